"""Rollout benchmark: the klppo engine vs transformers ``generate`` on Qwen2.5-shaped random models.

    PYTHONPATH=$PWD python bench/rollout.py [--shapes 0.5b,1.5b] [--batches 64,256,1024] [--out results.json]
        [--variants sdpa,eager] [--check] [--profile] [--n 4] [--samplers auto,torch]
        [--decode-attention auto,sdpa] [--temperature 1] [--top-k -1] [--top-p 1] [--device cuda]

``--n`` samples per prompt (the batch counts sequences): with n > 1 the engine prefills each prompt once.

Shapes: Qwen2.5-0.5B, -1.5B and -7B (``7b``: one GPU's 7B rollout). bf16 random weights, prompt 256 tokens,
256 new tokens forced (EOS ignored), temperature 1, top-p 1, no top-k. For each shape and batch: klppo cold
(first call: cache allocation + graph capture) and warm (graphs reused) — tokens/s, ms per decode step, peak
memory; hf ``generate`` with its default dynamic cache; hf static cache + its own torch.compile for one batch
size; and the memory-bandwidth floor of a decode step ((weight bytes + mean KV bytes read + logits) / HBM
bandwidth: the card's datasheet figure, ``HBM_BYTES_PER_S``). ``--check`` adds the GPU correctness checks:
fp32 greedy vs hf, bf16 greedy token match rate, bf16 log-probs vs a recomputed forward, seeded
reproducibility with graphs, bf16 split backend vs the torch reference. ``--variants`` re-runs the engine at
``--compile-batch`` with one engine setting changed (``VARIANTS``: settings a user also has; ``same``: the
default engine again, to see the order's effect). To compare two revisions of the engine, run this script on
both (``bench/ab.py``). ``--profile`` prints the CUDA kernel-time table of a few eager (graph-less) decode
steps. ``--samplers`` times the engine once per ``sampler`` setting (``auto``: rows ``klppo-*``; ``torch``:
rows ``klppo-torch-*``) with the sampling of ``--temperature``, ``--top-k``, ``--top-p``;
``--decode-attention`` likewise once per ``decode_attention`` (``sdpa``: rows ``klppo-attn-sdpa-*``; with
``--profile``, one kernel table per setting and ``--profile-batches`` batch). ``--eos-every K`` makes every
K-th token id an EOS (not ignored): on the random models the sequences then end at spread lengths, as in a
real rollout (``--variants compact`` times slot compaction there; ``--no-hf-compile`` skips hf static +
compile at ``--compile-batch``). ``--device cpu`` with ``--shapes tiny`` runs the script's own test."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import torch

from klppo.rollout import SamplingParams, make_rollout
from klppo.rollout.compiled import CompiledFunctions
from klppo.rollout.settings import EngineSettings

SHAPES = {
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
    ),
    "7b": dict(
        hidden_size=3584,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=18944,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    ),  # CPU tests of the bench scripts
}
HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}  # the SXM cards' memory bandwidth (datasheets)


def hbm_bytes_per_s() -> float:
    """The bandwidth of this process's GPU (by name; an unknown card: the H200's)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((bw for card, bw in HBM_BYTES_PER_S.items() if card in name), HBM_BYTES_PER_S["H200"])


VARIANTS = {  # engine settings a user also has (EngineSettings fields, or the compiled functions' mode)
    "sdpa": dict(decode_attention="sdpa"),
    "torch-sampler": dict(sampler="torch"),
    "bf16-logits": dict(fp32_logits=False),
    "eager": dict(compile_decode=False),
    "compact": dict(compact_slots=True),
    # inductor's Triton GEMM templates tuned per shape for the compiled layers (a compile mode; made per run)
    "autotune": dict(compiled=lambda: CompiledFunctions(mode="max-autotune-no-cudagraphs")),
    "same": dict(),  # the default engine again: after another variant, the order's effect shows
}


def variant(name: str) -> dict:
    """The engine options of ``--variants`` entry ``name`` (one of ``VARIANTS``)."""
    if name not in VARIANTS:
        raise SystemExit(f"--variants {name}: not one of {', '.join(VARIANTS)}")
    return VARIANTS[name]


