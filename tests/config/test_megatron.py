"""verl's Megatron launches: keys translated to FSDP2 counterparts or to nothing in one notice,
result-changing ones refused by name, packaged Megatron config names and `defaults:` entries read as klppo's
defaults."""

from __future__ import annotations

import dataclasses
import math

import pytest

from klppo.assembly.settings import optim_settings
from klppo.config import ConfigError, derive_sizes, load_config
from klppo.roles.optim import lr_multiplier

A = "actor_rollout_ref.actor"
MEGATRON = [
    "--config-name=ppo_megatron_trainer",
    f"{A}.megatron.tensor_model_parallel_size=2",
    f"{A}.megatron.pipeline_model_parallel_size=2",
    f"{A}.megatron.virtual_pipeline_model_parallel_size=2",
    f"{A}.megatron.context_parallel_size=2",
    f"{A}.megatron.param_offload=True",
    f"{A}.megatron.optimizer_offload=True",
    "critic.megatron.context_parallel_size=2",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.apply_rope_fusion=True",
    "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_cpu_offload=True",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
]
FSDP = [
    f"{A}.ulysses_sequence_parallel_size=2",
    f"{A}.fsdp_config.param_offload=True",
    f"{A}.fsdp_config.optimizer_offload=True",
    "critic.ulysses_sequence_parallel_size=2",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
]


def _load(argv):
    notes: list[str] = []
    return load_config(argv, notify=notes.append), notes


def test_megatron_launch_equals_the_hand_written_fsdp_launch_but_for_strategy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --config-name: verl's packaged name, absent here
    mg, notes = _load(MEGATRON)
    fsdp, _ = _load(FSDP)
    assert mg.actor_rollout_ref.actor.strategy == mg.critic.strategy == "megatron"
    assert fsdp.actor_rollout_ref.actor.strategy == "fsdp2"

    def same(a, b, path=""):
        for f in dataclasses.fields(a):
            x, y = getattr(a, f.name), getattr(b, f.name)
            if dataclasses.is_dataclass(x):
                same(x, y, f"{path}{f.name}.")
            elif f.name != "strategy":
                assert x == y, f"{path}{f.name}"

    same(mg, fsdp)
    [notice] = [n for n in notes if n.startswith("Megatron launch read on FSDP2")]
    lines = notice.splitlines()[1:]
    for expected in (
        f"{A}.megatron.context_parallel_size=2 → {A}.ulysses_sequence_parallel_size=2",
        f"{A}.megatron.param_offload=True → {A}.fsdp_config.param_offload=True",
        f"{A}.megatron.optimizer_offload=True → {A}.fsdp_config.optimizer_offload=True",
        "critic.megatron.context_parallel_size=2 → critic.ulysses_sequence_parallel_size=2",
        f"{A}.megatron.tensor_model_parallel_size=2 → nothing",
        f"{A}.megatron.pipeline_model_parallel_size=2 → nothing",
        f"{A}.megatron.virtual_pipeline_model_parallel_size=2 → nothing",
        f"{A}.megatron.override_transformer_config.recompute_granularity='full' → nothing",
        f"{A}.megatron.override_transformer_config.apply_rope_fusion=True → "
        f"nothing (kernel or fusion choice)",
        f"{A}.optim.override_optimizer_config.optimizer_cpu_offload=True → "
        f"{A}.fsdp_config.optimizer_offload=True",
    ):
        assert any(line.strip().startswith(expected) for line in lines), expected
    assert len(lines) == 3 + 1 + len(MEGATRON) - 2  # config name + 3 strategies, then one per Megatron key


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        ([f"{A}.megatron.use_dist_checkpointing=True"], "verl.model_merger merge --backend megatron"),
        ([f"+{A}.megatron.override_transformer_config.num_layers=4"], "changes the model's shape"),
        ([f"+{A}.megatron.override_transformer_config.moe_router_dtype=fp32"], "no fp32 router"),
        ([f"+{A}.megatron.override_transformer_config.hidden_dropout=0.1"], "hidden_dropout"),
        ([f"+{A}.megatron.override_mcore_model_config.x=1"], "override_mcore_model_config"),
        ([f"+{A}.optim.lr_decay_style=linear"], "lr_scheduler_type"),
        ([f"{A}.optim.lr_decay_style=cosine", f"{A}.optim.min_lr=1e-7"], "min_lr_ratio"),
        ([f"+{A}.optim.lr_warmup_init=1e-7"], "lr_warmup_init"),
        (
            [
                "+actor_rollout_ref.model.lora.rank=8",
                "+actor_rollout_ref.model.lora.lora_A_init_method=xavier",
            ],
            "Kaiming",
        ),
        ([f"+{A}.megatron.not_a_megatron_key=1"], "not classified"),
    ],
)
def test_result_changing_megatron_keys_are_refused_by_name(argv, named):
    with pytest.raises(ConfigError) as e:
        load_config(argv, notify=lambda _m: None)
    text = str(e.value)
    assert text.startswith("klppo train cannot honour these Megatron settings") and named in text


