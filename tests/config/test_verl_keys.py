"""verl's current key tree and hydra's command-line conventions (issue 14): every key has an entry, the
result-changing ones are refused, packaged config names, `+`/`++`/`~`, null, boolean frequencies (Megatron:
test_megatron.py)."""

from __future__ import annotations

import fnmatch

import pytest
import yaml

from klppo.config import ConfigError, check_trainable, config_to_yaml, load_config, warn_unimplemented
from klppo.config._walk import all_keys, lookup
from klppo.config.schema import KLPPOConfig
from klppo.config.unimplemented import _expanded

Q = {"notify": lambda _m: None}

# the groups of verl's current trainer config (the list) that klppo lacked: each must be a key
NEW_KEYS = (
    "reward_model.use_reward_loop",
    "reward_model.rollout.name",
    "reward_model.num_workers",
    "reward_model.reward_loop_source",
    "reward_model.reward_loop_module_path",
    "reward_model.reward_loop_class_name",
    "reward_model.n_gpus_per_node",
    "reward_model.nnodes",
    "reward_model.enable_resource_pool",
    "reward_model.model.override_config",
    "reward_manager.source",
    "reward_manager.name",
    "reward_manager.module.path",
    "algorithm.rollout_correction.rollout_is",
    "algorithm.rollout_correction.rollout_rs_threshold",
    "algorithm.rollout_correction.bypass_mode",
    "actor_rollout_ref.rollout.prometheus.enable",
    "actor_rollout_ref.rollout.checkpoint_engine.backend",
    "actor_rollout_ref.rollout.mtp",
    "actor_rollout_ref.model.mtp.enable",
    "actor_rollout_ref.actor.tau_pos",
    "actor_rollout_ref.actor.tau_neg",
    "actor_rollout_ref.actor.use_prefix_grouper",
    "actor_rollout_ref.actor.calculate_sum_pi_squared",
    "actor_rollout_ref.actor.sum_pi_squared_checkpointing",
    "actor_rollout_ref.actor.freeze_vision_tower",
    "actor_rollout_ref.actor.router_replay.mode",
    "actor_rollout_ref.ref.router_replay.mode",
    "actor_rollout_ref.model.tiled_mlp.enabled",
    "critic.model.tiled_mlp.num_shards",
    "actor_rollout_ref.model.hf_config_path",
    "transfer_queue.enable",
    "actor_rollout_ref.rollout.enable_rollout_routing_replay",
    "actor_rollout_ref.rollout.quantization_config_file",
    "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",
    "data.tool_config_path",
    "data.image_patch_size",
)
MUST_REFUSE = (
    "actor_rollout_ref.actor.tau_pos",
    "actor_rollout_ref.actor.tau_neg",
    "actor_rollout_ref.actor.use_prefix_grouper",
    "actor_rollout_ref.actor.calculate_sum_pi_squared",
    "*.router_replay.*",
    "actor_rollout_ref.rollout.mtp",
    "actor_rollout_ref.model.mtp.*",
)


def _effects() -> dict[str, str]:
    return {k: e for k, e, _ in _expanded()}


def test_new_verl_keys_are_schema_keys():
    for key in NEW_KEYS:
        assert lookup(KLPPOConfig, key.split("."))[0] in ("leaf", "group"), key


def test_result_changing_keys_are_refused_never_warned():
    effects = _effects()
    for pattern in MUST_REFUSE:
        hits = [k for k in all_keys(KLPPOConfig) if fnmatch.fnmatchcase(k, pattern)]
        leaves = [k for k in hits if lookup(KLPPOConfig, k.split("."))[0] == "leaf"]
        assert leaves, pattern
        for key in leaves:
            assert effects.get(key) == "refuse", (key, effects.get(key))


@pytest.mark.parametrize(
    "arg",
    [
        "actor_rollout_ref.actor.tau_neg=1.2",
        "actor_rollout_ref.actor.use_prefix_grouper=true",
        "actor_rollout_ref.actor.calculate_sum_pi_squared=true",
        "actor_rollout_ref.actor.router_replay.mode=R3",
        "actor_rollout_ref.model.mtp.enable=true",
        "reward_manager.source=importlib",
        "actor_rollout_ref.actor.freeze_vision_tower=true",
        "actor_rollout_ref.model.hf_config_path=/x",
        "reward_model.reward_loop_source=importlib",
        "reward_model.sandbox_fusion.url=http://localhost:8080/run_code",
        "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
    ],
)
def test_each_refused_key_is_named_by_train(arg):
    cfg = load_config([arg], **Q)  # klppo config accepts it
    with pytest.raises(ConfigError) as e:
        check_trainable(cfg, notify=lambda _m: None)
    assert (
        arg.split("=")[0] in str(e.value) and "not built" in str(e.value) or "not supported" in str(e.value)
    )


