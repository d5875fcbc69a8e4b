"""The memory check `klppo train` runs before loading any model on a GPU: the memory model's predicted
peak per phase for the configured settings, logged, with a warning that names `klppo tune` when a phase
is predicted not to fit — and, the other way round, the token budget to set when the actor's mini-batch
runs as several micro-batches while a larger budget is predicted to fit well inside the device. A setting
that cannot fit the device or the host (``klppo.tune.host.refusal``) is refused here, with the figure and
the settings that would fit."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from klppo.config import ConfigError
from klppo.rollout.workspace import slot_bytes
from klppo.tune.critic import run_peaks
from klppo.tune.host import host_peak, refusal
from klppo.tune.memory import Point, TuneWorkload, Workload
from klppo.tune.shapes import head_dim
from klppo.tune.units import ModelFacts

log = logging.getLogger("klppo")


def predicted_peaks_gib(workload: TuneWorkload, model_config: Any) -> dict[str, float]:
    """Predicted peak GiB per rank for the rollout, log-prob and update phases of the actor, with its update
    micro-batches as configured (``klppo.assembly.settings.tune_workload``; LoRA's: ``klppo.tune.lora``), and
    with a critic its ``values`` and ``update_critic`` phases (``klppo.tune.critic``)."""
    peaks = run_peaks(workload, ModelFacts.from_config(model_config))
    return {name: peak / 2**30 for name, peak in peaks.items()}


ADVICE_SHARE = 0.6
"""A larger micro-batch budget is advised only while the update and log-prob phases stay predicted under
this share of the device (the memory model is within ~15%; the rest is room for fragmentation and for
what it does not count)."""


def micro_batch_advice(
    workload: TuneWorkload, model_config: Any, mini_batch_tokens: int, *, share: float = ADVICE_SHARE
) -> str | None:
    """With token-budget micro-batches (``use_dynamic_bsz``): when the actor's mini-batch of up to
    ``mini_batch_tokens`` tokens per rank takes several micro-batches of ``ppo_max_token_len_per_gpu`` and
    a larger budget — doubled until it holds the whole mini-batch — keeps the predicted update and
    log-prob peaks under ``share`` of the device (the rollout's peak does not depend on it), the sentence
    that says what to set (the log-prob budget too); None otherwise (fixed micro-batches, one micro-batch
    already, or no room). Fewer, larger micro-batches cut the host work per step, which is what bounds
    small models."""
    budget = workload.point.micro_tokens
    if workload.update_micro_tokens != budget or budget >= mini_batch_tokens:
        return None
    facts, limit = ModelFacts.from_config(model_config), share * workload.workload.device_bytes

    def peak_at(tokens: int) -> float:  # the phases the budget sizes (the rollout's does not move with it)
        w = dataclasses.replace(
            workload.workload, log_prob_tokens=max(tokens, workload.workload.log_prob_tokens or 0)
        )
        point = dataclasses.replace(workload.point, micro_tokens=tokens)
        tw = dataclasses.replace(workload, workload=w, point=point, update_micro_tokens=tokens)
        phases = run_peaks(tw, facts)  # with what a critic holds beside them
        return max(phases["update"], phases["log_prob"])

    best, tokens = None, budget
    while tokens < mini_batch_tokens:
        tokens = min(2 * tokens, mini_batch_tokens)
        if peak_at(tokens) > limit:
            break
        best = tokens
    if best is None:
        return None
    device_gib = workload.workload.device_bytes / 2**30
    return (
        f"the actor's mini-batch (up to {mini_batch_tokens:,} tokens per rank) runs as up to "
        f"{-(-mini_batch_tokens // budget)} micro-batches of ≤ {budget:,} tokens; "
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={best} and "
        f"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu={best} are predicted to need "
        f"{peak_at(best) / 2**30:.1f} GiB of {device_gib:.0f} in the update and log-prob passes "
        f"({-(-mini_batch_tokens // best)} micro-batch(es)): fewer, larger micro-batches cut the per-step "
        "host work that bounds small models"
    )


def workspace_advice(
    workload: TuneWorkload, model_config: Any, rollout_seqs: int, *, share: float = ADVICE_SHARE
) -> str | None:
    """For a klppo-engine rollout that frees its workspace after each step (``free_cache_engine=True``,
    verl's default): when keeping it beside the training phases' predicted peak (update, log-prob and a
    critic's) stays under
    ``share`` of the device, the sentence that says to set ``free_cache_engine=False`` and what it costs;
    None otherwise. What a kept workspace holds through training, per rank: the KV cache of
    ``rollout_seqs`` sequences (an upper bound: the engine takes fewer slots when fewer fit) at the full
    prompt + response length rounded up to 64 positions, the decode step's per-slot temporaries the engine
    budgets (``rollout.workspace.slot_bytes``, as ``num_slots`` counts a slot: 32 bytes per vocabulary
    entry — fp32 logits and the sampler's buffers, kept in the graphs' memory pool), and one bf16/fp16 copy
    of the weights. The engine then captures its decode graphs once per run instead of at every step."""
    facts = ModelFacts.from_config(model_config)
    shape, c = facts.shape, workload.workload.compute_bytes
    positions = -(-workload.seq_len // 64) * 64
    per_slot = slot_bytes(
        layers=shape.layers,
        kv_heads=shape.kv_heads,
        head_dim=head_dim(facts.config),
        max_len=positions,
        vocab=shape.vocab,
        elt=c,
    )
    kept = rollout_seqs * per_slot + facts.num_params * c
    # the training phases (a critic's too), each with what the other roles hold beside it
    training = max(v for name, v in run_peaks(workload, facts).items() if name != "rollout")
    if training + kept > share * workload.workload.device_bytes:
        return None
    device_gib = workload.workload.device_bytes / 2**30
    return (
        f"actor_rollout_ref.rollout.free_cache_engine=False keeps the rollout's KV cache and decode graphs "
        "between steps (graphs captured once per run instead of every step; docs/rollout.md, 'Keeping the "
        f"engine between rollouts') for {kept / 2**30:.1f} GiB held through training ({rollout_seqs} "
        f"sequences × {positions} positions, decode buffers and a copy of the weights); with the update and "
        f"log-prob passes that is predicted at {(training + kept) / 2**30:.1f} GiB of {device_gib:.0f}"
    )


def check_memory(
    workload: TuneWorkload,
    model_config: Any,
    *,
    headroom: float = 0.95,
    mini_batch_tokens: int | None = None,
    rollout_seqs: int | None = None,
    host_bytes: int | None = None,
) -> None:
    """Log the predicted peaks; warn when one exceeds ``headroom`` × the device (the model is within ~15%);
    with ``mini_batch_tokens`` (the actor's mini-batch per rank), log :func:`micro_batch_advice` if any;
    with ``rollout_seqs`` (sequences per rank of a rollout that frees its workspace each step), log
    :func:`workspace_advice` if any. With ``host_bytes`` (this machine's memory) the host's predicted peak is
    logged too, and a setting predicted not to fit the device or the host raises a ConfigError that says
    what would (``klppo.tune.host.refusal``)."""
    device_gib = workload.workload.device_bytes / 2**30
    try:
        peaks = predicted_peaks_gib(workload, model_config)
    except Exception as exc:  # an architecture the model does not know: the check is advice, not a gate
        log.info("memory check skipped: %s", exc)
        return
    summary = ", ".join(f"{name} {gib:.1f}" for name, gib in peaks.items())
    log.info("predicted peak memory per GPU (GiB, of %.0f): %s", device_gib, summary)
    if host_bytes is not None:
        facts = ModelFacts.from_config(model_config)
        host = host_peak(facts, workload.update_point, workload.workload, critic=workload.critic).total
        log.info("predicted peak host memory per rank: %.1f GiB of %.0f", host / 2**30, host_bytes / 2**30)
        message = refusal(workload, model_config, host_bytes=host_bytes)
        if message:
            raise ConfigError(message)
    over = {name: gib for name, gib in peaks.items() if gib > headroom * device_gib}
    if over:
        worst = max(over, key=over.get)
        log.warning(
            "the %s phase is predicted to need %.1f GiB of this GPU's %.0f GiB: it may run out of memory. %s",
            worst,
            over[worst],
            device_gib,
            _over_budget_advice(worst, over[worst], workload),
        )
    else:
        advice = [
            micro_batch_advice(workload, model_config, mini_batch_tokens) if mini_batch_tokens else None,
            workspace_advice(workload, model_config, rollout_seqs) if rollout_seqs else None,
        ]
        for line in filter(None, advice):
            log.info("advice: %s", line)


def _over_budget_advice(phase: str, peak_gib: float, workload: Any) -> str:
    """What to set when ``phase`` is predicted over the device. The rollout's peak is max(its KV-cache share
    of the device, ``gpu_memory_utilization`` × D; what stays resident + the gathered weights): only in the
    first case does a lower share help (`klppo tune` does not vary it)."""
    w = getattr(workload, "workload", None)
    util, device = getattr(w, "gpu_memory_utilization", None), getattr(w, "device_bytes", None)
    if phase.startswith("rollout") and isinstance(util, float) and device:
        if abs(peak_gib - util * device / 2**30) <= 0.02 * peak_gib:
            return (
                f"Lower actor_rollout_ref.rollout.gpu_memory_utilization (now {util:g}): the rollout takes "
                "that share of the device for its weights and KV cache."
            )
        return (
            "The rollout's weights and what stays resident exceed it whatever its cache share: shard the "
            "rollout (actor_rollout_ref.rollout.tensor_model_parallel_size), offload the roles that wait "
            "(fsdp_config.param_offload/optimizer_offload), or see `klppo tune <same arguments> --dry-run`."
        )
    point = getattr(workload, "update_point", None)
    plain = isinstance(w, Workload) and isinstance(point, Point) and w.runs_plain(point)  # no FSDP2 units
    return (
        "`klppo tune <same arguments> --dry-run` shows each term and the settings that fit "
        f"({'' if plain else 'min_num_params, '}offload, micro-batch tokens, gradient checkpointing)."
    )
