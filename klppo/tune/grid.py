"""The sweep: grid points, pruning by the memory model, measuring in order within a time budget.

Points differ in threshold × offload × (forward_prefetch, reshard_after_forward) × micro-batch tokens.
Points whose units are identical (e.g. every prefetch variant of the root-only threshold) are kept once.
On the plain path (one process, no FSDP2: :meth:`Workload.runs_plain`) thresholds and prefetch / reshard
variants do nothing: every point without ``offload="cpu"`` is kept once per (offload, micro-batch tokens),
as :func:`~klppo.tune.memory.plain_point`.
A point is skipped, not run, when the memory model predicts more than ``headroom × device`` in any
phase. The sweep measures the configuration's own point first, then the others in an order that puts
likely-fast points early (no offload, large micro-batches, few units), and stops when the budget is
spent (a point started is finished; the estimate of the next point's cost is the mean so far).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from klppo.tune.measure import Measurement
from klppo.tune.memory import Point, Workload, kv_cache_room, predict
from klppo.tune.units import WHOLE_MODEL, ModelFacts

DEFAULT_THRESHOLDS = (0, 10**7, 10**8, WHOLE_MODEL)
COMBOS = ((False, True), (True, True), (False, False))
"""(forward_prefetch, reshard_after_forward) variants."""


def build_grid(
    facts: ModelFacts,
    *,
    thresholds: Iterable[int],
    offloads: Iterable[str],
    micro_tokens: Iterable[int],
    plain: bool = False,
    plain_offload: bool = False,
) -> list[Point]:
    """All distinct points (duplicates by identical units and behaviour removed); ``plain``
    (``Workload.plain``, ``plain_offload``): points the plain path runs, one per (offload, tokens)."""
    w = Workload(plain=plain, plain_offload=plain_offload)
    seen: set[tuple] = set()
    points = []
    for threshold in thresholds:
        sizes = tuple(facts.units(threshold).sizes)
        for offload in offloads:
            for fwd, reshard in COMBOS:
                if len(sizes) == 1:  # root only: prefetch and resharding change nothing
                    fwd, reshard = False, True
                for tokens in micro_tokens:
                    point = w.as_run(Point(threshold, offload, fwd, reshard, tokens))
                    key = (offload, tokens) if w.runs_plain(point) else (sizes, offload, fwd, reshard, tokens)
                    if key not in seen:
                        seen.add(key)
                        points.append(point)
    return points


def order(points: list[Point], first: Point | None) -> list[Point]:
    """``first`` (the configured point) leads; then no offload before offload, big micro-batches and
    big units first, default prefetch settings before variants."""
    rank = {"off": 0, "idle": 1, "cpu": 2, "cpu_step": 3}

    def key(p: Point) -> tuple:
        return (
            p != first,
            rank[p.offload],
            -p.micro_tokens,
            -p.min_num_params,
            p.forward_prefetch,
            not p.reshard_after_forward,
        )

    return sorted(points, key=key)


def training_need(facts: ModelFacts, point: Point, w: Workload, update_bytes: float | None = None) -> float:
    """Bytes the point needs outside the KV cache: max of the update peak (``update_bytes`` when
    measured, else predicted), the log-prob peak, and the rollout's resident state + gathered model
    (the engine fills the rest of ``gpu_memory_utilization·D`` with KV cache by design)."""
    phases = predict(facts, point, w)
    rollout = sum(t.bytes for t in phases["rollout"].terms if not t.name.startswith("KV"))
    update = phases["update"].total if update_bytes is None else update_bytes
    ref = next((t.bytes for t in phases["update"].terms if t.name == "reference shards"), 0.0)
    if update_bytes is not None:
        update += ref
    return max(update, phases["log_prob"].total, rollout)


def rule_out(
    facts: ModelFacts, point: Point, w: Workload, headroom: float, update_bytes: float | None = None
) -> str:
    """Why ``point`` cannot fit ("" when it can): need > headroom·D, or no room left for a KV cache."""
    need = training_need(facts, point, w, update_bytes)
    if need > headroom * w.device_bytes:
        return f"{'measured' if update_bytes else 'model'}: {need / 2**30:.1f} GiB > {headroom:.0%} of device"
    if kv_cache_room(facts, point, w) <= 0:
        return "model: no room for the rollout KV cache at this gpu_memory_utilization"
    return ""


def run_sweep(
    facts: ModelFacts,
    points: list[Point],
    w: Workload,
    *,
    measure: Callable[[Point], Measurement],
    budget_s: float,
    headroom: float,
    agree: Callable[[float], float] = lambda x: x,
    log: Callable[[str], None] = print,
) -> list[Measurement]:
    """Measure ``points`` in order until ``budget_s`` is spent; pruned and unmeasured points are
    returned as ``skipped`` with the reason. ``agree`` makes all ranks see the same elapsed time
    (max over ranks) so that every rank stops at the same point."""
    start = time.perf_counter()
    results: list[Measurement] = []
    spent: list[float] = []
    for i, point in enumerate(points):
        phases = predict(facts, point, w)
        update = phases["update"].total
        reason = rule_out(facts, point, w, headroom)
        if reason:
            results.append(Measurement(point, "skipped", predicted_bytes=update, note=reason))
            continue
        elapsed = agree(time.perf_counter() - start)
        expected = sum(spent) / len(spent) if spent else 0.0
        if elapsed + expected > budget_s:
            results.append(Measurement(point, "skipped", predicted_bytes=update, note="time budget spent"))
            continue
        t0 = time.perf_counter()
        m = measure(point)
        spent.append(time.perf_counter() - t0)
        results.append(replace(m, predicted_bytes=phases["update"].total))
        log(
            f"[{i + 1}/{len(points)}] {describe(point, w.runs_plain(point))}: {m.status} "
            f"{'' if m.status != 'ok' else f'{m.step_s:.3f}s {m.peak_bytes / 2**30:.2f} GiB'}"
        )
    return results


def describe(p: Point, plain: bool = False) -> str:
    """One line naming the point; ``plain``: the plain path's (no FSDP2 fields)."""
    if plain:
        return f"plain (no FSDP2) offload={p.offload} tokens={p.micro_tokens}"
    threshold = "whole" if p.min_num_params >= WHOLE_MODEL else f"{p.min_num_params:g}"
    return (
        f"min_num_params={threshold} offload={p.offload} fwd_prefetch={int(p.forward_prefetch)} "
        f"reshard={int(p.reshard_after_forward)} tokens={p.micro_tokens}"
    )