def test_inert_lora_keys_pass_at_rank_zero_and_map_at_a_rank():
    cfg, notes = _load(["+actor_rollout_ref.model.lora.lora_A_init_method=xavier"])
    assert cfg.actor_rollout_ref.model.lora_rank == 0 and "LoRA is off" in notes[-1]
    cfg, _ = _load(
        [
            "+actor_rollout_ref.model.lora.rank=32",
            "+actor_rollout_ref.model.lora.alpha=64",
            "+actor_rollout_ref.model.lora.lora_A_init_method=kaiming",
            "+actor_rollout_ref.model.lora.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
        ]
    )
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (32, 64, "all-linear")


def test_megatron_config_name_and_defaults_entry_are_klppo_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plain, _ = _load([])
    for argv in (
        ["--config-path=config", "--config-name=ppo_megatron_trainer.yaml"],
        ["--config-name", "_generated_ppo_megatron_trainer"],
    ):
        cfg, notes = _load(argv)
        assert cfg.actor_rollout_ref.actor.strategy == "megatron"
        assert cfg.actor_rollout_ref.actor.optim == plain.actor_rollout_ref.actor.optim
        assert len([n for n in notes if n.startswith("Megatron launch")]) == 1
    f = tmp_path / "run.yaml"
    f.write_text(
        "defaults:\n  - ppo_megatron_trainer\n  - _self_\nactor_rollout_ref:\n  actor:\n    megatron:\n"
        "      context_parallel_size: 2\n    optim:\n      optimizer: adam\n      lr_decay_style: constant\n"
    )
    cfg, _ = _load([str(f)])
    actor = cfg.actor_rollout_ref.actor
    assert (actor.strategy, actor.ulysses_sequence_parallel_size, actor.optim.optimizer) == (
        "megatron",
        2,
        "AdamW",
    )


def test_translated_data_parallel_size_is_what_batch_sizes_are_checked_for():
    """Megatron's DP would be 8 / (TP 2 · PP 2 · CP 2) = 1; on FSDP2 it is 8 / Ulysses 2 = 4."""
    argv = [
        f"{A}.megatron.tensor_model_parallel_size=2",
        f"{A}.megatron.pipeline_model_parallel_size=2",
        f"{A}.megatron.context_parallel_size=2",
        "trainer.n_gpus_per_node=8",
        "data.train_batch_size=8",
        f"{A}.ppo_mini_batch_size=8",
        "actor_rollout_ref.rollout.n=1",
        f"{A}.ppo_micro_batch_size_per_gpu=4",
    ]
    cfg, notes = _load(argv)
    with pytest.raises(ConfigError, match="divisible|divide"):
        derive_sizes(cfg, 8)  # 8 samples / 4 data-parallel ranks = 2, not a multiple of 4 per GPU
    cfg, _ = _load([*argv[:-1], f"{A}.ppo_micro_batch_size_per_gpu=2"])
    assert derive_sizes(cfg, 8).actor_dp_size == 4


def megatron_cosine_lr(k: int, *, max_lr: float, min_lr: float, warmup: int, decay_steps: int) -> float:
    """megatron.core's OptimizerParamScheduler.get_lr with lr_decay_style=cosine and lr_warmup_init 0, at
    ``k`` scheduler steps (verl steps it once per update, after the update)."""
    if warmup > 0 and k <= warmup:
        return max_lr * k / warmup
    if k > decay_steps:
        return min_lr
    ratio = (k - warmup) / (decay_steps - warmup)
    return min_lr + 0.5 * (math.cos(math.pi * ratio) + 1.0) * (max_lr - min_lr)


def test_megatron_cosine_is_klppo_cosine_and_other_keys_say_what_they_become():
    cfg, notes = _load(
        [
            f"{A}.optim.lr_decay_style=cosine",
            f"{A}.optim.lr=1e-3",
            f"{A}.optim.min_lr=0.0",
            "critic.optim.lr_decay_style=cosine",
            "critic.nccl_timeout=1200",
            "+actor_rollout_ref.rollout.layer_name_map.qkv_layer_name=qkv",
        ]
    )
    assert (
        cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == cfg.critic.optim.lr_scheduler_type == "cosine"
    )
    settings = optim_settings(cfg.actor_rollout_ref.actor.optim, total_steps=20)
    for k in range(24):  # verl's lr_decay_steps null: the run's steps; no warmup
        want = megatron_cosine_lr(k, max_lr=1e-3, min_lr=0.0, warmup=0, decay_steps=20)
        assert 1e-3 * lr_multiplier(k, settings) == pytest.approx(want, rel=1e-12, abs=1e-18), k
    lines = [line.strip() for line in notes[-1].splitlines()[1:]]
    assert (
        f"{A}.optim.lr_decay_style='cosine' → {A}.optim.lr_scheduler_type='cosine' (the same curve"
        in lines[0]
    )
    assert (
        "critic.nccl_timeout=1200 → nothing (trainer.collective_timeout_s bounds every collective)" in lines
    )
    assert (
        "actor_rollout_ref.rollout.layer_name_map.qkv_layer_name='qkv' → nothing (the rollout reads the "
        "actor's gathered weights by their Hugging Face names; no Megatron layer names to map)"
    ) in lines
