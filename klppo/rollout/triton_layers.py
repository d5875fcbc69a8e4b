"""The split decode layers' elementwise work as two small Triton kernels: no ``torch.compile`` on the path.

The split decode layers of the fast backend (:func:`klppo.rollout.llama.decode_rope_in_attention`) are
GEMMs and the Triton attention with elementwise work between them: the residual add with the RMSNorm that
reads it, and SwiGLU's ``silu(gate) · up``. Inductor would fuse the same kernels, at the cost of its import,
dynamo's trace and compilation in every new process; two Triton kernels load from Triton's cache in
milliseconds.

The arithmetic is eager PyTorch's, rounding for rounding (:func:`klppo.models.llama_layers.residual_add`,
:func:`~klppo.models.llama_layers.rms_norm`, ``F.silu(gate) * up``):

- ``add_rms_norm(x, m, w, eps)``: ``s = round(x + m)`` (float32, rounded once to the dtype; ``m`` None: ``s
  = x``), ``h = round(w · round(s · rsqrt(mean(s²) + eps)))``, the mean and the product in float32;
- ``silu_mul(gate_up)``: ``round(round(g / (1 + exp(−g))) · u)`` for ``gate_up`` = [gate | up], in float32.

What can differ from eager is below the last rounding: the reduction's order, Triton's fast square root
and division in ``1 / sqrt(mean + eps)`` (eager's ``rsqrt`` is also approximate) and the exponential's last
bits — within 8 ulp, and a rounding moved in under 2% of entries (tests/rollout/test_triton_layers.py holds
them to that on the GPU in bf16, fp16 and fp32). The layer functions
(``attn_in_qkv``, ``attn_out_mlp_split``, ``final_norm``) are the split layers' front, back and final norm;
what the kernels do not take (Qwen3's per-head q/k norms, unfused gate/up)
runs as eager torch inside them. Off CUDA (or without triton) the functions compute the same eagerly: the
reference the kernels are tested against.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from klppo.models.llama_layers import mlp, qkv_projection, residual_add, rms_norm, swiglu
from klppo.models.llama_weights import LayerWeights

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path only
    triton = None

_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"  # the CPU tests' kernels (CPU tensors)
MAX_HIDDEN = 16384  # one row per program in registers: the RMSNorm kernel's limit (the torch path above it)
SILU_BLOCK = 1024  # columns per program of the SwiGLU kernel


def _kernels_take(x: torch.Tensor, *others: torch.Tensor | None, max_cols: int | None = MAX_HIDDEN) -> bool:
    """Whether the kernels run on ``x`` (rows of the last dim, contiguous; at most ``max_cols`` columns: the
    norm's row in registers; None: no limit) with ``others`` of its dtype; CPU tests reach the kernels
    through Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors)."""
    if (
        triton is None
        or x.dim() != 2
        or x.stride(-1) != 1
        or (max_cols is not None and x.shape[-1] > max_cols)
    ):
        return False
    if not (x.is_cuda or _INTERPRETED):
        return False
    return all(t is None or (t.dtype == x.dtype and t.stride(-1) == 1) for t in others)


def add_rms_norm(
    x: torch.Tensor, m: torch.Tensor | None, weight: torch.Tensor, eps: float, *, num_warps: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(``x + m`` rounded once, its RMSNorm with ``weight``) — ``m`` None: (``x``, the norm of ``x``); see
    the module docstring. ``x``, ``m`` [T, hidden], ``weight`` [hidden]; ``num_warps``: the launch's
    (None: 4 up to 2048 columns, else 8)."""
    if not _kernels_take(x, m, weight) or (m is not None and m.shape != x.shape):
        s = x if m is None else residual_add(x, m)
        return s, rms_norm(s, weight, eps)
    rows, hidden = x.shape
    s = x if m is None else torch.empty_like(x)
    h = torch.empty_like(x)
    if rows:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(rows,)](
            x,
            x if m is None else m,
            weight,
            s,
            h,
            hidden,
            float(eps),
            x.stride(0),
            0 if m is None else m.stride(0),
            s.stride(0),
            h.stride(0),
            HAS_M=m is not None,
            BLOCK=block,
            num_warps=num_warps or (4 if block <= 2048 else 8),
        )
    return s, h


