"""The memory check `klppo train` runs before loading any model on a GPU: the memory model's predicted
peak per phase for the configured settings, logged, with a warning that names `klppo tune` when a phase
is predicted not to fit."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from klppo.tune.memory import Point, predict
from klppo.tune.units import ModelFacts

log = logging.getLogger("klppo")


def predicted_peaks_gib(
    cfg: Any, model_config: Any, *, world_size: int, device_gib: float
) -> dict[str, float]:
    """Predicted peak GiB per rank for the rollout, log-prob and update phases of ``cfg``'s actor."""
    from klppo.tune.cli import workload_from

    w, point, seq_len = workload_from(cfg, argparse.Namespace(device_gb=device_gib), world_size)
    actor = cfg.actor_rollout_ref.actor
    if not actor.use_dynamic_bsz and actor.ppo_micro_batch_size_per_gpu:
        # fixed micro-batches: rows × the padded sequence length, split over a Ulysses group's ranks
        point = Point(
            point.min_num_params,
            point.offload,
            point.forward_prefetch,
            point.reshard_after_forward,
            -(-int(actor.ppo_micro_batch_size_per_gpu) * seq_len // w.sequence_parallel),
        )
    phases = predict(ModelFacts.from_config(model_config), point, w)
    return {name: peak.total / 2**30 for name, peak in phases.items()}


def check_memory(
    cfg: Any, model_config: Any, *, world_size: int, device_gib: float, headroom: float = 0.95
) -> None:
    """Log the predicted peaks; warn when one exceeds ``headroom`` × the device (the model is within ~15%)."""
    try:
        peaks = predicted_peaks_gib(cfg, model_config, world_size=world_size, device_gib=device_gib)
    except Exception as exc:  # an architecture the model does not know: the check is advice, not a gate
        log.info("memory check skipped: %s", exc)
        return
    summary = ", ".join(f"{name} {gib:.1f}" for name, gib in peaks.items())
    log.info("predicted peak memory per GPU (GiB, of %.0f): %s", device_gib, summary)
    over = {name: gib for name, gib in peaks.items() if gib > headroom * device_gib}
    if over:
        worst = max(over, key=over.get)
        log.warning(
            "the %s phase is predicted to need %.1f GiB of this GPU's %.0f GiB: it may run out of memory. "
            "`klppo tune <same arguments> --dry-run` shows each term and the settings that fit "
            "(min_num_params, offload, micro-batch tokens, gradient checkpointing).",
            worst, over[worst], device_gib,
        )  # fmt: skip
