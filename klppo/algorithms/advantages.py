"""Advantage estimators (verl ``algorithm.adv_estimator``): GAE, GRPO, RLOO, REINFORCE++, ReMax.

Every estimator takes ``token_level_rewards`` [B, T] (scores with the KL penalty already folded in when
``use_kl_in_reward``) and a 0/1 ``response_mask`` [B, T], and returns ``(advantages, returns)``, both
[B, T], computed without autograd, 0 at masked positions (verl leaves some of them non-zero; we zero them
on purpose), in float32 (float64 if an input is float64).

Outcome estimators (GRPO, RLOO) use one scalar per row, the row sum of ``token_level_rewards`` over all
positions (as verl), and compare it with the other rows of the same group: ``group_ids`` holds one hashable
per row (the prompt ``uid``), or is a 1-D integer tensor.

:data:`ADVANTAGE_ESTIMATORS` maps each ``adv_estimator`` name to its function and its needs, and
:func:`compute_advantages` dispatches by name, so the trainer needs no if-chain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from klppo.algorithms.masked import as_bool_mask, compute_dtype, masked_whiten

GroupIds = Sequence[Hashable] | torch.Tensor


def _group_index(group_ids: GroupIds, batch_size: int, device: torch.device) -> torch.Tensor:
    """Dense group index [B] int64 on ``device`` (first-seen order for Python ids)."""
    if len(group_ids) != batch_size:
        raise ValueError(f"group_ids has {len(group_ids)} entries for a batch of {batch_size} rows")
    if isinstance(group_ids, torch.Tensor):
        return torch.unique(group_ids.to(device), return_inverse=True)[1].reshape(-1)
    dense: dict[Hashable, int] = {}
    index = [dense.setdefault(g, len(dense)) for g in group_ids]
    return torch.tensor(index, dtype=torch.long, device=device)


def _group_stats(
    scores: torch.Tensor, index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row (group size n, group mean, unbiased group std) gathered back to [B]; two-pass variance."""
    zeros = torch.zeros(scores.shape[0], dtype=scores.dtype, device=scores.device)  # ≥ number of groups
    count = zeros.index_add(0, index, torch.ones_like(scores))
    mean = zeros.index_add(0, index, scores) / count.clamp(min=1)
    sq = zeros.index_add(0, index, (scores - mean[index]).square())
    std = torch.sqrt(sq / (count - 1).clamp(min=1))
    return count[index], mean[index], std[index]


