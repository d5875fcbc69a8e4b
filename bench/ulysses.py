"""Ulysses sequence parallelism on K GPUs: actor-update tokens/s and peak memory per GPU, SP=1 vs SP=K.

Run from the repository root (``PYTHONPATH=$PWD``)::

    python bench/ulysses.py --gpus 2 --shape Qwen2.5-7B --lengths 16384,65536 --out $OUT/ulysses.json
    python bench/ulysses.py --gpus 2 --tiny --device cpu --lengths 64,256 --out /tmp/u.json   # mechanics

One *step* is the actor's work per optimizer step on one packed sequence of ``length`` tokens per
data-parallel group (half prompt, half response; log-probs of the response, the backward of their mean,
gradient clipping, AdamW): with SP=1 each of the K ranks runs its own sequence (K sequences per step),
with SP=K the K ranks split one sequence (1 per step). Random weights, fp32 master + bf16 compute on GPU,
FSDP2 one unit per decoder layer over all K ranks, per-layer activation checkpointing, the packed varlen
attention. Reported per (length, sp): ``tokens_per_s_per_gpu`` = sequence tokens processed per second ÷
K, ``peak_gib`` = max over ranks of ``torch.cuda.max_memory_allocated``, or ``status="oom"``. For each
length SP=K runs first; an out-of-memory error ends the run after it is recorded (a rank that ran out
of memory may leave FSDP state behind), so put the length expected to exhaust SP=1 last.

What to expect (7B shape, 2 × H200 141 GB): the static state (fp32 params + grads + AdamW over 2 ranks)
is ~61 GiB per GPU either way; activations and logits are per rank's tokens, so SP=2 at length L costs
what SP=1 costs at L/2. At 16k both fit and SP=2 is slower per GPU by the all-to-alls (4 per layer in
forward, 4 in backward, plus the checkpointed recompute's 4); at 64k SP=1 runs out of memory (logits
of 32k response tokens × 152k vocabulary in fp32 alone are ~20 GB, with their gradient twice that)
while SP=2 fits."""

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

ENV = "KLPPO_ULYSSES_BENCH"  # the ranks' arguments (JSON), so torchrun never parses them


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gpus", type=int, default=2, help="ranks K (SP compared: 1 and K)")
    p.add_argument("--shape", default="Qwen2.5-7B", help="a klppo.tune.shapes name")
    p.add_argument("--tiny", action="store_true", help="the tiny test shape (mechanics on CPU)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--lengths", default="16384,65536", help="comma-separated tokens per sequence")
    p.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    p.add_argument("--out", type=Path, required=True)
    return p.parse_args(argv)


def model_config(args):
    from klppo.tune.shapes import ModelShape, config_from_shape

    if args.tiny:
        return config_from_shape(ModelShape("tiny", "qwen2", 64, 2, 4, 2, 128, 384, True))
    return config_from_shape(args.shape)


def sequence(config, length: int, device, seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (1, length), generator=gen).to(device)
    mask = torch.ones_like(ids)
    return ids, mask, torch.arange(length, device=device).unsqueeze(0), length // 2


def step(model, optimizer, batch, sp) -> None:
    from klppo.batching.packing import forward_log_probs
    from klppo.parallel import ulysses
    from klppo.parallel.fsdp import clip_grad_norm_

    ids, mask, pos, response = batch
    if sp is None:
        log_probs, _ = forward_log_probs(
            model, ids, mask, pos, response_length=response, use_remove_padding=True
        )
    else:
        log_probs, _ = ulysses.forward_log_probs(
            model, ids, mask, pos, response_length=response, temperature=1.0, calculate_entropy=False, sp=sp
        )
    (-log_probs.mean()).backward()
    clip_grad_norm_(model, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure(args, config, length: int, sp_size: int, info) -> dict:
    """One (length, sp) point on every rank; figures reduced over ranks (max memory, max time)."""
    import torch

    from klppo.parallel.collectives import all_reduce_max_values
    from klppo.parallel.mesh import build_parallel_mesh
    from klppo.parallel.ulysses import enable_ulysses_attention
    from klppo.tune.measure import build, free_memory
    from klppo.tune.memory import Point, Workload

    cuda = info.device.type == "cuda"
    mesh = build_parallel_mesh(sp_size, info.device.type)
    sp = mesh.sequence_parallel
    w = Workload(world_size=info.world_size, grad_checkpointing=True, compute_bytes=2 if cuda else 4)
    row = {"length": length, "sp": sp_size, "status": "ok"}
    try:
        model, optimizer = build(config, Point(min_num_params=0, micro_tokens=length), w, info.device)
        if sp is not None:
            enable_ulysses_attention(model, sp.size)
        batch = sequence(config, length, info.device, seed=mesh.dp_rank)  # one sequence per dp group
        step(model, optimizer, batch, sp)  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(model, optimizer, batch, sp)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        step_s, peak = all_reduce_max_values([statistics.median(times), peak])
        row.update(
            step_s=step_s,
            peak_gib=peak,
            tokens_per_s_per_gpu=length * mesh.dp_size / step_s / info.world_size,
        )
        del model, optimizer
    except torch.OutOfMemoryError as e:
        row.update(status="oom", note=str(e).splitlines()[0][:160])
    free_memory(info.device)
    return row


def ranks(args) -> None:
    import torch

    from klppo.parallel.dist import destroy, init_distributed

    info = init_distributed(args.device, 300.0)  # an OOM on one rank only ends in a timeout
    config = model_config(args)
    result = {
        "meta": {
            "shape": "tiny" if args.tiny else args.shape,
            "world_size": info.world_size,
            "device": torch.cuda.get_device_name() if info.device.type == "cuda" else "cpu",
            "commit": os.environ.get("KLPPO_COMMIT", ""),
        },
        "rows": [],
    }
    try:
        for length in [int(x) for x in args.lengths.split(",")]:
            for sp_size in (info.world_size, 1):
                row = measure(args, config, length, sp_size, info)
                result["rows"].append(row)
                if info.rank == 0:
                    print(json.dumps(row), flush=True)
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(result, indent=1))
                if row["status"] == "oom":
                    return
    finally:
        destroy()


def main(argv: list[str] | None = None) -> int:
    from bench.spmd import relaunch_main

    return relaunch_main("bench.ulysses", ENV, parse, ranks, list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
