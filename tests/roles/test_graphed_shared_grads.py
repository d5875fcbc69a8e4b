"""The role's graphs share one set of gradient tensors: a parameter the first graph gives a gradient but a
later graph's step does not reach must read as no gradient (None) after that graph's replay, as eagerly —
not the shared tensor zeroed (AdamW would then decay it and count a step)."""

import torch

from klppo.roles.graphed import MicroGraphs, signature
from tests.roles.graph_fakes import WarmupRecordingCapture


def test_a_parameter_a_later_graph_does_not_reach_has_no_gradient_after_its_replay():
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(3))
    graphs = MicroGraphs([a, b], capture=WarmupRecordingCapture())

    def step_for(use_b: bool):
        def step(ts):
            loss = (ts[0] * a).sum() + ((ts[0] * b).sum() if use_b else 0)
            loss.backward()
            return [loss.detach()]

        return step

    x = torch.ones(3)
    seen = {}
    for use_b in (True, True, True, False, False, False):  # eager, capture, replay per key
        key = signature([x], extra=use_b)
        graphs.run(key, [x * (2 if use_b else 3)], step_for(use_b))
        seen[use_b] = (a.grad.clone(), None if b.grad is None else b.grad.clone())
        a.grad = b.grad = None
    assert graphs.num_replays == 4
    assert all(torch.equal(g, torch.full((3,), 2.0)) for g in seen[True])
    assert torch.equal(seen[False][0], torch.full((3,), 3.0))
    assert seen[False][1] is None  # eagerly: b got no gradient
