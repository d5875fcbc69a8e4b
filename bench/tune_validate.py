"""Validate `klppo tune` on one GPU: memory model vs measured peak (0.5B, 1.5B shapes), and the tuner's
pick for the 1.5B shape vs the tuning guides' settings.

    PYTHONPATH=$PWD python bench/tune_validate.py --out $OUT [--small-budget 50] [--tune-budget 100]

Part A: a validation grid on Qwen2.5-0.5B (thresholds 0 / 1e8 / whole × reshard / prefetch variants ×
micro-batch tokens × offload off/idle) within --small-budget seconds: predicted vs measured update peak.
Part B: `klppo tune --model-shape Qwen2.5-1.5B` (no config: verl defaults — prompt 512 + response 512,
checkpointing on, 16384-token micro-batches) within --tune-budget seconds; then the guides' settings
(min_num_params 0 + param/optimizer offload; 1e8 without offload) at 16384 tokens, measured fresh.
Writes JSON and the plot under --out; run with --shape-small/--shape-big tiny names for a CPU smoke test.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch


def _row(m) -> dict:
    d = asdict(m)
    d["err"] = (
        (m.predicted_bytes - m.peak_bytes) / m.peak_bytes if m.status == "ok" and m.peak_bytes > 0 else None
    )
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def part_a(shape: str, budget_s: float, tokens: list[int], out: Path, device: torch.device) -> list[dict]:
    from klppo.tune.grid import build_grid, order, run_sweep
    from klppo.tune.measure import measure_point, safe_measure
    from klppo.tune.memory import Workload
    from klppo.tune.shapes import load_model_config
    from klppo.tune.units import WHOLE_MODEL, ModelFacts

    facts = ModelFacts.from_config(load_model_config(shape))
    gb = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else 80 * 2**30
    w = Workload(device_bytes=gb, compute_bytes=2 if device.type == "cuda" else 4)
    points = build_grid(
        facts, thresholds=[0, 10**8, WHOLE_MODEL], offloads=["off", "idle"], micro_tokens=tokens
    )
    points = order(points, None)

    def measure(p):
        return safe_measure(
            lambda: measure_point(facts.config, p, w, device=device, seq_len=1024, profile=False), p, device
        )

    results = run_sweep(facts, points, w, measure=measure, budget_s=budget_s, headroom=0.95)
    rows = [dict(_row(m), shape=shape) for m in results]
    (out / f"validate_{Path(shape).name}.json").write_text(json.dumps(rows, indent=1, default=str))
    return rows


def part_b(shape: str, budget_min: float, tokens: int, out: Path, device: torch.device) -> dict:
    from klppo.tune import cli
    from klppo.tune.measure import measure_point, safe_measure
    from klppo.tune.memory import Point, Workload, predict
    from klppo.tune.shapes import load_model_config
    from klppo.tune.units import ModelFacts

    t0 = time.perf_counter()
    rc = cli.main(
        [
            "--model-shape",
            shape,
            "--budget-minutes",
            str(budget_min),
            "--micro-tokens",
            f"{tokens // 2},{tokens}",
            "--out",
            str(out / "tune"),
        ]
    )
    tune_s = time.perf_counter() - t0
    facts = ModelFacts.from_config(load_model_config(shape))
    gb = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else 80 * 2**30
    w = Workload(device_bytes=gb, compute_bytes=2 if device.type == "cuda" else 4)
    guides = {
        "guide: 0 + offload": Point(0, "idle", micro_tokens=tokens),
        "guide: 1e8, no offload": Point(10**8, "off", micro_tokens=tokens),
    }
    rows = {}
    for name, p in guides.items():
        m = safe_measure(
            lambda p=p: measure_point(facts.config, p, w, device=device, seq_len=1024, profile=False),
            p,
            device,
        )
        m.predicted_bytes = predict(facts, p, w)["update"].total
        rows[name] = _row(m)
        print(name, rows[name], flush=True)
    result = {"rc": rc, "tune_wall_s": tune_s, "guides": rows}
    (out / "guides.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def replot(results: Path, shape: str, png: Path, device_gb: float, num_micro: int = 2) -> None:
    """Re-rank a device run's ``results.json`` with the current model; print the table, write the plot."""
    from rich.console import Console

    from klppo.tune import report
    from klppo.tune.measure import Measurement
    from klppo.tune.memory import Point, Workload, predict
    from klppo.tune.shapes import load_model_config
    from klppo.tune.units import ModelFacts

    facts = ModelFacts.from_config(load_model_config(shape))
    w = Workload(device_bytes=int(device_gb * 2**30))
    ms = []
    for r in json.loads(results.read_text()):
        p = Point(**(r["point"] if isinstance(r["point"], dict) else eval(r["point"])))  # noqa: S307 (own file)
        nan = float("nan")
        m = Measurement(
            p,
            r["status"],
            r["peak_bytes"] or nan,
            r["step_s"] or nan,
            r["exposed_comm_s"] or nan,
            r["comm_s"] or nan,
            predict(facts, p, w)["update"].total,
            r["note"] or "",
        )
        ms.append(m)
    ranked = report.rank(facts, ms, w, 0.9, num_micro)
    Console(width=200).print(report.results_table(ranked, num_micro, w.device_bytes))
    report.plot(ranked, num_micro, png, w.device_bytes, 0.9)
    pick = report.best(ranked, num_micro)
    print("pick:", pick.point if pick else None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--replot", nargs=2, metavar=("RESULTS_JSON", "PNG"), help="re-rank a run's results")
    ap.add_argument("--device-gb", type=float, default=139.8)
    ap.add_argument("--shape-small", default="Qwen2.5-0.5B")
    ap.add_argument("--shape-big", default="Qwen2.5-1.5B")
    ap.add_argument("--small-budget", type=float, default=50)
    ap.add_argument("--tune-budget", type=float, default=100)
    ap.add_argument("--tokens", type=int, default=16384)
    args = ap.parse_args()
    if args.replot:
        replot(Path(args.replot[0]), args.shape_big, Path(args.replot[1]), args.device_gb)
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    from klppo.parallel.dist import init_distributed

    init_distributed(device.type, 600)
    if device.type == "cuda":
        print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    status = 0
    for name, fn in [
        (
            "A",
            lambda: part_a(args.shape_small, args.small_budget, [args.tokens // 4, args.tokens], out, device),
        ),
        ("B", lambda: part_b(args.shape_big, args.tune_budget / 60, args.tokens, out, device)),
    ]:
        try:
            fn()
        except Exception:
            traceback.print_exc()
            status = 1
            print(f"part {name} failed", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
