"""`klppo report RUN_DIR [RUN_DIR ...] [--output DIR] [--dpi N]`: the run report (see `klppo.report`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from klppo.config.flags import FlagParser
from klppo.report.page import PAGE_NAME, PNG_DIR, build_report
from klppo.report.runs import load_run, unique_names


def _parser() -> argparse.ArgumentParser:
    parser = FlagParser(
        prog="klppo report",
        description="Draw runs' metrics (score, KL, entropy, lengths, advantages, timing, throughput, "
        f"memory, validation, monitor events) into one HTML page ({PAGE_NAME}, figures embedded) and PNGs "
        f"({PNG_DIR}/*.png). Several runs are overlaid, one colour each.",
    )
    parser.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="run directories (trainer.default_local_dir)"
    )
    parser.add_argument(
        "--output",
        "-o",
        metavar="DIR",
        default=None,
        help="where to write the page and PNGs (default: the run directory for one run, "
        "./klppo-report for several)",
    )
    parser.add_argument("--dpi", type=int, default=100, help="PNG resolution (default 100)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    paths = [Path(p) for p in args.runs]
    try:
        runs = [load_run(path, name=name) for path, name in zip(paths, unique_names(paths))]
        out_dir = (
            Path(args.output) if args.output else (paths[0] if len(paths) == 1 else Path("klppo-report"))
        )
        report = build_report(runs, out_dir, dpi=args.dpi)
    except (FileNotFoundError, ImportError, ValueError) as exc:
        print(f"klppo report: {exc}", file=sys.stderr)
        return 2
    for run in runs:
        if run.num_bad_lines:
            print(
                f"klppo report: {run.path}: {run.num_bad_lines} unreadable line(s) skipped", file=sys.stderr
            )
    drawn = ", ".join(f.spec.slug for f in report.figures)
    print(
        f"report: {report.page} ({len(report.figures)} figures: {drawn}; PNGs in "
        f"{report.page.parent / PNG_DIR})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
