"""Stopping drills: SIGTERM to the `klppo train` launcher of a 2-rank run saves one checkpoint and exits 0
with no process left; a signal that reaches one rank only (in a different step than the others) saves,
not hangs; a second trainer in the same run directory is refused by the lock file (stale locks replaced)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.utils import base_overrides, read_metrics

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------- lock
def test_lock_refuses_a_second_trainer_and_replaces_a_stale_one(tmp_path, caplog):
    from klppo.ops.run_lock import LOCK_NAME, RunLock, RunLockError

    with RunLock(tmp_path) as first:
        owner = json.loads((tmp_path / LOCK_NAME).read_text())
        assert owner["host"] == socket.gethostname() and owner["pid"] == os.getpid()
        with pytest.raises(
            RunLockError, match=f"in use by another trainer .host {socket.gethostname()}, PID"
        ):
            RunLock(tmp_path).acquire()
        assert first.held
    assert not (tmp_path / LOCK_NAME).exists()

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a PID that no longer runs: the lock of a killed trainer
    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid}))
    with caplog.at_level("WARNING", logger="klppo"), RunLock(tmp_path):
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert any("stale lock" in r.getMessage() for r in caplog.records)

    # our own PID with another start time: the PID was reused by an unrelated process
    (tmp_path / LOCK_NAME).write_text(
        json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "start_time": "1"})
    )
    with RunLock(tmp_path):
        pass

    (tmp_path / LOCK_NAME).write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    with pytest.raises(RunLockError, match=f"another machine .*delete {tmp_path / LOCK_NAME}"):
        RunLock(tmp_path).acquire()


def test_klppo_train_refuses_a_locked_run_directory(tiny_model_dir, arithmetic_data, tmp_path, capsys):
    from klppo.commands.train import main
    from klppo.ops.run_lock import LOCK_NAME, RunLock

    run_dir = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        run_dir.mkdir()
        lock = RunLock(run_dir)
        lock.owner["pid"], lock.owner["start_time"] = other.pid, None
        lock.acquire()
        assert main(base_overrides(tiny_model_dir, arithmetic_data, run_dir)) == 2
        assert f"PID {other.pid}" in capsys.readouterr().err
        assert not (run_dir / "metrics.jsonl").exists()
    finally:
        other.kill()
        other.wait()
    assert main(base_overrides(tiny_model_dir, arithmetic_data, run_dir)) == 0  # stale now: replaced
    assert not (run_dir / LOCK_NAME).exists()  # released at the end


# ------------------------------------------------------------------------------------- multi-process
def _two_rank_argv(model_dir, data, run_dir, *extra: str) -> list[str]:
    return base_overrides(model_dir, data, run_dir) + [
        "trainer.n_gpus_per_node=2",
        "trainer.collective_timeout_s=90",
        *extra,
    ]


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_once_and_leaves_no_process(tiny_model_dir, arithmetic_data, tmp_path):
    from klppo.ops import checkpoint
    from klppo.ops.run_lock import LOCK_NAME
    from klppo.parallel.launch import _children

    run_dir = tmp_path / "run"
    argv = _two_rank_argv(tiny_model_dir, arithmetic_data, run_dir, "trainer.total_training_steps=200")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "klppo.cli", "train", *argv], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.5)
        processes = _children(launcher.pid)
        assert len(processes) >= 3  # torchrun and its two ranks
        launcher.send_signal(signal.SIGTERM)  # what `kill PID`, `docker stop` and systemd send
        _, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    steps = [r["step"] for r in read_metrics(run_dir)]
    latest = checkpoint.latest_checkpoint(run_dir)
    assert latest is not None and latest.name == f"global_step_{steps[-1]}" and steps[-1] < 200
    assert checkpoint.list_checkpoints(run_dir) == [(steps[-1], latest)]  # saved once
    assert {p.name for p in (latest / "rng").iterdir()} == {"rank_0.pt", "rank_1.pt"}
    assert checkpoint.validate_checkpoint(latest, roles=["actor", "critic"]) is None
    time.sleep(1)
    alive = [pid for pid in processes if Path(f"/proc/{pid}").exists()]
    assert not alive, f"left running: {alive}"
    assert not (run_dir / LOCK_NAME).exists()


SIGTERM_RANK_1_ONLY = """
import os, signal
calls = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    calls.append(1)
    if os.environ.get("RANK") == "1" and len(calls) == 5:  # rank 1's first sample of step 2 (4 a step)
        os.kill(os.getpid(), signal.SIGTERM)
    return 0.0
"""


@pytest.mark.slow
def test_signal_to_one_rank_saves_and_does_not_hang(tiny_model_dir, arithmetic_data, tmp_path):
    from klppo.commands.train import main
    from klppo.ops import checkpoint

    fn = tmp_path / "rank1_preempted.py"
    fn.write_text(SIGTERM_RANK_1_ONLY)
    run_dir = tmp_path / "run"
    argv = _two_rank_argv(
        tiny_model_dir,
        arithmetic_data,
        run_dir,
        "trainer.total_training_steps=6",
        f"custom_reward_function.path={fn}",
    )
    start = time.monotonic()
    assert main(argv) == 0
    assert time.monotonic() - start < 90  # no collective timeout: both ranks stopped after step 2
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2]
    latest = checkpoint.latest_checkpoint(run_dir)
    assert latest.name == "global_step_2"
    assert {p.name for p in (latest / "rng").iterdir()} == {"rank_0.pt", "rank_1.pt"}
