"""A stalled rank names its phase before the collective timeout (NCCL gives no exception to label)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.phase_stall import WORKER
from klppo.parallel import dist as kdist
from klppo.parallel.dist import PhaseWatch, free_port, phase


def test_watch_reports_an_overdue_phase_once_per_entry():
    out = io.StringIO()
    watch = PhaseWatch(10.0, rank=3, stream=out)
    with phase("step"), phase("gen"):
        since = kdist._phase_since
        assert watch.check(now=since + 9.0) is None and out.getvalue() == ""  # not yet overdue
        warned = watch.check(now=since + 12.0)
        assert warned == since
        line = out.getvalue()
        assert "rank 3" in line and "phase 'gen' (step > gen)" in line and "for 12 s" in line
        assert watch.check(now=since + 30.0, warned=warned) == warned  # once per phase entry
        assert out.getvalue() == line
    with phase("gen"):  # a new entry of the same phase is reported again
        assert watch.check(now=kdist._phase_since + 11.0, warned=warned) == kdist._phase_since
    assert out.getvalue().count("rank 3") == 2


def test_watch_thread_starts_and_stops():
    out = io.StringIO()
    watch = PhaseWatch(0.05, rank=0, poll_s=0.01, stream=out).start()
    with phase("update_actor"):
        time.sleep(0.3)
    watch.stop()
    assert "phase 'update_actor'" in out.getvalue()


@pytest.mark.slow
def test_two_ranks_one_stalled_name_both_phases(tmp_path: Path):
    """gloo, 2 processes, collective timeout 2 s: rank 1 sleeps 5 s in 'gen' while rank 0 waits in an
    all-reduce inside 'gather_samples'. Rank 0's error names its phase; rank 1's watch line (at 80% of the
    timeout) names the stalled phase, the cause. The worker is bench/phase_stall.py's (which runs it under
    torchrun, also on NCCL)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, PYTHONPATH=os.environ.get("PYTHONPATH", ""))  # fmt: skip
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env["PYTHONPATH"]])
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), "cpu", "2", "5"], env=env, stderr=subprocess.PIPE, text=True
            )
        )
    errs = [p.communicate(timeout=120)[1] for p in procs]
    assert procs[0].returncode == 3, errs[0]
    assert "phase 'gather_samples' (step > gather_samples)" in errs[0]
    assert "rank 1 has been in phase 'gen' (step > gen)" in errs[1], errs[1]
