"""bench/multi_gpu.py's smoke mode, mechanically on CPU: 2 gloo ranks (the trainer relaunched under
torchrun) against 1 process, first 2 PPO steps of a tiny Qwen2 with greedy rollouts and one mini-batch per
step. fp32 on CPU, so the only difference is float summation order: rel 1e-4 (as
tests/trainer/test_distributed.py)."""

from __future__ import annotations

import json

import pytest

from bench.multi_gpu import compare_steps, main, memory_check, memory_error
from tests.bench.gate import device_bench_run

pytestmark = pytest.mark.slow  # multi-process or long (minutes on 2 busy cores); `-m 'not slow'` skips it

# non-zero by construction from step 1 (the smoke reward spreads scores over [0, 1)): the strong checks
CHECKED = ["actor/grad_norm", "critic/grad_norm", "critic/vf_loss", "critic/returns/mean"]


@device_bench_run
def test_smoke_two_gloo_ranks_match_one(tmp_path):
    argv = ["--run", "smoke", "--device", "cpu", "--tiny", "--gpus", "2", "--smoke-steps", "2"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--work-dir", str(tmp_path / "work")]) == 0
    saved = json.loads((tmp_path / "out" / "smoke_k2.json").read_text())
    result = saved["result"]
    assert saved["meta"]["gpus"] == 2 and result["world_sizes"] == [2.0]
    assert result["ok"] and {c["step"] for c in result["compared"]} == {1, 2}

    # independent re-check from the raw metrics rows, not the script's verdict
    one = {r["step"]: r for r in result["rows_1"]}
    two = {r["step"]: r for r in result["rows_k"]}
    assert set(one) == set(two) == {1, 2}
    for step in (1, 2):
        for key in CHECKED:
            assert abs(one[step][key]) > 1e-3, (step, key, "vacuous comparison")
            assert two[step][key] == pytest.approx(one[step][key], rel=1e-4), (step, key)

    # the comparison fails on what a rank-layout bug gives: gradients summed over 2 ranks, not averaged
    summed = [dict(r, **{"actor/grad_norm": 2 * r["actor/grad_norm"]}) for r in result["rows_k"]]
    bad = [c for c in compare_steps(summed, result["rows_1"], rel=2e-2) if not c["ok"]]
    assert {c["metric"] for c in bad} == {"actor/grad_norm"} and len(bad) == 2


def test_memory_check_by_hand():
    rows = [
        dict(shape="Qwen2.5-7B", k=2, status="ok", peak_gib=40.0, predicted_gib=42.0),  # +5%
        dict(shape="Qwen2.5-7B", k=2, status="ok", peak_gib=50.0, predicted_gib=44.0),  # -12%
        dict(shape="Qwen2.5-7B", k=2, status="oom", peak_gib=None, predicted_gib=90.0),  # not measured
        dict(shape="Qwen2.5-1.5B", k=2, status="ok", peak_gib=20.0, predicted_gib=21.0),  # +5%
    ]
    assert memory_error(rows[0]) == pytest.approx(0.05) and memory_error(rows[2]) is None
    lines = memory_check(rows)
    assert lines == [
        "- memory model, Qwen2.5-1.5B, K=2: largest error +5.0%; 1 of 1 points within ±10%",
        "- memory model, Qwen2.5-7B, K=2: largest error -12.0%; 1 of 2 points within ±10% — NOT all",
    ]


def test_scaling_variants_parse_and_table():
    """``--variant NAME:overrides`` and ``--scaling-ks``: each variant's efficiency against its own K = 1
    (the runs themselves: `--run scaling --device cpu --tiny --scaling-ks 1,2 --variant ...`, ~1 min)."""
    import argparse

    from bench.multi_gpu import parse_args, parse_variant, scaling_table

    key = "critic.model.fsdp_config.grad_sync_per_mini_batch"
    assert parse_variant(f"per_micro:{key}=false x.y=1") == ("per_micro", [f"{key}=false", "x.y=1"])
    assert parse_variant("auto") == ("auto", [])
    with pytest.raises(argparse.ArgumentTypeError, match="NAME:key=value"):
        parse_variant("bad:novalue")
    args = parse_args(
        ["--run", "scaling", "--scaling-ks", "1,2", "--variant", "a", "--variant", f"b:{key}=true"]
    )
    assert args.scaling_ks == [1, 2] and args.variant == [("a", []), ("b", [f"{key}=true"])]

    def run(variant, k, tput):
        return {
            "variant": variant,
            "k": k,
            "shape": "S",
            "train_batch_size": 32 * k,
            "last": {"perf/throughput": tput},
        }

    runs = [run("a", 1, 100.0), run("a", 2, 90.0), run("b", 1, 100.0), run("b", 2, 96.0)]
    files = [{"meta": {"run": "scaling", "gpus": 2}, "result": {"shape": "S", "variants": runs}}]
    table = scaling_table(files)
    assert "| S [a] | 2 | 64 |" in table and "| 90 | 0.90 |" in table
    assert "| S [b] | 2 | 64 |" in table and "| 96 | 0.96 |" in table


def test_scaling_reads_the_median_of_the_steps_after_the_first():
    """One step varied ~10% between identical runs on the GPUs: the table reads the median of the steps
    after the first (``steady``), and files without it still read their last step."""
    from bench.multi_gpu import _steady, scaling_table

    rows = [
        {"step": 1, "perf/throughput": 10.0},
        {"step": 2, "perf/throughput": 100.0},
        {"step": 3, "perf/throughput": 80.0},
        {"step": 4, "perf/throughput": 120.0},
    ]
    assert _steady(rows)["perf/throughput"] == 100.0 and _steady(rows[:1])["perf/throughput"] == 10.0
    one = {
        "variant": "a",
        "k": 1,
        "shape": "S",
        "train_batch_size": 32,
        "last": rows[-1],
        "steady": _steady(rows),
    }
    two = dict(
        one, k=2, train_batch_size=64, last={"perf/throughput": 50.0}, steady={"perf/throughput": 95.0}
    )
    table = scaling_table(
        [{"meta": {"run": "scaling", "gpus": 2}, "result": {"shape": "S", "variants": [one, two]}}]
    )
    assert "median of the steps after the first" in table and "| 95 | 0.95 |" in table
    del one["steady"], two["steady"]
    table = scaling_table(
        [{"meta": {"run": "scaling", "gpus": 2}, "result": {"shape": "S", "variants": [one, two]}}]
    )
    assert "last step" in table and "| 50 | 0.42 |" in table


def test_offload_writes_the_recipe_first_and_keeps_it_when_cut(tmp_path, monkeypatch):
    """A device call's timeout must not lose the 7B offload run: the recipe (offload on) runs first and its
    figures are on disk before the second run starts."""
    import bench.multi_gpu as mg

    args = mg.parse_args(
        ["--run", "offload", "--gpus", "2", "--device", "cpu", "--tiny", "--out", str(tmp_path)]
    )
    monkeypatch.setattr(mg, "make_model_dir", lambda *a, **k: tmp_path / "model")
    monkeypatch.setattr(
        mg, "_prompts", lambda *a, **k: (tmp_path / "train.parquet", tmp_path / "val.parquet")
    )
    calls = []

    def run_trainer(argv, run_dir):
        calls.append(next(x for x in argv if "actor.fsdp_config.param_offload=" in x))
        if len(calls) == 2:
            raise KeyboardInterrupt  # the call's timeout, during the second run
        return [{"timing_s/step": 2.0, "perf/max_memory_allocated_gb": 30.5}]

    monkeypatch.setattr(mg, "run_trainer", run_trainer)
    with pytest.raises(KeyboardInterrupt):
        mg.run_offload(args, tmp_path)
    assert calls[0].endswith("param_offload=True") and calls[1].endswith("param_offload=False")
    saved = json.loads((tmp_path / "offload_k2.json").read_text())
    assert saved["meta"]["partial"] is True
    assert saved["result"]["results"]["on"]["last"]["perf/max_memory_allocated_gb"] == 30.5
    assert "off" not in saved["result"]["results"]
    assert "| True |" not in mg.summarize(tmp_path) and "30.5" in mg.summarize(tmp_path)
