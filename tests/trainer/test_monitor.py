"""The operating rules end to end: each rule fired through a real training run (tiny model, CPU, 1 process) by
a constructed situation — a reward function that turns NaN, a plateau, a large learning rate, a validation
drop, an out-of-memory error inside the actor's backward — with events.jsonl, metrics and checkpoints
checked. The rules' arithmetic is checked on its own in test_monitor_rules.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.utils import base_overrides, read_metrics, run_training, train_two_ranks

# scores that vary with the response text, so that advantages (and policy gradients) are non-zero
REWARD_VARIED = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (sum(map(ord, solution_str)) % 7) / 6.0
"""
# finite for the first 8 samples (step 1), NaN after
REWARD_TURNS_NAN = """
CALLS = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    CALLS[0] += 1
    return 0.5 if CALLS[0] <= 8 else float("nan")
"""
REWARD_CONSTANT = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return 0.25
"""
# training samples score 0.5–1; validation samples 1 on the first validation (before training), 0 after
REWARD_VAL_DROPS = """
VAL_CALLS = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if extra_info["split"] != "test":
        return 0.5 + (sum(map(ord, solution_str)) % 7) / 12.0
    VAL_CALLS[0] += 1
    return 1.0 if VAL_CALLS[0] <= 8 else 0.0
