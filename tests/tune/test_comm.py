"""The communication model's bytes against hand counts, with and without the gradient sync deferred to the
mini-batch's last micro-batch (``fsdp_config.grad_sync_per_mini_batch``)."""

from __future__ import annotations

import pytest
import torch

from klppo.tune.comm import predict_units, step_bytes, syncs_per_step
from klppo.tune.memory import Point, Workload
from klppo.tune.units import UnitSizes

UNITS = UnitSizes(min_num_params=0, sizes=[100, 200, 50], matmul=[100, 200, 40])
POINT = Point(0, micro_tokens=64)  # reshard after forward: two all-gathers per unit and micro-batch


def w(sync, ranks=2, **kw) -> Workload:
    return Workload(world_size=ranks, compute_bytes=2, grad_sync_per_mini_batch=sync, **kw)


def test_step_bytes_by_hand_per_micro_and_deferred():
    gathered = 2 * 350 * 2  # two gathers of every unit in bf16, per micro-batch
    assert step_bytes(UNITS, POINT, w(False), 3) == (3 * gathered, 3 * 350 * 4)
    assert step_bytes(UNITS, POINT, w(True), 3) == pytest.approx((3 * gathered, 350 * 4))  # one sync
    assert step_bytes(UNITS, POINT, w("auto"), 3) == pytest.approx((3 * gathered, 350 * 4))  # 2 ranks: on
    assert step_bytes(UNITS, POINT, w("auto", ranks=1), 3)[1] == 3 * 350 * 4  # one rank: nothing deferred
    offload = Point(0, offload="cpu", micro_tokens=64)
    assert step_bytes(UNITS, offload, w("auto"), 3)[1] == 3 * 350 * 4  # offload puts memory first
    assert syncs_per_step(UNITS, POINT, w("auto", device_bytes=10_000), 3) == 3  # 1,400 B > 10% of 10,000
    # gradients reduced in bf16 (mixed_precision.reduce_dtype=bf16): half the reduce-scatter bytes
    assert step_bytes(UNITS, POINT, w(False, reduce_dtype="bfloat16"), 3) == (3 * gathered, 3 * 350 * 2)


def test_bf16_reduction_halves_the_deferred_gradients_in_the_memory_model():
    from klppo.tune.memory import ModelFacts, predict
    from klppo.tune.shapes import load_model_config

    facts = ModelFacts.from_config(load_model_config("Qwen2.5-0.5B"))
    point = Point(0, micro_tokens=1024)

    def term(r):
        phase = predict(facts, point, Workload(world_size=2, grad_sync_per_mini_batch=True, reduce_dtype=r))[
            "update"
        ]
        return {t.name: t.bytes for t in phase.terms}

    fp32, bf16 = term("float32"), term("bfloat16")
    key = "unsharded grads (sync per mini-batch)"
    assert fp32[key] == facts.num_params * 4 and bf16[key] == facts.num_params * 2


def test_the_workload_reads_the_reduce_dtype():
    from klppo.assembly.settings import fsdp_settings, tune_workload
    from klppo.config import load_config

    for dtype, nbytes in (("fp32", 4), ("bf16", 2)):
        cfg = load_config([f"actor_rollout_ref.actor.fsdp_config.mixed_precision.reduce_dtype={dtype}"])
        fsdp = fsdp_settings(cfg.actor_rollout_ref.actor.fsdp_config, device_type="cuda", world_size=2)
        workload = tune_workload(cfg, fsdp, world_size=2, device_gib=80).workload
        assert workload.reduce_bytes == nbytes and getattr(torch, workload.reduce_dtype) == fsdp.reduce_dtype


def test_predicted_unit_traffic_averages_a_deferred_sync_over_the_micro_batches():
    kw = dict(bus_bandwidth=1e3, flops_per_s=1e9, num_micro=4)
    per_micro = predict_units(UNITS, POINT, w(False), **kw)
    deferred = predict_units(UNITS, POINT, w(True), **kw)
    assert [u.reduce_scatter_bytes for u in per_micro] == [400.0, 800.0, 200.0]
    assert [u.reduce_scatter_bytes for u in deferred] == [100.0, 200.0, 50.0]
    assert [u.all_gather_bytes for u in deferred] == [u.all_gather_bytes for u in per_micro]
    # ring over 2 ranks: half the bytes cross the link; unit 0: (400 gathered + 100 reduced) / 2 / 1e3 B/s
    assert deferred[0].comm_s == pytest.approx((400 + 100) / 2 / 1e3)


def test_partial_overlap_by_hand():
    """Of a unit's communication, what its longer neighbour's compute does not cover is exposed (with
    prefetch; all of it without)."""
    units = UnitSizes(min_num_params=0, sizes=[100, 100, 100], matmul=[100, 100, 100])
    point = Point(0, micro_tokens=10, reshard_after_forward=False)  # one all-gather per unit
    # per unit: (200 gathered + 400 reduced) bytes, half over the link at 1e3 B/s → 0.3 s;
    # compute 3 passes · 2 · 100 · 10 FLOP at 2e4 FLOP/s → 0.3 s, 0.2 s at 3e4
    eager = w(False, grad_checkpointing=False)  # 3 passes: forward and backward (2×)
    exact = predict_units(units, point, eager, bus_bandwidth=1e3, flops_per_s=2e4)
    assert [u.exposed_s for u in exact] == pytest.approx([0.0, 0.0, 0.0]) and all(u.hidden for u in exact)
    short = predict_units(units, point, eager, bus_bandwidth=1e3, flops_per_s=3e4)
    assert [u.comm_s for u in short] == pytest.approx([0.3] * 3)
    assert [u.exposed_s for u in short] == pytest.approx([0.1] * 3) and not any(u.hidden for u in short)
    none = predict_units(
        units,
        point,
        w(False, grad_checkpointing=False, backward_prefetch=False),
        bus_bandwidth=1e3,
        flops_per_s=3e4,
    )
    assert [u.exposed_s for u in none] == pytest.approx([0.3] * 3)
