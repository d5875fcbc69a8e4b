"""The loop learns: a reward for emitting a chosen character rises over ~20 steps (tiny model, CPU)."""

from __future__ import annotations

import pytest

from tests.trainer.utils import base_overrides, read_metrics, run_training

pytestmark = pytest.mark.slow  # multi-process or long (minutes on 2 busy cores); `-m 'not slow'` skips it

REWARD_FN = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    """Fraction of the response's characters that are the digit 7."""
    return solution_str.count("7") / max(1, len(solution_str))
'''


def test_toy_reward_rises(tiny_model_dir, arithmetic_data, tmp_path):
    fn = tmp_path / "reward_fn.py"
    fn.write_text(REWARD_FN)
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4",
        "data.train_batch_size=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.optim.lr=3e-3",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "trainer.total_training_steps=20",
        f"custom_reward_function.path={fn}",
    ]
    run_training(overrides)
    scores = [row["critic/score/mean"] for row in read_metrics(tmp_path / "run")]
    assert len(scores) == 20
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > first + 0.1 and last > 2 * first, scores
