"""trainer.val_only validates and never trains — also after a resume (it trained on from the checkpoint,
writing new ones, when the resumed step was not 0)."""

from __future__ import annotations

from tests.trainer.utils import base_overrides, read_metrics, run_training


def test_val_only_after_a_resume_validates_the_resumed_model_and_stops(
    tiny_model_dir, arithmetic_data, tmp_path
):
    run_dir = tmp_path / "run"
    common = base_overrides(tiny_model_dir, arithmetic_data, run_dir) + ["algorithm.adv_estimator=grpo"]
    state, _ = run_training(common + ["trainer.save_freq=1", "trainer.total_training_steps=1"])
    assert state.global_step == 1
    state, _ = run_training(
        common + ["trainer.val_only=True", "trainer.total_training_steps=3", "trainer.save_freq=1"]
    )
    assert state.global_step == 1  # resumed at step 1, not trained on
    assert sorted(p.name for p in run_dir.glob("global_step_*")) == ["global_step_1"]
    rows = read_metrics(run_dir)
    val = [r for r in rows if any(k.startswith("val-core/") for k in r)]
    assert val and val[-1]["step"] == 1
    assert not [r for r in rows if r.get("step", 0) > 1]
