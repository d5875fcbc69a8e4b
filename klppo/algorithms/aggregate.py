"""Loss aggregation (``actor_rollout_ref.actor.loss_agg_mode``, ``critic.loss_agg_mode``): a per-token
loss [B, T] with a 0/1 mask → a scalar. Shared by every policy loss, the value, KL and entropy terms."""

from __future__ import annotations

import torch

from klppo.algorithms.masked import masked_count, masked_mean, masked_sum

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Aggregate a per-token loss [B, T] into a scalar (``loss_agg_mode``). With m the mask, n_i = Σ_t m_it:

    - ``token-mean``:              Σ_it m·ℓ / Σ_it m  (every token weighs the same; DAPO)
    - ``seq-mean-token-sum``:      (1/B) Σ_i Σ_t m·ℓ
    - ``seq-mean-token-mean``:     mean over rows with n_i > 0 of (Σ_t m·ℓ)/n_i  (original PPO/GRPO)
    - ``seq-mean-token-sum-norm``: Σ_it m·ℓ / D, D = ``loss_scale_factor`` when given (verl's
      ``actor.loss_scale_factor``: a constant, so the scale does not move with the padded length), else
      T = ``loss_mat.shape[-1]`` (Dr. GRPO, arXiv:2503.20783)

    ``loss_scale_factor`` is ignored by the other modes (as verl). Same numbers as verl, except
    ``seq-mean-token-mean`` with empty rows, where verl returns NaN: here empty rows are left out of the
    mean (0 if every row is empty).
    """
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    row_sums = masked_sum(loss_mat, mask, dim=-1)
    if mode == "seq-mean-token-sum":
        return row_sums.mean()
    if mode == "seq-mean-token-mean":
        counts = masked_count(mask, dim=-1, dtype=row_sums.dtype)
        return masked_mean(row_sums / counts.clamp(min=1), counts > 0)
    if mode == "seq-mean-token-sum-norm":
        if loss_scale_factor is None:
            return row_sums.sum() / loss_mat.shape[-1]
        if not loss_scale_factor > 0:
            raise ValueError(f"loss_scale_factor must be > 0, got {loss_scale_factor}")
        return row_sums.sum() / loss_scale_factor
    raise ValueError(f"unknown loss_agg_mode {mode!r}; valid: {', '.join(LOSS_AGG_MODES)}")
