"""verl's policy-loss variants (``actor_rollout_ref.actor.policy_loss.loss_mode``) besides ``vanilla``:
``gspo``, ``clip_cov``, ``kl_cov``, ``gpg``, ``geo_mean``.

Every function has the signature of :func:`klppo.algorithms.losses.policy_loss` — ``(old_log_prob,
log_prob, advantages, response_mask, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c,
loss_agg_mode, loss_scale_factor)``, arguments a variant does not use are accepted and ignored — plus its
own keyword-only floats (verl's ``policy_loss.*`` keys). Each returns ``(loss, stats)`` with the same three
detached 0-dim stats as ``vanilla`` (``pg_clipfrac``, ``ppo_kl``, ``pg_clipfrac_lower``; 0 where verl
reports nothing, e.g. a variant that clips nothing), so the metrics keep one set of names.

Deliberate difference from verl: ``clip_cov``, ``kl_cov`` and ``geo_mean`` clamp log π − log π_old to
[−20, 20] before exponentiating, as ``vanilla`` does (verl leaves them unclamped, which overflows float32
beyond a log-ratio of 88). Results differ only where |log-ratio| > 20.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from klppo.algorithms.aggregate import agg_loss
from klppo.algorithms.masked import as_bool_mask, compute_dtype, masked_count, masked_mean, masked_sum

Stats = dict[str, torch.Tensor]


def _prepare(
    old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log π, log π − log π_old, A) in the compute dtype; gradient flows through log π only."""
    dtype = compute_dtype(old_log_prob, log_prob, advantages)
    lp = log_prob.to(dtype)
    return lp, lp - old_log_prob.to(dtype), advantages.to(dtype)


def _stats(clipfrac: torch.Tensor, ppo_kl: torch.Tensor, clipfrac_lower: torch.Tensor | None = None) -> Stats:
    lower = torch.zeros_like(ppo_kl) if clipfrac_lower is None else clipfrac_lower
    return {"pg_clipfrac": clipfrac.detach(), "ppo_kl": ppo_kl.detach(), "pg_clipfrac_lower": lower.detach()}


def is_weighted(per_token: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    """ℓ_t · w_t with the rollout-correction importance weights w [B, T] (detached; ``None``: ℓ unchanged, the
    same tensor), as verl weighs every policy loss but ``geo_mean``
    (docs/algorithms.md#rollout-correction)."""
    return (
        per_token
        if rollout_is_weights is None
        else per_token * rollout_is_weights.detach().to(per_token.dtype)
    )


def _clip_bounds(clip_ratio: float, low: float | None, high: float | None) -> tuple[float, float]:
    return (clip_ratio if low is None else low), (clip_ratio if high is None else high)


def gspo(
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
) -> tuple[torch.Tensor, Stats]:
    """Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071): a sequence-level ratio.

    s_i = exp((1/n_i) Σ_t m_it (log π − log π_old)_it), the length-normalised sequence ratio; per token
        s_it = exp(min(sg[log s_i] + log π_it − sg[log π_it], 10))      (value s_i, gradient s_i ∇log π_it)
        ℓ_it = max(−A_it s_it, −A_it clip(s_it, 1 − ε_lo, 1 + ε_hi))   (no dual clip)
    loss = agg_loss(ℓ, m, loss_agg_mode, loss_scale_factor). The GSPO paper, and some verl versions,
    always aggregate with ``seq-mean-token-mean``; others (0.9.x) honour ``loss_agg_mode``, as here: set
    ``loss_agg_mode=seq-mean-token-mean`` for the paper's objective. ``clip_ratio_c`` is unused.
    Stats: ``pg_clipfrac`` (share of tokens where the clipped term is larger), ``ppo_kl`` (token-mean of
    log π_old − log π), ``pg_clipfrac_lower`` = 0.
    """
    lp, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages)
    eps_low, eps_high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    lengths = masked_count(response_mask, dim=-1, dtype=lp.dtype).clamp(min=1)
    seq_log_ratio = (masked_sum(log_ratio, response_mask, dim=-1) / lengths).detach()
    seq_ratio = torch.exp(torch.clamp(lp - lp.detach() + seq_log_ratio.unsqueeze(-1), max=10.0))
    loss_unclipped = -adv * seq_ratio
    loss_clipped = -adv * torch.clamp(seq_ratio, 1.0 - eps_low, 1.0 + eps_high)
    per_token = torch.maximum(loss_unclipped, loss_clipped)
    loss = agg_loss(
        is_weighted(per_token, rollout_is_weights), response_mask, loss_agg_mode, loss_scale_factor
    )
    with torch.no_grad():
        clipfrac = masked_mean((loss_clipped > loss_unclipped).to(lp.dtype), response_mask)
        stats = _stats(clipfrac, masked_mean(-log_ratio, response_mask))
    return loss, stats


