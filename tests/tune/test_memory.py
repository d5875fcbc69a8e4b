"""Memory-model terms of a tiny Qwen2 shape against hand-computed numbers, units, and the phase rule."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from klppo.parallel.fsdp import choose_units, unit_report
from klppo.tune.memory import Point, Workload, kv_cache_room, predict
from klppo.tune.shapes import config_from_shape, meta_model
from klppo.tune.units import WHOLE_MODEL, ModelFacts, unit_sizes
from tests.tune.tiny_shape import FFN, KVD, LAYER, ROOT, H, L, P, V, terms


def test_param_count_and_units(facts):
    assert facts.num_params == P == 90688
    units = facts.units(0)
    assert units.sizes == [LAYER, LAYER, ROOT]
    assert facts.units(WHOLE_MODEL).sizes == [P]
    model = meta_model(facts.config)
    for threshold in (0, 40_000, 60_000, WHOLE_MODEL):
        sizes = unit_sizes(model, threshold)
        report = unit_report(choose_units(model, threshold, None))
        assert (sizes.count, sizes.total, max(sizes.sizes)) == (report.count, report.total, report.largest)
    # matmul params: every Linear (q,k,v,o,gate,up,down) + the tied head in the root
    assert units.matmul[0] == LAYER - 2 * H and units.matmul[-1] == V * H


def test_update_terms_by_hand(facts):
    w = Workload(world_size=2, compute_bytes=2, response_fraction=0.25, device_bytes=2**30)
    T, c = 1024, 2
    phase = predict(facts, Point(0, micro_tokens=T), w)["update"]
    t = terms(phase)
    shard = math.ceil(P / 2)
    assert t["sharded params"] == shard * 4
    assert t["sharded grads"] == shard * 4
    assert t["optimizer (AdamW)"] == shard * 8
    assert t["gathered root"] == ROOT * c
    assert t["gathered units"] == 2 * LAYER * c  # a layer and the prefetched next
    A = 8 * H + c * (5 * H + 2 * KVD + 4 * FFN)
    assert t["activations"] == L * T * H * c + T * A
    assert t["backward workspace"] == T * c * (2 * H + 2 * FFN)
    assert t["logits"] == (T // 4) * V * (c + 12)
    assert t["LM head grad"] == V * H * c
    # reshard_after_forward (default): the root reshards too, so nothing is gathered while the logits are
    # live; root and window come back at the head's backward with its fp32 logits gradient (here the
    # first layer's backward workspace is larger), and the root stays gathered while the layers reduce
    grads = max(ROOT * (c + 4), 2 * ROOT * c + LAYER * (c + 4))
    assert t["unit grads / gather buffer"] == grads
    always = shard * 16
    start = t["activations"] + t["backward workspace"] + t["logits"] + t["LM head grad"]
    workspace = T * c * (2 * H + 2 * FFN)
    assert workspace > (T // 4) * V * 4
    assert t["logits grad (head backward)"] == workspace
    head = ROOT * c + 2 * LAYER * c + t["activations"] + workspace + V * H * c
    assert phase.total == max(always + max(start, head, grads), shard * 20)
    # without resharding every gathered byte is there from the forward to the backward, logits included
    kept = predict(facts, Point(0, reshard_after_forward=False, micro_tokens=T), w)["update"]
    assert "logits grad (head backward)" not in terms(kept)
    assert terms(kept)["unit grads / gather buffer"] == max(ROOT * (c + 4), ROOT * c + LAYER * (c + 4))
    gathered = ROOT * c + 2 * LAYER * c
    assert kept.total == max(
        always + gathered + max(start, ROOT * (c + 4), ROOT * c + LAYER * (c + 4)), shard * 20
    )


def test_variants_change_the_right_terms(facts):
    w = Workload(world_size=1, compute_bytes=2, grad_checkpointing=False, device_bytes=2**30)
    base = terms(predict(facts, Point(0, micro_tokens=512), w)["update"])
    A = 8 * H + 2 * (5 * H + 2 * KVD + 4 * FFN)
    assert base["activations"] == L * 512 * A
    no_reshard = terms(predict(facts, Point(0, reshard_after_forward=False, micro_tokens=512), w)["update"])
    assert no_reshard["gathered units"] == 2 * LAYER * 2  # every unit stays gathered
    cpu = predict(facts, Point(0, offload="cpu", micro_tokens=512), w)["update"]
    assert terms(cpu)["sharded params"] == 0 and "optimizer (AdamW)" not in terms(cpu)
    whole = terms(predict(facts, Point(WHOLE_MODEL, micro_tokens=512), w)["update"])
    assert whole["gathered root"] == P * 2 and whole["gathered units"] == 0


def test_rollout_and_offload(facts):
    w = Workload(world_size=1, compute_bytes=2, gpu_memory_utilization=0.5, device_bytes=2**24)
    off = predict(facts, Point(0), w)["rollout"]
    idle = predict(facts, Point(0, offload="idle"), w)["rollout"]
    assert off.total == pytest.approx(0.5 * 2**24)  # the engine fills its budget with KV cache
    assert terms(off)["optimizer (AdamW)"] == P * 8 and "optimizer (AdamW)" not in terms(idle)
    assert kv_cache_room(facts, Point(0, offload="idle"), w) - kv_cache_room(facts, Point(0), w) == P * 8
    tiny_device = Workload(world_size=1, device_bytes=P)  # not even the weights fit in half of it
    assert kv_cache_room(facts, Point(0), tiny_device) == 0
    lp = terms(predict(facts, Point(0, micro_tokens=256), w)["log_prob"])
    assert lp["logits"] == 128 * V * 10


def test_ulysses_terms(facts):
    """Per-rank tokens T: S = 2 adds only the all-to-all buffers; S = 4 > 2 KV heads replicates them."""
    T, c = 1024, 2
    base = Workload(world_size=4, compute_bytes=c, response_fraction=0.25, device_bytes=2**30)
    one = {p: terms(v) for p, v in predict(facts, Point(0, micro_tokens=T), base).items()}
    two = {
        p: terms(v)
        for p, v in predict(facts, Point(0, micro_tokens=T), replace(base, sequence_parallel=2)).items()
    }
    assert two["update"].pop("all-to-all buffers") == T * c * (2 * H + 2 * KVD)
    assert two["log_prob"].pop("all-to-all buffers") == T * c * (2 * H + 2 * KVD)
    assert two == one
    four = terms(predict(facts, Point(0, micro_tokens=T), replace(base, sequence_parallel=4))["update"])
    kvd4 = 4 * (H // 4)  # 2 KV heads replicated to 4, head_dim 16
    assert four["all-to-all buffers"] == T * c * (2 * H + 2 * kvd4)
    assert four["activations"] == L * T * H * c + T * (8 * H + c * (5 * H + 2 * kvd4 + 4 * FFN))


def test_tensor_parallel_rollout(facts):
    """TP = 2: the rank's slices P·c/2 replace the gathered model; the reshard buffers (largest unit's
    send 1/f and receive 1/TP) are a moment before the KV cache, which gets the room the slices free."""
    c = 2
    base = Workload(world_size=2, compute_bytes=c, gpu_memory_utilization=0.5, device_bytes=2**24)
    tp2 = replace(base, rollout_tensor_parallel=2)
    one, two = (
        terms(predict(facts, Point(0), base)["rollout"]),
        terms(predict(facts, Point(0), tp2)["rollout"]),
    )
    assert one["gathered model"] == P * c and "gathered model" not in two
    assert two["tensor-parallel slices"] == P * c / 2
    assert two["reshard buffers"] == max(LAYER, ROOT) * c * (1 / 2 + 1 / 2)
    assert kv_cache_room(facts, Point(0), tp2) - kv_cache_room(facts, Point(0), base) == P * c / 2
    # a device too small for the gathered model: TP = 2 still leaves a KV cache
    small = replace(base, device_bytes=int(2 * (P * 4 / 2 + P * 8 / 2 + 0.75 * P * c)))
    assert kv_cache_room(facts, Point(0), small) == 0
    assert kv_cache_room(facts, Point(0), replace(small, rollout_tensor_parallel=2)) > 0


def test_grad_sync_per_mini_batch_rule_and_term(facts):
    """auto defers the gradient sync with >1 rank, no offload and P·4 ≤ 10% of the device; on, the update
    holds the whole model's unsharded fp32 gradients (P·4) on top."""
    from klppo.tune.memory import defers_grad_sync

    big = 10 * P * 4  # P·4 is exactly 10% of this device
    rule = dict(offload="off", grad_bytes=P * 4, device_bytes=big)
    assert defers_grad_sync("auto", ranks=2, **rule)[0]
    assert not defers_grad_sync("auto", ranks=1, **rule)[0]  # one rank: nothing to save
    assert not defers_grad_sync("auto", ranks=2, **dict(rule, offload="idle"))[0]
    assert not defers_grad_sync("auto", ranks=2, **dict(rule, device_bytes=big - 1))[0]
    assert defers_grad_sync("auto", ranks=2, **dict(rule, device_bytes=None))[0]  # CPU: no device limit
    assert defers_grad_sync(True, ranks=1, offload="cpu", grad_bytes=P * 4, device_bytes=1)[0]
    assert not defers_grad_sync(False, **dict(rule, ranks=2))[0]

    point = Point(0, micro_tokens=256)
    w = Workload(world_size=2, compute_bytes=2, device_bytes=big)
    off = predict(facts, point, w)["update"]
    on = predict(facts, point, replace(w, grad_sync_per_mini_batch=True))["update"]
    auto = predict(facts, point, replace(w, grad_sync_per_mini_batch="auto"))["update"]
    assert terms(on)["unsharded grads (sync per mini-batch)"] == P * 4
    assert on.total == off.total + P * 4
    assert auto.total == on.total  # 2 ranks, 10% of the device: auto is on
    one_rank = replace(w, world_size=1, grad_sync_per_mini_batch="auto")
    assert "unsharded grads (sync per mini-batch)" not in terms(predict(facts, point, one_rank)["update"])


