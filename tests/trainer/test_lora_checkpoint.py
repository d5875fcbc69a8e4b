"""A LoRA actor's checkpoint holds its adapters, their optimizer state and the trainer state, with a record
of the base model (``actor/base_model.json``) instead of the base weights: it is the size
``klppo.tune.disk`` predicts and far below the full model's, resumes to the uninterrupted run's metrics on
the base read from the model path, refuses another base before any weights load, and exports the merged
model; a checkpoint that holds the base weights (written before the record existed) still resumes."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.trainer.test_lora import LORA
from tests.trainer.utils import base_overrides, read_metrics, run_training

pytest.importorskip("peft")

COMPARED = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean", "critic/score/mean")


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _merged(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trained actor's merged weights (fp32), as `klppo export` writes them."""
    import copy

    return {k: v.float() for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    """A tiny model whose weights outweigh the tensors' records on disk (unlike the trainer tests')."""
    from klppo.models.tiny import save_tiny_model_dir

    path = tmp_path_factory.mktemp("lora_base")
    return save_tiny_model_dir(path, num_layers=2, hidden_size=256, intermediate_size=512)


@pytest.fixture(scope="module")
def runs(base_dir, arithmetic_data, tmp_path_factory):
    """An uninterrupted 3-step LoRA run, and one saved at step 2 and resumed to step 3."""
    root = tmp_path_factory.mktemp("lora_ckpt")

    def overrides(run_dir: Path) -> list[str]:
        return base_overrides(base_dir, arithmetic_data, run_dir) + LORA

    _, full = run_training(overrides(root / "full") + ["trainer.total_training_steps=3"])
    merged = _merged(full.roles.actor.model)
    cut = overrides(root / "cut") + ["trainer.save_freq=2"]
    run_training(cut + ["trainer.total_training_steps=2"])
    saved = root / "saved_step_2"
    shutil.copytree(root / "cut" / "global_step_2", saved)  # as written, before the resume adds step 3
    run_training(cut + ["trainer.total_training_steps=3"])
    return {"root": root, "full": read_metrics(root / "full"), "merged": merged, "saved": saved, "cut": cut}


def _same_steps(resumed: list[dict], full: list[dict]) -> None:
    by_step = {row["step"]: row for row in resumed}
    assert sorted(by_step) == [1, 2, 3]
    for key in COMPARED:
        assert by_step[3][key] == pytest.approx(full[2][key], rel=1e-6, abs=1e-7), key


@pytest.mark.slow
def test_the_checkpoint_holds_the_adapters_and_a_record_of_the_base(runs, base_dir):
    from klppo.assembly.startup_checks import disk_roles
    from klppo.config import load_config
    from klppo.ops.resume_check import base_record
    from klppo.tune import disk

    saved = runs["saved"]
    record = json.loads((saved / "actor" / "base_model.json").read_text())
    assert record == base_record(base_dir)
    roles = disk_roles(load_config(runs["cut"]), str(base_dir))
    predicted = disk.checkpoint_size(roles)
    assert predicted.total == pytest.approx(_bytes(saved), rel=0.03)
    assert disk.role_bytes(predicted, "actor") == pytest.approx(_bytes(saved / "actor"), rel=0.03)
    base_weights = sum(f.stat().st_size for f in Path(base_dir).glob("*.safetensors"))
    assert _bytes(saved / "actor") < base_weights / 4  # the frozen base is not in it
    full_state = disk.checkpoint_size([dataclasses.replace(roles[0], lora_rank=0)])
    assert predicted.total < full_state.total / 5


@pytest.mark.slow
def test_resume_from_the_adapters_continues_the_run_and_exports_merged(runs, tmp_path):
    from transformers import AutoModelForCausalLM

    from klppo.commands.export import main as export_main

    _same_steps(read_metrics(runs["root"] / "cut"), runs["full"])
    out = tmp_path / "hf"
    assert export_main([str(runs["root"] / "cut" / "global_step_3"), str(out), "--dtype", "fp32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert set(exported) == set(runs["merged"])
    for key, value in runs["merged"].items():
        torch.testing.assert_close(exported[key], value, rtol=1e-6, atol=1e-7, msg=key)


@pytest.mark.slow
def test_another_base_is_refused_before_weights_load(runs, tmp_path, base_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    from klppo.commands.export import main as export_main
    from klppo.ops.resume_check import ResumeMismatchError

    other = tmp_path / "other_base"
    shutil.copytree(base_dir, other)
    model = AutoModelForCausalLM.from_pretrained(other)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.add_(0.01)
    model.save_pretrained(other)
    run_dir = tmp_path / "run"
    shutil.copytree(runs["saved"], run_dir / "global_step_2")
    overrides = [o for o in runs["cut"] if not o.startswith(("actor_rollout_ref.model.path=", "trainer.d"))]
    overrides += [
        f"actor_rollout_ref.model.path={other}",
        f"trainer.default_local_dir={run_dir}",
        "trainer.total_training_steps=3",
        "trainer.allow_resume_changes=True",  # the base is refused whatever this says
    ]
    import klppo.assembly.roles_build as roles_build

    def no_weights(*args, **kwargs):
        raise AssertionError("weights loaded before the base was checked")

    monkeypatch.setattr(roles_build, "load_policy_model", no_weights)
    with pytest.raises(ResumeMismatchError, match="without their base weights.*other weights than the base"):
        run_training(overrides)
    # export reads the recorded base, or --base: another base is refused there too
    out = tmp_path / "hf"
    assert export_main([str(runs["saved"]), str(out), "--base", str(other)]) == 2
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.slow
def test_a_checkpoint_with_the_base_weights_still_resumes(
    runs, base_dir, arithmetic_data, tmp_path, monkeypatch
):
    """A checkpoint written with every weight and no base record (as before the record existed) resumes
    to the same step 3."""
    from klppo.assembly.setup import Run

    run_dir = tmp_path / "old"
    overrides = base_overrides(base_dir, arithmetic_data, run_dir) + LORA + ["trainer.save_freq=2"]
    with monkeypatch.context() as patch:
        patch.setattr(Run, "frozen_bases", property(lambda self: {}))
        run_training(overrides + ["trainer.total_training_steps=2"])
    old = run_dir / "global_step_2"
    assert not (old / "actor" / "base_model.json").exists()
    assert _bytes(old / "actor") > 4 * _bytes(runs["saved"] / "actor")  # the base weights are in it
    run_training(overrides + ["trainer.total_training_steps=3"])
    _same_steps(read_metrics(run_dir), runs["full"])
