"""Reading run directories robustly: non-finite values in any spelling, cut lines, events."""

from __future__ import annotations

import math

import pytest

from klppo.report.runs import load_run, unique_names


def test_metrics_with_non_finite_values_and_a_cut_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(
        '{"step": 0, "val-core/openai/gsm8k/reward/mean@1": 0.25}\n'
        '{"step": 1, "critic/score/mean": 0.5, "actor/pg_loss": NaN, "note": "text"}\n'
        '{"step": 2, "critic/score/mean": null, "actor/pg_loss": "inf"}\n'
        '{"step": 3, "critic/score/mean": "-Infinity", "actor/pg_loss": "1.5"}\n'
        '{"step": 3, "critic/score/mean": 0.75}\n'  # a resumed run's repeat: the last value wins
        '{"step": 4, "critic/score/me\n'  # cut by a crash
        "[1, 2]\n"
        '{"step": 4, "val-core/openai/gsm8k/reward/mean@1": 0.5}\n'
    )
    run = load_run(tmp_path)
    assert run.num_bad_lines == 2
    assert run.series("critic/score/mean")[0] == [1, 2, 3]
    scores = run.series("critic/score/mean")[1]
    assert scores[0] == 0.5 and math.isnan(scores[1]) and scores[2] == 0.75
    losses = run.series("actor/pg_loss")[1]
    assert math.isnan(losses[0]) and losses[1] == math.inf and losses[2] == 1.5
    assert "note" not in run.keys()
    assert run.series("val-core/openai/gsm8k/reward/mean@1") == ([0, 4], [0.25, 0.5])
    assert run.steps == [1, 2, 3]  # validation lines are not training steps


def test_events_in_several_spellings(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    (tmp_path / "events.jsonl").write_text(
        '{"step": 7, "kind": "kl_explosion", "message": "KL 0.9 > 0.5: kl_coef 0.01 -> 0.02"}\n'
        '{"step": 3, "rule": "plateau", "msg": "reward flat"}\n'
        '{"step": 5, "rule": "kl_explosion", "action": "raise_kl_coef", "message": "KL 0.9", "kl": 0.9}\n'
        '{"kind": "no step"}\n'
        '{"step": 9, "rule": "summary", "action": "summary", "counts": {"plateau/stop": 1}}\n'
    )
    run = load_run(tmp_path)
    assert [(e.step, e.kind, e.message) for e in run.events] == [
        (3, "plateau", "reward flat"),
        (5, "kl_explosion → raise_kl_coef", "KL 0.9"),
        (7, "kl_explosion", "KL 0.9 > 0.5: kl_coef 0.01 -> 0.02"),
    ]
    assert run.num_bad_lines == 1


def test_missing_metrics_names_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="has no metrics.jsonl"):
        load_run(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_run(tmp_path / "nope")


def test_unique_names(tmp_path):
    a, b = tmp_path / "x" / "run", tmp_path / "y" / "run"
    assert unique_names([a, b]) == ["x/run", "y/run"]
    assert unique_names([a, tmp_path / "other"]) == ["run", "other"]
