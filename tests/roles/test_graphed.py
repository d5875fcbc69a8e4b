"""MicroGraphs (klppo.roles.graphed): eager on a signature's first micro-batch, captured on its second,
replayed after; outputs and gradients equal to the eager step's; inputs read through static copies."""

from __future__ import annotations

import pytest
import torch

from klppo.parallel.fsdp import FSDPSettings
from klppo.roles.forward import MicroBatching
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


def test_a_failed_capture_falls_back_to_eager_once_and_says_so(caplog):
    import logging

    model = _model()
    calls = []

    def failing(step, static, params, *, pool=None):
        calls.append(1)
        step(static)  # the warm-up ran and left gradients, then the capture failed
        raise RuntimeError("operation not permitted when stream is capturing\nmore lines")

    graphs = MicroGraphs(
        list(model.parameters()), capture=failing, key_name="critic.model.fsdp_config.cuda_graph_update"
    )
    caplog.set_level(logging.WARNING, logger="klppo")
    x, w = torch.randn(3, 4), torch.randn(3)
    for _ in range(4):
        expected, grads = _eager(model, x, w)
        out = graphs.run(signature([x, w]), [x, w], _step(model))
        assert [float(o) for o in out] == [float(o) for o in expected]
        assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
        for p in model.parameters():
            p.grad = None
    assert len(calls) == 1 and graphs.num_eager == 4 and graphs.num_replays == 0
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith(
        "critic.model.fsdp_config.cuda_graph_update: capturing"
    )
    assert "operation not permitted when stream is capturing)" in messages[0]

    def out_of_memory(step, static, params, *, pool=None):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    graphs = MicroGraphs(list(model.parameters()), capture=out_of_memory)
    graphs.run(signature([x, w]), [x, w], _step(model))
    for p in model.parameters():
        p.grad = None
    with pytest.raises(torch.OutOfMemoryError):  # to the role's recovery
        graphs.run(signature([x, w]), [x, w], _step(model))
    assert graphs.failed is None


def test_signature_tells_shapes_dtypes_and_the_extra_key_apart():
    a = torch.zeros(2, 3)
    assert signature([a]) == signature([torch.ones(2, 3)])
    assert signature([a]) != signature([torch.zeros(3, 2)])
    assert signature([a]) != signature([a.double()])
    assert signature([a], extra=(1,)) != signature([a], extra=(2,))


# ---- the trained roles: graphed update == eager update, bit for bit (the capture replaced by the CPU
# stand-in)


def _graph_actor(
    graphed: bool,
    *,
    kl: bool = True,
    compute_dtype=torch.bfloat16,
    device: str = "cpu",
    capture=None,
    forward_capture=None,
):
    from klppo.batching.attention import enable_packed_attention
    from klppo.models.tiny import build_tiny_model
    from klppo.parallel.plain import plain_model
    from klppo.roles.actor import Actor, ActorSettings
    from tests.parallel import plain_worker as W  # the plain path's tiny actor (bf16 compute, fp32 masters)

    model = build_tiny_model(seed=0).to(device)
    enable_packed_attention(model)
    masters = plain_model(model, FSDPSettings(param_dtype=compute_dtype, reduce_dtype=torch.float32))
    settings = ActorSettings(
        mini_batch_size=4,
        update_micro=MicroBatching(micro_batch_size=2),
        grad_clip=W.GRAD_CLIP,
        use_kl_loss=kl,
        kl_loss_type="low_var_kl",
        entropy_coeff=0.01,
        use_remove_padding=True,
        cuda_graph_update=graphed,
    )
    actor = Actor(model, settings, W.OPTIM, masters=masters)
    capture = capture or FakeCapture()
    if graphed and device == "cpu":  # on CUDA the role's own MicroGraphs captures for real
        actor.graphs = MicroGraphs(list(model.parameters()), capture=capture)
        with_forward_capture(actor, forward_capture or FakeCapture())
    return actor, capture


def with_forward_capture(role, capture):
    """The role's no-grad pass graphs with the CPU stand-in ``capture``, in its update graphs' pool (as the
    role builds them)."""
    role.forward_graphs = MicroGraphs(
        (),
        capture=capture,
        key_name=role.forward_graphs.key_name,
        what="a no-grad forward",
        shares_pool_with=role.graphs,
    )


