"""A run directory is one run's truth (issue 51), end to end: a fresh start over an earlier run, records
kept per start, a resume checked before weights load, a hung reward function stopped (1 process and 2
ranks, the hung rank named by the launcher), and no rank outliving a `klppo train` killed with -9."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer.utils import base_overrides, read_metrics

ROOT = Path(__file__).resolve().parents[2]


def _klppo_lines(capsys) -> list[str]:
    """What klppo said on stderr (progress bars of other libraries left out)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("klppo")]


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in read_metrics(run_dir)]


@pytest.mark.slow
def test_one_run_per_directory_and_a_resume_checked_before_weights(
    tiny_model_dir, arithmetic_data, tmp_path, capsys
):
    from klppo.commands.train import main
    from klppo.models.tiny import save_tiny_model_dir

    run_dir = tmp_path / "run"
    base = base_overrides(tiny_model_dir, arithmetic_data, run_dir) + ["trainer.save_freq=1"]
    assert main(base) == 0
    records = {n: (run_dir / n).read_text() for n in ("resolved_config.yaml", "command.txt", "events.jsonl")}
    capsys.readouterr()

    # case 2: a fresh start where checkpoints are is refused, naming the key; nothing is overwritten
    assert main(base + ["trainer.resume_mode=disable"]) == 2
    err = _klppo_lines(capsys)
    assert len(err) == 1 and "trainer.run_dir_exists=archive" in err[0], err
    assert _steps(run_dir) == [1]

    # case 5: other weights of the same shapes, or another batch geometry, refused by name before weights load
    other = save_tiny_model_dir(tmp_path / "other", num_layers=2, hidden_size=64, seed=1)
    over = [a for a in base if not a.startswith("actor_rollout_ref.model.path=")]
    assert main(over + [f"actor_rollout_ref.model.path={other}", "trainer.total_training_steps=2"]) == 2
    assert "would change the model weights" in capsys.readouterr().err
    assert main(base + ["trainer.total_training_steps=2", "actor_rollout_ref.rollout.n=4"]) == 2
    assert "actor_rollout_ref.rollout.n 2 → 4" in capsys.readouterr().err
    # case 3: the refused starts are recorded beside the first; the run's records stay as they were
    assert {n: (run_dir / n).read_text() for n in records} == records
    starts = run_dir / "starts"
    assert (starts / "latest").read_text() == "004\n"
    assert "rollout.n=4" in (starts / "004" / "command.txt").read_text()
    assert "rollout.n=4" not in (starts / "001" / "command.txt").read_text()

    # on purpose: the earlier run archived, the fresh run's metrics alone
    (run_dir / "wandb_run_id.txt").write_text("earlier\n")
    assert main(base + ["trainer.resume_mode=disable", "trainer.run_dir_exists=archive"]) == 0
    assert read_metrics(run_dir) != read_metrics(run_dir / "archive" / "001")  # another run's step 1
    assert _steps(run_dir) == [1] and _steps(run_dir / "archive" / "001") == [1]
    assert not (run_dir / "wandb_run_id.txt").exists()


HANGS = """
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if os.environ.get("HANG_RANK", os.environ.get("RANK", "0")) == os.environ.get("RANK", "0"):
        time.sleep(1000)
    return 0.0
"""


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True])
def test_a_hung_reward_function_ends_the_run_at_its_limit(
    tiny_model_dir, arithmetic_data, tmp_path, capsys, background
):
    from klppo.commands.train import main

    fn = tmp_path / "hangs.py"
    fn.write_text(HANGS)
    run_dir = tmp_path / "run"
    argv = base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
        f"custom_reward_function.path={fn}",
        "reward_model.timeout_s=2",
        f"reward_model.launch_reward_fn_async={background}",
    ]
    start = time.monotonic()
    assert main(argv) == 3
    assert time.monotonic() - start < 60
    err = _klppo_lines(capsys)
    assert len(err) == 1 and err[0].startswith("klppo: rank 0: custom_reward_function"), err
    assert "did not return within reward_model.timeout_s=2 s, scoring batch row 0 (data_source" in err[0]
    assert (run_dir / "logs" / "rank0.log").is_file()


def _launch(argv: list[str], **env: str) -> subprocess.Popen:
    full = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen(
        [sys.executable, "-m", "klppo.cli", "train", *argv], env=full, stderr=subprocess.PIPE, text=True
    )


def _two_ranks(tiny_model_dir, arithmetic_data, run_dir: Path, *extra: str) -> list[str]:
    return base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
        "trainer.n_gpus_per_node=2",
        "trainer.collective_timeout_s=300",
        *extra,
    ]


@pytest.mark.slow
def test_a_reward_hung_on_rank_1_is_named_by_the_launcher(tiny_model_dir, arithmetic_data, tmp_path):
    fn = tmp_path / "hangs.py"
    fn.write_text(HANGS)
    run_dir = tmp_path / "run"
    argv = _two_ranks(
        tiny_model_dir,
        arithmetic_data,
        run_dir,
        f"custom_reward_function.path={fn}",
        "reward_model.timeout_s=3",
    )
    start = time.monotonic()
    launcher = _launch(argv, HANG_RANK="1")
    try:
        _, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert time.monotonic() - start < 120  # not the collective timeout (300 s)
    assert launcher.returncode == 3, err[-3000:]
    assert "klppo: rank 1: custom_reward_function" in err and "timeout_s=3 s" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert "Traceback" in (run_dir / "logs" / "rank1.log").read_text()


@pytest.mark.slow
def test_kill_9_of_the_launcher_leaves_no_rank_and_the_lock_is_free(
    tiny_model_dir, arithmetic_data, tmp_path
):
    from klppo.ops.run_lock import RANKS_DIR, RunLock
    from klppo.parallel.launch import _children

    run_dir = tmp_path / "run"
    argv = _two_ranks(
        tiny_model_dir, arithmetic_data, run_dir, "trainer.total_training_steps=200", "trainer.save_freq=1"
    )
    launcher = _launch(argv)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "metrics.jsonl").exists() or not read_metrics(run_dir):
            assert launcher.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.5)
        processes = _children(launcher.pid)
        ranks = [json.loads(p.read_text())["pid"] for p in (run_dir / RANKS_DIR).glob("*.json")]
        assert len(ranks) == 2 and set(ranks) <= set(processes)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    finally:
        if launcher.poll() is None:
            launcher.kill()
    deadline = time.monotonic() + 10
    while [p for p in processes if Path(f"/proc/{p}").exists()] and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = [
        p
        for p in processes
        if Path(f"/proc/{p}/stat").exists()
        and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    ]
    assert not alive, f"left running: {alive}"
    with RunLock(run_dir):  # the run is provably dead: the lock is taken over
        pass