PROMPT, NEW = 256, 256


def qwen_config(shape: str):
    from transformers import AutoConfig

    return AutoConfig.for_model(
        "qwen2",
        vocab_size=151936,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        eos_token_id=151645,
        pad_token_id=151643,
        **SHAPES[shape],
    )


def build(shape: str, dtype: torch.dtype, device: str = "cuda"):
    from transformers import AutoModelForCausalLM

    config = qwen_config(shape)
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
    return (weight_bytes + batch * mean_ctx * kv_per_token + logits) / hbm_bytes_per_s() * 1e3


def timed(fn, *args):
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = fn(*args)
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0, torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0


def run_klppo(engine, name: str, shape: str, model, prompts, mask, params, emit) -> None:
    batch = prompts.shape[0] * params.n
    for phase in ("cold", "warm"):
        out, elapsed, peak = timed(engine.generate, model, prompts, mask, params)
        s = out.stats
        decode_s = s["rollout/time_s"] - s["rollout/prefill_s"] - s["rollout/graph_capture_s"]
        emit(
            dict(
                shape=shape,
                batch=batch,
                backend=f"{name}-{phase}",
                time_s=elapsed,
                sampling=f"T={params.temperature} top_k={params.top_k} top_p={params.top_p}",
                tokens_per_s=s["rollout/tokens_generated"] / elapsed,
                ms_per_step=decode_s / s["rollout/decode_steps"] * 1e3,
                slot_moves=s["rollout/slot_moves"],
                prefill_s=s["rollout/prefill_s"],
                capture_s=s["rollout/graph_capture_s"],
                n=params.n,
                prefill_tokens=s["rollout/prefill_tokens"],
                num_slots=s["rollout/num_slots"],
                peak_gb=peak,
                floor_ms=floor_ms(model, batch),
                fused_gb=s.get("rollout/fused_weights_gb", 0.0),
                tokens=int(out.response_mask.sum()),
            )
        )
    engine.release()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_shape(
    shape: str,
    batches: list[int],
    hf_batches: list[int],
    compile_batch: int | None,
    emit,
    variants: list[str] = (),
    n: int = 1,
    *,
    samplers: list[str] = ("auto",),
    sampling: dict | None = None,
    device: str = "cuda",
    eos_every: int = 0,
    hf_compile: bool = True,
    attentions: list[str] = ("auto",),
):
    model = build(shape, torch.bfloat16, device)
    sampling = sampling or dict(temperature=1.0, top_p=1.0, top_k=-1)
    params = SamplingParams(max_new_tokens=NEW, seed=0, ignore_eos=not eos_every, n=n, **sampling)
    eos, pad = [151645], 151643
    if eos_every:  # every eos_every-th id ends a sequence: lengths spread as in a real rollout
        eos = list(range(0, model.config.vocab_size, eos_every))
    kw = dict(eos_token_ids=eos, pad_token_id=pad, gpu_memory_utilization=0.9, free_cache_engine=False)
    for batch in batches:
        prompts = torch.randint(0, 151000, (batch // n, PROMPT), device=device)  # batch = sequences
        mask = torch.ones_like(prompts)
        for sampler in samplers:
            for attention in attentions:
                name = "klppo" if sampler == "auto" else f"klppo-{sampler}"
                name += "" if attention == "auto" else f"-attn-{attention}"
                settings = EngineSettings(**kw, sampler=sampler, decode_attention=attention)
                engine = make_rollout("klppo", settings)
                run_klppo(engine, name, shape, model, prompts, mask, params, emit)
        if batch in hf_batches:
            hf = make_rollout("hf", EngineSettings(eos_token_ids=eos, pad_token_id=pad))
            out, elapsed, peak = timed(hf.generate, model, prompts, mask, params)
            emit(
                dict(
                    shape=shape,
                    batch=batch,
                    backend="hf-default",
                    time_s=elapsed,
                    tokens_per_s=batch * NEW / elapsed,
                    ms_per_step=elapsed / NEW * 1e3,
                    peak_gb=peak,
                )
            )
        if batch == compile_batch and hf_compile:
            from klppo.rollout.hf import HFRollout

            hf = HFRollout(eos_token_ids=eos, pad_token_id=pad, cache_implementation="static")
            _, compile_s, _ = timed(hf.generate, model, prompts, mask, params)
            out, elapsed, peak = timed(hf.generate, model, prompts, mask, params)
            emit(
                dict(
                    shape=shape,
                    batch=batch,
                    backend="hf-static-compile",
                    time_s=elapsed,
                    first_call_s=compile_s,
                    tokens_per_s=batch * NEW / elapsed,
                    ms_per_step=elapsed / NEW * 1e3,
                    peak_gb=peak,
                )
            )
            del hf
        if batch == compile_batch:
            sampler = samplers[-1]  # the variants beside the last sampler's full row
            for name in variants:
                options = {
                    "sampler": sampler,
                    **{k: v() if callable(v) else v for k, v in variant(name).items()},
                }
                compiled = options.pop("compiled", None)
                engine = make_rollout("klppo", EngineSettings(**kw, **options), compiled=compiled)
                row = f"klppo-{name}" if sampler == "auto" else f"klppo-{sampler}-{name}"
                run_klppo(engine, row, shape, model, prompts, mask, params, emit)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def profile(
    batch: int = 256,
    steps: int = 16,
    shape: str = "0.5b",
    device: str = "cuda",
    decode_attention: str = "auto",
    stack: bool = False,
    sampler: str = "auto",
) -> None:
    """CUDA kernel time of ``steps`` eager decode steps alone (no prefill; no graphs, so kernel times and
    not launch gaps), at context ``PROMPT`` and up; builds the engine's call and its decode step
    (:func:`klppo.rollout.steps.decode_step`). ``stack``: also the host operators by their Python call
    sites (which line launches each copy); ``decode_attention``, ``sampler``: the engine's."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from klppo.models.llama_weights import LlamaWeights
    from klppo.rollout.engine import KLPPORollout
    from klppo.rollout.steps import decode_step

    model = build(shape, torch.bfloat16, device)
    prompts = torch.randint(0, 1000, (batch, PROMPT), device=device)
    params = SamplingParams(max_new_tokens=2 * steps, seed=0, ignore_eos=True)
    engine = KLPPORollout(
        EngineSettings(
            eos_token_ids=[151645],
            pad_token_id=151643,
            gpu_memory_utilization=0.9,
            cuda_graphs=False,
            free_cache_engine=False,
            decode_attention=decode_attention,
            sampler=sampler,
        )
    )
    engine.generate(model, prompts, torch.ones_like(prompts), params)  # compile, keep the workspace
    call = engine._call(LlamaWeights.read(model), prompts, torch.ones_like(prompts), [PROMPT] * batch, params)
    call.ws.position.fill_(PROMPT)  # the kept workspace (same shape), fused copies refreshed
    step = decode_step(call, call.ws.kv.shape[2])
    step()
    activities = [ProfilerActivity.CUDA] if device == "cuda" else [ProfilerActivity.CPU]
    with torch_profile(activities=activities, with_stack=stack) as prof:
        for _ in range(steps):
            step()
        if device == "cuda":
            torch.cuda.synchronize()
    sort = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    print(
        f"decode-only profile: {shape} batch {batch}, decode_attention={decode_attention}, "
        f"sampler={sampler}, {steps} steps (divide totals by {steps} for per step)"
    )
    print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=70))
    if stack:
        print(
            prof.key_averages(group_by_stack_n=6).table(
                sort_by="cpu_time_total", row_limit=30, max_name_column_width=40
            )
        )


def recompute(model, prompts, mask, out, mode: str) -> torch.Tensor:
    """Log-probs [B, R] of ``out.responses`` from one full forward: ``model`` (its own logits),
    ``fp32-head`` (its hidden states, float32 LM-head output) or ``fp32`` (a float32 copy of the model)."""
    import copy

    from klppo.models.lm_head import lm_head_logits

    ids = torch.cat([prompts, out.responses], dim=1)
    full_mask = torch.cat([mask, out.response_mask], dim=1)
    positions = (full_mask.cumsum(1) - 1).clamp(min=0)
    kw = dict(input_ids=ids, attention_mask=full_mask, position_ids=positions)
    start, width = prompts.shape[1] - 1, out.responses.shape[1]
    with torch.no_grad():
        if mode == "model":
            logits = model(**kw).logits[:, start : start + width].float()
        elif mode == "fp32-head":
            hidden = model.model(**kw).last_hidden_state
            logits = lm_head_logits(hidden[:, start : start + width], model.lm_head.weight, True)
        else:
            logits = copy.deepcopy(model).float()(**kw).logits[:, start : start + width]
    return torch.log_softmax(logits, -1).gather(-1, out.responses[..., None]).squeeze(-1) * out.response_mask


def logprob_gap(model, prompts, mask, out, mode: str, stat: str = "max") -> float:
    """max (or mean) |``out.log_probs`` − ``recompute(mode)``| over the response tokens."""
    gap = (recompute(model, prompts, mask, out, mode) - out.log_probs).abs()[out.response_mask.bool()]
    return (gap.max() if stat == "max" else gap.mean()).item()


def check_prompts(device: str = "cuda", vocab: int = 151000) -> tuple[torch.Tensor, torch.Tensor]:
    """The correctness checks' inputs: eight prompts of 64 ids below ``vocab``, every other one left-padded
    by 17 (ids, mask)."""
    prompts = torch.randint(0, vocab, (8, 64), device=device)
    mask = torch.ones_like(prompts)
    mask[::2, :17] = 0  # ragged, left-padded
    return prompts, mask


def checks(emit, dtypes=(torch.float32, torch.bfloat16)) -> None:
    """GPU correctness on the 0.5B shape (short generations)."""
    eos, pad = [151645], 151643
    prompts, mask = check_prompts()
    greedy = SamplingParams(max_new_tokens=32, do_sample=False)
    engine = make_rollout(
        "klppo", EngineSettings(eos_token_ids=eos, pad_token_id=pad, gpu_memory_utilization=0.9)
    )
    hf = make_rollout("hf", EngineSettings(eos_token_ids=eos, pad_token_id=pad))
    for dtype in dtypes:
        model = build("0.5b", dtype)
        ours = engine.generate(model, prompts, mask, greedy)
        ref = hf.generate(model, prompts, mask, greedy)
        match = (ours.responses == ref.responses).float().mean().item()
        identical_rows = (ours.responses == ref.responses).all(dim=1).float().mean().item()
        sampled = engine.generate(model, prompts, mask, SamplingParams(max_new_tokens=32, seed=1))
        again = engine.generate(model, prompts, mask, SamplingParams(max_new_tokens=32, seed=1))
        diff = logprob_gap(model, prompts, mask, sampled, "model")
        emit(
            dict(
                check=str(dtype),
                greedy_token_match=match,
                greedy_rows_identical=identical_rows,
                logprob_max_abs_diff=diff,
                seeded_reproducible=bool(torch.equal(sampled.responses, again.responses)),
            )
        )
        if dtype == torch.bfloat16:
            # where the bf16 gap comes from: each engine logits setting against recomputations whose LM head
            # rounds to bf16 ("model", what HF returns), keeps fp32 ("fp32-head"), or an fp32 copy ("fp32")
            for fp32_logits in (False, True):
                eng = make_rollout(
                    "klppo",
                    EngineSettings(
                        eos_token_ids=eos,
                        pad_token_id=pad,
                        gpu_memory_utilization=0.9,
                        fp32_logits=fp32_logits,
                    ),
                )
                out = eng.generate(model, prompts, mask, SamplingParams(max_new_tokens=32, seed=1))
                emit(
                    dict(
                        check=f"bf16 log-prob gap, engine fp32_logits={fp32_logits}",
                        **{
                            f"{stat}_vs_{m}": logprob_gap(model, prompts, mask, out, m, stat)
                            for m in ("model", "fp32-head", "fp32")
                            for stat in ("max", "mean")
                        },
                    )
                )
            # the recomputation's own error: a bf16 recompute against the fp32 copy, same tokens
            recomputed = dataclasses.replace(out, log_probs=recompute(model, prompts, mask, out, "model"))
            emit(
                dict(
                    check="bf16 recompute (model) vs fp32 copy",
                    **{
                        f"{stat}": logprob_gap(model, prompts, mask, recomputed, "fp32", stat)
                        for stat in ("max", "mean")
                    },
                )
            )
        if dtype == torch.bfloat16:  # the split backend against the torch reference
            sdpa = make_rollout(
                "klppo",
                EngineSettings(
                    eos_token_ids=eos, pad_token_id=pad, gpu_memory_utilization=0.9, decode_attention="sdpa"
                ),
            )
            ref = sdpa.generate(model, prompts, mask, SamplingParams(max_new_tokens=32, seed=1))
            same = (ref.responses == sampled.responses).all(dim=1)
            emit(
                dict(
                    check="bf16 split backend vs sdpa reference",
                    token_match=(ref.responses == sampled.responses).float().mean().item(),
                    logprob_max_abs_diff_identical_rows=(
                        (ref.log_probs - sampled.log_probs)[same].abs().max().item() if same.any() else None
                    ),
                )
            )
        del model
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> None:
    global PROMPT, NEW  # --prompt / --new: the functions above read them
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument("--batches", default="64,256,1024")
    ap.add_argument("--hf-batches", default="64,256")
    ap.add_argument("--compile-batch", type=int, default=256)
    ap.add_argument("--compile-shape", default="0.5b")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--check-dtypes", default="float32,bfloat16")
    ap.add_argument("--variants", default="")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--profile-batches", default="256", help="batches of the --profile kernel tables")
    ap.add_argument("--profile-stack", action="store_true", help="--profile: host operators by call site too")
    ap.add_argument("--profile-shape", default="0.5b", help="the shape of the --profile kernel tables")
    ap.add_argument("--n", type=int, default=1, help="samples per prompt (batch = prompts × n sequences)")
    ap.add_argument("--samplers", default="auto", help="auto,torch: the engine once per sampler setting")
    ap.add_argument(
        "--decode-attention",
        default="auto",
        help="auto,sdpa: the engine once per decode_attention (rows klppo[-sampler]-attn-NAME; "
        "auto: rows klppo[-sampler]); also the --profile runs",
    )
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=-1)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--no-hf-compile", action="store_true", help="skip hf static + compile at --compile-batch"
    )
    ap.add_argument(
        "--eos-every", type=int, default=0, help="K > 0: every K-th id is an EOS (EOS not ignored)"
    )
    ap.add_argument("--prompt", type=int, default=PROMPT, help="prompt tokens (default 256)")
    ap.add_argument("--new", type=int, default=NEW, help="new tokens, forced (default 256)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    PROMPT, NEW = args.prompt, args.new
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)

    if args.device == "cuda":
        print(torch.cuda.get_device_name(), torch.__version__, file=sys.stderr)
    for name in [v for v in args.variants.split(",") if v]:
        variant(name)  # a wrong name fails before any model is built
    for shape in [s for s in args.shapes.split(",") if s]:  # --shapes "": the checks or profiles only
        compile_batch = args.compile_batch if shape == args.compile_shape else None
        bench_shape(
            shape,
            [int(b) for b in args.batches.split(",")],
            [int(b) for b in args.hf_batches.split(",") if b],
            compile_batch,
            emit,
            [v for v in args.variants.split(",") if v],
            args.n,
            samplers=args.samplers.split(","),
            sampling=dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p),
            device=args.device,
            eos_every=args.eos_every,
            hf_compile=not args.no_hf_compile,
            attentions=args.decode_attention.split(","),
        )
    if args.check:
        checks(emit, [getattr(torch, d) for d in args.check_dtypes.split(",")])
    if args.profile:
        sampler = args.samplers.split(",")[-1]
        for attention in args.decode_attention.split(","):
            for batch in [int(b) for b in args.profile_batches.split(",")]:
                profile(
                    batch,
                    shape=args.profile_shape,
                    device=args.device,
                    decode_attention=attention,
                    stack=args.profile_stack,
                    sampler=sampler,
                )


if __name__ == "__main__":
    main()
