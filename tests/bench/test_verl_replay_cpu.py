"""bench/verl_replay.py on a miniature verl checkout written here (launch scripts and config files in verl's
formats, written for this test): the multi-turn GSM8K launches — the tool config named by an absolute path
inside the checkout, the interaction config by a path relative to it — pass `klppo train --dry-run`, and
the multi-turn launches that need what klppo does not build are refused naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.verl_replay import record, replay

CONFIG = "examples/sglang_multiturn/config"
LAUNCH = """set -x
PROJECT_DIR="$(pwd)"
python3 -m verl.trainer.main_ppo \\
    --config-path="$PROJECT_DIR/{config}" \\
    --config-name='multiturn_grpo' \\
    algorithm.adv_estimator=grpo \\
    data.train_batch_size=16 \\
    data.max_prompt_length=256 \\
    data.max_response_length=256 \\
    data.return_raw_chat=True \\
    actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct \\
    actor_rollout_ref.actor.ppo_mini_batch_size=8 \\
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \\
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 \\
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \\
    actor_rollout_ref.rollout.name=sglang \\
    actor_rollout_ref.rollout.mode=async \\
    actor_rollout_ref.rollout.n=4 \\
    trainer.logger=['console'] \\
    trainer.n_gpus_per_node=2 \\
    trainer.nnodes=1 \\
    data.train_files=$HOME/data/{data}/train.parquet \\
    data.val_files=$HOME/data/{data}/test.parquet \\
    {extra} $@
"""
MULTI_TURN = "actor_rollout_ref.rollout.multi_turn"
TOOL = """tools:
  - class_name: "{class_name}"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "{name}"
        description: "{name}"
        parameters:
          type: "object"
          properties:
            answer:
              type: "string"
              description: "the answer"
          required: ["answer"]
"""
LAUNCHES = {  # script: (data set, its multi-turn argument, the verdict, words of the message)
    "gsm8k_tool": (
        "gsm8k",
        f'{MULTI_TURN}.tool_config_path="$PROJECT_DIR/{CONFIG}/tool_config/gsm8k_tool_config.yaml"',
        "accepted",
        "",
    ),
    "gsm8k_interaction": (
        "gsm8k",
        f"{MULTI_TURN}.interaction_config_path={CONFIG}/interaction_config/gsm8k_interaction_config.yaml "
        f"{MULTI_TURN}.max_user_turns=1",
        "accepted",
        "",
    ),
    "search": (
        "searchR1",
        f'{MULTI_TURN}.tool_config_path="$PROJECT_DIR/{CONFIG}/tool_config/search_tool_config.yaml"',
        "refused",
        "SearchTool is not supported: it needs a retrieval service",
    ),
    "sandbox": (
        "retool_dapo",
        f'{MULTI_TURN}.tool_config_path="$PROJECT_DIR/{CONFIG}/tool_config/sandbox_fusion_tool_config.yaml"',
        "refused",
        "it needs a remote SandboxFusion service",
    ),
    "agent_loop": (
        "gsm8k",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={CONFIG}/agent.yaml",
        "refused",
        "agent loops are not built",
    ),
    "geo3k": (
        "geo3k",
        f'{MULTI_TURN}.tool_config_path="$PROJECT_DIR/{CONFIG}/tool_config/geo3k_tool_config.yaml"',
        "refused",
        "image and video inputs are not built",
    ),
}


def miniature_verl(root: Path) -> None:
    config = root / CONFIG
    (config / "tool_config").mkdir(parents=True)
    (config / "interaction_config").mkdir()
    (config / "multiturn_grpo.yaml").write_text(
        "hydra:\n  searchpath:\n    - file://verl/trainer/config\n"
        "defaults:\n  - ppo_trainer\n  - _self_\n"
        "actor_rollout_ref:\n  rollout:\n    name: sglang\n"
        "    multi_turn:\n      enable: True\n      max_assistant_turns: 5\n"
    )
    for file, class_name, name in (
        ("gsm8k", "verl.tools.gsm8k_tool.Gsm8kTool", "calc_gsm8k_reward"),
        ("search", "verl.tools.search_tool.SearchTool", "search"),
        ("sandbox_fusion", "verl.tools.sandbox_fusion_tools.SandboxFusionTool", "code_interpreter"),
        ("geo3k", "verl.tools.geo3k_tool.Geo3kTool", "calc_geo3k_reward"),
    ):
        (config / "tool_config" / f"{file}_tool_config.yaml").write_text(
            TOOL.format(class_name=class_name, name=name)
        )
    (config / "interaction_config" / "gsm8k_interaction_config.yaml").write_text(
        'interaction:\n  - name: "gsm8k"\n'
        '    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"\n    config: {}\n'
    )
    (config / "agent.yaml").write_text("- name: my_agent\n  _target_: my.agent.Loop\n")
    for script, (data, extra, _, _) in LAUNCHES.items():
        (root / "examples" / "sglang_multiturn" / f"run_{script}.sh").write_text(
            LAUNCH.format(config=CONFIG, data=data, extra=extra)
        )


@pytest.mark.slow  # about 15 s on 2 cores: a dry run per launch
def test_gsm8k_multi_turn_launches_pass_and_the_others_are_refused_by_name(tmp_path) -> None:
    verl, work = tmp_path / "verl", tmp_path / "work"
    miniature_verl(verl)
    results = {r["name"]: r for r in replay(record(verl, work), work, verl)}
    assert results.pop("ISSUE_LIST")["verdict"] == "accepted"
    assert sorted(results) == sorted(f"examples/sglang_multiturn/run_{s}.sh#1" for s in LAUNCHES)
    for script, (_, _, verdict, words) in LAUNCHES.items():
        result = results[f"examples/sglang_multiturn/run_{script}.sh#1"]
        assert result["verdict"] == verdict, (script, result)
        assert words in "\n".join(result["message"]), (script, result)
