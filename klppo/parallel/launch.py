"""Start K processes per node through torchrun, or run as-is when a launcher already did.

Usage in an entry point (the child runs the same module with the same arguments)::

    @record_errors
    def main(argv):
        code = maybe_relaunch(argv, nproc_per_node=K, nnodes=M, module="klppo.cli")
        if code is not None:
            return code
        ...  # every rank runs from here

A failing rank's traceback is shown once: :func:`record_errors` writes it to torchrun's error file
(``TORCHELASTIC_ERROR_FILE``) instead of the console, torchrun prints it in its failure summary, and
only local rank 0's console output is shown (``--local-ranks-filter 0``) unless ``show_all_ranks``.
torchrun then stops the other ranks and exits non-zero, which :func:`maybe_relaunch` returns.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from klppo.parallel.dist import CollectiveTimeoutError, free_port, under_launcher

T = TypeVar("T")


def _visible_gpu_ids() -> list[str]:
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [x for x in env.split(",") if x.strip()]
    import torch

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
) -> int | None:
    """Re-exec under torchrun when more than one process is asked for and no launcher started us.

    Returns torchrun's exit code (non-zero when any rank failed), or None when the caller should run
    in this process: one process in all, or already under torchrun / a multi-task SLURM step. With
    ``use_gpus`` (default: CUDA available) and K below the visible GPUs, the first K are used
    (``CUDA_VISIBLE_DEVICES``).
    """
    if nproc_per_node < 1 or nnodes < 1:
        raise ValueError(f"nproc_per_node={nproc_per_node} and nnodes={nnodes} must be >= 1")
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
    return subprocess.call(cmd, env=env)


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


def _torchrun_main() -> int:
    """torchrun with its failure summary (root cause traceback) printed once, no launcher traceback."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    try:
        run(parse_args(sys.argv[1:]))
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr)
        return 1
    except SignalException as e:  # the launcher itself was signalled (preemption, docker stop, Ctrl-C)
        print(
            f"klppo: stopped by signal {int(e.sigval)}; the ranks were told to finish their step and save a "
            "checkpoint (within torchrun's grace period); run the same command to resume.",
            file=sys.stderr,
        )
        return 128 + int(e.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(_torchrun_main())
