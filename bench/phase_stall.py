"""A rank stalled on purpose (issue 21): does every rank's output name the phase, under NCCL as under gloo?

Two ranks; rank 1 sleeps in phase ``step > gen`` for ``--stall`` seconds while rank 0 waits in an
all-reduce inside ``step > gather_samples``; the collective timeout is ``--timeout`` seconds. Under gloo
rank 0 gets a ``CollectiveTimeoutError`` naming its phase; under NCCL the watchdog aborts the waiting
process instead (no Python exception), so what names the phases there is klppo's phase watch (a line at
80% of the timeout) and the ``faulthandler`` stacks on the abort. Prints each rank's exit code, the lines
that name a phase and each rank's last lines; writes them to ``--out`` as JSON — also when the ranks are
still running after ``--max-wall`` seconds (then killed; ``killed_at_max_wall`` says so).

    PYTHONPATH=$PWD python3 bench/phase_stall.py --device cuda --out $OUT/stall.json
    PYTHONPATH=$PWD python3 bench/phase_stall.py --device cpu --timeout 2 --stall 5 --out /tmp/stall.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = """
import os, sys, time
import torch, torch.distributed as dist
from klppo.parallel.dist import CollectiveTimeoutError, init_distributed, phase
device, timeout_s, stall_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
info = init_distributed(device, timeout_s=timeout_s)
try:
    with phase("step"):
        if info.rank == 1:
            with phase("gen"):
                time.sleep(stall_s)
        else:
            with phase("gather_samples"):
                t = torch.ones(1, device=info.device)
                dist.all_reduce(t)
                if t.is_cuda:
                    torch.cuda.synchronize()
    print("no timeout", file=sys.stderr, flush=True)
except CollectiveTimeoutError as e:
    print("ERROR", e, file=sys.stderr, flush=True)
    os._exit(3)  # no interpreter teardown: the failed collective's work is still pending
"""

KEYS = ("phase", "Watchdog", "timed out", "Timeout", "ERROR", "Fatal Python error", "line")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--timeout", type=float, default=20.0, help="collective timeout, seconds")
    p.add_argument("--stall", type=float, default=45.0, help="seconds rank 1 sleeps in 'gen'")
    p.add_argument("--max-wall", type=float, default=120.0, help="kill the ranks after this many seconds")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="klppo-stall-"))  # worker and rank logs: only the JSON goes to --out
    worker, logs = work / "stall_worker.py", work / "logs"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    worker.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--redirects", "2",
           "--log-dir", str(logs), str(worker), args.device, str(args.timeout), str(args.stall)]  # fmt: skip
    start = time.monotonic()
    exit_code, tail = _run_ranks(cmd, args.max_wall)
    wall = time.monotonic() - start
    ranks = {}
    for err in sorted(logs.rglob("stderr.log")):
        rank = err.parent.name
        lines = err.read_text(errors="replace").splitlines()
        # the lines naming a phase or the abort, and the last lines whatever they say (a hang shows there)
        ranks[rank] = {"named": [ln for ln in lines if any(k in ln for k in KEYS)][:40], "last": lines[-8:]}
    result = {"device": args.device, "timeout_s": args.timeout, "stall_s": args.stall, "wall_s": round(wall, 1),
              "torchrun_exit": exit_code, "killed_at_max_wall": exit_code is None, "ranks": ranks,
              "torchrun_tail": tail[-3000:]}  # fmt: skip
    args.out.write_text(json.dumps(result, indent=1))
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))


def _run_ranks(cmd: list[str], max_wall: float) -> tuple[int | None, str]:
    """torchrun's exit code and stderr; after ``max_wall`` seconds its whole process group is killed (exit
    code None) so that the logs written so far are still read and reported."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env=os.environ.copy(), start_new_session=True)  # fmt: skip
    try:
        _, err = proc.communicate(timeout=max_wall)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err


if __name__ == "__main__":
    main()
