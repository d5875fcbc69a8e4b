"""The critic's memory (klppo/tune/critic.py) from config files only (meta models, no weights): PPO on a 7B
actor with the GRPO recipe's settings (the actor's optimizer stepped on the CPU) and a critic on its own model
(``critic.model.path``), its own LoRA, dtype and offload — on the device per phase, on the host, in
`klppo train --dry-run`'s forecast and in `klppo tune --dry-run`."""

from __future__ import annotations

import json

import pytest

from klppo.assembly import memory_check
from klppo.commands.tune import main as tune_main
from klppo.config import load_config
from klppo.tune.critic import value_params
from klppo.tune.units import ModelFacts
from tests.tune.test_host import GRPO, QWEN25_7B

GIB = 2**30
H200_GIB, HOST = 140.0, 128 * GIB
QWEN25_15B = {
    **QWEN25_7B,
    "hidden_size": 1536,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "intermediate_size": 8960,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
}
PPO = [
    "actor_rollout_ref.actor.fsdp_config.optimizer_step_on_cpu=true",
    "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    "algorithm.adv_estimator=gae",
    "critic.ppo_mini_batch_size=64",
    "critic.use_dynamic_bsz=true",
    "critic.ppo_max_token_len_per_gpu=8192",
    "critic.model.enable_gradient_checkpointing=true",
]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    out = {}
    for name, config in (("7b", QWEN25_7B), ("1.5b", QWEN25_15B)):
        path = tmp_path_factory.mktemp(name.replace(".", "_"))
        (path / "config.json").write_text(json.dumps(config))
        out[name] = str(path)
    return out


def _forecast(models: dict[str, str], overrides: list[str]) -> memory_check.Forecast:
    cfg = load_config([*GRPO, f"actor_rollout_ref.model.path={models['7b']}", *PPO, *overrides])
    return memory_check.forecast(cfg, models["7b"], world_size=1, device_gib=H200_GIB, host_bytes=HOST)


def _critic_terms(phase) -> dict[str, float]:
    return {t.name: t.bytes for t in phase.terms if t.name.startswith("critic ")}


def test_a_smaller_critic_is_read_from_its_own_path_and_fits_one_h200(models):
    found = _forecast(models, [f"critic.model.path={models['1.5b']}"])
    small = value_params(ModelFacts.from_config(memory_check.AutoConfig.from_pretrained(models["1.5b"])))
    assert 1.5e9 < small < 1.6e9  # tied embeddings: no LM head to drop, a one-output head added
    assert found.refusal is None and set(found.device_bytes) == {
        *("rollout", "log_prob", "update"),
        *("values", "update_critic"),
    }
    # the critic stays on the GPU between its passes: its fp32 masters + AdamW, 12 bytes a parameter, with
    # the plain path's bf16 compute copy (2 bytes), in every actor phase; nothing of it on the host
    alone = _forecast(models, ["algorithm.adv_estimator=grpo"])
    extra = found.device_bytes["update"] - alone.device_bytes["update"]
    assert extra == pytest.approx(small * 14, rel=1e-6)
    assert found.host.total == alone.host.total and not _critic_terms(found.host)
    assert found.device_bytes["update_critic"] < found.device_bytes["update"] < 0.95 * H200_GIB * GIB


def test_the_7b_critic_on_the_actors_backbone_stepped_on_the_cpu_is_refused(models):
    found = _forecast(models, ["critic.model.fsdp_config.optimizer_step_on_cpu=true"])
    assert found.refusal is not None and "196.5 GiB of its 128 GiB" in found.refusal
    alone = _forecast(models, ["algorithm.adv_estimator=grpo"])
    # on the GPU: its bf16 compute copy (7.07e9 parameters) in the actor's phases
    assert found.device_bytes["update"] - alone.device_bytes["update"] == pytest.approx(13.2 * GIB, rel=0.01)


def test_a_lora_critic_holds_no_adamw_or_masters_of_its_frozen_weights(models):
    lora = ["critic.model.lora_rank=64", "critic.model.lora_alpha=128"]
    full = _forecast(models, ["critic.model.fsdp_config.optimizer_step_on_cpu=true"])
    found = _forecast(models, [*lora, "critic.model.fsdp_config.optimizer_step_on_cpu=true"])
    host = _critic_terms(found.host)
    assert "critic optimizer (AdamW)" in host and host["critic optimizer (AdamW)"] == 0
    # the plain path keeps no master of a frozen weight: the full critic's 28 GB of fp32 masters are gone
    assert host["critic masters"] == 0 and _critic_terms(full.host)["critic masters"] > 25 * GIB
    # on the device: no master or compute-dtype gradients of the frozen weights in the critic's update
    assert found.device_bytes["update_critic"] < full.device_bytes["update_critic"] - 30 * GIB
    # without offload the LoRA critic stays on the GPU: the host holds what the GRPO recipe's does
    on_gpu = _forecast(models, lora)
    alone = _forecast(models, ["algorithm.adv_estimator=grpo"])
    assert on_gpu.refusal is None and on_gpu.host.total == alone.host.total


def test_the_critics_own_dtype_sizes_its_masters(models):
    fp32 = _forecast(models, ["critic.model.fsdp_config.optimizer_step_on_cpu=true"])
    bf16 = _forecast(
        models,
        ["critic.model.fsdp_config.optimizer_step_on_cpu=true", "critic.model.fsdp_config.model_dtype=bf16"],
    )
    assert _critic_terms(bf16.host)["critic masters"] == pytest.approx(
        _critic_terms(fp32.host)["critic masters"] / 2
    )


def test_tune_dry_run_reads_the_critics_model(models, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")  # the terms table unwrapped
    args = [f"actor_rollout_ref.model.path={models['7b']}", *GRPO, *PPO]
    small = args + ["critic.model.path=Qwen2.5-1.5B"]  # a named shape, as the actor's may be
    assert tune_main(["--dry-run", "--device-gb", "140", "--host-gb", "128", *small]) == 0
    out = capsys.readouterr().out
    assert "update_critic" in out and "values" in out and "a run is refused" not in out
    # the 1.5B critic's parameters (1.54e9, fp32 masters: 5.75 GiB) and its checkpoint's
    assert "│ values        │ sharded params        │   5.75 │" in out
    assert "P_t=1,543," in out
