"""The optimizer step and the gradient clip on the DTensors' local shards (``fsdp_config.local_shard_optim``)
against the DTensor path and a float64 AdamW + clip, FSDP2 on gloo worlds of 1 and 2 processes (the checks,
local_shards_worker.py, run inside test_fsdp.py's two launches: no spawn of their own).

Bitwise, not a tolerance, against the DTensor path: on CPU both run torch's single-tensor AdamW (torch's
default picks foreach only for CUDA tensors) on the same shard values, and the norm is the
same arithmetic (per-tensor norms of the shards, their norm, squared, summed over the group, square root),
so any difference is a bug. The float64 reference (AdamW's formula written out, fed the recorded fp32 full
gradients) agrees to rtol 1e-6: fp32 rounding of four steps.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import local_shards_worker as W  # noqa: E402
from tree_compare import assert_same  # noqa: E402

from klppo.parallel.local_shards import LocalShardAdam, LocalShardAdamW  # noqa: E402
from klppo.roles.optim import OptimSettings, build_optimizer  # noqa: E402

# the checks run inside test_fsdp.py's launches (conftest's fsdp_runs: a world of 1, then of 2)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rank_pool")]
WORLDS = (1, 2)


@pytest.fixture(scope="module")
def runs(fsdp_runs) -> dict:
    return {1: fsdp_runs["one"]["local_shards"], 2: fsdp_runs["two"]["local_shards"]}


def float64_adamw(run: dict) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Clip to MAX_NORM then decoupled-weight-decay AdamW, written out in float64 on the recorded
    gradients."""
    (beta1, beta2), decay, eps = W.OPTIM.betas, W.OPTIM.weight_decay, 1e-8
    params = {k: v.double() for k, v in run["initial"].items()}
    m = {k: torch.zeros_like(v) for k, v in params.items()}
    v = {k: torch.zeros_like(x) for k, x in params.items()}
    norms = []
    for t, (grads, lr) in enumerate(zip(run["grads"], run["lrs"]), start=1):
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        norms.append(norm)
        coef = min(1.0, W.MAX_NORM / (norm + 1e-6))
        for k, g in grads.items():
            g = g.double() * coef
            params[k] = params[k] * (1 - lr * decay)
            m[k] = beta1 * m[k] + (1 - beta1) * g
            v[k] = beta2 * v[k] + (1 - beta2) * g * g
            m_hat, v_hat = m[k] / (1 - beta1**t), v[k] / (1 - beta2**t)
            params[k] = params[k] - lr * m_hat / (v_hat.sqrt() + eps)
    return norms, params


@pytest.mark.parametrize("world", WORLDS)
def test_local_shards_equal_the_dtensor_path_bit_for_bit(runs, world):
    local, dtensor = runs[world]["runs"]["local"], runs[world]["runs"]["dtensor"]
    assert (local["class"], dtensor["class"]) == ("LocalShardAdamW", "AdamW")
    # the fast path was taken (equal results alone would not say so: a fallback gives them too)
    assert local["step_lists"] == [False] * W.STEPS and dtensor["step_lists"] == [True] * W.STEPS
    assert local["clip_local"] == [True] * W.STEPS
    assert local["lrs"] == dtensor["lrs"] and len(set(local["lrs"])) == 2  # the scheduler acted
    assert_same(local["norms"], dtensor["norms"])
    assert_same(local["grads"], dtensor["grads"])
    # parameters and optimizer state as DCP sees them: same keys, DTensors with the same placements
    assert_same(local["state"], dtensor["state"])
    state = local["state"]["optim"]["state"]
    assert state["0.weight"]["exp_avg"][0] == "DTensor" and "0.bias" not in state  # frozen: no state


@pytest.mark.parametrize("world", WORLDS)
def test_clip_and_adamw_match_float64(runs, world):
    run = runs[world]["runs"]["local"]
    norms, want = float64_adamw(run)
    assert [float(n) for n in run["norms"]] == pytest.approx(norms, rel=1e-6)
    assert norms[0] > W.MAX_NORM  # clipping acted
    assert norms[W.SMALL_STEP] < W.MAX_NORM  # and a step under the bound was left as it was (coefficient 1)
    model = run["state"]["model"]
    for k, w in want.items():
        got = model[k][2]
        torch.testing.assert_close(got.double(), w, rtol=1e-6, atol=1e-7, msg=k)
        if k != "0.bias":
            assert not torch.equal(got, run["initial"][k]), k  # trained, so the comparison says something
    assert torch.equal(model["0.bias"][2], run["initial"]["0.bias"])  # frozen


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_gradients_as_on_the_dtensor_path(runs, world, value):
    """The norm is returned as is; the gradients are multiplied by nan (nan) or 0 (inf), as before."""
    got = runs[world][value]
    assert_same(got["local"], got["dtensor"])
    norm = float(got["local"]["norm"])
    assert math.isnan(norm) if value == "nan" else norm == math.inf


@pytest.mark.parametrize("world", WORLDS)
def test_checkpoints_load_across_the_two_paths(runs, world):
    result = runs[world]
    local, dtensor = result["runs"]["local"]["state"], result["runs"]["dtensor"]["state"]
    assert_same(result["cross"]["local_into_dtensor"], local)
    assert_same(result["cross"]["dtensor_into_local"], dtensor)


def test_world_of_one_checkpoint_resumes_on_two_ranks(runs):
    assert_same(runs[2]["from_w1"], runs[1]["runs"]["local"]["state"])


def test_build_optimizer_switch_and_plain_tensors():
    """Torch's Adam/AdamW get the local-shard class (other classes unchanged); on plain
    tensors it is torch's AdamW exactly."""
    params = [
        torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(i))) for i in range(2)
    ]
    assert type(build_optimizer(params, OptimSettings())) is LocalShardAdamW
    assert type(build_optimizer(params, OptimSettings(optimizer="Adam"))) is LocalShardAdam
    assert type(build_optimizer(params, OptimSettings(optimizer="SGD"))) is torch.optim.SGD
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    mine, torchs = LocalShardAdamW(params, lr=0.1), torch.optim.AdamW(copies, lr=0.1)
    for _ in range(2):
        for ps, opt in ((params, mine), (copies, torchs)):
            for p in ps:
                p.grad = p.detach() ** 2
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, copies))
    assert_same(mine.state_dict(), torchs.state_dict())