def _broadcast_masked(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(as_bool_mask(mask), per_row.unsqueeze(-1), 0.0)


@torch.no_grad()
def gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438); needs a critic.

    Over the response tokens t of a row (masked positions are skipped: their reward and value are
    ignored and the recursion links each token to the next unmasked one, t'):
        δ_t = r_t + γ V_{t'} − V_t   (V after the last token = 0)
        A_t = δ_t + γ λ A_{t'}
        returns_t = A_t + V_t
    Advantages are then whitened over all response tokens of the batch (``masked_whiten``).

    Args:
        token_level_rewards, values, response_mask: [B, T].
        gamma, lam: ``algorithm.gamma``, ``algorithm.lam``.
    """
    dtype = compute_dtype(token_level_rewards, values)
    rewards, vals = token_level_rewards.to(dtype), values.to(dtype)
    mask = as_bool_mask(response_mask)
    batch, length = rewards.shape
    next_value = torch.zeros(batch, dtype=dtype, device=rewards.device)
    last_gae = torch.zeros_like(next_value)
    adv = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        candidate = delta + gamma * lam * last_gae
        next_value = torch.where(mask[:, t], vals[:, t], next_value)
        last_gae = torch.where(mask[:, t], candidate, last_gae)
        adv[:, t] = last_gae
    returns = torch.where(mask, adv + vals, 0.0)
    return masked_whiten(adv, mask), returns


@torch.no_grad()
def grpo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300).

    s_i = Σ_t r_{i,t};  A_i = (s_i − mean_g) / (std_g + eps), std unbiased (n − 1), over the rows of
    group g = group_ids[i]; with ``norm_by_std=False`` A_i = s_i − mean_g (Dr. GRPO, arXiv:2503.20783;
    ``algorithm.norm_adv_by_std_in_grpo``). A group of one has mean 0 and std 1 (as verl).
    A_i is broadcast over the row's response tokens; returns = advantages.
    """
    dtype = compute_dtype(token_level_rewards)
    scores = token_level_rewards.to(dtype).sum(dim=-1)
    index = _group_index(group_ids, scores.shape[0], scores.device)
    count, mean, std = _group_stats(scores, index)
    single = count < 2
    mean = torch.where(single, 0.0, mean)
    std = torch.where(single, 1.0, std)
    adv = (scores - mean) / (std + eps) if norm_by_std else scores - mean
    adv = _broadcast_masked(adv, response_mask)
    return adv, adv


@torch.no_grad()
def rloo(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: GroupIds,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024, arXiv:2402.14740).

    s_i = Σ_t r_{i,t};  A_i = s_i − (1/(n−1)) Σ_{j≠i, g_j = g_i} s_j = n/(n−1) · (s_i − mean_g) for a group
    of n ≥ 2 rows; a group of one keeps A_i = s_i (as verl). Broadcast over the row; returns = advantages.
    """
    dtype = compute_dtype(token_level_rewards)
    scores = token_level_rewards.to(dtype).sum(dim=-1)
    index = _group_index(group_ids, scores.shape[0], scores.device)
    count, mean, _ = _group_stats(scores, index)
    scale = count / (count - 1).clamp(min=1)
    adv = torch.where(count > 1, scores * scale - mean * scale, scores)
    adv = _broadcast_masked(adv, response_mask)
    return adv, adv


@torch.no_grad()
def reinforce_plus_plus(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return, whitened over the batch.

    G_t = r_t + γ G_{t+1}, restarted (G = 0) after each masked position, so a row's return never leaks in
    from padding; the per-token KL penalty enters through ``token_level_rewards`` (use_kl_in_reward).
    advantages = masked_whiten(G) over all response tokens; returns = G (both 0 outside the mask).
    """
    dtype = compute_dtype(token_level_rewards)
    rewards = token_level_rewards.to(dtype)
    mask = as_bool_mask(response_mask)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = torch.where(mask[:, t], running, 0.0)
    returns = torch.where(mask, returns, 0.0)
    return masked_whiten(returns, mask), returns


@torch.no_grad()
def remax(
    token_level_rewards: torch.Tensor,
    reward_baselines: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): baseline = the greedy response's reward.

    returns_t = Σ_{t' ≥ t} r_{t'} m_{t'} (undiscounted reward-to-go over response tokens);
    advantages_t = returns_t − b, with b = ``reward_baselines`` [B] the score of the greedy sample for
    the same prompt. Not whitened.
    """
    dtype = compute_dtype(token_level_rewards, reward_baselines)
    mask = as_bool_mask(response_mask)
    rewards = torch.where(mask, token_level_rewards.to(dtype), 0.0)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    adv = torch.where(mask, returns - reward_baselines.to(dtype).reshape(-1, 1), 0.0)
    return adv, torch.where(mask, returns, 0.0)


def _run_gae(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return gae(kw["token_level_rewards"], kw["values"], kw["response_mask"], gamma=kw["gamma"], lam=kw["lam"])


def _run_grpo(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return grpo(
        kw["token_level_rewards"],
        kw["response_mask"],
        kw["group_ids"],
        eps=kw["eps"],
        norm_by_std=kw["norm_by_std"],
    )


def _run_rloo(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return rloo(kw["token_level_rewards"], kw["response_mask"], kw["group_ids"])


def _run_reinforce_plus_plus(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return reinforce_plus_plus(kw["token_level_rewards"], kw["response_mask"], gamma=kw["gamma"])


def _run_remax(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return remax(kw["token_level_rewards"], kw["reward_baselines"], kw["response_mask"])


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    """An ``algorithm.adv_estimator`` entry: the function, an adapter from ``compute_advantages``'s
    keyword arguments to it, and what the trainer must provide."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    run: Callable[[dict[str, Any]], tuple[torch.Tensor, torch.Tensor]]
    needs_critic: bool = False  # values from a critic, and a critic update
    needs_group_ids: bool = False  # several samples per prompt (rollout.n > 1), grouped by uid
    needs_reward_baselines: bool = False  # one extra greedy sample per prompt, scored


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    "gae": AdvantageEstimator("gae", gae, _run_gae, needs_critic=True),
    "grpo": AdvantageEstimator("grpo", grpo, _run_grpo, needs_group_ids=True),
    "rloo": AdvantageEstimator("rloo", rloo, _run_rloo, needs_group_ids=True),
    "reinforce_plus_plus": AdvantageEstimator(
        "reinforce_plus_plus", reinforce_plus_plus, _run_reinforce_plus_plus
    ),
    "remax": AdvantageEstimator("remax", remax, _run_remax, needs_reward_baselines=True),
}


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """Registry entry for ``name``; ValueError listing the valid names otherwise."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown adv_estimator {name!r}; valid: {', '.join(ADVANTAGE_ESTIMATORS)}")
    return ADVANTAGE_ESTIMATORS[name]


def needs_critic(name: str) -> bool:
    """Whether ``adv_estimator=name`` needs a critic (only ``gae``)."""
    return get_advantage_estimator(name).needs_critic


def compute_advantages(
    name: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    group_ids: GroupIds | None = None,
    reward_baselines: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run estimator ``name`` (``algorithm.adv_estimator``) with the inputs it uses; others are ignored.

    ``gamma``/``lam`` are ``algorithm.gamma``/``algorithm.lam``, ``norm_by_std`` is
    ``algorithm.norm_adv_by_std_in_grpo``. ValueError if an input the estimator needs is None.
    """
    est = get_advantage_estimator(name)
    needed = {
        "values": (est.needs_critic, values),
        "group_ids": (est.needs_group_ids, group_ids),
        "reward_baselines": (est.needs_reward_baselines, reward_baselines),
    }
    missing = [k for k, (need, v) in needed.items() if need and v is None]
    if missing:
        raise ValueError(f"adv_estimator {name!r} needs {', '.join(missing)}")
    return est.run(
        {
            "token_level_rewards": token_level_rewards,
            "response_mask": response_mask,
            "values": values,
            "group_ids": group_ids,
            "reward_baselines": reward_baselines,
            "gamma": gamma,
            "lam": lam,
            "norm_by_std": norm_by_std,
            "eps": eps,
        }
    )
