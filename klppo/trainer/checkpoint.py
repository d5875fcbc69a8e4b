"""Run checkpoints: ``<default_local_dir>/global_step_N/`` written atomically, resumable exactly.

Layout of one checkpoint::

    global_step_N/
      actor/            model + optimizer (torch.distributed.checkpoint, loadable by any world size)
      actor/huggingface/  model config, generation config and tokenizer (for `klppo export`)
      critic/           same for the critic, when there is one
      trainer_state.pt  step, dataloader position, KL controller, schedulers, counters
      rng/rank_<r>.pt   each rank's RNG states
      COMPLETE          written last inside the directory

The directory is written as ``.global_step_N.tmp`` and renamed once every rank has finished, then
``latest_checkpointed_iteration.txt`` (verl's marker) is updated: a crash at any point leaves either the
previous checkpoint or a temporary directory that is never mistaken for a checkpoint.
"""

from __future__ import annotations

import errno
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from klppo.parallel.collectives import rank, world_size

MARKER = "latest_checkpointed_iteration.txt"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


class CheckpointError(RuntimeError):
    pass


def _barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / "COMPLETE").exists():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint named by the marker file, else the newest complete one, else None."""
    root = Path(root)
    marker = root / MARKER
    if marker.exists():
        try:
            step = int(marker.read_text().strip())
        except ValueError:
            step = -1
        candidate = root / f"global_step_{step}"
        if (candidate / "COMPLETE").exists():
            return candidate
    found = list_checkpoints(root)
    return found[-1][1] if found else None


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
    hf_assets: dict[str, Any],
    trainer_state: dict[str, Any],
    max_to_keep: int | None = None,
) -> Path:
    """Save a checkpoint of step ``step``; collective (every rank calls it). Returns the final path.

    ``hf_assets[role]`` is a callable ``(dir) -> None`` writing that role's HF config/tokenizer (rank 0).
    """
    from klppo.parallel.checkpoint import save_checkpoint as save_model_and_optimizer

    root = Path(root)
    final = root / f"global_step_{step}"
    tmp = root / f".global_step_{step}.tmp"
    try:
        if rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            (tmp / "rng").mkdir()
        _barrier()
        for role, (model, optimizer) in models.items():
            save_model_and_optimizer(tmp / role, model, optimizer)
            if rank() == 0 and role in hf_assets:
                hf_assets[role](tmp / role / "huggingface")
        torch.save(rng_state(), tmp / "rng" / f"rank_{rank()}.pt")
        if rank() == 0:
            torch.save(trainer_state, tmp / "trainer_state.pt")
        _barrier()
        if rank() == 0:
            (tmp / "COMPLETE").write_text(f"{step}\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_marker(root, step)
            _prune(root, max_to_keep)
        _barrier()
    except OSError as exc:
        if rank() == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        reason = "the disk is full" if exc.errno == errno.ENOSPC else str(exc)
        raise CheckpointError(
            f"saving checkpoint global_step_{step} under {root} failed: {reason}. "
            f"The previous checkpoint ({latest_checkpoint(root)}) is intact; free space or change "
            "trainer.default_local_dir and resume."
        ) from exc
    return final


def _write_marker(root: Path, step: int) -> None:
    tmp_marker = root / (MARKER + ".tmp")
    tmp_marker.write_text(f"{step}\n")
    os.replace(tmp_marker, root / MARKER)


def _prune(root: Path, max_to_keep: int | None) -> None:
    if not max_to_keep or max_to_keep <= 0:
        return
    for _, path in list_checkpoints(root)[:-max_to_keep]:
        shutil.rmtree(path, ignore_errors=True)


def resolve_resume(mode: str, root: str | Path, resume_from_path: str | None) -> Path | None:
    """The checkpoint to resume from under ``trainer.resume_mode`` (auto | disable | resume_path)."""
    import logging

    root = Path(root)
    if mode == "disable":
        if list_checkpoints(root) and rank() == 0:
            logging.getLogger("klppo").warning(
                "trainer.resume_mode=disable: starting fresh; the checkpoints already in %s stay there and "
                "may be overwritten by this run's",
                root,
            )
        return None
    if mode == "auto":
        return latest_checkpoint(root)
    if mode == "resume_path":
        if not resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        path = Path(resume_from_path).expanduser()
        if not (path / "COMPLETE").exists():
            raise CheckpointError(f"trainer.resume_from_path={path} is not a complete klppo checkpoint")
        return path
    raise ValueError(f"trainer.resume_mode={mode!r}: expected auto, disable or resume_path")


def checkpoint_step(path: Path) -> int:
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path} is not named global_step_N")
    return int(m.group(1))


def load_checkpoint(
    path: str | Path, *, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
) -> dict[str, Any]:
    """Load model/optimizer states in place and return the trainer state; restores this rank's RNG."""
    from klppo.parallel.checkpoint import load_checkpoint as load_model_and_optimizer

    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"{path} is not a complete klppo checkpoint (no COMPLETE file)")
    for role, (model, optimizer) in models.items():
        if not (path / role).exists():
            raise CheckpointError(f"checkpoint {path} has no {role!r} state")
        load_model_and_optimizer(path / role, model, optimizer)
    state = torch.load(path / "trainer_state.pt", weights_only=False)
    rng_file = path / "rng" / f"rank_{rank()}.pt"
    if rng_file.exists():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return state
