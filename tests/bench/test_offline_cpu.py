"""bench/offline.py --tiny on the CPU: the log of a random model, the offline KL-PPO, filtered-SFT, online and
online-TIS arms two steps each, two at a time, every arm's checkpoint sampled on the held-out prompts and its
KL to the starting model measured, one JSON (the real figures need the GPU and SmolLM2)."""

from __future__ import annotations

import json
import math

import pytest

from bench.offline import main
from tests.bench.gate import device_bench_run
from tests.trainer.utils import read_metrics


@pytest.mark.slow
@device_bench_run
def test_offline_bench_tiny_runs_every_arm(tmp_path):
    out = tmp_path / "offline.json"
    arms = ["--arms", "offline", "sft", "online", "online_tis", "--parallel", "2", "--curve", "sft"]
    arms += ["--curve-every", "1"]
    assert main(["--tiny", *arms, "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["log"]["samples"] == 16 and report["log"]["sft_pairs"] > 0
    results = {r["name"]: r for r in report["results"]}
    assert sorted(results) == ["offline_lr0.001", "online_lr0.001", "online_tis_lr0.001", "sft_lr0.001"]
    for r in results.values():
        assert r["exit_code"] == 0 and r["steps"] == 2 and r["step_s_median"] > 0
        held = r["heldout"]
        assert held["checkpoint"] == "global_step_2" and held["samples"] == 8
        assert math.isfinite(held["kl_k3"]) and held["kl_k3"] >= 0 and 0 <= held["sampled_accuracy"] <= 1
    assert results["offline_lr0.001"]["series"]["gen_s"] == [None, None]  # logged: nothing generated
    assert all(x is not None for x in results["online_lr0.001"]["series"]["gen_s"])
    assert set(report["step_time_vs_online"]) == {"offline_lr0.001", "sft_lr0.001", "online_tis_lr0.001"}
    per_token = report["step_time_per_token_vs_online"]
    assert set(per_token) == set(report["step_time_vs_online"]) and all(x > 0 for x in per_token.values())
    tis = read_metrics(tmp_path / "work" / "online_tis_lr0.001")
    assert any("rollout_corr/rollout_is_mean" in m for m in tis)  # the TIS arm weights its tokens
    assert report["parallel"] == 2
    # the SFT arm's curve: its checkpoint before the last, with the validation and the KL at that step
    (point,) = results["sft_lr0.001"]["curve"]
    assert point["step"] == 1 and point["checkpoint"] == "global_step_1" and 0 <= point["accuracy"] <= 1
    assert math.isfinite(point["kl_k3"]) and "curve" not in results["offline_lr0.001"]
    # a later call evaluates the trained arms again without training them (a call cut off before its curve)
    again = tmp_path / "again.json"
    argv = ["--tiny", "--arms", "sft", "--curve", "sft", "--curve-every", "1", "--evaluate-only"]
    assert main([*argv, "--workdir", str(tmp_path / "work"), "--out", str(again)]) == 0
    (sft,) = json.loads(again.read_text())["results"]
    assert sft["steps"] == 2 and sft["curve"] == results["sft_lr0.001"]["curve"]
    # the SFT arm's advantages: +½ on the correct responses, −½ on the EOS-only partners, no KL loss
    sft = read_metrics(tmp_path / "work" / "sft_lr0.001")
    for step in (m for m in sft if "critic/advantages/max" in m):
        assert step["critic/advantages/max"] == pytest.approx(0.5) and "actor/kl_loss" not in step
        assert step["critic/advantages/min"] == pytest.approx(-0.5)
