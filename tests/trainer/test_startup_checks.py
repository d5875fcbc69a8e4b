"""What `klppo train` (and its --dry-run) checks before any weight loads (issue 14): logger backends,
text-only data, run directory and one checkpoint's disk space; the data limits, critic warm-up as verl,
enforce_eager. Each failure is one line naming the key or file."""

from __future__ import annotations

import importlib.util
import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klppo.assembly import startup_checks
from klppo.config import ConfigError, load_config
from tests.trainer.utils import base_overrides

Q = {"notify": lambda _m: None}


def _cfg(tiny_model_dir, arithmetic_data, tmp_path, *extra):
    return load_config(base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + list(extra), **Q)


def test_logger_backends_are_checked_by_name(tiny_model_dir, arithmetic_data, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "wandb" else real(m, *a))
    cfg = _cfg(tiny_model_dir, arithmetic_data, tmp_path, "trainer.logger=[console,wandb]")
    with pytest.raises(ConfigError) as e:
        startup_checks.check_loggers(cfg)
    assert "trainer.logger includes 'wandb'" in str(e.value) and "pip install wandb" in str(e.value)
    with pytest.raises(ConfigError, match="'clearml', which klppo does not build"):
        startup_checks.check_loggers(
            _cfg(tiny_model_dir, arithmetic_data, tmp_path, "trainer.logger=[clearml]")
        )
    startup_checks.check_loggers(
        _cfg(tiny_model_dir, arithmetic_data, tmp_path, "trainer.logger=[console,jsonl]")
    )


def _write(path, prompts, **columns):
    pq.write_table(pa.table({"prompt": prompts, **columns}), path)
    return str(path)


def test_image_and_video_data_are_refused_naming_the_key(tiny_model_dir, arithmetic_data, tmp_path):
    chat = [[{"role": "user", "content": "What is 1 + 1?"}]] * 3
    with_images = _write(tmp_path / "vl.parquet", chat, images=[[b"x"]] * 3)
    cfg = _cfg(tiny_model_dir, arithmetic_data, tmp_path, f"data.train_files={with_images}")
    with pytest.raises(ConfigError) as e:
        startup_checks.check_text_only(cfg)
    assert "vl.parquet has a 'images' column (data.image_key)" in str(e.value)
    videos = _write(tmp_path / "v.parquet", chat, clips=[[b"x"]] * 3)
    with pytest.raises(ConfigError, match=r"'clips' column \(data.video_key\)"):
        startup_checks.check_text_only(
            _cfg(
                tiny_model_dir, arithmetic_data, tmp_path, f"data.val_files={videos}", "data.video_key=clips"
            )
        )
    tagged = chat[:2] + [[{"role": "user", "content": "<image>What is drawn?"}]]
    with pytest.raises(ConfigError, match=r"tag.parquet row 2: the prompt \(prompt\) holds a <image>"):
        startup_checks.check_text_only(
            _cfg(
                tiny_model_dir,
                arithmetic_data,
                tmp_path,
                f"data.train_files={_write(tmp_path / 'tag.parquet', tagged)}",
            )
        )
    startup_checks.check_text_only(_cfg(tiny_model_dir, arithmetic_data, tmp_path))  # the text set passes


def test_checkpoint_roles_from_the_config(tiny_model_dir, arithmetic_data, tmp_path):
    """The trained roles and the keys that size a checkpoint (the sizes: tests/tune/test_disk.py)."""
    grpo = _cfg(tiny_model_dir, arithmetic_data, tmp_path, "algorithm.adv_estimator=grpo")
    (actor,) = startup_checks.disk_roles(grpo, str(tiny_model_dir))
    assert (actor.name, actor.model_dtype, actor.lora_rank, actor.optimizer) == ("actor", "fp32", 0, "AdamW")
    assert actor.files_bytes > 0  # the tokenizer and the configs
    lora = _cfg(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.model.lora_rank=8",
        "critic.model.fsdp_config.model_dtype=bf16",
    )
    actor, critic = startup_checks.disk_roles(lora, str(tiny_model_dir))
    assert actor.lora_rank == 8 and (critic.name, critic.model_dtype, critic.lora_rank) == (
        "critic",
        "bf16",
        0,
    )


