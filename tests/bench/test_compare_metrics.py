"""bench/compare_metrics.py: equal runs pass, a changed result fails by name, timings are left out."""

from __future__ import annotations

import json

from bench.compare_metrics import main


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_equal_results_pass_whatever_the_timings(tmp_path, capsys):
    a = _write(
        tmp_path / "a.jsonl", [{"step": 1, "actor/pg_loss": 0.5, "timing_s/gen": 1.0, "rollout/time_s": 2}]
    )
    b = _write(
        tmp_path / "b.jsonl", [{"step": 1, "actor/pg_loss": 0.5, "timing_s/gen": 9.0, "rollout/time_s": 3}]
    )
    assert main([str(a), str(b), "--steps", "1"]) == 0
    assert "step 1: 1 of 1 keys equal" in capsys.readouterr().out


def test_a_changed_value_or_a_missing_step_fails_and_is_named(tmp_path, capsys):
    a = _write(tmp_path / "a.jsonl", [{"step": 1, "actor/pg_loss": 0.5}, {"step": 2, "actor/pg_loss": 0.1}])
    b = _write(tmp_path / "b.jsonl", [{"step": 1, "actor/pg_loss": 0.5000001}])
    assert main([str(a), str(b), "--steps", "2"]) == 1
    out = capsys.readouterr().out
    assert "actor/pg_loss: 0.5 vs 0.5000001" in out and "step 2: missing in B" in out
    assert main([str(a), str(b), "--steps", "1", "--rtol", "1e-6"]) == 0
