"""Start K processes per node through torchrun, or run as-is when a launcher already did.

Usage in an entry point (the child runs the same module with the same arguments)::

    @record_errors def main(argv):
        code = maybe_relaunch(argv, nproc_per_node=K, nnodes=M, module="klppo.cli")
        if code is not None:
            return code
        ...  # every rank runs from here

A failing rank's traceback is shown once: :func:`record_errors` writes it to torchrun's error file
(``TORCHELASTIC_ERROR_FILE``) instead of the console, torchrun prints it in its failure summary, and
only local rank 0's console output is shown (``--local-ranks-filter 0``) unless ``show_all_ranks``.
torchrun then stops the other ranks and exits non-zero, which :func:`maybe_relaunch` returns.

Signals (:func:`supervise`): torchrun runs in its own session, so a terminal's Ctrl-C reaches only the
launching process, as ``kill PID``, ``docker stop`` and systemd do. The first SIGTERM/SIGINT creates the
*stop file* named in the ranks' environment (``KLPPO_STOP_FILE``): the ranks see it at the end of their
step, agree to stop, save a checkpoint and exit 0, and so does the launcher. If they have not finished
within ``stop_grace_s`` (or on a second signal), torchrun is sent SIGTERM (it signals the ranks and kills
them after its own 30 s), and whatever still runs 45 s later is killed: no process outlives the launcher.
"""

from __future__ import annotations

import ctypes
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ErrorHandler
from torch.distributed.run import parse_args, run

from klppo.parallel.dist import CollectiveTimeoutError, free_port, under_launcher

T = TypeVar("T")
STOP_FILE_ENV = "KLPPO_STOP_FILE"
LAUNCHER_PID_ENV = "KLPPO_LAUNCHER_PID"  # torchrun dies with this process (`klppo train`)
TORCHRUN_PID_ENV = "KLPPO_TORCHRUN_PID"  # the ranks die with this process (torchrun)
_TORCHRUN_SHUTDOWN_S = 30  # torchrun's wait between SIGTERM and SIGKILL of the ranks


def die_with_parent(parent: int) -> None:
    """End this process when ``parent`` (its parent now) ends: the kernel's SIGKILL on Linux
    (``prctl(PR_SET_PDEATHSIG)``), elsewhere a thread that polls; at once if ``parent`` is already gone."""
    armed = False
    if sys.platform.startswith("linux"):
        try:
            armed = (
                ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) == 0
            )  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            armed = False
    if os.getppid() != parent:  # it ended before the line above took effect
        os._exit(1)
    if not armed:
        threading.Thread(target=_exit_when_orphaned, args=(parent,), daemon=True).start()


