"""Rollout benchmark: the klppo engine vs transformers ``generate`` on Qwen2.5-shaped random models.

    PYTHONPATH=$PWD python bench/rollout.py [--shapes 0.5b,1.5b] [--batches 64,256,1024] [--out results.json]

bf16 random weights, prompt 256 tokens, 256 new tokens forced (EOS ignored), temperature 1, top-p 1, no
top-k. For each shape and batch: klppo cold (first call: cache allocation + graph capture) and warm
(graphs reused) — tokens/s, ms per decode step, peak memory; hf ``generate`` with its default dynamic
cache; hf static cache + its own torch.compile for one batch size; and the memory-bandwidth floor of a
decode step ((weight bytes + mean KV bytes read + logits) / HBM bandwidth). ``--check`` adds the GPU
correctness checks: fp32 greedy vs hf, bf16 greedy token match rate, bf16 log-probs vs a recomputed
forward, seeded reproducibility with graphs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from klppo.rollout import SamplingParams, make_rollout

SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960),
}  # fmt: skip
HBM_BYTES_PER_S = 4.8e12  # H200
PROMPT, NEW = 256, 256


def build(shape: str, dtype: torch.dtype, device: str = "cuda"):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen2", vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=4096,
        rms_norm_eps=1e-6, eos_token_id=151645, pad_token_id=151643, **SHAPES[shape],
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def floor_ms(model, batch: int) -> float:
    c = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = c.hidden_size // c.num_attention_heads
    kv_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * head_dim * 2
    mean_ctx = PROMPT + NEW / 2
    logits = batch * c.vocab_size * 4 * 2
    return (weight_bytes + batch * mean_ctx * kv_per_token + logits) / HBM_BYTES_PER_S * 1e3


def timed(fn, *args):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0, torch.cuda.max_memory_allocated() / 2**30


def bench_shape(shape: str, batches: list[int], hf_batches: list[int], compile_batch: int | None, emit):
    model = build(shape, torch.bfloat16)
    params = SamplingParams(max_new_tokens=NEW, temperature=1.0, top_p=1.0, top_k=-1, seed=0, ignore_eos=True)
    eos, pad = [151645], 151643
    for batch in batches:
        prompts = torch.randint(0, 151000, (batch, PROMPT), device="cuda")
        mask = torch.ones_like(prompts)
        engine = make_rollout(
            "klppo", eos_token_ids=eos, pad_token_id=pad, gpu_memory_utilization=0.9, free_cache_engine=False
        )
        for phase in ("cold", "warm"):
            out, elapsed, peak = timed(engine.generate, model, prompts, mask, params)
            s = engine.last_stats
            decode_s = s["rollout/time_s"] - s["rollout/prefill_s"] - s["rollout/graph_capture_s"]
            emit(dict(shape=shape, batch=batch, backend=f"klppo-{phase}", time_s=elapsed,
                      tokens_per_s=batch * NEW / elapsed, ms_per_step=decode_s / s["rollout/decode_steps"] * 1e3,
                      prefill_s=s["rollout/prefill_s"], capture_s=s["rollout/graph_capture_s"],
                      num_slots=s["rollout/num_slots"], peak_gb=peak, floor_ms=floor_ms(model, batch),
                      tokens=int(out.response_mask.sum())))  # fmt: skip
        engine.release()
        del engine
        torch.cuda.empty_cache()
        if batch in hf_batches:
            hf = make_rollout("hf", eos_token_ids=eos, pad_token_id=pad)
            out, elapsed, peak = timed(hf.generate, model, prompts, mask, params)
            emit(dict(shape=shape, batch=batch, backend="hf-default", time_s=elapsed,
                      tokens_per_s=batch * NEW / elapsed, ms_per_step=elapsed / NEW * 1e3, peak_gb=peak))  # fmt: skip
        if batch == compile_batch:
            from klppo.rollout.hf import HFRollout

            hf = HFRollout(eos_token_ids=eos, pad_token_id=pad, cache_implementation="static")
            _, compile_s, _ = timed(hf.generate, model, prompts, mask, params)
            out, elapsed, peak = timed(hf.generate, model, prompts, mask, params)
            emit(dict(shape=shape, batch=batch, backend="hf-static-compile", time_s=elapsed,
                      first_call_s=compile_s, tokens_per_s=batch * NEW / elapsed,
                      ms_per_step=elapsed / NEW * 1e3, peak_gb=peak))  # fmt: skip
        torch.cuda.empty_cache()


def checks(emit) -> None:
    """GPU correctness on the 0.5B shape (short generations)."""
    eos, pad = [151645], 151643
    prompts = torch.randint(0, 151000, (8, 64), device="cuda")
    mask = torch.ones_like(prompts)
    mask[::2, :17] = 0  # ragged, left-padded
    greedy = SamplingParams(max_new_tokens=32, do_sample=False)
    engine = make_rollout("klppo", eos_token_ids=eos, pad_token_id=pad, gpu_memory_utilization=0.9)
    hf = make_rollout("hf", eos_token_ids=eos, pad_token_id=pad)
    for dtype in (torch.float32, torch.bfloat16):
        model = build("0.5b", dtype)
        ours = engine.generate(model, prompts, mask, greedy)
        ref = hf.generate(model, prompts, mask, greedy)
        match = (ours.responses == ref.responses).float().mean().item()
        identical_rows = (ours.responses == ref.responses).all(dim=1).float().mean().item()
        sampled = engine.generate(model, prompts, mask, SamplingParams(max_new_tokens=32, seed=1))
        again = engine.generate(model, prompts, mask, SamplingParams(max_new_tokens=32, seed=1))
        ids = torch.cat([prompts, sampled.responses], dim=1)
        full_mask = torch.cat([mask, sampled.response_mask], dim=1)
        positions = (full_mask.cumsum(1) - 1).clamp(min=0)
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=full_mask, position_ids=positions).logits.float()
        lp = torch.log_softmax(logits[:, 63:-1], -1).gather(-1, sampled.responses[..., None]).squeeze(-1)
        diff = ((lp - sampled.log_probs).abs() * sampled.response_mask).max().item()
        emit(dict(check=str(dtype), greedy_token_match=match, greedy_rows_identical=identical_rows,
                  logprob_max_abs_diff=diff,
                  seeded_reproducible=bool(torch.equal(sampled.responses, again.responses))))  # fmt: skip
        del model
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--hf-batches", default="64,256")
    ap.add_argument("--compile-batch", type=int, default=256)
    ap.add_argument("--compile-shape", default="0.5b")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)

    print(torch.cuda.get_device_name(), torch.__version__, file=sys.stderr)
    if args.check:
        checks(emit)
    for shape in args.shapes.split(","):
        compile_batch = args.compile_batch if shape == args.compile_shape else None
        bench_shape(
            shape,
            [int(b) for b in args.batches.split(",")],
            [int(b) for b in args.hf_batches.split(",")],
            compile_batch,
            emit,
        )


if __name__ == "__main__":
    main()
