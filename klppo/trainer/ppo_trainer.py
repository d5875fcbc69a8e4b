"""The KL-PPO loop. One instance per rank (SPMD); reads top to bottom like the algorithm:

    prompts → rollout → old/ref log-probs, values → scores → KL penalty in reward → advantages
    → critic update → actor update → KL controller update → metrics → checkpoint → validation

Each rank rolls out and scores its contiguous share of the step's prompts (all samples of one prompt stay
on one rank); the per-sample fields are then all-gathered so that rewards, KL penalty and advantages are
computed on the global batch, identically on every rank (batch-level whitening and group statistics need
it); each rank then updates on its share, and FSDP averages the gradients.
"""

from __future__ import annotations

import logging
import math
import signal
import time
from dataclasses import dataclass
from typing import Any

import torch

from klppo.algorithms import advantages as adv
from klppo.algorithms import kl as kl_mod
from klppo.algorithms.kl_control import PenaltyShareWatch
from klppo.algorithms.losses import masked_mean
from klppo.batch import Batch
from klppo.roles.dp import all_gather_objects, all_gather_rows, all_reduce_sum, padded_share, rank, world_size
from klppo.trainer.dumps import chat_text, dump_rollouts, dump_samples
from klppo.trainer.setup import RunParts
from klppo.trainer.step_metrics import batch_metrics, perf_metrics, validation_metrics
from klppo.trainer.timer import PhaseTimer

log = logging.getLogger("klppo")

