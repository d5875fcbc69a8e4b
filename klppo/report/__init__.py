"""Looking at runs: `klppo report RUN_DIR [RUN_DIR ...]` draws a run's metrics (several runs overlaid) into
one self-contained HTML page plus PNGs, and `summary_lines` is the summary printed at the end of a run.

Reads only the run directory (``metrics.jsonl``, ``events.jsonl``); knows nothing of the trainer. The
figures need matplotlib (``pip install 'klppo[plot]'``), imported when drawing.
"""

from klppo.report.page import Report, build_report
from klppo.report.runs import RunData, load_run, run_from_history
from klppo.report.summary import summary_lines

__all__ = ["Report", "RunData", "build_report", "load_run", "run_from_history", "summary_lines"]
