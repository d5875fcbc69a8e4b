"""How a rank ends on a failure: one line for the user, the traceback in the run directory, an exit code.

:func:`report_failure` writes the full traceback to ``<run dir>/logs/rank<R>.log`` (appended, with the
time), and the one line — ``klppo: rank R: <message> (traceback: <log>)`` — to stderr in one process, or
under torchrun to the rank's error file, from which the `klppo train` launcher prints the first failure's
line (``klppo.parallel.launch``: only local rank 0's console is shown, so a failure on rank 1 is seen
there). Exit codes (:data:`EXIT_CODES`, also in docs/training.md):
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from klppo.config import ConfigError
from klppo.data import DataError
from klppo.ops.resume_check import ResumeMismatchError
from klppo.ops.run_lock import RunLockError
from klppo.ops.run_records import RunExistsError
from klppo.parallel.dist import CollectiveTimeoutError
from klppo.roles.reward_limit import RewardTimeoutError
from klppo.tracking.run_dir import RunDirError

EXIT_CODES = {
    0: "the run finished, or stopped on a signal after saving a checkpoint",
    1: "training failed (a reward function raised, a checkpoint could not be saved or loaded, out of memory, "
    "too many non-finite steps, any other error: the traceback is in <run dir>/logs/rank<R>.log)",
    2: "refused before training: configuration, data, run directory (lock, an earlier run, files klppo did "
    "not create), a resume that would change the run",
    3: "a batch's scoring ran past reward_model.timeout_s",
    75: "a rank waited in one collective past trainer.collective_timeout_s (ended by the phase watch)",
    130: "interrupted by a second signal: the last completed checkpoint stays",
}
__doc__ += "".join(f"\n- ``{code}``: {meaning}." for code, meaning in EXIT_CODES.items()) + "\n"

REFUSED = (ConfigError, DataError, RunDirError, RunExistsError, ResumeMismatchError, RunLockError)
LOG_DIR = "logs"


def exit_code(exc: BaseException) -> int:
    """The documented exit code of a rank that ends on ``exc``."""
    if isinstance(exc, KeyboardInterrupt):
        return 130
    if isinstance(exc, RewardTimeoutError):
        return 3
    if isinstance(exc, REFUSED):
        return 2
    return 1


def one_line(exc: BaseException) -> str:
    """klppo's own errors by their message (written for users), others with their type; the first line."""
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted by a second signal; the last completed checkpoint stays"
    text = (str(exc).strip().splitlines() or [""])[0]
    if type(exc).__module__.startswith("klppo.") and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def rank_log(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / LOG_DIR / f"rank{rank}.log"


def _write_log(path: Path, exc: BaseException) -> Path | None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S %Z')} pid {os.getpid()}\n")
            f.write("".join(traceback.format_exception(exc)))
        return path
    except OSError:  # a full or read-only disk: the line still goes out
        return None


def report_failure(exc: BaseException, *, run_dir: str | Path, rank: int, world_size: int) -> int:
    """Log ``exc``'s traceback, say its one line (module docstring; naming the rank when there are
    several) and return the exit code."""
    code = exit_code(exc)
    log = _write_log(rank_log(run_dir, rank), exc)
    where = "" if world_size == 1 else f"rank {rank}: "
    text = one_line(exc)
    line = f"{where}{text.removeprefix(where)}" + (f" (traceback: {log})" if log is not None else "")
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        consequence = isinstance(exc, CollectiveTimeoutError) or "gloo" in text or "NCCL" in text
        _write_error_file(error_file, line, code=code, consequence=consequence)
    else:
        print(f"klppo: {line}", file=sys.stderr, flush=True)
    return code


def _write_error_file(path: str, line: str, *, code: int, consequence: bool) -> None:
    """torchrun's per-rank error file, read by the launcher (``klppo.parallel.launch.failure_line``)."""
    data = {
        "message": {
            "message": line,
            "extraInfo": {
                "py_callstack": line,
                "timestamp": str(int(time.time())),
                "klppo": {"line": line, "code": code, "consequence": consequence, "time": time.time()},
            },
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        print(f"klppo: {line}", file=sys.stderr, flush=True)
