"""``<run_dir>/events.jsonl``: what the run's operating rules did, one JSON object per line.

Each line: ``{"step": int, "rule": str, "action": str, "message": str, ...rule-specific numbers,
"time": ISO-8601 UTC}``; the run's last line is ``{"rule": "summary", ...}`` with counts per rule. Like
``metrics.jsonl``, a resumed run first drops the lines of steps after its checkpoint (and old summaries),
so the file reads as the uninterrupted run's. Non-finite numbers are written as strings ("nan", "inf")
so every line is strict JSON. Ranks other than 0 write nothing.
"""

from __future__ import annotations

import json
import math
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

FILENAME = "events.jsonl"


def _strict(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class EventLog:
    def __init__(self, run_dir: str | Path, *, rank: int = 0, resume_step: int | None = None) -> None:
        self.path = Path(run_dir) / FILENAME
        self.rank = rank
        if rank == 0 and resume_step is not None and self.path.exists():
            self._truncate_after(resume_step)

    def write(self, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = {k: _strict(v) for k, v in record.items()}
        line["time"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, default=str) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.exists():
            return []
        return [
            json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()
        ]

    def _truncate_after(self, resume_step: int) -> None:
        kept = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:  # a line cut by a crash mid-write
                continue
            if record.get("rule") != "summary" and record.get("step", 0) <= resume_step:
                kept.append(line + "\n")
        tmp = self.path.with_name(f".{FILENAME}.tmp-{os.getpid()}")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)