def _batch(call: int, device: str = "cpu"):
    from tests.parallel import plain_worker as W

    b = W.batch(call).to(device)
    if call == W.NAN_CALL:  # a finite batch here: the nan step is the plain path's test
        b.advantages = torch.nan_to_num(b.advantages)
    if call >= 2:  # every response full: both micro-batches of a mini-batch replay the same graph
        b.response_mask = torch.ones_like(b.response_mask)
    return b


def _graphed_equals_eager(run, capture):
    """``run(actor) -> metrics`` on the eager actor and on a graphed one (``capture()``: the stand-in for
    capture); metrics and masters equal bit for bit; returns the graphed actor."""
    runs = {}
    for graphed in (False, True):
        actor, _ = _graph_actor(graphed, capture=capture() if graphed else None)
        runs[graphed] = (run(actor), [m.detach().clone() for m in actor.masters.masters], actor)
    (m_e, w_e, _), (m_g, w_g, actor) = runs[False], runs[True]
    assert m_g == m_e
    assert all(torch.equal(a, b) for a, b in zip(w_g, w_e, strict=True))
    return actor


@pytest.mark.parametrize("recorded", [False, True], ids=["rerun", "recorded"])
@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, None], ids=["bf16", "fp32"])
def test_the_graphed_actor_update_equals_the_eager_one_bit_for_bit(compute_dtype, recorded):
    """Four update calls of 2 mini-batches × 2 micro-batches in bf16 compute with fp32 masters, a KL
    coefficient that changes every call (an input of the graph, not a constant): metrics, log-probs after
    each call and the masters equal. In fp32 (no compute copy) the first micro-batch's gradient must be
    copied into the master's, not taken: the graph writes that tensor again. ``recorded``: the capture
    replays recorded aten calls (as a CUDA graph, Python values frozen) after a warm-up; the three graphs
    then write one set of gradient tensors (the first allocates it, the others zero it and accumulate)."""
    from tests.roles.graph_fakes import WarmupRecordingCapture

    torch.set_num_threads(1)
    runs = {}
    for graphed in (False, True):
        capture = WarmupRecordingCapture() if recorded else None
        actor, capture = _graph_actor(graphed, compute_dtype=compute_dtype, capture=capture)
        out = []
        for call in range(4):
            metrics = actor.update_policy(_batch(call), kl_loss_coef=0.05 * (call + 1))
            out.append((metrics, actor.compute_log_prob(_batch(call + 1))))
        runs[graphed] = (out, [m.detach().clone() for m in actor.masters.masters], actor, capture)
    (eager, w_eager, _, _), (graphed, w_graphed, actor, capture) = runs[False], runs[True]
    for (m_e, lp_e), (m_g, lp_g) in zip(eager, graphed, strict=True):
        assert m_g == m_e
        assert torch.equal(lp_g, lp_e)
    assert all(torch.equal(a, b) for a, b in zip(w_graphed, w_eager, strict=True))
    # 16 micro-batches of three shapes: rows 0-1 and 4-5 of calls 0-1 (one short response each) and the full
    # ones (the other 12); each shape eager once, the rest replays
    assert len(capture.graphs) == 3 and actor.graphs.num_eager == 3 and actor.graphs.num_replays == 13
    if recorded:  # one set of gradient tensors for the three graphs
        first, *others = actor.graphs._graphs.values()
        assert all(g is not None for g in first.grads)
        assert all(a is b for c in others for a, b in zip(c.grads, first.grads, strict=True))
    assert eager[0][0]["actor/kl_coef"] == 0.05 and "actor/kl_loss" in eager[0][0]


