"""Two tiny CPU runs (3 steps, validation before and after) shared by the report tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer.utils import base_overrides

STEPS = 2


def run_overrides(model_dir: Path, data, run_dir: Path, *extra: str) -> list[str]:
    return [
        *base_overrides(model_dir, data, run_dir),
        f"trainer.total_training_steps={STEPS}",
        "trainer.val_before_train=True",
        f"trainer.test_freq={STEPS}",
        "actor_rollout_ref.actor.use_kl_loss=True",
        *extra,
    ]


@pytest.fixture(scope="session")
def tiny_runs(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """(run A trained through `klppo train` in this process, run B with a monitor event, A's stdout lines):
    A is a GAE run with a critic and its checkpoint, B a GRPO run without critic and with events.jsonl."""
    import contextlib
    import io

    from klppo.commands.train import main
    from klppo.data.arithmetic import write_arithmetic_parquet
    from klppo.models.tiny import save_tiny_model_dir
    from tests.trainer.utils import run_training

    root = tmp_path_factory.mktemp("runs")
    model = save_tiny_model_dir(root / "model", num_layers=2, hidden_size=64)
    data = write_arithmetic_parquet(root / "data", num_train=32, num_test=4, seed=0)
    run_a, run_b = root / "gae" / "run", root / "grpo" / "run"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(
            run_overrides(model, data, run_a, f"trainer.save_freq={STEPS}", "trainer.logger=[console,jsonl]")
        )
    assert code == 0, out.getvalue()
    run_training(
        run_overrides(
            model, data, run_b, "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr=1e-2"
        )
    )
    event = {"step": 2, "kind": "kl_explosion", "message": "KL 0.9 above 0.5: kl_loss_coef 0.001 -> 0.002"}
    (run_b / "events.jsonl").write_text(json.dumps(event) + "\n")
    return run_a, run_b, out.getvalue().splitlines()
