"""The phases of one PPO step, each a function from typed values to typed values (no state kept between
calls): generate, forward passes (old / reference log-probs, values), score, rewards and advantages.

The trainer (``ppo_trainer.py``) calls them in order and owns the schedule: which rank holds which rows
(``klppo.parallel.shares``) and which role is on the device (``Run.offload``).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple

import torch

from klppo.agent.multi_turn import MultiTurnRollout
from klppo.algorithms import advantages as adv
from klppo.algorithms import kl as kl_mod
from klppo.algorithms.kl_control import KLController, PenaltyShareWatch
from klppo.algorithms.losses import masked_mean
from klppo.algorithms.rollout_correction import CorrectionSettings
from klppo.assembly.setup import Run
from klppo.batch import Batch, rollout_softmax_log_probs
from klppo.config.schema import AlgorithmConfig
from klppo.config.schema_arr import ActorConfig
from klppo.ops.nonfinite import check_kl
from klppo.parallel.collectives import rank
from klppo.roles.actor import Actor
from klppo.roles.forward import ForwardPlan
from klppo.roles.reward import PendingScores, Reward
from klppo.rollout.base import SamplingParams
from klppo.trainer.step_metrics import ref_kl_metrics

log = logging.getLogger("klppo")

# the per-sample tensor fields computed on each rank and gathered into the global batch
GATHERED = (
    "responses",
    "response_mask",
    "response_attention_mask",
    "rollout_log_probs",
    "rollout_log_kept_mass",
    "old_log_probs",
    "ref_log_probs",
    "values",
    "token_level_scores",
    "reward_baselines",
)


class Rollout(NamedTuple):
    """The samples of one generation (n per prompt, consecutive) and the engine's figures about it."""

    samples: Batch
    stats: dict[str, float]


def sample_seed(seed: int, step: int) -> int:
    """The sampling seed of ``step`` on this rank (a resumed run draws what an uninterrupted one would)."""
    return seed * 1_000_003 + step * 1009 + rank()


def generate(run: Run, prompts: Batch, sampling: SamplingParams, *, seed: int) -> Rollout:
    """Samples for ``prompts`` on the actor's gathered weights (the actor must be on the device)."""
    params = dataclasses.replace(sampling, seed=seed)
    start = time.perf_counter()
    with run.gather_weights() as model:
        if run.device.type == "cuda":
            torch.cuda.synchronize(run.device)
        gather_s = time.perf_counter() - start
        # conversations read the rows' tools / interaction fields
        if isinstance(run.rollout, MultiTurnRollout):
            out = run.rollout.generate(
                model,
                prompts.prompts,
                prompts.prompt_mask,
                params,
                extra_info=prompts.extra_info,
                raw_prompt=prompts.raw_prompt,
            )
        else:
            out = run.rollout.generate(model, prompts.prompts, prompts.prompt_mask, params)
    if run.free_cache_engine:
        run.rollout.release()
    samples = prompts.repeat_interleave(params.n)
    attention, truncated = out.response_attention_mask, out.truncated_log_probs
    samples = samples.replace(
        responses=out.responses,
        response_mask=out.response_mask.to(torch.float32),
        response_attention_mask=None if attention is None else attention.to(torch.float32),
        # the law sampled from (truncated by top-k / top-p: log q = log p − log K), and log K
        rollout_log_probs=out.log_probs if truncated is None else truncated,
        rollout_log_kept_mass=None if truncated is None else out.log_probs - truncated,
        extra_info=samples.extra_info
        if out.extras is None
        else [
            {**(info or {}), **extra}
            for info, extra in zip(samples.extra_info or [{}] * len(out.extras), out.extras)
        ],
    )
    return Rollout(samples, {"timing_s/update_weights": gather_s, **out.stats})


