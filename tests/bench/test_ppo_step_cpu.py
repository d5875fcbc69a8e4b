"""bench/ppo_step.py pieces on CPU: the operator count per trainer phase (``--count-ops``)."""

from __future__ import annotations

import gc

import torch

from bench.ppo_step import HostProbe, OpCount, kernel_seconds, variant_overrides
from klppo.parallel.dist import phase


def test_op_count_attributes_forward_and_backward_operators_to_the_phase():
    ops = OpCount(True)
    x = torch.ones(3, requires_grad=True)
    for _ in range(2):  # two steps; the summary is the median of the steps after the first
        with ops:
            with phase("update_actor"):
                loss = (x * 2).sum()  # mul, sum
                loss.backward()  # backward operators are dispatched too
            with phase("ref"):
                torch.zeros(2).add_(1)  # zeros (+ fill), add_
        ops.step()
    summary = ops.summary()
    assert set(summary) == {"ops/update_actor", "ops/ref", "ops_top/update_actor", "ops_top/ref"}
    assert summary["ops/update_actor"] >= 4 and summary["ops/ref"] >= 2  # forward 2 + backward ≥ 2
    # the operators by name, most frequent first, of the last step: "aten.mul 2, aten.sum 1, …"
    top = dict(x.rsplit(" ", 1) for x in summary["ops_top/update_actor"].split(", "))
    assert int(top["aten.mul"]) >= 2 and "aten.sum" in top  # forward mul, and the backward's mul by 2
    assert sum(map(int, top.values())) == summary["ops/update_actor"]  # both steps do the same work
    counts = list(map(int, top.values()))
    assert counts == sorted(counts, reverse=True)
    assert "aten.add_" in summary["ops_top/ref"] and "aten.mul" not in summary["ops_top/ref"]
    with ops:  # outside the mode nothing is counted
        pass
    torch.ones(2) * 3
    assert OpCount(False).summary() == {} and ops.current == {}


def test_host_probe_times_the_collections_of_each_step_and_stops_after():
    probe = HostProbe()
    with probe:
        probe.step()  # the first step is left out of the medians (compilation, warm-up)
        for _ in range(3):
            gc.collect()  # one full collection per step
            gc.collect(0)
            probe.step()
        assert probe.loop_s > 0
    summary = probe.summary()
    assert summary["host/gc_full"] == 1
    assert 0 < summary["host/gc_s"] < 5
    assert summary["host/gc_objects"] > 1000  # this process tracks at least the test's modules
    calls = len(probe.per_step)
    gc.collect()  # after the run the callback is gone
    probe.step()
    assert probe.per_step[-1] == (0.0, 0) and len(probe.per_step) == calls + 1


def test_kernel_seconds_count_each_kernel_once() -> None:
    """A profile of one step as ``key_averages()`` gives it on CUDA: two kernels (300 + 200 µs) inside
    ``phase/update_actor`` inside the profiler step, launched by ``aten::mm`` and a compiled region under
    an FSDP range. Every range and every CPU operator reports the device time it spans or launched (as
    torch.profiler's table shows: ``aten::mm`` with the GEMM's self CUDA time); only the kernels count."""
    from types import SimpleNamespace as E

    from torch.autograd import DeviceType

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    events = [
        E(key="ProfilerStep#3", self_device_time_total=500.0, device_type=cpu, is_user_annotation=False),
        E(key="phase/update_actor", self_device_time_total=500.0, device_type=cuda, is_user_annotation=True),
        E(key="FSDP::pre_forward", self_device_time_total=500.0, device_type=cuda, is_user_annotation=True),
        E(key="aten::mm", self_device_time_total=300.0, device_type=cpu, is_user_annotation=False),
        E(key="void gemm_kernel", self_device_time_total=300.0, device_type=cuda, is_user_annotation=False),
        E(
            key="triton_poi_fused_mul_silu_1",
            self_device_time_total=200.0,
            device_type=cuda,
            is_user_annotation=False,
        ),
    ]
    assert kernel_seconds(events) == 500e-6


def test_prompts_scales_the_batch_and_keeps_the_number_of_mini_batches():
    from bench.ppo_step import WORKLOADS, scaled_workload, tiny_workload

    w = scaled_workload(WORKLOADS["grpo135m"], 256)  # bench/learning.py's batch: 256 prompts × 8
    assert (w.prompts, w.n) == (256, 8)
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=256" in w.overrides  # one mini-batch, as before
    trl = scaled_workload(WORKLOADS["trl"], 64)
    assert "actor_rollout_ref.actor.ppo_mini_batch_size=16" in trl.overrides  # 4 mini-batches, as before
    assert [o for o in trl.overrides if "mini" not in o] == [
        o for o in WORKLOADS["trl"].overrides if "mini" not in o
    ]
    assert scaled_workload(tiny_workload(WORKLOADS["grpo135m"]), 16).overrides[0].endswith("=16")


def test_the_plain_candidate_turns_the_key_off_for_both_trained_roles():
    off = [f"{r}.fsdp_config.plain_single_gpu=false" for r in ("actor_rollout_ref.actor", "critic.model")]
    assert all(o in variant_overrides("after+critic_compile-plain") for o in off)
    assert not any("plain_single_gpu" in o for o in variant_overrides("after+critic_compile"))


def test_every_variant_is_configuration_only():
    """Variants are configuration keys a user also has (no bench switch, no patched name): every override
    loads, ``+graphs`` sets the three roles' cuda_graph_update, ``before`` turns every candidate off."""
    from bench.ppo_step import CANDIDATES, SETTINGS
    from klppo.config import load_config

    on = variant_overrides("after+critic_compile+graphs")
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model"):
        assert f"{role}.fsdp_config.cuda_graph_update=True" in on
    before = variant_overrides("before")
    assert all(o in before for off in (c[1] for c in CANDIDATES.values()) for o in off)
    every = [o for c in CANDIDATES.values() for side in c for o in side] + [
        o for v in SETTINGS.values() for o in v
    ]
    assert not any(o.startswith("@") for o in every)
    load_config(before)
    load_config(on)
