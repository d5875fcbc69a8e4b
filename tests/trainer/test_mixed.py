"""Mixed runs (data.logged_share between 0 and 1, docs/data.md "Mixed runs"): each step holds the generated
samples of some prompts and whole logged groups, every row with its own behaviour log-probs and score; a bad
share is one line before any weight loads; resume = uninterrupted."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.trainer.utils import (
    assert_resume_matches,
    base_overrides,
    read_metrics,
    train_two_ranks,
)

LOGGED_SCORE = 3.0
"""Every logged sample's score: the rule reward gives 0 or 1, so the logged rows' scores show they are
kept."""


@pytest.fixture(scope="module")
def logged(tiny_model_dir, arithmetic_data, tmp_path_factory) -> Path:
    """8 prompts × 2 samples of the tiny model (`klppo data log`), each scored LOGGED_SCORE."""
    from klppo.commands.log_data import main
    from klppo.data.logged import write_logged

    out = tmp_path_factory.mktemp("logged") / "log.parquet"
    common = base_overrides(tiny_model_dir, arithmetic_data, out.parent / "unused")
    assert main(["--output", str(out), "--n", "2", "--num-prompts", "8", *common]) == 0
    rows = pq.read_table(out).to_pylist()
    for row in rows:
        row["score"] = LOGGED_SCORE
    write_logged(str(out), rows)
    return out


def _overrides(tiny_model_dir, arithmetic_data, run_dir, log_file, *extra) -> list[str]:
    return base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
        f"data.logged_files={log_file}",
        "data.logged_share=0.5",
        "algorithm.adv_estimator=grpo",
        *extra,
    ]


def _train_capturing(overrides: list[str]) -> tuple[list, list]:
    """Train in this process; returns each step's global batch and the engine's rollouts (samples)."""
    from klppo.assembly.setup import build_run
    from klppo.config import load_config
    from klppo.parallel import dist
    from klppo.trainer import ppo_trainer

    batches, rollouts = [], []
    generate = ppo_trainer.generate

    def recording_generate(*args, **kwargs):
        out = generate(*args, **kwargs)
        rollouts.append(out.samples)
        return out

    torch.set_num_threads(1)
    cfg = load_config(overrides)
    info = dist.init_distributed("cpu", 120.0)
    try:
        trainer = ppo_trainer.PPOTrainer(build_run(cfg, device=info.device, argv=overrides))
        phases = trainer._phases

        def recording_phases(prompts, step, timer):
            done = phases(prompts, step, timer)
            batches.append(done.batch)
            return done

        trainer._phases = recording_phases
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ppo_trainer, "generate", recording_generate)
            trainer.fit()
    finally:
        dist.destroy()
    return batches, rollouts


def test_half_share_holds_both_sources_with_their_log_probs(
    logged, tiny_model_dir, arithmetic_data, tmp_path
):
    """share 0.5 of 4 prompts × 2 samples: 2 generated prompts (4 samples, the engine's log-probs) then 2
    logged groups (4 samples, the log's tokens, log-probs and scores), the groups in the log's order."""
    rows = pq.read_table(logged).to_pylist()
    run = tmp_path / "run"
    overrides = _overrides(
        tiny_model_dir,
        arithmetic_data,
        run,
        logged,
        "data.shuffle=False",
        "algorithm.rollout_correction.rollout_is=token",
        "trainer.total_training_steps=2",
    )
    batches, rollouts = _train_capturing(overrides)
    assert len(batches) == len(rollouts) == 2
    for step, (batch, fresh) in enumerate(zip(batches, rollouts)):
        assert len(batch) == 8 and batch.from_logs.tolist() == [False] * 4 + [True] * 4
        assert len(fresh) == 4 and batch.uid[:4] == fresh.uid
        width = fresh.response_length
        assert torch.equal(batch.responses[:4, :width], fresh.responses)
        assert torch.equal(batch.rollout_log_probs[:4, :width], fresh.rollout_log_probs)
        assert not batch.rollout_log_probs[:4, width:].any()
        for i, row in enumerate(rows[4 * step : 4 * step + 4]):
            k, n = 4 + i, len(row["response_ids"])
            assert batch.uid[k] == f"logged:{row['group_id']}"
            assert batch.responses[k, :n].tolist() == row["response_ids"]
            assert batch.response_mask[k].sum() == n
            assert batch.rollout_log_probs[k, :n].tolist() == pytest.approx(row["response_log_probs"])
            assert batch.token_level_scores[k].sum() == LOGGED_SCORE
        fresh_scores = batch.token_level_scores[:4].sum(dim=1)
        assert bool(((fresh_scores == 0) | (fresh_scores == 1)).all())  # the rule reward's, not NaN
    for m in read_metrics(run):
        assert m["mixed/logged_share"] == 0.5 and m["mixed/logged/score_mean"] == LOGGED_SCORE
        assert m["mixed/fresh/score_mean"] <= 1.0 and "timing_s/gen" in m and "rollout_corr/kl" in m


@pytest.fixture(scope="module")
def bare(logged) -> Path:
    """The log without behaviour log-probs."""
    from klppo.data.logged import write_logged

    rows = pq.read_table(logged).to_pylist()
    for row in rows:
        row["response_log_probs"] = None
    out = logged.parent / "bare.parquet"
    write_logged(str(out), rows)
    return out


def test_missing_log_probs_take_the_reference_on_logged_rows_only(
    bare, tiny_model_dir, arithmetic_data, tmp_path
):
    """A log without behaviour log-probs under a decoupled correction: the logged rows' are the
    reference's, the generated rows keep the engine's."""
    overrides = _overrides(
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "run",
        bare,
        "algorithm.rollout_correction.rollout_is=token",
        "actor_rollout_ref.actor.use_kl_loss=True",
    )
    (batch,), (fresh,) = _train_capturing(overrides)
    width = fresh.response_length
    assert torch.equal(batch.rollout_log_probs[:4, :width], fresh.rollout_log_probs)
    assert torch.equal(batch.rollout_log_probs[4:], batch.ref_log_probs[4:])
    assert not torch.equal(batch.rollout_log_probs[:4], batch.ref_log_probs[:4])


def test_missing_log_probs_without_a_correction_leave_the_step_none(
    bare, tiny_model_dir, arithmetic_data, tmp_path
):
    """A log without behaviour log-probs and no correction: the step carries none (the generated rows' are
    left out too) and reports no log-prob gap."""
    run = tmp_path / "run"
    (batch,), _ = _train_capturing(_overrides(tiny_model_dir, arithmetic_data, run, bare))
    assert batch.rollout_log_probs is None and batch.from_logs.sum() == 4
    (metrics,) = read_metrics(run)
    assert "rollout/log_prob_diff" not in metrics and "mixed/fresh/log_prob_diff" not in metrics
    assert metrics["mixed/logged/score_mean"] == LOGGED_SCORE


@pytest.mark.parametrize(
    ("share", "expected"),
    [
        (0.1, "data.logged_share=0.1 leaves the logs none of the data.train_batch_size=4 prompt groups"),
        (0.9, "data.logged_share=0.9 leaves generation none of the data.train_batch_size=4 prompt groups"),
    ],
)
def test_a_share_without_one_source_is_one_line_before_weights(
    share, expected, logged, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch, capsys
):
    """`klppo train` names the key in one line and exits 2; no weight is read."""
    from klppo.commands.train import main
    from klppo.models import loading

    monkeypatch.setattr(loading, "load_causal_lm", lambda *a, **k: pytest.fail("weights loaded"))
    argv = _overrides(tiny_model_dir, arithmetic_data, tmp_path / "run", logged, f"data.logged_share={share}")
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"klppo: {expected}") and err.count("\n") == 1, err


def test_mixed_resume_equals_uninterrupted(logged, tiny_model_dir, arithmetic_data, tmp_path):
    """Stopped after step 2 and resumed, steps 3 and 4 are the uninterrupted run's: the generation seeds,
    the prompt loader's and the logged loader's positions, the KL controllers."""
    keys = [
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.type=adaptive",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "algorithm.rollout_correction.rollout_is=token",
    ]
    assert_resume_matches(
        lambda run_dir: _overrides(tiny_model_dir, arithmetic_data, run_dir, logged, *keys),
        tmp_path / "full",
        tmp_path / "cut",
        (
            "actor/pg_loss",
            "actor/reward_kl_penalty_coeff",
            "rollout_corr/kl",
            "critic/score/mean",
            "mixed/fresh/score_mean",
            "mixed/fresh/response_length_mean",
            "mixed/logged/log_prob_diff",
            "actor/kl_loss",
        ),
    )


@pytest.mark.slow
@pytest.mark.xdist_group("rank_pool")
def test_two_ranks_lay_out_each_source_as_they_hold_it(
    logged, tiny_model_dir, arithmetic_data, tmp_path, rank_pool
):
    """`klppo train` on 2 gloo ranks, share 0.5 of 4 prompts: each rank generates for 1 prompt and takes 1
    logged group; the global batch's ``from_logs`` marks the rows each rank joined (the logged rows' scores
    are all the log's, the generated ones the rule's 0 or 1)."""
    argv = _overrides(
        tiny_model_dir,
        arithmetic_data,
        tmp_path / "two",
        logged,
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
        "reward_model.launch_reward_fn_async=True",  # the generated samples scored in the background
    )
    assert train_two_ranks(rank_pool, argv) == 0
    rows = read_metrics(tmp_path / "two")
    assert len(rows) == 2 and all(r["perf/world_size"] == 2 for r in rows)
    for r in rows:
        assert r["mixed/logged_share"] == 0.5 and r["mixed/logged/score_mean"] == LOGGED_SCORE
        assert 0 <= r["mixed/fresh/score_mean"] <= 1
        assert r["critic/score/mean"] == pytest.approx((LOGGED_SCORE + r["mixed/fresh/score_mean"]) / 2)