def test_run_dir_writable_and_disk_space(tiny_model_dir, arithmetic_data, tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    cfg = _cfg(tiny_model_dir, arithmetic_data, tmp_path, f"trainer.default_local_dir={blocker}/run")
    roles = startup_checks.disk_roles(cfg, str(tiny_model_dir))
    with pytest.raises(
        ConfigError, match=r"trainer.default_local_dir=.*a_file/run: .*a_file is not a writable"
    ):
        startup_checks.check_run_dir(cfg, roles)
    cfg = _cfg(
        tiny_model_dir, arithmetic_data, tmp_path, "trainer.save_freq=5", "trainer.total_training_steps=50"
    )
    line = startup_checks.check_run_dir(cfg, roles)
    assert (
        line.startswith("checkpoint: about ")
        and "MiB each (actor " in line
        and ", critic " in line
        and "GiB free" in line
    )
    need = startup_checks.disk.checkpoint_size(roles).total
    monkeypatch.setattr(startup_checks.shutil, "disk_usage", lambda _p: SimpleNamespace(free=1000))
    with pytest.raises(
        ConfigError, match=r"one checkpoint needs about .* are free .*save_freq=5.*free space"
    ):
        startup_checks.check_run_dir(cfg, roles)
    monkeypatch.setattr(startup_checks.shutil, "disk_usage", lambda _p: SimpleNamespace(free=0.9 * need))
    with pytest.raises(
        ConfigError, match=r"predicted to fit: actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"
    ):
        startup_checks.check_run_dir(cfg, roles)
    startup_checks.check_run_dir(_cfg(tiny_model_dir, arithmetic_data, tmp_path), roles)  # save_freq=-1
    # room for two: every checkpoint kept is a warning, keeping one (two on disk while writing) is not
    monkeypatch.setattr(startup_checks.shutil, "disk_usage", lambda _p: SimpleNamespace(free=2.5 * need))
    line = startup_checks.check_run_dir(cfg, roles)
    assert "room for 2 checkpoint(s)" in line and "set trainer.max_actor_ckpt_to_keep=1" in line
    assert "a later save may run out of space" in caplog.text
    keep_one = _cfg(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        "trainer.save_freq=5",
        "trainer.total_training_steps=50",
        "trainer.max_actor_ckpt_to_keep=1",
    )
    assert "room for" not in startup_checks.check_run_dir(keep_one, roles)
    one_save = _cfg(
        tiny_model_dir, arithmetic_data, tmp_path, "trainer.save_freq=5", "trainer.total_training_steps=5"
    )
    assert "room for" not in startup_checks.check_run_dir(one_save, roles)


def test_dry_run_runs_the_checks_and_prints_inert_keys(
    tiny_model_dir, arithmetic_data, tmp_path, capsys, monkeypatch
):
    from klppo.commands.train import main

    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run")
    assert main(["--dry-run", *overrides, "actor_rollout_ref.rollout.max_num_seqs=256"]) == 0
    out, err = capsys.readouterr()
    assert "checkpoint: about" in out
    assert "actor_rollout_ref.rollout.max_num_seqs=256 is accepted but has no effect yet" in err
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "wandb" else real(m, *a))
    assert main(["--dry-run", *overrides, "trainer.logger=[console,wandb]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("klppo: trainer.logger includes 'wandb'")


def test_dry_run_loads_the_tool_and_interaction_configs(tiny_model_dir, arithmetic_data, tmp_path, capsys):
    """verl's GSM8K tool and interaction load (mapped to klppo's); a verl class klppo does not ship is one
    line each, named once though the data check reads the tool config too."""
    from klppo.commands.train import main

    tools, interactions = tmp_path / "tools.yaml", tmp_path / "interactions.yaml"
    tools.write_text("tools:\n  - class_name: verl.tools.gsm8k_tool.Gsm8kTool\n    config: {type: native}\n")
    interactions.write_text(
        "interaction:\n  - name: gsm8k\n"
        "    class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction\n"
    )
    multi_turn = "actor_rollout_ref.rollout.multi_turn."
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        f"{multi_turn}enable=True",
        f"{multi_turn}tool_config_path={tools}",
        f"{multi_turn}interaction_config_path={interactions}",
    ]
    assert main(["--dry-run", *overrides]) == 0
    capsys.readouterr()
    tools.write_text("tools:\n  - class_name: verl.tools.search_tool.SearchTool\n")
    interactions.write_text(
        "interaction:\n  - class_name: verl.interactions.collabllm_interation.CollabLLMInteraction\n"
    )
    assert main(["--dry-run", *overrides]) == 2
    err = capsys.readouterr().err
    assert "klppo: 2 problems, nothing started:" in err, err
    assert f"1. tool config {tools}: verl.tools.search_tool.SearchTool is not supported: it needs a " in err
    assert "2. interaction config" in err and "CollabLLMInteraction is not supported: it needs a user" in err


def test_max_samples_limit_the_rows(tiny_model_dir, arithmetic_data, tmp_path):
    from klppo.assembly.data_check import build_loaders
    from klppo.models.loading import load_tokenizer

    tok = load_tokenizer(str(tiny_model_dir))
    cfg = _cfg(
        tiny_model_dir, arithmetic_data, tmp_path, "data.train_max_samples=8", "data.val_max_samples=3"
    )
    train, val = build_loaders(cfg, tok)
    assert (train.stats.num_rows, len(train)) == (8, 2)  # 64 rows, batch 4: 2 steps per epoch, not 16
    assert val.stats.num_rows == 3
    train, _ = build_loaders(_cfg(tiny_model_dir, arithmetic_data, tmp_path), tok)
    assert len(train) == 16


def test_engine_settings_from_enforce_eager_sampler_and_decode_attention():
    from klppo.assembly.settings import engine_settings

    def settings(*overrides, **kwargs):
        return engine_settings(load_config(list(overrides), **Q).actor_rollout_ref.rollout, **kwargs)

    eager = settings("actor_rollout_ref.rollout.enforce_eager=true")
    assert (eager.cuda_graphs, eager.compile_decode) == (False, False)
    default = settings()
    assert (default.cuda_graphs, default.compile_decode, default.sampler, default.decode_attention) == (
        True,
        None,
        "auto",
        "auto",
    )
    assert default.compact_slots is True and default.eos_token_ids == ()
    assert settings("actor_rollout_ref.rollout.sampler=torch").sampler == "torch"
    assert settings("actor_rollout_ref.rollout.decode_attention=sdpa").decode_attention == "sdpa"
    assert settings(eos_token_ids=[2, 7], pad_token_id=2).eos_token_ids == (2, 7)
    assert settings("actor_rollout_ref.rollout.compact_slots=false").compact_slots is False
    # auto: off under a tensor-parallel rollout (never run so on GPUs), where true turns it on
    tp2 = "actor_rollout_ref.rollout.tensor_model_parallel_size=2"
    assert settings(tp2).compact_slots is False
    assert settings(tp2, "actor_rollout_ref.rollout.compact_slots=true").compact_slots is True
    # as built: a configured size the run cannot build (LoRA) leaves the rollout data-parallel, compacting
    assert settings(tp2, tensor_parallel=False).compact_slots is True
    assert settings(tp2, tensor_parallel=True).compact_slots is False
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.compact_slots='sometimes'"):
        settings("actor_rollout_ref.rollout.compact_slots=sometimes")
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.compact_slots=true is klppo's"):
        settings("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.compact_slots=true")
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.decode_attention"):
        settings("actor_rollout_ref.rollout.decode_attention=splitkv")
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.decode_attention=sdpa is klppo's"):
        settings("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.decode_attention=sdpa")
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.sampler"):
        settings("actor_rollout_ref.rollout.sampler=cuda")
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.sampler=torch is klppo's"):
        settings("actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.sampler=torch")
    with pytest.raises(ConfigError, match="actor_rollout_ref.rollout.layer_kernels"):
        settings("actor_rollout_ref.rollout.layer_kernels=inductor")


@pytest.mark.parametrize(
    ("key", "value", "instead"),
    [
        ("sampler", "triton", "set auto"),
        ("decode_attention", "triton", "set auto"),
        ("decode_attention", "flash", "or sdpa"),
        ("decode_attention", "flash-plain", "or sdpa"),
        ("layer_kernels", "triton", "set auto"),
        ("layer_kernels", "compile", "set auto"),
    ],
)
def test_engine_values_without_a_path_are_refused_with_what_to_set(key, value, instead):
    """Values of the klppo engine's settings whose path does not exist are refused by name, saying what to
    set instead (never mapped to another value)."""
    with pytest.raises(
        ConfigError, match=f"actor_rollout_ref.rollout.{key}='{value}' is not a choice.*{instead}"
    ):
        load_config([f"actor_rollout_ref.rollout.{key}={value}"], **Q)


def test_critic_warmup_as_verl(tiny_model_dir, arithmetic_data, tmp_path):
    from klppo.trainer.ppo_trainer import updates_actor
    from tests.trainer.utils import run_training

    assert [updates_actor(s, 2) for s in (1, 2, 3)] == [False, True, True]  # verl: critic_warmup <= step
    assert updates_actor(1, 0) and updates_actor(1, 1)
    run = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, arithmetic_data, run) + [
        "algorithm.adv_estimator=gae",
        "trainer.critic_warmup=2",
        "trainer.total_training_steps=2",
    ]
    run_training(overrides)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    by_step = {d["step"]: d for d in lines}
    assert any(k.startswith("critic/") for k in by_step[1])
    assert not any(k.startswith("actor/pg") for k in by_step[1])
    assert any(k.startswith("actor/pg") for k in by_step[2])


