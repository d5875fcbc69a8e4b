"""Reverse first-order linear recurrences along the last dim, in O(log T) kernel launches instead of T.

    y_t = x_t + a_t · y_{t+1},   y_T = 0,   t = T−1 … 0

is the shape of every discounted sum in RL: returns (a = γ), GAE (a = γλ over the response tokens),
returns restarted after padding (a_t = γ·[t+1 is a response token]). A Python loop over t launches a few
small kernels per position; :func:`reverse_linear_scan` cuts the row into blocks of C positions, solves
every block at once (a [C, C] matmul when a is one scalar, log₂ C doubling steps when a varies per
position), then joins the blocks through the same recurrence on the blocks' first values, solved the
same way, so Python iterates log_C T times, never over T.

No closed form c^(−t)·cumsum(c^j x_j) anywhere: it overflows for long rows and small c. Every factor used
is a product of the given coefficients (powers c^k with k ≥ 0), so c = 0 and c = 1 are exact cases.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK = 64


def _powers(c: float, n: int, device: torch.device) -> torch.Tensor:
    """c^k for k = 0 … n−1, float64 [n] (0^0 = 1), made on ``device`` (no host-to-device copy)."""
    base = torch.full((), c, dtype=torch.float64, device=device)
    return base.pow(torch.arange(n, dtype=torch.float64, device=device))


def _block_scan_scalar(x: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block [..., n, C] solved alone (y = 0 after the block), one coefficient c.

    local_t = Σ_{j ≥ t} c^(j−t) x_j = (x @ Mᵀ)_t with M[t, j] = c^(j−t) for j ≥ t, 0 below;
    carry_t = c^(C−t), the factor on the value just after the block. Returns (local [..., n, C], carry [C]).
    The matmul runs in float64 (B·T·C flops, cheap) so that TF32 or bf16 float32-matmul settings cannot
    round it; the result comes back in x's dtype.
    """
    size = x.shape[-1]
    pw = _powers(c, size + 1, x.device)
    k = torch.arange(size, device=x.device)
    gap = k[None, :] - k[:, None]  # j − t
    mat = torch.where(gap >= 0, pw[gap.clamp(min=0)], 0.0)
    local = (x.to(torch.float64) @ mat.T).to(x.dtype)
    return local, pw[1:].flip(0).to(x.dtype)


def _block_scan_general(x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Every block [..., n, C] solved alone, per-position coefficients a [..., n, C]: doubling steps.

    After the step with offset d, y_t = Σ_{j ∈ [t, t+2d)} (Π_{i=t}^{j−1} a_i) x_j and p_t = Π_{i ∈ [t, t+2d)}
    a_i, both cut at the block end; log₂ C steps of elementwise work. Returns (local, carry), carry_t =
    Π_{i=t}^{C−1} a_i, both [..., n, C].
    """
    y, p = x, a
    size, d = x.shape[-1], 1
    while d < size:
        y = y + p * F.pad(y[..., d:], (0, d))
        p = p * F.pad(p[..., d:], (0, d), value=1.0)
        d *= 2
    return y, p


def reverse_linear_scan(
    x: torch.Tensor, coef: float | torch.Tensor, chunk: int = DEFAULT_CHUNK
) -> torch.Tensor:
    """y_t = x_t + a_t · y_{t+1} along the last dim, y_T = 0 (a reverse discounted sum).

    Args:
        x: [..., T] floating.
        coef: a Python number c (a_t = c everywhere), or a tensor broadcastable to x's shape (a_t per
            position; a_{T−1} is never used). Meant for |a| ≤ 1 (discounts); with |a| > 1, where the loop
            overflows to inf this may give NaN.
        chunk: block length C ≥ 2 (taken as min(C, T)); memory stays O(x.numel()).
    Returns:
        y: [..., T], x's dtype and device, equal to the sequential loop up to float rounding.

    Each block [s, s+C) is solved alone (local), then y_t = local_t + carry_t · y_{s+C} with carry_t =
    Π_{i=t}^{s+C−1} a_i; the values y_s at the blocks' first positions obey the same recurrence with x'
    = local_s and a' = carry_s, over T/C blocks, solved by this function again.
    """
    if chunk < 2:
        raise ValueError(f"chunk must be ≥ 2, got {chunk}")
    length = x.shape[-1]
    if length == 0:
        return x.clone()
    size = min(chunk, length)
    blocks = -(-length // size)
    pad = blocks * size - length
    xb = F.pad(x, (0, pad)).reshape(*x.shape[:-1], blocks, size)
    if isinstance(coef, torch.Tensor):
        a = F.pad(torch.broadcast_to(coef, x.shape).to(x.dtype), (0, pad))
        local, carry = _block_scan_general(xb, a.reshape(xb.shape))
        head_coef: float | torch.Tensor = carry[..., 0]
    else:
        local, carry = _block_scan_scalar(xb, float(coef))
        head_coef = float(torch.tensor(float(coef), dtype=torch.float64) ** size)  # inf, not OverflowError
    if blocks > 1:
        heads = reverse_linear_scan(local[..., 0], head_coef, chunk)  # y at each block's first position
        after = F.pad(heads[..., 1:], (0, 1))  # y just after each block, 0 after the last
        local = local + carry * after[..., None]
    return local.reshape(*x.shape[:-1], blocks * size)[..., :length]
