"""Rank programs for tests/rollout/test_tp.py (spawned, gloo on CPU): the tiny model FSDP2-sharded over
all ranks, rollout tensor-parallel groups of ``tp`` ranks; each rank writes its rows and figures to
``out_dir`` and the assertions run in the pytest process against one process without any parallelism."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

from klppo.models.tiny import build_tiny_model
from klppo.parallel.fsdp import FSDPSettings, build_mesh, gathered_params, shard_model
from klppo.parallel.mesh import build_rollout_mesh
from klppo.parallel.reshard import fsdp_unit_params
from klppo.rollout import SamplingParams, make_rollout
from klppo.rollout.settings import EngineSettings
from tests.rollout.conftest import left_padded

PROMPTS = [
    [1, 10, 20, 30, 40, 50],
    [1, 7, 8],
    [1, 99, 100, 101, 102],
    [5],
    [3, 4, 5, 6, 7, 8, 9, 10, 11],
    [9, 8, 7],
    [200, 201],
    [1, 2, 3, 4],
]
CASES = {  # name -> tiny model arguments
    "qwen2_kv2_tied": dict(arch="qwen2", num_heads=4, num_kv_heads=2),  # q/k/v bias, one KV head per rank
    "qwen3_kv1_untied_odd_vocab": dict(
        arch="qwen3", num_heads=4, num_kv_heads=1, tie_word_embeddings=False, vocab_size=383
    ),  # q/k norm, KV head replicated, uneven vocab split
}
GREEDY = SamplingParams(max_new_tokens=12, n=2, do_sample=False)
SAMPLED = SamplingParams(max_new_tokens=12, n=2, temperature=0.7, seed=5)
TOP_K = SamplingParams(max_new_tokens=8, n=1, temperature=0.9, top_k=20, top_p=0.9, seed=6)


def new_model(case: str) -> torch.nn.Module:
    return build_tiny_model(num_layers=3, seed=0, **CASES[case]).eval()


def my_prompts(rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's contiguous share of PROMPTS, left-padded to its own longest prompt."""
    per = len(PROMPTS) // world
    return left_padded(PROMPTS[rank * per : (rank + 1) * per])


