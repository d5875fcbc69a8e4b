"""A run directory holds one run: its start records, and what a fresh start does with an earlier run.

Every start of `klppo train` in a run directory is recorded in ``starts/NNN/`` (``001``, ``002``, …;
never overwritten): ``command.txt`` (shell-quoted) and ``resolved_config.yaml``; ``starts/latest`` names
the newest. A start refused at start-up (a resume that would change the run, a fresh start over an earlier
run) is recorded too, and leaves the run's other files as they were.

A *fresh* start (no checkpoint to resume: ``trainer.resume_mode=disable``, or ``auto`` in a directory
without one) where an earlier run left records:

- with checkpoints there (``global_step_N/``, ``best_validation/``), the start is refused, naming
  ``trainer.run_dir_exists`` (``refuse``, the default), unless that key is ``archive`` (the earlier run's
  files move into ``archive/NNN/``) or ``remove`` (they are deleted);
- without checkpoints (an earlier start that stopped before its first save), its records
  (``metrics.jsonl``, ``events.jsonl``, ``wandb_run_id.txt``, …) move into ``archive/NNN/``, with a note.

So ``metrics.jsonl`` never mixes two runs, and ``wandb_run_id.txt`` never makes a fresh run continue an
earlier run's W&B page. Files klppo did not create stay where they are.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
from pathlib import Path

log = logging.getLogger("klppo")
POLICY_KEY = "trainer.run_dir_exists"
POLICIES = ("refuse", "archive", "remove")
STARTS = "starts"
ARCHIVE = "archive"
_CHECKPOINT = re.compile(r"^(global_step_\d+|\.global_step_\d+\.tmp|best_validation)$")
_RECORDS = (
    "latest_checkpointed_iteration.txt",
    "resolved_config.yaml",
    "command.txt",
    "versions.json",
    "metrics.jsonl",
    "events.jsonl",
    "generations.jsonl",
    "report.html",
    "report",
    "wandb_run_id.txt",
    "wandb",
    "tensorboard",
    "mlruns",
    "swanlog",
    "logs",
    STARTS,
    ".klppo_files.json",
)
"""What klppo writes into a run directory besides checkpoints (``archive/`` and the lock excepted)."""


class RunExistsError(ValueError):
    """A fresh start in a run directory that holds an earlier run's checkpoints."""


def _numbered(parent: Path) -> Path:
    """A new directory ``parent/NNN`` (the next number; created, so two starts never share one)."""
    parent.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name) for p in parent.iterdir() if p.name.isdigit()]
    number = max(taken, default=0) + 1
    while True:
        path = parent / f"{number:03d}"
        try:
            path.mkdir()
            return path
        except FileExistsError:
            number += 1


def record_start(run_dir: str | Path, *, config_yaml: str, argv: list[str]) -> Path:
    """Write this start's ``starts/NNN/{command.txt,resolved_config.yaml}`` and mark it latest; returns it."""
    root = Path(run_dir)
    path = _numbered(root / STARTS)
    (path / "command.txt").write_text(shlex.join(argv) + "\n", encoding="utf-8")
    text = config_yaml if config_yaml.endswith("\n") else config_yaml + "\n"
    (path / "resolved_config.yaml").write_text(text, encoding="utf-8")
    tmp = root / STARTS / f".latest.tmp-{os.getpid()}"
    tmp.write_text(path.name + "\n")
    os.replace(tmp, root / STARTS / "latest")
    return path


def earlier_run(run_dir: Path) -> tuple[list[str], list[str]]:
    """(checkpoint entries, record entries) an earlier run left in ``run_dir``, by name."""
    if not run_dir.is_dir():
        return [], []
    names = sorted(p.name for p in run_dir.iterdir())
    checkpoints = [n for n in names if _CHECKPOINT.match(n)]
    records = [n for n in names if n in _RECORDS]
    return checkpoints, records


def _has_records(run_dir: Path, records: list[str]) -> bool:
    """Whether the records hold an earlier run's output (a start record or an empty file alone do not)."""
    for name in records:
        path = run_dir / name
        if name in (STARTS, ".klppo_files.json"):
            continue
        if path.is_dir() or path.stat().st_size > 0:
            return True
    return False


def prepare_fresh_start(run_dir: str | Path, *, policy: str, resume_mode: str) -> None:
    """Before a fresh start (nothing to resume) in ``run_dir``: refuse, archive or remove an earlier run
    (module docstring). Call on one process, holding the run directory's lock, before anything is written."""
    if policy not in POLICIES:
        raise RunExistsError(f"{POLICY_KEY}={policy!r}: expected one of {', '.join(POLICIES)}")
    root = Path(run_dir)
    checkpoints, records = earlier_run(root)
    moved = [n for n in checkpoints + records if n != STARTS]
    if checkpoints and policy == "refuse":
        shown = ", ".join(checkpoints[:3]) + (", …" if len(checkpoints) > 3 else "")
        raise RunExistsError(
            f"trainer.resume_mode={resume_mode} starts a new run, but {root} holds an earlier run's "
            f"checkpoints ({shown}); one directory holds one run: set trainer.default_local_dir to a new "
            f"directory, or {POLICY_KEY}=archive (moves the earlier run into {root / ARCHIVE}/) or "
            f"{POLICY_KEY}=remove (deletes it)"
        )
    if not checkpoints and not _has_records(root, records):
        return
    if policy == "remove" and checkpoints:
        for name in moved:
            path = root / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        log.warning("%s=remove: deleted the earlier run in %s (%s)", POLICY_KEY, root, ", ".join(moved))
        return
    target = _numbered(root / ARCHIVE)
    for name in moved:
        os.replace(root / name, target / name)
    why = f"{POLICY_KEY}=archive" if checkpoints else "an earlier start that saved no checkpoint"
    log.warning("%s: the earlier run's files in %s moved to %s", why, root, target)
