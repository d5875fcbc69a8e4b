"""A GRPO run scored in the background (``reward_model.launch_reward_fn_async=True``) logs every metric of
the same run scored in the step, the timings aside — and its scores did come from the scoring process (the
function logs where it ran: a fallback to the trainer would give the same metrics)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer.utils import base_overrides, read_metrics, run_training

# varied scores (non-zero advantages), and the name of the process that computed each one
LOGGING_SCORE = """
import multiprocessing
def compute_score(data_source, solution_str, ground_truth, extra_info=None, log=None, **kwargs):
    with open(log, "a") as f:
        f.write(multiprocessing.current_process().name + "\\n")
    return (sum(map(ord, solution_str)) % 7) / 6.0
"""


def scored_where(log: Path) -> list[str]:
    return log.read_text().split() if log.exists() else []


@pytest.mark.slow
def test_a_training_run_scored_in_the_background_equals_the_in_step_run(
    tiny_model_dir, arithmetic_data, tmp_path
):
    fn = tmp_path / "reward_fn.py"
    fn.write_text(LOGGING_SCORE)
    rows, where = {}, {}
    for name, flag in (("step", "False"), ("background", "True")):
        run, log = tmp_path / name, tmp_path / f"{name}.log"
        common = [
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.use_kl_loss=True",
            f"custom_reward_function.path={fn}",
            "trainer.total_training_steps=2",
            f"reward_model.reward_kwargs={{log: {log}}}",
        ]
        run_training(
            base_overrides(tiny_model_dir, arithmetic_data, run)
            + common
            + [f"reward_model.launch_reward_fn_async={flag}"]
        )
        rows[name], where[name] = read_metrics(run), scored_where(log)
    assert len(rows["step"]) == len(rows["background"]) == 2
    for a, b in zip(rows["step"], rows["background"], strict=True):
        same = {
            k: a[k] for k in a if not k.startswith(("timing_s/", "perf/")) and "_s" not in k.split("/")[-1]
        }
        assert {k: b.get(k) for k in same} == same
    assert any(r["critic/score/max"] > 0 for r in rows["step"])  # the scores varied: the check has teeth
    assert len(where["step"]) == len(where["background"]) == 2 * 4 * 2  # steps × prompts × n
    assert set(where["step"]) == {"MainProcess"}
    assert all(w.startswith("SpawnProcess") for w in where["background"])
