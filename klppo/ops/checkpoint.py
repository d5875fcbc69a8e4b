"""Run checkpoints: ``<default_local_dir>/global_step_N/`` written atomically, validated before use.

Layout of one checkpoint::

    global_step_N/
      actor/            model + optimizer (torch.distributed.checkpoint, loadable by any world size)
      actor/huggingface/  model config, generation config and tokenizer (for `klppo export`)
      actor/base_model.json  with LoRA: the base model the adapters apply to (path, architecture, digest)
      critic/           same for the critic, when there is one
      trainer_state.pt  step, dataloader position, KL controller, schedulers, counters
      rng/rank_<r>.pt   each rank's RNG states
      MANIFEST.json     every other file's size and SHA-256, written once all of them are complete
      COMPLETE          written last inside the directory

A role with frozen base weights (a LoRA actor: ``frozen_bases``) writes only what training changes — its
adapters and their optimizer state — and ``base_model.json``, the record of its base
(:func:`klppo.ops.resume_check.base_record`); a resume loads the base from the model path, checked
against the record before any weights load, and the adapters from the checkpoint. A role folder without
the record holds every weight and loads them all.

The directory is written as ``.global_step_N.tmp`` and renamed once every rank has finished, then
``latest_checkpointed_iteration.txt`` (verl's marker) is updated: a crash at any point leaves either the
previous checkpoint or a temporary directory that is never mistaken for a checkpoint. Any failure while
writing (an ``OSError``, torch.distributed.checkpoint's ``CheckpointException``, a failed ``torch.save``)
removes the temporary directory on every rank's say-so and raises :class:`CheckpointError` with one line;
a full disk is named as such, with the free space and the checkpoint's expected size.

Resume (:func:`resolve_resume`) validates a checkpoint before any of it is used: ``COMPLETE``, the
manifest, each file's size and checksum, the files every checkpoint needs. A damaged latest checkpoint is
reported in one line naming the file, and the newest intact older one is used. Only tensors and plain
Python values are ever unpickled (``torch.load(weights_only=True)``; DCP's metadata through
:class:`klppo.parallel.checkpoint.SafeFileSystemReader`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import random
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from klppo.parallel.checkpoint import load_checkpoint as load_model_and_optimizer
from klppo.parallel.checkpoint import save_checkpoint as save_model_and_optimizer
from klppo.parallel.checkpoint import shards_problem
from klppo.parallel.collectives import all_gather_objects, rank, world_size

log = logging.getLogger("klppo")
MARKER = "latest_checkpointed_iteration.txt"
MANIFEST = "MANIFEST.json"
BASE_RECORD = "base_model.json"
"""In a role's folder: the base model its saved adapters apply to (the frozen weights are not saved)."""
_STEP_DIR = re.compile(r"^global_step_(\d+)$")
_LOW_SPACE_BYTES = 16 * 2**20  # less free than this after a failed write: the disk was full


class CheckpointError(RuntimeError):
    pass


def _barrier() -> None:
    if world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------------- RNG
def rng_state() -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (loadable with ``weights_only=True``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        },
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    npy = state["numpy"]
    keys = npy["keys"].numpy().astype(np.uint32)
    np.random.set_state((npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# --------------------------------------------------------------------------------------- discovery
def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """Checkpoints marked complete under ``root``, oldest first (not yet validated)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = _STEP_DIR.match(child.name)
        if m and (child / "COMPLETE").exists():
            found.append((int(m.group(1)), child))
    return sorted(found)


def _marker_step(root: Path) -> int | None:
    try:
        return int((root / MARKER).read_text().strip())
    except (OSError, ValueError):
        return None


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint named by the marker file, else the newest complete one, else None."""
    candidates = _candidates(Path(root))
    return candidates[0] if candidates else None


def _candidates(root: Path) -> list[Path]:
    """Complete checkpoints, the marker's first, then newest to oldest."""
    found = [path for _, path in reversed(list_checkpoints(root))]
    step = _marker_step(root)
    marked = root / f"global_step_{step}"
    if step is not None and marked in found:
        found.remove(marked)
        found.insert(0, marked)
    return found


def checkpoint_step(path: Path) -> int:
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise CheckpointError(f"{path} is not named global_step_N")
    return int(m.group(1))


# ------------------------------------------------------------------------------------------ manifest
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(8 * 2**20), b""):
            h.update(chunk)
    return h.hexdigest()


def _files(directory: Path) -> list[str]:
    skip = {MANIFEST, "COMPLETE"}
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.relative_to(directory).as_posix() not in skip
    )


