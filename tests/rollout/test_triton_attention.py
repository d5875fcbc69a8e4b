"""Split-KV decode attention fused with the cache write (:mod:`klppo.rollout.triton_attention`): the torch
reference against float64 loops (CPU); the Triton kernels against the reference in Triton's CPU
interpreter (fp16 and fp32: the interpreter's ``tl.dot`` mishandles bf16) and on CUDA (bf16, fp16);
``llama.decode`` with ``flash="triton"`` against masked SDPA (CPU: the reference path); the engine with
``decode_attention="triton"`` against ``flash`` (CUDA graphs)."""

from __future__ import annotations

import math

import pytest
import torch

from klppo.models.tiny import build_tiny_model
from klppo.rollout.base import SamplingParams
from klppo.rollout.engine import KLPPORollout
from klppo.rollout.llama import LlamaWeights, decode, prefill
from klppo.rollout.triton_attention import decode_attention_reference, num_splits
from tests.rollout.conftest import HAS_TRITON, left_padded, run_triton_interpreted

# (B, H, H_kv, D, S, positions, splits): position 0, a full cache (S - 1), GQA groups 1/2/7, D not a power
# of two, chunks past a short slot's length, the last chunk partial (S = 200 at 3 splits: 64+64+72 rows)
CASES = [
    (3, 4, 2, 16, 40, [0, 17, 39], 1),
    (3, 4, 2, 16, 40, [0, 17, 39], 3),
    (2, 14, 2, 64, 200, [199, 130], 3),
    (4, 6, 6, 32, 128, [5, 64, 127, 63], 2),
    (2, 8, 2, 24, 96, [95, 0], 4),
    (5, 7, 1, 64, 300, [299, 1, 150, 64, 0], 5),
]
# bf16/fp16 output: the result rounded once (≤ 2⁻⁸ relative, bf16) plus P rounded to bf16 before P·V
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _inputs(case, dtype, device="cpu", seed=0):
    batch, heads, kv_heads, dim, max_len, positions, _ = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g)
    kv_new = torch.randn(2, batch, kv_heads, dim, generator=g)
    cache = torch.randn(2, batch + 1, max_len, kv_heads, dim, generator=g)  # one spare slot, untouched
    cache[:, :, -1] = float("nan")  # stale entries past a slot's length must not be read (the full slot's row
    # S - 1 is overwritten by its new token)
    return (*(t.to(device, dtype) for t in (q, kv_new, cache)), torch.tensor(positions, device=device))


