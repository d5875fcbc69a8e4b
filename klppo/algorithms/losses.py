"""PPO losses: clipped policy loss (with dual clip) and the :data:`POLICY_LOSSES` registry of verl's
``policy_loss.loss_mode`` variants, clipped value loss, KL loss, entropy.

Per-token losses are [B, T] with a 0/1 ``response_mask``; :func:`agg_loss` (from :mod:`.aggregate`) turns
them into a scalar (``actor_rollout_ref.actor.loss_agg_mode``). Stats are detached 0-dim tensors on the
input's device, so the caller reduces metrics once per step instead of syncing inside the loss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from klppo.algorithms import policy_losses
from klppo.algorithms.aggregate import LOSS_AGG_MODES, agg_loss
from klppo.algorithms.kl import default_chunk_rows, kl_penalty
from klppo.algorithms.masked import (
    compute_dtype,
    explained_variance,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

__all__ = [
    "LOSS_AGG_MODES",
    "POLICY_LOSSES",
    "POLICY_LOSS_KEYS",
    "POLICY_LOSS_OPTIONS",
    "agg_loss",
    "entropy_from_logits",
    "explained_variance",
    "kl_loss",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "get_policy_loss",
    "policy_loss",
    "policy_loss_agg_mode",
    "value_loss",
]


def policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
    *,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate (Schulman et al. 2017, arXiv:1707.06347) with dual clip (Ye et al. 2020,
    arXiv:1912.09729) and asymmetric clip ranges (DAPO's clip-higher, arXiv:2503.14476).

    ρ = exp(clamp(log π − log π_old, −20, 20)), ε_lo = clip_ratio_low or clip_ratio, ε_hi likewise;
        ℓ₁ = max(−A ρ, −A clip(ρ, 1 − ε_lo, 1 + ε_hi))
        ℓ  = min(ℓ₁, −A c)  where A < 0 (dual clip, c = clip_ratio_c > 1), else ℓ₁
    loss = agg_loss(ℓ·w, mask, loss_agg_mode, loss_scale_factor), w = ``rollout_is_weights`` (rollout
    correction's importance weights, detached; 1 when None); gradient flows to ``log_prob`` only.
    This is ``policy_loss.loss_mode=vanilla``; the other modes are in :data:`POLICY_LOSSES`.

    Returns:
        (loss, stats) with 0-dim detached stats: ``pg_clipfrac`` (share of tokens where the clipped term
        is the larger one), ``ppo_kl`` (token-mean of log π_old − log π), ``pg_clipfrac_lower`` (share of
        tokens with A < 0 where the dual clip is active).
    """
    if not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual-clip bound) must be > 1, got {clip_ratio_c}")
    eps_low = clip_ratio if clip_ratio_low is None else clip_ratio_low
    eps_high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    dtype = compute_dtype(old_log_prob, log_prob, advantages)
    adv = advantages.to(dtype)
    log_ratio = torch.clamp(log_prob.to(dtype) - old_log_prob.to(dtype), min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss_ppo = torch.maximum(loss_unclipped, loss_clipped)
    loss_dual = -adv * clip_ratio_c
    negative = adv < 0
    per_token = torch.where(negative, torch.minimum(loss_ppo, loss_dual), loss_ppo)
    per_token = policy_losses.is_weighted(per_token, rollout_is_weights)
    loss = agg_loss(per_token, response_mask, loss_agg_mode, loss_scale_factor)
    with torch.no_grad():
        stats = {
            "pg_clipfrac": masked_mean((loss_clipped > loss_unclipped).to(dtype), response_mask),
            "ppo_kl": masked_mean(-log_ratio, response_mask),
            "pg_clipfrac_lower": masked_mean(((loss_ppo > loss_dual) & negative).to(dtype), response_mask),
        }
    return loss, stats


PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: dict[str, PolicyLossFn] = {
    "vanilla": policy_loss,
    "gspo": policy_losses.gspo,
    "clip_cov": policy_losses.clip_cov,
    "kl_cov": policy_losses.kl_cov,
    "gpg": policy_losses.gpg,
    "geo_mean": policy_losses.geo_mean,
}
"""``actor_rollout_ref.actor.policy_loss.loss_mode`` → loss function. Every function takes
``(old_log_prob, log_prob, advantages, response_mask, clip_ratio, clip_ratio_low, clip_ratio_high,
clip_ratio_c, loss_agg_mode, loss_scale_factor)``, a mode with options of its own also ``options=`` (an
instance of its :data:`POLICY_LOSS_OPTIONS` class), and returns ``(loss, {pg_clipfrac, ppo_kl,
pg_clipfrac_lower})``."""

POLICY_LOSS_OPTIONS: dict[str, type] = {
    "clip_cov": policy_losses.ClipCovOptions,
    "kl_cov": policy_losses.KLCovOptions,
}
"""Modes with options of their own → the options class (its float fields, by their defaults, are verl's key
names)."""

POLICY_LOSS_KEYS: dict[str, tuple[str, ...]] = {
    name: tuple(f.name for f in dataclasses.fields(POLICY_LOSS_OPTIONS[name]) if isinstance(f.default, float))
    if name in POLICY_LOSS_OPTIONS
    else ()
    for name in POLICY_LOSSES
}
"""The ``actor_rollout_ref.actor.policy_loss.*`` keys each mode reads."""

_ROW_MEAN_LOSSES = ("geo_mean",)  # one term per row, averaged over all rows: ignores loss_agg_mode


def get_policy_loss(name: str) -> PolicyLossFn:
    """Registry entry for ``loss_mode=name``; ValueError listing the valid names otherwise."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy_loss.loss_mode {name!r}; valid: {', '.join(POLICY_LOSSES)}")
    return POLICY_LOSSES[name]


def policy_loss_agg_mode(loss_mode: str, loss_agg_mode: str) -> str:
    """The aggregation the ``loss_mode`` policy loss really applies, as a ``loss_agg_mode`` name: what
    gradient accumulation must weight its micro-batches by. ``geo_mean`` averages one term per row over
    all rows, which micro-batches as ``seq-mean-token-sum`` (weight rows_m / rows); the others honour
    ``loss_agg_mode``."""
    get_policy_loss(loss_mode)
    return "seq-mean-token-sum" if loss_mode in _ROW_MEAN_LOSSES else loss_agg_mode


def value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (``critic.cliprange_value``), as in PPO2 / TRL / verl.

    V_clip = clamp(V_new, V_old − c, V_old + c);  ℓ = max((V_new − R)², (V_clip − R)²);
    loss = ½ · agg_loss(ℓ, mask, loss_agg_mode). Gradient flows to ``vpreds`` only.

    Returns:
        (loss, stats) with ``vf_clipfrac`` (share of tokens where the clipped error is the larger one)
        and ``vpred_mean`` (token-mean of vpreds, verl's ``critic/vpred_mean``).
    """
    dtype = compute_dtype(vpreds, returns, values)
    v_new, ret, v_old = vpreds.to(dtype), returns.to(dtype), values.to(dtype)
    v_clipped = torch.clamp(v_new, v_old - cliprange_value, v_old + cliprange_value)
    err_unclipped = (v_new - ret).square()
    err_clipped = (v_clipped - ret).square()
    loss = 0.5 * agg_loss(torch.maximum(err_unclipped, err_clipped), response_mask, loss_agg_mode)
    with torch.no_grad():
        stats = {
            "vf_clipfrac": masked_mean((err_clipped > err_unclipped).to(dtype), response_mask),
            "vpred_mean": masked_mean(v_new, response_mask),
        }
    return loss, stats


def kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
) -> torch.Tensor:
    """KL loss term of the actor (``actor.use_kl_loss``, ``kl_loss_type``, weighted by ``kl_loss_coef``):
    agg_loss(kl_penalty(log_prob, ref_log_prob, kind), mask, loss_agg_mode).

    For ``kind="full"`` use ``agg_loss(kl_penalty_full(logits, ref_logits, mask), mask, mode)``.
    """
    return agg_loss(kl_penalty(log_prob, ref_log_prob, kind), response_mask, loss_agg_mode)