@dataclass(frozen=True)
class ClipCovOptions:
    """Clip-Cov's own options: verl's ``policy_loss.clip_cov_*`` keys (field names are the keys), and the
    generator of its random choice of tokens (None: the global CPU RNG, as verl)."""

    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    generator: torch.Generator | None = None


@dataclass(frozen=True)
class KLCovOptions:
    """KL-Cov's own options: verl's ``policy_loss.kl_cov_ratio`` and ``ppo_kl_coef`` keys."""

    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1


@torch.no_grad()
def _clip_cov_keep(
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clipped_by_ppo: torch.Tensor,
    *,
    ratio: float,
    lower: float,
    upper: float,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """Bool [B, T]: False on the tokens Clip-Cov detaches (see :func:`clip_cov`). Host syncs: two."""
    cov = (advantages - masked_mean(advantages, mask)) * (log_prob - masked_mean(log_prob, mask))
    candidates = mask & ~clipped_by_ppo & (cov > lower) & (cov < upper)
    num_clip = max(int(ratio * float(mask.sum())), 1)
    flat = torch.nonzero(candidates.reshape(-1)).reshape(-1)  # row-major, as verl's 2-D nonzero
    keep = torch.ones_like(mask)
    if flat.numel() > 0:
        perm = torch.randperm(flat.numel(), generator=generator)[:num_clip].to(flat.device)
        keep.reshape(-1)[flat[perm]] = False
    return keep


def clip_cov(
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
    options: ClipCovOptions = ClipCovOptions(),
) -> tuple[torch.Tensor, Stats]:
    """Clip-Cov (Cui et al. 2025, *The Entropy Mechanism of RL for Reasoning LMs*, arXiv:2505.22617).

    ρ = exp(clamp(log π − log π_old, −20, 20)); ℓ₁ = −Aρ, ℓ₂ = −A clip(ρ, 1 − ε_lo, 1 + ε_hi);
    cov_t = (A_t − Ā)(log π_t − mean log π), means over the response tokens of this call. Candidates: tokens
    with m = 1, not already clipped by PPO (ℓ₂ ≤ ℓ₁) and ``options.clip_cov_lb`` < cov_t <
    ``options.clip_cov_ub``; of
    them, max(⌊``options.clip_cov_ratio`` · Σm⌋, 1) chosen uniformly at random (``options.generator``,
    default the global CPU RNG, as verl) get no gradient:  ℓ = max(ℓ₁, ℓ₂) · c, c = 0 on chosen tokens, else 1
    (no dual clip).
    loss = agg_loss(ℓ, m, loss_agg_mode, loss_scale_factor). As in verl the selection is per call, i.e. per
    micro-batch. Stats: ``pg_clipfrac`` = share of tokens with c = 0 (verl's meaning), ``ppo_kl``,
    ``pg_clipfrac_lower`` = 0. ``clip_ratio_c`` is unused.
    """
    if not options.clip_cov_ratio > 0:
        raise ValueError(f"clip_cov_ratio must be > 0, got {options.clip_cov_ratio}")
    lp, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages)
    eps_low, eps_high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    mask = as_bool_mask(response_mask)
    ratio = torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    keep = _clip_cov_keep(
        lp.detach(),
        adv,
        mask,
        (loss_clipped > loss_unclipped).detach(),
        ratio=options.clip_cov_ratio,
        lower=options.clip_cov_lb,
        upper=options.clip_cov_ub,
        generator=options.generator,
    )
    per_token = torch.where(keep, torch.maximum(loss_unclipped, loss_clipped), 0.0)
    loss = agg_loss(
        is_weighted(per_token, rollout_is_weights), response_mask, loss_agg_mode, loss_scale_factor
    )
    with torch.no_grad():
        stats = _stats(masked_mean((~keep).to(lp.dtype), mask), masked_mean(-log_ratio, mask))
    return loss, stats


