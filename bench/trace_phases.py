"""Where a training step's wall time goes, per trainer phase, from a torch.profiler Chrome trace.

    python bench/trace_phases.py TRACE.json.gz [--top 8] [--json OUT.json]

To get a trace, add ``global_profiler.tool=torch,global_profiler.steps=[60],global_profiler.save_path=DIR``
to a run's overrides; the trainer writes ``DIR/torch/step_60_rank_<r>.trace.json.gz`` (gzipped Chrome-trace
JSON; plain ``.json`` is read too). Every ``phase/<name>`` range the trainer opens (gen, ref, old_log_prob,
update_actor, …; ``phase/step`` holds the others) gets one line: its host wall time, the union of its CUDA
kernel intervals (``kernel_busy_s``; copies and memsets apart as ``memcpy_s``), kernel / launch / CPU-operator
counts, the time the host waited on the device (``sync_s``: ``*Synchronize*``, blocking ``*Memcpy*`` calls
and ``cudaMemcpyAsync`` into pageable memory, which blocks as well), and ``busy`` = kernel_busy_s / wall_s.
A low busy share with little sync time means the phase is host-bound (Python, dispatch, launches); near
100% it is kernel-bound. ``busy`` can exceed 100%: a kernel counts where it was launched, and one launched
late in a phase may run during the next one. Under each line: the kernels with
the most time, and the CPU operators by count and by self time (own duration less that of the operators
directly inside it on the same thread). A phase that occurs several times is summed under its name.

A device event belongs to the phase in which the host launched it: the runtime call (``cuda_runtime`` /
``cuda_driver``) with the kernel's ``correlation`` id has its CPU timestamp inside the phase's range. A
device event with no matching call is placed by its start: inside the phase's ``gpu_user_annotation`` range
of the same name, or, where the phase has none, inside its CPU range. Traces of CPU runs give zeros.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import sys
from collections import defaultdict
from pathlib import Path

from klppo.tune.intervals import union_length

US = 1e-6  # Chrome-trace timestamps and durations are microseconds
RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
COPY_CATS = ("gpu_memcpy", "gpu_memset")
NAME_CHARS = 70


def load_events(path: Path) -> list[dict]:
    """The trace's events (``traceEvents`` of a gzipped or plain Chrome-trace JSON file)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    return [e for e in events if isinstance(e, dict)]


