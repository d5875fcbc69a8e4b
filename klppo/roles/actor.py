"""The actor: the policy model, its optimizer, log-prob recomputation and the PPO policy update.

One rank's view: ``batch`` holds this rank's samples; gradients are averaged over data-parallel ranks by
FSDP, so each micro-batch loss is scaled such that the accumulated gradient equals the gradient of the
loss over the *global* mini-batch (token counts are all-reduced once per mini-batch).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from klppo.algorithms import kl as kl_mod
from klppo.algorithms import losses
from klppo.batch import Batch
from klppo.roles.dp import all_reduce_sum, world_size
from klppo.roles.forward import MicroBatching, iter_micro, no_grad_pass, policy_forward
from klppo.roles.metrics import MetricAccumulator
from klppo.roles.optim import OptimSettings, build_optimizer, build_scheduler


@dataclass(frozen=True)
class ActorSettings:
    """PPO update settings of the actor (verl's ``actor_rollout_ref.actor.*``), sizes per rank in samples."""

    ppo_epochs: int = 1
    mini_batch_size: int = 8
    update_micro: MicroBatching = MicroBatching(micro_batch_size=4)
    log_prob_micro: MicroBatching = MicroBatching(micro_batch_size=8)
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    temperature: float = 1.0
    shuffle: bool = False
    use_remove_padding: bool = False
    seed: int = 1


class Actor:
    """Policy role: ``compute_log_prob(batch)`` and ``update_policy(batch) -> metrics``."""

    def __init__(self, model: torch.nn.Module, settings: ActorSettings, optim: OptimSettings) -> None:
        self.model = model
        self.settings = settings
        self.optimizer = build_optimizer(model.parameters(), optim)
        self.scheduler = build_scheduler(self.optimizer, optim)
        self.num_skipped_updates = 0  # optimizer steps skipped for a non-finite loss or grad norm

    def compute_log_prob(self, batch: Batch, *, calculate_entropy: bool = False) -> torch.Tensor:
        """Log-probs [B,R] of the batch's responses under the current policy (no gradient)."""
        self.model.eval()
        s = self.settings
        return no_grad_pass(
            batch,
            s.log_prob_micro,
            lambda mb: policy_forward(
                self.model,
                mb,
                temperature=s.temperature,
                calculate_entropy=False,
                use_remove_padding=s.use_remove_padding,
            )[0],
        )

    def update_policy(
        self,
        batch: Batch,
        *,
        ref_logits_fn: Callable[[Batch], torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """``ppo_epochs`` passes over mini-batches; one optimizer step per mini-batch.

        Needs ``old_log_probs``, ``advantages``, ``response_mask`` (and ``ref_log_probs`` for the KL loss;
        ``ref_logits_fn`` giving reference logits [b,R,V] when ``kl_loss_type='full'``).
        """
        s = self.settings
        self.model.train()
        acc = MetricAccumulator()
        generator = torch.Generator().manual_seed(s.seed)
        for _ in range(s.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator) if s.shuffle else torch.arange(len(batch))
            for start in range(0, len(batch), s.mini_batch_size):
                mini = batch.select(order[start : start + s.mini_batch_size])
                self._update_mini_batch(mini, acc, ref_logits_fn)
        self.scheduler.step()
        metrics = acc.means()
        metrics["actor/lr"] = self.scheduler.get_last_lr()[0]
        metrics["actor/num_skipped_updates"] = float(self.num_skipped_updates)
        return metrics

    def _update_mini_batch(self, mini: Batch, acc: MetricAccumulator, ref_logits_fn) -> None:
        s = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        counts = global_counts(mini.response_mask)
        finite = True
        for _, mb in iter_micro(mini, s.update_micro):
            loss, stats = self._micro_loss(mb, ref_logits_fn)
            weight = micro_weight(s.loss_agg_mode, mb.response_mask, counts, mini.response_length)
            if not torch.isfinite(loss):
                finite = False
            (loss * weight).backward()
            acc.add(stats, weight=float(mb.response_mask.sum()))
        grad_norm = _clip_grad_norm(self.model, s.grad_clip)
        if finite and math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.num_skipped_updates += 1
        acc.add({"actor/grad_norm": grad_norm}, weight=1.0)

    def _micro_loss(self, mb: Batch, ref_logits_fn) -> tuple[torch.Tensor, dict[str, float]]:
        s = self.settings
        need_logits = s.use_kl_loss and s.kl_loss_type == "full"
        log_prob, entropy, logits = policy_forward(
            self.model,
            mb,
            temperature=s.temperature,
            calculate_entropy=s.entropy_coeff != 0,
            use_remove_padding=s.use_remove_padding,
            return_logits=need_logits,
        )
        mask = mb.response_mask
        pg_loss, pg_stats = losses.policy_loss(
            old_log_prob=mb.old_log_probs,
            log_prob=log_prob,
            advantages=mb.advantages,
            response_mask=mask,
            clip_ratio=s.clip_ratio,
            clip_ratio_low=s.clip_ratio_low,
            clip_ratio_high=s.clip_ratio_high,
            clip_ratio_c=s.clip_ratio_c,
            loss_agg_mode=s.loss_agg_mode,
        )
        loss = pg_loss
        stats = {"actor/pg_loss": pg_loss.detach()}
        stats.update({f"actor/{k}": v for k, v in pg_stats.items()})
        if entropy is not None:
            entropy_loss = losses.agg_loss(entropy, mask, s.loss_agg_mode)
            loss = loss - s.entropy_coeff * entropy_loss
            stats["actor/entropy"] = entropy_loss.detach()
        if s.use_kl_loss:
            if need_logits:
                with torch.no_grad():
                    ref_logits = ref_logits_fn(mb)
                kl_mat = kl_mod.kl_penalty_full(logits, ref_logits, mask)
            else:
                kl_mat = kl_mod.kl_penalty(log_prob, mb.ref_log_probs, s.kl_loss_type)
            kl_loss = losses.agg_loss(kl_mat, mask, s.loss_agg_mode)
            loss = loss + s.kl_loss_coef * kl_loss
            stats["actor/kl_loss"] = kl_loss.detach()
            stats["actor/kl_coef"] = s.kl_loss_coef
        return loss, {k: float(v) for k, v in stats.items()}

    # ---- checkpoint state ---------------------------------------------------------------------
    def extra_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "num_skipped_updates": self.num_skipped_updates}

    def load_extra_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.num_skipped_updates = int(state["num_skipped_updates"])


def global_counts(mini_mask: torch.Tensor) -> tuple[float, float, float]:
    """(tokens, rows with a token, rows) of the mini-batch summed over all ranks: one collective."""
    rows = torch.tensor(float(mini_mask.shape[0]), device=mini_mask.device)
    counts = torch.stack([mini_mask.sum(), (mini_mask.sum(dim=-1) > 0).sum(), rows]).double()
    tokens, seqs, num_rows = all_reduce_sum(counts).tolist()
    return tokens, seqs, num_rows


def micro_weight(
    mode: str, micro_mask: torch.Tensor, counts: tuple[float, float, float], horizon: int
) -> float:
    """Scale of a micro-batch's aggregated loss so that the sum over micro-batches and ranks (FSDP averages
    gradients over the ranks, hence × world size) equals the aggregated loss of the global mini-batch."""
    from klppo.batching.dynamic import micro_batch_loss_weight

    tokens, seqs, rows = counts
    return world_size() * micro_batch_loss_weight(mode, micro_mask, tokens, seqs, horizon=horizon, mini_num_rows=rows)


def _clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Global gradient norm (sharded grads included), clipped to ``max_norm``; inf/nan returned as is."""
    from klppo.parallel.fsdp import clip_grad_norm_

    return float(clip_grad_norm_(model, max_norm))
