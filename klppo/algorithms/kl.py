"""KL divergence between the policy π and the reference π_ref, per token, and the KL penalty in the reward.

Estimators of KL(π‖π_ref) from one sampled token y ~ π, with r = log π(y) − log π_ref(y)
(Schulman, "Approximating KL divergence", 2020, http://joschu.net/blog/kl-approx.html):

- ``kl`` / ``k1``:  r                      (unbiased, high variance, can be negative)
- ``abs``:          |r|
- ``mse`` / ``k2``: ½ r²                   (biased, low variance; its gradient is the KL gradient in
expectation)
- ``low_var_kl`` / ``k3``: e^{−r} − 1 + r  (unbiased, ≥ 0), with −r clamped to [−20, 20] and the result to
  [−10, 10] as verl does
- any of the above with a ``+`` suffix: the named estimator's value, k2's gradient (straight-through)
- ``full``: the exact Σ_v π(v) log(π(v)/π_ref(v)) over the vocabulary; needs logits, so it is
  :func:`kl_penalty_full`.

Pure functions on tensors: no process groups, models or config objects.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from klppo.algorithms.masked import as_bool_mask, compute_dtype, masked_mean

# Elements of one float32 [rows, vocab] temporary in the chunked vocabulary functions (64 MiB).
VOCAB_CHUNK_ELEMENTS = 1 << 24


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _abs(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio.abs()


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    neg = torch.clamp(-log_ratio, min=-20.0, max=20.0)  # log π_ref − log π
    return torch.clamp(torch.exp(neg) - neg - 1.0, min=-10.0, max=10.0)


_ESTIMATORS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "kl": _k1,
    "k1": _k1,
    "abs": _abs,
    "mse": _k2,
    "k2": _k2,
    "low_var_kl": _k3,
    "k3": _k3,
}
KL_KINDS: tuple[str, ...] = tuple(_ESTIMATORS) + tuple(k + "+" for k in _ESTIMATORS) + ("full",)


def _check_kind(kind: str) -> tuple[str, bool]:
    """Split ``kind`` into (estimator name, straight-through?) or raise ValueError."""
    if kind in ("full", "full+"):
        raise ValueError(
            f"kl kind {kind!r} is the exact KL over the vocabulary and needs logits: call "
            "klppo.algorithms.kl.kl_penalty_full(logits, ref_logits, response_mask) instead of kl_penalty"
        )
    straight = kind.endswith("+")
    base = kind[:-1] if straight else kind
    if base not in _ESTIMATORS:
        raise ValueError(f"unknown kl kind {kind!r}; valid kinds: {', '.join(KL_KINDS)}")
    return base, straight


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate from the sampled tokens' log-probs (no mask applied; see module docstring).

    Args:
        log_prob: [B, T] log π(y_t) of the sampled tokens (any float dtype; carries grad for a KL loss).
        ref_log_prob: [B, T] log π_ref(y_t).
        kind: one of :data:`KL_KINDS` except ``full`` (verl's ``algorithm.kl_penalty`` /
            ``actor_rollout_ref.actor.kl_loss_type`` values).

    Returns:
        [B, T] in float32 (float64 if an input is float64). For ``<name>+``: value of ``<name>``, gradient
        of k2, i.e. ``k2 − k2.detach() + name.detach()``.
    """
    base, straight = _check_kind(kind)
    dtype = compute_dtype(log_prob, ref_log_prob)
    log_ratio = log_prob.to(dtype) - ref_log_prob.to(dtype)
    value = _ESTIMATORS[base](log_ratio)
    if not straight or _ESTIMATORS[base] is _k2:
        return value
    k2 = _k2(log_ratio)
    return k2 - k2.detach() + value.detach()


def sampled_estimator(kind: str) -> str:
    """The per-token estimator that measures a ``kind`` from sampled tokens: its base name (the ``+``
    straight-through variants have the same value), and ``low_var_kl`` (k3) for ``full``, which needs logits.
    The KL-loss controller measures ``kl_loss_type`` this way."""
    base = kind[:-1] if kind.endswith("+") else kind
    return "low_var_kl" if base == "full" else base


