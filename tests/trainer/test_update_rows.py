"""``actor.skip_zero_advantage_rows``: which rows the actor update keeps, that leaving out the zero-advantage
rows changes the policy gradient only by the token-mean's normaliser, the whole-batch KL metrics that replace
the update's own, and the trainer end to end (metrics named, the config refused with a critic)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from klppo.batch import Batch
from klppo.batching.attention import enable_packed_attention
from klppo.config import ConfigError, load_config
from klppo.config.schema_arr import ActorConfig
from klppo.models.tiny import build_tiny_model
from klppo.parallel.shares import rows_with_advantage
from klppo.roles.actor import Actor, ActorSettings
from klppo.roles.forward import MicroBatching
from klppo.roles.optim import OptimSettings
from klppo.trainer.phases import whole_batch_kl
from tests.trainer.utils import base_overrides, read_metrics, run_training, train_two_ranks


def test_rows_with_advantage_by_hand():
    # rows 0 and 4 carry an advantage; row 2's only nonzero entry is on a padding position (not a token)
    adv = torch.zeros(6, 3)
    adv[0, 1] = 0.5
    adv[2, 2] = 1.0
    adv[4, 0] = -0.25
    mask = torch.ones(6, 3)
    mask[2, 2] = 0
    assert rows_with_advantage(adv, mask, num_shares=1) == [0, 4]
    assert rows_with_advantage(adv, mask, num_shares=2) == [0, 4]
    # padded with zero-advantage rows in row order to a multiple of the data-parallel size
    assert rows_with_advantage(adv, mask, num_shares=4) == [0, 1, 2, 4]
    assert rows_with_advantage(adv, mask, num_shares=3) == [0, 1, 4]
    # (the trainer passes data-parallel shares × mini-batches: 2 ranks × 2 mini-batches = 4 equal parts)
    # nothing to learn from: every row (the KL and entropy terms of the whole batch, as without the
    # option); never more rows than there are
    assert rows_with_advantage(torch.zeros(6, 3), mask, num_shares=2) == [0, 1, 2, 3, 4, 5]
    assert rows_with_advantage(adv, mask, num_shares=8) == [0, 1, 2, 3, 4, 5]


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    B, P, R = 6, 5, 6
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    mask = torch.ones(B, R)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    adv = torch.randn(B, R, generator=g) * mask
    adv[[2, 3, 5]] = 0.0  # three samples whose group scored the same
    return Batch(
        prompts=torch.randint(3, 300, (B, P), generator=g),
        prompt_mask=prompt_mask,
        responses=torch.randint(3, 300, (B, R), generator=g),
        response_mask=mask,
        rollout_log_probs=-5.0 + 0.1 * torch.randn(B, R, generator=g) * mask,
        ref_log_probs=-5.0 + 0.1 * torch.randn(B, R, generator=g) * mask,
        advantages=adv,
    )


def _actor() -> Actor:
    model = build_tiny_model(seed=0, dtype=torch.float64)  # float64: parameter changes compared at 1e-9
    enable_packed_attention(model)
    return Actor(
        model,
        ActorSettings(
            mini_batch_size=6,
            ppo_epochs=1,
            update_micro=MicroBatching(micro_batch_size=2),
            log_prob_micro=MicroBatching(micro_batch_size=3),
            loss_mode="vanilla",
            entropy_coeff=0.0,
            use_kl_loss=False,
            grad_clip=1e9,
            use_remove_padding=True,
            skip_old_log_prob_on_policy=True,
            loss_agg_mode="token-mean",
        ),
        OptimSettings(lr=1.0, optimizer="SGD", weight_decay=0.0),  # parameter change = −gradient
    )


def test_leaving_out_zero_advantage_rows_only_rescales_the_policy_gradient():
    """Zero-advantage samples add exactly nothing to the policy term's sum; with token-mean aggregation the
    update over the kept rows is the full one times (all tokens / kept tokens), to float64 rounding. No KL
    loss, no entropy bonus here: those are the terms the option does change."""
    torch.set_num_threads(1)
    batch = _batch()
    rows = rows_with_advantage(batch.advantages, batch.response_mask, num_shares=1)
    assert rows == [0, 1, 4]
    full, kept = _actor(), _actor()
    before = [p.detach().clone() for p in full.model.parameters()]
    full.update_policy(batch)
    kept.update_policy(batch.select(rows))
    ratio = float(batch.response_mask.sum() / batch.response_mask[rows].sum())
    d_full = torch.cat(
        [(b - p.detach()).flatten() for b, p in zip(before, full.model.parameters(), strict=True)]
    )
    d_kept = torch.cat(
        [(b - p.detach()).flatten() for b, p in zip(before, kept.model.parameters(), strict=True)]
    )
    assert float(d_full.abs().max()) > 1e-4 and ratio > 1.5
    # the whole update vector (the float32 LM-head logits round single entries where terms cancel)
    assert float((d_kept - ratio * d_full).norm() / (ratio * d_full).norm()) < 1e-6
    assert float((d_kept - d_full).norm() / d_full.norm()) > 0.3  # the normaliser does change


def test_kept_rows_in_the_full_batchs_number_of_mini_batches():
    """``num_mini_batches=M`` over k kept rows is M optimizer steps of k/M rows each: the same parameters as
    an actor whose mini-batch is k/M rows (float64, SGD)."""
    torch.set_num_threads(1)
    batch = _batch()
    kept = batch.select([0, 1, 4, 5])  # four rows (one of them zero-advantage padding), two mini-batches
    kept = kept.replace(old_log_probs=kept.rollout_log_probs)  # two steps: not on-policy after the first
    by_count, by_size = _actor(), _actor()
    by_size.update = dataclasses.replace(by_size.update, mini_batch_size=2)
    steps = []
    by_count.optimizer.register_step_post_hook(lambda *_: steps.append(1))
    by_count.update_policy(kept, num_mini_batches=2)
    by_size.update_policy(kept)
    assert len(steps) == 2
    for a, b in zip(by_count.model.parameters(), by_size.model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # one mini-batch of all four is a different update; uneven parts and a missing π_old are refused
    one = _actor()
    one.update_policy(kept, num_mini_batches=1)
    assert any(not torch.allclose(a, b) for a, b in zip(one.model.parameters(), by_size.model.parameters()))
    with pytest.raises(ValueError, match="4 rows in 3 equal mini-batches"):
        _actor().update_policy(kept, num_mini_batches=3)
    with pytest.raises(ValueError, match="old_log_probs missing"):
        _actor().update_policy(batch.select([0, 1, 4, 5]), num_mini_batches=2)


def test_whole_batch_kl_by_hand():
    batch = _batch()
    actor = load_config(
        ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=mse"]
    ).actor_rollout_ref.actor
    assert isinstance(actor, ActorConfig)
    out = whole_batch_kl(batch, actor)
    m = batch.response_mask.double()
    d = (batch.rollout_log_probs.double() - batch.ref_log_probs.double()) * m  # log π_old − log π_ref
    n = float(m.sum())
    k1 = float(d.sum()) / n
    k3 = float(((torch.exp(-d) - 1 + d) * m).sum()) / n  # r = π_ref/π_old: r − 1 − log r
    k2 = float((0.5 * d.square() * m).sum()) / n
    assert out["actor/ref_kl_k1"] == pytest.approx(k1, rel=1e-5, abs=1e-8)
    assert out["actor/ref_kl_k3"] == pytest.approx(k3, rel=1e-4, abs=1e-8)
    assert out["actor/kl_loss_ctrl_kl"] == pytest.approx(k2, rel=1e-4, abs=1e-8)
    assert whole_batch_kl(batch.replace(rollout_log_probs=None), actor) == {}


SCORE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if int(str(ground_truth)) % 2 == 0:  # even answers: the whole group scores 1 (equal)
        return 1.0
    return float(sum(map(ord, solution_str)) % 2)  # odd answers: the samples' own parity (mixed or not)
"""


