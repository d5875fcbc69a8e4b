"""A rank stalled on purpose: does the job end, on time, with every rank's phase named?

Two ranks under torchrun; rank 1 sleeps in phase ``step > gen`` for ``--stall`` seconds and never joins the
collective that rank 0 waits in, inside ``step > gather_samples``; the collective timeout is ``--timeout``
seconds. Scenarios (``--scenario``, default all three, one torchrun each):

- ``cold``: rank 0's all-reduce is the first collective on the communicator. Under NCCL the call itself
  blocks (the communicator connects to its peers there), before NCCL's watchdog knows of it: only klppo's
  phase watch can end it (at the timeout + ``stall_grace_s``, exit code 75). Under gloo: the
  ``CollectiveTimeoutError`` at the timeout (the worker exits 3).
- ``warm``: both ranks first complete one all-reduce, so rank 0's next one is launched on the GPU and its
  thread waits in ``torch.cuda.synchronize``: NCCL's watchdog's case (it logs the timeout at the timeout,
  pauses for its flight-recorder dump — 4 x ``TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC``, a minute by default in
  recent torch — then aborts: SIGABRT, the stacks from ``faulthandler``). Under gloo as ``cold``.
- ``watch``: rank 0 waits in a barrier of a group whose own timeout is 10x ``--timeout``: only klppo's
  watch ends it, on CPU as on GPU (exit code 75).

For each scenario: per rank, the exit code and the time it exited (seconds since the launch; a rank
killed by torchrun's SIGKILL leaves no record), the time rank 0 entered the collective, the lines that name
a phase or the abort and the last lines; torchrun's exit code and wall time; ``ended_within_bound``
(the job ended within timeout + grace + 45 s of rank 0 entering the collective; for ``warm`` + 75 s more,
the watchdog's pause) and ``phases_named``
(rank 0's output names 'gather_samples' and rank 1's names 'gen'). Ranks still running after
``--max-wall`` seconds are killed (``killed_at_max_wall``). Writes everything to ``--out`` as JSON.

    PYTHONPATH=$PWD python3 bench/phase_stall.py --device cuda --out $OUT/stall.json
    PYTHONPATH=$PWD python3 bench/phase_stall.py --device cpu --timeout 2 --stall 15 --out /tmp/stall.json
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

from klppo.parallel.dist import COLLECTIVE_STALL_EXIT, stall_grace_s

SCENARIOS = ("cold", "warm", "watch")

WORKER = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from klppo.parallel.dist import CollectiveTimeoutError, init_distributed, phase
device, timeout_s, stall_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
scenario = sys.argv[4] if len(sys.argv) > 4 else "cold"
t0 = float(os.environ.get("KLPPO_STALL_T0", time.time()))
info = init_distributed(device, timeout_s=timeout_s)
group = dist.new_group(timeout=timedelta(seconds=10 * timeout_s)) if scenario == "watch" else None
if scenario == "warm":  # one completed all-reduce: the communicator's connections exist
    w = torch.ones(1, device=info.device)
    dist.all_reduce(w)
    if w.is_cuda:
        torch.cuda.synchronize()
try:
    with phase("step"):
        if info.rank == 1:
            with phase("gen"):
                time.sleep(stall_s)
        else:
            with phase("gather_samples"):
                print(
                    f"klppo-stall: rank 0 enters the collective at {time.time() - t0:.1f} s",
                    file=sys.stderr,
                      flush=True)
                if scenario == "watch":
                    dist.barrier(group=group)
                else:
                    t = torch.ones(1, device=info.device)
                    dist.all_reduce(t)
                    if t.is_cuda:
                        torch.cuda.synchronize()
    print("no timeout", file=sys.stderr, flush=True)
except CollectiveTimeoutError as e:
    print("ERROR", e, file=sys.stderr, flush=True)
    os._exit(3)  # no interpreter teardown: the failed collective's work is still pending
"""

# torchrun starts this per rank: it runs the worker and records the worker's exit code and time (torchrun's
# SIGTERM/SIGKILL go to the whole process group, the worker included)
RANK_WRAPPER = """
import json, os, signal, subprocess, sys, time
t0 = float(os.environ["KLPPO_STALL_T0"])
child = subprocess.Popen([sys.executable] + sys.argv[2:])
signals = []
def on_signal(signum, _frame):
    signals.append([signal.Signals(signum).name, round(time.time() - t0, 1)])
for s in (signal.SIGTERM, signal.SIGINT):
    signal.signal(s, on_signal)
code = child.wait()
record = {"exit_code": code, "exit_s": round(time.time() - t0, 1), "signals_to_wrapper": signals}
with open(os.path.join(sys.argv[1], os.environ["RANK"] + ".json"), "w") as f:
    json.dump(record, f)
sys.exit(code if code >= 0 else 128 - code)
"""

