"""Block-diagonal causal attention over packed sequences, as a transformers attention implementation.

:func:`enable_packed_attention` switches a Hugging Face model to the attention implementation
``"klppo_packed"`` registered here. It behaves exactly as ``"sdpa"`` for ordinary padded batches; when the
forward receives ``cu_seq_lens_q`` (the packed path of :mod:`klppo.batching.packing` passes it), the
``[1, T]`` row is treated as independent sequences ``[cu[i], cu[i+1])``, each attending causally to
itself only, through the first backend available:

==============  ========================================================  ====================
backend         kernel                                                    used when
==============  ========================================================  ====================
flash_attn      ``flash_attn.flash_attn_varlen_func``                     flash-attn installed, CUDA,
bf16/fp16 torch_varlen    ``torch.nn.attention.varlen.varlen_attn`` (FlashAttention  CUDA, bf16/fp16
                inside PyTorch ≥ 2.9)
flex            FlexAttention with a document mask (compiled)             CUDA
sdpa_block      SDPA with an explicit ``[T, T]`` block-causal bool mask    anything (CPU tests)
==============  ========================================================  ====================

``set_packed_attention_backend(name)`` forces one (benchmarks, tests). The mask function registered for
``"klppo_packed"`` builds no ``[T, T]`` mask for packed rows (``attention_mask=None``), so the varlen
kernels cost O(Σ Lᵢ²) and no O(T²) memory; only ``sdpa_block`` materialises it. Sliding-window layers
are not supported on the packed path (Qwen2.5 and Llama configs use none).

Without :func:`enable_packed_attention` the packed forward still gives the right answer with the stock
``sdpa`` / ``eager`` / ``flex_attention`` / ``flash_attention_2`` implementations, because transformers
detects packed rows from position ids that restart at 0 — but ``sdpa`` then attends over a dense
``[T, T]`` mask (slow on long rows).
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

PACKED_ATTENTION = "klppo_packed"
BACKENDS = ("flash_attn", "torch_varlen", "flex", "sdpa_block")
_forced_backend: str | None = None
_mask_cache: dict[tuple, object] = {}


def set_packed_attention_backend(name: str | None) -> None:
    """Force a packed-attention backend for the whole process (``None`` = choose automatically)."""
    global _forced_backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"unknown packed attention backend {name!r}; expected one of {BACKENDS}")
    _forced_backend = name


@functools.cache
def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func  # noqa: PLC0415  optional: flash-attn is not a dependency
    except Exception:
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: PLC0415  optional: only in newer torch builds
    except Exception:
        return None
    return varlen_attn


def packed_attention_backend(device: torch.device, dtype: torch.dtype) -> str:
    """The backend that packed attention uses for tensors on ``device`` of ``dtype``."""
    if _forced_backend is not None:
        return _forced_backend
    if device.type == "cuda":
        if dtype in (torch.float16, torch.bfloat16):
            if _flash_attn_varlen() is not None:
                return "flash_attn"
            if _torch_varlen() is not None:
                return "torch_varlen"
        return "flex"
    return "sdpa_block"


def _document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """[T] index of the sequence each packed token belongs to."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(
        torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=total
    )


def _capturing() -> bool:
    """A CUDA graph is being captured on this thread's stream (:mod:`klppo.roles.graphed`)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _cached(kind: str, cu_seqlens: torch.Tensor, total: int, build):
    # All layers of one forward receive the same cu_seqlens tensor: build the mask once per forward. A CUDA
    # graph's capture (klppo.roles.graphed) finds no mask built outside it (capture in the key): a mask from
    # the warm-up on the same static tensor would be read by every replay, whatever cu_seqlens holds then,
    # and freed at the cache's next clear; the capture's first layer builds it inside the graph.
    key = (kind, cu_seqlens.data_ptr(), cu_seqlens.numel(), total, cu_seqlens.device, _capturing())
    hit = _mask_cache.get(key)
    if hit is not None and hit[0] is cu_seqlens:
        return hit[1]
    _mask_cache.clear()
    value = build()
    _mask_cache[key] = (cu_seqlens, value)
    return value


def _sdpa_block(q, k, v, cu_seqlens, scaling):
    """q [Hq, T, D], k/v [Hkv, T, D] → [Hq, T, D] with a dense block-causal mask (built once per forward)."""
    total = q.shape[1]

    def build():
        doc = _document_ids(cu_seqlens, total)
        pos = torch.arange(total, device=q.device)
        return (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])

    mask = _cached("sdpa", cu_seqlens, total, build)
    return F.scaled_dot_product_attention(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        attn_mask=mask,
        scale=scaling,
        enable_gqa=q.shape[0] != k.shape[0],
    ).squeeze(0)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def _flex(q, k, v, cu_seqlens, scaling):
    total = q.shape[1]

    def build():
        doc = _document_ids(cu_seqlens, total)

        def document_causal(b, h, q_idx, kv_idx):
            return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

        return create_block_mask(document_causal, None, None, total, total, device=q.device)

    block_mask = _cached("flex", cu_seqlens, total, build)
    out = _compiled_flex()(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        block_mask=block_mask,
        scale=scaling,
        enable_gqa=q.shape[0] != k.shape[0],
    )
    return out.squeeze(0)


@functools.cache
def _torch_varlen_params() -> frozenset[str]:
    """The keyword names of this torch's ``varlen_attn`` (they changed across releases)."""
    return frozenset(inspect.signature(_torch_varlen()).parameters)


