"""The memory forecast of a run before any process starts or weight loads: the memory model's predicted peak
per phase on the GPU (the actor's, ``klppo.tune.memory``; LoRA's, ``klppo.tune.lora``; the critic's,
``klppo.tune.critic``) and the host memory the
offload needs (``klppo.tune.host``: the actor's, the offloaded reference's, an offloading critic's), and the
refusal of a setting predicted not to fit either (``klppo.tune.host.refusal``: the figure and the settings
that would fit).

`klppo train` refuses such a setting on a GPU before it starts a process (:func:`check_memory_fit`; each rank
checks again before its weights load, ``klppo.tune.preflight.check_memory``); its ``--dry-run`` prints the
forecast (:func:`forecast_lines`), on a machine without a GPU for an 80 GiB one. Reads model configs, never
weights.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from transformers import AutoConfig

from klppo.assembly.settings import fsdp_settings, tune_workload
from klppo.config import ConfigError, KLPPOConfig, uses_critic
from klppo.models.loading import model_dir
from klppo.tune.critic import run_peaks
from klppo.tune.host import host_peak, host_ram_bytes, host_text, refusal
from klppo.tune.memory import PhasePeak
from klppo.tune.units import ModelFacts

log = logging.getLogger("klppo")
GIB = 2**30
DEFAULT_DEVICE_GIB = 80.0
"""The GPU a forecast is made for on a machine without one."""


@dataclass(frozen=True)
class Forecast:
    """The predicted peaks of one rank: per phase on the GPU and on the host, and whether the run would be
    refused."""

    device_bytes: dict[str, float]
    """Per phase (rollout, log_prob, update)."""
    device_total: int
    host: PhasePeak
    host_total: int
    """The host memory of one process (``klppo.tune.host.host_ram_bytes``)."""
    refusal: str | None
    """``klppo.tune.host.refusal``'s sentence; None when the run is predicted to fit."""


def forecast(
    cfg: KLPPOConfig, model_path: str, *, world_size: int, device_gib: float, host_bytes: int
) -> Forecast:
    """The :class:`Forecast` of ``cfg`` on ``world_size`` GPUs of ``device_gib`` with ``host_bytes`` of host
    memory per process, the actor's model config read from ``model_path`` (the critic's from its own path
    where it names another model: :func:`critic_model_config`)."""
    arr = cfg.actor_rollout_ref
    key = "actor_rollout_ref.actor.fsdp_config"
    fsdp = fsdp_settings(arr.actor.fsdp_config, device_type="cuda", world_size=world_size, key=key)
    critic_config = critic_model_config(cfg, model_path)
    workload = tune_workload(
        cfg, fsdp, world_size=world_size, device_gib=device_gib, critic_config=critic_config
    )
    actor_config = AutoConfig.from_pretrained(model_path)
    facts = ModelFacts.from_config(actor_config)
    return Forecast(
        device_bytes=run_peaks(workload, facts),
        device_total=workload.workload.device_bytes,
        host=host_peak(facts, workload.update_point, workload.workload, critic=workload.critic),
        host_total=host_bytes,
        refusal=refusal(workload, actor_config, host_bytes=host_bytes),
    )


def critic_model_config(cfg: KLPPOConfig, model_path: str) -> object | None:
    """The model config of ``critic.model.path`` where it names another model than the actor's at
    ``model_path`` (None: no critic, or the actor's backbone). Reads the config file, never weights."""
    path = cfg.critic.model.path
    if not uses_critic(cfg) or not path or path == cfg.actor_rollout_ref.model.path:
        return None
    path = model_dir(path, key="critic.model.path")
    if path == model_path:
        return None
    return AutoConfig.from_pretrained(path)


def forecast_lines(found: Forecast, where: str) -> list[str]:
    """The dry run's lines: the GPU's peak per phase on ``where``, the host's with its terms, the refusal."""
    summary = ", ".join(f"{k} {v / GIB:.1f}" for k, v in found.device_bytes.items())
    lines = [
        f"predicted peak GiB per GPU on {where}: {summary} (klppo tune --dry-run shows the terms)",
        f"predicted peak host memory per process: {host_text(found.host, found.host_total)}",
    ]
    if found.refusal is not None:
        lines.append(f"refused on {where} with this host's memory: {found.refusal}")
    return lines


def check_memory_fit(cfg: KLPPOConfig, model_path: str, *, nproc: int) -> None:
    """On a GPU: ConfigError with :func:`forecast`'s refusal when the configured settings are predicted not
    to fit this GPU or this host (its memory shared by the ``nproc`` processes of this node); a model the
    memory model cannot build is let through (logged)."""
    device_gib = torch.cuda.get_device_properties(0).total_memory / GIB
    world, host = nproc * cfg.trainer.nnodes, host_ram_bytes(nproc)
    try:
        found = forecast(cfg, model_path, world_size=world, device_gib=device_gib, host_bytes=host)
    except (
        Exception
    ) as exc:  # an architecture the memory model does not know: the check is advice, not a gate
        log.info("memory check skipped: %s", exc)
        return
    if found.refusal is not None:
        raise ConfigError(found.refusal)
