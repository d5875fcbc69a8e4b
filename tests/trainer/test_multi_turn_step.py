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


INTERACTION = """interaction:
  - name: arithmetic
    class_name: klppo.tools.gsm8k.Gsm8kInteraction
    config: {method: flexible}
"""


@pytest.mark.slow
def test_validation_runs_the_retry_and_reports_each_attempt(tmp_path):
    """Validation runs the conversation loop with the run's interaction (greedy): the tiny model whose turns
    end at once answers, hears "try again", answers again; the dumps keep each sample's turn scores and
    turns, and the attempts' metrics agree with them."""
    import json

    from klppo.data.arithmetic import write_arithmetic_parquet
    from klppo.models.tiny import save_tiny_model_dir
    from klppo.trainer.step_metrics import attempt_metrics

    model = save_tiny_model_dir(tmp_path / "model", num_layers=2, hidden_size=64, eos_logit=3.0)
    data = write_arithmetic_parquet(tmp_path / "data", num_train=8, num_test=4, interaction="arithmetic")
    inter = tmp_path / "interaction.yaml"
    inter.write_text(INTERACTION)
    overrides = base_overrides(model, data, tmp_path / "run") + [
        "actor_rollout_ref.rollout.multi_turn.enable=True",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={inter}",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
        "data.max_response_length=160",  # the tiny tokenizer spends ~100 tokens on the retry message
        "trainer.val_before_train=True",
        f"trainer.validation_data_dir={tmp_path / 'val'}",
    ]
    run_training(overrides)
    rows = [json.loads(x) for x in (tmp_path / "val" / "0.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    # greedy answers are empty: wrong, a retry, wrong again, and the turn limit ends the conversation
    assert all(r["num_turns"] == 3 and r["turn_scores"] == [0.0] for r in rows)
    assert all(r["output"].count("try again") == 1 for r in rows)
    val = next(m for m in read_metrics(tmp_path / "run") if "val-core/arithmetic/reward/mean@1" in m)
    expected = attempt_metrics(rows, 1)
    assert expected["failed_first/share"] == 1.0 and expected["num_turns/mean"] == 3.0
    for key, value in expected.items():
        assert val[f"val-aux/arithmetic/{key}"] == pytest.approx(value)
    train_rows = read_metrics(tmp_path / "run")[-1]
    assert train_rows["multi_turn/assistant_turns"] > 1  # sampled conversations retry too