def _torch_varlen_call(q, k, v, cu_seqlens, max_len, scaling):
    """q [T, Hq, D], k/v [T, Hkv, D] → [T, Hq, D] through PyTorch's varlen FlashAttention."""
    fn, params = _torch_varlen(), _torch_varlen_params()
    kwargs = {"scale": scaling}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if "is_causal" in params:
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    cu = cu_seqlens.to(torch.int32)
    return fn(q, k, v, cu, cu, max_len, max_len, **kwargs)


@torch.compiler.disable
def _varlen_attention(q, k, v, cu_seqlens, max_len: int, scaling: float) -> torch.Tensor:
    """q [1, Hq, T, D], k/v [1, Hkv, T, D] → [1, T, Hq, D] block-diagonal causal attention. Opaque to
    ``torch.compile`` (compiled decoder layers, :mod:`klppo.models.compiled_layers`, run it eager between
    their compiled parts): the kernels are the same, and the backend choice and mask cache stay Python."""
    backend = packed_attention_backend(q.device, q.dtype)
    if backend in ("flash_attn", "torch_varlen"):
        qt, kt, vt = (x.squeeze(0).transpose(0, 1) for x in (q, k, v))  # [T, H, D]
        if backend == "flash_attn":
            cu = cu_seqlens.to(torch.int32)
            out = _flash_attn_varlen()(
                qt, kt, vt, cu, cu, max_len, max_len, softmax_scale=scaling, causal=True
            )
        else:
            out = _torch_varlen_call(qt, kt, vt, cu_seqlens, max_len, scaling)
        return out.unsqueeze(0)
    q0, k0, v0 = q.squeeze(0), k.squeeze(0), v.squeeze(0)
    if backend == "flex":
        out = _flex(q0, k0, v0, cu_seqlens, scaling)
    else:
        out = _sdpa_block(q0, k0, v0, cu_seqlens, scaling)  # [Hq, T, D]
    return out.transpose(0, 1).unsqueeze(0)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q [B, Hq, S, D], k/v [B, Hkv, S, D] → ([B, S, Hq, D], None)."""

    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is None:
        if attention_mask is not None and attention_mask.dtype == torch.bool and attention_mask.dim() == 4:
            # Queries on left padding see no key at all; CUDA SDPA kernels can return NaN for such rows
            # and the NaN reaches the weight gradients (0 · NaN). Let them see themselves: finite garbage
            # on padding only, real tokens never attend to padding.
            q_len, kv_len = attention_mask.shape[-2:]
            if q_len == kv_len:
                dead = ~attention_mask.any(dim=-1, keepdim=True)
                eye = torch.eye(q_len, dtype=torch.bool, device=attention_mask.device)
                attention_mask = attention_mask | (dead & eye)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects one packed row, got batch {query.shape[0]}")
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("sliding-window attention is not supported on the packed path")
    if dropout:
        raise NotImplementedError("attention dropout is not supported on the packed path")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    max_len = kwargs.get("max_length_q")
    if max_len is None:
        max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return _varlen_attention(query, key, value, cu_seqlens, int(max_len), scaling), None


def _packed_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """Mask function for ``klppo_packed``: none for packed/plain-causal rows, sdpa's mask for padded ones."""

    if attention_mask is None:
        return None
    q_offset = kwargs.get("q_offset", 0)
    if kwargs.get("q_length") == kwargs.get("kv_length") and isinstance(q_offset, int) and q_offset == 0:
        # a whole-sequence forward (the padded training passes): always the explicit mask. Asking whether
        # SDPA's is_causal could replace it reads the padding on the host, a device sync per forward, and
        # these batches are left-padded anyway.
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


@functools.cache
def register_packed_attention() -> str:
    """Register ``"klppo_packed"`` with transformers (idempotent); returns its name."""

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, _packed_mask)
    return PACKED_ATTENTION


def enable_packed_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` (a transformers PreTrainedModel) to the ``klppo_packed`` attention implementation."""
    name = register_packed_attention()
    model.set_attn_implementation(name)
    if getattr(model.config, "_attn_implementation", None) != name:
        raise RuntimeError(f"{type(model).__name__} refused attention implementation {name!r}")