def kl_cov(
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
    options: KLCovOptions = KLCovOptions(),
) -> tuple[torch.Tensor, Stats]:
    """KL-Cov (Cui et al. 2025, arXiv:2505.22617): a |log-ratio| penalty on the highest-covariance tokens.

    δ = log π − log π_old, ρ = exp(clamp(δ, −20, 20)); over the response tokens of this call (flattened
    row-major) cov_t = (A_t − Ā)(log π_t − mean log π); the k = max(1, ⌊Σm · ``options.kl_cov_ratio``⌋)
    tokens with the largest cov get ℓ = −Aρ + ``options.ppo_kl_coef`` · |δ|, all others ℓ = −Aρ (no clipping
    at all).
    loss = agg_loss(ℓ, m, loss_agg_mode, loss_scale_factor); per call (micro-batch), as verl.
    Stats: ``ppo_kl`` = token-mean of |δ| (verl reports the absolute value under this name),
    ``pg_clipfrac`` = ``pg_clipfrac_lower`` = 0. The clip arguments are unused. One host sync (Σm).
    """
    if not options.kl_cov_ratio > 0:
        raise ValueError(f"kl_cov_ratio must be > 0, got {options.kl_cov_ratio}")
    lp, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages)
    mask = as_bool_mask(response_mask)
    abs_kl = log_ratio.abs()
    loss_pg = -adv * torch.exp(torch.clamp(log_ratio, min=-20.0, max=20.0))
    with torch.no_grad():
        num_valid = int(mask.sum())
        penalized = torch.zeros_like(mask)
        if num_valid > 0:
            flat = torch.nonzero(mask.reshape(-1)).reshape(-1)
            a, logp = adv.reshape(-1)[flat], lp.detach().reshape(-1)[flat]
            cov = (a - a.mean()) * (logp - logp.mean())
            top = torch.topk(cov, max(1, int(num_valid * options.kl_cov_ratio))).indices
            penalized.reshape(-1)[flat[top]] = True
    per_token = torch.where(penalized, loss_pg + options.ppo_kl_coef * abs_kl, loss_pg)
    loss = agg_loss(
        is_weighted(per_token, rollout_is_weights), response_mask, loss_agg_mode, loss_scale_factor
    )
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    return loss, _stats(zero, masked_mean(abs_kl, mask).detach())


def gpg(
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
) -> tuple[torch.Tensor, Stats]:
    """Group Policy Gradient loss (Chu et al. 2025, arXiv:2504.02546): plain REINFORCE, no ratio, no clip.

    ℓ_t = −A_t log π_t;  loss = agg_loss(ℓ, m, loss_agg_mode, loss_scale_factor). ``old_log_prob`` only
    feeds the ``ppo_kl`` stat (verl reports no stats for gpg); ``pg_clipfrac`` = ``pg_clipfrac_lower`` = 0.
    """
    lp, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages)
    loss = agg_loss(
        is_weighted(-lp * adv, rollout_is_weights), response_mask, loss_agg_mode, loss_scale_factor
    )
    with torch.no_grad():
        zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
        stats = _stats(zero, masked_mean(-log_ratio, response_mask))
    return loss, stats


def geo_mean(
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
) -> tuple[torch.Tensor, Stats]:
    """Geometric-Mean Policy Optimization (Zhao et al. 2025, GMPO, arXiv:2507.20673).

    δ = clamp(log π − log π_old, −20, 20); per token, clipped in log space and only in the direction that
    limits the update: δ̃ = sgn(A) · min(sgn(A) δ, sgn(A) clamp(δ, −ε_lo, ε_hi)). Per row (n_i = Σ_t m):
        r_i = exp((1/n_i) Σ_t m δ̃),   Ā_i = (1/n_i) Σ_t m A   (a sequence-level advantage, as verl assumes)
        loss = (1/B) Σ_i −Ā_i r_i          (mean over all B rows; an empty row contributes 0)
    ``loss_agg_mode`` and ``loss_scale_factor`` are ignored (as verl); verl divides by n_i + 1e-8, the same
    float32 number for n_i ≥ 1. Stats: ``pg_clipfrac`` / ``pg_clipfrac_lower`` = share of tokens with
    A > 0 / A < 0 whose δ lies outside [−ε_lo, ε_hi]; ``ppo_kl``. ``rollout_is_weights`` is refused: verl
    folds them into the geometric mean per row, which is not built here.
    """
    if rollout_is_weights is not None:
        raise ValueError("geo_mean takes no rollout-correction importance weights (not built)")
    lp, log_ratio, adv = _prepare(old_log_prob, log_prob, advantages)
    eps_low, eps_high = _clip_bounds(clip_ratio, clip_ratio_low, clip_ratio_high)
    delta = torch.clamp(log_ratio, min=-20.0, max=20.0)
    sign = torch.sign(adv)
    delta_clamped = torch.clamp(delta, min=-eps_low, max=eps_high)
    delta_min = sign * torch.minimum(sign * delta, sign * delta_clamped)
    lengths = masked_count(response_mask, dim=-1, dtype=lp.dtype).clamp(min=1)
    seq_ratio = torch.exp(masked_sum(delta_min, response_mask, dim=-1) / lengths)
    seq_adv = masked_sum(adv, response_mask, dim=-1) / lengths
    loss = (-seq_adv * seq_ratio).mean()
    with torch.no_grad():
        clipped = delta != delta_clamped
        stats = _stats(
            masked_mean((clipped & (adv > 0)).to(lp.dtype), response_mask),
            masked_mean(-log_ratio, response_mask),
            masked_mean((clipped & (adv < 0)).to(lp.dtype), response_mask),
        )
    return loss, stats
