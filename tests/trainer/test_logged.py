"""Training from logged responses (data.logged_files, docs/data.md): `klppo data log` → file → train, every
bad input one line before any weight loads, resume = uninterrupted, and the bypass loss against the
behaviour log-probs of the log equal to its float64 hand formula."""

from __future__ import annotations

import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from tests.trainer.utils import (
    assert_resume_matches,
    base_overrides,
    read_metrics,
    run_training,
    train_two_ranks,
)


@pytest.fixture(scope="module")
def logged(tiny_model_dir, arithmetic_data, tmp_path_factory) -> Path:
    """8 prompts × 2 samples of the tiny model, written by `klppo data log`."""
    from klppo.commands.log_data import main

    out = tmp_path_factory.mktemp("logged") / "log.parquet"
    common = base_overrides(tiny_model_dir, arithmetic_data, out.parent / "unused")
    assert main(["--output", str(out), "--n", "2", "--num-prompts", "8", *common]) == 0
    return out


def _rewrite(src: Path, dst: Path, change) -> Path:
    from klppo.data.logged import write_logged

    rows = pq.read_table(src).to_pylist()
    for i, row in enumerate(rows):
        change(i, row)
    write_logged(str(dst), rows)
    return dst


def _scored(logged: Path, tmp_path: Path) -> Path:
    """The log with scores 0, 1, 0, 1, … (groups of two: every group has an advantage)."""
    return _rewrite(logged, tmp_path / "scored.parquet", lambda i, r: r.update(score=float(i % 2)))


def _loader_settings(
    path: Path, *, groups_per_batch: int = 8, shuffle: bool = False, overlong: str = "error"
):
    """The loader's settings for the tiny logs: pairs of samples, 64 + 8 tokens, any token id."""
    from klppo.data.logged import LoggedSettings

    return LoggedSettings(
        [str(path)],
        groups_per_batch=groups_per_batch,
        samples_per_group=2,
        max_prompt_length=64,
        max_response_length=8,
        vocab_size=10**6,
        shuffle=shuffle,
        overlong=overlong,
    )


def _overrides(tiny_model_dir, arithmetic_data, run_dir, log_file, *extra) -> list[str]:
    return base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
        f"data.logged_files={log_file}",
        "algorithm.adv_estimator=grpo",
        *extra,
    ]


def test_log_file_round_trip(logged, tiny_model_dir, arithmetic_data, tmp_path):
    """The file holds what the schema says; the loader's batch gives it back; two steps train on it with
    no generation, the logged scores kept."""
    from klppo.data.logged import LoggedLoader
    from klppo.models.loading import load_tokenizer

    rows = pq.read_table(logged).to_pylist()
    assert len(rows) == 16 and rows[0]["group_id"] == rows[1]["group_id"] != rows[2]["group_id"]
    for row in rows:
        assert len(row["response_ids"]) == len(row["response_log_probs"]) == len(row["response_mask"]) <= 8
        assert all(v <= 0 for v in row["response_log_probs"]) and row["temperature"] == 1.0
    tokenizer = load_tokenizer(str(tiny_model_dir))
    settings = _loader_settings(logged)
    batch = LoggedLoader(settings, tokenizer).next_batch()
    for i, row in enumerate(rows):
        n = len(row["response_ids"])
        assert batch.responses[i, :n].tolist() == row["response_ids"] and batch.response_mask[i].sum() == n
        assert batch.rollout_log_probs[i, :n].tolist() == pytest.approx(row["response_log_probs"])
        assert batch.token_level_scores[i, n - 1] == row["score"]

    scored = _scored(logged, tmp_path)
    run = tmp_path / "run"
    run_training(
        _overrides(
            tiny_model_dir,
            arithmetic_data,
            run,
            scored,
            "data.train_batch_size=4",
            "trainer.total_training_steps=2",
        )
    )
    metrics = read_metrics(run)
    assert len(metrics) == 2 and all("timing_s/gen" not in m for m in metrics)
    assert metrics[0]["critic/score/mean"] == pytest.approx(0.5)  # the logged scores, not the reward's 0