# `bench/tune_validate.py` on one H200 (docs/performance.md, "memory model"), measured out of sample for the
# root's resharding: (shape, min_num_params, offload, forward_prefetch, reshard_after_forward, tokens, GiB)
ONE_GPU_POINTS = [
    ("Qwen2.5-0.5B", "whole", "off", 0, 1, 16384, 26.74),
    ("Qwen2.5-0.5B", "1e+08", "off", 0, 1, 16384, 26.74),
    ("Qwen2.5-0.5B", "1e+08", "off", 0, 0, 16384, 27.66),
    ("Qwen2.5-0.5B", "1e+08", "off", 1, 1, 16384, 26.74),
    ("Qwen2.5-0.5B", "0", "off", 0, 1, 16384, 26.73),
    ("Qwen2.5-0.5B", "0", "off", 0, 0, 16384, 27.66),
    ("Qwen2.5-0.5B", "0", "off", 1, 1, 16384, 26.73),
    ("Qwen2.5-0.5B", "whole", "off", 0, 1, 4096, 12.26),
    ("Qwen2.5-0.5B", "1e+08", "off", 0, 1, 4096, 12.26),
    ("Qwen2.5-0.5B", "1e+08", "off", 0, 0, 4096, 13.18),
    ("Qwen2.5-0.5B", "1e+08", "off", 1, 1, 4096, 12.26),
    ("Qwen2.5-0.5B", "0", "off", 0, 1, 4096, 12.26),
    ("Qwen2.5-0.5B", "0", "off", 0, 0, 4096, 13.18),
    ("Qwen2.5-0.5B", "0", "off", 1, 1, 4096, 12.26),
    ("Qwen2.5-0.5B", "whole", "idle", 0, 1, 16384, 26.73),
    ("Qwen2.5-1.5B", "0", "off", 0, 0, 16384, 46.00),
    ("Qwen2.5-1.5B", "1e+08", "off", 0, 0, 16384, 46.01),
    ("Qwen2.5-1.5B", "1e+08", "off", 1, 1, 16384, 43.12),
    ("Qwen2.5-1.5B", "1e+08", "off", 0, 1, 16384, 43.12),
    ("Qwen2.5-1.5B", "0", "off", 1, 1, 16384, 43.12),
    ("Qwen2.5-1.5B", "whole", "off", 0, 1, 16384, 43.11),
    ("Qwen2.5-1.5B", "0", "off", 0, 1, 16384, 43.12),
    ("Qwen2.5-1.5B", "1e+08", "off", 1, 1, 8192, 33.11),
    ("Qwen2.5-1.5B", "1e+08", "off", 0, 1, 8192, 33.11),
    ("Qwen2.5-1.5B", "whole", "off", 0, 1, 8192, 34.57),
    ("Qwen2.5-1.5B", "1e+08", "off", 0, 0, 8192, 35.98),
    ("Qwen2.5-1.5B", "0", "off", 0, 0, 8192, 35.98),
    ("Qwen2.5-1.5B", "0", "off", 1, 1, 8192, 33.10),
    ("Qwen2.5-1.5B", "0", "off", 0, 1, 8192, 33.10),
    ("Qwen2.5-1.5B", "1e+08", "idle", 0, 1, 16384, 43.10),
    ("Qwen2.5-1.5B", "whole", "idle", 0, 1, 16384, 43.10),
    ("Qwen2.5-1.5B", "0", "idle", 0, 1, 16384, 43.10),
    ("Qwen2.5-1.5B", "1e+08", "off", 0, 1, 16384, 43.12),
]


