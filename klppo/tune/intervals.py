"""Time intervals ``(start, end)``: their union, its length, and the part of one set no other set covers.
No torch import: the profile readers (`klppo.ops.profiler`, `klppo.tune.measure`,
``bench/trace_phases.py``) share it."""

from __future__ import annotations

Interval = tuple[float, float]


def union(intervals: list[Interval]) -> list[Interval]:
    """The disjoint, sorted intervals covering what ``intervals`` cover (touching ones merged)."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def union_length(intervals: list[Interval]) -> float:
    """Length of the union of ``intervals``."""
    return sum(b - a for a, b in union(intervals))


def exposed_time(comm: list[Interval], compute: list[Interval]) -> tuple[float, float]:
    """(total, exposed): length of the union of ``comm`` intervals, and the part of it that no
    ``compute`` interval covers — communication the step waits for instead of hiding it."""
    comm_u, compute_u = union(comm), union(compute)
    total = sum(b - a for a, b in comm_u)
    covered = 0.0
    for a, b in comm_u:
        for c, d in compute_u:
            covered += max(0.0, min(b, d) - max(a, c))
    return total, total - covered
