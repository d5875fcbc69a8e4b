"""One training step with multi_turn enabled and the calculator tool, end to end on the tiny model."""

from __future__ import annotations

import pytest

from tests.trainer.utils import base_overrides, read_metrics, run_training

TOOLS = """tools:
  - class_name: klppo.tools.calculator.CalculatorTool
    config: {type: native}
"""


@pytest.mark.slow
def test_one_step_with_the_calculator(tiny_model_dir, arithmetic_data, tmp_path):
    tools = tmp_path / "tools.yaml"
    tools.write_text(TOOLS)
    run_dir = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
    ]
    state, _ = run_training(overrides)
    assert state.global_step == 1
    metrics = read_metrics(run_dir)[-1]
    assert metrics["multi_turn/assistant_turns"] >= 1 and "multi_turn/tool_calls" in metrics
