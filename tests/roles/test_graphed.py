"""MicroGraphs (klppo.roles.graphed): eager on a signature's first micro-batch, captured on its second,
replayed after; outputs and gradients equal to the eager step's; inputs read through static copies."""

from __future__ import annotations

import pytest
import torch

from klppo.roles.graphed import MicroGraphs, signature
from tests.roles.graph_fakes import FakeCapture


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _step(model):
    def step(ts):
        x, w = ts
        loss = (model(x).squeeze(-1) * w).sum()
        loss.backward()
        return [loss.detach(), torch.isfinite(loss)]

    return step


def _eager(model, x, w):
    for p in model.parameters():
        p.grad = None
    out = _step(model)([x, w])
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return [o.clone() for o in out], grads


def test_first_eager_second_captured_then_replayed_with_the_eager_results():
    model = _model()
    capture = FakeCapture()
    graphs = MicroGraphs(list(model.parameters()), capture=capture)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(5, 4, generator=g), torch.randn(5, generator=g)) for _ in range(4)]
    key = signature(list(batches[0]))
    for i, (x, w) in enumerate(batches):
        expected, grads = _eager(model, x, w)
        x_seen = x.clone()
        out = graphs.run(key, [x, w], _step(model))
        assert [float(o) for o in out] == [float(o) for o in expected]
        for p, gr in zip(model.parameters(), grads, strict=True):
            assert torch.equal(p.grad, gr)
        x.add_(100.0)  # the caller's tensors may change after the call: the graph read its own copies
        assert not torch.equal(x, x_seen)
        if i == 1:
            static_out, static_grads = out, [p.grad for p in model.parameters()]
        if i >= 1:  # a replay gives the graph's own tensors every time
            assert all(a is b for a, b in zip(out, static_out, strict=True))
            assert all(p.grad is s for p, s in zip(model.parameters(), static_grads, strict=True))
        for p in model.parameters():  # as the plain path's accumulation does
            p.grad = None
    assert graphs.num_eager == 1 and graphs.num_replays == 3
    assert len(capture.graphs) == 1 and capture.graphs[0].replays == 3


def test_a_new_signature_is_eager_first_and_the_graph_count_is_bounded():
    model = _model()
    capture = FakeCapture()
    graphs = MicroGraphs(list(model.parameters()), capture=capture, max_graphs=2)
    for rows in (2, 3, 4):
        for _ in range(3):
            x, w = torch.randn(rows, 4), torch.randn(rows)
            graphs.run(signature([x, w]), [x, w], _step(model))
            for p in model.parameters():
                p.grad = None
    # 2 and 3 rows: eager, captured, replayed; 4 rows: over the bound, eager every time
    assert len(capture.graphs) == 2 and graphs.num_replays == 4 and graphs.num_eager == 2 + 3
    assert capture.pools == [None, "fake-pool"]  # the second graph shares the first one's pool


def test_a_capture_refuses_accumulated_gradients():
    model = _model()
    graphs = MicroGraphs(list(model.parameters()), capture=FakeCapture())
    x, w = torch.randn(2, 4), torch.randn(2)
    key = signature([x, w])
    graphs.run(key, [x, w], _step(model))  # eager; its gradients are left on the parameters
    with pytest.raises(RuntimeError, match="no gradients"):
        graphs.run(key, [x, w], _step(model))


def test_signature_tells_shapes_dtypes_and_the_extra_key_apart():
    a = torch.zeros(2, 3)
    assert signature([a]) == signature([torch.ones(2, 3)])
    assert signature([a]) != signature([torch.zeros(3, 2)])
    assert signature([a]) != signature([a.double()])
    assert signature([a], extra=(1,)) != signature([a], extra=(2,))