def silu_mul(gate_up: torch.Tensor, *, block: int = SILU_BLOCK, num_warps: int = 4) -> torch.Tensor:
    """``silu(gate) · up`` for ``gate_up`` [T, 2·I] = [gate | up] (see the module docstring) → [T, I];
    ``block``, ``num_warps``: the launch's (columns per program, warps)."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2 or not _kernels_take(gate_up, max_cols=None):
        return swiglu(gate_up)  # eager's result (and eager's error for an odd width)
    rows, width = gate_up.shape  # blocks of columns: any width
    inter = width // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        grid = (rows, triton.cdiv(inter, block))
        _silu_mul_kernel[grid](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=num_warps
        )
    return out


def attn_in_qkv(
    x: torch.Tensor, m: torch.Tensor | None, lw: LayerWeights, spec: tuple[int, int, int, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer front of the split decode layers: the previous layer's MLP output ``m`` added to the residual
    ``x`` (None: the first layer), norm, q/k/v, Qwen3's q/k norms — no RoPE, which the attention kernel
    applies. ``spec`` = (H, H_kv, D, eps). x, m [T, hidden] → (x + m, qkv [T, (H + 2·H_kv)·D]: q, k, v
    side by side, unrotated)."""
    x, h = add_rms_norm(x, m, lw.input_norm, spec[3])
    return x, qkv_projection(h, lw, spec)


def attn_out_mlp_split(
    x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer back of the split decode layers: ``attn_out_mlp`` without its last residual add —
    (x + o(attn), mlp(norm(·))), whose sum is the layer's output, added by the next layer's front or by
    :func:`final_norm`."""
    x, h = add_rms_norm(x, F.linear(attn, lw.o, lw.o_bias), lw.post_norm, eps)
    return x, mlp(lw, h, silu_mul)


def final_norm(
    x: torch.Tensor, m: torch.Tensor | None, weight_eps: tuple[torch.Tensor, float]
) -> torch.Tensor:
    """The last layer's output ``x + m`` through the final RMSNorm; ``weight_eps`` = (its weight, eps)."""
    weight, eps = weight_eps
    return add_rms_norm(x, m, weight, eps)[1]


SPLIT_LAYER_FNS = (attn_in_qkv, attn_out_mlp_split, final_norm)

if triton is not None:

    @triton.jit
    def _add_rms_norm_kernel(
        x_ptr,
        m_ptr,
        w_ptr,
        s_ptr,
        h_ptr,
        n_cols,
        eps,
        stride_x,
        stride_m,
        stride_s,
        stride_h,
        HAS_M: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """Row ``program_id(0)``: s = round(x + m) (stored when HAS_M), h = round(w · round(s ·
        rsqrt(mean(s²) + eps)))."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dtype = x.dtype
        if HAS_M:
            m = tl.load(m_ptr + row * stride_m + cols, mask=mask, other=0.0)
            x = (x.to(tl.float32) + m.to(tl.float32)).to(dtype)
            tl.store(s_ptr + row * stride_s + cols, x, mask=mask)
        x32 = x.to(tl.float32)
        mean = tl.sum(x32 * x32, axis=0) / n_cols
        normed = (x32 * (1.0 / tl.sqrt(mean + eps))).to(dtype)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        h = (w.to(tl.float32) * normed.to(tl.float32)).to(dtype)
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)

    @triton.jit
    def _silu_mul_kernel(gu_ptr, out_ptr, inter, stride_gu, stride_out, BLOCK: tl.constexpr):
        """Row ``program_id(0)``, columns block ``program_id(1)``: round(round(silu(gate)) · up)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        gate = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0)
        up = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0)
        g32 = gate.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(gate.dtype)
        out = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
        tl.store(out_ptr + row * stride_out + cols, out, mask=mask)
