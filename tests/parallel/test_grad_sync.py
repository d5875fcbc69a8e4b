"""Gradient sync once per mini-batch (``grad_sync_per_mini_batch``) against FSDP2's per-micro-batch sync, on
1 and 2 gloo ranks, for the actor and the critic (fp32): the gradients each optimizer step sees and the
weights after the update agree (only the summation order differs: Σ_micro then reduce vs reduce then Σ),
the reduce-scatters of a mini-batch go from one per unit and micro-batch to one per unit, and a checkpoint
written after such an update resumes to the same weights."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import grad_sync_worker as W  # noqa: E402

from klppo.parallel.dist import free_port  # noqa: E402

# slow: two launches (~20 s on 2 busy cores), a module fixture run once in the session's rank pool
# (tests/rank_pool.py) of the xdist worker that runs the group
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rank_pool")]

ROLES = ("actor", "critic")
UNITS = W.NUM_LAYERS + 1  # one per decoder layer + the root


@pytest.fixture(scope="module")
def runs(tmp_path_factory, rank_pool) -> dict[int, dict]:
    out = tmp_path_factory.mktemp("grad_sync")
    for world in (1, 2):
        rank_pool.run(W.main, world, free_port(), str(out), nprocs=world)
    return {world: torch.load(out / f"grad_sync_{world}.pt", weights_only=False) for world in (1, 2)}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("role", ROLES)
def test_same_gradients_and_weights(runs, world, role):
    per_micro, per_mini = runs[world][(role, False)], runs[world][(role, True)]
    assert len(per_micro["grads"]) == len(per_mini["grads"]) == W.ROWS // W.MINI_ROWS  # both steps taken
    for g_micro, g_mini in zip(per_micro["grads"], per_mini["grads"]):
        _close(g_mini, g_micro)
        assert max(g.abs().max().item() for g in g_micro.values()) > 1e-3  # not a comparison of zeros
    _close(per_mini["weights"], per_micro["weights"])
    assert per_mini["grad_norm"] == pytest.approx(per_micro["grad_norm"], rel=1e-5)


@pytest.mark.parametrize("role", ROLES)
def test_two_ranks_match_one(runs, role):
    """The deferred sync on 2 ranks gives the 1-rank update (the global mini-batch's gradient)."""
    _close(runs[2][(role, True)]["weights"], runs[1][(role, False)]["weights"])


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("role", ROLES)
def test_one_reduce_per_unit_and_mini_batch(runs, world, role):
    """FSDP2 reduces each unit's gradients once per backward by default; deferred, once per mini-batch.
    On 2 ranks each reduction is a reduce-scatter (on 1 rank FSDP2 copies instead)."""
    minis = W.ROWS // W.MINI_ROWS
    micro_per_mini = W.MINI_ROWS // world  # micro-batches of one row
    per_micro, per_mini = runs[world][(role, False)]["calls"], runs[world][(role, True)]["calls"]
    assert per_micro["foreach_reduce"] == UNITS * micro_per_mini * minis
    assert per_mini["foreach_reduce"] == UNITS * minis
    expected_rs = (per_micro["foreach_reduce"], per_mini["foreach_reduce"]) if world > 1 else (0, 0)
    assert (per_micro["reduce_scatter"], per_mini["reduce_scatter"]) == expected_rs
    # the all-gathers and all-reduces are untouched by the switch
    for name in ("all_gather", "all_reduce"):
        assert per_micro[name] == per_mini[name], name


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("role", ROLES)
def test_checkpoint_resume_and_sync_restored(runs, world, role):
    case = runs[world][(role, True)]
    assert case["sync_restored"]  # FSDP2's per-backward sync is back after the update
    for k, v in case["second"].items():
        torch.testing.assert_close(case["second_resumed"][k], v, rtol=0, atol=0, msg=k)
