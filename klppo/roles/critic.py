"""The critic: a value head on a causal-LM backbone; value estimation and the clipped value update."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from klppo.algorithms import losses
from klppo.batch import Batch
from klppo.batching.packing import ValueInputs, prepare_values, values_of
from klppo.parallel.mesh import SequenceParallel
from klppo.parallel.plain import MasterWeights
from klppo.roles.forward import (
    MicroBatching,
    graphed_forward,
    no_grad_pass,
    split_inputs,
    trim_left_padding,
    value_forward,
)
from klppo.roles.graphed import MicroParts, cleared_on_retry
from klppo.roles.optim import OptimSettings
from klppo.roles.trained import LossTerms, TrainedRole, UpdateSettings


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
    sp: SequenceParallel | None = None  # Ulysses group (needs use_remove_padding); None: no sequence split
    grad_sync_per_mini_batch: bool = False  # one reduce-scatter per mini-batch (roles/trained.py)
    cuda_graph_update: bool = False  # micro-batches replayed as CUDA graphs (roles/graphed.py; plain path)


class Critic(TrainedRole):
    """Value role: ``compute_values(batch)`` and ``update_critic(batch) -> metrics``."""

    name = "critic"
    graph_key = "critic.model.fsdp_config"

    def __init__(
        self,
        model: torch.nn.Module,
        settings: CriticSettings,
        optim: OptimSettings,
        *,
        masters: MasterWeights | None = None,
    ) -> None:
        super().__init__(
            model,
            UpdateSettings.of(settings, seed_offset=1),
            optim,
            masters=masters,
        )
        self.settings = settings
        if self.graphs is not None and not self.graph_capable():
            raise ValueError(
                "critic.model.fsdp_config.cuda_graph_update=true needs packed rows "
                "(critic.model.use_remove_padding=true) and no sequence parallelism: set it to false"
            )

    def graph_capable(self) -> bool:
        """Packed rows and no sequence parallelism: what :meth:`graph_parts` serves."""
        return self.settings.use_remove_padding and self.settings.sp is None

    def compute_values(self, batch: Batch) -> torch.Tensor:
        """Values [B,R] (zero on masked positions)."""
        self.model.eval()
        rmpad, sp = self.settings.use_remove_padding, self.settings.sp

        def forward(mb: Batch) -> torch.Tensor:
            # packed rows, no sequence parallelism when there are graphs (the constructor's check)
            if self.forward_graphs is not None:
                return graphed_forward(
                    self.forward_graphs, self._value_inputs(mb), self._values, extra="values"
                )
            return value_forward(self.model, mb, use_remove_padding=rmpad, sp=sp)

        # out of memory: the role's graphs go with the larger micro-batches (one pool with the update's)
        attempt = cleared_on_retry(
            lambda micro: no_grad_pass(batch, micro, forward, sp=sp), self.graphs, self.forward_graphs
        )
        return self.oom.run("values", self.settings.forward_micro, attempt, self.model)

    def _value_inputs(self, mb: Batch) -> ValueInputs:
        """A micro-batch's packed value inputs, planned on the host (its ``host_mask``)."""
        mb = trim_left_padding(mb)
        return prepare_values(
            mb.input_ids,
            mb.attention_mask,
            mb.position_ids,
            response_length=mb.response_length,
            host_mask=mb.host_mask,
        )

    def _values(self, inputs: ValueInputs) -> torch.Tensor:
        return values_of(self.model, inputs)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Clipped value regression; needs ``values`` (old), ``returns``, ``response_mask``: the loss counts
        the tokens of ``response_mask`` only — not a multi-turn rollout's appended tokens, nor the tokens
        rollout rejection sampling left out (the critic reads them as input but fits no value there, as
        verl's critic)."""
        graph_parts = None if self.graphs is None else self.graph_parts
        return self.run_updates(batch, self._micro_loss, graph_parts=graph_parts)

    def _micro_loss(self, mb: Batch) -> tuple[LossTerms, dict[str, float | torch.Tensor]]:
        s = self.settings
        vpreds = value_forward(self.model, mb, use_remove_padding=s.use_remove_padding, sp=s.sp)
        return self._loss_terms(mb.returns, mb.values, mb.response_mask, vpreds)

    def term_modes(self) -> list[str]:
        """The aggregation mode of the one loss term."""
        return [self.settings.loss_agg_mode]

    def graph_parts(self, mb: Batch) -> MicroParts:
        """:meth:`_micro_loss` split for capture (:mod:`klppo.roles.graphed`): the packing planned here, the
        forward and the value loss a function of device tensors. Packed rows only, no sequence parallelism."""
        model_tensors, key, rebuild = split_inputs(self._value_inputs(mb))
        n = len(model_tensors)

        def loss(ts):
            returns, values, mask = ts[n:]
            return self._loss_terms(returns, values, mask, values_of(self.model, rebuild(ts[:n])))

        tensors = [*model_tensors, mb.returns, mb.values, mb.response_mask]
        return MicroParts(tensors, key, self.term_modes(), loss)

    def _loss_terms(
        self, returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, vpreds: torch.Tensor
    ) -> tuple[LossTerms, dict[str, float | torch.Tensor]]:
        s = self.settings
        loss, stats = losses.value_loss(
            vpreds=vpreds,
            returns=returns,
            values=values,
            response_mask=mask,
            cliprange_value=s.cliprange_value,
            loss_agg_mode=s.loss_agg_mode,
        )
        micro_stats = {"critic/vf_loss": loss.detach()}  # on the device: one transfer per update
        micro_stats.update({f"critic/{k}": v for k, v in stats.items()})
        return [(loss, s.loss_agg_mode)], micro_stats
