"""The critic: a value head on a causal-LM backbone; value estimation and the clipped value update."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from klppo.algorithms import losses
from klppo.batch import Batch
from klppo.roles.actor import _clip_grad_norm, global_counts, micro_weight
from klppo.roles.forward import MicroBatching, iter_micro, no_grad_pass, value_forward
from klppo.roles.metrics import MetricAccumulator
from klppo.roles.optim import OptimSettings, build_optimizer, build_scheduler


@dataclass(frozen=True)
class CriticSettings:
    """verl's ``critic.*`` update settings; sizes per rank, in samples."""

    ppo_epochs: int = 1
    mini_batch_size: int = 8
    update_micro: MicroBatching = MicroBatching(micro_batch_size=4)
    forward_micro: MicroBatching = MicroBatching(micro_batch_size=8)
    grad_clip: float = 1.0
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    shuffle: bool = False
    use_remove_padding: bool = False
    seed: int = 1


class Critic:
    """Value role: ``compute_values(batch)`` and ``update_critic(batch) -> metrics``."""

    def __init__(self, model: torch.nn.Module, settings: CriticSettings, optim: OptimSettings) -> None:
        self.model = model
        self.settings = settings
        self.optimizer = build_optimizer(model.parameters(), optim)
        self.scheduler = build_scheduler(self.optimizer, optim)
        self.num_skipped_updates = 0

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values [B,R] (zero on masked positions)."""
        self.model.eval()
        rmpad = self.settings.use_remove_padding
        return no_grad_pass(
            batch, self.settings.forward_micro, lambda mb: value_forward(self.model, mb, use_remove_padding=rmpad)
        )

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Needs ``values`` (old), ``returns``, ``response_mask``."""
        s = self.settings
        self.model.train()
        acc = MetricAccumulator()
        generator = torch.Generator().manual_seed(s.seed + 1)
        for _ in range(s.ppo_epochs):
            order = torch.randperm(len(batch), generator=generator) if s.shuffle else torch.arange(len(batch))
            for start in range(0, len(batch), s.mini_batch_size):
                self._update_mini_batch(batch.select(order[start : start + s.mini_batch_size]), acc)
        self.scheduler.step()
        metrics = acc.means()
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def _update_mini_batch(self, mini: Batch, acc: MetricAccumulator) -> None:
        s = self.settings
        self.optimizer.zero_grad(set_to_none=True)
        counts = global_counts(mini.response_mask)
        finite = True
        for _, mb in iter_micro(mini, s.update_micro):
            vpreds = value_forward(self.model, mb, use_remove_padding=s.use_remove_padding)
            loss, stats = losses.value_loss(
                vpreds=vpreds,
                returns=mb.returns,
                values=mb.values,
                response_mask=mb.response_mask,
                cliprange_value=s.cliprange_value,
                loss_agg_mode=s.loss_agg_mode,
            )
            weight = micro_weight(s.loss_agg_mode, mb.response_mask, counts, mini.response_length)
            finite = finite and bool(torch.isfinite(loss))
            (loss * weight).backward()
            micro_stats = {"critic/vf_loss": float(loss.detach())}
            micro_stats.update({f"critic/{k}": float(v) for k, v in stats.items()})
            micro_stats["critic/vpred_mean"] = float(losses.masked_mean(vpreds.detach(), mb.response_mask))
            acc.add(micro_stats, weight=float(mb.response_mask.sum()))
        grad_norm = _clip_grad_norm(self.model, s.grad_clip)
        if finite and math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            self.optimizer.zero_grad(set_to_none=True)
            self.num_skipped_updates += 1
        acc.add({"critic/grad_norm": grad_norm})

    def extra_state(self) -> dict:
        return {"scheduler": self.scheduler.state_dict(), "num_skipped_updates": self.num_skipped_updates}

    def load_extra_state(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        self.num_skipped_updates = int(state["num_skipped_updates"])
