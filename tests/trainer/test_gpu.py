"""GPU smoke of the trainer paths CPU tests cannot reach (bf16 mixed precision, CUDA graphs in the
engine, offload to the host and back, the start-of-run memory check): one or two steps each on the tiny
model. Skipped without CUDA; run on the device with `python -m pytest -m gpu tests/trainer/test_gpu.py`."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.utils import base_overrides, read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CASES = {
    "klppo_engine_gae_bf16": [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.rollout.name=klppo",
        "algorithm.use_kl_in_reward=True",
    ],
    "offload_everything": [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.rollout.name=klppo",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "critic.model.fsdp_config.param_offload=True",
        "critic.model.fsdp_config.optimizer_offload=True",
        "trainer.save_freq=2",
    ],
    "lora_klppo_engine": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.name=klppo",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
    ],
    # one mini-batch: no old-log-prob pass, the reference (adapters off) is the first forward (issue 16's
    # crash: bf16 gradients assigned to the fp32 adapters); a checkpoint at step 1
    "lora_reference_first": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.name=klppo",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=mse",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.save_freq=1",
    ],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_gpu_steps(name, tiny_model_dir, arithmetic_data, tmp_path):
    overrides = [
        o.replace("trainer.device=cpu", "trainer.device=cuda")
        for o in base_overrides(tiny_model_dir, arithmetic_data, tmp_path)
    ]
    argv = overrides + CASES[name] + ["trainer.total_training_steps=2"]
    from klppo.assembly.setup import build_run
    from klppo.config import load_config
    from klppo.parallel import dist
    from klppo.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(argv)
    info = dist.init_distributed("cuda", 120.0)
    try:
        state = PPOTrainer(build_run(cfg, device=info.device, argv=argv)).fit()
    finally:
        dist.destroy()
    assert state.global_step == 2
    rows = read_metrics(tmp_path)
    for row in rows:
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"])
        assert row["perf/max_memory_allocated_gb"] > 0