def write_manifest(directory: Path, step: int) -> dict[str, Any]:
    """Record every file's size and SHA-256 (hashed in parallel) in ``MANIFEST.json``."""
    names = _files(directory)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
        digests = list(pool.map(lambda n: _sha256(directory / n), names))
    manifest = {
        "format": 1,
        "step": step,
        "files": {n: {"size": (directory / n).stat().st_size, "sha256": d} for n, d in zip(names, digests)},
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _required_files(path: Path, roles: list[str] | None) -> list[str]:
    required = ["trainer_state.pt", "rng/rank_0.pt"]
    for role in roles or ["actor"]:
        required.append(f"{role}/.metadata")
    return required


def validate_checkpoint(path: str | Path, *, roles: list[str] | None = None) -> str | None:
    """None if the checkpoint is intact, else one phrase naming the damaged file and what is wrong.

    Checks ``COMPLETE``, the manifest (every listed file present with its size and SHA-256) and the files
    every checkpoint needs (``trainer_state.pt``, rank 0's RNG file, each role's DCP ``.metadata``).
    A checkpoint without a manifest is verified by loading instead (:func:`_verify_by_loading`).
    """
    path = Path(path)
    if not (path / "COMPLETE").is_file():
        return f"{path / 'COMPLETE'} is missing (the save did not finish)"
    manifest_path = path / MANIFEST
    if manifest_path.exists():
        try:
            listed = json.loads(manifest_path.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return f"{manifest_path} is unreadable ({type(exc).__name__})"
        for name, entry in sorted(listed.items()):
            f = path / name
            if not f.is_file():
                return f"{f} is missing"
            size = f.stat().st_size
            if size != entry["size"]:
                return f"{f} has {size} bytes, {entry['size']} were written"
        bad = _first_checksum_mismatch(path, listed)
        if bad is not None:
            return f"{path / bad} does not match its checksum (damaged after the save)"
    for name in _required_files(path, roles):
        f = path / name
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size == 0:
            return f"{f} is empty"
    return None if manifest_path.exists() else _verify_by_loading(path, roles)


def _verify_by_loading(path: Path, roles: list[str] | None) -> str | None:
    """A checkpoint without a manifest, checked by loading what is small and reading what is large: the
    trainer state and every RNG file loaded (tensors and plain values only), each role's DCP metadata read
    and every tensor it lists found within its file's bytes. None when it holds, else one phrase."""
    try:
        load_trainer_state(path)
        for f in sorted((path / "rng").glob("rank_*.pt")):
            _load_small(f)
    except CheckpointError as exc:
        return str(exc).removeprefix("cannot load ")
    for role in roles or ["actor"]:
        problem = shards_problem(path / role)
        if problem is not None:
            return problem
    return None


def _first_checksum_mismatch(path: Path, listed: dict[str, dict[str, Any]]) -> str | None:
    names = sorted(listed)
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(names)))) as pool:
        digests = list(pool.map(lambda n: _sha256(path / n), names))
    for name, digest in zip(names, digests):
        if digest != listed[name]["sha256"]:
            return name
    return None


def checkpoint_bytes(path: Path) -> int | None:
    """Total size recorded in a checkpoint's manifest (None without one)."""
    try:
        files = json.loads((path / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError):
        return None
    return sum(int(e["size"]) for e in files.values())


# ---------------------------------------------------------------------------------------------- save
def _state_bytes(
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]], frozen: dict[str, Any]
) -> int:
    """Bytes of the models' parameters and optimizer states (global sizes: a DTensor counts whole); the
    roles in ``frozen`` count their trained parameters only."""
    total = 0
    for role, (model, optimizer) in models.items():
        params = [p for p in model.parameters() if p.requires_grad or role not in frozen]
        total += sum(p.numel() * p.element_size() for p in params)
        if optimizer is not None:
            for state in optimizer.state.values():
                total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return total


