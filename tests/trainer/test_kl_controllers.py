"""KL control through `klppo train` (tiny model, CPU): the KL-loss controller's β follows its rule on the
step's measured KL and resumes exactly; the reward-side penalty share is reported and warns."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from klppo.algorithms.kl_control import make_kl_controller
from tests.trainer.utils import base_overrides, read_metrics, run_training

pytestmark = pytest.mark.slow  # multi-process or long (minutes on 2 busy cores); `-m 'not slow'` skips it

PI = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    "actor_rollout_ref.actor.kl_loss_coef=0.05",
    "actor_rollout_ref.actor.kl_loss_ctrl.type=pi",
    "actor_rollout_ref.actor.kl_loss_ctrl.target_kl=0.001",
    "actor_rollout_ref.actor.kl_loss_ctrl.min_coef=0.001",
    # an annealed target: 0.01 for the first update, then halfway (geometric) and the final 0.001 from update
    # 3
    "actor_rollout_ref.actor.kl_loss_ctrl.target_kl_start=0.01",
    "actor_rollout_ref.actor.kl_loss_ctrl.anneal_begin=1",
    "actor_rollout_ref.actor.kl_loss_ctrl.anneal_steps=2",
    "actor_rollout_ref.actor.optim.lr=3e-3",
    "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # one mini-batch: on-policy
    # a score every group varies in: the policy must move for the KL to rise (not luck with the arithmetic
    # scorer)
    f"custom_reward_function.path={Path(__file__).with_name('length_reward.py')}",
]


def test_pi_kl_loss_controller_in_the_loop_and_resume(tiny_model_dir, arithmetic_data, tmp_path):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    run_training(
        base_overrides(tiny_model_dir, arithmetic_data, full_dir) + PI + ["trainer.total_training_steps=4"]
    )
    rows = read_metrics(full_dir)
    # the β each step used is the controller's output on that step's measured KL(π_old‖π_ref) (k3)
    ctrl = make_kl_controller(
        "pi", 0.05, 0.001, min_coef=0.001, max_coef=10.0, target_kl_start=0.01, anneal_begin=1, anneal_steps=2
    )
    for row in rows:  # β of step t from KL_1 … KL_{t−1}: the controller reads each step's KL after its update
        assert row["actor/kl_coef"] == pytest.approx(ctrl.value, rel=1e-9)
        assert row["actor/kl_loss_ctrl_kl"] == pytest.approx(row["actor/ref_kl_k3"], rel=1e-6, abs=1e-9)
        ctrl.update(row["actor/kl_loss_ctrl_kl"])
        assert row["actor/kl_loss_ctrl_target"] == pytest.approx(ctrl.target, rel=1e-12)
    assert [r["actor/kl_loss_ctrl_target"] for r in rows] == pytest.approx([0.01, 0.01, 10**-2.5, 0.001])
    assert rows[0]["actor/ref_kl_k3"] == pytest.approx(0.0, abs=1e-6)  # actor = reference at step 1
    assert rows[-1]["actor/ref_kl_k3"] > 0.001 and rows[-1]["actor/kl_coef"] > rows[2]["actor/kl_coef"]
    assert "timing_s/old_log_prob" not in rows[0]  # on-policy: the controller does not need the extra pass

    # the same run with the old-log-prob pass kept: the same β sequence (the KL read before vs in the update)
    kept_dir = tmp_path / "kept"
    run_training(
        base_overrides(tiny_model_dir, arithmetic_data, kept_dir)
        + PI
        + ["trainer.total_training_steps=4", "actor_rollout_ref.actor.skip_old_log_prob_on_policy=False"]
    )
    kept = read_metrics(kept_dir)
    assert "timing_s/old_log_prob" in kept[0]
    for a, b in zip(rows, kept):
        assert a["actor/kl_coef"] == pytest.approx(b["actor/kl_coef"], rel=1e-5)
        assert a["actor/kl_loss_ctrl_kl"] == pytest.approx(b["actor/kl_loss_ctrl_kl"], rel=1e-4, abs=1e-7)

    cut = base_overrides(tiny_model_dir, arithmetic_data, cut_dir) + PI
    run_training(cut + ["trainer.total_training_steps=2", "trainer.save_freq=2"])
    run_training(cut + ["trainer.total_training_steps=4"])
    resumed = {row["step"]: row for row in read_metrics(cut_dir)}
    for key in (
        "actor/kl_coef",
        "actor/kl_loss",
        "actor/pg_loss",
        "actor/ref_kl_k3",
        "actor/kl_loss_ctrl_target",
    ):
        assert resumed[4][key] == pytest.approx(rows[3][key], rel=1e-5, abs=1e-7), key


REWARD_FN = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 0.001 * (len(solution_str) % 3)
"""


def test_reward_penalty_share_metric_and_warning(tiny_model_dir, arithmetic_data, tmp_path, caplog):
    fn = tmp_path / "reward_fn.py"
    fn.write_text(REWARD_FN)
    run_dir = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.kl_coef=5.0",
        "actor_rollout_ref.actor.optim.lr=3e-3",
        f"custom_reward_function.path={fn}",
        "trainer.total_training_steps=6",
    ]
    with caplog.at_level(logging.WARNING, logger="klppo"):
        run_training(overrides)
    rows = read_metrics(run_dir)
    assert rows[0]["actor/reward_kl_penalty_share"] == pytest.approx(0.0, abs=1e-6)
    assert all(row["actor/reward_kl_penalty_share"] > 1.0 for row in rows[1:])
    warnings = [r.getMessage() for r in caplog.records if "outweighs the task score" in r.getMessage()]
    assert len(warnings) == 1 and "step 6" in warnings[0], warnings


def test_the_penalty_share_warning_names_the_setting_that_acts_for_the_controller():
    """A fixed β is set by kl_coef; an adaptive or PI controller moves β toward target_kl (it advised
    raising target_kl under a fixed controller, which ignores it); all-zero scores are no task signal."""
    from klppo.config import load_config
    from klppo.trainer.phases import penalty_share_message

    def message(score, *over):
        algo = load_config(["algorithm.use_kl_in_reward=True", *over]).algorithm
        return penalty_share_message(6, 5, 2.5, 0.2, algo, score)

    fixed = message(0.5)
    assert "Lower algorithm.kl_ctrl.kl_coef (β=0.2, fixed)" in fixed and "target_kl" not in fixed
    adaptive = message(0.5, "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=0.05")
    assert "Raise algorithm.kl_ctrl.target_kl (now 0.05; the adaptive controller moves β=0.2" in adaptive
    zero = message(0.0)
    assert "every sample scored 0" in zero and "kl_coef" not in zero
