"""The quickstart: the GPU/CPU switch, both recipes valid, and the CPU demo end to end (on a tiny model in
place of SmolLM2): banner, validation before and after, summary, the next steps; each fact said once, no
advice to change the recipe, no pointer outside docs/."""

from __future__ import annotations

import re

import pytest

from klppo.commands import quickstart


def test_choice_follows_the_machine(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert quickstart.choose().name == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert quickstart.choose().name == "gpu"
    assert quickstart.choose("cpu").name == "cpu"
    with pytest.raises(ValueError, match=r"--quickstart 'tpu': choose one of \['cpu', 'gpu'\]"):
        quickstart.choose("tpu")


@pytest.fixture
def tiny_quickstart(monkeypatch, tmp_path, tiny_model_dir):
    """The quickstart with the tiny model in place of SmolLM2, its data under tmp_path, run from tmp_path."""
    # where quickstart_argv looks the name up (its module imports it at the top)
    monkeypatch.setattr(quickstart, "quickstart_model_path", lambda: str(tiny_model_dir))
    monkeypatch.setenv("KLPPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("name", ["gpu", "cpu"])
def test_recipes_validate_before_and_after(tiny_quickstart, name, capsys):
    from klppo.commands.train import main
    from klppo.config import check_trainable, load_config

    recipe = quickstart.QUICKSTARTS[name]
    cfg = load_config(quickstart.quickstart_argv(recipe))
    check_trainable(cfg)
    t = cfg.trainer
    assert (
        t.val_before_train and t.test_freq > t.total_training_steps
    )  # validation before and at the end only
    assert t.save_freq > t.total_training_steps and "jsonl" in t.logger and "console" in t.logger
    assert cfg.actor_rollout_ref.rollout.val_kwargs.do_sample is False  # greedy accuracy
    assert cfg.actor_rollout_ref.actor.use_kl_loss
    # the whole plan checks out (on this CPU machine)
    assert main(["--dry-run", "--quickstart", name, "trainer.device=cpu"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(recipe.about + "\n") and "processes: 1 per node × 1 node(s) on cpu" in out
    rows = {"gpu": (8000, 200), "cpu": (64, 8)}[name]
    assert (recipe.num_train, recipe.num_test) == rows


def test_cpu_demo_end_to_end(tiny_quickstart, capsys, caplog):
    from klppo.commands.train import main

    steps = 2  # the demo's own number of steps is the YAML's; fewer here to keep the test short
    with caplog.at_level("INFO", logger="klppo"):
        assert main(["--quickstart=cpu", f"trainer.total_training_steps={steps}"]) == 0
    out, err = capsys.readouterr()
    logged = [r.getMessage() for r in caplog.records]
    said = [*out.splitlines(), *err.splitlines(), *logged]
    prompts = [m.split(":")[0] for m in logged if "prompts:" in m]
    assert prompts == ["train prompts", "validation prompts"]  # once each, by the launcher
    assert not [line for line in said if re.search(r"\badvice\b|\btip\b|bench/", line)]
    assert not [m for m in logged if "reduce-scatter once per" in m]  # one process: no reduce-scatter at all
    assert len(set(logged)) == len(logged), logged
    assert out.startswith("klppo quickstart (CPU demo): ") and "too short to learn" in out
    lines = out.splitlines()
    assert [line.split(" | ")[0] for line in lines if line.startswith(("val @", "step "))] == [
        "val @ step 0",
        "step 1/2",
        "step 2/2",
        f"val @ step {steps}",
    ]
    assert re.search(r"validation arithmetic/reward/mean@1: \S+ → \S+ \(step 0 → 2\)", out)
    run_dir = tiny_quickstart / "runs" / "quickstart-cpu"
    assert f"checkpoint: {run_dir.relative_to(tiny_quickstart) / 'global_step_2'}" in out
    assert (run_dir / "report.html").is_file()
    checkpoint = run_dir.relative_to(tiny_quickstart) / "global_step_2"
    assert lines[-3:] == [
        "next:",
        f"  its model as a Hugging Face folder: klppo export {checkpoint} {checkpoint.parent / 'hf'}",
        f"  the learning recipe (about 5 minutes on one GPU): {quickstart.GPU_COMMAND}",
    ]
    assert out.count(quickstart.GPU_COMMAND) == 1