def naive(q, kv_new, cache, positions):
    """float64 loops: the expected cache (new K/V written) and attention [B, H, D]."""
    q, kv_new, cache = q.double(), kv_new.double(), cache.double().clone()
    batch, heads, dim = q.shape
    group = heads // cache.shape[3]
    out = torch.zeros_like(q)
    for b in range(batch):
        p = int(positions[b])
        cache[:, b, p] = kv_new[:, b]
        for h in range(heads):
            k, v = cache[0, b, : p + 1, h // group], cache[1, b, : p + 1, h // group]
            scores = torch.stack([k[n] @ q[b, h] for n in range(p + 1)]) / math.sqrt(dim)
            weights = torch.exp(scores - scores.max())
            out[b, h] = (weights[:, None] * v).sum(0) / weights.sum()
    return cache, out


@pytest.mark.parametrize("case", CASES)
def test_reference_equals_float64_loops(case) -> None:
    q, kv_new, cache, positions = _inputs(case, torch.float32)
    want_cache, want = naive(q, kv_new, cache, positions)
    out = decode_attention_reference(q, kv_new, cache, positions)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    assert torch.equal(cache.double().nan_to_num(7.0), want_cache.nan_to_num(7.0))  # written, rest unchanged


def test_num_splits_fill_the_device_and_stop_at_one_when_the_batch_does() -> None:
    assert num_splits(64, 2, 512, 132) == 3  # 128 programs → 3 chunks each: 384 ≥ 2 × 132
    assert num_splits(256, 2, 512, 132) == 1  # 512 programs already: no combine
    assert num_splits(1, 2, 512, 132) == 8  # at most one chunk per 64 rows of the cache
    assert num_splits(1, 1, 8192, 132) == 32  # MAX_SPLITS
    assert num_splits(4, 2, 40, 132) == 1  # shorter than one block


def check_kernels(device: str, dtypes) -> None:
    """The kernels against the reference on every case (both from the same inputs; the cache written)."""
    from klppo.rollout.triton_attention import decode_attention_triton  # needs triton (skipped without)

    for case in CASES:
        for dtype in dtypes:
            q, kv_new, cache, positions = _inputs(case, dtype, device)
            want_cache = cache.clone()
            want = decode_attention_reference(q, kv_new, want_cache, positions)
            out = decode_attention_triton(q, kv_new, cache, positions, splits=case[-1])
            torch.testing.assert_close(
                out.float(), want.float(), atol=TOLERANCE[dtype], rtol=0, msg=str(case)
            )
            assert torch.equal(cache.nan_to_num(7.0), want_cache.nan_to_num(7.0)), case
            if device == "cuda":  # the default split count of this GPU, and a strided q (the fused front's)
                wide = torch.cat([q, q], dim=-1)[..., : q.shape[-1]]
                again = decode_attention_triton(wide, kv_new, cache.clone(), positions)
                torch.testing.assert_close(again.float(), want.float(), atol=TOLERANCE[dtype], rtol=0)


CHILD = """
import torch
from tests.rollout.test_triton_attention import check_kernels
check_kernels("cpu", [torch.float16, torch.float32])
print("OK")
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package (its CPU interpreter)")
def test_kernels_in_the_interpreter() -> None:
    run_triton_interpreted(CHILD, timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_kernels_on_gpu() -> None:
    check_kernels("cuda", [torch.bfloat16, torch.float16])


def test_decode_with_the_fused_write_equals_masked_sdpa() -> None:
    """``llama.decode(flash="triton")`` (off CUDA: the reference, which writes the cache itself) gives the
    logits and the cache of the SDPA path after an index_put write."""
    model = build_tiny_model(arch="qwen2", num_heads=4, num_kv_heads=2).eval()
    w = LlamaWeights.read(model)
    kv = torch.zeros(len(w.layers), 2, 3, 16, w.num_kv_heads, w.head_dim)
    prefill(w, kv, torch.tensor([1, 5, 9, 3, 4, 2]), torch.tensor([0, 1, 2]), [3, 1, 2])
    tokens, positions = torch.tensor([7, 8, 9]), torch.tensor([3, 1, 2])
    kv_sdpa = kv.clone()
    with torch.no_grad():
        logits = decode(w, kv, tokens, positions, flash="triton")
        want = decode(w, kv_sdpa, tokens, positions, flash=None)
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(kv, kv_sdpa, atol=1e-6, rtol=0)


def test_triton_decode_attention_needs_cuda_and_triton() -> None:
    prompts, mask = left_padded([[1, 5, 9], [3, 4]])
    engine = KLPPORollout(eos_token_ids=[2], pad_token_id=2, decode_attention="triton")
    with pytest.raises(ValueError, match="actor_rollout_ref.rollout.decode_attention=triton .* needs"):
        engine.generate(build_tiny_model().eval(), prompts, mask, SamplingParams(max_new_tokens=2))


@pytest.mark.parametrize(
    ("setting", "device", "dtype", "has_triton", "want"),
    [
        ("auto", "cuda", torch.bfloat16, True, "triton"),  # measured faster than flash (bench/RESULTS.md)
        ("auto", "cuda", torch.float16, False, "packed"),  # no triton: flash varlen
        ("auto", "cuda", torch.float32, True, None),  # fp32 cache: masked SDPA
        ("auto", "cpu", torch.bfloat16, True, None),
        ("flash", "cuda", torch.bfloat16, True, "packed"),
        ("flash-plain", "cuda", torch.bfloat16, True, "plain"),
        ("sdpa", "cuda", torch.bfloat16, True, None),
        ("triton", "cuda", torch.bfloat16, True, "triton"),
    ],
)
def test_decode_attention_choice(monkeypatch, setting, device, dtype, has_triton, want) -> None:
    """What each ``decode_attention`` setting hands to ``decode`` for a cache (only its device and dtype are
    read, so a stand-in object checks the CUDA branches on a CPU machine)."""
    from types import SimpleNamespace

    from klppo.rollout import triton_attention

    monkeypatch.setattr(
        triton_attention, "available", lambda d: has_triton and torch.device(d).type == "cuda"
    )
    kv = SimpleNamespace(device=torch.device(device), dtype=dtype)
    engine = KLPPORollout(eos_token_ids=[2], pad_token_id=2, decode_attention=setting)
    assert engine._use_flash(kv) == want


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_engine_greedy_tokens_equal_flash_on_gpu() -> None:
    """fp16 greedy, CUDA graphs and compiled layers, 40 steps: the same tokens as the flash path, log-probs
    within fp16 rounding."""
    model = build_tiny_model(arch="qwen2").to("cuda", torch.float16).eval()
    prompts, mask = (t.cuda() for t in left_padded([[1, 10, 20, 30, 40, 50], [1, 7, 8], [5], [1, 99, 100]]))
    params = SamplingParams(max_new_tokens=40, do_sample=False, ignore_eos=True)
    outs = [
        KLPPORollout(eos_token_ids=[2], pad_token_id=2, decode_attention=a).generate(
            model, prompts, mask, params
        )
        for a in ("flash", "triton")
    ]
    assert torch.equal(outs[0].responses, outs[1].responses)
    torch.testing.assert_close(outs[0].log_probs, outs[1].log_probs, atol=1e-2, rtol=0)