def test_one_gpu_points_within_five_percent():
    """The 33 update peaks measured on one GPU (0.5B and 1.5B, 4k/8k/16k tokens, whole model / 1e8 / per
    layer, reshard on/off, idle offload), out of sample for the root's resharding: within ±5% (-3.9% to
    +0.6%; without the root's own moment the whole-model points with resharding read +4.6% to +6.8%)."""

    facts_of = {}
    for shape, threshold, offload, prefetch, reshard, tokens, measured in ONE_GPU_POINTS:
        facts = facts_of.setdefault(shape, ModelFacts.from_config(config_from_shape(shape)))
        mnp = {"whole": WHOLE_MODEL, "1e+08": 10**8, "0": 0}[threshold]
        w = Workload(world_size=1, grad_checkpointing=True, device_bytes=int(139.8 * 2**30), compute_bytes=2)
        point = Point(mnp, offload, bool(prefetch), bool(reshard), tokens)
        predicted = predict(facts, point, w)["update"].total / 2**30
        assert abs(predicted / measured - 1) <= 0.05, (shape, threshold, offload, prefetch, reshard, tokens)
    assert len(ONE_GPU_POINTS) == 33


def test_measured_sweeps_within_five_percent():
    """The update peaks measured on two H200s (bench/results: fsdp-sweep-2gpu-1.5b-7b.json, Qwen2.5-1.5B and
    7B at thresholds 0 and 1e8; fsdp-sweep-2gpu-1.5b.json, 1.5B at all four thresholds; each × forward
    prefetch × reshard_after_forward: 32 measurements, 24 distinct points) against the model as
    bench/multi_gpu.py calls it. The root's resharding (_gathered) is fitted on the 1.5B points of the second
    file (whole model as one unit, resharding: +14.3% when the root is counted as always gathered), so these
    are in sample for it; the 7B points with
    resharding sit on the optimizer-step floor and do not test it (the one-GPU points above do). Every
    point within ±5% (the issue asks ±10%)."""
    import json
    from pathlib import Path

    results = Path(__file__).parents[2] / "bench/results"
    rows = []
    for name in ("fsdp-sweep-2gpu-1.5b-7b.json", "fsdp-sweep-2gpu-1.5b.json"):
        rows += json.loads((results / name).read_text())["rows"]
    assert len(rows) == 32 and {r["shape"] for r in rows} == {"Qwen2.5-1.5B", "Qwen2.5-7B"}
    w = Workload(world_size=2, grad_checkpointing=True, device_bytes=143771 * 2**20, compute_bytes=2)
    for r in rows:
        facts = ModelFacts.from_config(config_from_shape(r["shape"]))
        p = Point(
            r["min_num_params"], "off", r["forward_prefetch"], r["reshard_after_forward"], r["micro_tokens"]
        )
        predicted = predict(facts, p, w)["update"].total / 2**30
        assert abs(predicted / r["peak_gib"] - 1) <= 0.05, (r, predicted)


