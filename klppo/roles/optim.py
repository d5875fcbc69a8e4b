"""Optimizer and learning-rate schedule for a trained role (actor or critic)."""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch

from klppo.parallel.cpu_optim import host_step_class
from klppo.parallel.local_shards import local_shard_class
from klppo.parallel.plain import MasterWeights


@dataclass(frozen=True)
class OptimSettings:
    """AdamW + warmup then constant/cosine decay; verl's ``*.optim`` keys.

    ``warmup_steps`` < 0 means "use ``warmup_steps_ratio`` × total_steps".
    """

    lr: float = 1e-6
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = -1
    warmup_steps_ratio: float = 0.0
    schedule: str = "constant"  # constant | cosine
    min_lr_ratio: float = 0.0
    num_cycles: float = 0.5
    total_steps: int = 1
    optimizer: str = "AdamW"
    """Class name in ``optimizer_impl`` (verl's ``optim.optimizer`` / ``optim.optimizer_impl``)."""
    optimizer_impl: str = "torch.optim"
    extra: tuple[tuple[str, Any], ...] = ()
    """``optim.override_optimizer_config``: further keyword arguments of the optimizer class."""


def build_optimizer(
    params, settings: OptimSettings, *, host: MasterWeights | None = None
) -> torch.optim.Optimizer:
    """The configured optimizer (AdamW by default) over the trainable parameters.

    torch's Adam/AdamW step on the DTensor parameters' local shards (:mod:`klppo.parallel.local_shards`:
    same state, same checkpoints); other classes as configured.

    ``betas`` are passed to optimizers that take them (Adam family); ``weight_decay`` to all that do.
    Optimizers with a ``fused`` option (torch's Adam/AdamW/SGD) get ``fused=True`` when every parameter is
    on CUDA (one kernel per parameter group instead of one per tensor and operation), unless
    ``override_optimizer_config`` sets ``fused`` (``{fused: false}``: the multi-tensor ``foreach`` path).

    ``host`` (``fsdp_config.optimizer_step_on_cpu``: masters on the host, ``params`` its masters): the class's
    host-step variant (:mod:`klppo.parallel.cpu_optim`, Adam/AdamW only), ``foreach`` on the CPU unless
    ``override_optimizer_config`` chooses (``{fused: true}``: torch's fused CPU kernel).
    """

    params = [p for p in params if p.requires_grad]
    try:
        cls = getattr(importlib.import_module(settings.optimizer_impl), settings.optimizer)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"optim.optimizer={settings.optimizer!r} not found in "
            f"optim.optimizer_impl={settings.optimizer_impl!r}"
        ) from exc
    cls = host_step_class(cls) if host is not None else local_shard_class(cls)
    accepted = inspect.signature(cls).parameters
    kwargs: dict[str, Any] = {"lr": settings.lr}
    if "betas" in accepted:
        kwargs["betas"] = settings.betas
    if "weight_decay" in accepted:
        kwargs["weight_decay"] = settings.weight_decay
    if "fused" in accepted and params and all(p.is_cuda for p in params):
        kwargs["fused"] = True
    if host is not None and not {"fused", "foreach"} & {k for k, _ in settings.extra}:
        kwargs["foreach"] = True
    kwargs.update(dict(settings.extra))
    optimizer = cls(params, **kwargs)
    if host is not None:
        optimizer.attach(host)
    return optimizer


def lr_multiplier(step: int, settings: OptimSettings) -> float:
    """Multiplier of the base lr after ``step`` scheduler steps.

    warmup: (step+1)/warmup for step < warmup (linear from lr/warmup, as verl's constant-with-warmup);
    cosine: min_lr_ratio + (1 − min_lr_ratio)·½(1 + cos(2π·num_cycles·progress)).
    """
    warmup = settings.warmup_steps
    if warmup < 0:
        warmup = int(settings.warmup_steps_ratio * settings.total_steps)
    if step < warmup:
        return float(step + 1) / float(max(1, warmup))
    if settings.schedule == "constant":
        return 1.0
    if settings.schedule == "cosine":
        progress = (step - warmup) / max(1, settings.total_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(2.0 * math.pi * settings.num_cycles * min(progress, 1.0)))
        return settings.min_lr_ratio + (1.0 - settings.min_lr_ratio) * max(0.0, cosine)
    raise ValueError(f"unknown lr schedule {settings.schedule!r}: expected constant or cosine")


def build_scheduler(optimizer: torch.optim.Optimizer, settings: OptimSettings):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, settings))
