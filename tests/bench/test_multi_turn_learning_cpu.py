"""bench/multi_turn_learning.py on the CPU: ``--tiny`` trains the retry recipe, its one-turn counterpart and
the retry with the progress reward on a tiny model (whose turns end early, so that validation reaches the
retry) and writes the JSON the GPU run reports (the figures need the GPU and SmolLM2)."""

from __future__ import annotations

import json

import pytest

from bench.multi_turn_learning import ACCURACIES, checks, main
from tests.bench.gate import device_bench_run

ATTEMPT_KEYS = {*ACCURACIES, "n", "failed_first_share", "num_turns"}


@pytest.mark.slow
@device_bench_run  # three training processes: ~35 s on 2 cores
def test_tiny_run_writes_every_runs_attempts_before_and_after(tmp_path, capsys):
    out = tmp_path / "mt.json"
    runs = ["--runs", "retry", "one_turn", "retry_progress", "--parallel", "3"]
    assert main(["--tiny", *runs, "--workdir", str(tmp_path / "work"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["recipe"] == "examples/arithmetic_grpo_retry.yaml" and report["gpu"] == "cpu"
    results = {r["name"]: r for r in report["results"]}
    assert set(results) == {"retry", "one_turn", "retry_progress"}
    for r in results.values():
        assert r["exit_code"] == 0 and r["steps"] == len(r["series"]["step_s"]) >= 1
        assert r["train_seconds"] == pytest.approx(sum(r["series"]["step_s"]))
        for when in ("before", "after"):
            assert set(r[when]) == ATTEMPT_KEYS and r[when]["n"] == 4
            assert all(0.0 <= r[when][k] <= 1.0 for k in ACCURACIES if r[when][k] is not None)
            # validation conversations reach the retry in both runs: answer, "try again", answer
            assert r[when]["num_turns"] > 1
        assert set(r["gain_points"]) <= set(ACCURACIES)
        assert r["kl_k3_last20_mean"] is not None and r["kl_k3_max"] >= 0.0
    # the retry run's samples retry; the one-turn run's training rows are single_turn_agent: one answer
    assert max(results["retry"]["series"]["assistant_turns"]) > 1
    assert set(results["one_turn"]["series"]["assistant_turns"]) == {1.0}
    assert set(results["retry"]["checks"]) == {
        "up_to_two_attempts_gain_ge_15_points",
        "second_given_first_failed_rises",
        "kl_k3_last20_le_0.1",
    }
    assert "checks" not in results["one_turn"] and set(results["retry_progress"]["checks"]) == set(
        results["retry"]["checks"]
    )
    command = (tmp_path / "work" / "retry_progress" / "bench_command.txt").read_text()
    assert "examples/rewards/retry_progress.py" in command and "progress_bonus: 1.0" in command
    assert "| retry | " in capsys.readouterr().out


def test_the_checks_read_the_gain_of_both_figures_and_the_kl():
    good = {
        "gain_points": {"up_to_two_attempts": 15.0, "second_given_first_failed": 0.5},
        "kl_k3_last20_mean": 0.1,
    }
    assert all(checks(good).values())
    first_only = {**good, "gain_points": {"up_to_two_attempts": 40.0, "second_given_first_failed": 0.0}}
    assert checks(first_only)["second_given_first_failed_rises"] is False
    assert checks({**good, "kl_k3_last20_mean": 0.11})["kl_k3_last20_le_0.1"] is False
    assert not any(checks({"gain_points": {}, "kl_k3_last20_mean": None}).values())
