"""Checkpoints: exact resume (step k+1 metrics equal the uninterrupted run's), atomicity, retention,
export to a Hugging Face directory."""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.trainer.utils import base_overrides, read_metrics, run_training

pytestmark = pytest.mark.slow  # multi-process or long (minutes on 2 busy cores); `-m 'not slow'` skips it

GAE = [
    "algorithm.adv_estimator=gae",
    "algorithm.use_kl_in_reward=True",
    "algorithm.kl_ctrl.type=adaptive",
    "actor_rollout_ref.actor.use_kl_loss=True",
]
COMPARED = [
    "critic/score/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "critic/vf_loss",
    "actor/reward_kl_penalty",
    "actor/reward_kl_penalty_coeff",
    "actor/lr",
    "response_length/mean",
    "critic/advantages/mean",
]


def test_resume_equals_uninterrupted_and_export(tiny_model_dir, arithmetic_data, tmp_path):
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    common = base_overrides(tiny_model_dir, arithmetic_data, full_dir) + GAE
    run_training(common + ["trainer.total_training_steps=3", "trainer.save_freq=-1"])
    full = read_metrics(full_dir)

    cut = base_overrides(tiny_model_dir, arithmetic_data, cut_dir) + GAE
    run_training(cut + ["trainer.total_training_steps=2", "trainer.save_freq=2"])
    assert (cut_dir / "global_step_2" / "COMPLETE").exists()
    assert (cut_dir / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    state, _ = run_training(cut + ["trainer.total_training_steps=3", "trainer.save_freq=-1"])
    assert state.global_step == 3
    resumed = {row["step"]: row for row in read_metrics(cut_dir)}
    for key in COMPARED:
        assert resumed[3][key] == pytest.approx(full[2][key], rel=1e-5, abs=1e-6), key

    # export the step-2 checkpoint and check transformers loads the same weights that were trained
    from transformers import AutoModelForCausalLM

    from klppo.commands.export import main as export_main

    out = tmp_path / "hf"
    assert export_main([str(cut_dir / "global_step_2"), str(out)]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    diffs = [
        (a - b).abs().max().item()
        for a, b in zip(exported.state_dict().values(), original.state_dict().values())
    ]
    assert max(diffs) > 0, "exported weights are the untrained ones"
    assert export_main([str(cut_dir / "global_step_2"), str(tmp_path / "hf_critic"), "--role", "critic"]) == 0


def test_crash_mid_save_keeps_previous_checkpoint(tiny_model_dir, arithmetic_data, tmp_path, monkeypatch):
    from klppo.ops import checkpoint

    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path) + [
        "trainer.total_training_steps=1",
        "trainer.save_freq=1",
    ]
    run_training(overrides)
    assert checkpoint.latest_checkpoint(tmp_path).name == "global_step_1"

    real_save = torch.save

    def crash_on_trainer_state(obj, path, *a, **k):
        if str(path).endswith("trainer_state.pt"):
            raise KeyboardInterrupt("simulated crash mid-save")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", crash_on_trainer_state)
    with pytest.raises(KeyboardInterrupt):
        run_training(overrides + ["trainer.total_training_steps=2"])
    monkeypatch.undo()
    # the half-written step 2 is not a checkpoint; step 1 is still the latest and loads
    assert checkpoint.latest_checkpoint(tmp_path).name == "global_step_1"
    assert not (tmp_path / "global_step_2").exists()
    state, _ = run_training(overrides + ["trainer.total_training_steps=2"])
    assert state.global_step == 2


def test_full_disk_on_save_is_clear_and_keeps_previous(
    tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    import errno

    from klppo.ops import checkpoint

    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path) + [
        "trainer.total_training_steps=1",
        "trainer.save_freq=1",
        "trainer.max_actor_ckpt_to_keep=1",
    ]
    run_training(overrides)
    real_save = torch.save

    def disk_full(obj, path, *a, **k):
        if str(path).endswith("trainer_state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(checkpoint.torch, "save", disk_full)
    with pytest.raises(checkpoint.CheckpointError, match="disk is full"):
        run_training(overrides + ["trainer.total_training_steps=2"])
    monkeypatch.undo()
    assert checkpoint.latest_checkpoint(tmp_path).name == "global_step_1"
    assert not any(p.name.startswith(".global_step") for p in tmp_path.iterdir())
    shutil.rmtree(tmp_path)


SIGTERM_AT_STEP_2 = """
import os, signal

calls = []

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    calls.append(1)
    if len(calls) == 9:  # first sample of step 2 (8 samples per step)
        os.kill(os.getpid(), signal.SIGTERM)
    return 0.0
"""


def test_sigterm_finishes_step_saves_and_resumes(tiny_model_dir, arithmetic_data, tmp_path):
    from klppo.ops import checkpoint

    fn = tmp_path / "preempt.py"
    fn.write_text(SIGTERM_AT_STEP_2)
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "trainer.total_training_steps=4",
        "trainer.save_freq=-1",
        f"custom_reward_function.path={fn}",
    ]
    state, _ = run_training(overrides)
    assert state.global_step == 2  # the step in flight finished, then the run stopped
    assert checkpoint.latest_checkpoint(tmp_path / "run").name == "global_step_2"
    state, _ = run_training(overrides)  # resumes at step 3 (a second SIGTERM would land in its last step)
    assert state.global_step == 4
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4]
