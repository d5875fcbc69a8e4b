"""Shared fixtures for config tests: the parameter list of issue 3, verbatim."""

from __future__ import annotations

import pytest

ISSUE_LIST = """
trainer.n_gpus_per_node=8 data.train_batch_size=512 actor_rollout_ref.actor.ppo_mini_batch_size=128
actor_rollout_ref.model.path=Qwen/Qwen2.5-7B-Instruct actor_rollout_ref.actor.strategy=fsdp2
actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=0
actor_rollout_ref.actor.fsdp_config.param_offload=True
actor_rollout_ref.actor.fsdp_config.optimizer_offload=True
actor_rollout_ref.actor.fsdp_config.fsdp_size=-1 actor_rollout_ref.actor.fsdp_config.forward_prefetch=True
actor_rollout_ref.actor.use_kl_loss=True actor_rollout_ref.actor.kl_loss_coef=0.001
actor_rollout_ref.actor.kl_loss_type=low_var_kl algorithm.kl_ctrl.type=adaptive
algorithm.kl_ctrl.kl_coef=0.001
algorithm.kl_ctrl.target_kl=0.01 algorithm.kl_ctrl.horizon=10000 actor_rollout_ref.actor.clip_ratio=0.2
actor_rollout_ref.actor.entropy_coeff=0.001 actor_rollout_ref.actor.use_dynamic_bsz=True
actor_rollout_ref.actor.ppo_max_token_len_per_gpu=3072 actor_rollout_ref.rollout.gpu_memory_utilization=0.65
actor_rollout_ref.rollout.tensor_model_parallel_size=2 actor_rollout_ref.rollout.n=4
actor_rollout_ref.actor.ulysses_sequence_parallel_size=2 data.max_prompt_length=512
data.max_response_length=256 global_profiler.steps=[1,5,10] trainer.logger=[console,tensorboard]
""".split()


@pytest.fixture
def issue_list() -> list[str]:
    return list(ISSUE_LIST)


@pytest.fixture
def run_cli(capsys):
    """Run `klppo config ARGS` in-process: returns (exit code, stdout, stderr)."""
    from klppo.config.cli import main

    def run(argv: list[str]) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = main(list(argv))
        out, err = capsys.readouterr()
        return rc, out, err

    return run