def test_compiled_layers_are_advised_where_they_could_run_and_only_there():
    """On a GPU the pre-flight names ``compile_packed_layers`` for each role that packs without it (actor
    and reference; the critic only in a run with one), not where it is set, not without packing or with
    Ulysses (where it is refused)."""
    from klppo.config.checks import compiled_layers_advice

    def advice(*over):
        return compiled_layers_advice(load_config(list(over), **Q))

    [actor] = advice()
    assert (
        actor.startswith("actor_rollout_ref.model.compile_packed_layers=True") and "Compiled passes" in actor
    )
    assert advice("actor_rollout_ref.model.compile_packed_layers=True") == []
    assert advice("actor_rollout_ref.model.use_remove_padding=False") == []
    assert advice("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2") == []
    gae = [
        "algorithm.adv_estimator=gae",
        "critic.enable=True",
        "critic.model.use_remove_padding=True",
        "actor_rollout_ref.model.compile_packed_layers=True",
    ]
    [critic] = advice(*gae)
    assert critic.startswith("critic.model.compile_packed_layers=True") and "peak memory" in critic
    assert advice(*gae, "critic.model.compile_packed_layers=True") == []
    assert advice(*gae[:-2], "actor_rollout_ref.model.compile_packed_layers=True") == []  # critic unpacked


