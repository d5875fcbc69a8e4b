"""The KL-PPO loop. One instance per rank (SPMD); reads top to bottom like the algorithm:

    prompts → rollout → old/ref log-probs, values → scores → KL penalty in reward → advantages
    → critic update → actor update → KL controller update → metrics → checkpoint → validation

Each rank rolls out and scores its contiguous share of the step's prompts (all samples of one prompt stay
on one rank); the per-sample fields are then all-gathered so that rewards, KL penalty and advantages are
computed on the global batch, identically on every rank (batch-level whitening and group statistics need
it); each rank then updates on its share, and FSDP averages the gradients.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from klppo.algorithms.kl_control import PenaltyShareWatch
from klppo.assembly.setup import Run
from klppo.batch import Batch
from klppo.data.logged import LoggedLoader
from klppo.data.mixed import MixedBatch
from klppo.ops.checkpoint import load_checkpoint, save_checkpoint
from klppo.ops.dumps import chat_text, dump_rollouts, dump_samples
from klppo.ops.monitor import best_checkpoint_step, build_monitor
from klppo.ops.nonfinite import (
    STEP_INPUTS,
    STEP_TARGETS,
    NonFiniteStep,
    check_finite,
    record_skipped_step,
)
from klppo.ops.profiler import StepProfiler
from klppo.ops.stopping import StopRequest
from klppo.parallel.collectives import all_gather_objects, all_reduce_sum_values, rank, world_size
from klppo.parallel.shares import (
    padded_share,
    reduce_metrics,
    rows_with_advantage,
    shard_for_update,
)
from klppo.roles.forward import ForwardPlan
from klppo.roles.reward import PendingScores
from klppo.roles.trained import TrainedRole
from klppo.trainer.logged_phases import is_logged, with_behaviour_stand_in
from klppo.trainer.mixed_phases import (
    gather_step,
    shard_step,
    unknown_behaviour_rows,
    with_logged_groups,
    with_step_scores,
)
from klppo.trainer.phases import (
    control_kl_loss,
    generate,
    measure_kl_for_control,
    rewards_and_advantages,
    sample_seed,
    update_rows_metrics,
    with_old_log_probs,
    with_reward_baselines,
)
from klppo.trainer.ref_cache import RefLogProbCache
from klppo.trainer.step_metrics import batch_metrics, perf_metrics, validation_metrics
from klppo.trainer.timer import PhaseTimer

log = logging.getLogger("klppo")
TURN_FIELDS = ("num_turns", "turn_scores")
"""A multi-turn validation sample's fields kept in its record and dump (klppo.agent.multi_turn's extras)."""


def _align_ranks(timer: PhaseTimer) -> None:
    """On several ranks, one 8-byte all-reduce before the updates, timed as ``timing_s/rank_wait``: how far
    the ranks drifted apart since their last collective (rewards, advantages, the host's batch split) is
    waited out there instead of inside the first update phase, so ``timing_s/update_*`` measure the updates
    (issue 21: rank imbalance told apart from communication). The step's total is unchanged."""
    if world_size() > 1:
        with timer.phase("rank_wait"):
            all_reduce_sum_values([0.0])


@dataclass(frozen=True)
class StepDone:
    """What a step's phases leave for its metrics: the global batch, the phases' metrics, what was non-finite
    if the step skipped an update (None: it did not), and the rows the actor updated on (None: no update)."""

    batch: Batch
    metrics: dict[str, float]
    skipped: str | None = None
    update_rows: Batch | None = None


@dataclass
class TrainerState:
    """What carries from one step to the next (and into checkpoints)."""

    global_step: int = 0
    num_nan_steps: int = 0
    """Steps skipped for a non-finite value (trainer/nonfinite.py)."""
    penalty_share: PenaltyShareWatch = field(
        default_factory=lambda: PenaltyShareWatch(threshold=1.0, patience=5)
    )
    """Steps in a row the reward's KL penalty outweighed the score."""


def updates_actor(step: int, critic_warmup: int) -> bool:
    """verl's rule: the actor is updated at step ``step`` (counted from 1) once ``critic_warmup <= step``;
    earlier steps train only the critic."""
    return critic_warmup <= step


class PPOTrainer:
    def __init__(self, run: Run) -> None:
        self.run = run
        self.cfg = run.cfg
        self.state = TrainerState()
        self._stop = StopRequest()
        self.monitor = build_monitor(run, self._trainer_state, rank=rank())
        self.profiler = StepProfiler(run.cfg.global_profiler, device=run.device, rank=rank())
        # a run on logs alone meets each sample again on every pass: its reference log-probs are kept
        logs_only = isinstance(run.loaders.train, LoggedLoader)
        self.ref_cache = RefLogProbCache() if logs_only and run.roles.reference is not None else None

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainerState:
        self._stop.install()
        try:
            return self._fit()
        finally:
            try:
                self.monitor.finish(self.state.global_step)  # the summary also when a step failed
                self.run.trackers.metrics.close()  # flushed also when a step fails (TensorBoard, W&B, …)
            finally:
                self.run.roles.reward.close()  # the background scoring processes, if any
                self._stop.restore()

    def _fit(self) -> TrainerState:
        run, tcfg = self.run, self.cfg.trainer
        tracker, val_loader = run.trackers.metrics, run.loaders.val
        self._maybe_resume()
        total = run.total_training_steps
        if self.state.global_step >= total and rank() == 0:
            log.warning(
                "the run in %s already reached step %d of trainer.total_training_steps=%d (resumed from "
                "%s): nothing to train. Raise total_training_steps/total_epochs to continue, or start over "
                "with "
                "trainer.resume_mode=disable or another trainer.default_local_dir.",
                run.run_dir,
                self.state.global_step,
                total,
                run.resume_path,
            )
        tracker.set_total_steps(total)
        at_start = self.state.global_step == 0 and tcfg.val_before_train
        # val_only: the resumed model too, never trained
        if val_loader is not None and (at_start or tcfg.val_only):
            step = self.state.global_step
            val = self.validate()
            self.monitor.observe_validation(step, val)
            tracker.log(val, step=step)
            if tcfg.val_only:
                return self.state
        while self.state.global_step < total:
            prompts = run.loaders.train.next_batch().to(run.device)
            self.state.global_step += 1
            step = self.state.global_step
            metrics: dict[str, float] = {}
            with self.profiler.step(step, metrics):
                metrics.update(self.train_step(prompts, step))
            signalled = self._stop.agreed()  # one collective: every rank stops after the same step
            last = step >= total or signalled
            val = None
            if val_loader is not None and tcfg.test_freq > 0 and (step % tcfg.test_freq == 0 or last):
                val = self.validate()
            stop = self.monitor.observe(step, metrics, val)  # the rules act before the checkpoint
            tracker.log(metrics, step=step)
            if val is not None:
                tracker.log(val, step=step)
            if (tcfg.save_freq > 0 and (step % tcfg.save_freq == 0 or last or stop)) or signalled:
                self.save()
            if stop:
                log.warning("stopping after step %d: %s", step, self.monitor.stop_reason)
                break
            if signalled:
                log.warning(
                    "stopping after step %d on a signal; checkpoint saved, resume with the same command", step
                )
                break
        return self.state

    def train_step(self, prompts: Batch | MixedBatch, step: int) -> dict[str, float]:
        """One PPO step: generate → score → gather → advantages → updates; returns the step's metrics."""
        timer = PhaseTimer(self.run.device)
        with timer.phase("step"), self.run.offload.on_device(self.run.roles.actor):
            done = self._phases(prompts, step, timer)
        if self.cfg.trainer.rollout_data_dir and rank() == 0:
            dump_rollouts(
                self.cfg.trainer.rollout_data_dir, step, done.batch, self.run.tokenizer, self.run.roles.reward
            )
        metrics = self._step_metrics(done.batch, timer, done.metrics, update_batch=done.update_rows)
        return self._count_skipped(metrics, step, done.skipped)

    def _phases(self, prompts: Batch | MixedBatch, step: int, timer: PhaseTimer) -> StepDone:
        """The step's phases, the actor on the device (the caller's), the critic from its values to its
        update; a non-finite advantage input or target updates no model, a skipped critic step no actor."""
        run, roles = self.run, self.run.roles
        local, rollout_stats, pending = self._rollout(shard_step(prompts), step, timer)
        local, metrics, plan = self._old_log_probs(local, timer)
        local = with_behaviour_stand_in(run, self._reference_log_probs(local, timer, plan))
        with self._critic_on_device():
            local = self._values(local, timer)
            with timer.phase("reward"):
                local = with_step_scores(roles.reward, prompts, local, pending)
            batch = gather_step(run, prompts, local)
            if self.ref_cache is not None:
                self.ref_cache.keep(batch)
            batch, adv_metrics, skipped = self._checked_advantages(batch, step, timer)
            if skipped is not None:
                return StepDone(batch, {**metrics, **adv_metrics, **rollout_stats}, skipped=skipped)
            rows, num_mini_batches = self._update_rows(batch)
            share = shard_for_update(
                rows, balance=self.cfg.trainer.balance_batch, sp_size=roles.actor.update.sp_size
            )
            _align_ranks(timer)
            critic_metrics, skipped = self._update_critic(self._critic_share(batch, share), timer)
        if skipped is not None:
            return StepDone(
                batch, {**metrics, **adv_metrics, **critic_metrics, **rollout_stats}, skipped=skipped
            )
        actor_metrics, skipped = self._update_actor(
            batch, share, step, timer, num_update_rows=len(rows), num_mini_batches=num_mini_batches
        )
        metrics = {**metrics, **adv_metrics, **critic_metrics, **actor_metrics, **rollout_stats}
        return StepDone(batch, metrics, skipped=skipped, update_rows=rows if skipped is None else None)

    def _rollout(
        self, mine: Batch | MixedBatch, step: int, timer: PhaseTimer
    ) -> tuple[Batch, dict, PendingScores | None]:
        """This rank's samples (with the greedy baselines ReMax-like estimators need; a mixed step's logged
        groups after the generated ones), the engine's figures, and the generated samples' scores when they
        are computed in the background (``launch_reward_fn_async``), started here so that they overlap the
        log-prob, reference and value passes."""
        run = self.run
        if is_logged(mine):  # logged samples (data.logged_files): nothing to generate or to score yet
            return mine, {}, None
        prompts = mine.prompts if isinstance(mine, MixedBatch) else mine
        with timer.phase("gen"):
            seed = sample_seed(self.cfg.trainer.seed, step)
            local, rollout_stats = generate(run, prompts, run.sampling.train, seed=seed)
        if run.sampling.greedy is not None:
            with timer.phase("gen_max"):
                local = with_reward_baselines(run, local, prompts, run.sampling.greedy)
        pending = None
        if run.roles.reward.worker is not None:
            with timer.phase("reward"):  # the host's share of background scoring: token ids read and sent
                pending = run.roles.reward.submit(local, seed=seed)
        return with_logged_groups(run, local, mine), rollout_stats, pending

    def _checked_advantages(
        self, batch: Batch, step: int, timer: PhaseTimer
    ) -> tuple[Batch, dict[str, float], str | None]:
        """Rewards (KL penalty) and advantages of the global batch, its inputs and targets checked finite:
        (batch, metrics, None), or with the first non-finite value named as the third item."""
        adv_metrics: dict[str, float] = {}
        try:
            check_finite(batch, STEP_INPUTS, paths=self._data_paths)
            with timer.phase("adv"):
                batch, adv_metrics = rewards_and_advantages(
                    batch,
                    self.cfg.algorithm,
                    self.run.kl_ctrl,
                    watch=self.state.penalty_share,
                    step=step,
                    correction=self.run.roles.actor.settings.rollout_correction,
                )
            check_finite(batch, STEP_TARGETS, paths=self._data_paths)
        except NonFiniteStep as exc:
            return batch, adv_metrics, str(exc)
        return batch, adv_metrics, None

    def _count_skipped(self, metrics: dict[str, float], step: int, skipped: str | None) -> dict[str, float]:
        """A step skipped for a non-finite value is counted (and past ``trainer.max_nan_steps`` stops)."""
        if skipped is not None:
            self.state.num_nan_steps = record_skipped_step(
                step, skipped, count=self.state.num_nan_steps, limit=self.cfg.trainer.max_nan_steps
            )
            metrics["training/nan_steps"] = float(self.state.num_nan_steps)
        return metrics

    # ------------------------------------------------------------------ phases with their offload schedule
    def _old_log_probs(
        self, samples: Batch, timer: PhaseTimer
    ) -> tuple[Batch, dict[str, float], ForwardPlan | None]:
        """π_old's log-probs, unless the update is on-policy (then π_old = the update's own log-probs) or in
        bypass mode (π_old = the behaviour policy's ``rollout_log_probs``, which the actor's loss reads); the
        pass's micro-batches, cut and packed once, also serve the reference."""
        actor = self.run.roles.actor
        if actor.bypass_mode:  # π_old = π_rollout: the actor's loss takes it (verl's bypass mode)
            return samples, {}, None
        # on-policy: π_old = the update's log-probs; the update's rows per rank are a Ulysses group's
        if actor.skips_old_log_prob(len(samples) * actor.update.sp_size):
            return samples, {}, None
        with timer.phase("old_log_prob"):
            plan = actor.log_prob_plan(samples)
            unknown = unknown_behaviour_rows(self.run, samples)
            samples, metrics = with_old_log_probs(actor, samples, plan=plan, unknown_rows=unknown)
        return samples, metrics, plan

    def _reference_log_probs(self, samples: Batch, timer: PhaseTimer, plan: ForwardPlan | None) -> Batch:
        """Reference log-probs, with the reference on the device just for them; over ``plan`` (the
        old-log-prob pass's micro-batches) when its micro-batching is the reference's; on a run from logs
        alone, the kept ones when every rank has all of its samples' (``ref_cache.py``)."""
        run, reference = self.run, self.run.roles.reference
        if reference is None:
            return samples
        kept = None if self.ref_cache is None else self.ref_cache.lookup(samples)
        if kept is not None:  # a logged sample met before (ref_cache.py)
            return samples.replace(ref_log_probs=kept)
        with timer.phase("ref"), run.offload.on_device(reference):
            return samples.replace(ref_log_probs=reference.compute_ref_log_prob(samples, plan=plan))

    def _values(self, samples: Batch, timer: PhaseTimer) -> Batch:
        critic = self.run.roles.critic
        if critic is None:
            return samples
        with timer.phase("values"):
            return samples.replace(values=critic.compute_values(samples))

    def _critic_on_device(self) -> contextlib.AbstractContextManager:
        """The critic's weights stay on the device from its values to its update (when there is a critic)."""
        critic = self.run.roles.critic
        return contextlib.nullcontext() if critic is None else self.run.offload.on_device(critic)

    def _critic_share(self, batch: Batch, actor_share: Batch) -> Batch:
        """The critic's update rows: the actor's, unless its Ulysses groups differ in size from the
        actor's."""
        critic, actor = self.run.roles.critic, self.run.roles.actor
        if critic is None or critic.update.sp_size == actor.update.sp_size:
            return actor_share
        return shard_for_update(batch, balance=self.cfg.trainer.balance_batch, sp_size=critic.update.sp_size)

    def _update_critic(self, share: Batch, timer: PhaseTimer) -> tuple[dict[str, float], str | None]:
        """The critic's update; (metrics, what was non-finite if it skipped an optimizer step)."""
        critic = self.run.roles.critic
        if critic is None:
            return {}, None
        skipped_before = critic.num_skipped_updates
        with timer.phase("update_critic"), self.run.offload.on_device(critic, optimizer=True):
            metrics = critic.update_critic(share)
        if critic.num_skipped_updates > skipped_before:
            return (
                metrics,
                "a non-finite critic loss or gradient norm (critic step skipped, actor not updated)",
            )
        return metrics, None

    def _update_rows(self, batch: Batch) -> tuple[Batch, int | None]:
        """The global batch's rows for the actor update, and how many mini-batches to cut them into: all
        rows (None: mini-batches of ``ppo_mini_batch_size``), or with ``actor.skip_zero_advantage_rows``
        those with a nonzero advantage, padded to equal data-parallel shares of equal mini-batches
        (:func:`rows_with_advantage`), in as many mini-batches as the full batch makes (the same number of
        optimizer steps per step, each over fewer rows)."""
        actor = self.run.roles.actor
        if not self.cfg.actor_rollout_ref.actor.skip_zero_advantage_rows:
            return batch, None
        num_shares = world_size() // actor.update.sp_size
        num_mini = -(-(len(batch) // num_shares) // actor.update.mini_batch_size)
        rows = rows_with_advantage(batch.advantages, batch.response_mask, num_shares=num_shares * num_mini)
        return (batch, None) if len(rows) == len(batch) else (batch.select(rows), num_mini)

    def _update_actor(
        self,
        batch: Batch,
        share: Batch,
        step: int,
        timer: PhaseTimer,
        *,
        num_update_rows: int,
        num_mini_batches: int | None = None,
    ) -> tuple[dict[str, float], str | None]:
        """The KL loss's β from the global batch, then the policy update over ``share`` (this rank's part of
        the ``num_update_rows`` rows of the batch it updates on), after ``trainer.critic_warmup``; (metrics,
        what was non-finite if it skipped an optimizer step)."""
        run, roles = self.run, self.run.roles
        if not updates_actor(step, self.cfg.trainer.critic_warmup):
            return {}, None
        skipped_before = roles.actor.num_skipped_updates
        metrics = measure_kl_for_control(batch, self.cfg.actor_rollout_ref.actor)
        ref_logits_fn = roles.reference.logits if roles.reference is not None else None
        with timer.phase("update_actor"), run.offload.on_device(roles.actor, optimizer=True):
            metrics.update(
                roles.actor.update_policy(
                    share,
                    kl_loss_coef=run.kl_loss_ctrl.value,
                    ref_logits_fn=ref_logits_fn,
                    num_mini_batches=num_mini_batches,
                )
            )
        # per-rank figures from the actor (on-policy skip) are reduced over ranks before the controller sees
        # them; every rank computes the same β from the same reduced value
        if "actor/kl_loss_ctrl_kl" in metrics and batch.old_log_probs is None:
            metrics["actor/kl_loss_ctrl_kl"] = reduce_metrics({"k": metrics["actor/kl_loss_ctrl_kl"]})["k"]
        if self.cfg.actor_rollout_ref.actor.skip_zero_advantage_rows:
            metrics.update(
                update_rows_metrics(
                    metrics,
                    batch,
                    self.cfg.actor_rollout_ref.actor,
                    num_update_rows,
                    bypass=roles.actor.bypass_mode,
                )
            )
        if roles.actor.num_skipped_updates > skipped_before:  # the KL-loss controller is not moved either
            return metrics, "a non-finite actor loss or gradient norm (actor step skipped)"
        control_kl_loss(metrics, run.kl_loss_ctrl, len(batch))
        return metrics, None

    @property
    def _data_paths(self) -> list[str] | None:
        source = getattr(self.run.loaders.train, "source", None)
        return list(source.paths) if source is not None else None

    # ------------------------------------------------------------------ metrics
    def _step_metrics(
        self,
        batch: Batch,
        timer: PhaseTimer,
        per_rank: dict[str, float],
        *,
        update_batch: Batch | None = None,
    ) -> dict[str, float]:
        """The ``per_rank`` metrics averaged over ranks, then those of the global batch, timings and perf
        (the actor's MFU over ``update_batch``, the rows its update ran on)."""
        run = self.run
        metrics = reduce_metrics(per_rank)
        metrics.update(batch_metrics(batch))
        metrics.update(timer.metrics())
        metrics.update(
            perf_metrics(
                batch,
                timer.metrics(),
                device=run.device,
                model_config=run.roles.actor.model.config,
                ppo_epochs=self.cfg.actor_rollout_ref.actor.ppo_epochs,
                update_batch=update_batch,
            )
        )
        return metrics

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Generate with ``val_kwargs`` on the validation set (a multi-turn run's conversations, with its
        tools and interaction); mean score per data source. Samples go to ``trainer.log_val_generations``
        (the first N) and ``trainer.validation_data_dir`` (all, with their ``TURN_FIELDS``)."""
        run, tcfg = self.run, self.cfg.trainer
        records: list[dict[str, Any]] = []
        n = run.sampling.val.n
        with run.offload.on_device(run.roles.actor):
            for prompts in run.loaders.val:
                records += self._validation_records(prompts.to(run.device))
        out = validation_metrics(records, n)
        if rank() == 0:
            step = self.state.global_step
            if tcfg.log_val_generations > 0:
                keys = ("prompt", "response", "score")
                run.trackers.generations.write(
                    step, [{k: r[k] for k in keys} for r in records[: tcfg.log_val_generations]]
                )
            if tcfg.validation_data_dir:
                dump_samples(
                    tcfg.validation_data_dir,
                    step,
                    inputs=[chat_text(r["prompt"]) for r in records],
                    outputs=[r["response"] for r in records],
                    scores=[r["score"] for r in records],
                    ground_truths=[r["ground_truth"] for r in records],
                    data_sources=[r["data_source"] for r in records],
                    extras=[{k: r[k] for k in TURN_FIELDS if k in r} for r in records],
                )
        return out

    def _validation_records(self, prompts: Batch) -> list[dict[str, Any]]:
        """Every rank's validation samples of ``prompts``, scored (the same list on every rank)."""
        run = self.run
        # every rank generates the same number of rows (collectives inside), padding rows are dropped
        share, num_real = padded_share(prompts)
        seed = sample_seed(self.cfg.trainer.seed, 0)
        local = generate(run, share, run.sampling.val, seed=seed).samples.select(
            range(num_real * run.sampling.val.n)
        )
        scores = run.roles.reward.score(local)
        mine = [
            {
                "prompt": raw,
                "response": text,
                "score": score,
                "data_source": src,
                "ground_truth": truth,
                "uid": uid,
                **{k: info[k] for k in TURN_FIELDS if k in (info or {})},
            }
            for raw, text, score, src, truth, uid, info in zip(
                local.raw_prompt,
                scores.texts,
                scores.sequence.tolist(),
                local.data_source,
                local.ground_truth,
                local.uid,
                local.extra_info or [None] * len(local.uid),
            )
        ]
        return [r for part in all_gather_objects(mine) for r in part]

    # ------------------------------------------------------------------ checkpoints
    def _trainer_state(self) -> dict[str, Any]:
        """What ``trainer_state.pt`` holds (also in the best-validation checkpoint)."""
        run, roles = self.run, self.run.roles.trained()
        return {
            "global_step": self.state.global_step,
            "num_nan_steps": self.state.num_nan_steps,
            "dataloader": run.loaders.train.state_dict(),
            "kl_ctrl": run.kl_ctrl.state_dict(),
            "kl_loss_ctrl": run.kl_loss_ctrl.state_dict(),
            "penalty_share_streak": self.state.penalty_share.streak,
            "roles": {name: role.extra_state() for name, role in roles.items()},
            "monitor": self.monitor.state_dict(),
            "identity": run.identity,  # what a resume is checked against (klppo.ops.resume_check)
        }

    def save(self) -> None:
        run, roles = self.run, self.run.roles.trained()
        trainer_state = self._trainer_state()
        path = save_checkpoint(
            run.run_dir,
            self.state.global_step,
            models=_models(roles),
            hf_assets=run.hf_assets,
            trainer_state=trainer_state,
            max_to_keep=self.cfg.trainer.max_actor_ckpt_to_keep,
            frozen_bases=run.frozen_bases,
        )
        if rank() == 0:
            log.info("checkpoint saved: %s", path)

    def _maybe_resume(self) -> None:
        run, roles = self.run, self.run.roles.trained()
        if run.resume_path is None:
            return
        state = load_checkpoint(run.resume_path, models=_models(roles))
        self.state.global_step = int(state["global_step"])
        self.state.num_nan_steps = int(state["num_nan_steps"])
        run.loaders.train.load_state_dict(state["dataloader"])
        run.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if "kl_loss_ctrl" in state:  # checkpoints before the KL-loss controller have none (β was fixed)
            run.kl_loss_ctrl.load_state_dict(state["kl_loss_ctrl"])
            self.state.penalty_share.streak = int(state["penalty_share_streak"])
        for name, role in roles.items():
            role.load_extra_state(state["roles"][name])
        if "monitor" in state:
            self.monitor.load_state_dict(
                state["monitor"], best_step_on_disk=best_checkpoint_step(run.run_dir)
            )
        if rank() == 0:
            log.info("resumed from %s at step %d", run.resume_path, self.state.global_step)


def _models(roles: dict[str, TrainedRole]) -> dict[str, tuple]:
    """(model, optimizer) of each trained role, for the checkpoint."""
    return {name: (role.state_model, role.optimizer) for name, role in roles.items()}