def with_reward_baselines(run: Run, samples: Batch, prompts: Batch, greedy: SamplingParams) -> Batch:
    """``samples`` with ``reward_baselines``: the score of one greedy response per prompt, for each of the
    prompt's samples."""
    scores = run.roles.reward.score(generate(run, prompts, greedy, seed=0).samples)
    n = len(samples) // len(prompts)
    return samples.replace(reward_baselines=scores.sequence.to(run.device).repeat_interleave(n))


def with_old_log_probs(
    actor: Actor,
    samples: Batch,
    *,
    plan: ForwardPlan | None = None,
    unknown_rows: torch.Tensor | None = None,
) -> tuple[Batch, dict[str, float]]:
    """The actor's log-probs of the sampled tokens before the update (over ``plan``'s micro-batches when
    given), and their gap to the behaviour log-probs (the engine's or the log's; ``unknown_rows`` [B] bool:
    rows left out, whose behaviour log-probs are not known yet), like with like: ``rollout/log_prob_diff``
    compares both full tempered softmaxes (with top-k / top-p, the engine's truncated log-probs plus its log
    kept mass), so it measures the two forwards' numerics, not the truncation."""
    samples = samples.replace(old_log_probs=actor.compute_log_prob(samples, plan=plan))
    metrics: dict[str, float] = {}
    if samples.rollout_log_probs is not None:
        diff = (samples.old_log_probs - rollout_softmax_log_probs(samples)).abs()
        mask = samples.response_mask
        mask = mask if unknown_rows is None else mask * ~unknown_rows[:, None]
        metrics["rollout/log_prob_diff"] = float(masked_mean(diff, mask))
    return samples, metrics


def with_scores(reward: Reward, samples: Batch, pending: PendingScores | None = None) -> Batch:
    """``token_level_scores``: each sample's score on its last response token (from ``pending``, the
    background scoring of these samples, when given)."""
    scores = pending.result() if pending is not None else reward.score(samples)
    return samples.replace(token_level_scores=scores.token_level)


def rewards_and_advantages(
    batch: Batch,
    algo: AlgorithmConfig,
    kl_ctrl: KLController,
    *,
    watch: PenaltyShareWatch,
    step: int,
    correction: CorrectionSettings | None = None,
) -> tuple[Batch, dict[str, float]]:
    """KL penalty into the reward (``use_kl_in_reward``; updates ``kl_ctrl``, and ``watch`` warns when the
    penalty outweighs the score), the decoupled rollout correction (``correction``, :func:`with_correction`),
    then the configured advantage estimator, on the global batch."""
    metrics: dict[str, float] = {}
    if algo.use_kl_in_reward:
        rewards, kl_stats = kl_mod.apply_kl_penalty(
            token_level_scores=batch.token_level_scores,
            # bypass mode has no π_old pass: the penalty is the behaviour policy's, as verl's
            log_prob=batch.rollout_log_probs if batch.old_log_probs is None else batch.old_log_probs,
            ref_log_prob=batch.ref_log_probs,
            response_mask=batch.response_mask,
            kl_ctrl=kl_ctrl,
            kind=algo.kl_penalty,
        )
        current_kl = float(kl_stats["kl"])
        check_kl(current_kl)  # a non-finite KL skips the step before the controller moves
        metrics["actor/reward_kl_penalty"] = current_kl
        metrics["actor/reward_kl_penalty_coeff"] = float(kl_stats["kl_coef"])
        if getattr(kl_ctrl, "target", None) is not None:
            metrics["actor/reward_kl_ctrl_target"] = float(kl_ctrl.target)
        share = penalty_share(batch.token_level_scores, rewards)
        metrics["actor/reward_kl_penalty_share"] = share
        if watch.update(share) and rank() == 0:
            score = float(batch.token_level_scores.sum(dim=-1).abs().mean())
            log.warning(penalty_share_message(step, watch.streak, share, kl_ctrl.value, algo, score))
        kl_ctrl.update(current_kl, len(batch))
    else:
        rewards = batch.token_level_scores
    if correction is not None and not correction.bypass_mode:
        batch, corr_metrics = with_correction(batch, correction)
        metrics.update(corr_metrics)
    advantages, returns = adv.compute_advantages(
        algo.adv_estimator,
        token_level_rewards=rewards,
        response_mask=batch.response_mask,
        values=batch.values,
        group_ids=batch.uid,
        reward_baselines=batch.reward_baselines,
        gamma=algo.gamma,
        lam=algo.lam,
        norm_by_std=algo.norm_adv_by_std_in_grpo,
    )
    return batch.replace(token_level_rewards=rewards, advantages=advantages, returns=returns), metrics


