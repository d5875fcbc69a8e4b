"""A stalled rank names its phase before the collective timeout (NCCL gives no exception to label), and a
rank left inside one collective call past the timeout is ended by its watch with the phase named (NCCL's
watchdog does not see a collective whose call has not returned)."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from bench.phase_stall import WORKER
from klppo.parallel import dist as kdist
from klppo.parallel.dist import COLLECTIVE_STALL_EXIT, PhaseWatch, free_port, phase, stall_grace_s

C10D = "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py"


def fake_frame(filename: str = C10D, lasti: int = 40, name: str = "all_reduce"):
    return SimpleNamespace(
        f_code=SimpleNamespace(co_filename=filename, co_name=name), f_lasti=lasti, f_lineno=7
    )


def compiled_in(filename: str, source: str, name: str):
    """A function whose code says it lives in ``filename`` (a stand-in for a torch collective)."""
    scope: dict = {"time": time}
    exec(compile(source, filename, "exec"), scope)
    return scope[name]


def test_watch_reports_an_overdue_phase_once_per_entry():
    out = io.StringIO()
    watch = PhaseWatch(10.0, rank=3, stream=out)
    with phase("step"), phase("gen"):
        since = kdist._phase_since
        assert watch.check(now=since + 9.0) is None and out.getvalue() == ""  # not yet overdue
        warned = watch.check(now=since + 12.0)
        assert warned == since
        line = out.getvalue()
        assert "rank 3" in line and "phase 'gen' (step > gen)" in line and "for 12 s" in line
        assert watch.check(now=since + 30.0, warned=warned) == warned  # once per phase entry
        assert out.getvalue() == line
    with phase("gen"):  # a new entry of the same phase is reported again
        assert watch.check(now=kdist._phase_since + 11.0, warned=warned) == kdist._phase_since
    assert out.getvalue().count("rank 3") == 2


def test_watch_thread_starts_and_stops():
    out = io.StringIO()
    watch = PhaseWatch(0.05, rank=0, poll_s=0.01, stream=out).start()
    with phase("update_actor"):
        time.sleep(0.3)
    watch.stop()
    assert "phase 'update_actor'" in out.getvalue()


@pytest.mark.slow
def test_two_ranks_one_stalled_name_both_phases(tmp_path: Path):
    """gloo, 2 processes, collective timeout 2 s: rank 1 sleeps 5 s in 'gen' while rank 0 waits in an
    all-reduce inside 'gather_samples'. Rank 0's error names its phase; rank 1's watch line (at 80% of the
    timeout) names the stalled phase, the cause. The worker is bench/phase_stall.py's (which runs it under
    torchrun, also on NCCL)."""
    procs = _launch_two(tmp_path, WORKER, ["cpu", "2", "5"])
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert procs[0].returncode == 3, errs[0]
    assert "phase 'gather_samples' (step > gather_samples)" in errs[0]
    assert "has waited" not in errs[0]  # gloo's own error came first: the watch did not act
    assert "rank 1 has been in phase 'gen' (step > gen)" in errs[1], errs[1]


def test_stall_tracking_with_a_fake_clock():
    watch = PhaseWatch(8.0, rank=0, act_after_s=25.0)
    call = fake_frame()
    assert (
        watch.observe(fake_frame(filename="/work/klppo/trainer/ppo_trainer.py"), 0.0) is None
    )  # not a collective
    assert watch.observe(call, 10.0) == 0.0 and watch._held is None  # first look: address noted, no reference
    assert (
        watch.observe(call, 15.0) == 5.0 and watch._held[0] is call
    )  # same call 5 s later: held from now on
    assert watch.observe(call, 36.0) == 26.0  # past act_after_s: tick() would end the rank
    call.f_lasti = 52  # the call moved on (a Python loop inside the same function): counted afresh
    assert watch.observe(call, 37.0) == 0.0 and watch._held is None
    other = fake_frame()  # the next call of the same function: another frame, not the held one
    watch.observe(call, 38.0)
    assert watch.observe(other, 39.0) == 0.0 and watch._held is None
    watch.observe(other, 40.0)
    assert watch.observe(fake_frame(filename="/x/torch/nn/modules/module.py"), 41.0) is None
    assert watch._held is None and watch._candidate is None  # the frame is released at once
    functional = fake_frame(filename="/v/torch/distributed/_functional_collectives.py")
    watch.observe(functional, 50.0)
    assert watch.observe(functional, 80.0) == 30.0


def test_grace_after_the_timeout():
    assert (
        stall_grace_s(10) == 2.0
        and stall_grace_s(20) == 2.0
        and stall_grace_s(300) == 30.0
        and stall_grace_s(1800) == 60.0
    )


def test_watch_ends_a_rank_stuck_in_one_collective_call(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The main thread sits in one call of a (stand-in) collective: the watch prints the line naming the
    phase and the call, the stacks, writes torchrun's error file and exits with COLLECTIVE_STALL_EXIT."""
    stuck = compiled_in(C10D, "def all_reduce(s):\n    time.sleep(s)\n", "all_reduce")
    out, codes = io.StringIO(), []
    watch = PhaseWatch(100.0, rank=2, poll_s=0.05, stream=out, act_after_s=0.6, timeout_s=0.5)
    watch.exit_fn = lambda code: (codes.append(code), watch._stop.set())
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    watch.start()
    with phase("step"), phase("gather_samples"):
        stuck(2.0)
    watch.stop()
    assert codes == [COLLECTIVE_STALL_EXIT]
    text = out.getvalue()
    where = r"in one collective call \(all_reduce, torch/distributed/distributed_c10d.py:2\) during phase"
    assert re.search(
        r"klppo: rank 2 has waited \d+ s " + where + r" 'gather_samples' \(step > gather_samples\)", text
    )
    assert (
        f"collective_timeout_s (0.5 s), and the backend did not end it: this rank stops with exit code "
        f"{COLLECTIVE_STALL_EXIT}" in text
    )
    assert "Python stacks of every thread" in text and "in test_watch_ends_a_rank_stuck" in text  # the stacks
    message = json.loads(error_file.read_text())["message"]
    assert message["message"].startswith("CollectiveStall: klppo: rank 2 has waited")
    assert "all_reduce" in message["extraInfo"]["py_callstack"]


