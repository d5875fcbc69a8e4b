"""`algorithm.rollout_correction` end to end on the CPU: token-level TIS (decoupled), bypass mode's
REINFORCE and decoupled rejection (`rollout_rs`) train the tiny model and report verl's `rollout_corr/*`
metrics."""

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
        (
            "bypass",
            [
                f"{K}.bypass_mode=True",
                f"{K}.loss_type=reinforce",
                f"{K}.rollout_is=token",
                f"{K}.rollout_rs=seq_mean_k3",  # δ ≈ 0.1 at most: the threshold keeps every row
                f"{K}.rollout_rs_threshold=10.0",
            ],
        ),
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
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] == 0.0  # rejection ran in the actor


@pytest.mark.parametrize(
    "options,threshold,rejected",
    [
        # the HF rollout and the trainer run the same float32 forward: δ ≈ 0, every token kept
        ("token_k1,seq_mean_k3", "0.5_2.0,0.1", 0.0),
        # k1 = −δ ≈ 0 lies below ln 1.5: every token rejected, the update has nothing to train on
        ("token_k1", "1.5_2.0", 1.0),
    ],
)
def test_rejection_trains_two_steps_and_reports_the_rejected_share(
    options, threshold, rejected, tiny_model_dir, arithmetic_data, tmp_path
):
    """Decoupled rejection on the gloo world of one process: two steps, verl's rejected fractions per step,
    and a step with every token rejected trains nothing (no gradient) without a non-finite value."""
    score = tmp_path / "parity.py"
    score.write_text(SCORE)
    over = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "algorithm.adv_estimator=grpo",
        f"custom_reward_function.path={score}",
        f"{K}.rollout_rs={options}",
        f"{K}.rollout_rs_threshold={threshold}",
        "actor_rollout_ref.actor.entropy_coeff=0.01",  # a gradient from every kept token
        "trainer.total_training_steps=2",
    ]
    run_training(over)
    metrics = read_metrics(tmp_path / "run")
    assert len(metrics) == 2
    for step in metrics:
        assert step["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(rejected, abs=1e-6)
        assert step["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(rejected, abs=1e-6)
        for option in options.split(","):
            assert math.isfinite(step[f"rollout_corr/rollout_rs_{option}_masked_fraction"])
        assert "rollout_corr/rollout_is_mean" not in step  # rejection alone: no weights
        assert step.get("training/nan_steps", 0.0) == 0.0
        if rejected == 1.0:  # no token to weigh: no gradient, and no token statistic to report
            assert step["actor/grad_norm"] == 0.0 and "actor/pg_loss" not in step
        else:
            assert math.isfinite(step["actor/pg_loss"]) and step["actor/grad_norm"] > 0
