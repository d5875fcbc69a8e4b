"""Tensor-parallel rollout on gloo: 2 processes (TP = 2) give the greedy tokens of one process without
any parallelism and log-probs within 1e-5 (fp32), sampled log-probs normalised over the whole vocabulary
(float64 recomputation), each rank receives exactly its slices with a bounded peak; 4 processes
(TP = 2 × DP = 2) give what 2 data-parallel processes give."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import tp_worker as W  # noqa: E402

from klppo.parallel.dist import free_port  # noqa: E402
from klppo.rollout import make_rollout  # noqa: E402
from klppo.rollout.settings import EngineSettings
from tests.rollout.conftest import reference_log_probs  # noqa: E402


def _check_unsupported(out: Path, world: int) -> None:
    """A model the engine cannot run generates data-parallel on gathered weights (the engine's hf
    fallback), with a warning naming the key, and gives each rank what one process gives its prompts."""
    model = W.unsupported_model()
    hf = make_rollout("hf", EngineSettings(eos_token_ids=[2], pad_token_id=2))
    for r in range(world):
        got = torch.load(out / f"unsupported_rank{r}.pt", weights_only=False)
        assert any("tensor_model_parallel_size" in m and "hidden_act" in m for m in got["warnings"])
        prompts, mask = W.my_prompts(r, world)
        assert torch.equal(got["responses"], hf.generate(model, prompts, mask, W.GREEDY).responses)


def _check_compacted(out: Path, world: int, tp_size: int) -> None:
    """Slot compaction under tensor parallelism (``rollout.compact_slots=true``): the greedy tokens and
    log-probs of one process compacting alike, with slots moved (a group decodes its ranks' prompts
    together, so its ranks count the group's moves)."""
    model, moves = W.new_model(next(iter(W.CASES))), []
    for r in range(world):
        got = torch.load(out / f"compacted_rank{r}.pt", weights_only=False)
        prompts, mask = W.my_prompts(r, world)
        want = W.compact_engine().generate(model, prompts, mask, W.GREEDY)
        assert torch.equal(got["responses"], want.responses) and torch.equal(got["mask"], want.response_mask)
        torch.testing.assert_close(got["log_probs"], want.log_probs, rtol=0, atol=1e-5)
        assert want.stats["rollout/slot_moves"] > 0  # the reference compacts too
        moves.append(got["moves"])
    # moved, and every rank of a group moved its group's slots (groups decode different prompts)
    assert moves[0] > 0 and all(moves[r] == moves[r - r % tp_size] for r in range(world)), moves


def _check_hsdp(out: Path, world: int, tp_size: int) -> None:
    """Slices resharded from HSDP shards (every rank holds whole parameters) equal the full weights'."""
    from klppo.parallel.tp_layout import TPLayout

    case = next(iter(W.CASES))
    full = dict(W.new_model(case).named_parameters())
    layout = TPLayout.of(W.new_model(case).config, tp_size)
    for r in range(world):
        got = torch.load(out / f"hsdp_rank{r}.pt", weights_only=False)
        assert set(got) == set(full)
        for name, t in full.items():
            region = layout.region(name, t.shape, r % tp_size)
            want = t if region.dim is None else t.narrow(region.dim, region.start, region.stop - region.start)
            assert torch.equal(got[name], want.detach()), name


def _launch(tmp_path: Path, world: int, tp_size: int, rank_pool=None) -> dict[str, list[dict]]:
    """The ranks in the session's rank pool (2), or spawned for this launch (4)."""
    out = tmp_path / f"w{world}_tp{tp_size}"
    out.mkdir()
    args = (free_port(), world, tp_size, str(out))
    if rank_pool is not None and world <= rank_pool.size:
        rank_pool.run(W.main, *args, nprocs=world)
    else:
        mp.start_processes(W.main, args=args, nprocs=world, start_method="spawn")
    if tp_size > 1:
        _check_hsdp(out, world, tp_size)
        _check_unsupported(out, world)
        _check_compacted(out, world, tp_size)
    return {
        case: [torch.load(out / f"{case}_rank{r}.pt", weights_only=False) for r in range(world)]
        for case in W.CASES
    }


def _cat(ranks: list[dict], run: str, field: str) -> torch.Tensor:
    return torch.cat([r[run][field] for r in ranks])


@pytest.mark.slow
@pytest.mark.xdist_group("rank_pool")
def test_tp2_matches_one_process(tmp_path, rank_pool):
    runs = _launch(tmp_path, 2, 2, rank_pool)
    for case, ranks in runs.items():
        model = W.new_model(case)
        engine = make_rollout("klppo", EngineSettings(eos_token_ids=[2], pad_token_id=2))
        for r, got in enumerate(ranks):
            prompts, mask = got["prompts"], got["mask"]
            want = engine.generate(model, prompts, mask, W.GREEDY)
            assert torch.equal(got["greedy"]["responses"], want.responses), (case, r)
            assert torch.equal(got["greedy"]["mask"], want.response_mask), (case, r)
            torch.testing.assert_close(got["greedy"]["log_probs"], want.log_probs, rtol=0, atol=1e-5)
            assert got["greedy"]["mask"].sum() > 10  # not a test of empty responses
            for run, params in (("sampled", W.SAMPLED), ("top_k", W.TOP_K)):
                s = got[run]
                ref = reference_log_probs(
                    model, prompts, mask, s["responses"], s["mask"], params.temperature, params.n
                )
                torch.testing.assert_close(
                    s["log_probs"].double(), ref, rtol=0, atol=1e-5, msg=f"{case} {run}"
                )
                if params.top_k > 0:  # the truncated law's log-probs, every rank the group's first one's
                    args = (model, prompts, mask, s["responses"], s["mask"], params.temperature, params.n)
                    cut = reference_log_probs(*args, top_k=params.top_k, top_p=params.top_p)
                    torch.testing.assert_close(s["truncated_log_probs"].double(), cut, rtol=0, atol=1e-5)
                else:
                    assert s["truncated_log_probs"] is None
            assert got["greedy"]["stats"]["rollout/reshard_s"] > 0
            assert got["greedy"]["stats"]["rollout/fused_weights_gb"] == 0  # fused in place by the reshard
            # kept cache: the same result, then the moved weights' result (not the stale slices')
            torch.testing.assert_close(got["kept"]["first"], want.log_probs, rtol=0, atol=1e-5)
            moved = W.new_model(case)
            with torch.no_grad():
                for p in moved.parameters():
                    p.mul_(1.01)
            want_moved = engine.generate(moved, prompts, mask, W.GREEDY).log_probs
            torch.testing.assert_close(got["kept"]["second"], want_moved, rtol=0, atol=1e-5)
            assert not torch.allclose(want_moved, want.log_probs, rtol=0, atol=1e-3)
        # the two ranks drew their own samples of their own prompts
        assert not torch.equal(ranks[0]["sampled"]["responses"], ranks[1]["sampled"]["responses"])
        for got in ranks:
            re = got["reshard"]
            for name, t in re["expected"].items():
                assert torch.equal(re["tensors"][name], t), (case, name)
            # (1/TP + one FSDP unit) × the model, plus what a rank holds beyond an even 1/TP share: the
            # replicated norms (and KV heads, when fewer than TP), and 4 KiB of small bookkeeping tensors;
            # the peak must at least hold the slices
            replicated = re["slice_bytes"] - re["model_bytes"] / 2
            assert 0 <= replicated < (0.01 if "kv2" in case else 0.1) * re["model_bytes"]
            bound = re["model_bytes"] / 2 + re["largest_unit"] + replicated + 4096
            assert re["slice_bytes"] <= re["peak"] <= bound, (case, re["peak"], re["slice_bytes"], bound)


@pytest.mark.slow
@pytest.mark.skipif(
    (os.cpu_count() or 1) < 4 and not os.environ.get("KLPPO_TEST_4_RANKS"),
    reason="4 processes on fewer than 4 cores take minutes (KLPPO_TEST_4_RANKS=1 runs it)",
)
def test_tp2_dp2_matches_dp2(tmp_path):
    four = _launch(tmp_path, 4, 2)
    two = _launch(tmp_path, 2, 1)
    for case in W.CASES:
        for field in ("responses", "mask"):
            assert torch.equal(_cat(four[case], "greedy", field), _cat(two[case], "greedy", field)), (
                case,
                field,
            )
        torch.testing.assert_close(
            _cat(four[case], "greedy", "log_probs"), _cat(two[case], "greedy", "log_probs"), rtol=0, atol=1e-5
        )
