"""`klppo report` on tiny CPU runs: a page holding each figure, two runs overlaid, the end-of-run summary."""

from __future__ import annotations

import base64
import re

import pytest

from tests.report.conftest import STEPS

# the runs of the session fixture tiny_runs (conftest.py) are trained once, by the one xdist worker of the
# group
pytestmark = pytest.mark.xdist_group("report_runs")

pytest.importorskip("matplotlib")

# the figures a CPU run with a reference (KL loss), validation and the run monitor (on by default) logs
EXPECTED = {
    "score",
    "kl",
    "entropy",
    "response_length",
    "advantages",
    "update",
    "rollout_correction",  # rollout/log_prob_diff: the engine's log-probs against the trainer's
    "timing",
    "throughput",
    "memory",
    "validation",
    "monitor",
}


def _figures(page: str) -> dict[str, bytes]:
    found = re.findall(r'data-figure="([a-z_]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    return {slug: base64.b64decode(data) for slug, data in found}


def test_end_of_run_summary_and_report(tiny_runs):
    run_a, _, stdout = tiny_runs
    summary = stdout[stdout.index(next(line for line in stdout if line.startswith("klppo run summary"))) :]
    text = "\n".join(summary)
    assert summary[0] == f"klppo run summary: {STEPS} training steps in {run_a}"
    assert re.search(rf"score \(critic/score/mean\): \S+ → \S+ \(step 1 → {STEPS}\)", text), text
    assert re.search(rf"validation arithmetic/reward/mean@1: \S+ → \S+ \(step 0 → {STEPS}\)", text), text
    assert re.search(
        r"KL to the reference, last step: k1 \S+ \(max \S+\), k3 \S+ \(max \S+\), kl_loss", text
    ), text
    assert re.search(rf"time: .* in {STEPS} steps \(.*/step; .*%.*\), .* in all", text), text
    assert f"checkpoint: {run_a / f'global_step_{STEPS}'}" in text
    assert f"report: {run_a / 'report.html'}" in text
    # one progress line per step although stdout is not a terminal
    progress = [line for line in stdout if line.startswith("step ")]
    assert len(progress) == STEPS and all("% | " in line and " elapsed" in line for line in progress)
    assert (run_a / "report.html").is_file() and (run_a / "report" / "score.png").is_file()


def test_report_holds_each_figure(tiny_runs, tmp_path, capsys):
    from klppo.cli import main

    run_a, _, _ = tiny_runs
    assert main(["report", str(run_a), "--output", str(tmp_path), "--dpi", "60"]) == 0
    assert f"report: {tmp_path / 'report.html'}" in capsys.readouterr().out
    page = (tmp_path / "report.html").read_text()
    figures = _figures(page)
    assert set(figures) == EXPECTED
    for slug, png in figures.items():
        assert png.startswith(b"\x89PNG") and len(png) > 5000, slug
        assert (tmp_path / "report" / f"{slug}.png").read_bytes() == png
    assert "Not logged by these runs" not in page
    text = re.sub(r"base64,[A-Za-z0-9+/=]+", "", page)  # the figures' bytes may spell anything
    assert "http" not in text.replace("http-equiv", "")  # nothing fetched: opens offline


def test_two_runs_overlaid(tiny_runs, tmp_path):
    from klppo.report.figures import FIGURES, make_figure
    from klppo.report.runs import load_run, unique_names

    paths = list(tiny_runs[:2])
    runs = [load_run(p, name=n) for p, n in zip(paths, unique_names(paths))]
    assert [r.name for r in runs] == ["gae/run", "grpo/run"]
    kl = make_figure(next(s for s in FIGURES if s.slug == "kl"), runs)
    first = kl.axes[0]
    assert first.get_title() == "actor/ref_kl_k1"
    lines = [line for line in first.get_lines() if not line.get_label().startswith("_")]
    assert [line.get_label() for line in lines if line.get_linestyle() == "-"] == ["gae/run", "grpo/run"]
    assert [t.get_text() for t in first.get_legend().get_texts()] == ["gae/run", "grpo/run", "monitor event"]
    for line, run in zip(lines, runs):
        assert list(line.get_xdata()) == list(range(1, STEPS + 1))
        assert list(line.get_ydata()) == pytest.approx(run.series("actor/ref_kl_k1")[1])
    # the event of run B: a dotted line at its step on every panel, its kind written on the first
    for ax in kl.axes:
        if ax.get_visible():
            assert any(
                line.get_linestyle() == ":" and list(line.get_xdata()) == [2, 2] for line in ax.get_lines()
            )
    assert "kl_explosion" in [t.get_text().strip() for t in first.texts]
    # the advantages figure: run B (GRPO) has no critic values, run A has
    adv = make_figure(next(s for s in FIGURES if s.slug == "advantages"), runs)
    titled = {ax.get_title(): ax for ax in adv.axes if ax.get_visible()}
    assert "critic/values/mean" in titled


def test_report_cli_two_runs(tiny_runs, tmp_path, capsys):
    from klppo.cli import main

    run_a, run_b, _ = tiny_runs
    assert main(["report", str(run_a), str(run_b), "-o", str(tmp_path / "both"), "--dpi", "60"]) == 0
    page = (tmp_path / "both" / "report.html").read_text()
    assert set(_figures(page)) == EXPECTED
    assert "gae/run" in page and "grpo/run" in page
    assert "<td>kl_explosion</td>" in page and "kl_loss_coef 0.001 -&gt; 0.002" in page
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "missing is not a directory" in capsys.readouterr().err


def test_missing_matplotlib_is_one_line(tiny_runs, monkeypatch, tmp_path, capsys):
    import sys

    from klppo.cli import main
    from klppo.trainer.finish import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["report", str(tiny_runs[0]), "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == "klppo report: the run report draws with matplotlib, which is not installed: pip install "
        "'klppo[plot]'"
    )
    from klppo.report import load_run

    page, note = write_report(load_run(tiny_runs[0]), tmp_path)
    assert page is None and note.startswith("skipped: matplotlib is not installed (pip install 'klppo[plot]'")


def test_non_finite_values_leave_a_gap_and_a_red_x():
    import math

    from klppo.report.figures import FIGURES, make_figure
    from klppo.report.runs import run_from_history

    run = run_from_history(
        "nan-run",
        [
            (1, {"actor/entropy": 1.0}),
            (2, {"actor/entropy": math.nan}),
            (3, {"actor/entropy": math.inf}),
            (4, {"actor/entropy": 0.5}),
        ],
    )
    ax = make_figure(next(s for s in FIGURES if s.slug == "entropy"), [run]).axes[0]
    curve, marks = ax.get_lines()
    assert list(curve.get_xdata()) == [1, 2, 3, 4]
    assert [v for v in curve.get_ydata() if not math.isnan(v)] == [1.0, 0.5]  # a gap at steps 2 and 3
    assert marks.get_marker() == "x" and marks.get_color() == "red" and list(marks.get_xdata()) == [2, 3]
    assert make_figure(next(s for s in FIGURES if s.slug == "memory"), [run]) is None  # nothing logged


def test_rollout_correction_metrics_have_their_panels():
    """A run with token TIS: the mismatch and weight statistics each get a panel of the correction figure."""
    from klppo.report.figures import FIGURES, make_figure
    from klppo.report.runs import run_from_history

    spec = next(s for s in FIGURES if s.slug == "rollout_correction")
    logged = [
        "rollout_corr/kl",
        "rollout_corr/k3_kl",
        "rollout_corr/rollout_is_mean",
        "rollout_corr/rollout_is_max",
    ]
    run = run_from_history("tis", [(step, {k: 0.1 * step for k in logged}) for step in (1, 2, 3)])
    figure = make_figure(spec, [run])
    assert [ax.get_title() for ax in figure.axes if ax.get_lines()] == logged
