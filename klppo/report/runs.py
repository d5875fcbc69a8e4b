"""Reading a run directory for the report: ``metrics.jsonl`` (training and validation lines) and the
monitor's ``events.jsonl``.

Reading is forgiving, because a report is most wanted for a run that went wrong: a line cut by a crash
or not a JSON object is skipped and counted; a value written as ``null``, ``NaN``/``Infinity`` (Python's
JSON extensions) or a string such as ``"nan"`` / ``"inf"`` becomes a non-finite float; other non-numeric
values are left out. A step logged twice keeps its last value (the record of a resumed run).

A line whose metric keys all start with ``val-`` is a validation line (``val-core/<source>/reward/mean@n``,
logged at the step it follows, 0 before training); every other line is a training step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
EVENTS_FILE = "events.jsonl"

_NON_FINITE_WORDS = {
    "nan": math.nan,
    "inf": math.inf,
    "+inf": math.inf,
    "-inf": -math.inf,
    "infinity": math.inf,
    "+infinity": math.inf,
    "-infinity": -math.inf,
}


@dataclass(frozen=True)
class Event:
    """One monitor event: the step it happened at, its kind (rule or action) and its message."""

    step: int
    kind: str
    message: str


@dataclass
class RunData:
    """A run's record: ``train[key] = {step: value}`` and ``val[key] = {step: value}``; events by step."""

    name: str
    path: Path | None = None
    train: dict[str, dict[int, float]] = field(default_factory=dict)
    val: dict[str, dict[int, float]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    num_bad_lines: int = 0

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric in step order (training or validation); empty when not logged."""
        points = self.train.get(key) or self.val.get(key) or {}
        steps = sorted(points)
        return steps, [points[s] for s in steps]

    def keys(self) -> list[str]:
        return [*self.train, *self.val]

    @property
    def steps(self) -> list[int]:
        """The training steps logged, in order."""
        return sorted({s for points in self.train.values() for s in points})

    def add_record(self, record: Mapping[str, Any]) -> None:
        """File one metrics line ``{"step": int, key: value, ...}`` (see the module docstring)."""
        step = to_float(record.get("step"))
        if step is None or not math.isfinite(step):
            self.num_bad_lines += 1
            return
        values = {
            k: v for k, v in ((k, to_float(v)) for k, v in record.items() if k != "step") if v is not None
        }
        if not values:
            return
        target = self.val if all(k.startswith("val-") for k in values) else self.train
        for key, value in values.items():
            target.setdefault(key, {})[int(step)] = value


def to_float(value: Any) -> float | None:
    """A metric value as a float: numbers as they are, ``None`` and non-finite words as NaN/±inf; None
    for anything else (booleans count as 0/1)."""
    if value is None:
        return math.nan
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _NON_FINITE_WORDS:
            return _NON_FINITE_WORDS[word]
        try:
            return float(word)
        except ValueError:
            return None
    return None


def json_lines(path: Path) -> tuple[list[dict[str, Any]], int]:
    """The JSON objects of a JSON-lines file, and the number of lines that were not one."""
    records, bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad


def is_run_summary(record: Mapping[str, Any]) -> bool:
    """The monitor's last line (``"rule": "summary"``): counts for the run, not an event at a step."""
    return record.get("rule") == "summary" or record.get("action") == "summary"


def parse_event(record: Mapping[str, Any]) -> Event | None:
    """An ``events.jsonl`` line as an `Event` (None without a step). The monitor writes ``{"step", "rule",
    "action", "message", ...}``: the kind is ``rule → action``; otherwise the first of ``kind``/``event``/
    ``type``. The message is the first of ``message``/``msg``/``detail``."""
    step = to_float(record.get("step"))
    if step is None or not math.isfinite(step):
        return None
    rule, action = record.get("rule"), record.get("action")
    if rule and action and action != rule:
        kind = f"{rule} → {action}"
    else:
        names = (rule, action, *(record.get(k) for k in ("kind", "event", "type")))
        kind = next((str(n) for n in names if n), "event")
    message = next((str(record[k]) for k in ("message", "msg", "detail") if k in record), "")
    return Event(step=int(step), kind=kind, message=message)


def load_run(run_dir: str | Path, *, name: str | None = None) -> RunData:
    """Read ``<run_dir>/metrics.jsonl`` (required) and ``<run_dir>/events.jsonl`` (when present)."""
    root = Path(run_dir)
    metrics = root / METRICS_FILE
    if not metrics.is_file():
        what = "is not a directory" if not root.is_dir() else f"has no {METRICS_FILE}"
        raise FileNotFoundError(
            f"{root} {what}: a run directory is trainer.default_local_dir of a run that logged with `jsonl` "
            "in trainer.logger (the default)"
        )
    run = RunData(name=name or root.resolve().name, path=root)
    records, run.num_bad_lines = json_lines(metrics)
    for record in records:
        run.add_record(record)
    if (root / EVENTS_FILE).is_file():
        events, bad = json_lines(root / EVENTS_FILE)
        parsed = [parse_event(r) for r in events if not is_run_summary(r)]
        run.events = sorted((e for e in parsed if e is not None), key=lambda e: e.step)
        run.num_bad_lines += bad + sum(e is None for e in parsed)
    return run


def run_from_history(name: str, history: Iterable[tuple[int, Mapping[str, float]]]) -> RunData:
    """A `RunData` from ``(step, metrics)`` pairs (the tracker's in-memory record)."""
    run = RunData(name=name)
    for step, values in history:
        run.add_record({"step": step, **values})
    return run


def unique_names(paths: list[Path]) -> list[str]:
    """Short legend names for run directories: the last path component, or as many trailing components
    as it takes to tell them apart."""
    parts = [Path(p).resolve().parts for p in paths]
    for depth in range(1, max((len(p) for p in parts), default=1) + 1):
        names = ["/".join(p[-depth:]) for p in parts]
        if len(set(names)) == len(names):
            return names
    return [str(p) for p in paths]
