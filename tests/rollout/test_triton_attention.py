"""Split-KV decode attention fused with the cache write (:mod:`klppo.rollout.triton_attention`): the torch
reference against float64 loops (CPU); the Triton kernels against the reference in Triton's CPU
interpreter (fp16 and fp32: the interpreter's ``tl.dot`` mishandles bf16) and on CUDA (bf16, fp16);
``llama.decode`` on the split-KV attention, and the split layers with RoPE in the attention, against masked
SDPA (CPU: the reference path); which backend runs where."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from klppo.models.llama_weights import LlamaWeights
from klppo.models.tiny import build_tiny_model
from klppo.rollout import backends, triton_attention, triton_layers
from klppo.rollout.llama import decode, decode_rope_in_attention, prefill, triton_attention_of
from klppo.rollout.settings import EngineSettings
from klppo.rollout.triton_attention import decode_attention_reference, num_splits
from tests.rollout.conftest import HAS_TRITON, run_triton_interpreted

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
ROUNDING = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}  # one unit in the last place


def _inputs(case, dtype, device="cpu", seed=0):
    batch, heads, kv_heads, dim, max_len, positions, _ = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, dim, generator=g)
    kv_new = torch.randn(2, batch, kv_heads, dim, generator=g)
    cache = torch.randn(2, batch + 1, max_len, kv_heads, dim, generator=g)  # one spare slot, untouched
    cache[:, :, -1] = float("nan")  # stale entries past a slot's length must not be read (the full slot's row
    # S - 1 is overwritten by its new token)
    return (*(t.to(device, dtype) for t in (q, kv_new, cache)), torch.tensor(positions, device=device))


def _rope(case, dtype, device="cpu", seed=1):
    """cos, sin [B, D] of random angles, one per slot and dimension (each of the D entries differs, so a
    wrong partner or sign in the rotation shows)."""
    batch, dim = case[0], case[3]
    angles = torch.rand(batch, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 6.3
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def _rotated64(x, cos, sin):
    """float64, one dimension at a time: x[d]·cos[d] − x[d + D/2]·sin[d] (first half), x[d]·cos[d] +
    x[d − D/2]·sin[d] (second half), for x [B, H, D] and cos/sin [B, D]."""
    x, cos, sin = x.double(), cos.double(), sin.double()
    half = x.shape[-1] // 2
    out = torch.empty_like(x)
    for d in range(x.shape[-1]):
        other = -x[..., d + half] if d < half else x[..., d - half]
        out[..., d] = x[..., d] * cos[:, None, d] + other * sin[:, None, d]
    return out


def naive(q, kv_new, cache, positions, rope=None):
    """float64 loops: the expected cache (new K/V written) and attention [B, H, D]; ``rope``: q and the
    new K rotated first."""
    q, kv_new, cache = q.double(), kv_new.double(), cache.double().clone()
    if rope is not None:
        q = _rotated64(q, *rope)
        kv_new = torch.stack((_rotated64(kv_new[0], *rope), kv_new[1]))
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


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_reference_equals_float64_loops(case, rope) -> None:
    q, kv_new, cache, positions = _inputs(case, torch.float32)
    cos_sin = _rope(case, torch.float32) if rope else None
    want_cache, want = naive(q, kv_new, cache, positions, cos_sin)
    out = decode_attention_reference(q, kv_new, cache, positions, rope=cos_sin)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    # written (the rotated K rounded to float32 once), the rest unchanged
    torch.testing.assert_close(cache.double().nan_to_num(7.0), want_cache.nan_to_num(7.0), atol=1e-6, rtol=0)


def test_num_splits_fill_the_device_and_stop_at_one_when_the_batch_does() -> None:
    assert num_splits(64, 2, 512, 132) == 3  # 128 programs → 3 chunks each: 384 ≥ 2 × 132
    assert num_splits(256, 2, 512, 132) == 1  # 512 programs already: no combine
    assert num_splits(1, 2, 512, 132) == 8  # at most one chunk per 64 rows of the cache
    assert num_splits(1, 1, 8192, 132) == 32  # MAX_SPLITS
    assert num_splits(4, 2, 40, 132) == 1  # shorter than one block


def check_kernels(device: str, dtypes) -> None:
    """The kernels against the reference on every case (both from the same inputs; the cache written)."""
    from klppo.rollout.triton_attention import decode_attention_triton  # needs triton (skipped without)

    for case, dtype, rope in itertools.product(CASES, dtypes, (False, True)):
        q, kv_new, cache, positions = _inputs(case, dtype, device)
        cos_sin = _rope(case, dtype, device) if rope else None
        want_cache = cache.clone()
        want = decode_attention_reference(q, kv_new, want_cache, positions, rope=cos_sin)
        out = decode_attention_triton(q, kv_new, cache, positions, splits=case[-1], rope=cos_sin)
        msg = f"{case} {dtype} rope={rope}"
        torch.testing.assert_close(out.float(), want.float(), atol=TOLERANCE[dtype], rtol=0, msg=msg)
        # the new K rotated in float32 and rounded once on both sides (an FMA may differ in the last bit)
        torch.testing.assert_close(
            cache.nan_to_num(7.0),
            want_cache.nan_to_num(7.0),
            atol=ROUNDING[dtype],
            rtol=ROUNDING[dtype],
            msg=msg,
        )
        if device == "cuda":  # the default split count of this GPU, and q/K/V as views of one qkv row
            qkv = torch.cat([q.flatten(1), kv_new.transpose(0, 1).flatten(1)], dim=-1)
            heads, kv_heads, dim = q.shape[1], kv_new.shape[2], q.shape[2]
            q_view = qkv[:, : heads * dim].view_as(q)
            kv_view = qkv[:, heads * dim :].view(q.shape[0], 2, kv_heads, dim).transpose(0, 1)
            again = decode_attention_triton(q_view, kv_view, cache.clone(), positions, rope=cos_sin)
            torch.testing.assert_close(again.float(), want.float(), atol=TOLERANCE[dtype], rtol=0, msg=msg)


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
    """``llama.decode`` on :func:`triton_attention_of` (off CUDA: the reference, which writes the cache
    itself) gives the logits and the cache of the SDPA path after an index_put write."""
    model = build_tiny_model(arch="qwen2", num_heads=4, num_kv_heads=2).eval()
    w = LlamaWeights.read(model)
    kv = torch.zeros(len(w.layers), 2, 3, 16, w.num_kv_heads, w.head_dim)
    prefill(w, kv, torch.tensor([1, 5, 9, 3, 4, 2]), torch.tensor([0, 1, 2]), [3, 1, 2])
    tokens, positions = torch.tensor([7, 8, 9]), torch.tensor([3, 1, 2])
    kv_sdpa = kv.clone()
    with torch.no_grad():
        logits = decode(w, kv, tokens, positions, attention=triton_attention_of)
        want = decode(w, kv_sdpa, tokens, positions)
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(kv, kv_sdpa, atol=1e-6, rtol=0)


def _random_norms_and_biases(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every norm weight and bias random (Hugging Face makes them ones and zeros, under
    which a dropped bias or a swapped norm weight changes nothing)."""
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_((1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g))
    return model


