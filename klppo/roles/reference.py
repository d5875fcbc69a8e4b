"""The reference policy: a frozen copy of the initial actor, for ref log-probs (KL in reward or KL loss)."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from klppo.batch import Batch
from klppo.models.lora import adapters_disabled
from klppo.parallel.fsdp import fsdp_modules
from klppo.parallel.mesh import SequenceParallel
from klppo.roles.forward import (
    ForwardPlan,
    MicroBatching,
    check_fused,
    log_prob_pass,
    no_grad_pass,
    policy_forward,
)
from klppo.roles.graphed import MicroGraphs, cleared_on_retry
from klppo.roles.oom import OOMRecovery


class Reference:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        micro: MicroBatching,
        temperature: float = 1.0,
        use_remove_padding: bool = False,
        adapters_off: bool = False,
        use_fused_kernels: bool = False,
        sp: SequenceParallel | None = None,
        cuda_graph: bool = False,
    ) -> None:
        """``adapters_off``: ``model`` is the LoRA actor itself, run with its adapters disabled (shared,
        so it is neither frozen nor switched to eval mode here). ``use_fused_kernels``: log-probs from the
        LM head in chunks (:func:`klppo.roles.forward.policy_forward`). ``cuda_graph``
        (``actor_rollout_ref.ref.fsdp_config.cuda_graph_update``): the log-prob micro-batches replayed as CUDA
        graphs (:mod:`klppo.roles.graphed`; packed rows, no sequence parallelism, a model of its own without
        FSDP2 — the trainer checks the GPU, the plain path and param_offload)."""
        self.model = model
        self.adapters_off = adapters_off
        if not adapters_off:
            self.model.eval()
            for p in self.model.parameters():
                p.requires_grad_(False)
        self.micro = micro
        # out-of-memory retries with smaller micro-batches
        self.oom = OOMRecovery("ref", sp_size=1 if sp is None else sp.size)
        self.temperature = temperature
        self.use_remove_padding = use_remove_padding
        self.use_fused_kernels = use_fused_kernels
        self.sp = sp  # Ulysses group: log-probs of the group's rows, split along the tokens (no shared plan)
        if use_fused_kernels:
            check_fused(model, "actor_rollout_ref.model.use_fused_kernels")
        need = _graph_needs(
            use_remove_padding=use_remove_padding, sp=sp, adapters_off=adapters_off, model=model
        )
        if cuda_graph and need:
            raise ValueError(f"{GRAPH_KEY}=true needs {need}: set it to false")
        # the log-prob micro-batches as CUDA graphs, in a memory pool of the reference's own
        self.graphs = MicroGraphs((), key_name=GRAPH_KEY, what="a no-grad forward") if cuda_graph else None

    def _context(self):
        return adapters_disabled(self.model) if self.adapters_off else nullcontext()

    def compute_ref_log_prob(self, batch: Batch, *, plan: ForwardPlan | None = None) -> torch.Tensor:
        """Reference log-probs [B,R] (no gradient), over ``plan`` (e.g. the actor's old-log-prob plan) when
        it has this role's micro-batching and padding removal."""

        def attempt(micro: MicroBatching) -> torch.Tensor:
            if self.sp is not None:
                with self._context():
                    self.model.eval()
                    return no_grad_pass(batch, micro, self._sp_log_probs, sp=self.sp)
            use = ForwardPlan.reused_or_built(plan, batch, micro, use_remove_padding=self.use_remove_padding)
            with self._context():
                self.model.eval()
                return log_prob_pass(
                    self.model,
                    use,
                    temperature=self.temperature,
                    fused=self.use_fused_kernels,
                    graphs=self.graphs,
                )

        # out of memory: the graphs of the larger micro-batches go (their shapes recur no more)
        return self.oom.run("log_prob", self.micro, cleared_on_retry(attempt, self.graphs), self.model)

    def _sp_log_probs(self, mb: Batch) -> torch.Tensor:
        return policy_forward(
            self.model,
            mb,
            temperature=self.temperature,
            calculate_entropy=False,
            fused=self.use_fused_kernels,
            sp=self.sp,
        )[0]

    def logits(self, batch: Batch) -> torch.Tensor:
        """Temperature-scaled response logits [B,R,V] (for ``kl_loss_type='full'``)."""
        with torch.no_grad():
            return policy_forward(
                self.model, batch, temperature=self.temperature, calculate_entropy=False, return_logits=True
            )[2]


GRAPH_KEY = "actor_rollout_ref.ref.fsdp_config.cuda_graph_update"


def _graph_needs(
    *, use_remove_padding: bool, sp: SequenceParallel | None, adapters_off: bool, model: torch.nn.Module
) -> str | None:
    """What the reference's CUDA graphs need that these settings lack (None: nothing)."""
    if not use_remove_padding:
        return "packed rows (actor_rollout_ref.model.use_remove_padding=true)"
    if sp is not None:
        return "no sequence parallelism (actor_rollout_ref.ref.ulysses_sequence_parallel_size=1)"
    if adapters_off:
        return "a reference model of its own (with LoRA the reference is the actor with its adapters off)"
    if fsdp_modules(model):
        return "the plain path (actor_rollout_ref.ref.fsdp_config.plain_single_gpu: one process, no FSDP2)"
    return None
