"""The public API: frozen typed tree, defaults file, check_trainable, warn_unimplemented, ranges."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from klppo.config import (
    ConfigError,
    KLPPOConfig,
    check_trainable,
    config_to_yaml,
    load_config,
    warn_unimplemented,
)
from klppo.config.unimplemented import UNIMPLEMENTED

Q = {"notify": lambda _m: None}
DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_tree_is_typed_frozen_and_uses_verl_names():
    cfg = load_config([], **Q)
    assert isinstance(cfg, KLPPOConfig)
    assert (
        cfg.actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params == "auto"
    )  # klppo: one unit on one process (verl: 0)
    assert cfg.algorithm.kl_ctrl.type == "fixed"
    assert cfg.trainer.logger == ["console", "jsonl"]
    assert (cfg.trainer.device, cfg.trainer.n_gpus_per_node, cfg.trainer.seed) == ("auto", "auto", 1)
    assert cfg.data.bad_row_policy == "skip" and cfg.trainer.max_nan_steps == 3
    assert cfg.actor_rollout_ref.actor.fsdp_config.model_dtype == "fp32"
    assert cfg.actor_rollout_ref.rollout.name == "klppo"
    assert cfg.trainer.default_local_dir == "checkpoints/verl_examples/gsm8k"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.trainer.seed = 2  # type: ignore[misc]
    assert isinstance(load_config(["trainer.n_gpus_per_node=4"], **Q).trainer.n_gpus_per_node, int)


def test_packaged_yaml_equals_schema_defaults():
    from importlib import resources

    shipped = yaml.safe_load(resources.files("klppo.config").joinpath("ppo_trainer.yaml").read_text())
    schema = OmegaConf.to_container(OmegaConf.structured(KLPPOConfig), resolve=False)
    assert shipped == schema, "regenerate with: python -m klppo.config.docgen"


def test_interpolations_follow_unless_set():
    cfg = load_config(
        [
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
            "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=2048",
        ],
        **Q,
    )
    assert cfg.actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu == 4096
    assert cfg.actor_rollout_ref.ref.log_prob_max_token_len_per_gpu == 2048
    with pytest.raises(ConfigError, match="interpolation"):
        load_config(["trainer.experiment_name=${trainer.nope}"], **Q)


def test_ranges_and_cross_checks():
    for arg, part in [
        ("actor_rollout_ref.rollout.gpu_memory_utilization=1.5", "in [0.01, 1]"),
        ("actor_rollout_ref.rollout.n=0", "≥ 1"),
        ("trainer.resume_mode=resume_path", "resume_from_path"),
        ("data.bad_row_policy=ignore", "skip, error"),
        ("critic.enable=false", "needs a critic"),
        ("algorithm.kl_ctrl.target_kl=0", "target > 0"),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config([arg, "algorithm.kl_ctrl.type=adaptive"] if "target_kl" in arg else [arg], **Q)
        assert arg.split("=")[0] in str(e.value) and part in str(e.value)


def test_check_trainable_refuses_result_changing_values_and_notes_speed_only(issue_list):
    cfg = load_config(issue_list, **Q)
    notes: list[str] = []
    check_trainable(cfg, notify=notes.append)  # ulysses_sequence_parallel_size=2 included
    assert not any("tensor_model_parallel_size" in n for n in notes)  # tensor-parallel rollout is built
    check_trainable(load_config(["actor_rollout_ref.model.lora_rank=8", "critic.model.lora_rank=8"], **Q))
    with pytest.raises(ConfigError, match="adv_estimator='optimal_token_baseline'"):
        check_trainable(load_config(["algorithm.adv_estimator=optimal_token_baseline"], **Q))
    check_trainable(load_config([], **Q), notify=notes.append)  # defaults train


def test_check_trainable_refuses_what_ulysses_cannot_run_with(issue_list):
    for extra, key in [
        (["actor_rollout_ref.model.use_remove_padding=False"], "actor_rollout_ref.model.use_remove_padding"),
        (
            ["algorithm.adv_estimator=gae", "critic.ulysses_sequence_parallel_size=2"],
            "critic.model.use_remove_padding",
        ),
        (["actor_rollout_ref.actor.kl_loss_type=full"], "kl_loss_type='full'"),
        (["reward_model.ulysses_sequence_parallel_size=2"], "reward_model.ulysses_sequence_parallel_size=2"),
    ]:
        with pytest.raises(ConfigError) as e:
            check_trainable(load_config(issue_list + extra, **Q), notify=lambda _m: None)
        assert key in str(e.value), (extra, str(e.value))
    check_trainable(
        load_config(
            issue_list
            + [
                "algorithm.adv_estimator=gae",
                "critic.ulysses_sequence_parallel_size=2",
                "critic.model.use_remove_padding=True",
            ],
            **Q,
        ),
        notify=lambda _m: None,
    )


def test_warn_unimplemented_only_for_non_defaults(issue_list):
    assert warn_unimplemented(load_config([], **Q), notify=lambda _m: None) == []
    lines = warn_unimplemented(load_config(issue_list, **Q), notify=lambda _m: None)
    assert lines == []  # the list's only unimplemented key was global_profiler.steps, now honoured
    lines = warn_unimplemented(
        load_config(issue_list + ["actor_rollout_ref.actor.profiler.enable=True"], **Q),
        notify=lambda _m: None,
    )
    assert len(lines) == 1 and "actor_rollout_ref.actor.profiler" in lines[0] and "no effect yet" in lines[0]


def test_unimplemented_table_is_documented():
    doc = DOC.read_text()
    assert "accepted, no effect yet" in doc
    for pattern, _effect, _reason in UNIMPLEMENTED:
        assert f"`{pattern}`" in doc, pattern


def test_docs_are_current():
    from klppo.config.docgen import render_docs

    assert DOC.read_text() == render_docs(), "regenerate: python -m klppo.config.docgen"


def test_config_to_yaml_is_plain():
    text = config_to_yaml(load_config([], **Q))
    assert "${" not in text and "_target_" not in text
    assert yaml.safe_load(text)["trainer"]["logger"] == ["console", "jsonl"]


@pytest.mark.parametrize("overrides", [[], "issue_list"])
def test_defaults_come_from_the_schema_alone(overrides, issue_list):
    """The packaged ppo_trainer.yaml is documentation: loading it as a user file changes no byte of the
    printed configuration, for the defaults and for the issue's parameter list."""
    from importlib import resources

    args = issue_list if overrides == "issue_list" else []
    with resources.as_file(resources.files("klppo.config").joinpath("ppo_trainer.yaml")) as shipped:
        via_file = config_to_yaml(load_config([str(shipped), *args], **Q))
    assert config_to_yaml(load_config(args, **Q)) == via_file
