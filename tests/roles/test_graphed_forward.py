"""The no-grad passes as CUDA graphs (klppo.roles.graphed, ``fsdp_config.cuda_graph_update``): the actor's old
log-probs, the reference's log-probs and the critic's values, graphed == eager bit for bit with the CPU
stand-ins for capture (tests/roles/graph_fakes.py) over micro-batches of a repeated shape and new ones; the
refusals; a
failed capture and out of memory."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from klppo.roles.forward import ForwardPlan, MicroBatching
from klppo.roles.graphed import MicroGraphs, signature
from tests.roles.graph_fakes import FakeCapture, WarmupRecordingCapture
from tests.roles.test_graphed import _batch, _graph_actor, _graph_critic

# calls whose responses are all full (one packed shape per micro-batch of 2 rows), and calls 0 and 1 whose
# rows
# 1 and 5 are short (micro-batches of rows 0-1 and 4-5: two more shapes, met first mid-run)
CALLS = (2, 3, 0, 4, 1, 5)
KEY = "actor_rollout_ref.ref.fsdp_config.cuda_graph_update"


def test_forward_only_graphs_leave_gradients_alone_and_share_the_update_graphs_pool():
    """A forward-only MicroGraphs (no parameters) captures and replays a no-grad step without reading or
    setting any ``.grad``; sharing the update graphs' pool, its first capture sets the pool the update's next
    capture gets, and clearing either drops it for both."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    sentinels = [torch.full_like(p, 7.0) for p in model.parameters()]
    for p, s in zip(model.parameters(), sentinels, strict=True):
        p.grad = s
    update_capture, forward_capture = FakeCapture(), FakeCapture()
    update = MicroGraphs(list(model.parameters()), capture=update_capture)
    forward = MicroGraphs((), capture=forward_capture, what="a no-grad forward", shares_pool_with=update)
    x = torch.randn(3, 4)
    with torch.no_grad():
        outs = [forward.run(signature([x]), [x], lambda ts: [model(ts[0])])[0].clone() for _ in range(3)]
    assert all(torch.equal(o, model(x).detach()) for o in outs)
    assert forward.num_eager == 1 and forward.num_replays == 2
    assert all(p.grad is s for p, s in zip(model.parameters(), sentinels, strict=True))
    assert forward.pool == update.pool == "fake-pool"
    update.clear()
    assert forward.pool is None


def _old_log_probs(actor, graphed):
    """The old-log-prob pass of CALLS in micro-batches of 2 rows, an update after each (the weights change
    between passes; with graphs the update's graphs share the pass's pool)."""
    actor.settings = dataclasses.replace(actor.settings, log_prob_micro=MicroBatching(micro_batch_size=2))
    out = []
    for call in CALLS:
        out.append(actor.compute_log_prob(_batch(call)))
        actor.update_policy(_batch(call), kl_loss_coef=0.05)
    return out


@pytest.mark.parametrize("capture", [FakeCapture, WarmupRecordingCapture], ids=["rerun", "recorded"])
def test_graphed_old_log_probs_equal_eager_bit_for_bit(capture):
    """24 micro-batches of three shapes: each eager once, captured the second time, replayed after."""
    torch.set_num_threads(1)
    eager = _old_log_probs(_graph_actor(False)[0], False)
    forward_capture = capture()
    actor, update_capture = _graph_actor(True, capture=FakeCapture(), forward_capture=forward_capture)
    graphed = _old_log_probs(actor, True)
    assert all(torch.equal(g, e) for g, e in zip(graphed, eager, strict=True))
    graphs = actor.forward_graphs
    assert graphs.num_eager == 3 and graphs.num_replays == 21 and len(forward_capture.graphs) == 3
    # the pass captured first: the update's captures went into its pool
    assert forward_capture.pools[0] is None and set(update_capture.pools) == {forward_capture.pools[1]}


