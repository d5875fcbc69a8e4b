"""What a run directory records besides metrics: config, command, versions, sample generations.

Layout written here (``trainer.default_local_dir``)::

    resolved_config.yaml  the resolved config (rewritten on every start, so a resume shows the config it
                          resumed with); its own name, so a user's ``config.yaml`` kept there is never touched
    command.txt        the command line of the latest start, shell-quoted
    versions.json      klppo, torch, transformers, python, CUDA, GPUs, git commit of klppo
    generations.jsonl  sample generations (`GenerationLog`), one JSON object per sample
    .klppo_files.json  the names of the files above (and ``metrics.jsonl``) that klppo created here

Files klppo did not create are never overwritten or appended to: :func:`claim_run_files` refuses to start
a run whose directory holds a file of one of those names that is not listed as klppo's.
"""

from __future__ import annotations

import json
import os
import platform
import random
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

import klppo


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def _package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    """HEAD of the git checkout klppo runs from (None when installed from a wheel)."""
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def collect_versions() -> dict[str, Any]:
    """Versions of everything that changes numerics or behaviour of a run."""
    import transformers  # noqa: PLC0415  heavy (transformers, ~2 s): only to record its version

    cuda = torch.cuda.is_available()
    return {
        "klppo": klppo.__version__,
        "klppo_git_commit": _git_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": _package_version("tokenizers"),
        "numpy": _package_version("numpy"),
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "platform": platform.platform(),
    }


RESOLVED_CONFIG = "resolved_config.yaml"
OWNED_LIST = ".klppo_files.json"
RUN_FILES = (
    RESOLVED_CONFIG,
    "command.txt",
    "versions.json",
    "metrics.jsonl",
    "generations.jsonl",
    "report.html",
)
_LEGACY_SIGNS = ("latest_checkpointed_iteration.txt",)  # a run directory of a klppo without OWNED_LIST


class RunDirError(ValueError):
    """The run directory holds files klppo did not create under names it would write."""


def claim_run_files(run_dir: str | Path, names: Sequence[str] = RUN_FILES, *, record: bool = True) -> None:
    """Refuse (:class:`RunDirError`) if a file of ``names`` exists in ``run_dir`` and klppo did not create
    it; otherwise (with ``record``) record ``names`` as klppo's (``.klppo_files.json``). Call on rank 0,
    before writing.

    A directory of an older klppo (a checkpoint marker, no list) counts its files as klppo's."""
    root = Path(run_dir)
    listed = root / OWNED_LIST
    try:
        owned = set(json.loads(listed.read_text(encoding="utf-8")))
    except FileNotFoundError:
        legacy = any((root / sign).exists() for sign in _LEGACY_SIGNS)
        owned = set(RUN_FILES) - {RESOLVED_CONFIG} if legacy else set()
    except (OSError, ValueError) as exc:
        raise RunDirError(
            f"{listed} is unreadable ({exc}); remove it if this is a klppo run directory"
        ) from None
    foreign = [n for n in names if (root / n).exists() and n not in owned]
    if foreign:
        raise RunDirError(
            f"{root} holds {', '.join(foreign)}, not written by klppo; klppo never overwrites files it did "
            f"not create: move them, or set trainer.default_local_dir to another directory"
        )
    if not record:
        return
    root.mkdir(parents=True, exist_ok=True)
    _write_atomic(listed, json.dumps(sorted(owned | set(names))) + "\n")


def write_run_metadata(run_dir: str, *, config_yaml: str, argv: list[str]) -> dict[str, Any]:
    """Write ``resolved_config.yaml``, ``command.txt`` and ``versions.json`` into ``run_dir`` (after
    :func:`claim_run_files`); returns the versions. Files are replaced atomically. Call on rank 0 only.
    """
    root = Path(run_dir)
    claim_run_files(root, (RESOLVED_CONFIG, "command.txt", "versions.json"))
    text = config_yaml if config_yaml.endswith("\n") else config_yaml + "\n"
    _write_atomic(root / RESOLVED_CONFIG, text)
    _write_atomic(root / "command.txt", shlex.join(argv) + "\n")
    versions = collect_versions()
    _write_atomic(root / "versions.json", json.dumps(versions, indent=2) + "\n")
    return versions


class GenerationLog:
    """Appends sample generations to ``<run_dir>/generations.jsonl`` (``trainer.log_val_generations``).

    `write` appends samples the caller chose; `log` keeps ``num_samples`` samples chosen as verl does: sorted
    by prompt, shuffled with a fixed seed
    (42), the first ``num_samples`` taken; so the same prompts are followed from one validation to the
    next. Each line: ``{"step", "prompt", "response", "score"}`` plus ``ground_truth`` / ``data_source``
    when given. Ranks other than 0 write nothing.
    """

    FILENAME = "generations.jsonl"

    def __init__(self, run_dir: str, *, rank: int = 0) -> None:
        self.path = Path(run_dir) / self.FILENAME
        self.rank = rank

    def write(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """Append already-chosen samples (dicts such as ``{"prompt", "response", "score"}``) at ``step``."""
        if self.rank != 0 or not samples:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            for sample in samples:
                f.write(json.dumps({"step": int(step), **sample}, ensure_ascii=False, default=str) + "\n")

    def log(
        self,
        step: int,
        *,
        prompts: Sequence[str],
        responses: Sequence[str],
        scores: Sequence[float],
        num_samples: int,
        ground_truths: Sequence[Any] | None = None,
        data_sources: Sequence[str] | None = None,
    ) -> list[dict[str, Any]]:
        """Select and append samples; returns the records written (empty on other ranks)."""
        if self.rank != 0 or num_samples <= 0:
            return []
        columns: dict[str, Sequence[Any]] = {"prompt": prompts, "response": responses, "score": scores}
        if ground_truths is not None:
            columns["ground_truth"] = ground_truths
        if data_sources is not None:
            columns["data_source"] = data_sources
        lengths = {name: len(values) for name, values in columns.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"GenerationLog.log: columns differ in length {lengths}")
        order = sorted(range(len(prompts)), key=lambda i: (prompts[i], responses[i]))
        random.Random(42).shuffle(order)
        records = []
        for i in order[:num_samples]:
            record: dict[str, Any] = {"step": int(step)}
            record.update({name: values[i] for name, values in columns.items()})
            record["score"] = float(record["score"])
            records.append(record)
        self.write(step, [{k: v for k, v in r.items() if k != "step"} for r in records])
        return records
