"""Masked reductions over `[batch, response_len]` tensors: mean, variance, whitening, explained variance.

Conventions shared by all of `klppo.algorithms`:

- ``mask`` is 0/1 (bool, int or float); a position counts when ``mask != 0``. Values at masked positions
  never reach a result (they are selected away with ``torch.where``, not multiplied by 0), so garbage
  there cannot turn into NaN.
- Computation happens in float32 (float64 when any input is float64); bf16/fp16 inputs are upcast, and
  results come back in that compute dtype.
- No host synchronisation: empty masks give 0, never an exception, so these functions can run inside a
  step without `.item()`.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8  # verl's masked_whiten epsilon under the square root


def compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 if any floating input is float64, else float32 (bf16/fp16 are upcast)."""
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def as_bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """A 0/1 mask of any dtype as a bool tensor."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Σ values over positions where mask is set (all dims when ``dim`` is None), in the compute dtype."""
    dtype = compute_dtype(values)
    kept = torch.where(as_bool_mask(mask), values.to(dtype), 0.0)
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_count(
    mask: torch.Tensor, dim: int | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Number of set positions (all dims when ``dim`` is None), as ``dtype``."""
    m = as_bool_mask(mask).to(dtype)
    return m.sum() if dim is None else m.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean over set positions: Σ_mask x / max(n, 1); 0 where no position is set.

    verl divides by ``n + 1e-8``; for n ≥ 1 that is the same float32 number, for n = 0 both give 0.
    ``dim=None`` reduces everything to a 0-dim tensor; ``dim=-1`` gives one mean per row.
    """
    dtype = compute_dtype(values)
    total = masked_sum(values, mask, dim)
    count = masked_count(mask, dim, dtype)
    return total / count.clamp(min=1)


def masked_var(
    values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True, dim: int | None = None
) -> torch.Tensor:
    """Variance over set positions, two-pass: Σ_mask (x − mean)² / (n − 1) (unbiased, as verl) or / n.

    Deliberate difference from verl, which raises for n ∈ {0, 1} (and syncs with the host to check):
    here the variance of fewer than two values is 0.
    """
    dtype = compute_dtype(values)
    mean = masked_mean(values, mask, dim)
    centered = values.to(dtype) - (mean if dim is None else mean.unsqueeze(dim))
    sq = masked_sum(centered.square(), mask, dim)
    count = masked_count(mask, dim, dtype)
    denom = (count - 1.0) if unbiased else count
    return sq / denom.clamp(min=1)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = WHITEN_EPS
) -> torch.Tensor:
    """Whiten over all set positions of the batch: (x − mean) / √(var + eps), unbiased var, eps = 1e-8.

    With ``shift_mean=False`` the mean is added back: x' = (x − mean)/√(var + eps) + mean (verl's contract).
    Masked positions of the result are 0 (verl leaves them whitened; we zero them on purpose).
    """
    dtype = compute_dtype(values)
    x = values.to(dtype)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(as_bool_mask(mask), whitened, 0.0)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Fraction of the return variance the critic explains, over set positions (a 0-dim tensor).

    EV = 1 − Var(returns − values) / (Var(returns) + 1e-5), unbiased variances, as verl's
    ``critic/vf_explained_var``. 1 is a perfect critic, 0 no better than a constant, < 0 worse.
    """
    dtype = compute_dtype(values, returns)
    v, r = values.to(dtype), returns.to(dtype)
    return 1.0 - masked_var(r - v, mask) / (masked_var(r, mask) + 1e-5)