def _reference(graphed: bool, capture=None, *, use_remove_padding: bool = True, adapters_off: bool = False):
    from klppo.batching.attention import enable_packed_attention
    from klppo.models.tiny import build_tiny_model
    from klppo.parallel.plain import cast_params
    from klppo.roles.reference import Reference

    model = build_tiny_model(seed=0)
    enable_packed_attention(model)
    cast_params(model, torch.bfloat16)  # the plain path's reference: the compute copy alone
    ref = Reference(
        model,
        micro=MicroBatching(micro_batch_size=2),
        use_remove_padding=use_remove_padding,
        adapters_off=adapters_off,
        cuda_graph=graphed,
    )
    if graphed and capture is not None:
        ref.graphs = MicroGraphs((), capture=capture, key_name=KEY, what="a no-grad forward")
    return ref


def _ref_log_probs(ref):
    """CALLS' reference log-probs, every other call over a shared plan (as the old-log-prob pass hands it)."""
    out = []
    for i, call in enumerate(CALLS):
        b = _batch(call)
        plan = ForwardPlan.build(b, ref.micro, use_remove_padding=True) if i % 2 else None
        out.append(ref.compute_ref_log_prob(b, plan=plan))
    return out


@pytest.mark.parametrize("capture", [FakeCapture, WarmupRecordingCapture], ids=["rerun", "recorded"])
def test_graphed_reference_log_probs_equal_eager_bit_for_bit(capture):
    torch.set_num_threads(1)
    eager = _ref_log_probs(_reference(False))
    ref = _reference(True, capture())
    graphed = _ref_log_probs(ref)
    assert all(torch.equal(g, e) for g, e in zip(graphed, eager, strict=True))
    assert ref.graphs.num_eager == 3 and ref.graphs.num_replays == 21
    assert all(p.grad is None for p in ref.model.parameters())


def test_graphed_critic_values_equal_eager_bit_for_bit():
    """The values pass over CALLS in micro-batches of 2 rows, a critic update after each."""
    torch.set_num_threads(1)
    runs = {}
    for graphed in (False, True):
        critic = _graph_critic(graphed, forward_micro=2)
        out = []
        for call in CALLS:
            out.append(critic.compute_values(_batch(call)))
            b = _batch(call)
            b.values, b.returns = out[-1], out[-1] + 0.5 * b.response_mask
            critic.update_critic(b)
        runs[graphed] = (out, critic)
    (eager, _), (graphed, critic) = runs[False], runs[True]
    assert all(torch.equal(g, e) for g, e in zip(graphed, eager, strict=True))
    assert critic.forward_graphs.num_eager == 3 and critic.forward_graphs.num_replays == 21


def test_the_reference_refuses_graphs_it_cannot_capture():
    with pytest.raises(ValueError, match=rf"^{KEY}=true needs packed rows .*: set it to false$"):
        _reference(True, use_remove_padding=False)
    with pytest.raises(ValueError, match=rf"^{KEY}=true needs a reference model of its own"):
        _reference(True, adapters_off=True)
    assert _reference(False, use_remove_padding=False).graphs is None


def test_the_reference_key_is_checked_by_the_trainer_like_the_updates():
    """``ref.fsdp_config.cuda_graph_update`` is read (it was a 'not read' warning): refused without a GPU, and
    it reaches the reference's settings."""
    from klppo.assembly.roles_build import role_fsdp
    from klppo.assembly.settings import reference_settings
    from klppo.config import derive_sizes
    from klppo.config.loader import load_config

    cfg = load_config([f"{KEY}=true"])
    assert reference_settings(cfg, derive_sizes(cfg, 1)).cuda_graph
    assert not reference_settings(load_config([]), derive_sizes(load_config([]), 1)).cuda_graph
    with pytest.raises(
        ValueError, match=rf"^{KEY}=true needs a GPU \(trainer.device=cpu\): set it to false$"
    ):
        role_fsdp("reference", cfg.actor_rollout_ref.ref.fsdp_config, torch.device("cpu"))