def _agree(stage: str, error: BaseException | None) -> None:
    """Every rank learns whether any rank failed ``stage``; all raise together (no rank left waiting)."""
    reason = None if error is None else f"{type(error).__name__}: {_first_line(error)}"
    reasons = all_gather_objects(reason) if world_size() > 1 else [reason]
    reasons = [r for r in reasons if r is not None]
    if reasons:
        raise _SaveFailed(stage, reasons[0], error)


class _SaveFailed(Exception):
    def __init__(self, stage: str, reason: str, error: BaseException | None) -> None:
        super().__init__(f"{stage}: {reason}")
        self.stage, self.reason, self.error = stage, reason, error


def _first_line(exc: BaseException) -> str:
    if isinstance(exc, CheckpointException):
        for inner, _trace in exc.failures.values():
            return f"{type(inner).__name__}: {_first_line(inner)}"
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _looks_like_full_disk(exc: BaseException | None, reason: str) -> bool:
    seen: list[BaseException] = []
    todo = [exc] if exc is not None else []
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(e, CheckpointException):
            todo += [inner for inner, _ in e.failures.values()]
        todo += [e.__cause__, e.__context__]
    text = " ".join([reason, *(str(e) for e in seen)]).lower()
    return any(s in text for s in ("no space left", "unexpected pos", "file write failed", "disk quota"))


def _step(stage: str, fn, *args) -> None:
    error = None
    try:
        fn(*args)
    except (Exception, CheckpointException) as exc:  # DCP's CheckpointException is a BaseException
        error = exc
    _agree(stage, error)


