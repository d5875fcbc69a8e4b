"""Tensor-parallel rollout on K GPUs: TP=1 (each rank gathers the whole actor: data parallel) vs TP=K
(each rank generates on its slices, resharded from the FSDP2 shards) — tokens/s, gather / reshard time,
peak memory per GPU; and, under a memory cap, a rollout that does not fit at TP=1 generating at TP=K.

Run from the repository root (``PYTHONPATH=$PWD``)::

    python bench/tp_rollout.py --gpus 2 --shapes Qwen2.5-1.5B,Qwen2.5-7B --out $OUT/tp_rollout.json
    python bench/tp_rollout.py --gpus 2 --shapes Qwen2.5-14B --cap-gib 64 --out $OUT/tp_nonfit.json
    python bench/tp_rollout.py --gpus 2 --tiny --device cpu --out /tmp/tp.json   # mechanics (gloo)

Per shape: a random actor (fp32 master weights, bf16 compute on GPU; no optimizer state) FSDP2-sharded
one unit per decoder layer over the K ranks; each rank brings ``--batch`` prompts of ``--prompt`` random
tokens and generates ``--new`` tokens each (EOS ignored, temperature 1). One warm-up call (compilation,
graph capture), then ``--calls`` timed calls; a call's time includes the gather (TP=1, FSDP2 unshard in
place: ``timing_s/update_weights`` in training) or the reshard (TP=K: ``rollout/reshard_s``). Reported
per (shape, tp): ``tokens_per_s_per_gpu`` (each rank's own tokens / call time), ``weights_s`` (gather or
reshard), ``peak_gib`` (max over ranks of ``torch.cuda.max_memory_allocated`` during a call, weights
included), the KV cache's slots and GiB, ``cuda_graphs`` (1: the decode step ran as CUDA graphs; 0:
eager, asked with ``--eager`` or after a failed capture); then a ``check`` row: greedy 32 tokens of 8 prompts
at TP=K and TP=1, the share of identical rows and the largest log-prob gap (bf16: a few rows may part at
near-ties).
TP=K runs first; TP=1 last, as it is the one expected to fail under ``--cap-gib``
(``torch.cuda.set_per_process_memory_fraction``, set once the actor is sharded, and
``gpu_memory_utilization`` both set to the cap):
a failure is recorded as ``status`` (``oom`` or ``no_room``) and ends that shape.

What to expect (2 GPUs of 141 GB, bf16, batch 64 × (256 + 256)): at 1.5B and 7B both fit; TP=2 holds half the
weights (7B: 7.6 instead of 15.2 GB) and half the KV per token, so more slots fit, but each decode step
adds 2 all-reduces per layer on NVLink: per-GPU tokens/s at TP=2 is expected *below* TP=1 (data
parallelism needs no communication) — TP is for models that do not fit, not for speed. The reshard moves
each rank's slices only (half the bytes the gather brings in) in one all-to-all per unit: expected no
slower than the gather. 14B under a 64 GiB cap: TP=1 needs fp32 shards 29.5 + gathered bf16 29.5 +
fused copies ~17 GB > 64 GiB (no room for a KV cache); TP=2 needs 29.5 + 14.8 and generates.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ENV = "KLPPO_TP_ROLLOUT_BENCH"  # the ranks' arguments (JSON), so torchrun never parses them


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=2, help="ranks K (TP compared: K and 1)")
    p.add_argument("--shapes", default="Qwen2.5-1.5B,Qwen2.5-7B", help="klppo.tune.shapes names")
    p.add_argument("--tiny", action="store_true", help="the tiny test shape (mechanics on CPU)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batch", type=int, default=64, help="prompts per rank")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--new", type=int, default=256, help="generated tokens per prompt")
    p.add_argument("--calls", type=int, default=2, help="timed calls after one warm-up")
    p.add_argument("--util", type=float, default=0.85, help="gpu_memory_utilization (without --cap-gib)")
    p.add_argument("--cap-gib", type=float, default=None, help="cap each GPU at this many GiB")
    p.add_argument("--eager", action="store_true", help="decode without CUDA graphs / compilation")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def model_config(args, name: str):
    from klppo.tune.shapes import ModelShape, config_from_shape

    if args.tiny:
        return config_from_shape(ModelShape("tiny", "qwen2", 64, 2, 4, 2, 128, 384, True))
    return config_from_shape(name)


def build_actor(config, info):
    """A random actor, fp32 master weights, FSDP2 over all ranks (bf16 compute on GPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    from klppo.parallel.fsdp import FSDPSettings, build_mesh, shard_model

    torch.manual_seed(0)
    with torch.device(info.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    cuda = info.device.type == "cuda"
    settings = FSDPSettings(param_dtype=torch.bfloat16 if cuda else None)
    shard_model(model, settings, build_mesh(info.world_size, -1, info.device.type))
    return model


def prompts(config, args, device, rank: int, count: int, length: int):
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    ids = torch.randint(3, config.vocab_size, (count, length), generator=gen).to(device)
    return ids, torch.ones_like(ids)


def call(engine, model, ids, mask, params, tp: bool, device) -> tuple[object, float, float]:
    """One rollout with its weight step: (output, call seconds, gather-or-reshard seconds)."""
    import torch

    from klppo.parallel.fsdp import gathered_params

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    if tp:
        out = engine.generate(model, ids, mask, params)
        weights_s = out.stats["rollout/reshard_s"]
    else:
        with gathered_params(model):
            if cuda:
                torch.cuda.synchronize()
            weights_s = time.perf_counter() - start
            out = engine.generate(model, ids, mask, params)
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start, weights_s


def measure(args, config, model, tp, info) -> tuple[dict, dict | None]:
    """One (shape, tp) point on every rank (``tp``: the group, None for TP=1), reduced over ranks; and
    its greedy check outputs."""
    import torch

    from klppo.parallel.collectives import all_reduce_max_values
    from klppo.rollout import EngineSettings, SamplingParams, make_rollout

    cuda = info.device.type == "cuda"
    tp_size = 1 if tp is None else tp.size
    util = args.util
    if args.cap_gib is not None and cuda:
        util = min(1.0, args.cap_gib * 2**30 / torch.cuda.get_device_properties(info.device).total_memory)
    options = {"cuda_graphs": False, "compile_decode": False} if args.eager else {}
    settings = EngineSettings(eos_token_ids=[0], pad_token_id=0, gpu_memory_utilization=util, **options)
    engine = make_rollout("klppo", settings, tensor_parallel=tp)
    ids, mask = prompts(config, args, info.device, info.rank, args.batch, args.prompt)
    params = SamplingParams(max_new_tokens=args.new, temperature=1.0, ignore_eos=True, seed=info.rank)
    row: dict = {"tp": tp_size, "status": "ok"}
    try:
        call(engine, model, ids, mask, params, tp is not None, info.device)  # warm-up
        times, weights, peaks = [], [], []
        for _ in range(args.calls):
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            out, seconds, weights_s = call(engine, model, ids, mask, params, tp is not None, info.device)
            times.append(seconds)
            weights.append(weights_s)
            peaks.append(torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"))
        tokens = float(out.response_mask.sum())
        step_s, weights_s, peak = all_reduce_max_values(
            [statistics.median(times), statistics.median(weights), max(peaks)]
        )
        row.update(
            call_s=step_s,
            weights_s=weights_s,
            peak_gib=peak,
            tokens_per_s_per_gpu=tokens / step_s,
            num_slots=out.stats["rollout/num_slots"],
            kv_cache_gb=out.stats["rollout/kv_cache_gb"],
            decode_steps=out.stats["rollout/decode_steps"],
            cuda_graphs=out.stats["rollout/cuda_graphs"],
        )
        greedy = SamplingParams(max_new_tokens=32, do_sample=False)
        check_ids, check_mask = prompts(config, args, info.device, info.rank, 8, 32)
        check, _, _ = call(engine, model, check_ids, check_mask, greedy, tp is not None, info.device)
        return row, {"tokens": check.responses.cpu(), "log_probs": check.log_probs.cpu()}
    except torch.OutOfMemoryError as e:
        row.update(status="oom", note=str(e).splitlines()[0][:160])
    except ValueError as e:  # the engine's "no room for a KV cache"
        row.update(status="no_room", note=str(e)[:160])
    engine.release()
    return row, None


def compare(a: dict, b: dict) -> dict:
    """The greedy check: rows identical at TP=K and TP=1, largest log-prob gap (this rank's rows)."""
    same = (a["tokens"] == b["tokens"]).all(dim=1)
    gap = (a["log_probs"] - b["log_probs"]).abs().max().item()
    return {"rows_identical": float(same.float().mean()), "max_log_prob_gap": gap}


def ranks(args) -> None:
    import torch

    from klppo.parallel.collectives import all_reduce_max_values
    from klppo.parallel.dist import destroy, init_distributed
    from klppo.parallel.mesh import build_rollout_mesh
    from klppo.tune.measure import free_memory

    info = init_distributed(args.device, 600.0)  # an OOM on one rank only ends in a timeout
    result = {
        "meta": {
            "world_size": info.world_size,
            "cap_gib": args.cap_gib,
            "batch": args.batch,
            "prompt": args.prompt,
            "new": args.new,
            "eager": args.eager,
            "device": torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu",
            "commit": os.environ.get("KLPPO_COMMIT", ""),
        },
        "rows": [],
    }
    groups = {info.world_size: build_rollout_mesh(info.world_size, info.device.type), 1: None}
    try:
        for name in ["tiny"] if args.tiny else args.shapes.split(","):
            config = model_config(args, name)
            model = build_actor(config, info)
            if args.cap_gib is not None and info.device.type == "cuda":  # after building: fp32 init is full
                free_memory(info.device)
                total = torch.cuda.get_device_properties(info.device).total_memory
                torch.cuda.set_per_process_memory_fraction(
                    min(1.0, args.cap_gib * 2**30 / total), info.device
                )
            checks = {}
            for tp_size in (info.world_size, 1):
                row, checks[tp_size] = measure(args, config, model, groups[tp_size], info)
                _emit(args, info, result, {"shape": name, **row})
                if row["status"] != "ok":
                    break
            if all(checks.get(t) is not None for t in (info.world_size, 1)):
                got = compare(checks[info.world_size], checks[1])
                gap, neg_same = all_reduce_max_values([got["max_log_prob_gap"], -got["rows_identical"]])
                _emit(
                    args,
                    info,
                    result,
                    {
                        "shape": name,
                        "check": "greedy TP=K vs TP=1",
                        "rows_identical_min": -neg_same,
                        "max_log_prob_gap": gap,
                    },
                )
            del model
            free_memory(info.device)
    finally:
        destroy()


def _emit(args, info, result: dict, row: dict) -> None:
    result["rows"].append(row)
    if info.rank == 0:
        print(json.dumps(row), flush=True)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    from bench.spmd import relaunch_main

    return relaunch_main("bench.tp_rollout", ENV, parse, ranks, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