def test_a_failed_forward_capture_runs_eagerly_and_says_so_once(caplog):
    def failing(step, static, params, *, pool=None):
        step(static)
        raise RuntimeError("operation not permitted when stream is capturing\nmore")

    torch.set_num_threads(1)
    eager = _ref_log_probs(_reference(False))
    ref = _reference(True, failing)
    caplog.set_level(logging.WARNING, logger="klppo")
    graphed = _ref_log_probs(ref)
    assert all(torch.equal(g, e) for g, e in zip(graphed, eager, strict=True))
    assert ref.graphs.num_replays == 0 and ref.graphs.num_eager == 24
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1
    assert messages[0].startswith(f"{KEY}: capturing a no-grad forward failed (RuntimeError: operation not")


def test_out_of_memory_in_the_old_log_prob_pass_drops_the_roles_graphs(monkeypatch):
    """Out of memory in the pass halves its micro-batch for the run: the retry drops the role's graphs (the
    pass's and the update's: one pool), recaptures the new shapes, and the log-probs still equal eager."""
    from klppo.roles import actor as actor_module

    torch.set_num_threads(1)
    real = actor_module.log_prob_pass
    before = []

    def run(actor):
        actor.oom.max_retries = 1
        calls = []

        def log_prob_pass(model, plan, **kwargs):
            calls.append(plan.micro.micro_batch_size)
            if len(calls) == 4:  # the fourth pass (call 4), once
                if actor.forward_graphs is not None:
                    before.extend(
                        [list(actor.forward_graphs._graphs.values()), list(actor.graphs._graphs.values())]
                    )
                raise torch.OutOfMemoryError("simulated")
            return real(model, plan, **kwargs)

        monkeypatch.setattr(actor_module, "log_prob_pass", log_prob_pass)
        out = _old_log_probs(actor, actor.forward_graphs is not None)
        assert calls[3:5] == [2, 1] and actor.oom.micro["log_prob"].micro_batch_size == 1
        return out

    eager = run(_graph_actor(False)[0])
    actor, _ = _graph_actor(True)
    graphed = run(actor)
    assert all(torch.equal(g, e) for g, e in zip(graphed, eager, strict=True))
    # by then the full micro-batches' shape was captured, for the pass and for the update
    assert [len(graphs) for graphs in before] == [1, 1]
    now = [*actor.forward_graphs._graphs.values(), *actor.graphs._graphs.values()]
    assert now and not any(g in graphs for g in now for graphs in before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_no_grad_passes_captured_on_cuda_match_eager():
    """Real CUDA-graph capture and replay of the actor's old-log-prob pass (its update graphed too, one pool)
    and of the reference's log-prob pass, bf16 compute, packed rows: equal to the eager passes up to the GPU
    kernels' run-to-run differences, stated as tolerances."""
    from tests.roles.test_graphed import _graph_actor as graph_actor

    def actor_pass(graphed):
        actor, _ = graph_actor(graphed, device="cuda")
        actor.settings = dataclasses.replace(actor.settings, log_prob_micro=MicroBatching(micro_batch_size=2))
        out = []
        for call in CALLS:
            out.append(actor.compute_log_prob(_batch(call, "cuda")))
            actor.update_policy(_batch(call, "cuda"), kl_loss_coef=0.05)
        return out, actor

    def reference_pass(graphed):
        ref = _reference(graphed)
        ref.model.cuda()
        return [ref.compute_ref_log_prob(_batch(call, "cuda")) for call in CALLS], ref

    for passes in (actor_pass, reference_pass):
        (eager, _), (graphed, role) = passes(False), passes(True)
        graphs = role.forward_graphs if passes is actor_pass else role.graphs
        assert graphs.num_replays == 21 and graphs.num_eager == 3 and not graphs.failed, passes.__name__
        for g, e in zip(graphed, eager, strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=2e-2)