class _Entropy(torch.autograd.Function):
    """H(softmax(z)) per row, computed and differentiated in row chunks (only z is saved).

    H = logsumexp(z) − Σ_v p_v z_v;  ∂H/∂z_j = −p_j (log p_j + H).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        n = logits.shape[0]
        out = torch.empty(n, dtype=compute_dtype(logits), device=logits.device)
        for s in range(0, n, chunk_rows):
            logp = torch.log_softmax(logits[s : s + chunk_rows].to(out.dtype), dim=-1)
            out[s : s + chunk_rows] = -(logp.exp() * logp).sum(dim=-1)
        ctx.save_for_backward(logits, out)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, entropy = ctx.saved_tensors
        grad = torch.empty_like(logits)
        step = ctx.chunk_rows
        for s in range(0, logits.shape[0], step):
            logp = torch.log_softmax(logits[s : s + step].to(entropy.dtype), dim=-1)
            h = entropy[s : s + step].unsqueeze(-1)
            grad[s : s + step] = (
                -grad_out[s : s + step].to(entropy.dtype).unsqueeze(-1) * logp.exp() * (logp + h)
            )
        return grad, None


def entropy_from_logits(logits: torch.Tensor, *, chunk_rows: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: H = −Σ_v p_v log p_v.

    Args:
        logits: [..., V], any float dtype; differentiable (for ``actor.entropy_coeff``).
        chunk_rows: rows (positions) per chunk; by default each float32 temporary holds ≤ 2^24 elements.
            The float32 softmax is never held for the whole [..., V] tensor, in forward or backward.

    Returns:
        [...] float32 (float64 for float64 logits).
    """
    v = logits.shape[-1]
    flat = logits.reshape(-1, v)
    rows = chunk_rows or default_chunk_rows(v)
    return _Entropy.apply(flat, rows).reshape(logits.shape[:-1])