def test_speed_only_and_inert_new_keys_run_with_one_line_each():
    cfg = load_config(
        [
            "actor_rollout_ref.model.tiled_mlp.enabled=true",
            "reward_model.rollout.gpu_memory_utilization=0.8",
            "transfer_queue.enable=true",
            "actor_rollout_ref.rollout.prometheus.enable=true",
            "reward_model.use_reward_loop=false",
            "actor_rollout_ref.rollout.checkpoint_engine.backend=nccl",
        ],
        **Q,
    )
    notes: list[str] = []
    check_trainable(cfg, notify=notes.append)
    assert len(notes) == 3 and "tiled_mlp.enabled" in notes[0] and "reward_model.rollout" in notes[1]
    assert "transfer_queue.enable" in notes[2]
    lines = warn_unimplemented(cfg, notify=lambda _m: None)
    assert len(lines) == 3 and "checkpoint_engine.backend" in lines[0] and "prometheus.enable" in lines[1]
    assert "use_reward_loop" in lines[2]


def test_verl_style_file_with_targets_missing_markers_and_new_groups(tmp_path):
    """A file written the way verl's generated config is: `_target_` hints (also inside mapping values),
    `???` for required values, verl's long dtype names, the new groups at their defaults."""
    f = tmp_path / "verl_like.yaml"
    f.write_text(
        "actor_rollout_ref:\n  rollout:\n    _target_: x.RolloutConfig\n    name: ???\n    dtype: bfloat16\n"
        "    mtp: ${oc.select:actor_rollout_ref.model.mtp, null}\n"
        "    prometheus: {_target_: x.P, enable: false, port: 9090}\n"
        "  actor:\n    profiler:\n      tool_config:\n        nsys: {_target_: x.N, discrete: false}\n"
        "    router_replay: {_target_: x.R, mode: disabled, record_file: null}\n"
        "reward_manager:\n  _target_: x.RM\n  source: register\n  name: "
        "${oc.select:reward_model.reward_manager,naive}\n"
        "reward_model:\n  rollout:\n    _target_: x.RC\n    name: ???\n    dtype: bfloat16\n"
        "algorithm:\n  rollout_correction: {rollout_is: null, rollout_rs_threshold: null}\n"
        "transfer_queue: {enable: false}\n"
    )
    cfg = load_config([str(f)], **Q)
    assert cfg.actor_rollout_ref.rollout.name == "klppo"  # ??? leaves the default
    assert cfg.actor_rollout_ref.actor.profiler.tool_config == {"nsys": {"discrete": False}}
    assert cfg.actor_rollout_ref.rollout.mtp == {**load_config([], **Q).actor_rollout_ref.rollout.mtp}
    check_trainable(cfg, notify=lambda _m: None)  # nothing result-changing in it
    assert cfg.reward_manager.name == "naive"
    cfg = load_config([str(f), "reward_manager.name=dapo"], **Q)
    assert (cfg.reward_model.reward_manager, cfg.reward_manager.name) == ("dapo", "dapo")


@pytest.mark.parametrize("name", ["ppo_trainer", "ppo_trainer.yaml", "_generated_ppo_trainer"])
def test_packaged_ppo_config_names_are_klppo_defaults(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no ./config/<name> here: verl's packaged name
    notes: list[str] = []
    cfg = load_config(
        [
            "--config-path=config",
            f"--config-name={name}",
            "data.train_batch_size=64",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        ],
        notify=notes.append,
    )
    plain = load_config(["data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=16"], **Q)
    assert config_to_yaml(cfg) == config_to_yaml(plain)
    assert len(notes) == 1 and "packaged" in notes[0]


def test_non_ppo_packaged_config_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="sft_trainer.*PPO only"):
        load_config(["--config-name=sft_trainer"], **Q)


def test_hydra_append_force_and_delete():
    notes: list[str] = []
    cfg = load_config(
        [
            "+data.gen_batch_size=256",
            "++trainer.seed=5",
            "+actor_rollout_ref.model.override_config.attention_dropout=0.0",
        ],
        notify=notes.append,
    )
    assert cfg.trainer.seed == 5
    assert cfg.actor_rollout_ref.model.override_config == {"attention_dropout": 0.0}
    assert len(notes) == 1 and "data.gen_batch_size" in notes[0] and "ignored" in notes[0]
    with pytest.raises(ConfigError, match="unknown key 'data.gen_batch_size'"):
        load_config(["data.gen_batch_size=256"], **Q)  # without + an unknown key stays an error
    cfg = load_config(
        [
            "data.train_batch_size=64",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "~data.train_batch_size=64",
            "~actor_rollout_ref.actor.ppo_mini_batch_size",
        ],
        **Q,
    )
    assert (cfg.data.train_batch_size, cfg.actor_rollout_ref.actor.ppo_mini_batch_size) == (1024, 256)
    with pytest.raises(ConfigError, match="unknown key 'trainer.nope'"):
        load_config(["~trainer.nope"], **Q)


