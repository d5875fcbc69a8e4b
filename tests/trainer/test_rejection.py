"""Rollout rejection sampling (``algorithm.rollout_correction.rollout_rs``, decoupled) in the trainer: a
rejected row leaves the update exactly as if it had been dropped from the batch (float64, worked by hand),
its advantages are 0, and the model still reads its tokens."""

from __future__ import annotations

import math

import pytest
import torch

from klppo.algorithms import losses
from klppo.algorithms import rollout_correction as rc
from klppo.algorithms.kl_control import FixedKLController, PenaltyShareWatch
from klppo.batch import Batch
from klppo.config.schema import AlgorithmConfig
from klppo.models.tiny import build_tiny_model
from klppo.roles.actor import Actor, ActorSettings
from klppo.roles.forward import MicroBatching
from klppo.roles.optim import OptimSettings
from klppo.trainer.phases import rewards_and_advantages, with_correction

F64 = torch.float64
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64)
# δ = log π_old − log π_roll. seq_mean_k3 (k3 = e^δ − 1 − δ): row 0 ≈ 1.3e-4, row 1 = e^0.6 − 1.6 ≈ 0.222,
# row 2 ≈ 1.3e-3 — a threshold of 0.1 rejects row 1 only.
DELTA = torch.tensor([[0.02, -0.02, 0.0], [0.6, 0.6, 0.0], [0.05, 0.0, 0.0]], dtype=F64)
ADV = torch.tensor([[1.0, -2.0, 0.5], [3.0, 3.0, 0.0], [-1.0, 0.0, 0.0]], dtype=F64)
SEQ_MEAN_K3 = rc.CorrectionSettings(rs_options=rc.parse_rs_options("seq_mean_k3", 0.1))


def _batch(old_log_probs: torch.Tensor) -> Batch:
    g = torch.Generator().manual_seed(0)
    B, P, R = MASK.shape[0], 4, MASK.shape[1]
    return Batch(
        prompts=torch.randint(3, 300, (B, P), generator=g),
        prompt_mask=torch.ones(B, P, dtype=torch.long),
        responses=torch.randint(3, 300, (B, R), generator=g),
        response_mask=MASK.clone(),
        old_log_probs=old_log_probs * MASK,
        rollout_log_probs=(old_log_probs - DELTA) * MASK,
        advantages=ADV.clone(),
        uid=["a", "a", "a"],
    )


