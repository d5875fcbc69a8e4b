"""`klppo train --dry-run` on the 7B recipe (examples/qwen7b_grpo_one_gpu.yaml) with a Qwen2.5-7B config and
no weights: the GPU's peak per phase, the host memory the CPU-stepped optimizer and the offloaded reference
need, the refusal a GPU run would meet on a host too small, and the checkpoint's size — a refusal with the
settings that fit when it exceeds the free disk. Nothing the size of the model is allocated."""

from __future__ import annotations

import json
import resource
import shutil
from types import SimpleNamespace

import pytest

from klppo.assembly import startup_checks
from klppo.commands import plan
from klppo.commands.train import main
from tests.tune.test_host import QWEN25_7B

GIB = 2**30
RECIPE = "examples/qwen7b_grpo_one_gpu.yaml"


@pytest.fixture(scope="module")
def qwen7b_run(tmp_path_factory):
    """A Qwen2.5-7B model directory without weights (its config, the tiny model's tokenizer) and prompts."""
    from klppo.data.arithmetic import write_arithmetic_parquet
    from klppo.models.tiny import save_tiny_model_dir

    root = tmp_path_factory.mktemp("qwen7b")
    tiny = save_tiny_model_dir(root / "tiny", num_layers=1, hidden_size=32)
    model = root / "qwen7b"
    model.mkdir()
    for f in tiny.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, model / f.name)
    (model / "config.json").write_text(json.dumps(QWEN25_7B))
    train, test = write_arithmetic_parquet(root / "data", num_train=128, num_test=8, seed=0)
    return [
        RECIPE,
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"trainer.default_local_dir={root / 'run'}",
        "trainer.device=cpu",
    ]


def _no_weights(*args, **kwargs):
    raise AssertionError("the dry run loads weights")


def test_7b_recipe_forecast_without_weights(qwen7b_run, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", _no_weights)
    monkeypatch.setattr(plan, "host_ram_bytes", lambda _n: 128 * GIB)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert main(["--dry-run", *qwen7b_run]) == 0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before < 2 * GIB
    out = capsys.readouterr().out
    # the recipe's own comment states these figures
    assert "on an 80 GiB GPU: rollout 40.0, log_prob 21.1, update 56.7" in out
    host = "predicted peak host memory per process: 111.4 GiB of 128 (process 6.0, masters 28.4, "
    assert host + "optimizer (AdamW) 56.7, step buffers (pinned) 6.1, offloaded reference 14.2)" in out
    assert "refused" not in out
    # fp32 masters and AdamW state: 12 bytes per parameter
    assert "checkpoint: about 85.11 GiB each (actor 85.11 GiB;" in out

    monkeypatch.setattr(plan, "host_ram_bytes", lambda _n: 64 * GIB)
    assert main(["--dry-run", *qwen7b_run]) == 0
    out = capsys.readouterr().out
    assert (
        "refused on an 80 GiB GPU with this host's memory: the host is predicted to need 111.4 GiB of its 64"
        in out
    )


def test_7b_recipe_checkpoint_over_the_disk_is_refused(qwen7b_run, monkeypatch, capsys):
    monkeypatch.setattr(startup_checks.shutil, "disk_usage", lambda _p: SimpleNamespace(free=64 * GIB))
    assert main(["--dry-run", *qwen7b_run, "trainer.save_freq=10"]) == 2
    err = capsys.readouterr().err
    assert "one checkpoint needs about 85.11 GiB (actor 85.11 GiB) but 64.00 GiB are free" in err
    assert "predicted to fit: actor_rollout_ref.actor.fsdp_config.model_dtype=bf16: 42.56 GiB" in err
    if "lora_rank=64" in err:  # offered where peft is installed
        assert "actor_rollout_ref.model.lora_rank=64: 1.81 GiB" in err  # the adapters, no base
