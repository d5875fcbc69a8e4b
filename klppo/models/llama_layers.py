"""The Llama-family decoder layer as functions of :class:`klppo.models.llama_weights.LayerWeights`: RMSNorm,
RoPE, the q/k/v projections (fused or not, with Qwen3's q/k norms), the output projection and the SwiGLU MLP,
computed as Hugging Face computes them, and the tensor-parallel forms of the embedding and the layer back.
The rollout engine's prefill and decode (:mod:`klppo.rollout.llama`) and its Triton layer kernels' reference
are built from these.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from klppo.models.llama_weights import LayerWeights

if TYPE_CHECKING:
    from klppo.models.llama_weights import LlamaWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * (x / sqrt(mean(x²) + eps))`` computed in float32, as Hugging Face does."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_cos_sin(w: LlamaWeights, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, D] for integer ``positions`` [T]."""
    freqs = positions[:, None].float() * w.inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * w.attention_scaling).to(dtype), (emb.sin() * w.attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` for ``gate_up`` = [gate | up] (the last dim's halves)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def mlp(
    lw: LayerWeights, h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor] = swiglu
) -> torch.Tensor:
    """The SwiGLU MLP of normed states ``h``; ``act``: :func:`swiglu` on the fused projection, or a kernel."""
    if lw.gate_up is not None:
        act_out = act(F.linear(h, lw.gate_up, lw.gate_up_bias))
    else:
        act_out = F.silu(F.linear(h, lw.gate, lw.gate_bias)) * F.linear(h, lw.up, lw.up_bias)
    return F.linear(act_out, lw.down, lw.down_bias)


def attn_in(
    x: torch.Tensor, lw: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, spec: tuple[int, int, int, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer front: norm, q/k/v (fused if ``lw.qkv``), q/k norm, RoPE. ``spec`` = (H, H_kv, D, eps).

    x [T, hidden] → q [T, H, D], kv_new [2, T, H_kv, D] (roped K stacked with V, ready for one cache write).
    """
    q, k, v = qkv_heads(rms_norm(x, lw.input_norm, spec[3]), lw, spec)
    return apply_rope(q, cos, sin), torch.stack((apply_rope(k, cos, sin), v))


def qkv_heads(
    h: torch.Tensor, lw: LayerWeights, spec: tuple[int, int, int, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed ``h`` [T, hidden] → q [T, H, D], k, v [T, H_kv, D]: projections and Qwen3's q/k norms."""
    num_heads, num_kv_heads, head_dim, eps = spec
    num_tokens = h.shape[0]
    if lw.qkv is not None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        q, k, v = F.linear(h, lw.qkv, lw.qkv_bias).split(sizes, dim=-1)
    else:
        q, k, v = F.linear(h, lw.q, lw.q_bias), F.linear(h, lw.k, lw.k_bias), F.linear(h, lw.v, lw.v_bias)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, eps)
    if lw.k_norm is not None:
        k = rms_norm(k, lw.k_norm, eps)
    return q, k, v


def qkv_projection(h: torch.Tensor, lw: LayerWeights, spec: tuple[int, int, int, float]) -> torch.Tensor:
    """Normed ``h`` [T, hidden] → unrotated q/k/v side by side [T, (H + 2·H_kv)·D]: the fused GEMM's output
    itself unless Qwen3's q/k norms apply."""
    if lw.qkv is not None and lw.q_norm is None and lw.k_norm is None:
        return F.linear(h, lw.qkv, lw.qkv_bias)
    return torch.cat([t.flatten(1) for t in qkv_heads(h, lw, spec)], dim=-1)


def residual_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` in float32 rounded once (eager's bf16/fp16 result), so that Inductor fuses it into the
    sum's reader instead of a cuBLAS ``addmm`` that first copies ``x`` into the output."""
    return (x.float() + y.float()).to(x.dtype)


def attn_out_mlp(x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights, eps: float) -> torch.Tensor:
    """Decode-step layer back: output projection, residual (:func:`residual_add`), norm, SwiGLU MLP,
    residual."""
    x = residual_add(x, F.linear(attn, lw.o, lw.o_bias))
    return x + mlp(lw, rms_norm(x, lw.post_norm, eps))


def attn_out_mlp_tp(
    x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights, eps: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """``attn_out_mlp`` on tensor-parallel slices (:mod:`klppo.parallel.tp_weights`): the row-parallel ``o``
    and ``down`` partial sums are all-reduced over ``group`` before the replicated biases and residuals."""
    y = F.linear(attn, lw.o)
    dist.all_reduce(y, group=group)
    x = x + y if lw.o_bias is None else x + y + lw.o_bias
    h = rms_norm(x, lw.post_norm, eps)
    if lw.gate_up is not None:
        gate, up = F.linear(h, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
    else:
        gate, up = F.linear(h, lw.gate, lw.gate_bias), F.linear(h, lw.up, lw.up_bias)
    m = F.linear(F.silu(gate) * up, lw.down)
    dist.all_reduce(m, group=group)
    return x + m if lw.down_bias is None else x + m + lw.down_bias


def layer_back(w: LlamaWeights):
    """The eager layer back for ``w``: ``attn_out_mlp``, or its tensor-parallel form."""
    if w.tp is None:
        return attn_out_mlp
    group = w.tp.group
    return lambda x, attn, lw, eps: attn_out_mlp_tp(x, attn, lw, eps, group)


def embed_tokens(w: LlamaWeights, tokens: torch.Tensor) -> torch.Tensor:
    """[T] ids → [T, hidden]; tensor parallel: each rank's vocabulary rows (zeros elsewhere), summed."""
    if w.tp is None:
        return F.embedding(tokens, w.embed)
    local = tokens - w.vocab_start
    inside = (local >= 0) & (local < w.embed.shape[0])
    x = F.embedding(local.clamp(0, w.embed.shape[0] - 1), w.embed) * inside[:, None].to(w.embed.dtype)
    dist.all_reduce(x, group=w.tp.group)
    return x
