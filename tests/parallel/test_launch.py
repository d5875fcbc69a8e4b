"""Relaunch through torchrun: a failing rank shows one traceback and the job exits non-zero."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from klppo.parallel.dist import under_launcher

HERE = Path(__file__).parent
ROOT = HERE.parent.parent


def _run(arg: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE)])
    return subprocess.run(
        [sys.executable, str(HERE / "relaunch_target.py"), arg],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_failing_rank_one_traceback_nonzero_exit():
    proc = _run("fail")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert out.count('raise ValueError("boom from rank 1")') == 1, out
    assert out.count("Traceback (most recent call last)") == 1, out
    assert "Root Cause" in out and "rank      : 1" in out
    assert "phase 'relaunch-test'" in out  # the other rank's failure names the phase, without traceback


@pytest.mark.slow
def test_success_runs_both_ranks_rank0_output_only():
    proc = _run("ok")
    assert proc.returncode == 0, proc.stderr
    assert "rank 0 done" in proc.stdout and "rank 1 done" not in proc.stdout


def test_launcher_detection():
    assert not under_launcher({})
    assert under_launcher({"RANK": "0", "WORLD_SIZE": "2"})
    assert under_launcher({"TORCHELASTIC_RUN_ID": "x"})
    assert under_launcher({"SLURM_PROCID": "3", "SLURM_NTASKS": "8"})
    assert not under_launcher({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})  # sbatch script: relaunch
