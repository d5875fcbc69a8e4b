"""Offload changes where a role's state lives, never the run (issue 53's CPU tests): the tiny model trained
3 PPO steps (GAE: actor, reference, critic; a k3 KL loss) with the optimizer step on the CPU
(``optimizer_step_on_cpu``, actor and critic), and with the state offloaded between phases (``param_offload``
and ``optimizer_offload`` of the actor and the critic, the reference's ``param_offload``: FSDP2 on one
process), logs every metric within 1e-6 of the run that offloads nothing; and a checkpoint written under one
setting resumes under another with the uninterrupted run's next step."""

from __future__ import annotations

import pytest

from tests.trainer.utils import base_overrides, read_metrics, run_training

A = "actor_rollout_ref"
COMMON = ["algorithm.adv_estimator=gae", f"{A}.actor.use_kl_loss=True", f"{A}.actor.kl_loss_type=low_var_kl"]
SETTINGS = {
    "off": [],
    "cpu_step": [
        f"{A}.actor.fsdp_config.optimizer_step_on_cpu=True",
        "critic.model.fsdp_config.optimizer_step_on_cpu=True",
    ],
    "idle": [
        f"{A}.actor.fsdp_config.param_offload=True",
        f"{A}.actor.fsdp_config.optimizer_offload=True",
        f"{A}.ref.fsdp_config.param_offload=True",
        "critic.model.fsdp_config.param_offload=True",
        "critic.model.fsdp_config.optimizer_offload=True",
    ],
}
TOL = 1e-6


def _compared(row: dict) -> dict[str, float]:
    """Every metric that the run's arithmetic decides (times and memory left out)."""
    return {
        k: v
        for k, v in row.items()
        if isinstance(v, int | float) and not k.startswith(("timing_s/", "perf/")) and k != "rollout/time_s"
    }


def _assert_same(got: dict, want: dict, what: str) -> None:
    got, want = _compared(got), _compared(want)
    assert got.keys() == want.keys(), what
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=0, abs=TOL), f"{what}: {key}"


def _run(model, data, run_dir, setting: str, *extra: str) -> list[dict]:
    run_training(base_overrides(model, data, run_dir) + COMMON + SETTINGS[setting] + list(extra))
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, arithmetic_data, tmp_path_factory) -> list[dict]:
    rows = _run(
        tiny_model_dir,
        arithmetic_data,
        tmp_path_factory.mktemp("off"),
        "off",
        "trainer.total_training_steps=3",
    )
    assert len(rows) == 3
    return rows


@pytest.mark.parametrize("setting", ["cpu_step", "idle"])
def test_offloaded_equals_not_offloaded_over_3_steps(
    setting, uninterrupted, tiny_model_dir, arithmetic_data, tmp_path
):
    rows = _run(tiny_model_dir, arithmetic_data, tmp_path, setting, "trainer.total_training_steps=3")
    for step, (got, want) in enumerate(zip(rows, uninterrupted, strict=True), start=1):
        _assert_same(got, want, f"{setting}, step {step}")


@pytest.mark.parametrize(
    ("writer", "reader"), [("cpu_step", "idle"), ("idle", "cpu_step"), ("off", "cpu_step")]
)
def test_checkpoint_resumes_under_another_offload(
    writer, reader, uninterrupted, tiny_model_dir, arithmetic_data, tmp_path
):
    _run(
        tiny_model_dir,
        arithmetic_data,
        tmp_path,
        writer,
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
    )
    assert (tmp_path / "global_step_2" / "COMPLETE").exists()
    rows = _run(tiny_model_dir, arithmetic_data, tmp_path, reader, "trainer.total_training_steps=3")
    resumed = {row["step"]: row for row in rows}
    _assert_same(resumed[3], uninterrupted[2], f"{writer} → {reader}, step 3")