KEYS = (
    "phase",
    "Watchdog",
    "timed out",
    "Timeout",
    "ERROR",
    "Fatal Python error",
    "klppo:",
    "klppo-stall",
    "exit code",
)
STACK_START = ("Python stacks of every thread", "Fatal Python error")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--scenario", default="all", choices=("all", *SCENARIOS))
    p.add_argument("--timeout", type=float, default=20.0, help="collective timeout, seconds")
    p.add_argument("--stall", type=float, default=45.0, help="seconds rank 1 sleeps in 'gen'")
    p.add_argument(
        "--max-wall", type=float, default=150.0, help="kill a scenario's ranks after this many seconds"
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    scenarios = SCENARIOS if args.scenario == "all" else (args.scenario,)
    result = {
        "device": args.device,
        "timeout_s": args.timeout,
        "stall_s": args.stall,
        "grace_s": stall_grace_s(args.timeout),
        "stall_exit_code": COLLECTIVE_STALL_EXIT,
        "scenarios": {},
    }
    for scenario in scenarios:
        result["scenarios"][scenario] = run_scenario(args, scenario)
        args.out.write_text(json.dumps(result, indent=1))  # also what is done when a later one hangs
    print(json.dumps(result, indent=1))


def run_scenario(args: argparse.Namespace, scenario: str) -> dict:
    work = Path(tempfile.mkdtemp(prefix="klppo-stall-"))  # worker and rank logs: only the JSON goes to --out
    worker, wrapper, logs, exits = (
        work / "stall_worker.py",
        work / "rank_wrapper.py",
        work / "logs",
        work / "exits",
    )
    worker.write_text(WORKER)
    wrapper.write_text(RANK_WRAPPER)
    exits.mkdir()
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--redirects",
        "2",
        "--log-dir",
        str(logs),
        str(wrapper),
        str(exits),
        str(worker),
        args.device,
        str(args.timeout),
        str(args.stall),
        scenario,
    ]
    t0 = time.time()
    env = dict(os.environ, KLPPO_STALL_T0=repr(t0))
    exit_code, tail = _run_ranks(cmd, args.max_wall, env)
    wall = time.time() - t0
    ranks = {}
    for err in sorted(logs.rglob("stderr.log")):
        rank = err.parent.name
        lines = err.read_text(errors="replace").splitlines()
        record = exits / f"{rank}.json"
        ranks[rank] = {
            "exit": json.loads(record.read_text())
            if record.exists()
            else "no record (killed with its wrapper)",
            # the lines naming a phase or the abort, and the last lines whatever they say (a hang shows there)
            "named": [
                ln for ln in lines if any(k in ln for k in KEYS) and not ln.lstrip().startswith("File ")
            ][:40],
            "last": lines[-8:],
            # the Python stacks printed at the end (klppo's watch, or faulthandler on NCCL's abort)
            "stacks": next(
                (lines[i : i + 40] for i, ln in enumerate(lines) if any(k in ln for k in STACK_START)), []
            ),
        }
    entered = _entered_at(ranks.get("0", {}).get("named", []))
    bound = args.timeout + stall_grace_s(args.timeout) + 45.0  # watch poll + torchrun's 30 s + slack
    if scenario == "warm" and args.device == "cuda":
        bound += 75.0  # NCCL's watchdog pauses (4 x its 15 s dump timeout) and dumps before it aborts
    text = {r: "\n".join(v["named"]) for r, v in ranks.items()}
    shutil.rmtree(work, ignore_errors=True)
    return {
        "wall_s": round(wall, 1),
        "torchrun_exit": exit_code,
        "killed_at_max_wall": exit_code is None,
        "rank0_entered_collective_s": entered,
        "end_bound_s": round((entered or 0.0) + bound, 1),
        "ended_within_bound": exit_code is not None and entered is not None and wall <= entered + bound,
        "phases_named": "gather_samples" in text.get("0", "") and "'gen'" in text.get("1", ""),
        "ranks": ranks,
        "torchrun_tail": tail[-3000:],
    }


def _entered_at(lines: list[str]) -> float | None:
    for line in lines:
        if line.startswith("klppo-stall: rank 0 enters the collective at "):
            return float(line.split(" at ")[1].split()[0])
    return None


def _run_ranks(cmd: list[str], max_wall: float, env: dict[str, str]) -> tuple[int | None, str]:
    """torchrun's exit code and stderr; after ``max_wall`` seconds its whole process group is killed (exit
    code None) so that the logs written so far are still read and reported."""
    proc = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=max_wall)
        return proc.returncode, err
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
        return None, err


if __name__ == "__main__":
    main()