"""
GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.use_kl_loss=True"]


def reward_file(tmp_path: Path, source: str) -> list[str]:
    path = tmp_path / "reward_fn.py"
    path.write_text(source)
    return [f"custom_reward_function.path={path}"]


def grpo_run(model_dir: Path, data, tmp_path: Path, reward_source: str) -> tuple[Path, list[str]]:
    """(run directory, overrides) of a GRPO run of the tiny model scored by ``reward_source``."""
    run = tmp_path / "run"
    return run, base_overrides(model_dir, data, run) + GRPO + reward_file(tmp_path, reward_source)


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def acted(run_dir: Path, rule: str) -> list[dict]:
    return [e for e in events(run_dir) if e["rule"] == rule]


def klppo_train(argv: list[str]) -> int:
    """`klppo train ARGV` in this process (world size 1): its exit status."""
    from klppo.commands.train import main

    torch.set_num_threads(1)
    return main(argv)


def by_step(run_dir: Path) -> dict[int, dict]:
    """Training-step records (validation lines of the same step merged in)."""
    out: dict[int, dict] = {}
    for row in read_metrics(run_dir):
        out.setdefault(row["step"], {}).update(row)
    return out


def test_nonfinite_reward_stops_with_checkpoints_intact(tiny_model_dir, arithmetic_data, tmp_path):
    run, overrides = grpo_run(tiny_model_dir, arithmetic_data, tmp_path, REWARD_TURNS_NAN)
    # through `klppo train`'s entry point: a stop by a rule is a normal end (exit 0)
    assert (
        klppo_train(
            overrides
            + [
                "trainer.total_training_steps=4",
                "trainer.save_freq=1",
                "monitor.nonfinite_reward.action=stop",
            ]
        )
        == 0
    )
    assert max(by_step(run)) == 2
    (event,) = acted(run, "nonfinite_reward")
    assert event["step"] == 2 and event["action"] == "stop" and event["score"] == "nan"
    summary = events(run)[-1]
    assert summary["rule"] == "summary" and "nonfinite_reward" in summary["stopped_by"]
    assert by_step(run)[2]["monitor/nonfinite_reward/stop"] == 1.0
    # both checkpoints are complete, and step 2 (whose update was skipped) holds step 1's weights
    from klppo.commands.export import main as export_main

    for step in (1, 2):
        assert (run / f"global_step_{step}" / "COMPLETE").exists()
        assert export_main([str(run / f"global_step_{step}"), str(tmp_path / f"hf{step}")]) == 0
    from safetensors.torch import load_file

    w1, w2 = (load_file(next((tmp_path / f"hf{s}").glob("*.safetensors"))) for s in (1, 2))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


def test_reward_plateau_stops_early(tiny_model_dir, arithmetic_data, tmp_path):
    run, overrides = grpo_run(tiny_model_dir, arithmetic_data, tmp_path, REWARD_CONSTANT)
    assert (
        klppo_train(
            overrides
            + [
                "trainer.total_training_steps=8",
                "monitor.reward_plateau.enable=True",
                "monitor.reward_plateau.patience_steps=2",
                "monitor.reward_plateau.window=1",
            ]
        )
        == 0
    )
    assert max(by_step(run)) == 3  # step 1 sets the best; steps 2 and 3 do not beat it
    (event,) = acted(run, "reward_plateau")
    assert event["step"] == 3 and event["action"] == "stop" and event["steps_flat"] == 2
    rows = by_step(run)
    assert [rows[s]["monitor/reward_plateau/steps_without_improvement"] for s in (1, 2, 3)] == [0, 1, 2]


def test_learning_signal_stops_a_run_whose_groups_all_score_the_same(
    tiny_model_dir, arithmetic_data, tmp_path
):
    run, overrides = grpo_run(tiny_model_dir, arithmetic_data, tmp_path, REWARD_CONSTANT)
    assert (
        klppo_train(
            overrides
            + [
                "trainer.total_training_steps=6",
                "monitor.learning_signal.patience_steps=2",
                "monitor.learning_signal.action=stop",
            ]
        )
        == 0
    )
    assert max(by_step(run)) == 2
    (event,) = acted(run, "learning_signal")
    assert event["step"] == 2 and event["action"] == "stop" and event["equal_score_groups"] == 1.0
    assert "every sample scored 0.25" in event["message"]
    assert [by_step(run)[s]["monitor/learning_signal/steps_equal"] for s in (1, 2)] == [1, 2]


def test_kl_explosion_doubles_the_coefficient_and_kl_early_stop(tiny_model_dir, arithmetic_data, tmp_path):
    run, overrides = grpo_run(tiny_model_dir, arithmetic_data, tmp_path, REWARD_VARIED)
    state, _ = run_training(
        overrides
        + [
            "trainer.total_training_steps=6",
            "actor_rollout_ref.actor.optim.lr=0.05",
            "monitor.kl_explosion.enable=True",
            "monitor.kl_explosion.threshold=0.1",
            "monitor.kl_early_stop.enable=True",
            "monitor.kl_early_stop.target_kl=0.1",
            "monitor.kl_early_stop.patience_steps=2",
        ]
    )
    rows = by_step(run)
    fired = acted(run, "kl_explosion")
    assert fired, "the KL never exceeded 0.1 with lr 0.05"
    first = fired[0]["step"]
    assert rows[first]["actor/ref_kl_k1"] > 0.1
    assert fired[0]["kl_loss_coef_old"] == pytest.approx(0.001) and fired[0][
        "kl_loss_coef_new"
    ] == pytest.approx(0.002)
    assert rows[first]["actor/kl_coef"] == pytest.approx(0.001)  # step `first` trained with the old one
    assert rows[first + 1]["actor/kl_coef"] == pytest.approx(0.002)  # the next step with the doubled one
    (stop,) = acted(run, "kl_early_stop")
    assert stop["steps_over"] == 2 and state.global_step == stop["step"] == first + 1


def test_entropy_collapse_raises_the_entropy_bonus(tiny_model_dir, arithmetic_data, tmp_path):
    run, overrides = grpo_run(tiny_model_dir, arithmetic_data, tmp_path, REWARD_VARIED)
    # the tiny model starts at ~5.9 nats per token; lr 0.05 pulls it to ~3.6 by step 2
    run_training(
        overrides
        + [
            "trainer.total_training_steps=3",
            "actor_rollout_ref.actor.optim.lr=0.05",
            "monitor.entropy_collapse.enable=True",
            "monitor.entropy_collapse.min_entropy=4.5",
        ]
    )
    rows = by_step(run)
    fired = acted(run, "entropy_collapse")
    assert fired and rows[1]["actor/entropy"] > 4.5, (
        "constructed situation: entropy must start above the limit"
    )
    first = fired[0]["step"]
    assert first > 1 and rows[first]["actor/entropy"] < 4.5
    assert fired[0]["entropy_coeff_old"] == 0 and fired[0]["entropy_coeff_new"] == pytest.approx(0.001)
    assert rows[first]["monitor/entropy_coeff"] == pytest.approx(0.001)
    if len(fired) > 1:  # still collapsed on the next step: doubled
        assert fired[1]["entropy_coeff_new"] == pytest.approx(0.002)


def test_validation_drop_rolls_back_and_changes_lr_and_kl(tiny_model_dir, arithmetic_data, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from klppo.commands.export import main as export_main

    run, overrides = grpo_run(tiny_model_dir, arithmetic_data, tmp_path, REWARD_VAL_DROPS)
    run_training(
        overrides
        + [
            "trainer.total_training_steps=2",
            "trainer.val_before_train=True",
            "trainer.test_freq=1",
            "trainer.save_freq=1",
            "trainer.max_actor_ckpt_to_keep=1",
            "monitor.validation_drop.enable=True",
            "monitor.validation_drop.kl_coef_factor=2.0",
        ]
    )
    kept = acted(run, "validation_drop")
    assert [(e["step"], e["action"]) for e in kept] == [(0, "save_best"), (1, "rollback"), (2, "rollback")]
    rollback = kept[1]
    assert rollback["restored_step"] == 0 and rollback["val_score"] == 0 and rollback["train_reward"] >= 0.5
    rows = by_step(run)
    assert rows[1]["actor/lr"] == pytest.approx(1e-3) and rows[2]["actor/lr"] == pytest.approx(5e-4)
    assert rows[1]["actor/kl_coef"] == pytest.approx(0.001) and rows[2]["actor/kl_coef"] == pytest.approx(
        0.002
    )
    assert rows[1]["monitor/validation_drop/rollback"] == 1.0
    # the best-validation checkpoint survives the rotation (max_actor_ckpt_to_keep=1 kept only step 2)
    assert sorted(p.name for p in run.glob("global_step_*")) == ["global_step_2"]
    assert (run / "best_validation" / "global_step_0" / "COMPLETE").exists()
    # step 2 rolled back again after its update: its checkpoint holds the untrained (step 0) weights
    assert export_main([str(run / "global_step_2"), str(tmp_path / "hf")]) == 0
    exported = load_file(next((tmp_path / "hf").glob("*.safetensors")))
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert all(torch.equal(exported[k], original[k]) for k in exported if k in original)


class _OOMOnce:
    """Raises torch.OutOfMemoryError in the backward of the actor's 2nd micro-batch of step 1 (after the
    1st accumulated its gradients), once."""

    def __init__(self) -> None:
        self.backwards = 0
        self.raised = False

    def hook(self, module, grad_input, grad_output):
        self.backwards += 1
        if not self.raised and self.backwards == 2:
            self.raised = True
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")


def _last_layer(model: torch.nn.Module) -> torch.nn.Module:
    return model.model.layers[-1]


def _record_grads(monkeypatch) -> list[list[torch.Tensor]]:
    """Every optimizer step's gradients (actor and critic), cloned before the step. Patched on the class the
    roles build (``fsdp_config.local_shard_optim``, the default): torch's first construction of a class
    stores its profiler-wrapped ``step`` on that class, so a patch of ``torch.optim.AdamW`` would miss it."""
    from klppo.parallel.local_shards import LocalShardAdamW

    recorded: list[list[torch.Tensor]] = []
    real_step = LocalShardAdamW.step

    def step(self, *a, **k):
        recorded.append(
            [p.grad.detach().clone() for g in self.param_groups for p in g["params"] if p.grad is not None]
        )
        return real_step(self, *a, **k)

    monkeypatch.setattr(LocalShardAdamW, "step", step)
    return recorded


def test_oom_in_actor_backward_is_retried_with_the_same_gradients(
    tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    from klppo.roles.actor import Actor

    common = GRPO + reward_file(tmp_path, REWARD_VARIED) + ["trainer.total_training_steps=2"]
    clean_grads = _record_grads(monkeypatch)
    run_training(base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "clean") + common)
    monkeypatch.undo()

    oom = _OOMOnce()
    real_init = Actor.__init__

    def init_with_hook(self, model, *a, **k):
        real_init(self, model, *a, **k)
        _last_layer(model).register_full_backward_hook(oom.hook)

    monkeypatch.setattr(Actor, "__init__", init_with_hook)
    oom_grads = _record_grads(monkeypatch)
    run = tmp_path / "oom"
    state, parts = run_training(base_overrides(tiny_model_dir, arithmetic_data, run) + common)
    assert oom.raised and state.global_step == 2
    (event,) = acted(run, "oom_recovery/actor")
    assert event["step"] == 1 and event["micro_batch_size_old"] == 2 and event["micro_batch_size_new"] == 1
    assert parts.roles.actor.oom.micro["update"].micro_batch_size == 1  # stays halved for the rest of the run
    assert by_step(run)[1]["monitor/oom_recovery/retries"] == 1
    assert len(oom_grads) == len(clean_grads) == 4  # 2 steps × 2 mini-batches, none lost or repeated
    # the retried mini-batch (step 1's first optimizer step) has the uninterrupted one's gradient to fp32
    # rounding (measured 3e-8); later steps run with micro-batches of 1 on weights that differ by that
    # rounding, amplified by Adam (measured ≤ 2e-6)
    for i, (clean, retried) in enumerate(zip(clean_grads, oom_grads)):
        for a, b in zip(clean, retried, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-6 if i == 0 else 1e-5)


def test_oom_in_the_log_prob_pass_is_retried_with_the_same_log_probs(
    tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    """Out of memory in the 2nd micro-batch of the actor's old-log-prob pass (no gradients): the pass is
    redone with half the micro-batch and the step's numbers are those of an uninterrupted step."""
    from klppo.roles.actor import Actor

    common = GRPO + reward_file(tmp_path, REWARD_VARIED) + ["trainer.total_training_steps=2"]
    run_training(base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "clean") + common)

    state = {"inside": False, "forwards": 0, "raised": False}
    real_init, real_pass = Actor.__init__, Actor.compute_log_prob

    def hook(module, args, output):
        if state["inside"] and not state["raised"]:
            state["forwards"] += 1
            if state["forwards"] == 2:
                state["raised"] = True
                raise torch.OutOfMemoryError("CUDA out of memory (simulated, log-prob pass)")

    def init_with_hook(self, model, *a, **k):
        real_init(self, model, *a, **k)
        _last_layer(model).register_forward_hook(hook)

    def log_prob_pass(self, batch, **kwargs):
        state["inside"] = True
        try:
            return real_pass(self, batch, **kwargs)
        finally:
            state["inside"] = False

    monkeypatch.setattr(Actor, "__init__", init_with_hook)
    monkeypatch.setattr(Actor, "compute_log_prob", log_prob_pass)
    run = tmp_path / "oom"
    state_, parts = run_training(base_overrides(tiny_model_dir, arithmetic_data, run) + common)
    assert state["raised"] and state_.global_step == 2
    (event,) = acted(run, "oom_recovery/actor")
    assert event["phase"] == "log_prob" and (
        event["micro_batch_size_old"],
        event["micro_batch_size_new"],
    ) == (4, 2)
    assert parts.roles.actor.oom.micro["log_prob"].micro_batch_size == 2
    assert event["message"].endswith(
        "a new run starts there with actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2)"
    )
    clean, retried = by_step(tmp_path / "clean"), by_step(run)
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm", "actor/ref_kl_k1", "critic/score/mean"):
        for step in (1, 2):
            assert retried[step][key] == pytest.approx(clean[step][key], rel=1e-5, abs=1e-6), (key, step)


