"""Do two runs give the same step metrics? Compares two runs' ``metrics.jsonl`` step by step.

Timing, throughput, memory and utilisation keys (``timing_s/``, ``perf/``, …) differ between any two runs
and are left out; every other key must be equal (``--rtol`` 0: bit for bit as printed) on each of the
first ``--steps`` steps. Used to show that a refactor changes no result: run the same command with the same
seed on two commits (``bench/ab.py`` or by hand), then

    python3 bench/compare_metrics.py RUN_A/metrics.jsonl RUN_B/metrics.jsonl --steps 5

Prints one line per step (equal keys, differing keys with both values) and exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

VOLATILE = ("timing_s/", "timing_per_token_ms/", "perf/", "bench/", "time/")
"""Prefixes of keys that measure time, speed or memory: never equal between two runs."""
VOLATILE_SUFFIXES = ("_s", "_ms", "_gb", "_per_s")
"""Suffixes of such keys elsewhere (``rollout/time_s``, ``rollout/kv_cache_gb``, …)."""


def volatile(key: str) -> bool:
    return key.startswith(VOLATILE) or key.endswith(VOLATILE_SUFFIXES)


def read_steps(path: Path) -> dict[int, dict[str, float]]:
    """Step → that step's metrics (the last record of a step wins), from a ``metrics.jsonl``."""
    steps: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        step = record.get("step")
        if step is None:
            continue
        data = record.get("data", record)
        steps.setdefault(int(step), {}).update({k: v for k, v in data.items() if k != "step"})
    return steps


def differences(a: dict, b: dict, *, rtol: float) -> list[str]:
    """Keys whose values differ (beyond ``rtol``), volatile keys left out; a key in one run only differs."""
    out = []
    for key in sorted(set(a) | set(b)):
        if volatile(key):
            continue
        x, y = a.get(key), b.get(key)
        if isinstance(x, (int, float)) and isinstance(y, (int, float)):
            if math.isnan(x) and math.isnan(y):
                continue
            if abs(x - y) <= rtol * max(abs(x), abs(y)):
                continue
        elif x == y:
            continue
        out.append(f"{key}: {x!r} vs {y!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rtol", type=float, default=0.0)
    args = parser.parse_args(argv)
    a, b = read_steps(args.a), read_steps(args.b)
    bad = 0
    for step in range(1, args.steps + 1):
        if step not in a or step not in b:
            print(f"step {step}: missing in {'A' if step not in a else 'B'}")
            bad += 1
            continue
        diff = differences(a[step], b[step], rtol=args.rtol)
        compared = [k for k in set(a[step]) | set(b[step]) if not volatile(k)]
        print(f"step {step}: {len(compared) - len(diff)} of {len(compared)} keys equal")
        for line in diff:
            print("  " + line)
        bad += bool(diff)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
