"""The one-GPU path without FSDP2 (``fsdp_config.plain_single_gpu``, klppo/parallel/plain.py) against FSDP2,
the checks of plain_worker.py run inside test_fsdp.py's two launches (gloo on CPU, worlds of 1 and 2: no
spawn of their own).

Bitwise against FSDP2 on one rank, in mixed precision (bf16 compute, fp32 reduce and masters): the forward
sees the same bf16 values (FSDP2's per-forward cast and the plain path's copy after each step both round
the fp32 master to nearest even), each micro-batch's bf16 gradient reaches the fp32 master gradient by the
same exact cast and fp32 add, and the clip and AdamW run the same arithmetic on the same fp32 tensors, so
any difference is a bug. Across world sizes only the resumed *state* is bitwise; a continued trajectory on
2 ranks differs from 1 rank's by bf16 rounding of differently split gradients, which AdamW's normalised
step turns into up to ~lr per element (observed: mean |Δw| ≤ 2.2e-3 per tensor, log-probs ≤ 7e-3; an
optimizer state lost on resume gives 1.5e-2), hence the tolerances there.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import plain_worker as W  # noqa: E402
from tree_compare import assert_same as _assert_same  # noqa: E402

from klppo.parallel.checkpoint import load_checkpoint  # noqa: E402
from klppo.roles.forward import MicroBatching  # noqa: E402

# the checks marked slow run inside test_fsdp.py's launches (conftest's fsdp_runs: a world of 1, then of 2);
# the others here, in this process (the plain path needs no process group)
pytestmark = [pytest.mark.xdist_group("rank_pool")]
MEAN_TOL, LOG_PROB_TOL = 5e-3, 3e-2  # across world sizes (module docstring)


@pytest.fixture(scope="module")
def runs(fsdp_runs) -> dict:
    return {1: fsdp_runs["one"]["plain"], 2: fsdp_runs["two"]["plain"], "out": fsdp_runs["out"]}


def assert_same(got, want) -> None:
    """Equal trees, tensors bit for bit; nan floats equal (the runs record a nan-skipped step's loss)."""
    _assert_same(got, want, nan_floats=True)


def assert_near(got: dict, want: dict) -> None:
    """Model weights within MEAN_TOL in mean absolute difference, tensor by tensor."""
    assert got.keys() == want.keys()
    for k in want:
        assert (got[k] - want[k]).abs().mean() <= MEAN_TOL, k


@pytest.mark.slow
def test_plain_equals_fsdp2_on_one_rank_bit_for_bit(runs):
    fsdp, plain = runs[1]["fsdp"], runs[1]["plain"]
    # losses, statistics, gradient norms, learning rates and the next rows' log-probs of every update call
    assert_same(plain["calls"], fsdp["calls"])
    # the checkpointed state: fp32 weights under the model's names, AdamW's moments and step
    assert_same(plain["state"], fsdp["state"])
    assert plain["skipped"] == fsdp["skipped"] == 2


@pytest.mark.slow
def test_the_run_clips_skips_and_computes_in_bf16(runs):
    """What the equality above covers: steps the clip scales, a step skipped for a nan loss and one for an
    infinite gradient norm (finite loss), bf16 compute."""
    plain = runs[1]["plain"]
    norms = [c["metrics"]["actor/grad_norm"] for c in plain["calls"]]
    assert sum(n > W.GRAD_CLIP for n in norms if n == n) >= 2  # clipped (grad_norm: the mean over 2 steps)
    assert norms[W.NAN_CALL] != norms[W.NAN_CALL]  # the nan call: its step skipped (counted above)
    assert plain["calls"][W.NAN_CALL]["metrics"]["actor/num_skipped_updates"] == 1.0
    inf_call = plain["calls"][W.INF_CALL]["metrics"]  # a finite loss, a non-finite gradient norm: skipped
    assert math.isfinite(inf_call["actor/pg_loss"]) and not math.isfinite(inf_call["actor/grad_norm"])
    assert inf_call["actor/num_skipped_updates"] == 2.0
    assert plain["dtypes"] == ["torch.bfloat16"] and plain["compute_is_master_cast"]
    assert plain["state"]["model"]["model.embed_tokens.weight"].dtype == torch.float32


@pytest.mark.slow
def test_default_config_takes_the_plain_path_on_one_process_and_fsdp2_on_two(runs):
    assert runs[1]["path_taken"] == {"plain": True, "masters": True, "fsdp_modules": 0, "dtensor_params": 0}
    two = runs[2]["path_taken"]
    assert not two["plain"] and not two["masters"] and two["fsdp_modules"] > 0 and two["dtensor_params"] > 0


@pytest.mark.slow
def test_plain_checkpoint_resumes_under_fsdp2_on_two_ranks(runs):
    one, two = runs[1], runs[2]
    # loaded on 2 ranks: the state the plain path saved, bit for bit; and the same as FSDP2's own (world 1)
    assert_same(two["from_plain"]["loaded"], one["plain"]["state"])
    # continued on 2 ranks: the same update whichever path wrote the checkpoint
    assert_same(two["from_plain"]["calls"], two["from_fsdp"]["calls"])
    assert_same(two["from_plain"]["state"], two["from_fsdp"]["state"])
    # and near the plain path's own continuation on 1 rank (rank 0's rows of it)
    assert_near(two["from_plain"]["state"]["model"], one["plain"]["continued"]["state"]["model"])
    rows = W.rank_rows(0, 2)
    got, want = two["from_plain"]["calls"][0]["log_probs"], one["plain"]["continued"]["calls"][0]["log_probs"]
    torch.testing.assert_close(got, want[rows], rtol=0, atol=LOG_PROB_TOL)


@pytest.mark.slow
def test_fsdp2_checkpoint_of_two_ranks_resumes_on_the_plain_path(runs):
    """Back: the 2-rank FSDP2 checkpoint loaded here, on the plain path with no process group."""
    ckpts, two = runs["out"] / "plain", runs[2]["from_plain"]
    actor = W.new_actor("plain", 1)
    load_checkpoint(ckpts / "fsdp_w2", actor.state_model, actor.optimizer)
    actor.load_extra_state(torch.load(ckpts / "fsdp_w2_extra.pt", weights_only=False))
    assert_same(W.state(actor), two["state"])
    assert all(torch.equal(p, m.to(p.dtype)) for p, m in zip(actor.masters.params, actor.masters.masters))
    calls = W.run_calls(actor, range(W.CALLS + 1, W.CALLS + 2), 0, 1)
    assert_near(W.state(actor)["model"], two["second"]["state"]["model"])
    want = two["second"]["calls"][0]["log_probs"]
    torch.testing.assert_close(calls[0]["log_probs"][W.rank_rows(0, 2)], want, rtol=0, atol=LOG_PROB_TOL)


def _oom_once_after_a_backward(actor) -> dict:
    """The actor's 2nd micro-batch of its first update raises out of memory after a backward of its own loss
    (the compute-dtype gradients an aborted backward leaves behind), once."""
    real, seen = actor._micro_loss, {"calls": 0}

    def micro_loss(mb, *args):
        seen["calls"] += 1
        terms, stats = real(mb, *args)
        if seen["calls"] == 2:
            sum(term for term, _ in terms).backward()
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return terms, stats

    actor._micro_loss = micro_loss
    actor.oom.max_retries = 1
    return seen


def test_a_retry_after_out_of_memory_starts_from_no_gradients():
    """The retried mini-batch (micro-batches halved to 1 row) gives the update of a run that had micro-batches
    of 1 row from the start: the aborted pass's gradients, on the model and on the masters, are dropped."""
    torch.set_num_threads(1)
    retried = W.new_actor("plain", 1)
    seen = _oom_once_after_a_backward(retried)
    W.run_calls(retried, range(2), 0, 1)
    assert seen["calls"] > 2 and retried.oom.micro["update"].micro_batch_size == 1
    clean = W.new_actor("plain", 1)
    clean.oom.micro["update"] = MicroBatching(micro_batch_size=1)
    W.run_calls(clean, range(2), 0, 1)
    assert_same(W.state(retried), W.state(clean))


def test_masters_are_the_optimizers_and_the_checkpoints_parameters():
    """The optimizer steps the masters; the checkpoint's model state is theirs, under the model's names (the
    tied embedding and LM head once each, as in the model's state dict); the model computes in bf16."""
    actor = W.new_actor("plain", 1)
    model, masters = actor.model, actor.masters
    optimized = [p for g in actor.optimizer.param_groups for p in g["params"]]
    assert [id(p) for p in optimized] == [id(m) for m in masters.masters]
    assert actor.state_model.state_dict().keys() == model.state_dict().keys()
    names = dict(actor.state_model.named_parameters())
    assert names.keys() == dict(model.named_parameters()).keys()
    assert all(m.dtype == torch.float32 for m in names.values())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert actor.resident is masters and actor.state_model is masters.module


def test_a_gradient_wider_than_its_master_is_cast_before_it_is_added():
    """FSDP2's one-rank reduce casts to the master dtype, then adds: fp32 compute over bf16 masters rounds
    each micro-batch's gradient to bf16 before the sum (not the sum after an fp32 add)."""
    from klppo.parallel.plain import MasterWeights

    model = torch.nn.Linear(64, 1, bias=False).to(torch.bfloat16)  # the loaded (master) dtype: bf16
    masters = MasterWeights(model, param_dtype=torch.float32, reduce_dtype=torch.float32)
    (p,), (m,) = masters.params, masters.masters
    # 1 + 2⁻⁸·(1 + 2⁻¹⁰): cast first, 2⁻⁸ lands on the tie between two bf16 neighbours of 1 and rounds to
    # even (1.0); added in fp32 first, it lies above the tie and rounds up (1 + 2⁻⁷)
    first, second = torch.ones(1, 64), torch.full((1, 64), 2.0**-8 * (1 + 2.0**-10))
    for grad in (first, second):
        p.grad = grad.clone()
        masters.accumulate_grads()
    assert m.grad.dtype == torch.bfloat16
    assert torch.equal(m.grad, first.to(torch.bfloat16) + second.to(torch.bfloat16))


def test_a_gradient_as_wide_as_its_master_in_another_dtype_is_cast_before_it_is_added():
    """fp16 compute and reduce over bf16 masters: FSDP2 casts each reduced gradient to bf16, then adds;
    a foreach add of fp16 into bf16 would add in fp32 and round once (the tie below rounds the other way)."""
    from klppo.parallel.plain import MasterWeights

    model = torch.nn.Linear(64, 1, bias=False).to(torch.bfloat16)
    masters = MasterWeights(model, param_dtype=torch.float16, reduce_dtype=torch.float16)
    (p,), (m,) = masters.params, masters.masters
    first, second = torch.ones(1, 64), torch.full((1, 64), 2.0**-8 * (1 + 2.0**-10))
    for grad in (first, second):
        p.grad = grad.to(torch.float16)
        masters.accumulate_grads()
    assert m.grad.dtype == torch.bfloat16
    expected = first.to(torch.float16).to(torch.bfloat16) + second.to(torch.float16).to(torch.bfloat16)
    assert torch.equal(m.grad, expected)
