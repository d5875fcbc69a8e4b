"""Bad input gives a clear message and no corrupted state."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.utils import base_overrides, read_metrics, run_training


def test_model_path_that_is_not_a_model(arithmetic_data, tmp_path):
    from klppo.models.loading import ModelLoadError

    not_a_model = tmp_path / "empty_dir"
    not_a_model.mkdir()
    with pytest.raises(ModelLoadError, match=str(not_a_model.name)):
        run_training(base_overrides(not_a_model, arithmetic_data, tmp_path / "run"))


def test_empty_dataset_after_filtering(tiny_model_dir, arithmetic_data, tmp_path):
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "data.max_prompt_length=4"
    ]
    with pytest.raises(ValueError, match="(?i)filter|empty|longer"):
        run_training(overrides)


def test_nan_loss_steps_skipped_then_stop(tiny_model_dir, arithmetic_data, tmp_path, monkeypatch):
    from klppo.ops.nonfinite import TrainingStopped
    from klppo.roles import actor as actor_mod

    real = actor_mod.Actor._micro_loss

    def nan_loss(self, mb, *args):
        terms, stats = real(self, mb, *args)
        (pg, mode), *rest = terms
        return [(pg * torch.tensor(float("nan")), mode), *rest], stats

    monkeypatch.setattr(actor_mod.Actor, "_micro_loss", nan_loss)
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "trainer.total_training_steps=5",
        "trainer.max_nan_steps=2",
    ]
    with pytest.raises(TrainingStopped, match="max_nan_steps=2"):
        run_training(overrides)
    rows = read_metrics(tmp_path / "run")
    assert [r["training/nan_steps"] for r in rows] == [1.0, 2.0]


def test_out_of_memory_names_the_phase_and_the_fix(
    tiny_model_dir, arithmetic_data, tmp_path, monkeypatch, capsys
):
    from klppo.commands.train import main
    from klppo.ops import checkpoint
    from klppo.roles import actor as actor_mod

    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
    ]
    calls = []
    real = actor_mod.Actor.update_policy

    def oom_on_second_step(self, batch, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(self, batch, **kwargs)

    monkeypatch.setattr(actor_mod.Actor, "update_policy", oom_on_second_step)
    assert main(overrides) == 1
    err = capsys.readouterr().err
    assert "out of device memory in phase 'update_actor'" in err and "ppo_micro_batch_size_per_gpu" in err
    assert checkpoint.latest_checkpoint(tmp_path / "run").name == "global_step_1"  # step 1 intact
