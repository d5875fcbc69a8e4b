"""Group-baseline outcome estimators: GRPO, RLOO, REINFORCE++-baseline, OPO, GRPO pass@k, GPG.

Each reduces a row to one score, s_i = Σ_t r_{i,t} summed over *all* positions of ``token_level_rewards``
(as verl), compares it with the other rows of its group (``group_ids``: one hashable per row, the prompt
``uid``, or a 1-D integer tensor), and broadcasts the row's advantage over its response tokens (0 at masked
positions). Returns are the advantages. Computed without autograd, in float32 (float64 if an input is).

Registered in :data:`klppo.algorithms.advantages.ADVANTAGE_ESTIMATORS`; formulas in docs/algorithms.md.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from klppo.algorithms.masked import as_bool_mask, compute_dtype, masked_count, masked_whiten

GroupIds = Sequence[Hashable] | torch.Tensor


def group_index(group_ids: GroupIds, batch_size: int, device: torch.device) -> torch.Tensor:
    """Dense group index [B] int64 on ``device`` (first-seen order for Python ids)."""
    if len(group_ids) != batch_size:
        raise ValueError(f"group_ids has {len(group_ids)} entries for a batch of {batch_size} rows")
    if isinstance(group_ids, torch.Tensor):
        return torch.unique(group_ids.to(device), return_inverse=True)[1].reshape(-1)
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device)


def group_sum(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Σ of ``values`` [B] over each row's group, gathered back to [B]."""
    zeros = torch.zeros(values.shape[0], dtype=values.dtype, device=values.device)  # ≥ number of groups
    return zeros.index_add(0, index, values)[index]