def _tiny(arch: str) -> torch.nn.Module:
    """A three-layer tiny model; ``llama-bias``: Llama with every projection's bias (o, gate/up, down too)."""
    model = build_tiny_model(arch=arch.removesuffix("-bias"), num_heads=4, num_kv_heads=2, num_layers=3)
    if arch.endswith("-bias"):
        config = model.config
        config.attention_bias = config.mlp_bias = True
        torch.manual_seed(0)
        model = type(model)(config)
    return _random_norms_and_biases(model).eval()


@pytest.mark.parametrize(
    ("arch", "fuse"),
    [
        ("qwen2", True),
        ("qwen2", False),
        ("llama", True),
        ("llama-bias", True),
        ("llama-bias", False),
        ("qwen3", True),
    ],
)
def test_decode_with_rope_in_attention_equals_masked_sdpa(arch, fuse) -> None:
    """``llama.decode_rope_in_attention`` — split layers (here their torch path), the attention (here its
    reference) rotating q and K — gives the logits and the cache of the unsplit SDPA path over three steps:
    q/k/v biases (qwen2), none (llama), every bias (llama-bias: o, gate/up, down too), per-head q/k norms
    (qwen3),
    fused and separate projections; norm weights and biases random."""
    model = _tiny(arch)
    w = LlamaWeights.read(model)
    w = w.fuse() if fuse else w
    kv = torch.zeros(len(w.layers), 2, 3, 16, w.num_kv_heads, w.head_dim)
    prefill(w, kv, torch.tensor([1, 5, 9, 3, 4, 2]), torch.tensor([0, 1, 2]), [3, 1, 2])
    kv_sdpa = kv.clone()
    tokens, positions = torch.tensor([7, 8, 9]), torch.tensor([3, 1, 2])
    with torch.no_grad():
        for _ in range(3):
            logits = decode_rope_in_attention(w, kv, tokens, positions, triton_layers.SPLIT_LAYER_FNS)
            want = decode(w, kv_sdpa, tokens, positions)
            torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
            # the third layer's K carries two layers of float32 rounding in another order (about 1e-6); a
            # dropped bias or rotation is ≥ 1e-2
            torch.testing.assert_close(kv, kv_sdpa, atol=5e-6, rtol=0)
            tokens, positions = want.argmax(-1), positions + 1


@pytest.mark.parametrize(
    ("setting", "device", "dtype", "has_triton", "tensor_parallel", "want"),
    [
        ("auto", "cuda", torch.bfloat16, True, False, backends.SplitBackend),
        ("auto", "cuda", torch.float16, True, False, backends.SplitBackend),
        ("auto", "cuda", torch.float16, False, False, backends.TorchBackend),  # no triton
        ("auto", "cuda", torch.float32, True, False, backends.TorchBackend),  # fp32 cache
        ("auto", "cpu", torch.bfloat16, True, False, backends.TorchBackend),
        ("sdpa", "cuda", torch.bfloat16, True, False, backends.TorchBackend),
        ("auto", "cuda", torch.bfloat16, True, True, backends.TensorParallelBackend),
        ("sdpa", "cpu", torch.float32, False, True, backends.TensorParallelBackend),
    ],
)
def test_backend_choice(monkeypatch, setting, device, dtype, has_triton, tensor_parallel, want) -> None:
    """Which backend runs a cache of ``dtype`` on ``device`` for each ``decode_attention`` setting (only the
    device type is read, so a CPU machine checks the CUDA branches)."""
    monkeypatch.setattr(
        triton_attention, "available", lambda d: has_triton and torch.device(d).type == "cuda"
    )
    settings = EngineSettings(decode_attention=setting)
    assert (
        backends.backend_class(settings, torch.device(device), dtype, tensor_parallel=tensor_parallel) is want
    )
