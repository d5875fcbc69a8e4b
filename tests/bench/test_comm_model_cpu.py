"""bench/comm_model.py: klppo tune's communication model over a recorded sweep row (the first 1.5B point of
bench/results/fsdp-sweep-2gpu-1.5b.json: per-layer units, resharded, 2 micro-batches of 8,192 tokens,
measured 48% exposed; the sweep reduce-scatters after every micro-batch, as the script configures the
model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.comm_model import main, predicted_share

SWEEP = Path(__file__).resolve().parents[2] / "bench" / "results" / "fsdp-sweep-2gpu-1.5b.json"


def test_first_row_at_two_link_speeds_and_the_table(capsys):
    row = json.loads(SWEEP.read_text())["rows"][0]
    assert (row["min_num_params"], row["reshard_after_forward"], row["num_micro"]) == (0, True, 2)
    slow = predicted_share(row, world_size=2, link_gbps=20, tflops=600, extra=[])
    fast = predicted_share(row, world_size=2, link_gbps=350, tflops=600, extra=[])
    assert slow == pytest.approx(0.48, abs=0.02) and fast == 0.0
    # gradients reduced in bf16: half the reduce-scatter bytes, less exposed at the same link
    bf16 = "actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype=bf16"
    assert predicted_share(row, world_size=2, link_gbps=20, tflops=600, extra=[bf16]) < slow
    assert main([str(SWEEP), "--rows", "1", "--link-gbps", "20"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| shape") and lines[2].endswith("| 48% | 48% |")
