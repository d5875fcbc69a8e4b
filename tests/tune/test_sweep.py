"""Sweep mechanics without a model: OOM handling, pruning, budget, ranking, Pareto front, exposed time."""

from __future__ import annotations

import math

import pytest
import torch

from klppo.tune import measure
from klppo.tune.grid import build_grid, order, run_sweep
from klppo.tune.intervals import exposed_time
from klppo.tune.measure import Measurement, safe_measure
from klppo.tune.memory import Point, Workload
from klppo.tune.report import best, pareto, rank
from klppo.tune.shapes import ModelShape, config_from_shape
from klppo.tune.units import WHOLE_MODEL, ModelFacts

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return ModelFacts.from_config(config_from_shape(ModelShape("tiny", "qwen2", 64, 2, 4, 2, 128, 256, True)))


def test_exposed_time_by_hand():
    total, exposed = exposed_time([(0, 4), (3, 6), (10, 12)], [(1, 2), (5, 11)])
    assert total == 8  # [0,6] and [10,12]
    assert exposed == 8 - (1 + 1 + 1)  # covered: [1,2], [5,6], [10,11]
    assert exposed_time([], [(0, 1)]) == (0, 0)


def test_oom_is_caught_memory_freed_and_sweep_goes_on(facts, monkeypatch):
    freed = []
    monkeypatch.setattr(measure, "free_memory", lambda device: freed.append(device))
    w = Workload(device_bytes=2**40)
    points = [Point(0, micro_tokens=64), Point(0, micro_tokens=128), Point(0, micro_tokens=256)]

    def fake_step(p: Point) -> Measurement:
        if p.micro_tokens == 128:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return Measurement(p, "ok", peak_bytes=1e6, step_s=0.1)

    results = run_sweep(
        facts,
        points,
        w,
        measure=lambda p: safe_measure(lambda: fake_step(p), p, CPU),
        budget_s=60,
        headroom=0.9,
        log=lambda s: None,
    )
    assert [r.status for r in results] == ["ok", "oom", "ok"]
    assert "out of memory" in results[1].note and len(freed) == 3
    with pytest.raises(KeyboardInterrupt):  # only errors become results, not interrupts
        safe_measure(lambda: (_ for _ in ()).throw(KeyboardInterrupt()), points[0], CPU)


def test_pruning_and_budget(facts):
    small = Workload(device_bytes=200_000)  # the tiny model's fp32 state alone is 1.45 MB
    results = run_sweep(
        facts,
        [Point(0)],
        small,
        measure=lambda p: pytest.fail("should be pruned"),
        budget_s=60,
        headroom=0.9,
        log=lambda s: None,
    )
    assert results[0].status == "skipped" and "GiB" in results[0].note
    calls = []

    def slow(p: Point) -> Measurement:
        calls.append(p)
        import time

        time.sleep(0.2)
        return Measurement(p, "ok", peak_bytes=1.0, step_s=1.0)

    big = Workload(device_bytes=2**40)
    pts = [Point(0, micro_tokens=t) for t in (64, 128, 256, 512)]
    results = run_sweep(facts, pts, big, measure=slow, budget_s=0.3, headroom=0.9, log=lambda s: None)
    assert len(calls) == 1 and [r.note for r in results[1:]] == ["time budget spent"] * 3


def test_grid_dedup_and_order(facts):
    points = build_grid(facts, thresholds=[0, WHOLE_MODEL], offloads=["off", "idle"], micro_tokens=[64])
    whole = [p for p in points if p.min_num_params == WHOLE_MODEL]
    assert len(whole) == 2  # prefetch / reshard variants of a root-only model collapse
    assert len(points) == 2 * 3 + 2
    current = Point(0, "idle", micro_tokens=64)
    ordered = order(points, current)
    assert ordered[0] == current and ordered[1].offload == "off"


def test_rank_best_and_pareto(facts):
    w = Workload(device_bytes=2**40, gpu_memory_utilization=0.5)
    fast_big = Measurement(Point(0, micro_tokens=64), "ok", peak_bytes=3e9, step_s=1.00)
    tie_small = Measurement(
        Point(0, forward_prefetch=True, micro_tokens=64), "ok", peak_bytes=2e9, step_s=1.02
    )
    slow_small = Measurement(Point(0, "idle", micro_tokens=64), "ok", peak_bytes=1e9, step_s=2.0)
    oom = Measurement(Point(WHOLE_MODEL, micro_tokens=64), "oom")
    ranked = rank(facts, [slow_small, oom, fast_big, tie_small], w, 0.9, num_micro=2)
    assert [r[0] for r in ranked] == [fast_big, tie_small, slow_small, oom]
    assert best(ranked, 2) is tie_small  # within 3% of the fastest, less memory
    assert pareto([(1, 3), (1.02, 2), (2, 1), (2, 3)]) == [0, 1, 2]
    assert math.isnan(oom.step_s)