def self_times(cpu_ops: list[dict]) -> dict[int, float]:
    """Self time (µs) of each CPU operator, by ``id(event)``: its duration less the durations of the
    operators directly nested in it on the same (pid, tid)."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in cpu_ops:
        by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out: dict[int, float] = {}
    for ops in by_thread.values():
        ops.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[dict] = []
        for e in ops:
            out[id(e)] = e["dur"]
            while stack and stack[-1]["ts"] + stack[-1]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                out[id(stack[-1])] -= e["dur"]
            stack.append(e)
    return {k: max(v, 0.0) for k, v in out.items()}


class _Sorted:
    """Events sorted by start, for the ones starting inside [a, b]."""

    def __init__(self, events: list[dict]) -> None:
        self.events = sorted(events, key=lambda e: e["ts"])
        self.starts = [e["ts"] for e in self.events]

    def within(self, a: float, b: float) -> list[dict]:
        return self.events[bisect.bisect_left(self.starts, a) : bisect.bisect_right(self.starts, b)]


def _top(totals: dict[str, list[float]], key: int, n: int) -> list[dict]:
    """``totals``: name → [seconds, count]; the n largest by ``key`` (0: seconds, 1: count)."""
    rows = sorted(totals.items(), key=lambda kv: (-kv[1][key], -kv[1][1 - key], kv[0]))[:n]
    return [{"name": name[:NAME_CHARS], "total_s": s, "count": int(c)} for name, (s, c) in rows]


def _is_launch(name: str) -> bool:
    return "launch" in name.lower()  # cudaLaunchKernel(ExC), cuLaunchKernel(Ex), cudaGraphLaunch, …


def _is_sync(name: str) -> bool:
    low = name.lower()
    return "synchronize" in low or ("memcpy" in low and "async" not in low)


def _waits_for_pageable_copy(name: str, device_events) -> bool:
    """A ``cudaMemcpyAsync`` into pageable host memory (``.item()``, ``.tolist()``, ``.cpu()``) returns only
    when the copy is done, after all the work queued before it: the host waits there too."""
    return "memcpy" in name.lower() and any(
        d.get("cat") == "gpu_memcpy" and "DtoH" in str(d.get("name")) and "Pageable" in str(d.get("name"))
        for d in device_events
    )


def summarize(events: list[dict], *, top: int = 8) -> dict:
    """The per-phase and whole-trace numbers (see the module docstring); times in seconds."""
    complete = [
        e if "dur" in e else {**e, "dur": 0}
        for e in events
        if e.get("ph") == "X" and isinstance(e.get("ts"), (int, float))
    ]
    phases = sorted(
        (
            e
            for e in complete
            if str(e.get("name", "")).startswith("phase/") and e.get("cat") != "gpu_user_annotation"
        ),
        key=lambda e: (e["ts"], -e["dur"]),
    )
    gpu_ranges: dict[str, list[dict]] = defaultdict(list)
    for e in complete:
        if e.get("cat") == "gpu_user_annotation" and str(e.get("name", "")).startswith("phase/"):
            gpu_ranges[e["name"]].append(e)
    cpu_ops = [e for e in complete if e.get("cat") == "cpu_op"]
    runtime = [e for e in complete if e.get("cat") in RUNTIME_CATS]
    device = [e for e in complete if e.get("cat") == "kernel" or e.get("cat") in COPY_CATS]
    selfs = self_times(cpu_ops)

    launched_at: dict = {}  # correlation id → the runtime call that launched it
    for e in runtime:
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            launched_at[corr] = e
    by_corr: dict = defaultdict(list)
    orphans = []  # device events whose launch is not in the trace
    for e in device:
        corr = (e.get("args") or {}).get("correlation")
        (by_corr[corr] if corr is not None and corr in launched_at else orphans).append(e)
    ops_s, runtime_s, orphans_s = _Sorted(cpu_ops), _Sorted(runtime), _Sorted(orphans)

    acc: dict[str, dict] = {}
    for ph in phases:
        a, b, pid = ph["ts"], ph["ts"] + ph["dur"], ph.get("pid")
        p = acc.setdefault(
            ph["name"], {"count": 0, "wall": 0.0, "sync": 0.0, "launches": 0, "ops": [], "device": {}}
        )
        p["count"] += 1
        p["wall"] += ph["dur"]
        for r in runtime_s.within(a, b):
            if r.get("pid") != pid:
                continue
            name = str(r.get("name", ""))
            p["launches"] += _is_launch(name)
            copies = by_corr.get((r.get("args") or {}).get("correlation"), ())
            if _is_sync(name) or _waits_for_pageable_copy(name, copies):
                p["sync"] += min(r["ts"] + r["dur"], b) - r["ts"]
            for d in copies:
                p["device"][id(d)] = d
        windows = [(g["ts"], g["ts"] + g["dur"]) for g in gpu_ranges.get(ph["name"], []) if a <= g["ts"] <= b]
        for lo, hi in windows or [(a, b)]:
            for d in orphans_s.within(lo, hi):
                p["device"][id(d)] = d
        p["ops"].extend(o for o in ops_s.within(a, b) if o.get("pid") == pid)

    rows = []
    for name, p in acc.items():
        kernels = [d for d in p["device"].values() if d.get("cat") == "kernel"]
        copies = [d for d in p["device"].values() if d.get("cat") in COPY_CATS]
        ops = {id(o): o for o in p["ops"]}.values()
        k_tot: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for k in kernels:
            k_tot[str(k.get("name", ""))][0] += k["dur"] * US
            k_tot[str(k.get("name", ""))][1] += 1
        o_tot: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        for o in ops:
            o_tot[str(o.get("name", ""))][0] += selfs[id(o)] * US
            o_tot[str(o.get("name", ""))][1] += 1
        busy = union_length([(k["ts"], k["ts"] + k["dur"]) for k in kernels]) * US
        wall = p["wall"] * US
        rows.append(
            {
                "phase": name[len("phase/") :],
                "count": p["count"],
                "wall_s": wall,
                "kernel_busy_s": busy,
                "busy_share": busy / wall if wall > 0 else 0.0,
                "memcpy_s": union_length([(c["ts"], c["ts"] + c["dur"]) for c in copies]) * US,
                "n_kernels": len(kernels),
                "n_memcpy": len(copies),
                "n_launches": p["launches"],
                "n_cpu_ops": len(ops),
                "sync_s": p["sync"] * US,
                "top_kernels": _top(k_tot, 0, top),
                "top_ops_by_count": _top(o_tot, 1, top),
                "top_ops_by_self": _top(o_tot, 0, top),
            }
        )

    if complete:
        start = min(e["ts"] for e in complete)
        span = max(e["ts"] + e["dur"] for e in complete) - start
    else:
        span = 0.0
    all_kernels = [(e["ts"], e["ts"] + e["dur"]) for e in device if e.get("cat") == "kernel"]
    busy_all = union_length(all_kernels) * US
    whole = {
        "span_s": span * US,
        "kernel_busy_s": busy_all,
        "busy_share": busy_all / (span * US) if span > 0 else 0.0,
        "memcpy_s": union_length([(e["ts"], e["ts"] + e["dur"]) for e in device if e.get("cat") in COPY_CATS])
        * US,
        "n_kernels": len(all_kernels),
        "outside_phases_s": (span - union_length([(e["ts"], e["ts"] + e["dur"]) for e in phases])) * US,
    }
    return {"whole": whole, "phases": rows}


def _ms(s: float) -> str:
    return f"{s * 1e3:10.2f}"


def format_table(summary: dict) -> str:
    w = summary["whole"]
    lines = [
        f"trace span {w['span_s'] * 1e3:.2f} ms, kernels busy {w['kernel_busy_s'] * 1e3:.2f} ms "
        f"({w['busy_share']:.0%}) over {w['n_kernels']} kernels, memcpy {w['memcpy_s'] * 1e3:.2f} ms, "
        f"outside any phase {w['outside_phases_s'] * 1e3:.2f} ms",
        f"{'phase':<16}{'n':>3}{'wall_ms':>10}{'kernel_ms':>10}{'busy':>6}{'memcpy_ms':>10}{'sync_ms':>10}"
        f"{'kernels':>9}{'launches':>9}{'cpu_ops':>9}",
    ]
    for r in summary["phases"]:
        lines.append(
            f"{r['phase']:<16}{r['count']:>3}{_ms(r['wall_s'])}{_ms(r['kernel_busy_s'])}{r['busy_share']:>6.0%}"
            f"{_ms(r['memcpy_s'])}{_ms(r['sync_s'])}{r['n_kernels']:>9}{r['n_launches']:>9}{r['n_cpu_ops']:>9}"
        )
        for label, key in (
            ("kernels", "top_kernels"),
            ("ops by self time", "top_ops_by_self"),
            ("ops by count", "top_ops_by_count"),
        ):
            if r[key]:
                lines.append(f"    {label} (ms, count):")
                lines += [f"      {t['total_s'] * 1e3:10.3f} {t['count']:>7}  {t['name']}" for t in r[key]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", type=Path, help="step_<s>_rank_<r>.trace.json.gz")
    parser.add_argument("--top", type=int, default=8, help="entries in each top list")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    summary = summarize(load_events(args.trace), top=args.top)
    print(f"{args.trace.name}")
    print(format_table(summary))
    if args.json:
        args.json.write_text(json.dumps({"trace": str(args.trace), **summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
