"""`Tracker`: one object the trainer calls once per step; it fans metrics out to the chosen backends.

Contract:
- ``Tracker(loggers, run_dir=..., project_name=..., experiment_name=..., config_dict=..., rank=r)``;
  ``loggers`` is ``trainer.logger`` (a name or a list of names: console, jsonl (alias file),
  tensorboard, wandb, mlflow, swanlab). Unknown names raise on every rank; a backend whose package is
  missing raises a `TrackerError` naming the ``pip install`` (rank 0 only: other ranks build nothing).
- ``log(metrics, step)``: values are Python numbers, NumPy scalars or one-element tensors (any device;
  tensors are read with one host transfer per device, not one ``.item()`` each). ``step`` is the
  training step (1-based; validation lines carry the step they follow, 0 before training).
- ``resume_step``: on resume, lines / events logged after this step by the interrupted run are dropped
  (jsonl rewrites its file, TensorBoard purges), so the record matches an uninterrupted run.
- ``close()`` flushes and closes every backend; the tracker is a context manager too.
- ``history``: every ``(step, values)`` logged by this process, kept in memory (the end-of-run summary
  reads it when no ``jsonl`` file is written).
Ranks other than 0 are no-ops.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from klppo.tracking.backends import (
    Backend,
    JsonlBackend,
    MlflowBackend,
    SwanlabBackend,
    TensorBoardBackend,
    TrackerError,
    WandbBackend,
)
from klppo.tracking.console import ConsoleBackend

BACKENDS: dict[str, Callable[..., Backend]] = {
    "console": ConsoleBackend,
    "jsonl": JsonlBackend,
    "tensorboard": TensorBoardBackend,
    "wandb": WandbBackend,
    "mlflow": MlflowBackend,
    "swanlab": SwanlabBackend,
}
ALIASES = {"file": "jsonl"}
# backend → (module it imports, pip package): what `klppo train` checks is importable before weights load
PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "mlflow": ("mlflow", "mlflow"),
    "swanlab": ("swanlab", "swanlab"),
}

__all__ = ["BACKENDS", "PACKAGES", "Tracker", "TrackerError", "normalize_logger_names", "to_scalars"]


def normalize_logger_names(loggers: str | Sequence[str] | None) -> list[str]:
    """``trainer.logger`` → canonical backend names, deduplicated in order; raises on unknown names."""
    if loggers is None:
        return []
    if isinstance(loggers, str):
        loggers = [loggers]
    names: list[str] = []
    for raw in loggers:
        name = ALIASES.get(str(raw).strip().lower(), str(raw).strip().lower())
        if name not in BACKENDS:
            known = sorted([*BACKENDS, *ALIASES])
            raise TrackerError(f"trainer.logger: unknown logger {raw!r}; choose from {known}")
        if name not in names:
            names.append(name)
    return names


def to_scalars(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """Metric values → Python floats (ints stay ints); tensors read with one transfer per device."""
    out: dict[str, float | int] = {}
    tensors: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise TypeError(f"metric {key!r} is a tensor of shape {tuple(value.shape)}, not a scalar")
            tensors.setdefault(value.device, []).append((key, value.detach().reshape(())))
        elif isinstance(value, bool):
            out[key] = float(value)
        elif isinstance(value, int):
            out[key] = value
        else:
            try:
                out[key] = float(value)
            except (TypeError, ValueError):
                raise TypeError(f"metric {key!r} has non-numeric value {value!r}") from None
    for items in tensors.values():
        stacked = torch.stack([t.to(torch.float64) for _, t in items]).tolist()
        out.update({key: v for (key, _), v in zip(items, stacked)})
    return {key: out[key] for key in metrics}


class Tracker:
    """Fans metrics out to backends on rank 0 (see the module contract)."""

    def __init__(
        self,
        loggers: str | Sequence[str] | None,
        *,
        run_dir: str,
        project_name: str,
        experiment_name: str,
        config_dict: dict | None = None,
        rank: int = 0,
        resume_step: int | None = None,
    ) -> None:
        self.names = normalize_logger_names(loggers)
        self.rank = rank
        self.run_dir = run_dir
        self.backends: dict[str, Backend] = {}
        self.history: list[tuple[int, dict[str, float | int]]] = []
        if rank != 0:
            return
        try:
            for name in self.names:
                self.backends[name] = BACKENDS[name](
                    run_dir=run_dir,
                    project_name=project_name,
                    experiment_name=experiment_name,
                    config_dict=config_dict or {},
                    resume_step=resume_step,
                )
        except BaseException:
            self.close()
            raise

    def set_total_steps(self, total: int, *, initial: int = 0) -> None:
        """Start the console progress bar over ``total`` training steps (``initial`` done on resume)."""
        console = self.backends.get("console")
        if isinstance(console, ConsoleBackend):
            console.set_total_steps(total, initial=initial)

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        """Send one step's metrics to every backend (no-op on ranks other than 0)."""
        if self.rank != 0:
            return
        step = operator.index(step)
        values = to_scalars(metrics)
        self.history.append((step, values))
        for backend in self.backends.values():
            backend.log(values, step)

    def close(self) -> None:
        """Flush and close every backend (idempotent)."""
        backends, self.backends = self.backends, {}
        for backend in backends.values():
            backend.close()

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
