"""`klppo tune` on the plain path (one process, no FSDP2: fsdp_config.plain_single_gpu): the grid keeps one
point per (offload, tokens), the memory model counts the plain path's own terms, the measured step is the
trainer's arithmetic on the masters, and the output says the FSDP2 knobs do not apply."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

from klppo.assembly.settings import fsdp_settings, tune_workload
from klppo.batching.attention import enable_packed_attention
from klppo.batching.packing import forward_log_probs
from klppo.commands.tune import main
from klppo.config import load_config
from klppo.parallel.plain import MasterWeights
from klppo.roles.optim import OptimSettings, build_optimizer
from klppo.tune.grid import build_grid
from klppo.tune.measure import actor_step, build, measure_point, micro_batch
from klppo.tune.memory import Point, Workload, predict
from klppo.tune.preflight import _over_budget_advice, predicted_peaks_gib
from klppo.tune.report import PLAIN_NOTE, overrides
from klppo.tune.shapes import config_from_shape, load_model_config
from klppo.tune.units import WHOLE_MODEL, ModelFacts
from tests.tune.tiny_shape import FFN, KVD, TINY, H, L, P, V, terms

CPU = torch.device("cpu")


def test_the_grid_keeps_one_plain_point_per_offload_and_tokens(facts):
    kw = dict(thresholds=[0, 40_000, WHOLE_MODEL], offloads=["off", "idle", "cpu"], micro_tokens=[64, 128])
    fsdp2 = build_grid(facts, **kw)
    plain = build_grid(facts, **kw, plain=True, plain_offload=True)  # plain_single_gpu=true
    plain_points = [p for p in plain if p.offload != "cpu"]
    assert [(p.offload, p.micro_tokens) for p in plain_points] == [
        ("off", 64),
        ("off", 128),
        ("idle", 64),
        ("idle", 128),
    ]
    assert {(p.min_num_params, p.forward_prefetch, p.reshard_after_forward) for p in plain_points} == {
        (WHOLE_MODEL, False, True)
    }
    # offload_policy needs FSDP2: its points are FSDP2's, every variant kept
    assert [p for p in plain if p.offload == "cpu"] == [p for p in fsdp2 if p.offload == "cpu"]
    assert len([p for p in fsdp2 if p.offload == "off"]) > 2
    # auto leaves offloading roles on FSDP2: the idle points keep their variants
    auto = build_grid(facts, **kw, plain=True)
    assert [p for p in auto if p.offload == "idle"] == [p for p in fsdp2 if p.offload == "idle"]
    assert [p for p in auto if p.offload == "off"] == [p for p in plain if p.offload == "off"]
    # the configured point (what `klppo tune` measures first) is the grid's, whatever its FSDP2 keys
    key = "actor_rollout_ref.actor.fsdp_config"
    tw = _tune_workload([f"{key}.wrap_policy.min_num_params=0", f"{key}.forward_prefetch=true"], 1)
    current = tw.workload.as_run(tw.point)
    assert current in build_grid(facts, **dict(kw, micro_tokens=[tw.point.micro_tokens]), plain=True)


def test_plain_update_terms_by_hand(facts):
    """Masters, master grads, AdamW and the compute copy resident; the backward's start as FSDP2's (a),
    its end the bf16 gradients P·c; no gathered units, all-gather or reduce-scatter buffers."""
    T, c = 1024, 2
    w = Workload(world_size=1, compute_bytes=c, response_fraction=0.25, device_bytes=2**30, plain=True)
    for point in (Point(0, micro_tokens=T), Point(WHOLE_MODEL, "off", True, False, T)):
        phase = predict(facts, point, w)["update"]
        t = terms(phase)
        assert t["sharded params"] == P * 4 and t["sharded grads"] == P * 4
        assert t["optimizer (AdamW)"] == P * 8 and t["compute copy"] == P * c
        assert t["compute-dtype grads"] == P * c
        assert not {"gathered root", "gathered units", "unit grads / gather buffer"} & set(t)
        assert not any("head backward" in name for name in t)
        A = 8 * H + c * (5 * H + 2 * KVD + 4 * FFN)
        start = (L * T * H * c + T * A) + T * c * (2 * H + 2 * FFN) + (T // 4) * V * (c + 12) + V * H * c
        always = P * (4 + 4 + 8 + c)
        assert phase.total == max(always + max(start, P * c), always + P * 4)
    # one FSDP2 unit (plain_single_gpu=false) at its backward's end: the unit's grads and their fp32
    # reduce-scatter input, P·4 more than the plain path's
    fsdp2 = terms(
        predict(facts, Point(WHOLE_MODEL, micro_tokens=T), dataclasses.replace(w, plain=False))["update"]
    )
    assert fsdp2["unit grads / gather buffer"] - t["compute-dtype grads"] == P * 4


def test_plain_log_prob_and_rollout_by_hand(facts):
    T, c = 1024, 2
    w = Workload(world_size=1, compute_bytes=c, response_fraction=0.25, device_bytes=2**30, plain=True)
    phases = predict(facts, Point(0, micro_tokens=T), w)
    log_prob = terms(phases["log_prob"])
    assert set(log_prob) == {"sharded params", "compute copy", "optimizer (AdamW)", "activations", "logits"}
    assert phases["log_prob"].total == P * (4 + c + 8) + T * c * (4 * H + 2 * KVD + 3 * FFN) + (
        T // 4
    ) * V * (c + 8)
    rollout = terms(phases["rollout"])  # the engine reads the compute copy: P·c once
    assert "compute copy" not in rollout and rollout["gathered model"] == P * c
    # offload_policy stays FSDP2: the same prediction as without the plain path
    cpu = Point(0, "cpu", micro_tokens=T)
    fsdp2 = predict(facts, cpu, dataclasses.replace(w, plain=False))
    assert {k: v.total for k, v in predict(facts, cpu, w).items()} == {k: v.total for k, v in fsdp2.items()}


def _reference_step(config, batches, lr_settings: OptimSettings) -> list[torch.Tensor]:
    """The trainer's arithmetic without MasterWeights, on CPU (compute = master dtype): gradients of the
    micro-batches summed, clipped to norm 1, one AdamW step."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    enable_packed_attention(model)
    optimizer = build_optimizer(model.parameters(), lr_settings)
    for ids, mask, pos, resp in batches:
        log_probs, _ = forward_log_probs(model, ids, mask, pos, response_length=resp, use_remove_padding=True)
        (-log_probs.mean() / len(batches)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("offload", ["off", "idle"])
def test_a_plain_measured_step_is_the_trainers_step(offload):
    config = config_from_shape(TINY)
    w = Workload(world_size=1, compute_bytes=4, plain=True, plain_offload=True)
    point = Point(WHOLE_MODEL, offload, micro_tokens=64)
    batches = [micro_batch(config, point, w, 32, CPU, seed=i) for i in range(2)]
    torch.manual_seed(0)
    masters, optimizer = build(config, point, w, CPU)
    assert isinstance(masters, MasterWeights)
    assert not any(isinstance(m, FSDPModule) for m in masters.model.modules())
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(m) for m in masters.masters}
    before = [m.detach().clone() for m in masters.masters]
    actor_step(masters, optimizer, batches, point, CPU)
    expected = _reference_step(config, batches, OptimSettings())
    for m, p, b, e in zip(masters.masters, masters.params, before, expected):
        assert torch.equal(p, m)  # copied back into the compute copy
        assert torch.allclose(m - b, e - b, rtol=1e-4, atol=1e-12)
    assert any(not torch.equal(m, b) for m, b in zip(masters.masters, before))
    assert all(m.grad is None for m in masters.masters) and all(p.grad is None for p in masters.params)
    assert {v.device for s in optimizer.state.values() for v in s.values()} == {CPU}
    result = measure_point(config, point, w, device=CPU, steps=1, num_micro=2, seq_len=32, profile=False)
    assert result.status == "ok" and result.step_s > 0 and math.isnan(result.peak_bytes)


