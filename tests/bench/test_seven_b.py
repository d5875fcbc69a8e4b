"""bench/seven_b.py on CPU: the --tiny workload through the trainer with the recipe's settings (the optimizer
step on the CPU, the reference offloaded), 2 steps, ending in one JSON line with phases and memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_seven_b_tiny_runs_two_steps(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/seven_b.py", "--device", "cpu", "--tiny", "--steps", "2", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=120, capture_output=True)
    result = json.loads(out.read_text())
    assert result["workload"] == "grpo_k3" and result["steps"] == 2
    assert result["tokens_per_s"] > 0 and result["timing_s/update_actor"] > 0
    assert result["predicted_gib/host"] > 0 and result["measured_gib/host_rss"] > 0
