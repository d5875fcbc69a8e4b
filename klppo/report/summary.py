"""The end-of-run summary: a few lines a person reads first (score first → last, validation before →
after, KL to the reference, time, monitor events, where the checkpoint and the report are)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

from klppo.report.runs import RunData

SCORE_KEY = "critic/score/mean"
KL_KEYS = (
    ("k1", "actor/ref_kl_k1"),
    ("k3", "actor/ref_kl_k3"),
    ("kl_loss", "actor/kl_loss"),
    ("reward penalty", "actor/reward_kl_penalty"),
)


def _num(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def format_duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``."""
    seconds = max(0.0, float(seconds))
    if seconds < 60:
        return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def score_line(run: RunData) -> str | None:
    """``score (critic/score/mean) 0.06 → 0.5 (first → last step 20; mean of the first/last 5 steps: …)``."""
    steps, values = run.series(SCORE_KEY)
    if not steps:
        return None
    line = f"score ({SCORE_KEY}): {_num(values[0])} → {_num(values[-1])} (step {steps[0]} → {steps[-1]})"
    k = min(10, len(values) // 4)
    if k >= 2:
        line += f"; mean of the first/last {k} steps: {_num(_mean(values[:k]))} → {_num(_mean(values[-k:]))}"
    return line


def validation_lines(run: RunData) -> list[str]:
    """One line per validation mean (``val-core/<source>/reward/mean@n``): first → last, with their steps."""
    keys = [k for k in run.val if "/mean@" in k] or list(run.val)
    lines = []
    for key in keys:
        steps, values = run.series(key)
        short = key.split("/", 1)[1] if key.startswith("val-core/") else key
        if len(steps) == 1:
            lines.append(f"validation {short}: {_num(values[0])} (step {steps[0]})")
        else:
            lines.append(
                f"validation {short}: {_num(values[0])} → {_num(values[-1])} (step {steps[0]} → {steps[-1]})"
            )
    return lines


def kl_line(run: RunData) -> str | None:
    """The KL estimates at the last step, with their maximum over the run."""
    parts = []
    for label, key in KL_KEYS:
        _, values = run.series(key)
        if values:
            finite = [v for v in values if math.isfinite(v)]
            peak = f" (max {_num(max(finite))})" if len(finite) > 1 else ""
            parts.append(f"{label} {_num(values[-1])}{peak}")
    return "KL to the reference, last step: " + ", ".join(parts) if parts else None


def _step_time(run: RunData) -> tuple[float, int]:
    """(summed step seconds, steps) of a record."""
    _, step_times = run.series("timing_s/step")
    return sum(t for t in step_times if math.isfinite(t)), len(step_times)


def _steps_part(run: RunData) -> str:
    """``X in N steps (Y/step; the three largest phases' shares)``."""
    total, num_steps = _step_time(run)
    steps = f"{num_steps} step{'s' if num_steps != 1 else ''}"
    part = f"{format_duration(total)} in {steps} ({format_duration(total / num_steps)}/step"
    phases = {
        key.split("/", 1)[1]: sum(v for v in run.series(key)[1] if math.isfinite(v))
        for key in run.train
        if key.startswith("timing_s/") and key not in ("timing_s/step", "timing_s/update_weights")
    }
    top = sorted(phases.items(), key=lambda kv: -kv[1])[:3]
    if total > 0 and top:
        part += "; " + ", ".join(f"{name} {100 * t / total:.0f}%" for name, t in top)
    return part + ")"


def time_line(run: RunData, wall_s: float | None = None, this_start: RunData | None = None) -> str | None:
    """Summed step time, mean per step and the phases' shares (largest first), and ``wall_s`` (the
    invocation's seconds) "in all". With ``this_start`` (the steps this invocation trained) where ``run``
    (the run's record) holds more — a resumed run — the figures are this invocation's, and the run's summed
    step time follows them."""
    wall = f"{format_duration(wall_s)} in all" if wall_s is not None else None
    run_total, run_steps = _step_time(run)
    if this_start is None or _step_time(this_start)[1] == run_steps:  # one invocation trained every step
        if not run_steps:
            return f"time: {wall}" if wall else None
        return "time: " + ", ".join(filter(None, [_steps_part(run), wall]))
    this = _steps_part(this_start) if _step_time(this_start)[1] else "no step trained"
    return (
        "time (this start): "
        + ", ".join(filter(None, [this, wall]))
        + f"; the run: {format_duration(run_total)} in {run_steps} steps"
    )


def events_line(run: RunData) -> str | None:
    if not run.events:
        return None
    counts = Counter(e.kind for e in run.events)
    listed = ", ".join(f"{kind} ×{n}" if n > 1 else kind for kind, n in counts.items())
    return f"monitor events: {len(run.events)} ({listed}; events.jsonl)"


def summary_lines(
    run: RunData,
    *,
    wall_s: float | None = None,
    checkpoint: str | Path | None = None,
    report: str | Path | None = None,
    report_note: str | None = None,
    this_start: RunData | None = None,
) -> list[str]:
    """The summary, one finding per line, first line a header; ``this_start``: see :func:`time_line`."""
    steps = run.steps
    where = f" in {run.path}" if run.path is not None else ""
    lines = [f"run summary: {len(steps)} training step{'s' if len(steps) != 1 else ''}{where}"]
    lines += [line for line in (score_line(run),) if line]
    lines += validation_lines(run) or [
        "validation: none (data.val_files, trainer.val_before_train, trainer.test_freq)"
    ]
    lines += [line for line in (kl_line(run), time_line(run, wall_s, this_start), events_line(run)) if line]
    lines.append(f"checkpoint: {checkpoint}" if checkpoint else "checkpoint: none saved (trainer.save_freq)")
    if report is not None:
        lines.append(f"report: {report}")
    elif report_note:
        lines.append(f"report: {report_note}")
    return lines