def test_watch_ignores_back_to_back_collectives():
    """A loop of short calls of the same collective (the main thread inside it nearly all the time, frames
    at the same address) is not one stuck call: nothing happens."""
    short = compiled_in(C10D, "def all_reduce():\n    time.sleep(0.002)\n", "all_reduce")
    out, codes = io.StringIO(), []
    watch = PhaseWatch(100.0, rank=0, poll_s=0.05, stream=out, act_after_s=0.4, exit_fn=codes.append).start()
    end = time.monotonic() + 1.5
    with phase("update_actor"):
        while time.monotonic() < end:
            short()
    watch.stop()
    assert codes == [] and out.getvalue() == ""


def test_watch_ignores_long_work_outside_collectives():
    out, codes = io.StringIO(), []
    watch = PhaseWatch(100.0, rank=0, poll_s=0.05, stream=out, act_after_s=0.2, exit_fn=codes.append).start()
    with phase("gen"):
        time.sleep(0.8)
    watch.stop()
    assert codes == [] and out.getvalue() == ""


def _launch_two(tmp_path: Path, source: str, args: list[str]) -> list[subprocess.Popen]:
    script = tmp_path / "worker.py"
    script.write_text(source)
    port = str(free_port())
    root = str(Path(__file__).resolve().parents[2])
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            KLPPO_STALL_T0=repr(time.time()),
        )
        env["PYTHONPATH"] = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
        procs.append(
            subprocess.Popen([sys.executable, str(script), *args], env=env, stderr=subprocess.PIPE, text=True)
        )
    return procs


@pytest.mark.slow
def test_two_ranks_collective_past_the_timeout_ends_the_rank(tmp_path: Path):
    """gloo, 2 processes, collective timeout 1 s: rank 0 waits in a barrier of a group whose own timeout is
    10 s (as a NCCL call that never returns: no backend error) while rank 1 sleeps 12 s in 'gen'. Rank 0's
    watch ends it at 1 s + the grace (2 s), exit code 75, its line naming 'gather_samples'."""
    procs = _launch_two(tmp_path, WORKER, ["cpu", "1", "12", "watch"])
    start = time.monotonic()
    err0 = procs[0].communicate(timeout=120)[1]
    ended_after = time.monotonic() - start
    procs[1].terminate()  # as torchrun does once a rank failed
    err1 = procs[1].communicate(timeout=120)[1]
    assert procs[0].returncode == COLLECTIVE_STALL_EXIT, err0
    entered = float(err0.split("enters the collective at ")[1].split()[0])
    assert ended_after < entered + 1 + stall_grace_s(1) + 4, err0  # (wall from launch; entered: from T0)
    line = next(ln for ln in err0.splitlines() if "has waited" in ln)
    assert "rank 0" in line and "(barrier, torch/distributed/distributed_c10d.py:" in line
    assert "phase 'gather_samples' (step > gather_samples)" in line
    assert "rank 1 has been in phase 'gen' (step > gen)" in err1, err1


BUSY_WORKER = """
import os, sys, time
import torch, torch.distributed as dist
from klppo.parallel.dist import destroy, init_distributed, phase
time.sleep(3.0 if os.environ["RANK"] == "1" else 0.0)  # a rank that joins late (a slow import)
info = init_distributed("cpu", timeout_s=1.0)
end = time.monotonic() + float(sys.argv[1])
t = torch.ones(1)
with phase("update_actor"):
    while time.monotonic() < end:  # rank 0 waits in the all-reduce for most of the loop, each time < 1 s
        if info.rank == 1:
            time.sleep(0.3)
        dist.all_reduce(t)
        flag = torch.tensor([float(time.monotonic() < end)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 0:
            break
destroy()
print("done", file=sys.stderr, flush=True)
"""


@pytest.mark.slow
def test_two_ranks_busy_with_collectives_past_the_bound_run_to_the_end(tmp_path: Path):
    """A normal run: rank 0 spends 5 s (more than the 3 s at which a stuck call is ended: 1 s timeout + 2 s
    grace) waiting in short all-reduces, each shorter than the 1 s timeout: both ranks finish, exit 0, and
    nothing is ended. Rank 1 joins 3 s late: the rendezvous waits for it whatever the collective timeout
    (it failed at start-up with the 1 s timeout on a loaded 2-core machine)."""
    assert 1 + stall_grace_s(1) < 5
    procs = _launch_two(tmp_path, BUSY_WORKER, ["5"])
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errs
    assert all("done" in e and "has waited" not in e for e in errs), errs


def test_warning_when_nccl_watchdog_would_not_end_a_rank(caplog: pytest.LogCaptureFixture):
    with caplog.at_level("WARNING", logger="klppo.parallel.dist"):
        kdist._warn_watchdog_settings({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
        assert caplog.records == []
        kdist._warn_watchdog_settings({"TORCH_NCCL_RETHROW_CUDA_ERRORS": "0"})
    assert len(caplog.records) == 1 and "TORCH_NCCL_RETHROW_CUDA_ERRORS=0" in caplog.records[0].getMessage()