# per-sample tensor fields computed per rank and gathered into the global batch
_GATHERED = (
    "responses",
    "response_mask",
    "rollout_log_probs",
    "old_log_probs",
    "ref_log_probs",
    "values",
    "token_level_scores",
)


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (too many non-finite steps); the message says why and what to do."""


@dataclass
class TrainerState:
    global_step: int = 0
    num_nan_steps: int = 0


class PPOTrainer:
    def __init__(self, parts: RunParts) -> None:
        self.p = parts
        self.cfg = parts.cfg
        self.state = TrainerState()
        self._stop_requested = False
        self._share_watch = PenaltyShareWatch(threshold=1.0, patience=5)

    # ------------------------------------------------------------------ the loop
    def fit(self) -> TrainerState:
        previous = self._install_signal_handlers()
        try:
            return self._fit()
        finally:
            self.p.tracker.close()  # flushed also when a step fails (TensorBoard, W&B, …)
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _fit(self) -> TrainerState:
        p, cfg = self.p, self.cfg
        self._maybe_resume()
        total = p.total_training_steps
        if self.state.global_step >= total and rank() == 0:
            log.warning(
                "the run in %s already reached step %d of trainer.total_training_steps=%d (resumed from %s): "
                "nothing to train. Raise total_training_steps/total_epochs to continue, or start over with "
                "trainer.resume_mode=disable or another trainer.default_local_dir.",
                p.run_dir, self.state.global_step, total, p.resume_path,
            )  # fmt: skip
        p.tracker.set_total_steps(total)
        if self.state.global_step == 0 and cfg.trainer.val_before_train and p.val_loader is not None:
            p.tracker.log(self.validate(), step=0)
            if cfg.trainer.val_only:
                return self.state
        while self.state.global_step < total:
            prompts = p.train_loader.next_batch().to(p.device)
            self.state.global_step += 1
            step = self.state.global_step
            metrics = self.train_step(prompts, step)
            p.tracker.log(metrics, step=step)
            last = step >= total or self._stop_requested
            if cfg.trainer.save_freq > 0 and (step % cfg.trainer.save_freq == 0 or last):
                self.save()
            elif self._stop_requested:
                self.save()
            if (
                p.val_loader is not None
                and cfg.trainer.test_freq > 0
                and (step % cfg.trainer.test_freq == 0 or last)
            ):
                p.tracker.log(self.validate(), step=step)
            if self._stop_requested:
                log.warning(
                    "stopping after step %d on a signal; checkpoint saved, resume with the same command", step
                )
                break
        return self.state

    def train_step(self, prompts: Batch, step: int) -> dict[str, float]:
        p, cfg = self.p, self.cfg
        timer = PhaseTimer(p.device)
        metrics: dict[str, float] = {}
        with timer.phase("step"):
            with timer.phase("gen"):
                local = self.generate(self._rank_share(prompts), p.sampling, seed=self._seed(step))
            if p.needs_greedy_baseline:
                with timer.phase("gen_max"):
                    greedy = self.generate(self._rank_share(prompts), p.greedy_sampling, seed=0)
                    _, baseline, _ = p.reward.score(greedy)
            with timer.phase("old_log_prob"):
                local.old_log_probs = p.actor.compute_log_prob(local)
            if local.rollout_log_probs is not None:
                diff = (local.old_log_probs - local.rollout_log_probs).abs()
                metrics["rollout/log_prob_diff"] = float(masked_mean(diff, local.response_mask))
            if p.reference is not None:
                with timer.phase("ref"):
                    p.offload.load("ref")
                    local.ref_log_probs = p.reference.compute_ref_log_prob(local)
                    p.offload.release("ref")
            if p.critic is not None:
                with timer.phase("values"):
                    p.offload.load("critic")
                    local.values = p.critic.compute_values(local)
            with timer.phase("reward"):
                local.token_level_scores, _, _ = p.reward.score(local)
            batch = self._gather(prompts, local)
            with timer.phase("adv"):
                if p.needs_greedy_baseline:
                    self._baseline = all_gather_rows(baseline.to(p.device)).repeat_interleave(p.sampling.n)
                metrics.update(self.compute_rewards_and_advantages(batch))
            share = self._update_share(batch)
            if p.critic is not None:
                with timer.phase("update_critic"):
                    p.offload.load("critic_optim")
                    metrics.update(p.critic.update_critic(share))
                    p.offload.release("critic_optim")
            p.offload.release("critic")
            if step > cfg.trainer.critic_warmup:
                metrics.update(self.control_kl_loss(batch))
                with timer.phase("update_actor"):
                    p.offload.load("actor_optim")
                    metrics.update(
                        p.actor.update_policy(
                            share, kl_loss_coef=p.kl_loss_ctrl.value, ref_logits_fn=p.ref_logits_fn
                        )
                    )
                    p.offload.release("actor_optim")
            p.offload.release("actor")  # param_offload: shards live on the host until the next rollout
        if cfg.trainer.rollout_data_dir and rank() == 0:
            dump_rollouts(cfg.trainer.rollout_data_dir, step, batch, p.tokenizer, p.reward)
        metrics.update(self._rollout_stats)
        metrics = self._reduce_rank_metrics(metrics)
        metrics.update(batch_metrics(batch))
        metrics.update(timer.metrics())
        metrics.update(
            perf_metrics(
                batch,
                timer.metrics(),
                device=p.device,
                model_config=p.actor.model.config,
                ppo_epochs=int(cfg.actor_rollout_ref.actor.ppo_epochs),
            )
        )
        self._check_finite(metrics, step)
        return metrics

    # ------------------------------------------------------------------ phases
    def generate(self, prompts: Batch, sampling, *, seed: int) -> Batch:
        """Samples for ``prompts`` (n per prompt, consecutive) on the actor's gathered weights."""
        from dataclasses import replace

        p = self.p
        p.offload.load("actor")
        params = replace(sampling, seed=seed)
        start = time.perf_counter()
        with p.gather_weights() as model:
            if p.device.type == "cuda":
                torch.cuda.synchronize(p.device)
            gather_s = time.perf_counter() - start
            out = p.rollout.generate(model, prompts.prompts, prompts.prompt_mask, params)
        self._rollout_stats = {
            "timing_s/update_weights": gather_s,
            **(getattr(p.rollout, "last_stats", None) or {}),
        }
        if p.free_cache_engine:
            p.rollout.release()
        samples = prompts.repeat_interleave(params.n)
        samples.responses = out.responses
        samples.response_mask = out.response_mask.to(torch.float32)
        samples.rollout_log_probs = out.log_probs
        return samples

    def compute_rewards_and_advantages(self, batch: Batch) -> dict[str, float]:
        """KL penalty into the reward (optional), then the configured advantage estimator, in place."""
        p, algo = self.p, self.cfg.algorithm
        metrics: dict[str, float] = {}
        if algo.use_kl_in_reward:
            batch.token_level_rewards, kl_stats = kl_mod.apply_kl_penalty(
                token_level_scores=batch.token_level_scores,
                log_prob=batch.old_log_probs,
                ref_log_prob=batch.ref_log_probs,
                response_mask=batch.response_mask,
                kl_ctrl=p.kl_ctrl,
                kind=algo.kl_penalty,
            )
            current_kl = float(kl_stats["kl"])
            metrics["actor/reward_kl_penalty"] = current_kl
            metrics["actor/reward_kl_penalty_coeff"] = float(kl_stats["kl_coef"])
            metrics["actor/reward_kl_penalty_share"] = self._penalty_share(batch)
            p.kl_ctrl.update(current_kl, len(batch))
        else:
            batch.token_level_rewards = batch.token_level_scores
        batch.advantages, batch.returns = self._advantages(batch)
        return metrics

    def _penalty_share(self, batch: Batch) -> float:
        """mean_i |β·Σ_t KL_i,t| ÷ mean_i |Σ_t score_i,t|: how large the KL penalty is next to the task score
        (magnitudes: a k1 penalty can be negative, and a large bonus drowns the score as well). Warns when it
        stays above 1 for 5 steps in a row (and every 5 steps while it lasts)."""
        penalty = (batch.token_level_scores - batch.token_level_rewards).sum(dim=-1).abs().mean()
        score = batch.token_level_scores.sum(dim=-1).abs().mean()
        share = float(penalty) / max(float(score), 1e-6)
        if self._share_watch.update(share) and rank() == 0:
            algo = self.cfg.algorithm
            log.warning(
                "step %d: the KL penalty in the reward outweighs the task score for %d steps (share %.2f, "
                "β=%.4g): the policy is pulled back toward the reference instead of learning. Lower "
                "algorithm.kl_ctrl.kl_coef, raise target_kl (now %s, type %s) or move the KL into the loss "
                "(actor_rollout_ref.actor.use_kl_loss with kl_loss_ctrl)",
                self.state.global_step, self._share_watch.streak, share, self.p.kl_ctrl.value,
                algo.kl_ctrl.target_kl, algo.kl_ctrl.type,
            )  # fmt: skip
        return share

    def control_kl_loss(self, batch: Batch) -> dict[str, float]:
        """β of this step's KL loss: the controller sees the batch's KL(π_old‖π_ref) (token mean of the
        ``kl_loss_type`` estimator; k3 for ``full``) before the update it weights."""
        actor = self.cfg.actor_rollout_ref.actor
        if not actor.use_kl_loss or batch.ref_log_probs is None:
            return {}
        kind = "low_var_kl" if actor.kl_loss_type.startswith("full") else actor.kl_loss_type
        kl = float(
            masked_mean(
                kl_mod.kl_penalty(batch.old_log_probs, batch.ref_log_probs, kind), batch.response_mask
            )
        )
        self.p.kl_loss_ctrl.update(kl, len(batch))
        return {"actor/kl_loss_ctrl_kl": kl}

    def _advantages(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        algo = self.cfg.algorithm
        return adv.compute_advantages(
            algo.adv_estimator,
            token_level_rewards=batch.token_level_rewards,
            response_mask=batch.response_mask,
            values=batch.values,
            group_ids=batch.uid,
            reward_baselines=self._baseline,
            gamma=float(algo.gamma),
            lam=float(algo.lam),
            norm_by_std=bool(algo.norm_adv_by_std_in_grpo),
        )

    # ------------------------------------------------------------------ data-parallel plumbing
    def _rank_share(self, prompts: Batch) -> Batch:
        """This rank's contiguous share of the step's prompts (sizes are checked divisible at start)."""
        w = world_size()
        if w == 1:
            return prompts
        return prompts.chunk(w)[rank()]

    def _gather(self, prompts: Batch, local: Batch) -> Batch:
        """Global batch: the step's prompts × n with every rank's per-sample fields, in rank order."""
        batch = prompts.repeat_interleave(self.p.sampling.n)
        for name in _GATHERED:
            value = getattr(local, name)
            if value is not None:
                setattr(batch, name, all_gather_rows(value))
        return batch

    def _update_share(self, batch: Batch) -> Batch:
        """This rank's samples for the updates; with ``trainer.balance_batch`` ranks get equal token counts."""
        w = world_size()
        if w == 1:
            return batch
        if self.cfg.trainer.balance_batch:
            from klppo.batching.balance import balance_across_ranks

            lengths = batch.attention_mask.sum(dim=1).long().tolist()
            return batch.select(balance_across_ranks(lengths, w)[rank()])
        return batch.chunk(w)[rank()]

    def _reduce_rank_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Mean over ranks of the per-rank metrics (one collective for all keys)."""
        if world_size() == 1:
            return metrics
        keys = sorted(metrics)
        values = all_reduce_sum(torch.tensor([metrics[k] for k in keys], dtype=torch.float64)) / world_size()
        return dict(zip(keys, values.tolist()))

    def _seed(self, step: int) -> int:
        return int(self.cfg.trainer.seed) * 1_000_003 + step * 1009 + rank()

    # ------------------------------------------------------------------ metrics
    def _check_finite(self, metrics: dict[str, float], step: int) -> None:
        """Count steps whose update was skipped for a non-finite loss/grad; stop past the limit."""
        skipped = metrics.get("actor/num_skipped_updates", 0.0) + metrics.get(
            "critic/num_skipped_updates", 0.0
        )
        bad = skipped > self._skipped_so_far or any(
            not math.isfinite(metrics.get(k, 0.0)) for k in ("actor/pg_loss", "critic/vf_loss")
        )
        self._skipped_so_far = skipped
        if bad:
            self.state.num_nan_steps += 1
            metrics["training/nan_steps"] = float(self.state.num_nan_steps)
            log.warning(
                "step %d: non-finite loss or gradient, the update was skipped (%d so far)",
                step,
                self.state.num_nan_steps,
            )
            limit = int(self.cfg.trainer.max_nan_steps)
            if limit >= 0 and self.state.num_nan_steps > limit:
                raise TrainingStopped(
                    f"{self.state.num_nan_steps} steps had a non-finite loss or gradient (limit "
                    f"trainer.max_nan_steps={limit}); the weights were not updated by those steps and the last "
                    "checkpoint is intact. Lower the learning rate, check the reward function, or raise the limit."
                )

    _skipped_so_far = 0.0
    _baseline: torch.Tensor | None = None
    _rollout_stats: dict[str, float] = {}

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict[str, float]:
        """Generate with ``val_kwargs`` on the validation set; mean score per data source. Samples go to
        ``trainer.log_val_generations`` (the first N) and ``trainer.validation_data_dir`` (all)."""
        p, tcfg = self.p, self.cfg.trainer
        records: list[dict[str, Any]] = []
        n = p.val_sampling.n
        for prompts in p.val_loader:
            prompts = prompts.to(p.device)
            # every rank generates the same number of rows (collectives inside), padding rows are dropped
            share, num_real = padded_share(prompts)
            local = self.generate(share, p.val_sampling, seed=self._seed(0)).select(range(num_real * n))
            _, seq_scores, texts = p.reward.score(local)
            mine = [
                {"prompt": raw, "response": text, "score": score, "data_source": src, "ground_truth": truth,
                 "uid": uid}
                for raw, text, score, src, truth, uid in zip(
                    local.raw_prompt, texts, seq_scores.tolist(), local.data_source, local.ground_truth, local.uid
                )
            ]  # fmt: skip
            records += [r for part in all_gather_objects(mine) for r in part]
        p.offload.release("actor")
        out = validation_metrics(records, n)
        if rank() == 0:
            step = self.state.global_step
            if tcfg.log_val_generations > 0:
                keys = ("prompt", "response", "score")
                p.generation_log.write(
                    step, [{k: r[k] for k in keys} for r in records[: tcfg.log_val_generations]]
                )
            if tcfg.validation_data_dir:
                dump_samples(
                    tcfg.validation_data_dir, step,
                    inputs=[chat_text(r["prompt"]) for r in records], outputs=[r["response"] for r in records],
                    scores=[r["score"] for r in records], ground_truths=[r["ground_truth"] for r in records],
                    data_sources=[r["data_source"] for r in records],
                )  # fmt: skip
        return out

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        from klppo.trainer.checkpoint import save_checkpoint

        p = self.p
        trainer_state = {
            "global_step": self.state.global_step,
            "num_nan_steps": self.state.num_nan_steps,
            "skipped_so_far": self._skipped_so_far,
            "dataloader": p.train_loader.state_dict(),
            "kl_ctrl": p.kl_ctrl.state_dict(),
            "kl_loss_ctrl": p.kl_loss_ctrl.state_dict(),
            "penalty_share_streak": self._share_watch.streak,
            "roles": {name: role.extra_state() for name, role in p.trained_roles().items()},
        }
        path = save_checkpoint(
            p.run_dir,
            self.state.global_step,
            models={name: (role.model, role.optimizer) for name, role in p.trained_roles().items()},
            hf_assets=p.hf_assets,
            trainer_state=trainer_state,
            max_to_keep=self.cfg.trainer.max_actor_ckpt_to_keep,
        )
        if rank() == 0:
            log.info("checkpoint saved: %s", path)

    def _maybe_resume(self) -> None:
        from klppo.trainer.checkpoint import load_checkpoint

        p = self.p
        if p.resume_path is None:
            return
        state = load_checkpoint(
            p.resume_path,
            models={name: (role.model, role.optimizer) for name, role in p.trained_roles().items()},
        )
        self.state.global_step = int(state["global_step"])
        self.state.num_nan_steps = int(state["num_nan_steps"])
        self._skipped_so_far = float(state["skipped_so_far"])
        p.train_loader.load_state_dict(state["dataloader"])
        p.kl_ctrl.load_state_dict(state["kl_ctrl"])
        if "kl_loss_ctrl" in state:  # checkpoints before the KL-loss controller have none (β was fixed)
            p.kl_loss_ctrl.load_state_dict(state["kl_loss_ctrl"])
            self._share_watch.streak = int(state["penalty_share_streak"])
        for name, role in p.trained_roles().items():
            role.load_extra_state(state["roles"][name])
        if rank() == 0:
            log.info("resumed from %s at step %d", p.resume_path, self.state.global_step)

    def _install_signal_handlers(self) -> dict:
        """SIGTERM/SIGINT finish the current step, save a checkpoint and stop; returns the old handlers."""

        def request_stop(signum, _frame):
            if self._stop_requested:
                raise KeyboardInterrupt
            self._stop_requested = True
            log.warning(
                "received %s: finishing the current step, then saving a checkpoint and exiting "
                "(send again to abort now)",
                signal.Signals(signum).name,
            )

        previous = {}
        try:
            for signum in (signal.SIGTERM, signal.SIGINT):
                previous[signum] = signal.signal(signum, request_stop)
        except ValueError:  # not the main thread (e.g. inside a test runner thread)
            pass
        return previous
