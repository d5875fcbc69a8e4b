"""`algorithm.rollout_correction` end to end on the CPU: token-level TIS (decoupled) and bypass mode's
REINFORCE each train a step of the tiny model and report verl's `rollout_corr/*` metrics."""

from __future__ import annotations

import math

import pytest

from tests.trainer.utils import base_overrides, read_metrics, run_training

SCORE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(sum(map(ord, solution_str)) % 2)
"""
K = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    "mode,extra",
    [
        ("decoupled", [f"{K}.rollout_is=token", f"{K}.rollout_is_threshold=2.0"]),
        ("bypass", [f"{K}.bypass_mode=True", f"{K}.loss_type=reinforce", f"{K}.rollout_is=token"]),
    ],
)
def test_token_tis_trains_and_reports_rollout_corr(mode, extra, tiny_model_dir, arithmetic_data, tmp_path):
    """GRPO with a parity score (mixed groups, so advantages), one step of two mini-batches. The HF rollout
    and the trainer run the same float32 forward: decoupled, π_old = π_rollout up to rounding, so the weights
    are 1 and the mismatch KL is about 0; in bypass mode the second mini-batch's policy has taken a step."""
    score = tmp_path / "parity.py"
    score.write_text(SCORE)
    over = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "algorithm.adv_estimator=grpo",
        f"custom_reward_function.path={score}",
        *extra,
    ]
    run_training(over)
    (metrics,) = read_metrics(tmp_path / "run")
    for name in (
        "kl",
        "k3_kl",
        "training_ppl",
        "rollout_ppl",
        "chi2_token",
        "rollout_is_mean",
        "rollout_is_eff_sample_size",
        "rollout_is_ratio_fraction_high",
    ):
        assert math.isfinite(metrics[f"rollout_corr/{name}"]), name
    tol = 1e-3 if mode == "decoupled" else 0.1
    assert metrics["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=tol)
    assert abs(metrics["rollout_corr/kl"]) < tol
    assert math.isfinite(metrics["actor/pg_loss"])
    if mode == "decoupled":
        assert "timing_s/old_log_prob" in metrics  # π_old from its own pass
    else:
        assert "timing_s/old_log_prob" not in metrics  # π_old = π_rollout
