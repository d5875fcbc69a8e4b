"""Non-finite values: a NaN/inf reward is named (data source, data row) and skips the whole step — actor and
critic untouched — through the same counted path as a non-finite KL or loss; metrics.jsonl stays JSON."""

from __future__ import annotations

import json
import math

import pytest
import torch

from klppo.batch import Batch
from tests.trainer.utils import base_overrides, run_training

GAE_KL = [
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=True",
    "algorithm.kl_ctrl.type=adaptive",
]


def test_find_nonfinite_names_field_sample_source_and_row():
    from klppo.ops.nonfinite import find_nonfinite

    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    scores = torch.zeros(3, 3)
    scores[1, 2] = float("nan")  # under the mask: ignored
    batch = Batch(
        prompts=torch.zeros(3, 1, dtype=torch.long),
        prompt_mask=torch.ones(3, 1, dtype=torch.long),
        response_mask=mask,
        token_level_scores=scores,
        data_source=["gsm8k", "gsm8k", "math"],
        uid=["0:4", "0:9", "1:17"],
    )
    assert find_nonfinite(batch, ["token_level_scores"]) is None
    scores[2, 2] = float("inf")
    scores[0, 0] = -float("inf")
    reason = find_nonfinite(batch, ["token_level_scores"], paths=["a.parquet", "b.parquet"])
    assert reason == (
        "the reward score is -inf for sample 0 (data source 'gsm8k', a.parquet row 4) (2 samples in all)"
    )


NAN_FOR_ONE_SAMPLE = """
calls = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    calls.append(1)
    return float("nan") if len(calls) == 3 else 0.5 * (len(calls) % 2)  # 3rd sample of step 1
"""


def _snapshot(parts):
    return {
        name: [p.detach().clone() for p in role.model.parameters()]
        for name, role in parts.roles.trained().items()
    }


def _watch_steps(monkeypatch):
    """Per step: for each trained role, whether the step left every parameter exactly as it was."""
    from klppo.trainer.ppo_trainer import PPOTrainer

    untouched: list[dict[str, bool]] = []
    real = PPOTrainer.train_step

    def watched(self, prompts, step):
        before = _snapshot(self.run)
        out = real(self, prompts, step)
        after = _snapshot(self.run)
        untouched.append({k: all(torch.equal(a, b) for a, b in zip(before[k], after[k])) for k in before})
        return out

    monkeypatch.setattr(PPOTrainer, "train_step", watched)
    return untouched


def test_nan_reward_is_named_and_skips_the_whole_step(
    tiny_model_dir, arithmetic_data, tmp_path, monkeypatch, caplog
):
    fn = tmp_path / "nan_reward.py"
    fn.write_text(NAN_FOR_ONE_SAMPLE)
    untouched = _watch_steps(monkeypatch)
    run_dir = tmp_path / "run"
    overrides = (
        base_overrides(tiny_model_dir, arithmetic_data, run_dir)
        + GAE_KL
        + [
            f"custom_reward_function.path={fn}",
            "trainer.total_training_steps=2",
        ]
    )
    with caplog.at_level("WARNING", logger="klppo"):
        state, parts = run_training(overrides)
    assert state.global_step == 2 and state.num_nan_steps == 1
    assert untouched == [{"actor": True, "critic": True}, {"actor": False, "critic": False}]
    skipped = [r.getMessage() for r in caplog.records if "step 1 skipped" in r.getMessage()]
    train_file = str(arithmetic_data[0])
    assert len(skipped) == 1 and "the reward score is NaN for sample 2" in skipped[0], skipped
    assert f"data source 'arithmetic', {train_file} row " in skipped[0]

    def refuse(constant):
        raise ValueError(constant)

    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line, parse_constant=refuse) for line in lines]
    assert rows[0]["training/nan_steps"] == 1.0 and rows[0]["nonfinite"]["critic/score/mean"] == "nan"
    assert "training/nan_steps" not in rows[1]


def test_nonfinite_kl_goes_through_the_same_counted_skip(
    tiny_model_dir, arithmetic_data, tmp_path, monkeypatch, caplog
):
    from klppo.algorithms import kl as kl_mod

    real = kl_mod.apply_kl_penalty
    calls = []

    def infinite_kl_once(**kwargs):
        rewards, stats = real(**kwargs)
        calls.append(1)
        if len(calls) == 1:
            stats = {**stats, "kl": torch.tensor(float("inf"))}
        return rewards, stats

    monkeypatch.setattr(kl_mod, "apply_kl_penalty", infinite_kl_once)
    untouched = _watch_steps(monkeypatch)
    overrides = (
        base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run")
        + GAE_KL
        + [
            "trainer.total_training_steps=2",
            "algorithm.kl_ctrl.kl_coef=0.05",
        ]
    )
    with caplog.at_level("WARNING", logger="klppo"):
        state, parts = run_training(overrides)
    assert state.num_nan_steps == 1 and state.global_step == 2
    assert untouched[0] == {"actor": True, "critic": True}
    assert any("KL between the actor and the reference is +inf" in r.getMessage() for r in caplog.records)
    assert math.isfinite(parts.kl_ctrl.value)


def test_exploding_learning_rate_stops_with_a_message_not_a_crash(tiny_model_dir, arithmetic_data, tmp_path):
    """lr=1e6: the first update is finite but wrecks the weights; the next steps' non-finite values
    (log-probs, KL, loss) are skipped and counted, and the run stops at the limit with one message."""
    from klppo.ops.nonfinite import TrainingStopped

    overrides = (
        base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run")
        + GAE_KL
        + [
            "actor_rollout_ref.actor.optim.lr=1e6",
            "critic.optim.lr=1e6",
            "trainer.total_training_steps=6",
            "trainer.max_nan_steps=1",
        ]
    )
    with pytest.raises(TrainingStopped, match="max_nan_steps=1") as info:
        run_training(overrides)
    assert "\n" not in str(info.value)
