"""Advantage estimators (verl ``algorithm.adv_estimator``): GAE, REINFORCE++, ReMax here; the group
outcome estimators (GRPO, RLOO, REINFORCE++-baseline, OPO, GRPO pass@k, GPG) in :mod:`.outcome`.

Every estimator takes ``token_level_rewards`` [B, T] (scores with the KL penalty already folded in when
``use_kl_in_reward``) and a 0/1 ``response_mask`` [B, T], and returns ``(advantages, returns)``, both
[B, T], computed without autograd, 0 at masked positions (verl leaves some of them non-zero; we zero them
on purpose), in float32 (float64 if an input is float64).

Outcome estimators use one scalar per row, the row sum of ``token_level_rewards`` over all
positions (as verl), and compare it with the other rows of the same group: ``group_ids`` holds one hashable
per row (the prompt ``uid``), or is a 1-D integer tensor.

:data:`ADVANTAGE_ESTIMATORS` maps each ``adv_estimator`` name to its function and its needs, and
:func:`compute_advantages` dispatches by name, so the trainer needs no if-chain.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from klppo.algorithms.masked import as_bool_mask, compute_dtype, masked_whiten
from klppo.algorithms.outcome import (
    GroupIds,
    gpg,
    grpo,
    grpo_passk,
    opo,
    reinforce_plus_plus_baseline,
    rloo,
)
from klppo.algorithms.scan import reverse_linear_scan

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "GroupIds",
    "compute_advantages",
    "gae",
    "get_advantage_estimator",
    "gpg",
    "grpo",
    "grpo_passk",
    "needs_critic",
    "opo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "rloo",
]


def _compaction_index(mask: torch.Tensor) -> torch.Tensor:
    """Where each position of a row goes when its set positions are moved to the left, in order.

    dest_t = #{set positions before t} for a set t, n + #{unset positions before t} for an unset t (n = the
    row's set count): a permutation of 0 … T−1 per row ([B, T] int64). ``compact.scatter(-1, dest, x)``
    packs a row, ``compact.gather(-1, dest)`` unpacks it.
    """
    kept = mask.long()
    rank_kept = kept.cumsum(-1) - 1
    rank_dropped = (1 - kept).cumsum(-1) - 1
    return torch.where(mask, rank_kept, kept.sum(-1, keepdim=True) + rank_dropped)


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

    Each row's response tokens are packed to the left (``_compaction_index``), so t' = t + 1 there and
    A = ``reverse_linear_scan(δ, γλ)``; the result is unpacked to the original positions.

    Args:
        token_level_rewards, values, response_mask: [B, T].
        gamma, lam: ``algorithm.gamma``, ``algorithm.lam``.
    """
    dtype = compute_dtype(token_level_rewards, values)
    mask = as_bool_mask(response_mask)
    rewards = torch.where(mask, token_level_rewards.to(dtype), 0.0)  # masked garbage never enters
    vals = torch.where(mask, values.to(dtype), 0.0)
    dest = _compaction_index(mask)
    packed_r = torch.zeros_like(rewards).scatter_(-1, dest, rewards)
    packed_v = torch.zeros_like(vals).scatter_(-1, dest, vals)  # 0 past the row's last token
    next_v = F.pad(packed_v[:, 1:], (0, 1))
    delta = packed_r + gamma * next_v - packed_v  # 0 on the packed padding
    adv = reverse_linear_scan(delta, gamma * lam).gather(-1, dest)
    adv = torch.where(mask, adv, 0.0)
    returns = adv + vals  # both 0 at masked positions
    return masked_whiten(adv, mask), returns


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

    One segmented scan: G_t = r_t + a_t G_{t+1} with a_t = γ·m_{t+1} (``reverse_linear_scan``).
    """
    dtype = compute_dtype(token_level_rewards)
    mask = as_bool_mask(response_mask)
    rewards = torch.where(mask, token_level_rewards.to(dtype), 0.0)
    coef = F.pad(mask[:, 1:].to(dtype) * gamma, (0, 1))  # a_{T−1} is never used
    returns = torch.where(mask, reverse_linear_scan(rewards, coef), 0.0)
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


def _run_reinforce_plus_plus_baseline(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return reinforce_plus_plus_baseline(kw["token_level_rewards"], kw["response_mask"], kw["group_ids"])


def _run_opo(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return opo(kw["token_level_rewards"], kw["response_mask"], kw["group_ids"])


def _run_grpo_passk(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return grpo_passk(
        kw["token_level_rewards"],
        kw["response_mask"],
        kw["group_ids"],
        eps=kw["eps"],
        norm_by_std=kw["norm_by_std"],
    )


def _run_gpg(kw: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    return gpg(kw["token_level_rewards"], kw["response_mask"], kw["group_ids"])


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
    "reinforce_plus_plus_baseline": AdvantageEstimator(
        "reinforce_plus_plus_baseline",
        reinforce_plus_plus_baseline,
        _run_reinforce_plus_plus_baseline,
        needs_group_ids=True,
    ),
    "opo": AdvantageEstimator("opo", opo, _run_opo, needs_group_ids=True),
    "grpo_passk": AdvantageEstimator("grpo_passk", grpo_passk, _run_grpo_passk, needs_group_ids=True),
    "gpg": AdvantageEstimator("gpg", gpg, _run_gpg, needs_group_ids=True),
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
    ``algorithm.norm_adv_by_std_in_grpo`` (grpo, grpo_passk), ``eps`` the std epsilon of those two.
    ValueError if an input the estimator needs is None.
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