def test_the_dry_run_says_when_the_plain_path_applies(capsys):
    args = ["--dry-run", "--model-shape", "Qwen2.5-0.5B", "--device-gb", "80", "--micro-tokens", "4096"]
    assert main([*args, "--world-size", "1"]) == 0
    out = capsys.readouterr().out
    assert PLAIN_NOTE in out and "memory terms at plain (no FSDP2) offload=off" in out
    assert "│          plain │     - │ off     │            - │       - │   4096 │" in out
    assert (
        main([*args, "--world-size", "1", "actor_rollout_ref.actor.fsdp_config.plain_single_gpu=false"]) == 0
    )
    assert PLAIN_NOTE not in capsys.readouterr().out
    assert main([*args, "--world-size", "2"]) == 0
    assert PLAIN_NOTE not in capsys.readouterr().out


def test_plain_overrides_name_no_fsdp2_knob():
    point = Point(WHOLE_MODEL, "idle", micro_tokens=4096)
    plain = "\n".join(overrides(point, plain=True))
    for knob in ("min_num_params", "forward_prefetch", "reshard_after_forward"):
        assert knob not in plain and knob in "\n".join(overrides(point))
    assert "param_offload=true" in plain and "ppo_max_token_len_per_gpu=4096" in plain


def _tune_workload(overrides_: list[str], world_size: int):
    cfg = load_config(overrides_)
    fsdp = fsdp_settings(cfg.actor_rollout_ref.actor.fsdp_config, device_type="cuda", world_size=world_size)
    return tune_workload(cfg, fsdp, world_size=world_size, device_gib=80)