def _graph_critic(graphed: bool, *, forward_micro: int = 8):
    from transformers import AutoModelForTokenClassification

    from klppo.batching.attention import enable_packed_attention
    from klppo.models.tiny import build_tiny_model
    from klppo.parallel.plain import plain_model
    from klppo.roles.critic import Critic, CriticSettings
    from klppo.roles.optim import OptimSettings

    config = build_tiny_model(seed=0).config
    config.num_labels, config.classifier_dropout = 1, 0.0  # as klppo's loader builds the critic
    torch.manual_seed(1)
    model = AutoModelForTokenClassification.from_config(config)
    enable_packed_attention(model)
    masters = plain_model(model, FSDPSettings(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    settings = CriticSettings(
        mini_batch_size=4,
        update_micro=MicroBatching(micro_batch_size=2),
        forward_micro=MicroBatching(micro_batch_size=forward_micro),
        use_remove_padding=True,
        cuda_graph_update=graphed,
    )
    critic = Critic(model, settings, OptimSettings(lr=1e-2, warmup_steps=1, total_steps=10), masters=masters)
    if graphed:
        critic.graphs = MicroGraphs(list(model.parameters()), capture=FakeCapture())
        with_forward_capture(critic, FakeCapture())
    return critic


def test_the_graphed_critic_update_equals_the_eager_one_bit_for_bit():
    torch.set_num_threads(1)
    runs = {}
    for graphed in (False, True):
        critic = _graph_critic(graphed)
        out = []
        for call in range(3):
            b = _batch(call)
            g = torch.Generator().manual_seed(call)
            b.values = torch.randn(b.response_mask.shape, generator=g) * b.response_mask
            b.returns = b.values + torch.randn(b.response_mask.shape, generator=g) * b.response_mask
            out.append((critic.update_critic(b), critic.compute_values(_batch(call + 1))))
        runs[graphed] = (out, [m.detach().clone() for m in critic.masters.masters], critic)
    (eager, w_eager, _), (graphed, w_graphed, critic) = runs[False], runs[True]
    for (m_e, v_e), (m_g, v_g) in zip(eager, graphed, strict=True):
        assert m_g == m_e and torch.equal(v_g, v_e)
    assert all(torch.equal(a, b) for a, b in zip(w_graphed, w_eager, strict=True))
    assert critic.graphs.num_replays == 12 - 3 and "critic/vf_loss" in eager[0][0]


def test_cuda_graph_update_refuses_what_it_cannot_capture():
    with pytest.raises(ValueError, match="use_remove_padding"):
        _graph_actor_settings(use_remove_padding=False)
    with pytest.raises(ValueError, match="kl_loss_type=full"):
        _graph_actor_settings(use_kl_loss=True, kl_loss_type="full")
    with pytest.raises(ValueError, match="plain path"):
        _graph_actor_settings(masters=False)
    for mode in ("clip_cov", "kl_cov"):  # a host read of the token count: a capture error mid-run otherwise
        with pytest.raises(ValueError, match=f"loss_mode={mode}"):
            _graph_actor_settings(loss_mode=mode)


def _graph_actor_settings(*, masters: bool = True, **kwargs):
    from klppo.models.tiny import build_tiny_model
    from klppo.parallel.plain import plain_model
    from klppo.roles.actor import Actor, ActorSettings
    from klppo.roles.optim import OptimSettings

    model = build_tiny_model(seed=0)
    m = plain_model(model, FSDPSettings()) if masters else None
    settings = ActorSettings(**{"use_remove_padding": True, "cuda_graph_update": True, **kwargs})
    return Actor(model, settings, OptimSettings(lr=1e-3), masters=m)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_actor_update_captured_on_cuda_matches_eager():
    """Real CUDA-graph capture and replay (bf16 compute, fp32 masters, packed rows): the metrics, log-probs
    and masters of four update calls against the eager run — equal up to the GPU kernels' own
    run-to-run differences (atomics in the attention backward), stated as tolerances."""
    runs = {}
    for graphed in (False, True):
        actor, _ = _graph_actor(graphed, device="cuda")
        out = []
        for call in range(4):
            metrics = actor.update_policy(_batch(call, "cuda"), kl_loss_coef=0.05 * (call + 1))
            out.append((metrics, actor.compute_log_prob(_batch(call + 1, "cuda"))))
        runs[graphed] = (out, [m.detach().clone() for m in actor.masters.masters], actor)
    (eager, w_eager, _), (graphed, w_graphed, actor) = runs[False], runs[True]
    assert actor.graphs.num_replays == 13 and actor.graphs.num_eager == 3
    for (m_e, lp_e), (m_g, lp_g) in zip(eager, graphed, strict=True):
        assert m_g.keys() == m_e.keys()
        for k in m_e:
            assert m_g[k] == pytest.approx(m_e[k], rel=1e-3, abs=1e-5), k
        torch.testing.assert_close(lp_g, lp_e, rtol=0, atol=2e-2)
    for a, b in zip(w_graphed, w_eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-3)


def test_a_plain_eager_update_whose_shapes_repeat_advises_cuda_graph_update_once(monkeypatch, caplog):
    """On a GPU (faked) with graphs off: the first update meets its shapes, the second repeats every one of
    them (full-length responses) and logs the advice naming the key; no second time. A micro-batch whose
    shape changes every call keeps the advice away; so does a CPU run."""
    import logging

    from klppo.roles import trained

    monkeypatch.setattr(trained, "_on_gpu", lambda batch: True)
    torch.set_num_threads(1)
    actor, _ = _graph_actor(False)
    caplog.set_level(logging.INFO, logger="klppo")
    advice = []
    for call in (2, 3, 4):
        actor.update_policy(_batch(call))
        advice.append([r.getMessage() for r in caplog.records if "cuda_graph_update=true" in r.getMessage()])
    assert [len(a) for a in advice] == [0, 1, 1]
    assert "actor_rollout_ref.actor.fsdp_config.cuda_graph_update=true" in advice[1][0]
    varied, _ = _graph_actor(False)
    caplog.clear()
    for call in (2, 3, 4):  # row 0's response a different length each call: its micro-batch never repeats
        b = _batch(call)
        b.response_mask[0, call:] = 0
        varied.update_policy(b)
    assert varied._shape_repeats == [3, 4] and not varied._advised_graphs
    monkeypatch.setattr(trained, "_on_gpu", lambda batch: False)
    cpu, _ = _graph_actor(False)
    for call in (2, 3):
        cpu.update_policy(_batch(call))
    assert not cpu._advised_graphs


def test_an_entropy_coefficient_changed_after_capture_reaches_the_replays():
    """The monitor's ``set_entropy_coeff`` replaces the actor's settings between updates; the graphs captured
    before must use the new coefficient (an input tensor, not the float read at capture). The capture here
    replays recorded aten calls (RecordingCapture), so a float baked in at capture would stay baked in."""
    import dataclasses

    from tests.roles.graph_fakes import RecordingCapture

    torch.set_num_threads(1)

    def run(actor):
        metrics = []
        for call in range(4):
            if call == 2:  # as RunControls.set_entropy_coeff does
                actor.settings = dataclasses.replace(actor.settings, entropy_coeff=5.0)
            metrics.append(actor.update_policy(_batch(call), kl_loss_coef=0.05 * (call + 1)))
        return metrics

    assert _graphed_equals_eager(run, RecordingCapture).graphs.num_replays == 13


def test_a_replay_attends_within_its_own_sequence_boundaries():
    """Micro-batches of the same shapes but other sequence lengths (other cu_seqlens values) replay one graph.
    The packed attention's block mask (sdpa_block on CPU, flex on CUDA in fp32) is cached per cu_seqlens
    tensor; the capture, after a warm-up on the same static tensor (WarmupRecordingCapture, as capture_cuda),
    must build the mask inside the graph rather than read the warm-up's: the graphed update equals the
    eager."""
    from tests.roles.graph_fakes import WarmupRecordingCapture

    torch.set_num_threads(1)
    lengths = [(6, 4), (5, 5), (4, 6), (3, 7)]  # per micro-batch of 2 rows: 10 tokens, other boundaries

    def batch(call):
        b = _batch(call)
        mask = torch.zeros_like(b.response_mask)
        for row in range(len(b)):
            mask[row, : lengths[(call + row // 2) % 4][row % 2]] = 1
        b.response_mask = mask
        return b

    def run(actor):
        return [actor.update_policy(batch(call), kl_loss_coef=0.05) for call in range(4)]

    assert _graphed_equals_eager(run, WarmupRecordingCapture).graphs.num_replays == 13


def test_an_out_of_memory_retry_drops_the_graphs_of_the_larger_micro_batches():
    """Out of memory mid-update halves the micro-batch for the rest of the run: the graphs captured for the
    old shapes never replay again and would hold their gradients, outputs and pool (and their slots of
    ``max_graphs``) for the run. The retry drops them; the update still equals the eager one."""
    torch.set_num_threads(1)
    before = []

    def run(actor):
        actor.oom.max_retries = 1
        real, failed = actor._accumulate, []

        def accumulate(*args, **kwargs):
            if len(failed) == 0 and args[3].micro_batch_size == 2 and actor.scheduler.last_epoch == 2:
                failed.append(1)
                raise torch.OutOfMemoryError("simulated")
            return real(*args, **kwargs)

        actor._accumulate = accumulate
        metrics = []
        for call in range(4):
            metrics.append(actor.update_policy(_batch(call), kl_loss_coef=0.05))
            if call == 1 and actor.graphs is not None:
                before.extend(actor.graphs._graphs.values())
        return metrics

    actor = _graphed_equals_eager(run, FakeCapture)
    assert actor.oom.micro["update"].micro_batch_size == 1 and len(before) == 3
    assert not any(g in before for g in actor.graphs._graphs.values())