def test_oom_past_the_retries_stops_with_the_phase_named(
    tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    from klppo.roles.actor import Actor
    from klppo.trainer.timer import PhaseOutOfMemory

    def always(module, grad_input, grad_output):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    real_init = Actor.__init__

    def init_with_hook(self, model, *a, **k):
        real_init(self, model, *a, **k)
        _last_layer(model).register_full_backward_hook(always)

    monkeypatch.setattr(Actor, "__init__", init_with_hook)
    run = tmp_path / "run"
    with pytest.raises(PhaseOutOfMemory, match="update_actor"):
        run_training(base_overrides(tiny_model_dir, arithmetic_data, run) + GRPO)
    # micro-batch 2 → 1, then nothing left to halve; both the retry and the summary are recorded
    assert [e["micro_batch_size_new"] for e in acted(run, "oom_recovery/actor")] == [1]
    assert events(run)[-1]["rule"] == "summary"


def test_resumed_run_takes_the_same_actions(tiny_model_dir, arithmetic_data, tmp_path):
    rules = GRPO + [
        "actor_rollout_ref.actor.optim.lr=0.05",
        "monitor.kl_explosion.enable=True",
        "monitor.kl_explosion.threshold=0.02",
        "monitor.entropy_collapse.enable=True",
        "monitor.entropy_collapse.min_entropy=5.9",
    ]
    full, cut = tmp_path / "full", tmp_path / "cut"
    run_training(
        base_overrides(tiny_model_dir, arithmetic_data, full)
        + rules
        + reward_file(tmp_path, REWARD_VARIED)
        + ["trainer.total_training_steps=4"]
    )
    cut_args = (
        base_overrides(tiny_model_dir, arithmetic_data, cut) + rules + reward_file(tmp_path, REWARD_VARIED)
    )
    run_training(cut_args + ["trainer.total_training_steps=2", "trainer.save_freq=2"])
    run_training(cut_args + ["trainer.total_training_steps=4"])

    def strip(evs):
        return [{k: v for k, v in e.items() if k != "time"} for e in evs]

    assert acted(full, "kl_explosion"), "no action to compare"
    assert strip(events(cut)) == strip(events(full))
    a, b = by_step(full), by_step(cut)
    for key in (
        "actor/kl_coef",
        "monitor/entropy_coeff",
        "actor/ref_kl_k1",
        "actor/entropy",
        "monitor/num_actions",
    ):
        assert b[4][key] == pytest.approx(a[4][key], rel=1e-5, abs=1e-7), key


def test_monitor_config_errors_name_the_key():
    from klppo.config import load_config
    from klppo.config.errors import ConfigError

    with pytest.raises(ConfigError, match=r"monitor.validation_drop.action='rolback'.*did you mean rollback"):
        load_config(["monitor.validation_drop.action=rolback"])
    with pytest.raises(ConfigError, match="monitor.kl_explosion.coef_factor=0"):
        load_config(["monitor.kl_explosion.coef_factor=0"])
    with pytest.raises(ConfigError, match="global_profiler.tool='npu'"):
        load_config(["global_profiler.tool=npu"])


# training samples score 1–2, validation samples 0.5: every validation after the first (which has no
# training reward to compare with) is a drop; no state in the function, so ranks need not agree on calls
REWARD_VAL_BELOW_TRAIN = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if extra_info["split"] == "test":
        return 0.5
    return 1.0 + (sum(map(ord, solution_str)) % 7) / 6.0
"""


@pytest.mark.slow
@pytest.mark.xdist_group("rank_pool")
def test_two_processes_take_the_same_actions_as_one(tiny_model_dir, arithmetic_data, tmp_path, rank_pool):
    """Rollback (collective save and load of the best-validation checkpoint) and KL-coefficient changes
    with 2 gloo ranks under `klppo train`: the same events, coefficients and lr as 1 process."""
    from tests.trainer.test_distributed import _overrides

    rules = reward_file(tmp_path, REWARD_VAL_BELOW_TRAIN) + [
        "trainer.total_training_steps=2",
        "trainer.test_freq=1",
        "trainer.save_freq=2",
        "monitor.validation_drop.enable=True",
        "monitor.validation_drop.kl_coef_factor=2.0",
        "monitor.kl_explosion.enable=True",
        "monitor.kl_explosion.threshold=-1.0",  # fires every step
    ]
    two, one = tmp_path / "two", tmp_path / "one"
    argv = _overrides(tiny_model_dir, arithmetic_data, two) + rules + ["trainer.n_gpus_per_node=2"]
    assert train_two_ranks(rank_pool, argv) == 0
    run_training(_overrides(tiny_model_dir, arithmetic_data, one) + rules)

    def actions(run_dir):
        return [
            (e["step"], e["rule"], e["action"]) for e in events(run_dir) if not e["rule"].startswith("drift")
        ]

    assert actions(two) == actions(one)
    assert (1, "validation_drop", "rollback") in actions(one) and (
        1,
        "kl_explosion",
        "scale_kl_coef",
    ) in actions(one)
    a, b = by_step(one), by_step(two)
    for key in ("actor/kl_coef", "actor/reward_kl_penalty_coeff", "actor/lr", "monitor/lr_scale"):
        for step in (1, 2):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-4), (key, step)
    assert (two / "best_validation" / "global_step_0" / "COMPLETE").exists()
