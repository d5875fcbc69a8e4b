"""`klppo config`: the issue's parameter list printed back, typos, type errors, aliases, YAML layering."""

from __future__ import annotations

import yaml

from klppo.cli import main as klppo_main


def _get(tree: dict, key: str):
    for name in key.split("."):
        tree = tree[name]
    return tree


def _expected(text: str):
    """What `key=text` should read back as, by YAML's own rules (independent of klppo's parser)."""
    return yaml.safe_load(text)


def test_issue_list_is_accepted_and_printed_back(run_cli, issue_list):
    rc, out, err = run_cli(issue_list)
    assert rc == 0, err
    tree = yaml.safe_load(out)
    for item in issue_list:
        key, _, text = item.partition("=")
        want = _expected(text)
        if text in ("True", "False"):
            want = text == "True"
        if key.endswith("fsdp_size") or key.endswith("min_num_params"):
            want = int(want)
        got = _get(tree, key)
        assert got == want, (key, got, want)
    # interpolations follow what was set
    assert _get(tree, "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu") == 3072
    assert _get(tree, "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz") is True
    assert _get(tree, "actor_rollout_ref.rollout.response_length") == 256
    assert _get(tree, "critic.model.path") == "Qwen/Qwen2.5-7B-Instruct"


def test_top_level_dispatch_and_help(run_cli, capsys):
    assert (
        klppo_main(["config", "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
        == 0
    )
    assert "train_batch_size: 8" in capsys.readouterr().out
    rc, out, _ = run_cli(["--help"])
    assert rc == 0 and "usage: klppo config" in out


def test_typo_exits_nonzero_with_suggestion(run_cli):
    rc, out, err = run_cli(["actor_rollout_ref.actor.kl_los_coef=0.1"])
    assert rc == 2 and out == ""
    assert "actor_rollout_ref.actor.kl_los_coef" in err
    assert "did you mean: actor_rollout_ref.actor.kl_loss_coef" in err
    # a key in the wrong group is found by its name
    rc, _, err = run_cli(["actor_rollout_ref.kl_loss_coef=0.1"])
    assert rc == 2 and "actor_rollout_ref.actor.kl_loss_coef" in err
    rc, _, err = run_cli(["trainer.loger=[console]"])
    assert rc == 2 and "trainer.logger" in err


def test_type_errors_name_key_value_and_type(run_cli):
    cases = {
        "data.train_batch_size=abc": ("data.train_batch_size", "'abc'", "int"),
        "data.train_batch_size=12.5": ("data.train_batch_size", "12.5", "int"),
        "actor_rollout_ref.actor.use_kl_loss=maybe": ("use_kl_loss", "'maybe'", "bool"),
        "actor_rollout_ref.actor.optim.lr=fast": ("optim.lr", "'fast'", "float"),
        "trainer.logger={a: 1}": ("trainer.logger", "{'a': 1}", "list of string"),
        "data.max_prompt_length=null": ("data.max_prompt_length", "null", "int"),
    }
    for arg, parts in cases.items():
        rc, _, err = run_cli([arg])
        assert rc == 2, arg
        for p in parts:
            assert p in err, (arg, p, err)


def test_numbers_and_booleans_are_typed(run_cli):
    rc, out, err = run_cli(
        [
            "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=1e8",
            "actor_rollout_ref.actor.optim.lr=1e-6",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "actor_rollout_ref.actor.shuffle=False",
            "critic.cliprange_value=1",
        ]
    )
    assert rc == 0, err
    assert "min_num_params: 100000000\n" in out
    tree = yaml.safe_load(out)
    assert _get(tree, "actor_rollout_ref.actor.optim.lr") == 1e-6
    assert _get(tree, "actor_rollout_ref.actor.use_kl_loss") is True
    assert _get(tree, "actor_rollout_ref.actor.shuffle") is False
    assert _get(tree, "critic.cliprange_value") == 1.0 and isinstance(
        _get(tree, "critic.cliprange_value"), float
    )


def test_aliases_are_printed_normalized_with_notes(run_cli):
    rc, out, err = run_cli(
        [
            "data.use_sequence_packing=true",
            "actor_rollout_ref.actor.strategy=fsdp",
            "critic.strategy=fsdp",
            "algorithm.kl_penalty=k3+",
            "actor_rollout_ref.actor.kl_loss_type=k2",
            "trainer.logger=[console,file]",
            "actor_rollout_ref.rollout.name=vllm",
            "actor_rollout_ref.actor.fsdp_config.model_dtype=bfloat16",
        ]
    )
    assert rc == 0, err
    tree = yaml.safe_load(out)
    assert _get(tree, "actor_rollout_ref.model.use_remove_padding") is True
    assert _get(tree, "critic.model.use_remove_padding") is True
    assert _get(tree, "actor_rollout_ref.actor.strategy") == "fsdp2"
    assert _get(tree, "actor_rollout_ref.ref.strategy") == "fsdp2"  # follows the actor's
    assert _get(tree, "critic.strategy") == "fsdp2"
    assert _get(tree, "algorithm.kl_penalty") == "low_var_kl+"
    assert _get(tree, "actor_rollout_ref.actor.kl_loss_type") == "mse"
    assert _get(tree, "trainer.logger") == ["console", "jsonl"]
    assert _get(tree, "actor_rollout_ref.rollout.name") == "klppo"
    assert _get(tree, "actor_rollout_ref.actor.fsdp_config.model_dtype") == "bf16"
    assert "use_sequence_packing" not in out
    for word in ("fsdp2", "low_var_kl+", "jsonl", "vllm"):
        assert word in err
    assert err.count("\n") >= 6 and all(line.startswith("klppo: note:") for line in err.splitlines())


def test_refused_and_invalid_choices(run_cli):
    rc, _, err = run_cli(["actor_rollout_ref.actor.strategy=deepspeed"])
    assert rc == 2 and "fsdp2" in err and "megatron" in err
    rc, _, err = run_cli(["algorithm.adv_estimator=grp"])
    assert rc == 2 and "did you mean grpo" in err
    rc, _, err = run_cli(["algorithm.kl_penalty=k4"])
    assert rc == 2 and "algorithm.kl_penalty" in err
    rc, _, err = run_cli(["actor_rollout_ref.rollout.name=tgi"])
    assert rc == 2 and "klppo" in err
    rc, _, err = run_cli(["trainer.n_gpus_per_node=lots"])
    assert rc == 2 and "auto" in err


def test_yaml_file_then_overrides(run_cli, tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        "defaults:\n  - ppo_trainer\n"
        "data:\n  train_batch_size: 64\n  max_response_length: 100\n"
        "actor_rollout_ref:\n  actor:\n    _target_: verl.workers.config.FSDPActorConfig\n"
        "    ppo_mini_batch_size: 16\n    ppo_micro_batch_size_per_gpu: 4\n"
        "  rollout:\n    n: 2\n"
        "reward_model:\n  reward_kwargs: {method: flexible, format_score: 0.1}\n"
    )
    rc, out, err = run_cli([str(f), "data.train_batch_size=32", "reward_model.reward_kwargs.score=2.0"])
    assert rc == 0, err
    tree = yaml.safe_load(out)
    assert _get(tree, "data.train_batch_size") == 32  # override beats the file
    assert _get(tree, "data.max_response_length") == 100  # file beats the default
    assert _get(tree, "actor_rollout_ref.rollout.response_length") == 100
    assert _get(tree, "actor_rollout_ref.actor.ppo_mini_batch_size") == 16
    assert _get(tree, "reward_model.reward_kwargs") == {
        "method": "flexible",
        "format_score": 0.1,
        "score": 2.0,
    }
    assert "defaults" in err  # hydra section noted, not an error
    # hydra's --config-path/--config-name form, and an unknown key inside a file names the file
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_epoch: 3\n")
    rc, _, err = run_cli(["--config-path", str(tmp_path), "--config-name", "bad"])
    assert rc == 2 and "trainer.total_epoch" in err and "bad.yaml" in err and "trainer.total_epochs" in err
    rc, _, err = run_cli([str(tmp_path / "missing.yaml")])
    assert rc == 2 and "not found" in err
    rc, _, err = run_cli(["data.train_batch_size=8", "stray"])
    assert rc == 2 and "stray" in err


def test_printed_yaml_loads_back_identically(run_cli, tmp_path, issue_list):
    rc, out, _ = run_cli(issue_list)
    f = tmp_path / "printed.yaml"
    f.write_text(out)
    rc2, out2, err2 = run_cli([str(f)])
    assert rc == rc2 == 0, err2
    assert out2 == out


def test_no_arguments_prints_the_defaults_and_hydra_prefixes(run_cli):
    rc, out, err = run_cli([])
    assert rc == 0, err
    tree = yaml.safe_load(out)
    assert _get(tree, "trainer.logger") == ["console", "jsonl"] and _get(tree, "trainer.device") == "auto"
    rc, out, err = run_cli(
        ["+trainer.seed=7", "++trainer.logger=console", "data.train_files=[a.parquet,b.parquet]"]
    )
    assert rc == 0, err
    tree = yaml.safe_load(out)
    assert _get(tree, "trainer.seed") == 7
    assert _get(tree, "trainer.logger") == ["console"]  # a single name is a one-element list
    assert _get(tree, "data.train_files") == ["a.parquet", "b.parquet"]
    rc, out, err = run_cli(["trainer.seed=7", "~trainer.seed"])  # hydra's delete: back to the default
    assert rc == 0 and _get(yaml.safe_load(out), "trainer.seed") == 1 and "~trainer.seed" in err
