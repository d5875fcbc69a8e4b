"""The memory model at Qwen2.5-7B's shape (config only, no weights): the device peak per phase and the host
memory the offload needs, and the refusal before weights load (klppo/tune/host.py). A full fine-tune with
fp32 AdamW on an 80 GiB GPU: refused without offload (naming what fits), accepted with the optimizer step on
the CPU and gradient checkpointing, the host memory stated."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from klppo.assembly.settings import fsdp_settings, tune_workload
from klppo.config import ConfigError, load_config
from klppo.tune.host import fit, refusal
from klppo.tune.preflight import check_memory

QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}
GIB = 2**30
H100, HOST = 80 * GIB, 128 * GIB
GRPO = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=8",
    "actor_rollout_ref.actor.use_kl_loss=true",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "data.max_prompt_length=512",
    "data.max_response_length=512",
    "actor_rollout_ref.actor.use_dynamic_bsz=true",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=8192",
    "actor_rollout_ref.ref.fsdp_config.param_offload=true",
]


@pytest.fixture(scope="module")
def qwen7b(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen7b")
    (path / "config.json").write_text(json.dumps(QWEN25_7B))
    return AutoConfig.from_pretrained(path)


def _workload(overrides: list[str], device_bytes: int = H100):
    cfg = load_config(GRPO + overrides)
    fsdp_cfg = cfg.actor_rollout_ref.actor.fsdp_config
    fsdp = fsdp_settings(
        fsdp_cfg, device_type="cuda", world_size=1, key="actor_rollout_ref.actor.fsdp_config"
    )
    return tune_workload(cfg, fsdp, world_size=1, device_gib=device_bytes / GIB)


def test_7b_full_fine_tune_is_refused_without_offload(qwen7b):
    message = refusal(_workload([]), qwen7b, host_bytes=HOST)
    assert message is not None and "update phase is predicted to need" in message
    with pytest.raises(ConfigError, match="optimizer_step_on_cpu=true"):  # the start-of-run check
        check_memory(_workload([]), qwen7b, host_bytes=HOST)
    assert "optimizer_step_on_cpu=true" in message and "host" in message


def test_7b_fits_with_the_optimizer_step_on_the_cpu(qwen7b):
    on = [
        "actor_rollout_ref.actor.fsdp_config.optimizer_step_on_cpu=true",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true",
    ]
    workload = _workload(on)
    assert workload.update_point.offload == "cpu_step" and workload.workload.runs_plain(workload.update_point)
    assert refusal(workload, qwen7b, host_bytes=HOST) is None
    phases, host = fit(workload, qwen7b, host_bytes=HOST)
    # device: the bf16 compute copy, fp32 master gradients, one backward's bf16 gradients, activations
    assert 50 * GIB < phases["update"] < 75 * GIB
    # host: fp32 masters + AdamW (7.6e9 × 12 bytes ≈ 85 GiB), the bf16 reference, pinned buffers, process
    assert 100 * GIB < host < 120 * GIB
    # the same run refused on a host too small for it, with the figure
    small = refusal(workload, qwen7b, host_bytes=64 * GIB)
    assert small is not None and f"host is predicted to need {host / GIB:.1f} GiB" in small