def with_correction(batch: Batch, correction: CorrectionSettings) -> tuple[Batch, dict[str, float]]:
    """Decoupled rollout correction of the global batch (verl's place: after the KL penalty, before the
    advantages): ``rollout_is_weights`` from π_old against the log-probs of the distribution the rollout
    sampled from (``rollout_log_probs``: with top-k / top-p, the truncated one), the rejection of
    ``rollout_rs``, and the step's ``rollout_corr/*`` metrics (one device→host transfer).

    Rejection replaces ``response_mask`` by the kept tokens, as verl does: from here on every consumer of
    the mask leaves the rejected tokens out — the advantages (0 on them; GAE skips them as it skips
    padding), the actor's policy, KL and entropy terms and their metrics, the critic's value loss, the
    token and row counts that weight the update's micro-batches, and the KL the KL-loss controller
    measures. The rejected tokens stay in the model's input: ``response_attention_mask`` keeps every
    response token attended to. The KL penalty in the reward, computed before, covers them all."""
    if batch.rollout_log_probs is None or batch.old_log_probs is None:
        raise ValueError("algorithm.rollout_correction needs the rollout's and the old policy's log-probs")
    result = correction.apply(batch.old_log_probs, batch.rollout_log_probs, batch.response_mask)
    weights = None if result.weights is None else result.weights.to(torch.float32)
    names = list(result.metrics)
    values = torch.stack([result.metrics[k].double() for k in names]).tolist() if names else []
    metrics = dict(zip(names, values, strict=True))
    if not correction.rs_options:
        return batch.replace(rollout_is_weights=weights), metrics
    kept = batch.replace(
        rollout_is_weights=weights,
        response_mask=result.response_mask,
        response_attention_mask=batch.response_tokens_mask,
    )
    return kept, metrics


def penalty_share(scores: torch.Tensor, rewards: torch.Tensor) -> float:
    """mean_i |β·Σ_t KL_i,t| ÷ mean_i |Σ_t score_i,t| (``scores`` − ``rewards`` is the penalty, [B, R]): how
    large the KL penalty is next to the task score (magnitudes: a k1 penalty can be negative, and a large
    bonus drowns the score as well)."""
    penalty = (scores - rewards).sum(dim=-1).abs().mean()
    score = scores.sum(dim=-1).abs().mean()
    return float(penalty) / max(float(score), 1e-6)


def penalty_share_message(
    step: int, streak: int, share: float, beta: float, algo: AlgorithmConfig, score: float
) -> str:
    """The warning when the KL penalty outweighs the task score (``score``: mean |Σ_t score|), with the
    setting that acts for the controller in use — a fixed β is set by kl_coef; an adaptive or PI one moves
    β toward target_kl, so kl_coef only sets where it starts."""
    head = f"step {step}: the KL penalty in the reward outweighs the task score for {streak} steps"
    if score < 1e-6:
        return (
            f"{head}: every sample scored 0 — there is no task signal for the penalty to outweigh; check "
            "the reward function and whether the prompts are within the policy's reach (β need not change)"
        )
    ctrl = algo.kl_ctrl
    if ctrl.type == "fixed":
        act = f"lower algorithm.kl_ctrl.kl_coef (β={beta:.4g}, fixed)"
    else:
        act = (
            f"raise algorithm.kl_ctrl.target_kl (now {ctrl.target_kl}; the {ctrl.type} controller moves "
            f"β={beta:.4g} toward it — kl_coef only sets where β starts)"
        )
    return (
        f"{head} (share {share:.2f}): the policy is pulled back toward the reference instead of learning. "
        f"{act[0].upper()}{act[1:]}, or move the KL into the loss (actor_rollout_ref.actor.use_kl_loss with "
        "kl_loss_ctrl)"
    )


