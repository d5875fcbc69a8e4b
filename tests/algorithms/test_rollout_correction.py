"""Rollout correction against verl 0.9.1's own functions (fixtures from make_rollout_corr_fixtures.py, kept
in the repository so the test cannot skip) and against float64 cases worked by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from klppo.algorithms import losses
from klppo.algorithms import rollout_correction as rc

FIXTURES = Path(__file__).with_name("rollout_corr_verl091.json")


def _verl() -> dict:
    data = json.loads(FIXTURES.read_text())
    assert data["verl_version"] == "0.9.1"
    return data


def _correct(x: dict, setting: dict) -> rc.Correction:
    rs = setting.get("rollout_rs")
    return rc.rollout_correction(
        x["old_log_prob"],
        x["rollout_log_prob"],
        x["response_mask"],
        rollout_is=setting.get("rollout_is"),
        rollout_is_threshold=setting.get("rollout_is_threshold", 2.0),
        rollout_is_batch_normalize=setting.get("rollout_is_batch_normalize", False),
        rs_options=rc.parse_rs_options(rs, setting.get("rollout_rs_threshold")) if rs else (),
    )


def test_matches_verl_091_on_every_case() -> None:
    data = _verl()
    x = {k: torch.tensor(v, dtype=torch.float64) for k, v in data["inputs"].items()}
    assert len(data["cases"]) >= 29
    for case in data["cases"]:
        got = _correct(x, case["setting"])
        where = case["setting"]
        if case["weights"] is None:
            assert got.weights is None, where
        else:
            torch.testing.assert_close(got.weights, torch.tensor(case["weights"], dtype=torch.float64))
        assert got.response_mask.tolist() == case["response_mask"], where
        assert set(got.metrics) == set(case["metrics"]), (where, set(got.metrics) ^ set(case["metrics"]))
        for key, want in case["metrics"].items():
            # a std is √(E[x²] − E[x]²): where it is 0, the rounding of the difference (~1e-12) shows as ~1e-6
            tol = 1e-5 if key.endswith("_std") else 1e-9
            assert float(got.metrics[key]) == pytest.approx(want, rel=1e-6, abs=tol), (where, key)


def test_reinforce_loss_matches_verl_091() -> None:
    data = _verl()
    x = {k: torch.tensor(v, dtype=torch.float64) for k, v in data["inputs"].items()}
    for case in data["reinforce"]:
        weights = _correct(x, case["setting"]).weights
        loss, stats = rc.reinforce_loss(
            x["rollout_log_prob"],
            x["old_log_prob"],
            x["advantages"],
            x["response_mask"],
            weights=weights,
            loss_agg_mode=case["loss_agg_mode"],
        )
        # seq-mean-token-sum: klppo divides by all rows (docs/algorithms.md, Aggregation), verl 0.9.1 by the
        # rows with a token — the fixture's one empty row of six makes that 5/6
        scale = 5 / 6 if case["loss_agg_mode"] == "seq-mean-token-sum" else 1.0
        assert float(loss) == pytest.approx(case["loss"] * scale, rel=1e-9)
        assert float(stats["ppo_kl"]) == pytest.approx(case["actor/ppo_kl"], rel=1e-9)


# ---- float64 cases by hand: δ = [[ln 3, ln ½, 0], [ln 1.5, pad, pad]]
L3, LH, L15 = math.log(3.0), math.log(0.5), math.log(1.5)
DELTA = torch.tensor([[L3, LH, 0.0], [L15, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
ROLL = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -3.0, -3.0]], dtype=torch.float64)


def _w(level: str, threshold, normalize: bool = False) -> list[list[float]]:
    w, _ = rc.is_weights(DELTA, MASK, level=level, threshold=threshold, batch_normalize=normalize)
    return w.flatten().tolist()


def test_token_tis_icepop_and_normalisation_by_hand() -> None:
    assert _w("token", 2.0) == pytest.approx([2.0, 0.5, 1.0, 1.5, 0.0, 0.0])  # 3 truncated to 2
    assert _w("token", "0.6_2.5") == pytest.approx([0.0, 0.0, 1.0, 1.5, 0.0, 0.0])  # 3 and ½ out
    # normalised: mean of (2, ½, 1, 1.5) = 1.25
    assert _w("token", 2.0, True) == pytest.approx([1.6, 0.4, 0.8, 1.2, 0.0, 0.0])
    _, stats = rc.is_weights(DELTA, MASK, level="token", threshold=2.0)
    assert float(stats["rollout_is_mean"]) == pytest.approx(1.25)
    assert float(stats["rollout_is_ratio_fraction_high"]) == pytest.approx(0.25)  # 3 > 2
    assert float(stats["rollout_is_ratio_fraction_low"]) == pytest.approx(0.0)  # ½ is not < ½
    # ESS = 1 / mean((w / mean w)²) = 1 / (mean(4, ¼, 1, 2.25) / 1.5625)
    assert float(stats["rollout_is_eff_sample_size"]) == pytest.approx(1.5625 / 1.875, rel=1e-7)


def test_sequence_tis_by_hand() -> None:
    # row 0: 3 · ½ · 1 = 1.5 on every token; row 1: 1.5
    assert _w("sequence", 2.0) == pytest.approx([1.5, 1.5, 1.5, 1.5, 0.0, 0.0])
    assert _w("sequence", 1.2) == pytest.approx([1.2, 1.2, 1.2, 1.2, 0.0, 0.0])
    assert _w("sequence", "0.5_1.4") == pytest.approx([0.0] * 6)
    # normalised by the mean over rows of each row's token-mean: (1.2 + 1.2) / 2
    assert _w("sequence", 1.2, True) == pytest.approx([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])


def _kept(option: str, threshold) -> list[list[float]]:
    kept, _ = rc.rejection_mask(DELTA, MASK, rc.parse_rs_options(option, threshold))
    return kept.tolist()


def test_rejection_by_hand() -> None:
    # k1 = −δ kept within [ln 0.6, ln 1.5]: δ ∈ [−0.405, 0.511] → ln 3 and ln ½ rejected
    assert _kept("token_k1", "0.6_1.5") == [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    # k3 = e^δ − 1 − δ: ln 3 → 0.9014, ln ½ → 0.1931, 0 → 0, ln 1.5 → 0.0945
    assert _kept("token_k3", 0.15) == [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]
    assert _kept("token_k3", 0.5) == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert _kept("seq_mean_k3", 0.2) == [[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]  # row 0 mean 0.3648
    assert _kept("seq_max_k3", 0.95) == [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    # seq_sum_k1 = −Σδ = −ln 1.5 for both rows: outside [ln 0.9, ln 1.1] = [−0.105, 0.095]
    assert _kept("seq_sum_k1", "0.9_1.1") == [[0.0] * 3, [0.0] * 3]
    # k2 = ½δ²: ln 3 → 0.603, ln ½ → 0.240, ln 1.5 → 0.082; two options must both pass
    assert _kept("token_k2,seq_max_k2", "0.5,0.7") == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    _, stats = rc.rejection_mask(DELTA, MASK, rc.parse_rs_options("seq_mean_k3", 0.2))
    assert float(stats["rollout_rs_masked_fraction"]) == pytest.approx(0.75)
    assert float(stats["rollout_rs_seq_masked_fraction"]) == pytest.approx(0.5)


def test_offpolicy_metrics_by_hand() -> None:
    stats = rc.offpolicy_metrics(ROLL + DELTA, ROLL, MASK)
    assert float(stats["kl"]) == pytest.approx(-(L3 + LH + L15) / 4)
    assert float(stats["k3_kl"]) == pytest.approx((2 - L3 + (-0.5 - LH) + (0.5 - L15)) / 4)
    assert float(stats["chi2_token"]) == pytest.approx((9 + 0.25 + 1 + 2.25) / 4 - 1)
    assert float(stats["chi2_seq"]) == pytest.approx(1.5**2 - 1)
    train0, roll0 = (-1.0 + L3 - 2.0 + LH - 0.5) / 3, -3.5 / 3
    train1, roll1 = -1.5 + L15, -1.5
    assert float(stats["log_ppl_diff"]) == pytest.approx(((roll0 - train0) + (roll1 - train1)) / 2)
    assert float(stats["training_ppl"]) == pytest.approx((math.exp(-train0) + math.exp(-train1)) / 2)


def test_reinforce_and_weighted_policy_loss_by_hand() -> None:
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -0.5]], dtype=torch.float64)
    m = torch.ones(1, 2, dtype=torch.float64)
    w = torch.tensor([[2.0, 0.5]], dtype=torch.float64)
    loss, _ = rc.reinforce_loss(lp.detach(), lp, adv, m, weights=w)
    assert float(loss) == pytest.approx((-(1.0 * 2.0 * -1.0) - (-0.5 * 0.5 * -2.0)) / 2)  # (2 − 0.5) / 2
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-1.0, 0.125])  # −A·w / 2
    # the vanilla loss with weights: on-policy ratio 1, so ℓ = −A·w
    pg, _ = losses.policy_loss(lp.detach(), lp.detach(), adv, m, rollout_is_weights=w)
    assert float(pg) == pytest.approx((-2.0 + 0.25) / 2)
    unweighted, _ = losses.policy_loss(lp.detach(), lp.detach(), adv, m)
    assert float(unweighted) == pytest.approx((-1.0 + 0.5) / 2)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_one_update_decoupled_equals_bypass_reinforce(level: str) -> None:
    """One mini-batch and one epoch: the decoupled correction (π_old = the policy at the update, PPO ratio
    1, weights min(π_old / π_roll, C)) and bypass mode's REINFORCE (weights from the current policy) give
    the same gradient (the losses' values differ: −A·w against −A·w·log π), so an on-policy offline step
    needs no π_old pass (docs/training.md)."""
    g = torch.Generator().manual_seed(0)
    lp0 = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 3
    roll = lp0 + 0.8 * torch.randn(3, 5, generator=g, dtype=torch.float64)  # some weights past C
    adv = torch.randn(3, 5, generator=g, dtype=torch.float64)
    m = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0]], dtype=torch.float64)
    settings = rc.CorrectionSettings(rollout_is=level, rollout_is_threshold=2.0)
    decoupled = settings.apply(lp0, roll, m)
    lp_a = lp0.clone().requires_grad_(True)
    loss_a, _ = losses.policy_loss(lp0, lp_a, adv, m, rollout_is_weights=decoupled.weights)
    loss_a.backward()
    lp_b = lp0.clone().requires_grad_(True)
    bypass = settings.apply(lp_b.detach(), roll, m)  # the actor's micro-batch correction in bypass mode
    loss_b, _ = rc.reinforce_loss(roll, lp_b, adv, m, weights=bypass.weights)
    loss_b.backward()
    assert bool((decoupled.weights == 2.0).any()), "the case truncates some weights"
    torch.testing.assert_close(lp_a.grad, lp_b.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "option,threshold",
    [
        ("token_k4", 1.0),
        ("seq_max_k1", 1.0),
        ("token_k2", "0.1_0.2"),
        ("token_k1", None),
        ("seq_sum_k2", "1,2"),
    ],
)
def test_bad_rejection_settings_raise(option: str, threshold) -> None:
    with pytest.raises(ValueError):
        rc.parse_rs_options(option, threshold)


@pytest.mark.parametrize("threshold", [0.0, -1.0, "2_1", "x", True])
def test_bad_is_thresholds_raise(threshold) -> None:
    with pytest.raises(ValueError):
        rc.parse_is_threshold(threshold)
