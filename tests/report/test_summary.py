"""The summary's time line: this invocation's figures, with the run's total beside them after a resume."""

from __future__ import annotations

from klppo.report import run_from_history
from klppo.report.summary import time_line


def _run(steps: list[int]):
    return run_from_history("r", [(s, {"timing_s/step": 2.0, "timing_s/gen": 1.0}) for s in steps])


def test_a_fresh_run_has_one_set_of_times():
    whole = _run([1, 2, 3])
    assert time_line(whole, 10.0, whole) == "time: 6.0 s in 3 steps (2.0 s/step; gen 50%), 10 s in all"
    assert time_line(whole) == "time: 6.0 s in 3 steps (2.0 s/step; gen 50%)"  # the report page's form


def test_a_resumed_run_says_this_starts_times_and_the_runs_total():
    whole = _run([1, 2, 3])
    assert time_line(whole, 10.0, _run([3])) == (
        "time (this start): 2.0 s in 1 step (2.0 s/step; gen 50%), 10 s in all; the run: 6.0 s in 3 steps"
    )
    assert time_line(whole, 4.0, _run([])) == (
        "time (this start): no step trained, 4.0 s in all; the run: 6.0 s in 3 steps"
    )
