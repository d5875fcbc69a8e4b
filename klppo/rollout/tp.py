"""Tensor-parallel rollout: a group of ``TP`` ranks generates on slices of the actor's weights, resharded
straight from the FSDP2 shards (:mod:`klppo.parallel.tp_weights`); data parallel across the groups. The KV
cache holds only the rank's KV heads; the LM head gives the logits of the rank's vocabulary ids, sampled by
:func:`klppo.rollout.sampling.vocab_parallel_sampler`.

:class:`TPRollout` wraps the engine: it gathers the group's prompts (each rank brings its own share, as at
``TP = 1``), reshards, generates the group's rows on every rank in lockstep (the same tokens everywhere), and
returns this rank's rows. Models the engine cannot run generate data-parallel on gathered weights
(a warning; the engine then falls back to ``hf`` itself). Left out: LoRA actors (the adapters would have
to be merged into the slices) and the ``hf`` backend: the trainer runs those data-parallel with a warning.
"""

from __future__ import annotations

import time
import warnings

import torch

from klppo.models.llama_weights import storage_bytes, unsupported_reason
from klppo.models.lora import base_model
from klppo.parallel.collectives import all_reduce_max
from klppo.parallel.dist import phase
from klppo.parallel.fsdp import gathered_params
from klppo.parallel.mesh import TensorParallel
from klppo.parallel.reshard import compute_dtype
from klppo.parallel.shares import group_rows
from klppo.parallel.tp_layout import KEY, TPLayout
from klppo.parallel.tp_weights import fused_destinations, reshard_for_rollout, tp_weights
from klppo.rollout.base import RolloutOutput, SamplingParams
from klppo.rollout.engine import KLPPORollout


class TPRollout:
    """The klppo engine run by a tensor-parallel group on resharded slices (module docstring); ``generate``
    takes the FSDP2-sharded actor as it is (``reads_shards``)."""

    reads_shards = True

    def __init__(self, engine: KLPPORollout, tp: TensorParallel) -> None:
        self.engine = engine
        self.tp = tp
        self._tensors: dict[str, torch.Tensor] | None = None  # kept when the engine keeps its cache
        self._fallback_said = False

    @torch.no_grad()
    def generate(
        self, model: torch.nn.Module, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> RolloutOutput:
        """The rollout contract (:mod:`klppo.rollout.base`); every rank of the world calls it together (the
        reshard is a collective of all ranks, so all take the same path: the longest prompt of all)."""
        max_len = all_reduce_max(int(prompt_mask.sum(dim=1).max())) + params.max_new_tokens
        reason = unsupported_reason(model, max_len)
        if reason is not None:
            if not self._fallback_said:  # once: a reason that names the step's length would repeat every step
                self._fallback_said = True
                warnings.warn(
                    f"{KEY}={self.tp.size}: the klppo engine cannot run this model ({reason}); such "
                    "rollouts run data-parallel on gathered weights (said once)",
                    stacklevel=2,
                )
            with gathered_params(model):
                return self.engine.generate(model, prompts, prompt_mask, params)
        device = prompts.device
        cuda = device.type == "cuda"
        with phase("rollout_group_prompts"):  # a rank stuck before here shows on its group's others
            group_prompts, group_mask = group_rows(
                prompts, prompt_mask, self.tp.group, pad_id=self.engine.settings.pad_token_id
            )
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        layout = TPLayout.of(base_model(model).config, self.tp.size)
        into = self._tensors
        if into is None:
            into = fused_destinations(model, layout, self.tp.rank, dtype=compute_dtype(model), device=device)
        with phase("rollout_reshard"):
            tensors = {**into, **reshard_for_rollout(model, self.tp, device=device, into=into)}
        w = tp_weights(model, tensors, layout, self.tp)
        if cuda:
            torch.cuda.synchronize(device)
        reshard_s = time.perf_counter() - start
        weight_bytes = storage_bytes(tensors.values())
        self._tensors = None if self.engine.settings.free_cache_engine else tensors
        out = self.engine.generate_from(w, group_prompts, group_mask, params, reset_peak=False)
        del w, tensors
        rows = slice(self.tp.rank * len(prompts) * params.n, (self.tp.rank + 1) * len(prompts) * params.n)
        mask = out.response_mask[rows]
        tokens = float(mask.sum())
        stats = {
            **out.stats,
            "rollout/reshard_s": reshard_s,
            "rollout/tp_weights_gb": weight_bytes / 2**30,
            "rollout/tokens_generated": tokens,  # this rank's rows, as at TP = 1
            "rollout/tokens_per_s": tokens / max(out.stats["rollout/time_s"] + reshard_s, 1e-9),
        }
        truncated = out.truncated_log_probs
        return RolloutOutput(
            responses=out.responses[rows].clone(),
            response_mask=mask.clone(),
            log_probs=out.log_probs[rows].clone(),
            stats=stats,
            truncated_log_probs=None if truncated is None else truncated[rows].clone(),
        )

    def release(self) -> None:
        """Free the KV cache, graphs and kept slices."""
        self.engine.release()
        self._tensors = None