def main(rank: int, port: int, world: int, tp_size: int, out_dir: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        tp = build_rollout_mesh(tp_size, "cpu")
        for case in CASES:
            _run(rank, world, tp, case, Path(out_dir))
        if tp is not None:
            _hsdp(rank, world, tp, Path(out_dir))
            _unsupported(rank, world, tp, Path(out_dir))
            _compacted(rank, world, tp, Path(out_dir))
    finally:
        dist.destroy_process_group()


def _run(rank: int, world: int, tp, case: str, out: Path) -> None:
    model = new_model(case)
    shard_model(model, FSDPSettings(), build_mesh(world, -1, "cpu"))
    engine = make_rollout(
        "klppo",
        EngineSettings(eos_token_ids=[2], pad_token_id=2, max_num_seqs=5, eos_check_every=4),
        tensor_parallel=tp,
    )
    prompts, mask = my_prompts(rank, world)
    results: dict = {"prompts": prompts, "mask": mask}
    for name, params in (("greedy", GREEDY), ("sampled", SAMPLED), ("top_k", TOP_K)):
        if tp is None:
            with gathered_params(model):
                o = engine.generate(model, prompts, mask, params)
        else:
            o = engine.generate(model, prompts, mask, params)
        results[name] = {
            "responses": o.responses,
            "mask": o.response_mask,
            "log_probs": o.log_probs,
            "truncated_log_probs": o.truncated_log_probs,
            "stats": o.stats,
        }
    if tp is not None:
        # an engine keeping its cache: the second call reshards into the first call's tensors
        kept = make_rollout(
            "klppo",
            EngineSettings(eos_token_ids=[2], pad_token_id=2, eos_check_every=4, free_cache_engine=False),
            tensor_parallel=tp,
        )
        first = kept.generate(model, prompts, mask, GREEDY)
        with torch.no_grad():  # the weights move (as after an update): the kept slices must follow
            for p in model.parameters():
                p.to_local().mul_(1.01)
        second = kept.generate(model, prompts, mask, GREEDY)
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().div_(1.01)
        kept.release()
        results["kept"] = {"first": first.log_probs, "second": second.log_probs}
        results["reshard"] = _measure_reshard(model, tp)
    torch.save(results, out / f"{case}_rank{rank}.pt")


COMPACT_EOS = list(range(2, 60))  # many ids end a sequence: lengths spread, slots move


def compact_engine(tp=None):
    return make_rollout(
        "klppo",
        EngineSettings(
            eos_token_ids=COMPACT_EOS,
            pad_token_id=2,
            eos_check_every=1,
            compact_slots=True,
            compact_min_bucket=2,
        ),
        tensor_parallel=tp,
    )


def _compacted(rank: int, world: int, tp, out: Path) -> None:
    """Slot compaction under the tensor-parallel rollout: every rank of a group moves the same slots."""
    model = new_model(next(iter(CASES)))
    shard_model(model, FSDPSettings(), build_mesh(world, -1, "cpu"))
    prompts, mask = my_prompts(rank, world)
    o = compact_engine(tp).generate(model, prompts, mask, GREEDY)
    torch.save(
        {
            "responses": o.responses,
            "mask": o.response_mask,
            "log_probs": o.log_probs,
            "moves": o.stats["rollout/slot_moves"],
        },
        out / f"compacted_rank{rank}.pt",
    )


def unsupported_model() -> torch.nn.Module:
    """A model the engine cannot run (gelu MLP): the tensor-parallel rollout falls back."""
    model = new_model(next(iter(CASES)))
    model.config.hidden_act = "gelu_pytorch_tanh"
    for layer in model.model.layers:  # the MLP's activation was built from the config at construction
        layer.mlp.act_fn = torch.nn.GELU(approximate="tanh")
    return model


def _unsupported(rank: int, world: int, tp, out: Path) -> None:
    import warnings

    model = unsupported_model()
    shard_model(model, FSDPSettings(), build_mesh(world, -1, "cpu"))
    engine = make_rollout("klppo", EngineSettings(eos_token_ids=[2], pad_token_id=2), tensor_parallel=tp)
    prompts, mask = my_prompts(rank, world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = engine.generate(model, prompts, mask, GREEDY)
    messages = [str(w.message) for w in caught]
    torch.save({"responses": got.responses, "warnings": messages}, out / f"unsupported_rank{rank}.pt")


def _hsdp(rank: int, world: int, tp, out: Path) -> None:
    """The reshard from HSDP shards (``fsdp_size=1``: each rank's replica group is itself): its slices."""
    from klppo.parallel.tp_weights import reshard_for_rollout

    case = next(iter(CASES))
    model = new_model(case)
    shard_model(model, FSDPSettings(fsdp_size=1), build_mesh(world, 1, "cpu"))
    torch.save(reshard_for_rollout(model, tp, device=torch.device("cpu")), out / f"hsdp_rank{rank}.pt")


def _measure_reshard(model, tp) -> dict:
    """This rank's slices against the full weights, and the peak tensor bytes the reshard allocates
    (CPU allocator events of the profiler, cumulated in time order)."""
    from torch.profiler import ProfilerActivity, profile

    from klppo.parallel.tp_layout import TPLayout
    from klppo.parallel.tp_weights import reshard_for_rollout

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tensors = reshard_for_rollout(model, tp, device=torch.device("cpu"))
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    units = [sum(p.numel() * p.element_size() for _, p in unit) for unit in fsdp_unit_params(model)]
    layout = TPLayout.of(model.config, tp.size)
    with gathered_params(model):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected = {}
    for name, t in full.items():
        region = layout.region(name, t.shape, tp.rank)
        expected[name] = (
            t if region.dim is None else t.narrow(region.dim, region.start, region.stop - region.start)
        )
    return {
        "peak": peak,
        "model_bytes": sum(units),
        "largest_unit": max(units),
        "tensors": tensors,
        "expected": expected,
        "slice_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
    }
