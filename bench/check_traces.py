"""Check the torch-profiler traces a run wrote with ``global_profiler.tool=torch``.

    python bench/check_traces.py DIR --steps 1 3 [--cuda] [--max-mib 16]

DIR is ``<global_profiler.save_path>/torch``. Passes (exit 0) when exactly the listed steps have traces
(``step_<s>_rank_<r>.trace.json.gz``, every rank), each is smaller than ``--max-mib`` MiB gzipped, parses as
Chrome-trace JSON (a ``traceEvents`` list of complete events), holds the trainer's phase ranges
(``phase/update_actor`` …) and, with ``--cuda``, CUDA kernel events (``cat: kernel``). One line per trace,
then PASS or FAIL with the reasons; ``--json`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

_NAME = re.compile(r"^step_(\d+)(?:-(\d+))?_rank_(\d+)\.trace\.json\.gz$")


def inspect_trace(path: Path) -> dict:
    """Size, event counts and phase names of one gzipped Chrome trace."""
    size = path.stat().st_size
    with gzip.open(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError("traceEvents is not a list")
    complete = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"]
    kernels = [e for e in complete if e.get("cat") == "kernel"]
    phases = sorted({e["name"] for e in complete if str(e.get("name", "")).startswith("phase/")})
    return {
        "file": path.name,
        "mib_gz": size / 2**20,
        "events": len(events),
        "complete_events": len(complete),
        "cuda_kernels": len(kernels),
        "phases": phases,
    }


def check(directory: Path, steps: list[int], *, cuda: bool, max_mib: float) -> tuple[list[dict], list[str]]:
    """(one report per trace, problems); no problems = pass."""
    problems: list[str] = []
    files = sorted(directory.glob("*.trace.json.gz")) if directory.is_dir() else []
    if not files:
        return [], [f"no *.trace.json.gz under {directory}"]
    found: set[int] = set()
    reports = []
    for path in files:
        m = _NAME.match(path.name)
        if not m:
            problems.append(f"{path.name}: unexpected file name")
            continue
        first, last = int(m.group(1)), int(m.group(2) or m.group(1))
        found.update(range(first, last + 1))
        try:
            report = inspect_trace(path)
        except (OSError, ValueError, KeyError, json.JSONDecodeError) as exc:
            problems.append(f"{path.name}: not a gzipped Chrome trace ({exc})")
            continue
        reports.append(report)
        if report["mib_gz"] >= max_mib:
            problems.append(f"{path.name}: {report['mib_gz']:.1f} MiB gzipped ≥ {max_mib} MiB")
        if report["complete_events"] == 0:
            problems.append(f"{path.name}: no complete (ph=X) events")
        if "phase/update_actor" not in report["phases"]:
            problems.append(f"{path.name}: no phase/update_actor range")
        if cuda and report["cuda_kernels"] == 0:
            problems.append(f"{path.name}: no CUDA kernel events")
    if found != set(steps):
        problems.append(f"traces of steps {sorted(found)}, expected exactly {sorted(steps)}")
    return reports, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--steps", type=int, nargs="+", required=True)
    parser.add_argument("--cuda", action="store_true", help="require CUDA kernel events")
    parser.add_argument("--max-mib", type=float, default=16.0)
    parser.add_argument("--json", type=Path, help="also write the reports and problems here")
    args = parser.parse_args(argv)
    reports, problems = check(args.directory, args.steps, cuda=args.cuda, max_mib=args.max_mib)
    for r in reports:
        print(
            f"{r['file']}: {r['mib_gz']:.2f} MiB gz, {r['events']} events, {r['cuda_kernels']} CUDA kernels, "
            f"phases {', '.join(p[6:] for p in r['phases'])}"
        )
    print("PASS" if not problems else "FAIL\n  " + "\n  ".join(problems))
    if args.json:
        args.json.write_text(json.dumps({"reports": reports, "problems": problems}, indent=2) + "\n")
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
