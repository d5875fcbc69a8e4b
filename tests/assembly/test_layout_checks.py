"""Before any weight loads, from the model's config.json alone (no weights: shapes written on the spot): a
Megatron launch whose FSDP2 layout cannot fit is refused with the figure and the settings predicted to fit,
and a Ulysses size that does not split the model's heads is refused naming the key it came from."""

from __future__ import annotations

import re

import pytest
import torch

from klppo.assembly.layout_checks import check_translated_memory
from klppo.assembly.startup_checks import check_before_weights
from klppo.config import ConfigError, load_config
from klppo.tune.shapes import config_from_shape

A = "actor_rollout_ref.actor"


@pytest.fixture(autouse=True)
def no_gpu(monkeypatch):
    """The GPU size comes from trainer.gpu_memory_gib (80 by default) whatever this machine has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _model(tmp_path, shape: str):
    path = tmp_path / shape
    config_from_shape(shape).save_pretrained(path)
    return path


def _launch(model, tmp_path, *extra):
    return [
        f"actor_rollout_ref.model.path={model}",
        f"trainer.default_local_dir={tmp_path / 'run'}",
        "trainer.n_gpus_per_node=8",
        "data.train_batch_size=16",
        f"{A}.ppo_mini_batch_size=8",
        "data.max_prompt_length=2048",
        "data.max_response_length=4096",
        f"{A}.ppo_micro_batch_size_per_gpu=4",
        *extra,
    ]


def _load(argv):
    return load_config(argv, notify=lambda _m: None)


MEGATRON = [
    "--config-name=ppo_megatron_trainer",
    f"{A}.megatron.tensor_model_parallel_size=4",
    f"{A}.megatron.pipeline_model_parallel_size=2",
]


def test_megatron_launch_that_cannot_fit_is_refused_with_the_figure_and_what_fits(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # --config-name: verl's packaged name
    model = _model(tmp_path, "Qwen2.5-32B")
    with pytest.raises(ConfigError) as e:
        check_before_weights(_load(_launch(model, tmp_path, *MEGATRON)), str(model))
    text = str(e.value)
    assert "this Megatron launch, run on FSDP2 over 8 GPU(s), is predicted to need" in text
    need = float(re.search(r"need ([0-9.]+) GiB per GPU in the update phase", text).group(1))
    assert need > 80 and "a GPU holds 80 (trainer.gpu_memory_gib, no GPU visible)" in text
    fits = text.split("settings predicted to fit: ")[1]
    assert f"{A}.fsdp_config.offload_policy=True" in fits and "actor_rollout_ref.model.lora_rank=64" in fits
    for suggested in fits.removesuffix(". `klppo tune <same arguments> --dry-run` shows each term").split(
        "; or "
    ):
        overrides = suggested.rsplit(" (", 1)[0].split()
        check_translated_memory(
            _load(_launch(model, tmp_path, *MEGATRON, *overrides)), config_from_shape("Qwen2.5-32B")
        )
    # a larger GPU (the key, without a GPU visible) holds it; the same layout written for FSDP is not refused
    check_translated_memory(
        _load(_launch(model, tmp_path, *MEGATRON, "trainer.gpu_memory_gib=141")),
        config_from_shape("Qwen2.5-32B"),
    )
    check_translated_memory(_load(_launch(model, tmp_path)), config_from_shape("Qwen2.5-32B"))


def test_nothing_fits_names_more_gpus(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _model(tmp_path, "Qwen2.5-72B")
    argv = _launch(model, tmp_path, *MEGATRON, "trainer.n_gpus_per_node=1", "data.train_batch_size=8")
    with pytest.raises(
        ConfigError,
        match=r"over 1 GPU\(s\).*no offload, Ulysses or LoRA setting is predicted "
        r"to fit: more GPUs \(trainer.n_gpus_per_node, trainer.nnodes\)",
    ):
        check_translated_memory(_load(argv), config_from_shape("Qwen2.5-72B"))


def test_ulysses_size_that_does_not_split_the_heads_is_refused_naming_its_key(tmp_path, monkeypatch):
    """Qwen2.5-0.5B: 14 query heads, 2 KV heads; 4 does not divide 14."""
    monkeypatch.chdir(tmp_path)
    model = _model(tmp_path, "Qwen2.5-0.5B")
    cp = f"{A}.megatron.context_parallel_size=4"
    with pytest.raises(ConfigError) as e:
        check_before_weights(
            _load(_launch(model, tmp_path, "--config-name=ppo_megatron_trainer", cp)), str(model)
        )
    assert str(e.value).startswith(
        f"{A}.ulysses_sequence_parallel_size=4 (from Megatron's {cp}, context "
        "parallelism run as Ulysses) does not split the model's attention heads"
    )
    assert str(e.value).endswith("sizes that fit this model on 8 GPUs: 1, 2")
    direct = _launch(
        model,
        tmp_path,
        f"{A}.ulysses_sequence_parallel_size=4",
        "critic.ulysses_sequence_parallel_size=2",
        "algorithm.adv_estimator=gae",
        f"critic.model.path={model}",
    )
    with pytest.raises(ConfigError, match=rf"^{A}.ulysses_sequence_parallel_size=4 does not split"):
        check_before_weights(_load(direct), str(model))
    check_before_weights(_load(direct[:-4] + direct[-3:]), str(model))  # the critic's 2 splits 14 heads
    with pytest.raises(ConfigError, match=r"^critic.ulysses_sequence_parallel_size=4 does not split"):
        check_before_weights(
            _load([*direct[:-4], "critic.ulysses_sequence_parallel_size=4", *direct[-2:]]), str(model)
        )
