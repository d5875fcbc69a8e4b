"""bench/offline.py --tiny on the CPU: the log of a random model, the offline KL-PPO, filtered-SFT and online
arms two steps each, every arm's checkpoint sampled on the held-out prompts and its KL to the starting model
measured, one JSON (the real figures need the GPU and SmolLM2)."""

from __future__ import annotations

import json
import math

import pytest

from bench.offline import main
from tests.bench.gate import device_bench_run


@pytest.mark.slow
@device_bench_run
def test_offline_bench_tiny_runs_every_arm(tmp_path):
    out = tmp_path / "offline.json"
    assert main(["--tiny", "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["log"]["samples"] == 16 and report["log"]["sft_pairs"] > 0
    results = {r["name"]: r for r in report["results"]}
    assert sorted(results) == ["offline_lr0.001", "online_lr0.001", "sft_lr0.001"]
    for r in results.values():
        assert r["exit_code"] == 0 and r["steps"] == 2 and r["step_s_median"] > 0
        held = r["heldout"]
        assert held["checkpoint"] == "global_step_2" and held["samples"] == 8
        assert math.isfinite(held["kl_k3"]) and held["kl_k3"] >= 0 and 0 <= held["sampled_accuracy"] <= 1
    assert results["offline_lr0.001"]["series"]["gen_s"] == [None, None]  # logged: nothing generated
    assert all(x is not None for x in results["online_lr0.001"]["series"]["gen_s"])
    assert set(report["step_time_vs_online"]) == {"offline_lr0.001", "sft_lr0.001"}
    # the SFT arm's advantages: +½ on the correct responses, −½ on the EOS-only partners, no KL loss
    sft = [
        json.loads(x) for x in (tmp_path / "work" / "sft_lr0.001" / "metrics.jsonl").read_text().splitlines()
    ]
    for step in (m for m in sft if "critic/advantages/max" in m):
        assert step["critic/advantages/max"] == pytest.approx(0.5) and "actor/kl_loss" not in step
        assert step["critic/advantages/min"] == pytest.approx(-0.5)