def test_null_where_verl_allows_it():
    cfg = load_config(
        [
            "custom_reward_function.name=null",
            "actor_rollout_ref.actor.optim.lr_warmup_steps=null",
            "algorithm.kl_ctrl.target_kl=null",
        ],
        **Q,
    )
    assert cfg.custom_reward_function.name is None and cfg.algorithm.kl_ctrl.target_kl is None
    assert cfg.actor_rollout_ref.actor.optim.lr_warmup_steps is None
    with pytest.raises(
        ConfigError, match="custom_reward_function.path='r.py' needs custom_reward_function.name"
    ):
        load_config(["custom_reward_function.path=r.py", "custom_reward_function.name=null"], **Q)
    with pytest.raises(ConfigError, match="algorithm.kl_ctrl.target_kl=None"):
        load_config(["algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.target_kl=null"], **Q)
    with pytest.raises(ConfigError, match="data.max_prompt_length=null"):
        load_config(["data.max_prompt_length=null"], **Q)  # not optional in verl either


def test_boolean_frequencies_read_as_verl_reads_them(run_cli):
    rc, out, err = run_cli(["trainer.test_freq=False", "trainer.save_freq=True"])
    assert rc == 0, err
    tree = yaml.safe_load(out)["trainer"]
    assert (tree["test_freq"], tree["save_freq"]) == (-1, 1)
    assert "trainer.test_freq=False is read as trainer.test_freq=-1" in err
    rc, _, err = run_cli(["trainer.total_epochs=False"])
    assert rc == 2 and "trainer.total_epochs" in err


def test_config_prints_the_inert_key_lines(run_cli):
    rc, out, err = run_cli(["actor_rollout_ref.rollout.max_num_seqs=256"])
    assert rc == 0 and "max_num_seqs: 256" in out
    assert "actor_rollout_ref.rollout.max_num_seqs=256 is accepted but has no effect yet" in err


def test_unparsable_yaml_is_one_line_naming_the_file(tmp_path):
    f = tmp_path / "broken.yaml"
    f.write_text("trainer: {total_epochs: ???}\n")
    with pytest.raises(ConfigError, match="broken.yaml: not a readable YAML mapping"):
        load_config([str(f)], **Q)


def test_a_hydra_composed_file_adds_keys_a_plain_file_may_not(tmp_path):
    f = tmp_path / "composed.yaml"
    f.write_text(
        "defaults:\n  - ppo_trainer\n  - _self_\nactor_rollout_ref:\n  rollout:\n"
        "    sglang_rollout_mode: async\n    name: trtllm\n"
    )
    notes: list[str] = []
    cfg = load_config([str(f)], notify=notes.append)
    assert cfg.actor_rollout_ref.rollout.name == "klppo"
    assert sum("actor_rollout_ref.rollout.sglang_rollout_mode" in n and "ignored" in n for n in notes) == 1
    f.write_text("actor_rollout_ref:\n  rollout:\n    sglang_rollout_mode: async\n")
    with pytest.raises(ConfigError, match="unknown key 'actor_rollout_ref.rollout.sglang_rollout_mode'"):
        load_config([str(f)], **Q)


@pytest.mark.parametrize("key", ["trainer.device", "global_profiler.tool"])
def test_npu_values_are_refused_by_name(key):
    with pytest.raises(ConfigError, match=rf"^{key}='npu': .*NPU.* not supported"):
        load_config([f"{key}=npu"], **Q)


def test_a_batched_reward_function_is_refused_several_scoring_processes():
    """reward_manager=batch scores the whole batch in one call; background slices would split it."""
    base = [
        "reward_model.reward_manager=batch",
        "custom_reward_function.path=f.py",
        "reward_model.launch_reward_fn_async=True",
    ]
    with pytest.raises(
        ConfigError, match=r"reward_model.num_workers=2 with reward_manager='batch'.*num_workers=1"
    ):
        check_trainable(load_config([*base, "reward_model.num_workers=2"]), notify=lambda _m: None)
    check_trainable(load_config(base), notify=lambda _m: None)  # one process: the whole batch
    check_trainable(
        load_config(
            [
                *base[:2],
                "reward_model.launch_reward_fn_async=True",
                "reward_model.reward_manager=naive",
                "reward_model.num_workers=2",
            ]
        ),
        notify=lambda _m: None,
    )
