"""A step whose rollout samples with top-k: rollout correction weighs π_old against the truncated law the
engine sampled from (``Batch.rollout_log_probs``), while ``rollout/log_prob_diff`` compares the two full
softmaxes (the engine's truncated log-probs plus its log kept mass), on both the old-log-prob pass and the
on-policy update that skips it."""

from __future__ import annotations

import pytest

from tests.trainer.utils import base_overrides, read_metrics, run_training

SCORE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(sum(map(ord, solution_str)) % 2)
"""
K = "algorithm.rollout_correction"


def _overrides(tiny_model_dir, arithmetic_data, tmp_path, *extra) -> list[str]:
    score = tmp_path / "parity.py"
    score.write_text(SCORE)
    return base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "actor_rollout_ref.rollout.name=klppo",
        "actor_rollout_ref.rollout.top_k=5",
        "algorithm.adv_estimator=grpo",
        f"custom_reward_function.path={score}",
        *extra,
    ]


def test_correction_weighs_against_the_truncated_law(tiny_model_dir, arithmetic_data, tmp_path):
    """The engine and the trainer run the same float32 forward, so the full softmaxes agree (diff about 0);
    the law sampled from keeps K < 1 of the mass, so δ = log π_old − log q = log K: the mismatch KL is
    mean(−log K) > 0 and the token weights, exp(δ) = K, are below 1."""
    run_training(_overrides(tiny_model_dir, arithmetic_data, tmp_path, f"{K}.rollout_is=token"))
    (metrics,) = read_metrics(tmp_path / "run")
    assert metrics["rollout/log_prob_diff"] < 1e-4
    assert metrics["rollout_corr/kl"] > 0.1
    assert metrics["rollout_corr/rollout_is_mean"] < 0.95


def test_on_policy_update_compares_full_softmaxes(tiny_model_dir, arithmetic_data, tmp_path):
    """Without the old-log-prob pass the update's own log-probs give ``rollout/log_prob_diff``: about 0."""
    over = _overrides(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # = train_batch_size: on-policy
        "actor_rollout_ref.actor.skip_old_log_prob_on_policy=True",
    )
    run_training(over)
    (metrics,) = read_metrics(tmp_path / "run")
    assert "timing_s/old_log_prob" not in metrics
    assert metrics["rollout/log_prob_diff"] == pytest.approx(0.0, abs=1e-4)


def test_mixed_step_joins_truncated_and_logged_rows(tiny_model_dir, arithmetic_data, tmp_path):
    """A mixed step (``data.logged_share=0.5``) of generated top-k rows, which carry a log kept mass, and
    logged rows (untruncated, sampled by the same initial model), which carry none: the join takes the
    latter's as 0, and each source's ``log_prob_diff`` compares full softmaxes, about 0 for both."""
    from klppo.commands.log_data import main

    log = tmp_path / "log.parquet"
    common = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "unused")
    assert main(["--output", str(log), "--n", "2", "--num-prompts", "8", *common]) == 0
    over = _overrides(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        f"data.logged_files={log}",
        "data.logged_share=0.5",
        f"{K}.rollout_is=token",
    )
    run_training(over)
    (metrics,) = read_metrics(tmp_path / "run")
    assert metrics["mixed/logged_share"] == 0.5
    assert metrics["mixed/fresh/log_prob_diff"] < 1e-4
    assert metrics["mixed/logged/log_prob_diff"] < 1e-4
    assert metrics["rollout_corr/kl"] > 0.05  # the generated rows' truncation: δ = log K there
