"""Predicted peaks of an actor that trains LoRA adapters: the memory model's phases (:mod:`klppo.tune.memory`)
without what only full-model training holds.

With LoRA (``actor_rollout_ref.model.lora_rank > 0``) the base weights are frozen, so a rank keeps no
gradients of them and no AdamW moments (the adapters' are a fraction of a percent of the model and are not
counted); the reference is the actor's own model with the adapters off (no reference shards); and the
rollout runs data-parallel on the gathered weights (``rollout.tensor_model_parallel_size`` is not used with
LoRA). Everything else — sharded parameters, gathered units, activations, logits — is the memory model's own
term. Not fitted to device peaks; it errs high by the adapters' state.
"""

from __future__ import annotations

import dataclasses

from klppo.tune.memory import PhasePeak, TuneWorkload, predict
from klppo.tune.units import ModelFacts

FULL_TRAINING_TERMS = frozenset(
    {
        "sharded grads",
        "optimizer (AdamW)",
        "unsharded grads (sync per mini-batch)",
        "compute-dtype grads",
    }
)
"""The memory model's terms that LoRA training does not hold (names of :class:`~klppo.tune.memory.Term`)."""


def lora_peaks_gib(workload: TuneWorkload, facts: ModelFacts) -> dict[str, float]:
    """Predicted peak GiB per rank of each phase (rollout, log_prob, update) when the actor trains LoRA
    adapters: :func:`~klppo.tune.memory.predict` at the configured update point with no reference shards and
    a data-parallel rollout, less :data:`FULL_TRAINING_TERMS`; the update's optimizer-step floor (the full
    model's state plus one fp32 temporary) does not apply."""
    lora = dataclasses.replace(workload, workload=dataclasses.replace(workload.workload, lora=True))
    return {name: phase.total / 2**30 for name, phase in configured_phases(lora, facts).items()}


def without_full_training(phase: PhasePeak, cache_share: float) -> PhasePeak:
    """``phase`` less :data:`FULL_TRAINING_TERMS`; the rollout's KV cache again fills its share of the device
    (``cache_share`` bytes) around what stays, so its peak is max(share, what stays)."""
    kept = [t for t in phase.terms if t.name not in FULL_TRAINING_TERMS]
    if phase.phase == "rollout":
        kept = [t for t in kept if t.name != "KV cache + workspace"]
        return PhasePeak(phase.phase, kept, cache_share)
    return PhasePeak(phase.phase, kept, 0.0 if phase.phase == "update" else phase.floor)


def configured_phases(workload: TuneWorkload, facts: ModelFacts) -> dict[str, PhasePeak]:
    """The actor's predicted phases at the configured update point: :func:`~klppo.tune.memory.predict`'s,
    LoRA's (:func:`lora_peaks_gib`'s terms) when the actor trains LoRA adapters (``Workload.lora``)."""
    if not workload.workload.lora:
        return predict(facts, workload.update_point, workload.workload)
    w = dataclasses.replace(workload.workload, reference=False, rollout_tensor_parallel=1)
    cache_share = w.gpu_memory_utilization * w.device_bytes
    phases = predict(facts, workload.update_point, w)
    return {name: without_full_training(phase, cache_share) for name, phase in phases.items()}


def configured_peaks(workload: TuneWorkload, facts: ModelFacts) -> dict[str, float]:
    """Predicted peak bytes per rank of each of the actor's phases at the configured update point
    (:func:`configured_phases`' totals)."""
    return {name: phase.total for name, phase in configured_phases(workload, facts).items()}