def group_stats(scores: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (group size n, group mean, unbiased group std) gathered back to [B]; two-pass variance."""
    count = group_sum(torch.ones_like(scores), index)
    mean = group_sum(scores, index) / count
    std = torch.sqrt(group_sum((scores - mean).square(), index) / (count - 1).clamp(min=1))
    return count, mean, std


def equal_groups(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B] bool: the row's group scored exactly the same on every row (compared, not via the std: the
    group mean of equal float32 scores can be an ulp off them, which ``(s − mean) / (std + eps)`` turns into
    advantages of up to ~0.1 when ``std`` is that ulp)."""
    size = int(index.max()) + 1 if index.numel() else 0
    hi = scores.new_full((size,), -torch.inf).scatter_reduce(0, index, scores, "amax")
    lo = scores.new_full((size,), torch.inf).scatter_reduce(0, index, scores, "amin")
    return (hi == lo)[index]


def _scores(token_level_rewards: torch.Tensor, group_ids: GroupIds) -> tuple[torch.Tensor, torch.Tensor]:
    scores = token_level_rewards.to(compute_dtype(token_level_rewards)).sum(dim=-1)
    return scores, group_index(group_ids, scores.shape[0], scores.device)


def _broadcast_masked(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(as_bool_mask(mask), per_row.unsqueeze(-1), 0.0)


def _mean_without_singletons(scores: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Group mean, 0 for a group of one (verl's convention for GRPO, RF++-baseline, GPG)."""
    count, mean, _ = group_stats(scores, index)
    return torch.where(count < 2, 0.0, mean)


@torch.no_grad()
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    A_i = (s_i − mean_g) / (std_g + eps), std unbiased (n − 1), over the rows of group g = group_ids[i];
    with ``norm_by_std=False`` A_i = s_i − mean_g (Dr. GRPO, arXiv:2503.20783;
    ``algorithm.norm_adv_by_std_in_grpo``). A group of one has mean 0 and std 1 (as verl). A group of two or
    more whose scores are all equal gets exactly 0 (:func:`equal_groups`; verl keeps the mean's rounding
    noise there, up to ~0.1 with fractional float32 scores).
    """
    scores, index = _scores(token_level_rewards, group_ids)
    count, mean, std = group_stats(scores, index)
    single = count < 2
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    adv = (scores - mean) / (std + eps) if norm_by_std else scores - mean
    adv = torch.where(equal_groups(scores, index) & ~single, 0.0, adv)
    adv = _broadcast_masked(adv, response_mask)
    return adv, adv


@torch.no_grad()
def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = s_i − (1/(n−1)) Σ_{j≠i, g_j = g_i} s_j = n/(n−1) · (s_i − mean_g) for a group of n ≥ 2 rows; a
    group of one keeps A_i = s_i (as verl). A group of two or more whose scores are all equal gets exactly 0
    (:func:`equal_groups`; the rounding of ``mean`` leaves ~1e-8 otherwise).
    """
    scores, index = _scores(token_level_rewards, group_ids)
    count, mean, _ = group_stats(scores, index)
    scale = count / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, scores * scale - mean * scale, scores)
    adv = torch.where(equal_groups(scores, index) & (count > 1), 0.0, adv)
    adv = _broadcast_masked(adv, response_mask)
    return adv, adv


@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group-mean baseline (Hu 2025, arXiv:2501.03262, "REINFORCE++-baseline").

    a_i = s_i − mean_g (a group of one: mean 0, as verl), broadcast over the row's response tokens, then
    whitened over all response tokens of the batch: A = masked_whiten(a) (mean and unbiased variance
    weighted by token count, eps 1e-8 under the root). No std division per group, no ``eps`` argument.
    """
    scores, index = _scores(token_level_rewards, group_ids)
    centred = _broadcast_masked(scores - _mean_without_singletons(scores, index), response_mask)
    adv = masked_whiten(centred, response_mask)
    return adv, adv


@torch.no_grad()
def opo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585): length-weighted mean.

    With l_i = Σ_t m_{i,t} the response length: b_g = Σ_{j∈g} l_j s_j / Σ_{j∈g} l_j, A_i = s_i − b_g.
    A group of one has b = 0 (as verl). A group whose rows are all empty has b = 0 (verl divides 0 by 0;
    those rows have no response token, so their advantages are 0 either way).
    """
    scores, index = _scores(token_level_rewards, group_ids)
    count = group_sum(torch.ones_like(scores), index)
    lengths = masked_count(response_mask, dim=-1, dtype=scores.dtype)
    weight = group_sum(lengths, index)
    baseline = group_sum(lengths * scores, index) / weight.clamp(min=1)
    baseline = torch.where((count < 2) | (weight == 0), 0.0, baseline)
    adv = _broadcast_masked(scores - baseline, response_mask)
    return adv, adv


@torch.no_grad()
def grpo_passk(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k advantage, GRPO-style (Chen et al. 2025, arXiv:2503.19595): only a group's best row learns.

    In each group (n ≥ 2 rows required, as verl: ValueError otherwise) the row with the highest score gets
    A = (s_max − s_second) / (std_g + eps) (unbiased std; without the division when ``norm_by_std`` is
    False, ``algorithm.norm_adv_by_std_in_grpo``); every other row gets 0. With a tie for the maximum
    s_max = s_second, so the whole group gets 0 whichever row verl's ``topk`` picks.
    One host sync (the group-size check).
    """
    scores, index = _scores(token_level_rewards, group_ids)
    count, _, std = group_stats(scores, index)
    if bool((count < 2).any()):
        raise ValueError("adv_estimator='grpo_passk' needs at least 2 samples per group (rollout.n >= 2)")
    lowest = torch.finfo(scores.dtype).min
    zeros = torch.full_like(scores, lowest)
    best = zeros.scatter_reduce(0, index, scores, "amax")[index]
    is_best = scores == best
    num_best = group_sum(is_best.to(scores.dtype), index)
    others = torch.where(is_best, lowest, scores)
    second = zeros.scatter_reduce(0, index, others, "amax")[index]
    gap = best - second
    if norm_by_std:
        gap = gap / (std + eps)
    adv = torch.where(is_best & (num_best == 1), gap, 0.0)
    adv = _broadcast_masked(adv, response_mask)
    return adv, adv


@torch.no_grad()
def gpg(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Group Policy Gradient advantage (Chu et al. 2025, arXiv:2504.02546).

    α = B / max(#{i : s_i ≠ 0}, 1) over the whole batch (B rows), A_i = α · (s_i − mean_g) / F_norm with
    F_norm = 1 (verl's fixed default); a group of one has mean 0 (as verl). α is the inverse share of rows
    with a non-zero score (verl counts non-zero scores s_i, not non-zero advantages).
    """
    scores, index = _scores(token_level_rewards, group_ids)
    num_nonzero = (scores != 0).sum().to(scores.dtype)
    alpha = scores.shape[0] / num_nonzero.clamp(min=1)
    adv = _broadcast_masked(alpha * (scores - _mean_without_singletons(scores, index)), response_mask)
    return adv, adv
