"""The critic's device memory: its own model, dtypes, LoRA, offload and micro-batches (``critic.*``), its two
phases and what it holds in the actor's.

A value model is the memory model's causal LM (:mod:`klppo.tune.memory`) with one output per token instead of
the vocabulary (``Workload.value_model``) and ``P`` the value model's parameters (:func:`value_params`), on
``critic.model.path`` (the actor's backbone unless it names another model). The run's phases:

- ``values`` (the critic's no-grad pass) and ``update_critic``: the memory model's log-prob and update phases
  of the value model at the critic's point (LoRA: without the terms of full training,
  :data:`klppo.tune.lora.FULL_TRAINING_TERMS`), beside what the actor holds between its own phases
  (:func:`actor_idle_terms`: its parameters, compute copy and AdamW unless it offloads them while idle, the
  reference's shards, the graph pools);
- the actor's phases (rollout, log_prob, update) hold what the critic keeps between its passes
  (:func:`critic_idle_terms`): nothing when it offloads while idle (``param_offload``/``optimizer_offload``)
  or runs ``offload_policy``, the compute copy with ``optimizer_step_on_cpu``, else its parameters (with the
  plain path's compute copy) and AdamW unless it trains LoRA adapters. The rollout's KV cache fills the room
  left: its peak stays ``max(util·D, what is resident + P·c)``.

Not modelled: the critic's CUDA graph pool (``critic.model.fsdp_config.cuda_graph_update``); FSDP2's gathered
root counts the causal LM's untied head, which the value model does not have (it errs high by ``V·h·c``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from klppo.tune.lora import configured_phases, without_full_training
from klppo.tune.memory import PhasePeak, Point, TuneWorkload, Workload, log_prob_peak, update_peak
from klppo.tune.units import ModelFacts


@dataclass(frozen=True)
class CriticWorkload:
    """What the memory model needs of the critic: its workload (dtypes, checkpointing, LoRA, plain path,
    ``value_model``), its point (FSDP settings, offload, the update's token budget) and its model."""

    workload: Workload
    point: Point
    update_micro_tokens: int
    """Tokens of one update micro-batch as configured: the budget, or rows × seq_len."""
    model_config: object | None = None
    """The critic's model config (``critic.model.path``); None: the actor's backbone."""

    @property
    def update_point(self) -> Point:
        return dataclasses.replace(self.point, micro_tokens=self.update_micro_tokens)

    def facts(self, actor: ModelFacts) -> ModelFacts:
        """The value model's facts: its backbone's (the actor's when :attr:`model_config` is None) with
        :func:`value_params` parameters."""
        base = actor if self.model_config is None else ModelFacts.from_config(self.model_config)
        return dataclasses.replace(base, num_params=value_params(base))


def value_params(facts: ModelFacts) -> int:
    """Parameters of a value model on ``facts``' backbone: the causal LM's without its own LM head (an untied
    one: ``V·h``), with the one-output head ``score`` (``h + 1``)."""
    head = 0 if facts.shape.tied else facts.shape.vocab * facts.shape.hidden
    return facts.num_params - head + facts.shape.hidden + 1


RESIDENT_TERMS = ("sharded params", "compute copy", "optimizer (AdamW)")
"""A trained role's state between its phases (names of :class:`~klppo.tune.memory.Term`)."""
KEPT_BY_ROLE = ("reference shards", "actor graph pool", "reference graph pool")
"""What the actor's side keeps on the device whatever its offload."""
IDLE_OFFLOAD = ("idle", "cpu")
"""Offload modes that leave nothing of a role's state on the device while it is idle."""


def critic_own_phases(critic: CriticWorkload, actor: ModelFacts) -> dict[str, PhasePeak]:
    """The critic's ``values`` and ``update_critic`` phases alone (its own terms, LoRA's less full
    training)."""
    facts, w, point = critic.facts(actor), critic.workload, critic.update_point
    phases = {"values": log_prob_peak(facts, point, w), "update_critic": update_peak(facts, point, w)}
    if w.lora:
        phases = {k: without_full_training(p, 0.0) for k, p in phases.items()}
    return {name: dataclasses.replace(p, phase=name) for name, p in phases.items()}


def critic_idle_terms(critic: CriticWorkload, actor: ModelFacts) -> list[tuple[str, float, str]]:
    """What the critic keeps on the device while the actor's phases run (module docstring)."""
    if critic.point.offload in IDLE_OFFLOAD:
        return []
    values = critic_own_phases(critic, actor)["values"]
    return [(f"critic {t.name}", t.bytes, t.formula) for t in values.terms if t.name in RESIDENT_TERMS]


def actor_idle_terms(tw: TuneWorkload, actor_phases: dict[str, PhasePeak]) -> list[tuple[str, float, str]]:
    """What the actor's side keeps on the device while the critic's phases run: its log-prob phase's resident
    terms (none of its own state when it offloads while idle), the reference's shards, the graph pools."""
    kept = KEPT_BY_ROLE + (() if tw.update_point.offload in IDLE_OFFLOAD else RESIDENT_TERMS)
    return [(f"actor {t.name}", t.bytes, t.formula) for t in actor_phases["log_prob"].terms if t.name in kept]


def with_terms(phase: PhasePeak, terms: list[tuple[str, float, str]], cache_share: float) -> PhasePeak:
    """``phase`` with ``terms`` always present; a rollout's KV cache fills what is left of ``cache_share``
    bytes (its peak ``max(share, what stays)``)."""
    kept = list(phase.terms)
    floor = phase.floor
    if phase.phase == "rollout":
        kept = [t for t in kept if t.name != "KV cache + workspace"]
        floor = max(floor, cache_share)
    out = PhasePeak(phase.phase, kept, floor)
    for name, value, formula in terms:
        out.add(name, value, formula)
    return out


def run_phases(tw: TuneWorkload, facts: ModelFacts) -> dict[str, PhasePeak]:
    """The run's predicted phases on one rank: the actor's as configured
    (:func:`klppo.tune.lora.configured_phases`) and, with a critic (``tw.critic``), what it holds in them and
    its own two phases beside the actor's idle state (module docstring)."""
    phases = configured_phases(tw, facts)
    if tw.critic is None:
        return phases
    w = tw.workload
    share = w.gpu_memory_utilization * w.device_bytes
    idle = critic_idle_terms(tw.critic, facts)
    out = {name: with_terms(p, idle, share) for name, p in phases.items()}
    beside = actor_idle_terms(tw, phases)
    for name, p in critic_own_phases(tw.critic, facts).items():
        out[name] = with_terms(p, beside, share)
    return out


def run_peaks(tw: TuneWorkload, facts: ModelFacts) -> dict[str, float]:
    """:func:`run_phases`' totals (bytes), by phase."""
    return {name: p.total for name, p in run_phases(tw, facts).items()}