def save_checkpoint(
    root: str | Path,
    step: int,
    *,
    models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]],
    hf_assets: dict[str, Any],
    trainer_state: dict[str, Any],
    max_to_keep: int | None = None,
    frozen_bases: dict[str, dict[str, Any] | None] | None = None,
) -> Path:
    """Save a checkpoint of step ``step``; collective (every rank calls it). Returns the final path.

    ``hf_assets[role]`` is a callable ``(dir) -> None`` writing that role's HF config/tokenizer (rank 0).
    ``frozen_bases[role]``: a role whose frozen parameters are left out, with the record of its base
    written as ``<role>/base_model.json`` (rank 0's record; the key alone on other ranks).
    Raises :class:`CheckpointError` (on every rank, the partial directory removed) if any rank fails.
    """

    root = Path(root)
    final = root / f"global_step_{step}"
    tmp = root / f".global_step_{step}.tmp"
    previous = latest_checkpoint(root)

    def prepare() -> None:
        if rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
            (tmp / "rng").mkdir()

    frozen = frozen_bases or {}

    def hf(role: str) -> None:
        if rank() == 0 and role in hf_assets:
            hf_assets[role](tmp / role / "huggingface")
        if rank() == 0 and role in frozen:
            (tmp / role / BASE_RECORD).write_text(json.dumps(frozen[role], indent=1) + "\n")

    def state(role: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        save_model_and_optimizer(tmp / role, model, optimizer, trained_only=role in frozen)

    def small_files() -> None:
        torch.save(rng_state(), tmp / "rng" / f"rank_{rank()}.pt")
        if rank() == 0:
            torch.save(trainer_state, tmp / "trainer_state.pt")

    def finish() -> None:
        if rank() == 0:
            write_manifest(tmp, step)
            (tmp / "COMPLETE").write_text(f"{step}\n")
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            _write_marker(root, step)

    try:
        _step("creating the directory", prepare)
        for role, (model, optimizer) in models.items():
            _step(f"writing the {role} state", state, role, model, optimizer)
            _step(f"writing the {role} Hugging Face files", hf, role)
        _step("writing the trainer state and RNG files", small_files)
        _step("finishing", finish)
    except _SaveFailed as failed:
        full = _looks_like_full_disk(failed.error, failed.reason)
        free_before = _free_bytes(root)
        if rank() == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        _barrier()
        full = full or free_before < _LOW_SPACE_BYTES
        expected = (previous and checkpoint_bytes(previous)) or _state_bytes(models, frozen)
        message = _failure_message(root, step, failed, full=full, expected=expected, previous=previous)
        raise CheckpointError(message) from None
    if rank() == 0:
        _prune(root, max_to_keep)
    _barrier()
    return final


def _free_bytes(root: Path) -> int:
    probe = root if root.exists() else root.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return 1 << 62


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _failure_message(
    root: Path, step: int, failed: _SaveFailed, *, full: bool, expected: int, previous: Path | None
) -> str:
    if full:
        what = (
            f"the disk is full ({_gib(_free_bytes(root))} free on {root} after removing the partial "
            f"checkpoint; a checkpoint needs about {_gib(expected)})"
        )
    else:
        what = f"{failed.stage} failed ({failed.reason})"
    kept = (
        f"the previous checkpoint {previous} stays the latest"
        if previous
        else "there is no earlier checkpoint"
    )
    return (
        f"saving checkpoint global_step_{step} under {root}: {what}. The partial directory was removed; "
        f"{kept}. Free space or change trainer.default_local_dir, then run the same command to resume."
    )


def _write_marker(root: Path, step: int) -> None:
    tmp_marker = root / (MARKER + ".tmp")
    tmp_marker.write_text(f"{step}\n")
    os.replace(tmp_marker, root / MARKER)


def _prune(root: Path, max_to_keep: int | None) -> None:
    if not max_to_keep or max_to_keep <= 0:
        return
    for _, path in list_checkpoints(root)[:-max_to_keep]:
        shutil.rmtree(path, ignore_errors=True)


# -------------------------------------------------------------------------------------------- resume
def other_setup(path: Path, roles: list[str] | None) -> str | None:
    """A finished checkpoint without a trained role's state at all was saved by a run of another set-up (a
    GRPO checkpoint resumed with a critic): not damage, and older checkpoints of that run lack it too."""
    manifest = path / MANIFEST
    if not (path / "COMPLETE").is_file():
        return None
    if manifest.is_file():
        try:
            written = list(json.loads(manifest.read_text())["files"])
        except (OSError, ValueError, KeyError, TypeError):
            return None  # validate_checkpoint names an unreadable manifest
    else:  # from before the manifests: judged by its folders only where the actor's is there (else damage)
        if not (path / "actor").is_dir():
            return None
        written = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
    for role in roles or ["actor"]:
        if not any(name.startswith(f"{role}/") for name in written):
            return (
                f"checkpoint {path} holds no {role} state: it was saved by a run without a {role} (another "
                "algorithm.adv_estimator?); resume with that run's settings, or start over with "
                "trainer.resume_mode=disable or another trainer.default_local_dir"
            )
    return None


def _cheap_path_checks(path: Path, roles: list[str] | None) -> None:
    """What ``trainer.resume_from_path`` is, before any checksum: missing, a run directory, another set-up."""
    if not path.exists():
        raise CheckpointError(f"trainer.resume_from_path={path} does not exist")
    inside = [] if (path / "COMPLETE").exists() else _candidates(path)
    if inside:
        raise CheckpointError(
            f"trainer.resume_from_path={path} is a run directory: name one of its checkpoints (the newest: "
            f"{inside[0]}), or set trainer.resume_mode=auto with trainer.default_local_dir={path}"
        )
    other = other_setup(path, roles)
    if other is not None:
        raise CheckpointError(other)


def precheck_resume(mode: str, root: str | Path, resume_from_path: str | None, *, roles: list[str]) -> None:
    """The checks of :func:`resolve_resume` that need no checksums, at start-up before any weights load
    (one process): the path's kind, and whether the checkpoint to resume was saved with these roles."""
    if mode == "resume_path" and resume_from_path:
        _cheap_path_checks(Path(resume_from_path).expanduser(), roles)
    elif mode == "auto":
        candidates = _candidates(Path(root).expanduser())
        other = other_setup(candidates[0], roles) if candidates else None
        if other is not None:
            raise CheckpointError(other)


def _newest_intact(root: Path, roles: list[str] | None) -> Path | None:
    """Rank 0's choice: the newest intact checkpoint, each damaged newer one reported in one line."""
    damaged = []
    for path in _candidates(root):
        other = other_setup(path, roles)
        if other is not None:
            raise CheckpointError(other)
        problem = validate_checkpoint(path, roles=roles)
        if problem is None:
            if damaged:
                log.warning("resuming from the older intact checkpoint %s", path)
            return path
        damaged.append(path)
        log.warning("checkpoint %s is damaged: %s; trying the previous one", path.name, problem)
    if damaged:
        raise CheckpointError(
            f"no intact checkpoint in {root} ({len(damaged)} damaged, named above); move them away or set "
            "trainer.resume_mode=disable to start over"
        )
    return None


def _on_rank0(fn, *args):
    """``fn(*args)`` on rank 0 only; its result (or its CheckpointError) on every rank."""
    result: tuple[str, Any] = ("ok", None)
    if rank() == 0:
        try:
            result = ("ok", fn(*args))
        except CheckpointError as exc:
            result = ("error", str(exc))
    if world_size() > 1:
        result = all_gather_objects(result)[0]
    if result[0] == "error":
        raise CheckpointError(result[1])
    return result[1]


def resolve_resume(
    mode: str, root: str | Path, resume_from_path: str | None, *, roles: list[str] | None = None
) -> Path | None:
    """The checkpoint to resume from under ``trainer.resume_mode`` (auto | disable | resume_path), validated
    (rank 0 checks, every rank gets the same answer). ``roles``: the trained roles whose state must be
    there."""
    root = Path(root)
    if mode == "disable":  # an earlier run's checkpoints there: klppo.ops.run_records decides
        return None
    if mode == "auto":
        return _on_rank0(_newest_intact, root, roles)
    if mode == "resume_path":
        if not resume_from_path:
            raise ValueError("trainer.resume_mode=resume_path needs trainer.resume_from_path")
        path = Path(resume_from_path).expanduser()

        def check() -> Path:
            _cheap_path_checks(path, roles)
            problem = validate_checkpoint(path, roles=roles)
            if problem is not None:
                raise CheckpointError(f"trainer.resume_from_path={path} is damaged: {problem}")
            return path

        return _on_rank0(check)
    raise ValueError(f"trainer.resume_mode={mode!r}: expected auto, disable or resume_path")


def _load_small(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:  # torch's message advises weights_only=False: never for a checkpoint
        raise CheckpointError(
            f"cannot load {path}: it holds something other than tensors and plain values (damaged, or not "
            "written by klppo); it is not unpickled"
        ) from None
    except Exception as exc:  # a truncated file, …: one line naming the file
        raise CheckpointError(f"cannot load {path}: {_first_line(exc)}") from None


def load_trainer_state(path: str | Path) -> dict[str, Any]:
    """``trainer_state.pt`` of checkpoint ``path`` (tensors and plain values only), before any weights."""
    state = _load_small(Path(path) / "trainer_state.pt")
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{Path(path) / 'trainer_state.pt'} holds a {type(state).__name__}, not a mapping"
        )
    return state


def load_checkpoint(
    path: str | Path, *, models: dict[str, tuple[torch.nn.Module, torch.optim.Optimizer]]
) -> dict[str, Any]:
    """Load model/optimizer states in place and return the trainer state; restores this rank's RNG.

    The trainer state and RNG files are read first (so a bad one is reported before the large loads);
    every failure is a one-line :class:`CheckpointError` naming the file or role directory.
    """

    path = Path(path)
    if not (path / "COMPLETE").exists():
        raise CheckpointError(f"{path} is not a complete klppo checkpoint (no COMPLETE file)")
    state = _load_small(path / "trainer_state.pt")
    rng_file = path / "rng" / f"rank_{rank()}.pt"
    rng = _load_small(rng_file) if rng_file.exists() else None
    for role, (model, optimizer) in models.items():
        load_role(path / role, model, optimizer)
    if rng is not None:
        set_rng_state(rng)
    return state


def read_base_record(role_dir: str | Path) -> dict[str, Any] | None:
    """The base model a role folder's adapters apply to (``base_model.json``); None for a folder that
    holds every weight (no record)."""
    path = Path(role_dir) / BASE_RECORD
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {_first_line(exc)}") from None
    if not isinstance(record, dict):
        raise CheckpointError(f"{path} holds a {type(record).__name__}, not a mapping")
    return record


def load_role(role_dir: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """One role's model and optimizer state loaded in place: with a base record, the trained parameters
    only (the frozen base is the model's own, loaded from its path); else every weight. Collective."""
    role_dir = Path(role_dir)
    if not role_dir.exists():
        raise CheckpointError(f"checkpoint {role_dir.parent} has no {role_dir.name!r} state")
    trained_only = read_base_record(role_dir) is not None
    try:
        load_model_and_optimizer(role_dir, model, optimizer, trained_only=trained_only)
    except (Exception, CheckpointException) as exc:
        raise CheckpointError(f"cannot load {role_dir}: {_first_line(exc)}") from None
