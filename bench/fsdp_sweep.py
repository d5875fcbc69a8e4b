"""FSDP2 sweep on one GPU: peak memory and actor-update time for a Qwen2.5-1.5B-shaped random model.

For min_num_params ∈ {0, 1e8, whole model} × (param + optimizer offload off / on), one process (world 1,
so no communication is measured: that needs several GPUs). One "update" = forward + backward + grad
clipping + AdamW on ``--batch × --seq`` tokens, bf16 compute (``param_dtype``), fp32 master weights,
gradients and AdamW state. With offload on, the step is bracketed by load (CPU → GPU) and offload
(GPU → CPU) of parameters and optimizer state; ``transfer_s`` times those, ``idle_gib`` is what stays
allocated on the GPU between updates.

    PYTHONPATH=$PWD python bench/fsdp_sweep.py --out results.json
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback

import torch

from klppo.parallel.dist import init_distributed
from klppo.parallel.fsdp import FSDPSettings, build_mesh, clip_grad_norm_, shard_model
from klppo.parallel.offload import load_optimizer, load_params, offload_optimizer, offload_params

GIB = 2**30
QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


def build_model(num_layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", **{**QWEN25_15B, "num_hidden_layers": num_layers})
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def one_config(min_num_params: int, offload: bool, args) -> dict:
    device = torch.device("cuda")
    settings = FSDPSettings(
        min_num_params=min_num_params,
        param_offload=offload,
        optimizer_offload=offload,
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
    )
    model = build_model(args.layers)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable()
    report = shard_model(model, settings, build_mesh(1, -1, "cuda"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    x = torch.randint(0, QWEN25_15B["vocab_size"], (args.batch, args.seq), device=device)
    update_s, transfer_s, peaks, idle = [], [], [], []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if offload and step > 0:
            load_params(model, device)
            load_optimizer(opt, device)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t1 = time.perf_counter()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated()
        if offload:
            offload_params(model)
            offload_optimizer(opt)
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        if step >= args.warmup:
            update_s.append(t2 - t1)
            transfer_s.append((t1 - t0) + (t3 - t2))
            peaks.append(peak)
            idle.append(torch.cuda.memory_allocated())
    result = {
        "min_num_params": min_num_params,
        "offload": offload,
        "units": report.count,
        "unit_smallest": report.smallest,
        "unit_largest": report.largest,
        "params": report.total,
        "update_s": min(update_s),
        "transfer_s": min(transfer_s),
        "peak_gib": max(peaks) / GIB,
        "idle_gib": max(idle) / GIB,
        "tokens_per_s": args.batch * args.seq / min(update_s),
    }
    del model, opt, x, loss
    gc.collect()
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--grad-ckpt", action="store_true")
    parser.add_argument("--thresholds", default="0,100000000,10000000000")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    init_distributed("cuda", timeout_s=600)
    rows = []
    for threshold in (int(t) for t in args.thresholds.split(",")):
        for offload in (False, True):
            try:
                row = one_config(threshold, offload, args)
            except Exception as e:  # record and go on: one failure must not lose the other rows
                traceback.print_exc()
                row = {
                    "min_num_params": threshold,
                    "offload": offload,
                    "error": f"{type(e).__name__}: {e}"[:200],
                }
                gc.collect()
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.batch}x{args.seq} tokens")
    print(
        "| min_num_params | offload | units | largest unit | update s | tokens/s | transfer s | peak GiB | "
        "idle GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['min_num_params']:.0e} | {r['offload']} | {r['error']} |")
            continue
        print(
            f"| {r['min_num_params']:.0e} | {'on' if r['offload'] else 'off'} | {r['units']} | "
            f"{r['unit_largest'] / 1e6:.0f}M | {r['update_s']:.3f} | {r['tokens_per_s']:,.0f} | "
            f"{r['transfer_s']:.2f} | {r['peak_gib']:.1f} | {r['idle_gib']:.2f} |"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
