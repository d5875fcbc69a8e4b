"""Rollout correction: importance weights and rejection masks for the gap between the policy that sampled
the tokens (the rollout engine, π_roll) and the policy the trainer computes (π_train), verl's
``algorithm.rollout_correction.*`` (Liu, Li, Fu, Wang, Liu, Shen 2025, *When Speed Kills Stability:
Demystifying RL Collapse from the Training-Inference Mismatch*, https://richardli.xyz/rl-collapse; Yao et
al. 2025, *Your Efficient RL Framework Secretly Brings You Off-Policy RL Training*,
https://fengyao.notion.site/off-policy-rl).

Every function takes the per-token log-ratio ``log_ratio`` = log π_train − log π_roll [B, T] and the 0/1
``response_mask`` [B, T], and returns tensors: weights or masks, and a dict of 0-dim detached statistics
named as verl names them (without the ``rollout_corr/`` prefix, which :func:`rollout_correction` adds). No
host synchronisation: a statistic over nothing is 0 (verl raises on an all-padding batch).

Importance sampling (``rollout_is``, :data:`IS_LEVELS`), with S = 20 the safety bound of the exponent:

    token     w_t = exp(clamp(δ_t, −S, S)) · m_t
    sequence  w_t = exp(clamp(Σ_s m_s δ_s, −S, S)) · m_t          (one weight per row)
    TIS (threshold "u")        w ← min(w, u)                       Yao et al. 2025
    IcePop (threshold "l_u")   w ← w if l ≤ w ≤ u else 0            (masked IS)
    batch normalize            w ← w / mean(w) when mean(w) > 1e-8 (token: mean over tokens; sequence:
                               mean over non-empty rows of each row's token-mean)

Rejection sampling (``rollout_rs``, :data:`RS_STATISTICS`: ``<aggregation>_<estimator>``, comma-separated
options all of which must pass), with δ clamped to [−S, S]:

    estimators   k1 = −δ,  k2 = ½δ²,  k3 = e^δ − 1 − δ
    aggregations token (per token), seq_sum (Σ_t m k), seq_mean (Σ_t m k / n), seq_max (max_t over m)
    keep         k1: ln l ≤ stat ≤ ln u (threshold "l_u", or "u" meaning l = 1/u); k2/k3: stat ≤ u
    a sequence-level option keeps or rejects all tokens of a row; the kept mask is m · Π_options keep.

Off-policy diagnostics (:func:`offpolicy_metrics`, always): the perplexities of both policies, the KL
between them (k1 and k3 estimators, unclamped), and the χ² divergences E[ρ²] − 1 per token and per row.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from klppo.algorithms.aggregate import agg_loss
from klppo.algorithms.masked import as_bool_mask, compute_dtype, masked_mean, masked_sum

SAFETY_BOUND = 20.0
"""Bound of an exponent: exp(±20) ≈ 4.9e8 / 2.1e-9."""

Stats = dict[str, torch.Tensor]


# ----------------------------------------------------------------------------------------------- thresholds
def parse_is_threshold(spec: float | str) -> tuple[float, float | None]:
    """``rollout_is_threshold`` → (upper, lower): a number or ``"u"`` → (u, None), truncation (TIS);
    ``"l_u"`` → (u, l), IcePop. ValueError on a non-positive bound or l > u."""
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"rollout_is_threshold must be a number or a 'lower_upper' string, got {spec!r}")
    text = str(spec).strip()
    parts = text.split("_", 1)
    try:
        bounds = [float(p) for p in parts]
    except ValueError as exc:
        raise ValueError(f"rollout_is_threshold {spec!r}: not a number or 'lower_upper'") from exc
    upper, lower = bounds[-1], (bounds[0] if len(bounds) == 2 else None)
    if upper <= 0 or (lower is not None and lower <= 0):
        raise ValueError(f"rollout_is_threshold {spec!r}: bounds must be positive")
    if lower is not None and lower > upper:
        raise ValueError(f"rollout_is_threshold {spec!r}: lower bound above the upper")
    return upper, lower


class RSOption(NamedTuple):
    """One rejection criterion: its name (``seq_mean_k3``), upper bound, and (k1 only) lower bound, both
    in the statistic's units (k1: log-ratio units, ln of the given ratio bounds)."""

    name: str
    upper: float
    lower: float | None


