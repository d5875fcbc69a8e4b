"""The end of a run on rank 0: the run report written into the run directory and the summary printed.

The record is ``<run dir>/metrics.jsonl`` (all steps, those of earlier starts of a resumed run included);
without the ``jsonl`` logger, the tracker's in-memory record of this start. Neither the report nor the
summary can fail the run: a missing matplotlib skips the report with a one-line note, any other error in
drawing is reported in the summary's last line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from klppo.ops.checkpoint import latest_checkpoint
from klppo.report import build_report, load_run, run_from_history, summary_lines

log = logging.getLogger("klppo")

PLOT_HINT = "pip install 'klppo[plot]'"


def write_report(run: Any, run_dir: Path) -> tuple[Path | None, str | None]:
    """(report page, None) or (None, why not)."""

    try:
        return build_report([run], run_dir).page, None
    except ImportError:
        return None, f"skipped: matplotlib is not installed ({PLOT_HINT}, then `klppo report {run_dir}`)"
    except Exception as exc:  # a report must not fail a finished run
        log.warning("the run report could not be drawn: %s", exc, exc_info=True)
        return None, f"not written ({type(exc).__name__}: {exc})"


def finish_run(run_dir: Path, *, history: list[tuple[int, dict[str, float]]], wall_s: float) -> list[str]:
    """Write the report, print the summary (call on rank 0); returns the summary lines."""

    run_dir = Path(run_dir)
    this_start = run_from_history(run_dir.name, history)
    if (run_dir / "metrics.jsonl").is_file():
        run = load_run(run_dir)
    else:
        run = this_start
        run.path = run_dir
    page, note = write_report(run, run_dir)
    lines = summary_lines(
        run,
        wall_s=wall_s,
        checkpoint=latest_checkpoint(run_dir),
        report=page,
        report_note=note,
        this_start=this_start,
    )
    print("\n".join(["klppo " + lines[0], *("  " + line for line in lines[1:])]), flush=True)
    return lines