def test_the_preflight_predicts_the_path_the_trainer_runs():
    """One process: the plain path by default (its own terms), FSDP2 as before with plain_single_gpu=false,
    several processes or offload_policy."""
    model = load_model_config("Qwen2.5-0.5B")
    key = "actor_rollout_ref.actor.fsdp_config"
    for overrides_, world in (
        ([f"{key}.plain_single_gpu=false"], 1),
        ([], 2),
        ([f"{key}.offload_policy=true"], 1),
    ):
        tw = _tune_workload(overrides_, world)
        assert not tw.workload.runs_plain(tw.update_point), (overrides_, world)
        fsdp2 = dataclasses.replace(tw, workload=dataclasses.replace(tw.workload, plain=False))
        assert predicted_peaks_gib(tw, model) == predicted_peaks_gib(fsdp2, model)
        assert "(min_num_params, offload" in _over_budget_advice("update", 90.0, tw)
    tw = _tune_workload([], 1)
    assert tw.workload.plain and tw.workload.runs_plain(tw.update_point)
    phases = predict(ModelFacts.from_config(model), tw.update_point, tw.workload)
    assert "compute copy" in terms(phases["update"]) and "gathered root" not in terms(phases["log_prob"])
    assert "min_num_params" not in _over_budget_advice("update", 90.0, tw)


def test_a_plain_lora_model_holds_no_masters_of_its_frozen_weights(facts):
    """The plain path keeps no master of a frozen weight (:class:`MasterWeights`): with LoRA no masters on
    the device, and with the optimizer step on the CPU none on the host (the adapters' are not counted);
    FSDP2 keeps its fp32 shards of them."""
    from klppo.tune.host import host_peak

    T, c = 1024, 2
    w = Workload(
        world_size=1, compute_bytes=c, response_fraction=0.25, device_bytes=2**30, plain=True, lora=True
    )
    for point in (Point(0, micro_tokens=T), Point(0, "cpu_step", micro_tokens=T)):
        t = terms(predict(facts, point, w)["update"])
        assert t["sharded params"] == 0 and t["compute copy"] == P * c, point.offload
    host = terms(host_peak(facts, Point(0, "cpu_step", micro_tokens=T), w))
    assert host["masters"] == host["optimizer (AdamW)"] == host["step buffers (pinned)"] == 0
    full = terms(host_peak(facts, Point(0, "cpu_step", micro_tokens=T), dataclasses.replace(w, lora=False)))
    assert full["masters"] == P * 4
    fsdp2 = terms(predict(facts, Point(0, micro_tokens=T), dataclasses.replace(w, plain=False))["update"])
    assert fsdp2["sharded params"] == P * 4