def test_background_scoring_is_advised_where_reward_functions_score_in_the_step():
    """verl's default (the reward function in the step) gets the key named, with the guide section; not when
    it is set, not with a reward model (which scores on the device in the step)."""
    from klppo.config.checks import background_scoring_advice

    line = background_scoring_advice(load_config([], **Q))
    assert (
        line.startswith("reward_model.launch_reward_fn_async=True decodes")
        and "docs/training.md, 'Rewards'" in line
    )
    assert background_scoring_advice(load_config(["reward_model.launch_reward_fn_async=True"], **Q)) is None
    rm = ["reward_model.enable=True", "reward_model.model.path=/some/rm"]
    assert background_scoring_advice(load_config(rm, **Q)) is None


def test_the_critic_is_advised_the_actors_token_budget_where_it_cuts_its_mini_batch_finer():
    """GAE with token budgets: a critic budget under the actor's, over which its mini-batch runs as several
    micro-batches, gets the actor's budget advised; not when equal or larger, not when one micro-batch
    holds the mini-batch, not without a critic or token budgets, not for a critic on another model."""
    from klppo.config.checks import critic_budget_advice

    gae = [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=65536",
        "critic.ppo_max_token_len_per_gpu=16384",
    ]

    def advice(*over, tokens=200_000):
        return critic_budget_advice(load_config(list(over), **Q), critic_mini_batch_tokens=tokens)

    line = advice(*gae)
    assert line.startswith("critic.ppo_max_token_len_per_gpu=16384 cuts") and "up to 13 micro-batches" in line
    assert "critic.ppo_max_token_len_per_gpu=65536 and critic.forward_max_token_len_per_gpu=65536" in line
    assert advice(*gae, tokens=16_000) is None  # one micro-batch already
    assert advice(*gae, "critic.ppo_max_token_len_per_gpu=65536") is None
    assert advice(*gae, "algorithm.adv_estimator=grpo") is None  # no critic
    assert advice(*gae, "actor_rollout_ref.actor.use_dynamic_bsz=False") is None
    assert advice(*gae, "critic.model.path=/elsewhere") is None