def _exit_when_orphaned(parent: int, poll_s: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    os._exit(1)


def rank_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` for torchrun and the ranks: they import the klppo this process runs (its directory first on
    ``PYTHONPATH``), never a ``klppo`` folder of the working directory (``PYTHONSAFEPATH``: the working
    directory is not put first on ``sys.path``; it stays importable, last on ``PYTHONPATH``)."""
    import klppo  # noqa: PLC0415  the package's own location (its __init__ is loaded already)

    root = str(Path(klppo.__file__).resolve().parents[1])
    paths = [root, *[p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p], os.getcwd()]
    return {**env, "PYTHONSAFEPATH": "1", "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}


def _visible_gpu_ids() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [x for x in env.split(",") if x.strip()]

    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


def torchrun_command(
    argv: list[str], *, nproc_per_node: int, nnodes: int, module: str, show_all_ranks: bool = False
) -> list[str]:
    """The ``python -m klppo.parallel.launch ... -m module argv`` command line (torchrun's arguments;
    ``klppo.parallel.launch`` runs torchrun and prints its failure summary without the launcher's own
    traceback).

    ``nnodes`` > 1 needs ``MASTER_ADDR`` (reachable address of node 0) and ``NODE_RANK`` in the
    environment of every node; ``MASTER_PORT`` defaults to 29500.
    """
    cmd = [sys.executable, "-m", "klppo.parallel.launch", f"--nproc-per-node={nproc_per_node}"]
    if nnodes == 1:
        cmd += ["--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}"]
    else:
        missing = [k for k in ("MASTER_ADDR", "NODE_RANK") if k not in os.environ]
        if missing:
            raise ValueError(
                f"nnodes={nnodes}: set {' and '.join(missing)} on every node (or start the job with "
                "torchrun / srun yourself; see docs/distributed.md)"
            )
        cmd += [
            f"--nnodes={nnodes}",
            f"--node-rank={os.environ['NODE_RANK']}",
            f"--master-addr={os.environ['MASTER_ADDR']}",
            f"--master-port={os.environ.get('MASTER_PORT', '29500')}",
        ]
    if not show_all_ranks:
        cmd.append("--local-ranks-filter=0")
    return cmd + ["-m", module, *argv]


def maybe_relaunch(
    argv: list[str],
    *,
    nproc_per_node: int,
    nnodes: int,
    module: str,
    use_gpus: bool | None = None,
    show_all_ranks: bool = False,
    stop_grace_s: float = 600.0,
) -> int | None:
    """Re-exec under torchrun when more than one process is asked for and no launcher started us.

    Returns torchrun's exit code (non-zero when any rank failed), or None when the caller should run
    in this process: one process in all, or already under torchrun / a multi-task SLURM step. With
    ``use_gpus`` (default: CUDA available) and K below the visible GPUs, the first K are used
    (``CUDA_VISIBLE_DEVICES``). Signals are handled as :func:`supervise` says.
    """
    if nproc_per_node < 1 or nnodes < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node} and nnodes={nnodes} must be >= 1")
    if under_launcher() and os.environ.get(TORCHRUN_PID_ENV):  # a rank that `klppo train` started
        die_with_parent(int(os.environ[TORCHRUN_PID_ENV]))
    if nproc_per_node * nnodes == 1 or under_launcher():
        return None
    env = dict(os.environ)
    gpus = _visible_gpu_ids() if use_gpus is not False else []
    if use_gpus and len(gpus) < nproc_per_node:
        raise ValueError(f"n_gpus_per_node={nproc_per_node} but only {len(gpus)} GPUs are visible")
    if gpus and nproc_per_node < len(gpus):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[:nproc_per_node])
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = torchrun_command(
        argv, nproc_per_node=nproc_per_node, nnodes=nnodes, module=module, show_all_ranks=show_all_ranks
    )
    return supervise(cmd, env=rank_environment(env), stop_grace_s=stop_grace_s)


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (Linux ``/proc``; empty elsewhere)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _kill_tree(proc: subprocess.Popen) -> None:
    for pid in [*_children(proc.pid), proc.pid]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def supervise(cmd: list[str], *, env: dict[str, str], stop_grace_s: float) -> int:
    """Run ``cmd`` (torchrun) in its own session and return its exit code; SIGTERM/SIGINT to this process
    ask the ranks to stop through the stop file, bounded by ``stop_grace_s`` (module docstring)."""
    stop_dir = Path(tempfile.mkdtemp(prefix="klppo-stop-"))
    stop_file = stop_dir / "stop"
    env = {**env, STOP_FILE_ENV: str(stop_file), LAUNCHER_PID_ENV: str(os.getpid())}
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    state: dict[str, float | int | None] = {"signals": 0, "deadline": None}

    def on_signal(signum, _frame):
        state["signals"] = int(state["signals"] or 0) + 1
        if state["signals"] == 1:
            stop_file.touch()
            state["deadline"] = time.monotonic() + stop_grace_s
            print(
                f"klppo: received {signal.Signals(signum).name}: the ranks finish their step and save a "
                "checkpoint "
                f"(waiting up to {stop_grace_s:g} s, trainer.stop_grace_s; send again to stop them now)",
                file=sys.stderr,
            )
        else:
            state["deadline"] = time.monotonic()

    previous = {}
    try:
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, on_signal)
    except ValueError:  # not the main thread: no handlers, the caller handles signals
        pass
    try:
        return _wait(proc, state)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if proc.poll() is None:
            _kill_tree(proc)
        shutil.rmtree(stop_dir, ignore_errors=True)


def _wait(proc: subprocess.Popen, state: dict) -> int:
    killed_at = None
    while True:
        try:
            return proc.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
        deadline = state["deadline"]
        if deadline is None or time.monotonic() < deadline:
            continue
        if killed_at is None:
            print(
                "klppo: the ranks did not stop in time; stopping them (the last completed checkpoint stays)",
                file=sys.stderr,
            )
            proc.send_signal(signal.SIGTERM)  # torchrun signals the ranks, SIGKILLs them after its 30 s
            killed_at = time.monotonic()
        elif time.monotonic() - killed_at > _TORCHRUN_SHUTDOWN_S + 15:
            _kill_tree(proc)
            return 128 + signal.SIGKILL


def record_errors(fn: Callable[..., T]) -> Callable[..., T | int]:
    """Decorate a rank's entry point: under torchrun an escaping exception is written to the error
    file (torchrun shows it once, as the root cause) and the process exits 1 without printing it;
    outside torchrun the exception propagates unchanged."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if "TORCHELASTIC_ERROR_FILE" not in os.environ:
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except SystemExit:
            raise
        except BaseException as e:
            if isinstance(e, CollectiveTimeoutError):  # a consequence: keep its message, not a 2nd traceback
                _write_error_file(e, f"{type(e).__name__}: {e}")
            else:
                ErrorHandler().record_exception(e)
            rank = os.environ.get("RANK", "?")
            print(
                f"[rank {rank}] failed: {type(e).__name__} (traceback in torchrun's summary)", file=sys.stderr
            )
            return 1

    return wrapper


def _write_error_file(e: BaseException, callstack: str) -> None:
    data = {
        "message": {
            "message": f"{type(e).__name__}: {e}",
            "extraInfo": {"py_callstack": callstack, "timestamp": str(int(time.time()))},
        }
    }
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as f:
        json.dump(data, f)


def failure_line(error: ChildFailedError) -> tuple[str, int]:
    """(one line, exit code) for a failed torchrun job: the first failure a rank reported through
    ``klppo.ops.failures`` that is not a consequence of another (a peer gone from a collective), else the
    first failure torchrun saw (its message, or the exit code or signal)."""
    reported = []
    for failure in error.failures.values():
        message = failure.error_file_data.get("message")
        extra = message.get("extraInfo", {}) if isinstance(message, dict) else {}
        if isinstance(extra.get("klppo"), dict):
            reported.append(
                (extra["klppo"].get("consequence", False), extra["klppo"]["time"], extra["klppo"])
            )
    if reported:
        first = min(reported, key=lambda r: (r[0], r[1]))[2]
        return f"klppo: {first['line']}", int(first["code"])
    if any(
        f.error_file_data.get("message") for f in error.failures.values()
    ):  # record_errors: traceback once
        return error.format_msg(), 1
    global_rank, failure = min(error.failures.items(), key=lambda kv: kv[1].timestamp)
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    if failure.exitcode < 0:
        what = f"was killed by {failure.signal_name()}"
    else:
        what = f"exited with code {failure.exitcode}"
    detail = "" if not message or "To enable traceback" in message else f": {str(message).splitlines()[0]}"
    return f"klppo: rank {global_rank} {what}{detail}", failure.exitcode if failure.exitcode > 0 else 1


def _torchrun_main() -> int:
    """torchrun, ending with the launcher (``KLPPO_LAUNCHER_PID``) and its ranks with it; a failure is one
    line (:func:`failure_line`), no launcher traceback."""
    if os.environ.get(LAUNCHER_PID_ENV):
        die_with_parent(int(os.environ[LAUNCHER_PID_ENV]))
    os.environ[TORCHRUN_PID_ENV] = str(os.getpid())
    try:
        run(parse_args(sys.argv[1:]))
    except ChildFailedError as e:
        line, code = failure_line(e)
        print(line, file=sys.stderr)
        return code
    except SignalException as e:  # torchrun itself was signalled (by `klppo train` past its grace period)
        print(
            f"klppo: torchrun stopped by signal {int(e.sigval)}; the ranks were signalled and killed after "
            f"{_TORCHRUN_SHUTDOWN_S} s; the last completed checkpoint stays; run the same command to resume.",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(_torchrun_main())
