"""Tracker backends (all but the console): jsonl file, TensorBoard, Weights & Biases, MLflow, SwanLab.

Each backend is built with keyword arguments ``run_dir, project_name, experiment_name, config_dict,
resume_step`` and has ``log(values: dict[str, float | int], step: int)`` and ``close()``. Values arrive
already converted to Python numbers by the `Tracker`. The optional services are imported only when
chosen; a missing package raises `TrackerError` with the ``pip install`` to run.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
from pathlib import Path
from typing import Any, Protocol


class TrackerError(ValueError):
    """A tracker configuration the user must change (unknown logger, missing package)."""


class Backend(Protocol):
    def log(self, values: dict[str, float | int], step: int) -> None: ...

    def close(self) -> None: ...


def _require(module: str, pip_name: str, logger_name: str):
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TrackerError(
            f"trainer.logger includes {logger_name!r} but the `{module}` package is not installed: "
            f"run `pip install {pip_name}`, or remove {logger_name!r} from trainer.logger."
        ) from None


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict → ``{"a.b.c": value}`` (lists kept as values)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_config(value, name + "."))
        else:
            flat[name] = value
    return flat


def strict_record(step: int, values: dict[str, Any]) -> dict[str, Any]:
    """``{"step": step, **values}`` with non-finite floats replaced by ``None`` and listed under
    ``"nonfinite"`` as ``{key: "nan" | "inf" | "-inf"}`` (absent when every value is finite)."""
    record: dict[str, Any] = {"step": step}
    nonfinite: dict[str, str] = {}
    for key, value in values.items():
        if isinstance(value, float) and not math.isfinite(value):
            nonfinite[key] = "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
            value = None
        record[key] = value
    if nonfinite:
        record["nonfinite"] = nonfinite
    return record


class JsonlBackend:
    """``<run_dir>/metrics.jsonl``: one flat JSON object per line, ``{"step": int, key: value, ...}``.

    Appends (a resumed run continues the file); with ``resume_step`` the lines of later steps, written
    by the interrupted run after its last checkpoint, are dropped first (atomic rewrite). Each line is
    flushed as written, so ``tail -f`` and a crash lose nothing. Lines are strict JSON (RFC 8259): a
    non-finite value is written as ``null`` and named, with its kind, in the line's ``nonfinite`` object,
    e.g. ``{"step": 3, "actor/pg_loss": null, "nonfinite": {"actor/pg_loss": "nan"}}`` (kinds: ``nan``,
    ``inf``, ``-inf``); every JSON reader (jq, JavaScript, pandas) reads the file.
    """

    FILENAME = "metrics.jsonl"

    def __init__(self, *, run_dir: str, resume_step: int | None = None, **_: Any) -> None:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        self.path = Path(run_dir) / self.FILENAME
        if resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)
        self._file = open(self.path, "a", encoding="utf-8")

    def _truncate_after(self, resume_step: int) -> None:
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash mid-write
                continue
            if record.get("step", 0) <= resume_step:
                kept.append(line + "\n")
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)

    def log(self, values: dict[str, float | int], step: int) -> None:
        self._file.write(json.dumps(strict_record(step, values), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardBackend:
    """Scalars under ``<run_dir>/tensorboard``; on resume, events after ``resume_step`` are purged."""

    def __init__(self, *, run_dir: str, config_dict: dict, resume_step: int | None = None, **_: Any):
        _require("tensorboard", "tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter  # noqa: PLC0415  optional extra (klppo[tensorboard])

        purge = None if resume_step is None else resume_step + 1
        self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"), purge_step=purge)
        if config_dict and resume_step is None:
            self.writer.add_text("config", "```\n" + json.dumps(config_dict, indent=2, default=str) + "\n```")

    def log(self, values: dict[str, float | int], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbBackend:
    """Weights & Biases; the run id is kept in ``<run_dir>/wandb_run_id.txt`` so a resume continues it."""

    def __init__(self, *, run_dir: str, project_name: str, experiment_name: str, config_dict: dict, **_: Any):
        wandb = _require("wandb", "wandb", "wandb")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        id_file = Path(run_dir) / "wandb_run_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else None
        self.run = wandb.init(
            project=project_name,
            name=experiment_name,
            config=config_dict,
            dir=run_dir,
            id=run_id,
            resume="allow",
        )
        if run_id is None and getattr(self.run, "id", None):
            id_file.write_text(str(self.run.id) + "\n")

    def log(self, values: dict[str, float | int], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


_MLFLOW_BAD = re.compile(r"[^\w\-. /:]")


class MlflowBackend:
    """MLflow; tracking URI from ``$MLFLOW_TRACKING_URI``, else ``<run_dir>/mlruns``.

    MLflow metric names allow only ``[A-Za-z0-9_-. /:]``: ``@`` becomes ``_at_`` and others ``_``.
    """

    def __init__(self, *, run_dir: str, project_name: str, experiment_name: str, config_dict: dict, **_: Any):
        mlflow = _require("mlflow", "mlflow", "mlflow")
        self.mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri(Path(run_dir, "mlruns").resolve().as_uri())
        mlflow.set_experiment(project_name)
        self.run = mlflow.start_run(run_name=experiment_name)
        params = {k: str(v)[:500] for k, v in flatten_config(config_dict).items()}
        if params:
            mlflow.log_params(params)

    @staticmethod
    def sanitize(key: str) -> str:
        return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))

    def log(self, values: dict[str, float | int], step: int) -> None:
        finite = {self.sanitize(k): float(v) for k, v in values.items() if math.isfinite(v)}
        self.mlflow.log_metrics(finite, step=step)

    def close(self) -> None:
        self.mlflow.end_run()


class SwanlabBackend:
    """SwanLab; logs under ``<run_dir>/swanlog``; ``$SWANLAB_MODE`` (cloud/local/offline) is honoured."""

    def __init__(self, *, run_dir: str, project_name: str, experiment_name: str, config_dict: dict, **_: Any):
        swanlab = _require("swanlab", "swanlab", "swanlab")
        self.swanlab = swanlab
        kwargs: dict[str, Any] = {
            "project": project_name,
            "experiment_name": experiment_name,
            "config": config_dict,
            "logdir": str(Path(run_dir) / "swanlog"),
        }
        if os.environ.get("SWANLAB_MODE"):
            kwargs["mode"] = os.environ["SWANLAB_MODE"]
        self.run = swanlab.init(**kwargs)

    def log(self, values: dict[str, float | int], step: int) -> None:
        self.swanlab.log(values, step=step)

    def close(self) -> None:
        self.swanlab.finish()
