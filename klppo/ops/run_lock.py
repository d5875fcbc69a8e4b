"""One trainer per run directory: ``<run_dir>/.klppo.lock`` holds the owner's host, PID and process start
time while a `klppo train` runs there.

The lock is created atomically (``O_CREAT | O_EXCL``). A second trainer finding it refuses to start with
one line naming the owner. A lock whose owner is gone is *stale* and is replaced (with a warning): on the
same host, the PID no longer runs, or runs a different process (another start time: the PID was reused).
A lock from another host cannot be checked from here; it is refused, and the message says to delete the
file if that process is gone. Held by the launching process (`klppo train`), which the ranks it starts
inherit (``KLPPO_RUN_LOCK_HELD``); under an external launcher (torchrun, srun) global rank 0 takes it.

A launcher's death alone does not prove its run dead: every rank records its own process in
``<run_dir>/.klppo.ranks/<host>-<pid>.json`` (:func:`register_rank`: host, PID, start time, rank). A lock
is taken only when no recorded process of the run still runs; one that does is named in the refusal (one
on another host, which cannot be checked from here, too, with the file to delete if it is gone). The
records are removed with the lock.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from klppo.parallel.dist import under_launcher

log = logging.getLogger("klppo")
LOCK_NAME = ".klppo.lock"
RANKS_DIR = ".klppo.ranks"
HELD_ENV = "KLPPO_RUN_LOCK_HELD"


class RunLockError(RuntimeError):
    """Another trainer holds the run directory."""


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux ``/proc``), None elsewhere."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _owner_alive(owner: dict) -> bool | None:
    """True/False for an owner on this host; None when it cannot be known (another host)."""
    if owner.get("host") != socket.gethostname():
        return None
    pid = int(owner.get("pid", -1))
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # runs, as another user
    started = owner.get("start_time")
    return started is None or _start_time(pid) in (None, started)


def _process_record(**extra) -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start_time": _start_time(os.getpid()), **extra}


def register_rank(run_dir: str | Path, rank: int) -> Path:
    """Record this rank's process in the run directory (module docstring); returns the record's path."""
    folder = Path(run_dir) / RANKS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{socket.gethostname()}-{os.getpid()}.json"
    path.write_text(json.dumps(_process_record(rank=rank)))
    return path


def live_ranks(run_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(recorded processes still running on this host, those on other hosts) of the run in ``run_dir``;
    records of processes that ended are removed."""
    running, unknown = [], []
    for path in sorted((Path(run_dir) / RANKS_DIR).glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if record.get("pid") == os.getpid() and record.get("host") == socket.gethostname():
            continue  # this process (a rank 0 that takes the lock after registering)
        alive = _owner_alive(record)
        if alive is None:
            unknown.append(record)
        elif alive:
            running.append(record)
        else:
            path.unlink(missing_ok=True)
    return running, unknown


def _refuse_live_ranks(run_dir: Path) -> None:
    running, unknown = live_ranks(run_dir)
    if running:
        pids = ", ".join(f"{r.get('pid')} (rank {r.get('rank')})" for r in running)
        raise RunLockError(
            f"{run_dir} is in use: processes of an earlier trainer still run there (PID {pids}), though its "
            "launcher is gone; stop them first (kill PID), or choose another trainer.default_local_dir"
        )
    if unknown:
        who = ", ".join(f"{r.get('host')} PID {r.get('pid')}" for r in unknown)
        raise RunLockError(
            f"{run_dir} may be in use by ranks on other machines ({who}); if they are gone, delete "
            f"{run_dir / RANKS_DIR}"
        )


class RunLock:
    """The lock on ``run_dir``; :meth:`release` removes it if it is still ours. A context manager."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.owner = _process_record(since=time.strftime("%Y-%m-%d %H:%M:%S %Z"))
        self.held = False

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                self._handle_existing()
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
            self.held = True
            try:
                _refuse_live_ranks(self.path.parent)
            except RunLockError:
                self.release()
                raise
            return self
        raise RunLockError(f"could not take {self.path}: another trainer keeps creating it")

    def _handle_existing(self) -> None:
        try:
            owner = json.loads(self.path.read_text())
        except FileNotFoundError:
            return  # released meanwhile: try again
        except (OSError, ValueError):
            if time.time() - self.path.stat().st_mtime < 10:  # being written right now
                time.sleep(0.5)
                return
            owner = {}
        alive = _owner_alive(owner) if owner else False
        who = f"host {owner.get('host')}, PID {owner.get('pid')}, since {owner.get('since')}"
        if alive:
            raise RunLockError(
                f"{self.path.parent} is in use by another trainer ({who}); stop it first, or choose another "
                "trainer.default_local_dir"
            )
        if alive is None:
            raise RunLockError(
                f"{self.path.parent} is locked by a trainer on another machine ({who}); if that process is "
                f"gone, delete {self.path}"
            )
        _refuse_live_ranks(self.path.parent)  # the launcher is gone: are its ranks?
        log.warning("removing the stale lock %s (%s; that process is gone)", self.path, who)
        self.path.unlink(missing_ok=True)

    def release(self) -> None:
        if not self.held:
            return
        self.held = False
        try:
            if json.loads(self.path.read_text()).get("pid") == self.owner["pid"]:
                shutil.rmtree(self.path.parent / RANKS_DIR, ignore_errors=True)
                self.path.unlink()
        except (OSError, ValueError):
            pass

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def should_lock(nnodes: int) -> bool:
    """Whether this process takes the lock: not a rank our launcher started (it holds it), and only one
    process per job (node 0's launcher, or global rank 0 under an external launcher)."""
    if os.environ.get(HELD_ENV) == "1":
        return False
    if under_launcher():  # torchrun / srun started by someone else: global rank 0
        return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"
    return nnodes == 1 or os.environ.get("NODE_RANK", "0") == "0"