def test_missing_scores_are_computed_by_the_reward(logged, tiny_model_dir, arithmetic_data, tmp_path):
    from klppo.trainer.logged_phases import with_missing_scores

    class Half:  # scores every sample 7
        def score(self, batch):
            from types import SimpleNamespace

            s = torch.zeros_like(batch.response_mask)
            s[torch.arange(len(batch)), batch.response_mask.sum(1).long() - 1] = 7.0
            return SimpleNamespace(token_level=s)

    from klppo.data.logged import LoggedLoader
    from klppo.models.loading import load_tokenizer

    half = _rewrite(logged, tmp_path / "half.parquet", lambda i, r: r.update(score=None if i % 2 else 1.0))
    settings = _loader_settings(half)
    batch = with_missing_scores(
        Half(), LoggedLoader(settings, load_tokenizer(str(tiny_model_dir))).next_batch()
    )
    assert batch.token_level_scores.sum(1).tolist() == [1.0, 7.0] * 8


BAD = {  # name: (change to row i, extra keys, what the one line names)
    "vocab": (
        lambda i, r: r.update(response_ids=[10**6] * len(r["response_ids"])) if i == 3 else None,
        [],
        "row 3, column 'response_ids': token id 1000000 is beyond the model's vocabulary",
    ),
    "tokenizer": (lambda i, r: r.update(tokenizer_hash="0" * 16), [], "row 0, column 'tokenizer_hash'"),
    "overlong": (
        lambda i, r: (
            r.update(response_ids=[5] * 9, response_log_probs=[-1.0] * 9, response_mask=[1] * 9)
            if i == 5
            else None
        ),
        [],
        "row 5, column 'response_ids': 9 response tokens > data.max_response_length=8",
    ),
    "log_probs": (
        lambda i, r: r.update(response_log_probs=None) if i == 2 else None,
        ["algorithm.rollout_correction.bypass_mode=True"],
        "row 2, column 'response_log_probs'",
    ),
    "kept_mass": (
        lambda i, r: (
            r.update(response_log_kept_mass=[0.0] * (len(r["response_ids"]) + 1)) if i == 4 else None
        ),
        [],
        "row 4, column 'response_log_kept_mass': ",
    ),
    "kept_mass_alone": (
        lambda i, r: r.update(
            response_log_probs=None, response_log_kept_mass=[-0.5] * len(r["response_ids"])
        ),
        [],
        "row 0, column 'response_log_kept_mass': set without 'response_log_probs'",
    ),
    "group_of_one": (
        lambda i, r: r.update(group_id=str(i)),
        ["actor_rollout_ref.rollout.n=1"],
        "row 0, column 'group_id': a group of 1 sample(s)",
    ),
    "mask": (
        lambda i, r: r.update(response_mask=[1] * (len(r["response_ids"]) - 1) + [0]) if i == 1 else None,
        [],
        "row 1, column 'response_mask'",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_log_is_one_line_before_weights(
    case, logged, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    """`klppo train`'s start-up checks name the file, row and column in one line; no weight is read."""
    from klppo.commands.startup import check_startup
    from klppo.config import load_config
    from klppo.models import loading

    change, extra, expected = BAD[case]
    bad = _rewrite(logged, tmp_path / "bad.parquet", change)
    monkeypatch.setattr(loading, "load_causal_lm", lambda *a, **k: pytest.fail("weights loaded"))
    cfg = load_config(_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run", bad, *extra))
    problems = check_startup(cfg, problems=[]).problems
    assert len(problems) == 1 and "\n" not in problems[0], problems
    assert f"{bad} {expected}" in problems[0], problems[0]


def test_overlong_drop_leaves_out_the_group(logged, tiny_model_dir):
    from klppo.data.logged import LoggedLoader
    from klppo.models.loading import load_tokenizer

    long = _rewrite(
        logged,
        logged.parent / "long.parquet",
        lambda i, r: (
            r.update(response_ids=[5] * 9, response_log_probs=[-1.0] * 9, response_mask=[1] * 9)
            if i == 5
            else None
        ),
    )
    settings = _loader_settings(long, groups_per_batch=4, overlong="drop", shuffle=True)
    loader = LoggedLoader(settings, load_tokenizer(str(tiny_model_dir)))
    assert loader.num_dropped == 1 and len(loader) == 1 and "(1 groups dropped)" in loader.summary()


def test_logged_resume_equals_uninterrupted(logged, tiny_model_dir, arithmetic_data, tmp_path):
    """Two epochs over the log (4 steps of 4 groups) with an adaptive KL-in-reward controller and a KL loss:
    stopped after step 2 and resumed, step 3 and 4 are the uninterrupted run's."""
    scored = _scored(logged, tmp_path)
    keys = [
        "data.train_batch_size=4",
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.type=adaptive",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "algorithm.rollout_correction.rollout_is=token",
    ]
    assert_resume_matches(
        lambda run_dir: _overrides(tiny_model_dir, arithmetic_data, run_dir, scored, *keys),
        tmp_path / "full",
        tmp_path / "cut",
        (
            "actor/pg_loss",
            "actor/reward_kl_penalty",
            "actor/reward_kl_penalty_coeff",
            "rollout_corr/kl",
            "critic/score/mean",
            "actor/kl_loss",
        ),
    )


def test_bypass_loss_equals_hand_formula(logged, tiny_model_dir, arithmetic_data, tmp_path):
    """Bypass mode (π_old = the log's behaviour policy), one mini-batch: the step's ``actor/pg_loss`` is the
    float64 clipped surrogate of ρ = π_θ / π_behaviour with GRPO advantages of the logged scores."""
    from transformers import AutoModelForCausalLM

    from klppo.data.logged import LoggedLoader
    from klppo.models.loading import load_tokenizer

    gen = torch.Generator().manual_seed(0)
    offsets = {}

    def shift(i, row):  # behaviour log-probs away from π_θ's, so that ρ crosses both clip bounds
        delta = (torch.rand(len(row["response_ids"]), generator=gen, dtype=torch.float64) - 0.5).tolist()
        offsets[i] = delta
        row.update(
            score=float(i % 3 == 0),
            response_log_probs=[min(v - d, 0.0) for v, d in zip(row["response_log_probs"], delta)],
        )

    shifted = _rewrite(logged, tmp_path / "shifted.parquet", shift)
    run = tmp_path / "run"
    run_training(
        _overrides(
            tiny_model_dir,
            arithmetic_data,
            run,
            shifted,
            "data.train_batch_size=8",
            "data.shuffle=False",
            "algorithm.rollout_correction.bypass_mode=True",
            "actor_rollout_ref.actor.ppo_mini_batch_size=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        )
    )
    (metrics,) = read_metrics(run)

    settings = _loader_settings(shifted)
    b = LoggedLoader(settings, load_tokenizer(str(tiny_model_dir))).next_batch()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float64).eval()
    ids, attn = b.input_ids, b.attention_mask
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=b.position_ids).logits
    p = b.prompts.shape[1]
    logp = torch.log_softmax(logits[:, p - 1 : -1], dim=-1).gather(-1, b.responses[..., None])[..., 0]
    score = b.token_level_scores.double().sum(1).view(-1, 2)
    adv = ((score - score.mean(1, keepdim=True)) / (score.std(1, keepdim=True) + 1e-6)).flatten()
    mask = b.response_mask.double()
    ratio = torch.exp(logp - b.rollout_log_probs.double())
    a = adv[:, None]
    loss1 = torch.maximum(-a * ratio, -a * ratio.clamp(0.8, 1.2))
    loss = torch.where(a < 0, torch.minimum(loss1, -a * 3.0), loss1)
    expected = float((loss * mask).sum() / mask.sum())
    assert (
        math.isfinite(expected) and ((ratio > 1.2) & (mask > 0)).any() and ((ratio < 0.8) & (mask > 0)).any()
    )
    assert metrics["actor/pg_loss"] == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_rejection_leaves_out_the_mismatched_samples(logged, tiny_model_dir, arithmetic_data, tmp_path):
    """Decoupled rejection against the log's behaviour log-probs: every odd sample's are 3 nats below the
    policy's (δ = +3, seq_mean_k1 = −3 outside [ln ½, ln 2]) and its row is rejected, every even sample's
    are the policy's own and kept — half the rows and exactly the odd rows' tokens, on both steps."""
    lengths = {}

    def shift(i, row):
        lengths[i] = len(row["response_ids"])
        row.update(score=float(i % 2))
        if i % 2:
            row.update(response_log_probs=[v - 3.0 for v in row["response_log_probs"]])

    shifted = _rewrite(logged, tmp_path / "shifted.parquet", shift)
    run = tmp_path / "run"
    run_training(
        _overrides(
            tiny_model_dir,
            arithmetic_data,
            run,
            shifted,
            "data.train_batch_size=4",
            "data.shuffle=False",
            "algorithm.rollout_correction.rollout_rs=seq_mean_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2.0",
            "trainer.total_training_steps=2",
        )
    )
    for step, metrics in enumerate(read_metrics(run)):
        rows = range(8 * step, 8 * step + 8)
        odd = sum(lengths[i] for i in rows if i % 2) / sum(lengths[i] for i in rows)
        assert metrics["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(0.5)
        assert metrics["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(odd)
        assert metrics["rollout_corr/rollout_rs_seq_mean_k1_seq_min"] == pytest.approx(-3.0, abs=0.05)
        assert math.isfinite(metrics["actor/pg_loss"])


KEPT_KEYS = (
    "data.train_batch_size=4",  # 8 groups: 2 steps a pass
    "actor_rollout_ref.actor.use_kl_loss=True",
    "trainer.total_training_steps=4",
)
KEPT_METRICS = ("actor/kl_loss", "actor/pg_loss", "actor/grad_norm")


def test_reference_log_probs_kept_across_passes(
    logged, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    """Two passes over the log: the second runs no reference pass (its samples' log-probs were kept) and
    trains as a run that keeps nothing."""
    from klppo.trainer import ref_cache

    scored = _scored(logged, tmp_path)
    run_training(_overrides(tiny_model_dir, arithmetic_data, tmp_path / "kept", scored, *KEPT_KEYS))
    monkeypatch.setattr(ref_cache, "MAX_BYTES", 0)
    run_training(_overrides(tiny_model_dir, arithmetic_data, tmp_path / "none", scored, *KEPT_KEYS))
    kept, none = read_metrics(tmp_path / "kept"), read_metrics(tmp_path / "none")
    assert ["timing_s/ref" in m for m in kept] == [True, True, False, False]
    assert all("timing_s/ref" in m for m in none)
    for a, b in zip(kept, none, strict=True):
        for key in KEPT_METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-8), (a["step"], key)


@pytest.mark.slow
@pytest.mark.xdist_group("rank_pool")
def test_two_ranks_keep_reference_log_probs_alike(
    logged, tiny_model_dir, arithmetic_data, tmp_path, rank_pool
):
    """2 gloo ranks, two passes over the log: both ranks skip the reference pass on the second (one decision,
    no rank left waiting in a collective) and train as one rank does."""
    scored = _scored(logged, tmp_path)
    one = _overrides(tiny_model_dir, arithmetic_data, tmp_path / "one", scored, *KEPT_KEYS)
    run_training(one)
    two = _overrides(tiny_model_dir, arithmetic_data, tmp_path / "two", scored, *KEPT_KEYS)
    assert train_two_ranks(rank_pool, [*two, "trainer.n_gpus_per_node=2"]) == 0
    rows = read_metrics(tmp_path / "two")
    assert ["timing_s/ref" in m for m in rows] == [True, True, False, False]
    for a, b in zip(rows, read_metrics(tmp_path / "one"), strict=True):
        for key in KEPT_METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)


def test_bypass_kl_is_the_trained_policys(logged, tiny_model_dir, arithmetic_data, tmp_path):
    """Bypass mode on a log of the initial model: the KL to the reference that the step reports and the
    KL-loss controller holds is the trained policy's (0 at step 1, then growing as it learns), not the
    behaviour policy's (the initial model's: about 0 on every step)."""
    scored = _scored(logged, tmp_path)
    keys = [
        "algorithm.rollout_correction.bypass_mode=True",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.kl_loss_ctrl.type=pi",
        "actor_rollout_ref.actor.kl_loss_ctrl.target_kl=0.01",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # one update a step: its forward is at π_old
        "trainer.total_training_steps=4",
    ]
    run_training(_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run", scored, *keys))
    rows = read_metrics(tmp_path / "run")
    k3 = [r["actor/ref_kl_k3"] for r in rows]
    assert abs(k3[0]) < 1e-6 and all(k > 1e-5 for k in k3[1:]), k3
    assert [r["actor/kl_loss_ctrl_kl"] for r in rows] == pytest.approx(k3, rel=1e-6, abs=1e-9)
