"""bench/tp_rollout.py mechanically on CPU: 2 gloo ranks (relaunched under torchrun), the tiny shape at
TP=2 and TP=1; fp32, so the greedy check must find identical tokens and log-probs within 1e-5."""

from __future__ import annotations

import json

import pytest

from bench.tp_rollout import main
from tests.bench.gate import device_bench_run


@pytest.mark.slow
@device_bench_run
def test_tiny_tp2_vs_tp1_on_two_gloo_ranks(tmp_path):
    out = tmp_path / "tp.json"
    argv = ["--gpus", "2", "--tiny", "--device", "cpu", "--batch", "4", "--prompt", "8", "--new", "8"]
    assert main([*argv, "--calls", "1", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    by_tp = {r["tp"]: r for r in rows if "tp" in r}
    assert set(by_tp) == {1, 2} and all(r["status"] == "ok" for r in by_tp.values())
    for r in by_tp.values():
        assert r["tokens_per_s_per_gpu"] > 0 and 0 < r["weights_s"] < r["call_s"]
    # TP=2: the group's 8 rows in slots of 1 KV head each, the bytes of TP=1's 4 slots of 2 heads
    assert by_tp[2]["num_slots"] == 8 and by_tp[1]["num_slots"] == 4
    assert by_tp[2]["kv_cache_gb"] == by_tp[1]["kv_cache_gb"]
    (check,) = [r for r in rows if "check" in r]
    assert check["rows_identical_min"] == 1.0 and check["max_log_prob_gap"] < 1e-5
