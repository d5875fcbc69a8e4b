"""The memory check `klppo train` runs before loading any model on a GPU: the memory model's predicted
peak per phase for the configured settings, logged, with a warning that names `klppo tune` when a phase
is predicted not to fit."""

from __future__ import annotations

import logging
from typing import Any

from klppo.tune.memory import TuneWorkload, predict
from klppo.tune.units import ModelFacts

log = logging.getLogger("klppo")


def predicted_peaks_gib(workload: TuneWorkload, model_config: Any) -> dict[str, float]:
    """Predicted peak GiB per rank for the rollout, log-prob and update phases of the actor, with its update
    micro-batches as configured (``klppo.trainer.settings.tune_workload``)."""
    phases = predict(ModelFacts.from_config(model_config), workload.update_point, workload.workload)
    return {name: peak.total / 2**30 for name, peak in phases.items()}


def check_memory(workload: TuneWorkload, model_config: Any, *, headroom: float = 0.95) -> None:
    """Log the predicted peaks; warn when one exceeds ``headroom`` × the device (the model is within ~15%)."""
    device_gib = workload.workload.device_bytes / 2**30
    try:
        peaks = predicted_peaks_gib(workload, model_config)
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