def test_the_update_graph_pool_stays_through_the_other_phases(facts):
    """cuda_graph_update: the actor's update and old-log-prob graphs share one pool — the larger of the
    update's peak above the resident state and a log-prob micro-batch's working set — held in every phase,
    each phase's
    own pass counted beside it (a shape run eagerly allocates outside the pool); the reference's graphs hold a
    pool of their own."""
    from klppo.tune.memory import forward_pool_bytes, graph_pool_bytes

    w = Workload(world_size=1, compute_bytes=2, gpu_memory_utilization=0.5, device_bytes=2**28, plain=True)
    g = replace(w, graph_update=True)
    for log_prob_tokens in (None, 16384):  # the update's working set the larger, then the log-prob pass's
        w, g = replace(w, log_prob_tokens=log_prob_tokens), replace(g, log_prob_tokens=log_prob_tokens)
        point = Point(WHOLE_MODEL, micro_tokens=512)
        eager, graphed = predict(facts, point, w), predict(facts, point, g)
        update = eager["update"]
        static = ("sharded params", "sharded grads", "optimizer (AdamW)", "compute copy")
        resident = sum(t.bytes for t in update.terms if t.name in static)
        log_prob = forward_pool_bytes(facts, point, w)
        assert log_prob == terms(eager["log_prob"])["activations"] + terms(eager["log_prob"])["logits"]
        pool = graph_pool_bytes(facts, point, g)
        assert (
            pool == pytest.approx(max(update.total - resident, log_prob))
            and graph_pool_bytes(facts, point, w) == 0
        )
        assert (update.total - resident > log_prob) == (log_prob_tokens is None)
        # each phase holds the pool beside its own pass (which may run eagerly: a shape met the first time)
        assert graphed["update"].total == pytest.approx(update.total + pool)
        assert graphed["log_prob"].total == pytest.approx(eager["log_prob"].total + pool)
        assert terms(graphed["rollout"])["actor graph pool"] == pool
        assert kv_cache_room(facts, point, w) - kv_cache_room(facts, point, g) == pytest.approx(pool)
        # with a reference its pass runs beside the actor's pool; its own graphs add a pool held throughout
        r, rg = replace(g, reference=True), replace(g, reference=True, graph_reference=True)
        with_ref, ref_pool = predict(facts, point, r), predict(facts, point, rg)
        assert with_ref["log_prob"].total == pytest.approx(
            predict(facts, point, replace(w, reference=True))["log_prob"].total + pool
        )
        assert ref_pool["log_prob"].total == pytest.approx(with_ref["log_prob"].total + log_prob)
        for phase in ("rollout", "update"):
            assert terms(ref_pool[phase])["reference graph pool"] == log_prob
    # where the trainer refuses graphs (FSDP2, offloaded parameters) there is no pool to count
    assert graph_pool_bytes(facts, point, replace(g, plain=False)) == 0
    assert graph_pool_bytes(facts, replace(point, offload="idle"), replace(g, plain_offload=True)) == 0
