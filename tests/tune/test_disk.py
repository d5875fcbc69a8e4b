"""The checkpoint's predicted size (klppo/tune/disk.py) against checkpoints the trainer writes (a tiny model,
one step, ``trainer.save_freq=1``): the full state of an actor and a critic in fp32, and LoRA adapters with
bf16 masters and optimizer state (no base weights), within 3% in all and per role; and at Qwen2.5-7B's shape
(config only, no weights), the sizes per setting by hand."""

from __future__ import annotations

import pytest

from klppo.assembly.startup_checks import disk_roles
from klppo.config import load_config
from klppo.tune import disk
from klppo.tune.shapes import config_from_shape
from tests.trainer.utils import base_overrides, run_training

GIB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from klppo.data.arithmetic import write_arithmetic_parquet
    from klppo.models.tiny import save_tiny_model_dir

    root = tmp_path_factory.mktemp("disk")
    model = save_tiny_model_dir(root / "model", num_layers=2, hidden_size=64)
    return model, write_arithmetic_parquet(root / "data", num_train=64, num_test=8, seed=0)


def _bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _written_and_predicted(tiny, run_dir, extra: list[str]):
    model, data = tiny
    overrides = base_overrides(model, data, run_dir) + ["trainer.save_freq=1", *extra]
    run_training(overrides)
    predicted = disk.checkpoint_size(disk_roles(load_config(overrides), str(model)))
    return run_dir / "global_step_1", predicted


def test_full_state_of_actor_and_critic(tiny, tmp_path):
    written, predicted = _written_and_predicted(tiny, tmp_path / "run", ["algorithm.adv_estimator=gae"])
    assert predicted.total == pytest.approx(_bytes(written), rel=0.03)
    for role in ("actor", "critic"):
        assert disk.role_bytes(predicted, role) == pytest.approx(_bytes(written / role), rel=0.03), role


def test_lora_adapters_with_bf16_state(tiny, tmp_path):
    pytest.importorskip("peft")
    lora = [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.model.lora_rank=4",
        "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
    ]
    written, predicted = _written_and_predicted(tiny, tmp_path / "run", lora)
    assert predicted.total == pytest.approx(_bytes(written), rel=0.03)
    assert disk.role_bytes(predicted, "actor") == pytest.approx(_bytes(written / "actor"), rel=0.03)
    state = next(t for t in predicted.terms if t.name == "actor optimizer state")
    assert "LoRA rank 4" in state.formula


def test_7b_sizes_per_setting():
    pytest.importorskip("peft")
    qwen7b = config_from_shape("Qwen2.5-7B")
    P = 7_615_616_512  # parameters, untied: the embedding and the LM head written once each
    options = dict(disk.settings([disk.RoleState("actor", qwen7b)]))
    assert list(options) == [
        "as configured",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16",
        "actor_rollout_ref.model.lora_rank=64",
        "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16, actor_rollout_ref.model.lora_rank=64",
    ]
    overhead = 4 * 2**20  # tensor records and files: a few MB
    full = options["as configured"].total
    bf16 = options["actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"].total
    assert P * 12 < full < P * 12 + overhead  # fp32 masters + two fp32 moments: 85 GiB, over a 64 GiB disk
    assert P * 6 < bf16 < P * 6 + overhead
    adapters = 28 * 64 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))  # q,o; k,v; MLP
    lora = options["actor_rollout_ref.model.lora_rank=64"].total
    assert adapters * 12 < lora < adapters * 12 + overhead  # the adapters and their moments, no base
    assert lora / GIB == pytest.approx(1.81, abs=0.01)
