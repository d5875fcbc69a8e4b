"""Benchmark: fixed padded micro-batches vs token-budget micro-batches vs token-budget + packing.

Qwen2.5-0.5B-shaped random model in bf16 on one GPU, batch of 256 sequences, prompt lengths uniform in
[64, 512], response lengths long-tailed (log-normal, median ~150, clipped to [8, 1024], one at 1024), laid
out as verl does: prompts left-padded to 512, responses right-padded to 1024.

Measured for each variant: wall time of the log-prob pass (no grad) over the batch, and of one actor
update (forward + backward of a PPO-clip token-mean loss over all micro-batches, no optimizer step).

  (a) fixed:          micro-batches of ``--micro`` rows, full padded width (verl without dynamic bsz)
  (b) dynamic:        token-budget micro-batches (``--budget`` real tokens), each trimmed to its own
                      longest prompt + response, padded
  (c) dynamic+packed: token-budget micro-batches packed into one row, varlen attention

ideal ratio = padded tokens of (a) / real tokens. Target: speed-up (a)/(c) ≥ 0.85 × ideal ratio.

    PYTHONPATH=$PWD python bench/packing.py [--batch 256] [--micro 16] [--budget 16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time
import warnings

import torch

from klppo.batching.attention import enable_packed_attention, packed_attention_backend
from klppo.batching.dynamic import (
    fixed_micro_batches,
    micro_batch_loss_weight,
    partition_by_token_budget,
)
from klppo.batching.packing import forward_log_probs, trim_padding_columns

QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)


def make_batch(batch: int, max_prompt: int, max_response: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(64, max_prompt + 1, (batch,), generator=gen)
    log_len = math.log(150.0) + 0.9 * torch.randn(batch, generator=gen)
    response_lens = log_len.exp().round().clamp(8, max_response).long()
    response_lens[0] = max_response
    width = max_prompt + max_response
    ids = torch.randint(3, QWEN25_05B["vocab_size"], (batch, width), generator=gen)
    cols = torch.arange(width)
    mask = ((cols >= max_prompt - prompt_lens[:, None]) & (cols < max_prompt + response_lens[:, None])).long()
    ids = ids * mask + 2 * (1 - mask)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, pos, prompt_lens, response_lens


def run_pass(model, data, parts, *, packed: bool, trim: bool, grad: bool, max_response: int):
    ids, mask, pos, old, adv = data
    response_mask = mask[:, -max_response:].float()
    num_tokens = response_mask.sum()
    for p in parts:
        idx = torch.tensor(p, device=ids.device)
        i, m, q, r = ids[idx], mask[idx], pos[idx], max_response
        if trim:
            i, m, q, r = trim_padding_columns(i, m, q, r)
        with torch.set_grad_enabled(grad):
            lp, _ = forward_log_probs(model, i, m, q, response_length=r, use_remove_padding=packed)
            if grad:
                rm = response_mask[idx, :r]
                ratio = torch.exp(lp - old[idx, :r])
                a = adv[idx, :r]
                token_loss = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
                loss = (token_loss * rm).sum() / rm.sum().clamp(min=1)
                (loss * micro_batch_loss_weight("token-mean", rm, num_tokens, 0, r)).backward()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--budget", type=int, default=16384)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-response", type=int, default=1024)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script only")
    args = ap.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", **QWEN25_05B)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    enable_packed_attention(model)  # padded batches go through sdpa unchanged
    ids, mask, pos, prompt_lens, response_lens = make_batch(args.batch, args.max_prompt, args.max_response, 0)
    gen = torch.Generator().manual_seed(1)
    old = -11.9 + 0.1 * torch.randn(args.batch, args.max_response, generator=gen)
    adv = torch.randn(args.batch, args.max_response, generator=gen)
    data = tuple(t.to(args.device) for t in (ids, mask, pos, old, adv))
    real = int(mask.sum())
    padded = mask.numel()
    seq_lens = mask.sum(1).tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dyn_parts = partition_by_token_budget(seq_lens, args.budget)
    variants = {
        "a_fixed_padded": (fixed_micro_batches(args.batch, args.micro), False, False),
        "b_dynamic_padded": (dyn_parts, False, True),
        "c_dynamic_packed": (dyn_parts, True, False),
    }
    result = {
        "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "packed_backend": packed_attention_backend(torch.device(args.device), torch.bfloat16),
        "real_tokens": real,
        "padded_tokens": padded,
        "ideal_ratio": padded / real,
        "response_len_mean": float(response_lens.float().mean()),
        "response_len_median": float(response_lens.float().median()),
        "prompt_len_mean": float(prompt_lens.float().mean()),
        "num_micro": {k: len(v[0]) for k, v in variants.items()},
        "args": vars(args),
    }
    print(json.dumps(result), flush=True)
    for name, (parts, packed, trim) in variants.items():
        for grad in (False, True):
            key = f"{name}/{'update' if grad else 'log_prob'}"

            def fn(parts=parts, packed=packed, trim=trim, grad=grad):
                model.zero_grad(set_to_none=True)
                run_pass(
                    model, data, parts, packed=packed, trim=trim, grad=grad, max_response=args.max_response
                )

            fn()  # warm-up: kernels, allocator
            cuda = args.device == "cuda"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            result[key + "_s"] = timed(fn, args.repeats)
            result[key + "_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
            if grad:
                grads = [p.grad for p in model.parameters() if p.grad is not None]
                result[key + "_grads_finite"] = bool(all(torch.isfinite(g).all() for g in grads))
            print(f"{key}: {result[key + '_s']:.3f} s, peak {result[key + '_peak_gib']:.1f} GiB", flush=True)
    for phase in ("log_prob", "update"):
        base = result[f"a_fixed_padded/{phase}_s"]
        for v in ("b_dynamic_padded", "c_dynamic_packed"):
            result[f"speedup_{v}/{phase}"] = base / result[f"{v}/{phase}_s"]
        result[f"fraction_of_ideal/{phase}"] = (
            result[f"speedup_c_dynamic_packed/{phase}"] / result["ideal_ratio"]
        )
    summary = {k: round(v, 3) for k, v in result.items() if k.startswith(("speedup", "fraction", "ideal"))}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