def measure_kl_for_control(batch: Batch, actor: ActorConfig) -> dict[str, float]:
    """KL(π_old‖π_ref) of the global batch for the KL-loss controller: token mean of the ``kl_loss_type``
    estimator from the old-log-prob pass. With the on-policy skip there is no such pass: the actor reports
    the same figure from its update's forward (at the pre-step weights, i.e. π_old)."""
    if not actor.use_kl_loss or batch.ref_log_probs is None or batch.old_log_probs is None:
        return {}
    kl = kl_mod.kl_penalty(
        batch.old_log_probs, batch.ref_log_probs, kl_mod.sampled_estimator(actor.kl_loss_type)
    )
    return {"actor/kl_loss_ctrl_kl": float(masked_mean(kl, batch.response_mask))}


def whole_batch_kl(batch: Batch, actor: ActorConfig) -> dict[str, float]:
    """The KL metrics of every sample of the global batch when an on-policy update (no old-log-prob pass)
    left rows out (``actor.skip_zero_advantage_rows``) and so measured its own only: π_old is then the
    rollout engine's log-probs of the same weights (``rollout/log_prob_diff`` says how close they are).
    ``actor/ref_kl_k1``, ``actor/ref_kl_k3`` and, with a KL loss, the controller's
    ``actor/kl_loss_ctrl_kl``."""
    if batch.ref_log_probs is None or batch.rollout_log_probs is None:
        return {}
    old = rollout_softmax_log_probs(batch)  # the full softmax's, as the update's forward measures
    out = {k: float(v) for k, v in ref_kl_metrics(old, batch.ref_log_probs, batch.response_mask).items()}
    out.update(measure_kl_for_control(batch.replace(old_log_probs=old), actor))
    return out


def update_rows_metrics(
    metrics: dict[str, float], batch: Batch, actor: ActorConfig, num_update_rows: int, *, bypass: bool
) -> dict[str, float]:
    """With ``actor.skip_zero_advantage_rows``: the share of rows updated, and while the update is on-policy
    (no old-log-prob pass) its forward's KL figures, which cover the kept rows only, as ``*_update_rows``
    beside every sample's (:func:`whole_batch_kl`), which replace them and feed the controller on every
    step — one source whether or not rows were left out. In bypass mode (``bypass``) the engine's log-probs
    are the behaviour policy's, not the trained one's: the update's figures stay."""
    out = {"actor/update_rows_share": num_update_rows / len(batch)}
    if batch.old_log_probs is None and not bypass:
        out.update(
            {f"{k}_update_rows": metrics[k] for k in ("actor/ref_kl_k1", "actor/ref_kl_k3") if k in metrics}
        )
        out.update(whole_batch_kl(batch, actor))
    return out


def control_kl_loss(metrics: dict[str, float], kl_loss_ctrl: KLController, num_samples: int) -> None:
    """After the step's actor update: the controller sees this step's KL(π_old‖π_ref) and sets the β of
    the next step's KL loss (β_t depends on KL_1 … KL_{t−1}, as the reward-side controller in verl)."""
    if "actor/kl_loss_ctrl_kl" in metrics:
        kl_loss_ctrl.update(metrics["actor/kl_loss_ctrl_kl"], num_samples)
        if getattr(kl_loss_ctrl, "target", None) is not None:  # the target this step's KL was held to
            metrics["actor/kl_loss_ctrl_target"] = float(kl_loss_ctrl.target)
