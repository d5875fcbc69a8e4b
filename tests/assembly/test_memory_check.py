"""The memory forecast and refusal before a GPU run starts (klppo/assembly/memory_check.py), at Qwen2.5-7B's
shape (config only): the GRPO recipe fits an 80 GiB GPU beside a 128 GiB host; PPO with a critic that steps
on the CPU too does not fit that host, and the refusal names the critic's share; LoRA without offload is
judged by LoRA's peaks (no AdamW state of the frozen weights)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from klppo.assembly import memory_check
from klppo.config import ConfigError, load_config
from tests.tune.test_host import GRPO, QWEN25_7B

GIB = 2**30
CPU_STEP = [
    "actor_rollout_ref.actor.fsdp_config.optimizer_step_on_cpu=true",
    "actor_rollout_ref.model.enable_gradient_checkpointing=true",
]


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen7b")
    (path / "config.json").write_text(json.dumps(QWEN25_7B))
    return str(path)


def _check(qwen7b: str, overrides: list[str], monkeypatch, *, host_gib: float = 128) -> None:
    """`klppo train`'s check on one 80 GiB GPU and a host of ``host_gib``."""
    monkeypatch.setattr(
        memory_check.torch.cuda, "get_device_properties", lambda _i: SimpleNamespace(total_memory=80 * GIB)
    )
    monkeypatch.setattr(memory_check, "host_ram_bytes", lambda _n: int(host_gib * GIB))
    cfg = load_config([*GRPO, f"actor_rollout_ref.model.path={qwen7b}", *overrides])
    memory_check.check_memory_fit(cfg, qwen7b, nproc=1)


def test_the_grpo_recipe_fits_and_a_small_host_is_refused(qwen7b, monkeypatch):
    _check(qwen7b, CPU_STEP, monkeypatch)
    with pytest.raises(ConfigError, match=r"host is predicted to need 111.4 GiB of its 96 GiB"):
        _check(qwen7b, CPU_STEP, monkeypatch, host_gib=96)
    with pytest.raises(ConfigError, match=r"update phase is predicted to need .* optimizer_step_on_cpu=true"):
        _check(qwen7b, [], monkeypatch)


def test_a_critic_stepped_on_the_cpu_too_is_refused_naming_its_share(qwen7b, monkeypatch):
    critic = [
        "algorithm.adv_estimator=gae",
        "critic.model.fsdp_config.optimizer_step_on_cpu=true",
        "critic.ppo_mini_batch_size=64",
    ]
    cfg = load_config([*GRPO, f"actor_rollout_ref.model.path={qwen7b}", *CPU_STEP, *critic])
    found = memory_check.forecast(cfg, qwen7b, world_size=1, device_gib=80, host_bytes=128 * GIB)
    critic_terms = {t.name: t.bytes for t in found.host.terms if t.name.startswith("critic ")}
    # a value head on the 7B backbone: 7.07e9 parameters, fp32 masters + AdamW on the host
    assert critic_terms["critic masters"] / GIB == pytest.approx(26.3, abs=0.05)
    assert critic_terms["critic optimizer (AdamW)"] / GIB == pytest.approx(52.7, abs=0.05)
    assert (
        found.refusal is not None and "196.5 GiB of its 128 GiB (85.1 GiB of it the critic's" in found.refusal
    )
    lines = memory_check.forecast_lines(found, "an 80 GiB GPU")
    assert lines[1].startswith("predicted peak host memory per process: 196.5 GiB of 128 (")
    assert lines[2].startswith("refused on an 80 GiB GPU with this host's memory: the host")


def test_lora_without_offload_is_judged_by_lora_peaks(qwen7b, monkeypatch):
    pytest.importorskip("peft")
    lora = [
        "actor_rollout_ref.model.lora_rank=64",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    ]
    _check(qwen7b, lora, monkeypatch)  # the full fine-tune's AdamW state would not fit: LoRA has none
    cfg = load_config([*GRPO, f"actor_rollout_ref.model.path={qwen7b}", *lora])
    found = memory_check.forecast(cfg, qwen7b, world_size=1, device_gib=80, host_bytes=128 * GIB)
    assert found.device_bytes["update"] < 60 * GIB and found.refusal is None
