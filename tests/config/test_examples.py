"""The recipes in examples/ load and pass the start-up checks (their figures are in docs/performance.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from klppo.config import load_config
from klppo.config.unimplemented import check_trainable

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_loads(path):
    cfg = load_config([str(path)])
    check_trainable(cfg)
    # every recipe regularises toward the reference: a KL loss or the KL in the reward
    assert cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def test_examples_exist():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize(
    "example,setting,task",
    [
        # bench/learning.py's t14_s2, its seed included
        (
            "arithmetic_grpo_kl_ramp.yaml",
            "t14_s2=grpo_pi,{G},{R},{C}.target_kl=0.14,{B},actor_rollout_ref.rollout.n=4,{M},{F},"
            "{K}.skip_zero_advantage_rows=True,trainer.seed=2,{K}.optim.lr=5e-5,{K}.optim.lr_scheduler_type=cosine,"
            "{K}.optim.min_lr_ratio=0.1,trainer.total_training_steps=378,reward_model.launch_reward_fn_async=True",
            "arithmetic",
        ),
        # bench/learning.py's gae_p256
        (
            "arithmetic_gae_kl_ramp.yaml",
            "gae_p256=gae_pi,{G},{R},{C}.target_kl=0.13,{K}.optim.lr=3e-5,{K}.entropy_coeff=0.001,"
            "data.train_batch_size=256,actor_rollout_ref.rollout.n=4,{K}.ppo_mini_batch_size=256,"
            "critic.ppo_mini_batch_size=256,critic.optim.lr=5e-5,{M},{F},{V},reward_model.launch_reward_fn_async=True",
            "arithmetic",
        ),
        # bench/learning.py --task gsm8k's gsm_ramp
        (
            "gsm8k_grpo_kl_target.yaml",
            "gsm_ramp=grpo_pi,{G},{R},{C}.target_kl=0.13,{K}.optim.lr=4e-5,data.train_batch_size=128,"
            "{K}.ppo_mini_batch_size=128,{M},{F},{K}.skip_zero_advantage_rows=True,"
            "reward_model.launch_reward_fn_async=True,reward=strict",
            "gsm8k",
        ),
    ],
)
def test_ramp_recipes_are_the_measured_settings(example, setting, task):
    """The recipe file trains what bench/learning.py measured (its presets and the setting's overrides, as
    listed in docs/performance.md): the actor, rollout, critic, algorithm and batch sections agree."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_learning", Path(__file__).resolve().parents[2] / "bench" / "learning.py"
    )
    learning = importlib.util.module_from_spec(spec)
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # learning.py imports arith_reward
    try:
        spec.loader.exec_module(learning)
    finally:
        sys.path.pop(0)
    COMMON, parse_setting, task_overrides = learning.COMMON, learning.parse_setting, learning.TASK_OVERRIDES

    K = "actor_rollout_ref.actor"
    C = f"{K}.kl_loss_ctrl"
    parts = dict(
        K=K,
        C=C,
        G=f"{C}.kp=0.6,{C}.ki=0.15,{C}.min_coef=0.03,{C}.max_coef=1,{K}.kl_loss_type=mse",
        M=f"{K}.ppo_max_token_len_per_gpu=65536,actor_rollout_ref.rollout.free_cache_engine=False",
        B=f"data.train_batch_size=256,{K}.ppo_mini_batch_size=256",
        R=f"{K}.kl_loss_coef=0.3,{C}.target_kl_start=0.02,{C}.anneal_begin=0,{C}.anneal_steps=40",
        F="actor_rollout_ref.model.use_fused_kernels=True,actor_rollout_ref.model.compile_packed_layers=True",
        V="critic.model.use_remove_padding=True,critic.model.compile_packed_layers=True,"
        "critic.ppo_max_token_len_per_gpu=65536,critic.forward_max_token_len_per_gpu=65536",
    )
    _, overrides, method = parse_setting(setting.format(**parts))
    measured = load_config([*COMMON, *task_overrides[task], *overrides])
    recipe = load_config([str(Path(__file__).resolve().parents[2] / "examples" / example)])
    arr_m, arr_r = measured.actor_rollout_ref, recipe.actor_rollout_ref
    assert arr_r.actor == arr_m.actor
    assert arr_r.rollout == arr_m.rollout
    assert arr_r.model == arr_m.model
    assert arr_r.ref == arr_m.ref
    if measured.algorithm.adv_estimator == "gae":  # GRPO builds no critic: its section is not read
        assert recipe.critic == measured.critic
    assert recipe.algorithm == measured.algorithm
    for key in ("enable", "launch_reward_fn_async", "num_workers", "reward_manager"):  # background scoring
        assert getattr(recipe.reward_model, key) == getattr(measured.reward_model, key), key
    if method != "flexible":  # the bench's reward method (the arithmetic recipes use the default scorer)
        assert dict(recipe.reward_model.reward_kwargs)["method"] == method
    assert recipe.trainer.seed == measured.trainer.seed  # another seed is another run
    if arr_m.actor.optim.lr_scheduler_type == "cosine":  # the schedule's length is the run's step count
        assert recipe.trainer.total_training_steps == measured.trainer.total_training_steps
    paths = ("train_files", "val_files")  # the recipe names none; the bench writes its own
    assert {k: v for k, v in vars(recipe.data).items() if k not in paths} == {
        k: v for k, v in vars(measured.data).items() if k not in paths
    }


def test_the_retry_recipe_names_an_interaction_that_loads_and_agrees_with_its_reward():
    """examples/arithmetic_grpo_retry.yaml: its interaction config (a path from the repository root) loads,
    holds the name `klppo data arithmetic --interaction arithmetic` writes into the rows, and judges answers
    by the rule the reward reads."""
    from klppo.tools.config import load_interactions

    root = Path(__file__).resolve().parents[2]
    cfg = load_config([str(root / "examples" / "arithmetic_grpo_retry.yaml")])
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    assert mt.enable and mt.max_assistant_turns == 2
    interaction = load_interactions(str(root / mt.interaction_config_path))["arithmetic"]
    assert interaction.method == cfg.reward_model.reward_kwargs["method"] == "flexible"