def default_chunk_rows(vocab_size: int) -> int:
    """Rows per chunk so that one float32 [rows, vocab] temporary holds ≤ 2^24 elements."""
    return max(1, VOCAB_CHUNK_ELEMENTS // max(1, vocab_size))


class _FullKL(torch.autograd.Function):
    """KL(softmax(z) ‖ softmax(w)) per row, computed and differentiated in row chunks.

    Forward: KL = Σ_v p_v (log p_v − log q_v). Backward (recomputed per chunk, only z and w are saved):
    ∂KL/∂z_j = p_j (log p_j − log q_j − KL),  ∂KL/∂w_j = q_j − p_j.
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, ref_logits: torch.Tensor, chunk_rows: int) -> torch.Tensor:
        n = logits.shape[0]
        dtype = compute_dtype(logits, ref_logits)
        out = torch.empty(n, dtype=dtype, device=logits.device)
        for s in range(0, n, chunk_rows):
            logp = torch.log_softmax(logits[s : s + chunk_rows].to(dtype), dim=-1)
            logq = torch.log_softmax(ref_logits[s : s + chunk_rows].to(dtype), dim=-1)
            out[s : s + chunk_rows] = (logp.exp() * (logp - logq)).sum(dim=-1)
        ctx.save_for_backward(logits, ref_logits, out)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        logits, ref_logits, kl = ctx.saved_tensors
        need_z, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_z = torch.empty_like(logits) if need_z else None
        grad_w = torch.empty_like(ref_logits) if need_w else None
        step = ctx.chunk_rows
        for s in range(0, logits.shape[0], step):
            logp = torch.log_softmax(logits[s : s + step].to(kl.dtype), dim=-1)
            logq = torch.log_softmax(ref_logits[s : s + step].to(kl.dtype), dim=-1)
            p = logp.exp()
            g = grad_out[s : s + step].to(kl.dtype).unsqueeze(-1)
            if grad_z is not None:
                grad_z[s : s + step] = g * p * (logp - logq - kl[s : s + step].unsqueeze(-1))
            if grad_w is not None:
                grad_w[s : s + step] = g * (logq.exp() - p)
        return grad_z, grad_w, None


def kl_penalty_full(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Exact per-token KL(π‖π_ref) = Σ_v π(v) log(π(v)/π_ref(v)) from full logits (``kl_loss_type=full``).

    Args:
        logits: [B, T, V] policy logits (any float dtype; gradient flows to it).
        ref_logits: [B, T, V] reference logits (usually without grad; if it has grad, ∂/∂w = q − p).
        response_mask: [B, T] 0/1.
        chunk_rows: positions per chunk; default keeps each float32 temporary ≤ 2^24 elements, so memory
            beyond the inputs stays bounded (the backward recomputes softmaxes instead of saving them).

    Returns:
        [B, T] float32, 0 at masked positions. Aggregate it with ``agg_loss`` like any per-token loss.
    """
    if logits.shape != ref_logits.shape or logits.dim() != 3:
        raise ValueError(
            f"logits {tuple(logits.shape)} and ref_logits {tuple(ref_logits.shape)} must be [B, T, V]"
        )
    if response_mask.shape != logits.shape[:2]:
        raise ValueError(
            f"response_mask {tuple(response_mask.shape)} must be [B, T] = {tuple(logits.shape[:2])}"
        )
    b, t, v = logits.shape
    rows = chunk_rows or default_chunk_rows(v)
    kl = _FullKL.apply(logits.reshape(b * t, v), ref_logits.reshape(b * t, v), rows).reshape(b, t)
    return torch.where(as_bool_mask(response_mask), kl, 0.0)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: Any,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL penalty in the reward (Ziegler et al. 2019; verl ``algorithm.use_kl_in_reward``).

    rewards_t = scores_t − β · KL_t · mask_t, with KL_t = ``kl_penalty(log_prob, ref_log_prob, kind)`` and
    β = ``kl_ctrl.value`` (a controller from :mod:`klppo.algorithms.kl_control`, or a plain float).
    Computed without autograd (rewards are targets). As in verl, positions outside the mask keep their
    score (normally 0).

    Args:
        token_level_scores: [B, T] reward-model / rule scores (usually one non-zero per row).
        log_prob: [B, T] log-probs of the sampled tokens under the policy that generated them (old).
        ref_log_prob: [B, T] under the reference policy.
        response_mask: [B, T] 0/1.
        kl_ctrl: object with a float attribute ``value`` (β), or a float.
        kind: KL estimator (``algorithm.kl_penalty``; ``+`` variants give their forward value).

    Returns:
        (token_level_rewards [B, T], stats) with 0-dim tensors ``kl``: the batch KL, mean over rows of the
        per-row token-mean KL (verl's ``actor/reward_kl_penalty``; an empty row counts as 0), and
        ``kl_coef``: β. This function does not update the controller: the caller does, once per step,
        with ``kl_ctrl.update(float(stats["kl"]), n_steps=B)``.
    """
    beta = float(kl_ctrl.value) if hasattr(kl_ctrl, "value") else float(kl_ctrl)
    with torch.no_grad():
        dtype = compute_dtype(token_level_scores, log_prob, ref_log_prob)
        mask = as_bool_mask(response_mask)
        kld = torch.where(mask, kl_penalty(log_prob, ref_log_prob, kind).to(dtype), 0.0)
        rewards = token_level_scores.to(dtype) - beta * kld
        batch_kl = masked_mean(kld, mask, dim=-1).mean()
    stats = {"kl": batch_kl, "kl_coef": torch.tensor(beta, dtype=dtype, device=rewards.device)}
    return rewards, stats
