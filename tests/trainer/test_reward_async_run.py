"""A GRPO run scored in the background (``reward_model.launch_reward_fn_async=True``) logs every metric of
the same run scored in the step, the timings aside."""

from __future__ import annotations

import pytest

from tests.roles.test_reward_async import SCORE_BY_TEXT
from tests.trainer.utils import base_overrides, read_metrics, run_training


@pytest.mark.slow
def test_a_training_run_scored_in_the_background_equals_the_in_step_run(
    tiny_model_dir, arithmetic_data, tmp_path
):
    fn = tmp_path / "reward_fn.py"
    fn.write_text(SCORE_BY_TEXT.replace('extra_info["row"]', "0"))
    common = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True",
              f"custom_reward_function.path={fn}", "trainer.total_training_steps=2"]  # fmt: skip
    rows = {}
    for name, flag in (("step", "False"), ("background", "True")):
        run = tmp_path / name
        run_training(base_overrides(tiny_model_dir, arithmetic_data, run) + common
                     + [f"reward_model.launch_reward_fn_async={flag}"])  # fmt: skip
        rows[name] = read_metrics(run)
    assert len(rows["step"]) == len(rows["background"]) == 2
    for a, b in zip(rows["step"], rows["background"], strict=True):
        same = {
            k: a[k] for k in a if not k.startswith(("timing_s/", "perf/")) and "_s" not in k.split("/")[-1]
        }
        assert {k: b.get(k) for k in same} == same
    assert any(r["critic/score/max"] > 0 for r in rows["step"])  # the scores varied: the check has teeth