def parse_rs_options(options: str, thresholds: float | str | None) -> tuple[RSOption, ...]:
    """``rollout_rs`` (comma-separated, duplicates dropped) with ``rollout_rs_threshold`` (one value shared
    by all options, or one per option, comma-separated). k1 options take ratio bounds ``"l_u"`` (or ``"u"``,
    l = 1/u) and compare in log space; k2/k3 take one positive upper bound. ValueError naming the fault."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    if not names:
        raise ValueError("rollout_rs: no option given")
    for name in names:
        if name not in RS_STATISTICS:
            raise ValueError(f"rollout_rs option {name!r}: valid are {', '.join(RS_STATISTICS)}")
    if thresholds is None or isinstance(thresholds, bool):
        raise ValueError("rollout_rs needs rollout_rs_threshold")
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold: give one value or {len(names)} (one per rollout_rs option)")
    specs = specs * len(names) if len(specs) == 1 else specs
    return tuple(_rs_option(name, spec) for name, spec in zip(names, specs, strict=True))


def _rs_option(name: str, spec: str) -> RSOption:
    try:
        bounds = [float(p) for p in spec.split("_", 1)]
    except ValueError as exc:
        raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: not a number") from exc
    if any(b <= 0 for b in bounds):
        raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: bounds must be positive")
    if not name.endswith("k1"):
        if len(bounds) == 2:
            raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: one upper bound, no '_'")
        return RSOption(name, bounds[0], None)
    lower, upper = (bounds[0], bounds[1]) if len(bounds) == 2 else (1.0 / bounds[0], bounds[0])
    if lower > upper:
        raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: lower bound above the upper")
    return RSOption(name, math.log(upper), math.log(lower))


# ------------------------------------------------------------------------------------------ importance
# weights
def _token_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return log_ratio, log_ratio


def _sequence_log_weights(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total = masked_sum(log_ratio, mask, dim=-1).unsqueeze(-1)  # [B, 1]
    return total.expand_as(log_ratio), total


IS_LEVELS: dict[str, Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {
    "token": _token_log_weights,
    "sequence": _sequence_log_weights,
}
"""``rollout_is`` → (per-token log weight [B, T], the log weight the statistics read: [B, T] or [B, 1])."""


def is_weights(
    log_ratio: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    level: str,
    threshold: float | str = 2.0,
    batch_normalize: bool = False,
) -> tuple[torch.Tensor, Stats]:
    """Importance weights [B, T] (detached, 0 at padding) of ``level`` (token | sequence) with TIS or IcePop
    per ``threshold`` (module docstring), optionally normalised to mean 1; and verl's ``rollout_is_*``
    statistics of them."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is {level!r}: valid are {', '.join(IS_LEVELS)}")
    upper, lower = parse_is_threshold(threshold)
    dtype = compute_dtype(log_ratio)
    lr, m = log_ratio.detach().to(dtype), response_mask.to(dtype)
    log_w, log_w_stats = IS_LEVELS[level](lr, m)
    raw = torch.exp(log_w.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * m
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    stats = _is_stats(weights, raw, log_w_stats, m, level=level, upper=upper, lower=lower)
    if lower is not None:
        stats["rollout_is_oob_ratio"] = masked_mean(((raw < lower) | (raw > upper)).to(dtype), m)
    if batch_normalize:
        if level == "token":
            mean = masked_mean(weights, m)
        else:
            rows = m.sum(dim=-1) > 0
            mean = masked_mean(masked_mean(weights, m, dim=-1), rows)
        ok = mean > 1e-8
        weights = torch.where(ok, weights / torch.where(ok, mean, 1.0), weights)
        stats["rollout_is_batch_norm_factor"] = torch.where(ok, mean, torch.ones_like(mean))
    return weights, stats


def _is_stats(
    weights: torch.Tensor,
    raw: torch.Tensor,
    log_w_stats: torch.Tensor,
    m: torch.Tensor,
    *,
    level: str,
    upper: float,
    lower: float | None,
) -> Stats:
    """verl's ``rollout_is_*`` statistics: mean/max/min, shares beyond the bounds (lower default 1/upper),
    std and effective sample size of the weights clamped to [0, upper], and per-row summaries."""
    low = 1.0 / upper if lower is None else lower
    keep = as_bool_mask(m)
    stats: Stats = {"rollout_is_mean": masked_mean(weights, m)}
    if level == "sequence":  # over every row, empty ones included (their log weight is 0), as verl
        stats["rollout_is_max"] = torch.exp(log_w_stats.max().clamp(max=SAFETY_BOUND))
        stats["rollout_is_min"] = torch.exp(log_w_stats.min())
        stats["rollout_is_ratio_fraction_high"] = (log_w_stats > math.log(upper)).to(m.dtype).mean()
        stats["rollout_is_ratio_fraction_low"] = (log_w_stats < math.log(low)).to(m.dtype).mean()
    else:
        stats["rollout_is_ratio_fraction_high"] = masked_mean((raw > upper).to(m.dtype), m)
        stats["rollout_is_ratio_fraction_low"] = masked_mean((raw < low).to(m.dtype), m)
        stats["rollout_is_max"] = _masked_max(weights, keep)
        stats["rollout_is_min"] = -_masked_max(-weights, keep)
    clamped = weights.clamp(min=0.0, max=upper)
    mean_c = masked_mean(clamped, m)
    var = masked_mean(clamped.square(), m) - mean_c.square()
    stats["rollout_is_std"] = torch.where(m.sum() > 1, var.clamp(min=0.0).sqrt(), torch.zeros_like(var))
    normalized = clamped / (mean_c + 1e-8)
    stats["rollout_is_eff_sample_size"] = 1.0 / masked_mean(normalized.square(), m)
    row_mean = masked_mean(weights, m, dim=-1)  # every row, empty ones as 0, as verl
    stats["rollout_is_seq_mean"] = row_mean.mean()
    stats["rollout_is_seq_std"] = _std(row_mean)
    stats["rollout_is_seq_max"] = row_mean.max()
    stats["rollout_is_seq_min"] = row_mean.min()
    stats["rollout_is_seq_max_deviation"] = (row_mean - 1.0).abs().max()
    raw_row_mean = masked_mean(raw, m, dim=-1)
    stats["rollout_is_seq_fraction_high"] = (raw_row_mean > upper).to(m.dtype).mean()
    stats["rollout_is_seq_fraction_low"] = (raw_row_mean < low).to(m.dtype).mean()
    return {k: v.detach() for k, v in stats.items()}


def _masked_max(x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """max over kept positions (dim=None) — −inf where none is kept, as verl's masked fill."""
    return x.masked_fill(~keep, float("-inf")).max()


def _std(x: torch.Tensor) -> torch.Tensor:
    """Unbiased std of a 1-D tensor; 0 for fewer than two values."""
    return x.std() if x.numel() > 1 else torch.zeros((), dtype=x.dtype, device=x.device)


# ------------------------------------------------------------------------------------------ rejection
# sampling
_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": lambda d: -d,
    "k2": lambda d: 0.5 * d.square(),
    "k3": lambda d: torch.exp(d) - 1.0 - d,
}


def _seq_max(k: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    top = k.masked_fill(~as_bool_mask(m), float("-inf")).max(dim=-1).values
    return torch.where(torch.isinf(top) & (top < 0), torch.zeros_like(top), top)


_AGGREGATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None] = {
    "token": None,  # per token
    "seq_sum": lambda k, m: masked_sum(k, m, dim=-1),
    "seq_mean": lambda k, m: masked_mean(k, m, dim=-1),
    "seq_max": _seq_max,
}

RS_STATISTICS: dict[str, tuple[str, str]] = {
    f"{agg}_{est}": (agg, est)
    for agg in _AGGREGATIONS
    for est in _ESTIMATORS
    if not (agg == "seq_max" and est == "k1")
}
"""``rollout_rs`` option → (aggregation, estimator): verl's 11 options (no ``seq_max_k1``)."""


def rejection_mask(
    log_ratio: torch.Tensor, response_mask: torch.Tensor, options: tuple[RSOption, ...]
) -> tuple[torch.Tensor, Stats]:
    """The response mask with the tokens (or whole rows) that fail any of ``options`` set to 0, in the
    mask's dtype, and verl's ``rollout_rs_*`` statistics: per option its statistic's summary and the shares
    of tokens / rows it rejects; overall ``rollout_rs_masked_fraction`` and ``rollout_rs_seq_masked_fraction``
    (rows with a rejected token, over all rows)."""
    dtype = compute_dtype(log_ratio)
    m = response_mask.to(dtype)
    keep_m = as_bool_mask(response_mask)
    delta = log_ratio.detach().to(dtype).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    rows = m.sum(dim=-1) > 0
    combined = torch.ones_like(m)
    stats: Stats = {}
    for opt in options:
        agg, est = RS_STATISTICS[opt.name]
        token_stat = _ESTIMATORS[est](delta)
        reduce = _AGGREGATIONS[agg]
        seq_stat = None if reduce is None else reduce(token_stat, m)
        stat = token_stat if seq_stat is None else seq_stat.unsqueeze(-1).expand_as(m)
        passed = stat <= opt.upper
        if opt.lower is not None:
            passed = passed & (stat >= opt.lower)
        passed_f = passed.to(dtype)
        combined = combined * passed_f
        stats.update(_rs_stats(opt, stat, seq_stat, m, rows))
        prefix = f"rollout_rs_{opt.name}"
        stats[f"{prefix}_masked_fraction"] = masked_mean(1.0 - passed_f, m)
        row_rejected = (~passed & keep_m).any(dim=-1)
        stats[f"{prefix}_seq_masked_fraction"] = masked_mean(row_rejected.to(dtype), rows)
    stats["rollout_rs_masked_fraction"] = masked_mean(1.0 - combined, m)
    stats["rollout_rs_seq_masked_fraction"] = ((combined <= 0.5) & keep_m).any(dim=-1).to(dtype).mean()
    kept = (response_mask * combined).to(response_mask.dtype)
    return kept, {k: v.detach() for k, v in stats.items()}


def _rs_stats(
    opt: RSOption, stat: torch.Tensor, seq_stat: torch.Tensor | None, m: torch.Tensor, rows: torch.Tensor
) -> Stats:
    """verl's per-option summary of the rejection statistic ``stat`` [B, T] (a row's value repeated on its
    tokens for sequence options; ``seq_stat`` [B] then), ``rows``: the non-empty rows."""
    prefix = f"rollout_rs_{opt.name}"
    is_k1 = opt.lower is not None
    low = opt.lower if is_k1 else 0.0
    keep = as_bool_mask(m)
    row_values = masked_mean(stat, m, dim=-1) if seq_stat is None else seq_stat
    dtype = m.dtype
    out: Stats = {f"{prefix}_mean": masked_mean(stat, m)}
    if seq_stat is not None:
        out[f"{prefix}_max"] = _masked_max(row_values, rows)
        out[f"{prefix}_min"] = -_masked_max(-row_values, rows)
        out[f"{prefix}_fraction_high"] = masked_mean((row_values > opt.upper).to(dtype), rows)
        low_frac = masked_mean((row_values < low).to(dtype), rows)
    else:
        out[f"{prefix}_max"] = _masked_max(stat, keep)
        out[f"{prefix}_min"] = -_masked_max(-stat, keep)
        out[f"{prefix}_fraction_high"] = masked_mean((stat > opt.upper).to(dtype), m)
        low_frac = masked_mean((stat < low).to(dtype), m)
    out[f"{prefix}_fraction_low"] = low_frac if is_k1 else torch.zeros_like(low_frac)
    clamped = stat.clamp(min=low, max=opt.upper)
    mean_c = masked_mean(clamped, m)
    var = masked_mean(clamped.square(), m) - mean_c.square()
    out[f"{prefix}_std"] = torch.where(m.sum() > 1, var.clamp(min=0.0).sqrt(), torch.zeros_like(var))
    num_rows = rows.sum()
    mean_rows = masked_mean(row_values, rows)
    var_rows = masked_sum((row_values - mean_rows).square(), rows) / (num_rows - 1).clamp(min=1)
    out[f"{prefix}_seq_mean"] = mean_rows
    out[f"{prefix}_seq_std"] = torch.where(num_rows > 1, var_rows.sqrt(), torch.zeros_like(var_rows))
    out[f"{prefix}_seq_max"] = _masked_max(row_values, rows)
    out[f"{prefix}_seq_min"] = -_masked_max(-row_values, rows)
    out[f"{prefix}_seq_max_deviation"] = _masked_max(row_values.abs(), rows)
    out[f"{prefix}_seq_fraction_high"] = masked_mean((row_values > opt.upper).to(dtype), rows)
    if is_k1:
        out[f"{prefix}_seq_fraction_low"] = masked_mean((row_values < low).to(dtype), rows)
    return out


# ------------------------------------------------------------------------------------------ diagnostics
def offpolicy_metrics(
    log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
) -> Stats:
    """verl's mismatch diagnostics between π_train (``log_prob``) and π_roll, with δ = log π_train − log
    π_roll:

    training_ppl / rollout_ppl   mean over rows of exp(−token-mean log π) (rows without tokens count as 1)
    training_log_ppl / rollout_log_ppl   mean over rows of −token-mean log π
    kl        token-mean of −δ           (k1 estimate of KL(π_roll‖π_train))
    k3_kl     token-mean of e^δ − δ − 1  (k3; δ unclamped)
    log_ppl_diff (mean, abs mean, max, min over rows) = token-mean log π_roll − token-mean log π_train
    ppl_ratio mean over rows of exp(log_ppl_diff)
    chi2_token  token-mean of exp(2·clamp(δ, ±20)) − 1;  chi2_seq  mean over rows of exp(2·clamp(Σδ, ±20)) − 1
    """
    dtype = compute_dtype(log_prob, rollout_log_prob)
    lp, rlp, m = log_prob.detach().to(dtype), rollout_log_prob.detach().to(dtype), response_mask.to(dtype)
    train_row = masked_mean(lp, m, dim=-1)
    roll_row = masked_mean(rlp, m, dim=-1)
    delta = lp - rlp
    diff = roll_row - train_row
    safe = delta.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq = masked_sum(delta, m, dim=-1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {
        "training_ppl": torch.exp(-train_row).mean(),
        "training_log_ppl": (-train_row).mean(),
        "kl": masked_mean(-delta, m),
        "k3_kl": masked_mean(torch.exp(delta) - delta - 1.0, m),
        "rollout_ppl": torch.exp(-roll_row).mean(),
        "rollout_log_ppl": (-roll_row).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": torch.exp(diff).mean(),
        "chi2_token": masked_mean(torch.exp(safe).square(), m) - 1.0,
        "chi2_seq": torch.exp(2.0 * seq).mean() - 1.0,
    }


# ------------------------------------------------------------------------------------------ the whole
class Correction(NamedTuple):
    """The outcome of :func:`rollout_correction`: ``weights`` [B, T] (None without ``rollout_is``),
    ``response_mask`` [B, T] with rejected tokens at 0 (the input mask without ``rollout_rs``), and
    ``metrics``: 0-dim detached tensors named ``rollout_corr/<verl's name>``."""

    weights: torch.Tensor | None
    response_mask: torch.Tensor
    metrics: Stats


def rollout_correction(
    log_prob: torch.Tensor,
    rollout_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    rollout_is: str | None = None,
    rollout_is_threshold: float | str = 2.0,
    rollout_is_batch_normalize: bool = False,
    rs_options: tuple[RSOption, ...] = (),
) -> Correction:
    """Importance weights (``rollout_is``), rejection (``rs_options``, from :func:`parse_rs_options`) and the
    off-policy diagnostics of π_train (``log_prob``: π_old in decoupled mode, the current policy in bypass
    mode) against π_roll, all from δ = log_prob − rollout_log_prob on ``response_mask``'s tokens."""
    log_ratio = log_prob.detach() - rollout_log_prob.detach()
    stats: Stats = {}
    weights = None
    if rollout_is is not None:
        weights, is_stats = is_weights(
            log_ratio,
            response_mask,
            level=rollout_is,
            threshold=rollout_is_threshold,
            batch_normalize=rollout_is_batch_normalize,
        )
        stats.update(is_stats)
    mask = response_mask
    if rs_options:
        mask, rs_stats = rejection_mask(log_ratio, response_mask, rs_options)
        stats.update(rs_stats)
    stats.update(offpolicy_metrics(log_prob, rollout_log_prob, response_mask))
    return Correction(weights, mask, {f"rollout_corr/{k}": v for k, v in stats.items()})


def reinforce_loss(
    rollout_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    weights: torch.Tensor | None = None,
    loss_agg_mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Bypass mode's ``loss_type=reinforce`` (Williams 1992): ℓ_t = −A_t · w_t · log π_t with the detached
    importance weights w (1 when None), loss = agg_loss(ℓ, m, loss_agg_mode, loss_scale_factor); no ratio,
    no clip. Stats as the policy losses': ``ppo_kl`` = token-mean of log π_roll − log π, the clip
    fractions 0."""
    dtype = compute_dtype(log_prob, advantages)
    lp, adv = log_prob.to(dtype), advantages.to(dtype)
    per_token = -adv * lp
    if weights is not None:
        per_token = per_token * weights.detach().to(dtype)
    loss = agg_loss(per_token, response_mask, loss_agg_mode, loss_scale_factor)
    ppo_kl = masked_mean(rollout_log_prob.detach().to(dtype) - lp.detach(), response_mask)
    zero = torch.zeros_like(ppo_kl)
    return loss, {"pg_clipfrac": zero, "ppo_kl": ppo_kl, "pg_clipfrac_lower": zero}


BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")
"""``rollout_correction.loss_type`` in bypass mode: ``ppo_clip`` is the configured policy loss with π_old =
π_roll (the ratio is the importance weight, clipped; no extra weights), ``reinforce`` is
:func:`reinforce_loss`."""


@dataclass(frozen=True)
class CorrectionSettings:
    """One run's rollout correction (verl's ``algorithm.rollout_correction``, thresholds parsed once).

    ``bypass_mode`` False (decoupled): the trainer corrects the global batch once per step with π_old from the
    old-log-prob pass; True: π_old = π_roll, and the actor corrects each micro-batch with the current policy,
    its policy loss being ``loss_type`` (:data:`BYPASS_LOSS_TYPES`)."""

    rollout_is: str | None = None
    rollout_is_threshold: float | str = 2.0
    rollout_is_batch_normalize: bool = False
    rs_options: tuple[RSOption, ...] = ()
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    def apply(
        self, log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, response_mask: torch.Tensor
    ) -> Correction:
        """:func:`rollout_correction` with these settings."""
        return rollout_correction(
            log_prob,
            rollout_log_prob,
            response_mask,
            rollout_is=self.rollout_is,
            rollout_is_threshold=self.rollout_is_threshold,
            rollout_is_batch_normalize=self.rollout_is_batch_normalize,
            rs_options=self.rs_options,
        )