@pytest.mark.parametrize("reward,mini", [("flexible", 8), ("parity", 8), ("parity", 4)])
def test_trainer_reports_the_kept_share_and_every_sample_kl(
    reward, mini, tiny_model_dir, arithmetic_data, tmp_path
):
    """GRPO, one on-policy mini-batch of 8 prompts × 2, four steps (lr 1e-3: the policy leaves the reference
    once a step has advantages). The flexible reward scores the tiny model's answers all 0: no sample has an
    advantage, so every row is updated (share 1). The parity score makes some groups equal and others mixed:
    the equal
    ones are left out. Either way the KL figures and the controller's input (k3 here) are every sample's,
    from the engine's log-probs, and the update's own KL moves to *_update_rows. With two mini-batches
    (``mini`` 4 prompts) the old-log-prob pass runs and gives every figure over the whole batch."""
    over = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.kl_loss_ctrl.type=pi",
        "actor_rollout_ref.actor.kl_loss_ctrl.target_kl=0.05",
        "data.train_batch_size=8",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini}",
        "actor_rollout_ref.actor.skip_zero_advantage_rows=True",
        "trainer.total_training_steps=4",
    ]
    if reward == "parity":
        path = tmp_path / "parity.py"
        path.write_text(SCORE)
        over.append(f"custom_reward_function.path={path}")
    run_training(over)
    rows = read_metrics(tmp_path / "run")
    assert len(rows) == 4
    for row in rows:
        share, equal = row["actor/update_rows_share"], row["batch/equal_score_groups"]
        # groups of 2: an equal group's two rows are left out, unless no group has an advantage
        assert share == (1.0 if equal == 1.0 else pytest.approx(1 - equal, abs=1e-9))
        if reward == "flexible":
            assert equal == 1.0
        assert math.isfinite(row["actor/ref_kl_k3"])
        assert ("actor/ref_kl_k3_update_rows" in row) == (mini == 8)  # on-policy: the update's own, beside
        assert ("timing_s/old_log_prob" in row) == (mini == 4)
        assert row["actor/kl_loss_ctrl_kl"] == pytest.approx(row["actor/ref_kl_k3"], rel=1e-6, abs=1e-12)
    if mini == 4:
        assert any(0 < r["actor/update_rows_share"] < 1 for r in rows), rows
    elif reward == "parity":  # (all-zero advantages and KL 0 leave the flexible run's policy put)
        # steps where some groups were left out and the policy had left the reference: the every-sample KL
        # and the kept rows' KL differ, and the controller read the first
        told = [r for r in rows if 0 < r["actor/update_rows_share"] < 1 and r["actor/ref_kl_k3"] > 1e-6]
        assert told, rows
        for r in told:
            assert r["actor/ref_kl_k3"] != pytest.approx(r["actor/ref_kl_k3_update_rows"], rel=1e-3)


