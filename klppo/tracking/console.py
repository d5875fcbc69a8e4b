"""Console tracker: one compact line per step on stdout, and a progress bar over steps on stderr.

A training line reads (fields absent from the metrics are left out)::

    step 3/20 | score 0.25 | reward 0.248 | kl 0.0012 | pg_loss -0.0312 | vf_loss 0.12 | entropy 1.23 |
    resp_len 87 | 10.2 s (gen 7.1 s) | 512 tok/s

(on one line). A validation line (only ``val-*`` keys) reads ``val @ step 3 | <source>/reward/mean@1
0.42 | ...``. The bar (tqdm) is shown only on a terminal; without it (output to a file or a pipe) each
training line ends with the progress the bar would show: ``| 15% | 1:02 elapsed | eta 5:48``.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from tqdm.auto import tqdm

# (label, metric keys tried in order, format)
LINE_FIELDS: list[tuple[str, tuple[str, ...], str]] = [
    ("score", ("critic/score/mean",), "{:.4g}"),
    ("reward", ("critic/rewards/mean",), "{:.4g}"),
    ("kl", ("actor/kl_loss", "actor/reward_kl_penalty"), "{:.3g}"),
    ("pg_loss", ("actor/pg_loss",), "{:.4g}"),
    ("vf_loss", ("critic/vf_loss",), "{:.4g}"),
    ("entropy", ("actor/entropy",), "{:.3g}"),
    ("resp_len", ("response_length/mean",), "{:.0f}"),
]


def _fmt(fmt: str, value: float) -> str:
    return fmt.format(value) if math.isfinite(value) else str(value)


def format_step_line(values: dict[str, float | int], step: int, total: int | None = None) -> str:
    """The one-line summary of a step's metrics (see the module docstring)."""
    if values and all(key.startswith("val-") for key in values):
        parts = [f"val @ step {step}"]
        for key, value in values.items():
            short = key.split("/", 1)[1] if key.startswith("val-core/") else key
            parts.append(f"{short} {_fmt('{:.4g}', float(value))}")
        return " | ".join(parts)
    parts = [f"step {step}" + (f"/{total}" if total else "")]
    for label, keys, fmt in LINE_FIELDS:
        for key in keys:
            if key in values:
                parts.append(f"{label} {_fmt(fmt, float(values[key]))}")
                break
    if "timing_s/step" in values:
        timing = f"{values['timing_s/step']:.1f} s"
        if "timing_s/gen" in values:
            timing += f" (gen {values['timing_s/gen']:.1f} s)"
        parts.append(timing)
    if "perf/throughput" in values:
        parts.append(f"{values['perf/throughput']:.0f} tok/s")
    return " | ".join(parts)


def _clock(seconds: float) -> str:
    """``m:ss`` or ``h:mm:ss``."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def format_progress(step: int, total: int, *, elapsed_s: float, steps_done: int) -> str:
    """``15% | 1:02 elapsed | eta 5:48``: the share of ``total`` steps reached at ``step``, and the time
    left at the mean pace of the ``steps_done`` steps of ``elapsed_s``."""
    text = f"{100 * step / max(total, 1):.0f}% | {_clock(elapsed_s)} elapsed"
    if steps_done > 0 and step < total:
        text += f" | eta {_clock(elapsed_s / steps_done * (total - step))}"
    return text


class ConsoleBackend:
    """Prints `format_step_line` for every ``log``; drives a tqdm bar after ``set_total_steps`` (on a
    terminal), or appends `format_progress` to training lines (elsewhere)."""

    def __init__(self, *, stream: Any = None, **_: Any) -> None:
        self.stream = stream
        self.total: int | None = None
        self.bar = None
        self._start: float | None = None
        self._initial = 0

    def set_total_steps(self, total: int, *, initial: int = 0) -> None:
        self.total = int(total)
        if self.bar is not None:
            self.bar.close()
        # disable=None: no bar when stderr is not a terminal (CI logs, nohup)
        self.bar = tqdm(
            total=self.total, initial=initial, unit="step", desc="klppo", disable=None, leave=True
        )
        self._start, self._initial = time.monotonic(), int(initial)

    def log(self, values: dict[str, float | int], step: int) -> None:
        line = format_step_line(values, step, self.total)
        stream = self.stream if self.stream is not None else sys.stdout
        if self.bar is not None and not self.bar.disable:
            self.bar.write(line, file=stream)
        else:
            training = not (values and all(key.startswith("val-") for key in values))
            if self.total and self._start is not None and training:
                elapsed = time.monotonic() - self._start
                line += " | " + format_progress(
                    step, self.total, elapsed_s=elapsed, steps_done=step - self._initial
                )
            print(line, file=stream, flush=True)
        if self.bar is not None and step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