def test_dry_run_names_every_problem_at_once(tiny_model_dir, arithmetic_data, tmp_path, capsys, monkeypatch):
    """A key, a value, sizes, data, a logger and the disk wrong in one `--dry-run`: all named, exit 2."""
    from klppo.commands.train import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "wandb" else real(m, *a))
    monkeypatch.setattr(startup_checks.shutil, "disk_usage", lambda _p: SimpleNamespace(free=1000))
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "data.train_batch_sise=4",
        "actor_rollout_ref.rollout.n=two",
        "trainer.n_gpus_per_node=3",
        f"data.val_files={tmp_path / 'missing.parquet'}",
        "trainer.logger=[console,wandb]",
        "trainer.save_freq=1",
    ]
    assert main(["--dry-run", *overrides]) == 2
    err = capsys.readouterr().err
    assert "klppo: 6 problems, nothing started:\n  1. unknown key 'data.train_batch_sise'" in err
    for problem in (
        "2. actor_rollout_ref.rollout.n='two'",
        "3. data.train_batch_size=4 prompts",  # 4 prompts on 3 processes
        "4. trainer.logger includes 'wandb'",
        "5. trainer.default_local_dir=",  # one checkpoint does not fit
        "6. Parquet file not found: " + str(tmp_path / "missing.parquet"),
    ):
        assert f"\n  {problem}" in err, (problem, err)


def test_a_finished_run_says_so_before_any_weight_loads(
    tiny_model_dir, arithmetic_data, tmp_path, capsys, monkeypatch
):
    """Resuming a run whose checkpoint reached its last step: one line, exit 0, nothing started; with
    steps left (or resume off) the run starts."""
    import klppo.commands.train as train
    from klppo.ops.checkpoint import write_manifest

    checkpoint = tmp_path / "run" / "global_step_1"
    for name in ("trainer_state.pt", "rng/rank_0.pt", "actor/.metadata"):
        (checkpoint / name).parent.mkdir(parents=True, exist_ok=True)
        (checkpoint / name).write_bytes(b"x")
    write_manifest(checkpoint, 1)
    (checkpoint / "COMPLETE").write_text("1")
    started: list[int] = []
    monkeypatch.setattr(train, "_launch_or_run", lambda *a, **k: started.append(1) or 0)
    overrides = [
        *base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run"),
        "algorithm.adv_estimator=grpo",
    ]
    assert train.main(overrides) == 0 and not started  # total_training_steps=1
    out = capsys.readouterr().out
    assert out.startswith(
        f"klppo: {checkpoint} is at step 1, and this run ends at step 1 (trainer.total_training_steps): "
        "nothing left to train."
    )
    assert train.main([*overrides, "--dry-run"]) == 0 and "resume: " in capsys.readouterr().out
    assert train.main([*overrides, "trainer.total_training_steps=2"]) == 0 and started == [1]
    assert train.main([*overrides, "trainer.resume_mode=disable"]) == 0 and started == [1, 1]


def test_rows_name_an_interaction_and_an_agent_that_exist(tmp_path):
    """A multi-turn row whose ``interaction_kwargs.name`` is not in the interaction config, or whose
    ``agent_name`` klppo does not run, stops the start naming the file and the row."""
    import pyarrow.parquet as pq

    from klppo.assembly.startup_checks import _check_conversation_rows
    from klppo.data.arithmetic import write_arithmetic_parquet

    train, _ = write_arithmetic_parquet(tmp_path, num_train=4, num_test=2, interaction="arith")
    _check_conversation_rows(str(train), ["arith"])
    _check_conversation_rows(str(train), [])  # no interaction config: the rows' names are not used
    with pytest.raises(ConfigError, match=r"row 0: extra_info.interaction_kwargs.name='arith' is not in"):
        _check_conversation_rows(str(train), ["gsm8k"])
    table = pq.read_table(train)
    table = table.append_column("agent_name", [["tool_agent"] * 3 + ["x"]])
    pq.write_table(table, tmp_path / "agents.parquet")
    with pytest.raises(ConfigError, match=r"agents.parquet row 3: agent_name 'x' is not one klppo runs"):
        _check_conversation_rows(str(tmp_path / "agents.parquet"), ["arith"])