def test_with_correction_keeps_the_tokens_and_reports_the_rejected_share() -> None:
    batch = _batch(torch.full(MASK.shape, -1.0, dtype=F64))
    kept, metrics = with_correction(batch, SEQ_MEAN_K3)
    assert kept.response_mask.tolist() == [[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]
    assert torch.equal(kept.response_tokens_mask, MASK)  # row 1 is still read by the model
    assert torch.equal(kept.attention_mask, batch.attention_mask)
    assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(2 / 6)
    assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["rollout_corr/rollout_rs_seq_mean_k3_seq_max"] == pytest.approx(math.exp(0.6) - 1.6)


@pytest.mark.parametrize(
    "agg,by_hand",
    [
        # kept tokens: row 0 (3) and row 2 (1); ρ = e^0.1 inside the clip range, ℓ_t = −A_t·ρ
        ("token-mean", lambda r: -r * (1.0 - 2.0 + 0.5 - 1.0) / 4),
        ("seq-mean-token-mean", lambda r: (-r * (1.0 - 2.0 + 0.5) / 3 - r * -1.0) / 2),
    ],
)
def test_rejected_row_changes_the_loss_as_dropping_it(agg, by_hand) -> None:
    old = torch.full(MASK.shape, -1.0, dtype=F64)
    kept, _ = with_correction(_batch(old), SEQ_MEAN_K3)
    dropped = _batch(old).select([0, 2])

    def loss_and_grad(b: Batch) -> tuple[float, torch.Tensor]:
        log_prob = (b.old_log_probs + 0.1).requires_grad_(True)
        loss, _ = losses.policy_loss(
            b.old_log_probs, log_prob, b.advantages, b.response_mask, loss_agg_mode=agg
        )
        loss.backward()
        return float(loss.detach()), log_prob.grad

    loss_kept, grad_kept = loss_and_grad(kept)
    loss_dropped, grad_dropped = loss_and_grad(dropped)
    assert loss_kept == pytest.approx(by_hand(math.exp(0.1)), rel=1e-12)
    assert loss_dropped == pytest.approx(loss_kept, rel=1e-12)
    torch.testing.assert_close(grad_kept[[0, 2]], grad_dropped, rtol=1e-12, atol=0)
    assert not grad_kept[1].any()


def _actor_update(batch: Batch, micro_size: int, agg: str) -> tuple[list[torch.Tensor], dict]:
    model = build_tiny_model(seed=0).double()
    actor = Actor(
        model,
        ActorSettings(
            mini_batch_size=len(batch),
            update_micro=MicroBatching(micro_batch_size=micro_size),
            loss_agg_mode=agg,
            entropy_coeff=0.01,
            grad_clip=1e9,
        ),
        OptimSettings(lr=0.1, optimizer="SGD", weight_decay=0.0),
    )
    metrics = actor.update_policy(batch)
    return [p.detach().clone() for p in model.parameters()], metrics


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_rejected_row_updates_the_actor_as_dropping_it(agg) -> None:
    """The whole update — micro-batch weights from the global token / row counts, the policy and entropy
    terms and their metrics — on a batch with a rejected row equals the update without that row, with one
    micro-batch per row and with one for the whole batch."""
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    old = -5.0 + 0.1 * torch.randn(MASK.shape, generator=g, dtype=F64)
    kept, _ = with_correction(_batch(old), SEQ_MEAN_K3)
    dropped = _batch(old).select([0, 2])
    for kept_micro, dropped_micro in ((1, 1), (3, 2)):  # a micro-batch per row; one for the whole batch
        want, want_metrics = _actor_update(dropped, dropped_micro, agg)
        got, got_metrics = _actor_update(kept, kept_micro, agg)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        for name in ("actor/pg_loss", "actor/entropy"):  # reduced in float32
            assert got_metrics[name] == pytest.approx(want_metrics[name], rel=1e-6), name


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_advantages_are_zero_on_rejected_tokens(estimator) -> None:
    """verl's order: rejection after the KL penalty, before the advantages; GRPO keeps the rejected row's
    score in its group's statistics (the score is not masked), GAE skips the rejected tokens as padding."""
    old = torch.full(MASK.shape, -1.0, dtype=F64)
    scores = torch.zeros_like(MASK)
    scores[0, 2], scores[1, 1], scores[2, 0] = 1.0, 0.0, 0.25
    batch = _batch(old).replace(token_level_scores=scores, values=0.1 * MASK, advantages=None)
    algo = AlgorithmConfig(adv_estimator=estimator)

    def advantages(correction: rc.CorrectionSettings | None) -> tuple[Batch, dict]:
        return rewards_and_advantages(
            batch, algo, FixedKLController(0.0), watch=PenaltyShareWatch(), step=1, correction=correction
        )

    out, metrics = advantages(SEQ_MEAN_K3)
    assert out.response_mask[1].sum() == 0 and not out.advantages[1].any()
    assert out.advantages[0].all() and out.advantages[2, 0] != 0
    assert "rollout_corr/rollout_rs_masked_fraction" in metrics
    if estimator == "grpo":  # the group baseline still holds row 1's score
        plain, _ = advantages(None)
        torch.testing.assert_close(out.advantages[[0, 2]], plain.advantages[[0, 2]])


@pytest.mark.parametrize("loss_type", ["ppo_clip", "reinforce"])
def test_bypass_rejection_weighs_rejected_tokens_zero_and_keeps_the_divisor(loss_type) -> None:
    """Bypass mode (π_old = π_roll): the current policy's δ = log π_θ − log π_roll rejects row 1
    (seq_mean_k3 > 0.1); its tokens weigh 0 in the policy loss while the divisor stays the mini-batch's 6
    tokens (verl's bypass loss, token-mean), worked by hand in float64."""
    correction = rc.CorrectionSettings(
        rs_options=rc.parse_rs_options("seq_mean_k3", 0.1), bypass_mode=True, loss_type=loss_type
    )
    actor = Actor(
        build_tiny_model(seed=0).double(),
        ActorSettings(mini_batch_size=3, rollout_correction=correction),
        OptimSettings(lr=0.1, optimizer="SGD", weight_decay=0.0),
    )
    rollout = torch.full(MASK.shape, -1.0, dtype=F64) * MASK
    batch = _batch(rollout + DELTA).replace(rollout_log_probs=rollout, old_log_probs=rollout)
    log_prob = ((rollout + DELTA) * MASK).requires_grad_(True)
    stats: dict = {}
    loss, _ = actor._policy_loss(batch, rollout, log_prob, stats)
    loss.backward()
    e = math.exp
    if loss_type == "ppo_clip":  # ℓ = −A·ρ, ρ = e^δ inside the clip range
        want = -(1.0 * e(0.02) - 2.0 * e(-0.02) + 0.5 * 1.0 - 1.0 * e(0.05)) / 6
    else:  # ℓ = −A·log π_θ
        want = -(1.0 * -0.98 - 2.0 * -1.02 + 0.5 * -1.0 - 1.0 * -0.95) / 6
    assert float(loss.detach()) == pytest.approx(want, rel=1e-12)
    assert not log_prob.grad[1].any() and log_prob.grad[0].all()
    assert float(stats["rollout_corr/rollout_rs_seq_masked_fraction"]) == pytest.approx(1 / 3)