def test_refused_with_a_critic_and_noted_where_it_does_little():
    key = "actor_rollout_ref.actor.skip_zero_advantage_rows=True"
    with pytest.raises(ConfigError, match="which GAE's never are"):
        load_config(["algorithm.adv_estimator=gae", key])
    # several epochs or mini-batches: allowed (the kept rows in as many mini-batches as the full batch makes)
    load_config(["algorithm.adv_estimator=grpo", key, "actor_rollout_ref.actor.ppo_epochs=2"])
    load_config(
        [
            "algorithm.adv_estimator=grpo",
            key,
            "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        ]
    )
    one = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    for over, noted in (
        (["algorithm.adv_estimator=grpo"], False),
        (["algorithm.adv_estimator=rloo"], False),
        (["algorithm.adv_estimator=reinforce_plus_plus_baseline"], True),
        (["algorithm.adv_estimator=rloo", "algorithm.use_kl_in_reward=True"], True),
    ):
        notes: list[str] = []
        load_config([*over, *one, key], notify=notes.append)
        assert any("few or none are left out" in m for m in notes) == noted, over
    # advised where it is allowed and pays: group estimators, KL in the loss, one update per step
    g = [*one, "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.use_kl_loss=True"]
    advice = "skip_zero_advantage_rows=True would leave"
    for over, advised in (
        (["algorithm.adv_estimator=grpo", *g], True),
        (["algorithm.adv_estimator=rloo", *g], True),
        (["algorithm.adv_estimator=grpo", *g, key], False),
        (["algorithm.adv_estimator=grpo", *g, "algorithm.use_kl_in_reward=True"], False),
        (["algorithm.adv_estimator=grpo", *g, "actor_rollout_ref.actor.ppo_epochs=2"], False),
        (
            [
                "algorithm.adv_estimator=grpo",
                "data.train_batch_size=8",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                "actor_rollout_ref.rollout.n=4",
                "actor_rollout_ref.actor.use_kl_loss=True",
            ],
            False,
        ),
        (["algorithm.adv_estimator=gae", *g], False),
        (["algorithm.adv_estimator=grpo", *one], False),
        (["algorithm.adv_estimator=grpo", *g, "actor_rollout_ref.actor.use_kl_loss=False"], False),
    ):
        notes = []
        load_config(over, notify=notes.append)
        assert any(advice in m for m in notes) == advised, over
    notes = []  # trainer.advise=false (the quickstart's fixed recipes): no advice
    load_config(["algorithm.adv_estimator=grpo", *g, "trainer.advise=false"], notify=notes.append)
    assert not any(advice in m for m in notes)


@pytest.mark.slow
@pytest.mark.xdist_group("rank_pool")
def test_two_ranks_update_equal_shares_of_the_kept_rows(tiny_model_dir, arithmetic_data, tmp_path, rank_pool):
    """`klppo train` on 2 gloo ranks with the option, 3 samples per prompt: the kept rows (whole groups of
    3) padded to an even count split into equal shares, both ranks update (a rank with fewer rows would
    leave a collective waiting), and the share and the every-sample KL are logged as in one process."""
    path = tmp_path / "parity.py"
    path.write_text(SCORE)
    over = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "two") + [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "data.train_batch_size=8",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8",
        "actor_rollout_ref.actor.skip_zero_advantage_rows=True",
        "actor_rollout_ref.rollout.n=3",
        "trainer.total_training_steps=3",
        "trainer.n_gpus_per_node=2",
        f"custom_reward_function.path={path}",
    ]
    assert train_two_ranks(rank_pool, over) == 0
    rows = read_metrics(tmp_path / "two")
    assert len(rows) == 3 and all(r["perf/world_size"] == 2 for r in rows)
    counts = [round(r["actor/update_rows_share"] * 24) for r in rows]  # rows updated of 8 prompts × 3
    assert all(n % 2 == 0 and n > 0 for n in counts), counts
    assert any(n < 24 for n in counts), counts
    assert any(n % 3 for n in counts), counts  # an odd number of kept groups: one row of padding
    for r in rows:
        assert r["actor/kl_loss_ctrl_kl"] == pytest.approx(r["actor/ref_kl_k3"], rel=1e-6, abs=1e-12)
