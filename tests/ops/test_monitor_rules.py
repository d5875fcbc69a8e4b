"""The rules' arithmetic against hand-worked sequences, and the Monitor's actions on fake controls (no model).
The end-to-end runs that fire each rule are in test_monitor.py."""

from __future__ import annotations

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest

from klppo.config import ConfigError, load_config
from klppo.config.schema_monitor import MonitorConfig
from klppo.ops.monitor import Monitor
from klppo.ops.monitor_rules import (
    Drift,
    EntropyCollapse,
    KLEarlyStop,
    LearningSignal,
    RewardPlateau,
    ValidationDrop,
    build_rules,
    validation_score,
)

M = MonitorConfig()


def kinds(actions):
    return [a.kind for a in actions]


def test_kl_early_stop_needs_consecutive_steps():
    rule = KLEarlyStop(M.kl_early_stop.__class__(enable=True, patience_steps=3), target_kl=0.1)
    seq = [0.2, 0.3, 0.05, 0.2, 0.2, 0.2]  # the dip at step 3 resets the count
    fired = [kinds(rule.observe(i + 1, {"actor/ref_kl_k1": kl}, None)) for i, kl in enumerate(seq)]
    assert fired == [[], [], [], [], [], ["stop"]]
    assert rule.observe(7, {}, None) == []  # metric absent: no-op


def test_kl_early_stop_follows_an_annealed_reward_target():
    """With ``algorithm.kl_ctrl`` annealed (and no target of its own) the stop reads the target of the
    step's update: KL 0.2 under the loose 0.3 of the first steps does not count; once the target has
    decayed to 0.1 it does. The schedule is configuration, not checkpointed state."""
    from klppo.algorithms.kl_control import TargetSchedule
    from klppo.ops.monitor import _reward_target

    cfg = load_config(
        [
            "algorithm.use_kl_in_reward=True",
            "algorithm.kl_ctrl.type=pi",
            "algorithm.kl_ctrl.target_kl=0.1",
            "algorithm.kl_ctrl.target_kl_start=0.3",
            "algorithm.kl_ctrl.anneal_begin=3",
            "algorithm.kl_ctrl.anneal_steps=2",
            "monitor.kl_early_stop.enable=True",
            "monitor.kl_early_stop.patience_steps=2",
        ]
    )
    target = _reward_target(cfg.algorithm.kl_ctrl)
    assert isinstance(target, TargetSchedule) and _reward_target(load_config([]).algorithm.kl_ctrl) == 0.1
    (rule,) = [r for r in build_rules(cfg.monitor, default_target_kl=target) if isinstance(r, KLEarlyStop)]
    fired = [kinds(rule.observe(step, {"actor/ref_kl_k1": 0.2}, None)) for step in range(1, 8)]
    # targets by step: 0.3, 0.3, 0.3, 0.3, √0.03 ≈ 0.173, 0.1, 0.1: over from step 5, stop at step 6
    assert fired == [[], [], [], [], [], ["stop"], ["stop"]]
    assert rule.cfg_target == 0.1 and set(rule.state_dict()) == {"steps_over"}


def test_kl_early_stop_needs_a_target_where_the_reward_controller_has_none():
    """A null target reads algorithm.kl_ctrl's: a GRPO run with only a KL loss was stopped against that
    unused controller's default 0.1 (and a null one crashed the monitor's construction)."""
    on = ["monitor.kl_early_stop.enable=True"]
    with pytest.raises(
        Exception, match=r"monitor.kl_early_stop.target_kl is null and algorithm.use_kl_in_reward is off"
    ):
        load_config(on)
    with pytest.raises(
        Exception, match=r"algorithm.kl_ctrl.target_kl is null: set monitor.kl_early_stop.target_kl"
    ):
        load_config([*on, "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.target_kl=null"])
    load_config([*on, "monitor.kl_early_stop.target_kl=0.5"])
    with pytest.raises(Exception, match=r"algorithm.kl_ctrl.type=fixed does not use its target_kl"):
        load_config([*on, "algorithm.use_kl_in_reward=True"])
    load_config([*on, "algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive"])
    load_config(["monitor.kl_early_stop.enable=False"])  # off: no target needed


def test_reward_plateau_waits_for_a_flat_moving_mean():
    """A 0/1 reward on 512 samples whose pass rate rises 0.30 → 0.70 over 200 steps: the old rule (raw
    reward against its best, patience 3) stopped such runs near step 5; the 10-step mean with patience 20
    lets it run, and stops the same run once its rate has stayed flat."""
    import random

    rng = random.Random(0)
    rule = RewardPlateau(dataclasses.replace(M.reward_plateau, enable=True))
    rising = [sum(rng.random() < 0.3 + 0.4 * t / 200 for _ in range(512)) / 512 for t in range(200)]
    assert [s for s, r in enumerate(rising, 1) for _ in rule.observe(s, {"critic/score/mean": r}, None)] == []
    flat = [sum(rng.random() < 0.7 for _ in range(512)) / 512 for _ in range(60)]
    stops = [s for s, r in enumerate(flat, 201) for _ in rule.observe(s, {"critic/score/mean": r}, None)]
    assert stops and stops[0] <= 240
    old = RewardPlateau(dataclasses.replace(M.reward_plateau, enable=True, window=1, patience_steps=3))
    assert any(old.observe(s, {"critic/score/mean": r}, None) for s, r in enumerate(rising[:40], 1))


def test_reward_plateau_counts_from_the_best():
    rule = RewardPlateau(M.reward_plateau.__class__(enable=True, patience_steps=2, min_delta=0.1, window=1))
    seq = [0.5, 0.55, 0.7, 0.75, 0.79]  # 0.55 is not > 0.5 + 0.1; 0.7 is; then two flat steps
    out = [kinds(rule.observe(i + 1, {"critic/score/mean": r}, None)) for i, r in enumerate(seq)]
    assert out == [[], [], [], [], ["stop"]] and rule.best == 0.7
    assert rule.observe(6, {"critic/score/mean": math.nan}, None) == []  # NaN is not a plateau step


def test_validation_drop_keeps_best_then_rolls_back():
    rule = ValidationDrop(M.validation_drop.__class__(enable=True))
    val = {
        "val-core/a/reward/mean@1": 0.6,
        "val-core/b/reward/mean@1": 0.8,
        "val-core/a/reward/best@2/mean": 9,
    }
    assert validation_score(val) == pytest.approx(0.7)
    assert kinds(rule.observe(0, {}, val)) == ["save_best"] and rule.best_step == 0
    assert rule.observe(1, {"critic/score/mean": 0.5}, None) == []  # no validation this step
    # 0.7 ≥ 0.9 × 0.75 = 0.675, not better than the best: nothing
    assert rule.observe(2, {"critic/score/mean": 0.75}, val) == []
    (a,) = rule.observe(3, {"critic/score/mean": 0.8}, val)  # 0.7 < 0.72
    assert a.kind == "rollback" and a.values["best_step"] == 0 and a.values["lr_factor"] == 0.5


def test_learning_signal_acts_once_per_stretch_and_names_the_end_of_the_score_range():
    cfg = dataclasses.replace(M.learning_signal, patience_steps=3)
    rule = LearningSignal(cfg)
    low = {"batch/equal_score_groups_score": 0.0, "critic/score/min": 0.0, "critic/score/max": 1.0}
    shares = [0.95, 0.92, 0.5, 0.9, 0.93, 1.0, 1.0, 0.97, 0.4, 0.91, 0.99, 0.95]
    out = [rule.observe(i + 1, {"batch/equal_score_groups": s, **low}, None) for i, s in enumerate(shares)]
    # the dip at step 3 resets; steps 4–6 reach the patience (acts at 6, not again at 7–8); 9 resets; 10–12
    assert [i + 1 for i, a in enumerate(out) if a] == [6, 12]
    (a,) = out[5]
    assert a.rule == "learning_signal" and a.kind == "warn" and a.values["steps"] == 3
    assert "too hard" in a.message and "rollout.n" in a.message
    assert rule.metrics() == {"monitor/learning_signal/steps_equal": 3.0}
    assert rule.observe(13, {"critic/score/mean": 0.5}, None) == []  # no groups (e.g. GAE): state kept
    assert rule.steps_equal == 3
    # near the top of the range: solved; one score for every sample: said so; the stop action
    state = rule.state_dict()
    solved = LearningSignal(dataclasses.replace(cfg, patience_steps=1, action="stop"))
    (a,) = solved.observe(
        1,
        {
            "batch/equal_score_groups": 1.0,
            "batch/equal_score_groups_score": 0.97,
            "critic/score/min": 0.0,
            "critic/score/max": 1.0,
        },
        None,
    )
    assert a.kind == "stop" and "solved" in a.message

    def message(group, low, high):
        (a,) = LearningSignal(dataclasses.replace(cfg, patience_steps=1)).observe(
            1,
            {
                "batch/equal_score_groups": 0.95,
                "batch/equal_score_groups_score": group,
                "critic/score/min": low,
                "critic/score/max": high,
            },
            None,
        )
        return a.message

    assert "every sample scored 0" in message(0.0, 0.0, 0.0)
    # a format penalty below 0: the equal groups at −1 are the failing end, whatever the batch mean
    assert "too hard" in message(-1.0, -1.0, 1.0) and "solved" in message(1.0, -1.0, 1.0)
    assert "some too hard, some solved" in message(0.5, 0.0, 1.0)  # all-0 and all-1 groups alike
    resumed = LearningSignal(cfg)
    resumed.load_state_dict(state)
    assert resumed.steps_equal == 3 and resumed.observe(14, {"batch/equal_score_groups": 0.1}, None) == []


def test_learning_signal_only_for_estimators_that_zero_equal_groups():
    names = lambda est: [r.name for r in build_rules(M, default_target_kl=None, adv_estimator=est)]  # noqa: E731
    assert "learning_signal" in names("grpo") and "learning_signal" in names("rloo")
    # a critic (gae) or a batch-whitened baseline still gives equal-score groups advantages
    assert "learning_signal" not in names("gae") and "learning_signal" not in names(
        "reinforce_plus_plus_baseline"
    )


def test_drift_warns_on_entering_the_range_violation_only():
    rule = Drift(dataclasses.replace(M.drift, patience_steps=1))
    grads = [0.5, 1.5, 2.0, 0.5, 3.0]
    out = [[a.rule for a in rule.observe(i, {"actor/grad_norm": g}, None)] for i, g in enumerate(grads)]
    assert out == [[], ["drift/grad_norm"], [], [], ["drift/grad_norm"]]
    assert rule.metrics() == {"monitor/drift/grad_norm": 1.0}  # only what was measured
    (a,) = rule.observe(8, {"perf/exposed_comm_share": 0.3}, None)
    assert a.rule == "drift/exposed_comm" and a.message.endswith("above 0.1")


def test_drift_waits_patience_steps_and_names_what_to_set():
    """A healthy run has single steps over the grad-norm bound: those do not warn, five in a row do — once,
    naming the keys."""
    rule = Drift(M.drift)
    grads = [1.5, 0.5, 2.0, 3.0, 1.2, 0.9, 1.1, 1.3, 1.4, 1.6, 1.7, 1.8]
    fired = [i for i, g in enumerate(grads, 1) for a in rule.observe(i, {"actor/grad_norm": g}, None)]
    assert fired == [11]  # steps 7–11: the fifth in a row
    gap = Drift(dataclasses.replace(M.drift, patience_steps=1))
    (g,) = gap.observe(1, {"actor/grad_norm": 2.0}, None)
    assert (
        g.message.startswith("actor/grad_norm=2 above 1; ")
        and "actor_rollout_ref.actor.optim.lr" in g.message
    )
    (lp,) = gap.observe(1, {"rollout/log_prob_diff": 0.5}, None)
    assert "actor_rollout_ref.rollout.dtype" in lp.message
    from klppo.config.checks import value_at
    from klppo.config.schema import KLPPOConfig  # every key an advice names exists

    for key in (
        "actor_rollout_ref.actor.grad_clip",
        "actor_rollout_ref.actor.optim.lr",
        "monitor.drift.max_grad_norm",
        "actor_rollout_ref.rollout.dtype",
        "algorithm.rollout_correction",
        "actor_rollout_ref.actor.use_dynamic_bsz",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        "actor_rollout_ref.model.compile_packed_layers",
        "reward_model.launch_reward_fn_async",
    ):
        value_at(KLPPOConfig(), key)


def test_gpu_utilisation_is_not_judged_during_each_process_warm_up():
    """A process's first steps run under the utilisation floor (compilation at new shapes, graph capture):
    its first gpu_util_warmup_steps (10) readings are not judged."""
    rule = Drift(M.drift)
    assert M.drift.gpu_util_warmup_steps == 10
    quiet = [a for step in range(1, 15) for a in rule.observe(step, {"perf/gpu_util": 20.0}, None)]
    assert quiet == []  # ten warm-up readings, then four out of range: under the patience of 5
    (a,) = rule.observe(15, {"perf/gpu_util": 20.0}, None)
    assert a.rule == "drift/gpu_util" and "below 85 for 5 steps" in a.message
    with pytest.raises(ConfigError, match="monitor.drift.gpu_util_warmup_steps=-1"):
        load_config(["monitor.drift.gpu_util_warmup_steps=-1"])


def test_gpu_utilisation_warns_after_patience_steps_and_not_on_the_first_step():
    """A process's first steps (compilation) and single slow steps between normal ones are no reason to
    warn: a process's first values are not judged (here one: gpu_util_warmup_steps=1),
    and only patience_steps (5) steps in a row under the floor warn — once, with what to set; a step
    without the value (CPU, NVML missing) keeps the streak."""
    W1 = load_config(["monitor.drift.gpu_util_warmup_steps=1"]).monitor.drift
    rule = Drift(W1)
    util = [8.0, 90, 60, 91, 80, 84, 70, 55]  # step 1 compiles; then single dips, then four in a row
    assert [a for i, u in enumerate(util, 1) for a in rule.observe(i, {"perf/gpu_util": u}, None)] == []
    assert rule.observe(9, {}, None) == [] and rule.metrics() == {"monitor/drift/gpu_util": 0.0}
    (a,) = rule.observe(10, {"perf/gpu_util": 40.0}, None)  # the fifth step in a row under 85
    assert a.rule == "drift/gpu_util" and a.message.startswith("perf/gpu_util=40 below 85 for 5 steps; ")
    assert "ppo_max_token_len_per_gpu" in a.message and "compile_packed_layers=True" in a.message
    assert rule.observe(11, {"perf/gpu_util": 30.0}, None) == []  # once per excursion
    assert rule.metrics() == {"monitor/drift/gpu_util": 1.0}
    assert (
        rule.observe(12, {"perf/gpu_util": 95.0}, None) == []
        and rule.metrics()["monitor/drift/gpu_util"] == 0
    )
    # a resumed process does not judge its own first step either; the streak comes back from the checkpoint
    state = copy.deepcopy(rule.state_dict())
    assert "cfg_seen" not in state and state["streak"] == {"gpu_util": 0}
    resumed = Drift(W1)
    resumed.load_state_dict(state)
    assert resumed.observe(13, {"perf/gpu_util": 5.0}, None) == [] and resumed.streak == {"gpu_util": 0}
    # a streak the checkpoint carried does not survive the resumed process's warm-up (it would warn after
    # one low reading): the warm-up resets it
    carried = Drift(W1)
    carried.load_state_dict({**state, "streak": {"gpu_util": 4}})
    assert carried.observe(14, {"perf/gpu_util": 95.0}, None) == []  # the warm-up reading
    assert carried.observe(15, {"perf/gpu_util": 20.0}, None) == [] and carried.streak == {"gpu_util": 1}
    one = Drift(
        load_config(["monitor.drift.patience_steps=1", "monitor.drift.gpu_util_warmup_steps=1"]).monitor.drift
    )
    one.observe(1, {"perf/gpu_util": 5.0}, None)
    assert [a.message.split(";")[0] for a in one.observe(2, {"perf/gpu_util": 50.0}, None)] == [
        "perf/gpu_util=50 below 85"
    ]


def test_the_advantage_std_is_watched_where_the_estimator_whitens_or_where_a_bound_is_set():
    """null bounds: [0.8, 1.2] for estimators that whiten over the batch (std 1 unless the batch is
    degenerate); unwatched for grpo, whose std follows the share of equal-score groups (the quickstart's
    std 0.67 with half its groups equal is no drift); a bound the user sets applies to any estimator."""
    from klppo.config import load_config

    def adv_std_actions(est, std, *over):
        cfg = load_config([f"algorithm.adv_estimator={est}", "monitor.drift.patience_steps=1", *over])
        (drift,) = [
            r
            for r in build_rules(cfg.monitor, default_target_kl=None, adv_estimator=est)
            if isinstance(r, Drift)
        ]
        return [a.message for a in drift.observe(1, {"critic/advantages/std": std}, None)]

    assert adv_std_actions("gae", 0.5) == ["critic/advantages/std=0.5 below 0.8"]
    assert adv_std_actions("reinforce_plus_plus", 1.5) == ["critic/advantages/std=1.5 above 1.2"]
    assert adv_std_actions("reinforce_plus_plus_baseline", 0.0) == ["critic/advantages/std=0 below 0.8"]
    assert adv_std_actions("gae", 1.0) == []
    for est in ("grpo", "rloo", "remax", "opo", "gpg", "grpo_passk"):
        assert adv_std_actions(est, 0.0) == [] and adv_std_actions(est, 5.0) == []
    assert adv_std_actions("grpo", 0.2, "monitor.drift.adv_std_low=0.3") == [
        "critic/advantages/std=0.2 below 0.3"
    ]
    assert adv_std_actions("grpo", 5.0, "monitor.drift.adv_std_low=0.3") == []  # the unset side stays off
    assert adv_std_actions("gae", 1.1, "monitor.drift.adv_std_high=1.05") == [
        "critic/advantages/std=1.1 above 1.05"
    ]
    with pytest.raises(Exception, match=r"range \[0.9, 0.5\] is empty"):
        load_config(["monitor.drift.adv_std_low=0.9", "monitor.drift.adv_std_high=0.5"])
    # one bound against the other's default: an empty range is refused where the default applies
    with pytest.raises(Exception, match=r"range \[1.5, 1.2\] is empty .*adv_estimator=gae"):
        load_config(["algorithm.adv_estimator=gae", "monitor.drift.adv_std_low=1.5"])
    load_config(["algorithm.adv_estimator=grpo", "monitor.drift.adv_std_low=1.5"])  # no default high there


def test_the_drift_bounds_come_from_the_config_not_from_a_checkpoint():
    """A resumed run's rule keeps its own config's bounds (a checkpoint holds only what the rule
    observed): bounds set at resume apply, and a run resumed under another estimator uses its default."""
    from klppo.config import load_config

    def drift(est, *over):
        cfg = load_config([f"algorithm.adv_estimator={est}", "monitor.drift.patience_steps=1", *over])
        (rule,) = [
            r
            for r in build_rules(cfg.monitor, default_target_kl=None, adv_estimator=est)
            if isinstance(r, Drift)
        ]
        return rule

    saved = drift("grpo")
    saved.observe(1, {"actor/grad_norm": 5.0}, None)
    state = copy.deepcopy(saved.state_dict())  # as a checkpoint holds it
    resumed = drift("grpo", "monitor.drift.adv_std_low=0.3")
    resumed.load_state_dict(copy.deepcopy(state))
    assert resumed.outside == {"grad_norm": True}  # what was observed comes back
    assert [a.message for a in resumed.observe(2, {"critic/advantages/std": 0.1}, None)] == [
        "critic/advantages/std=0.1 below 0.3"
    ]
    resumed = drift("gae")
    resumed.load_state_dict(copy.deepcopy(state))
    assert resumed.observe(3, {"critic/advantages/std": 0.1}, None)[0].message.endswith("below 0.8")


class FakeControls:
    def __init__(self, best_step=None):
        self.coefs = {"kl_ctrl": 0.01, "kl_loss_coef": 0.001}
        self.entropy_coeff = 0.0
        self.lr_scale = 1.0
        self.saved, self.best_step = [], best_step

    def kl_coefs(self):
        return dict(self.coefs)

    def set_kl_coef(self, name, value):
        self.coefs[name] = value

    def set_entropy_coeff(self, value):
        self.entropy_coeff = value

    def scale_lr(self, factor):
        self.lr_scale *= factor

    def save_best(self, step):
        self.saved.append(step)
        self.best_step = step

    def rollback(self):
        return self.best_step

    def set_oom_retries(self, n):
        pass

    def drain_oom_events(self):
        return []

    def state_dict(self):
        return {"coefs": dict(self.coefs), "entropy_coeff": self.entropy_coeff, "lr_scale": self.lr_scale}

    def load_state_dict(self, s):
        self.coefs, self.entropy_coeff, self.lr_scale = dict(s["coefs"]), s["entropy_coeff"], s["lr_scale"]


def monitor(tmp_path, **groups):
    import dataclasses

    m = dataclasses.replace(MonitorConfig(), **groups)
    cfg = SimpleNamespace(
        monitor=m,
        algorithm=SimpleNamespace(
            kl_ctrl=SimpleNamespace(target_kl=0.1, target_kl_start=None), adv_estimator="grpo"
        ),
    )
    controls = FakeControls()
    return Monitor(cfg, controls, run_dir=tmp_path, rank=0, resume_step=None), controls


def test_kl_explosion_doubles_up_to_the_cap(tmp_path):
    import dataclasses

    mon, c = monitor(
        tmp_path,
        kl_explosion=dataclasses.replace(M.kl_explosion, enable=True, max_coef=0.03, cooldown_steps=1),
    )
    for step in (1, 2, 3):
        mon.observe(step, {"actor/ref_kl_k1": 5.0}, None)
    assert c.coefs == {"kl_ctrl": 0.03, "kl_loss_coef": 0.008}  # 0.01 → 0.02 → 0.03 (cap); 0.001 → 0.008
    m: dict = {"actor/ref_kl_k1": 0.5}
    mon.observe(4, m, None)
    assert "monitor/kl_explosion/scale_kl_coef" not in m and m["monitor/kl_coef/kl_ctrl"] == 0.03


def test_entropy_bonus_set_then_doubled_then_capped(tmp_path):
    import dataclasses

    rule_cfg = dataclasses.replace(M.entropy_collapse, enable=True, max_coeff=0.003, cooldown_steps=1)
    mon, c = monitor(tmp_path, entropy_collapse=rule_cfg)
    seen = []
    for step in (1, 2, 3):
        mon.observe(step, {"actor/entropy": 0.01}, None)
        seen.append(c.entropy_coeff)
    assert seen == [0.001, 0.002, 0.003]
    assert isinstance(EntropyCollapse(rule_cfg).observe(1, {"actor/entropy": 1.0}, None), list)


def test_kl_and_entropy_raises_wait_their_cooldown_and_never_lower(tmp_path):
    """The KL read lags a raise by about two steps: the default cooldown (3) raises at steps 1 and 4 of a
    run over the threshold, not at every step (β 0.001 → 10 in 14 steps before); a coefficient already over
    the cap is not lowered to it, and the message names the key and the change."""
    import dataclasses

    mon, c = monitor(tmp_path, kl_explosion=dataclasses.replace(M.kl_explosion, enable=True))
    raised = [
        s
        for s in range(1, 8)
        if "monitor/kl_explosion/scale_kl_coef" in _observe(mon, s, {"actor/ref_kl_k1": 5.0})
    ]
    assert raised == [1, 4, 7] and c.coefs == {"kl_ctrl": 0.08, "kl_loss_coef": 0.008}
    (event,) = [e for e in mon.events.read() if e["step"] == 1]
    assert "algorithm.kl_ctrl β 0.01 → 0.02" in event["message"]
    assert "actor_rollout_ref.actor.kl_loss_coef 0.001 → 0.002" in event["message"]
    over, c2 = monitor(
        tmp_path / "o", kl_explosion=dataclasses.replace(M.kl_explosion, enable=True, max_coef=0.005)
    )
    c2.coefs["kl_ctrl"] = 20.0  # e.g. an uncapped adaptive controller's β
    _observe(over, 1, {"actor/ref_kl_k1": 5.0})
    assert c2.coefs == {"kl_ctrl": 20.0, "kl_loss_coef": 0.002}
    ent, c3 = monitor(tmp_path / "e", entropy_collapse=dataclasses.replace(M.entropy_collapse, enable=True))
    c3.entropy_coeff = 0.2  # the user's bonus, above max_coeff 0.1
    _observe(ent, 1, {"actor/entropy": 0.01})
    (e,) = ent.events.read()
    assert (
        c3.entropy_coeff == 0.2
        and "actor_rollout_ref.actor.entropy_coeff 0.2 → 0.2, at its cap" in e["message"]
    )
    assert [
        s
        for s in range(2, 8)
        if "monitor/entropy_collapse/raise_entropy_coeff" in _observe(ent, s, {"actor/entropy": 0.01})
    ] == [4, 7]


def _observe(mon, step, metrics):
    m = dict(metrics)
    mon.observe(step, m, None)
    return m


def test_validation_drop_never_rolls_back_from_a_new_best_and_reads_negative_rewards():
    """It fired on validation 0.65 → 0.70 rising behind a training reward of 0.8–0.85 (rolled back to
    the 0.52 weights, lr halved twice), and with negative rewards on validation equal to training."""
    rule = ValidationDrop(M.validation_drop.__class__(enable=True))
    trace = [(10, 0.30, 0.55), (20, 0.52, 0.80), (30, 0.65, 0.85), (40, 0.70, 0.85)]
    acts = [
        kinds(rule.observe(s, {"critic/score/mean": t}, {"val-core/a/reward/mean@1": v})) for s, v, t in trace
    ]
    assert acts == [["save_best"]] * 4 and rule.best_step == 40
    (drop,) = rule.observe(50, {"critic/score/mean": 0.9}, {"val-core/a/reward/mean@1": 0.6})
    assert (
        drop.kind == "rollback"
        and drop.values["best_step"] == 40
        and "monitor.validation_drop.ratio" in drop.message
    )
    neg = ValidationDrop(M.validation_drop.__class__(enable=True))
    assert kinds(neg.observe(1, {"critic/score/mean": -0.5}, {"val-core/a/reward/mean@1": -0.5})) == [
        "save_best"
    ]
    assert (
        neg.observe(2, {"critic/score/mean": -0.5}, {"val-core/a/reward/mean@1": -0.52}) == []
    )  # above −0.55
    assert kinds(neg.observe(3, {"critic/score/mean": -0.5}, {"val-core/a/reward/mean@1": -0.6})) == [
        "rollback"
    ]
    with pytest.raises(Exception, match="action=rollback needs monitor.validation_drop.keep_best=True"):
        load_config(["monitor.validation_drop.enable=True", "monitor.validation_drop.keep_best=False"])
    load_config(
        [
            "monitor.validation_drop.enable=True",
            "monitor.validation_drop.keep_best=False",
            "monitor.validation_drop.action=warn",
        ]
    )


def test_rollback_scales_lr_and_kl_and_state_round_trips(tmp_path):
    import dataclasses

    rule_cfg = dataclasses.replace(M.validation_drop, enable=True, kl_coef_factor=2.0)
    mon, c = monitor(tmp_path, validation_drop=rule_cfg)
    mon.observe_validation(0, {"val-core/a/reward/mean@1": 0.8})
    m: dict = {"critic/score/mean": 1.0}
    assert not mon.observe(1, m, {"val-core/a/reward/mean@1": 0.1})
    assert c.saved == [0] and c.lr_scale == 0.5 and c.coefs == {"kl_ctrl": 0.02, "kl_loss_coef": 0.002}
    assert m["monitor/validation_drop/rollback"] == 1.0
    events = mon.events.read()
    assert [(e["step"], e["action"], e.get("restored_step")) for e in events] == [
        (0, "save_best", None),
        (1, "rollback", 0),
    ]
    state = mon.state_dict()
    again, c2 = monitor(tmp_path / "b", validation_drop=rule_cfg)
    again.load_state_dict(state, best_step_on_disk=0)
    assert again.rules[-1].best == 0.8 and again.counts == mon.counts and c2.lr_scale == 0.5
    stale, _ = monitor(tmp_path / "c", validation_drop=rule_cfg)
    stale.load_state_dict(state, best_step_on_disk=3)  # the checkpoint on disk is not the remembered one
    assert stale.rules[-1].best is None


def test_monitor_off_fires_nothing(tmp_path):
    import dataclasses

    mon, c = monitor(tmp_path, enable=False, kl_explosion=dataclasses.replace(M.kl_explosion, enable=True))
    m: dict = {"actor/ref_kl_k1": 5.0, "critic/score/mean": math.nan}
    assert not mon.observe(1, m, None) and c.coefs["kl_ctrl"] == 0.01 and mon.events.read() == []


def test_rule_state_from_older_checkpoints_and_changed_settings():
    """Drift: a checkpoint from before the streaks that was outside has already warned (no second warning
    for the same excursion); a patience lowered at resume below the saved streak warns at once. The
    plateau: a best from before the moving mean (one step's reward) is not compared with a mean."""
    old = Drift(M.drift)
    old.load_state_dict({"outside": {"grad_norm": True}})
    assert old.streak == {"grad_norm": 5}
    assert [old.observe(s, {"actor/grad_norm": 2.0}, None) for s in (1, 2, 3)] == [[], [], []]
    assert old.metrics() == {"monitor/drift/grad_norm": 1.0}
    saved = Drift(M.drift)
    for s in (1, 2, 3):
        saved.observe(s, {"actor/grad_norm": 2.0}, None)
    lower = Drift(dataclasses.replace(M.drift, patience_steps=2))
    lower.load_state_dict(copy.deepcopy(saved.state_dict()))
    assert kinds(lower.observe(4, {"actor/grad_norm": 2.0}, None)) == ["warn"]
    assert lower.observe(5, {"actor/grad_norm": 2.0}, None) == []
    plateau = RewardPlateau(dataclasses.replace(M.reward_plateau, enable=True))
    plateau.load_state_dict({"best": 0.62, "steps_flat": 2})
    assert plateau.best is None and plateau.steps_flat == 0 and plateau.recent == []


def test_the_rollback_check_and_the_cap_message_follow_what_runs(tmp_path):
    load_config(
        [
            "monitor.enable=False",
            "monitor.validation_drop.enable=True",
            "monitor.validation_drop.keep_best=False",
        ]
    )  # no rule runs: nothing to refuse
    import dataclasses as dc

    mon, c = monitor(tmp_path, kl_explosion=dc.replace(M.kl_explosion, enable=True))
    c.coefs["kl_loss_coef"] = 0.0
    mon.observe(1, {"actor/ref_kl_k1": 5.0}, None)
    (e,) = mon.events.read()
    assert "actor_rollout_ref.actor.kl_loss_coef 0 → 0, unchanged: a coefficient of 0" in e["message"]
    assert "at its cap" not in e["message"]


def test_a_resumed_validation_drop_without_kept_weights_keeps_its_best(tmp_path):
    """With keep_best=False there is never a best-validation checkpoint on disk: the remembered best stays
    (it was forgotten on every resume, so the first validation after it could never be a drop)."""
    import dataclasses as dc

    cfg = dc.replace(M.validation_drop, enable=True, keep_best=False, action="stop")
    mon, _ = monitor(tmp_path, validation_drop=cfg)
    mon.observe_validation(0, {"val-core/a/reward/mean@1": 0.8})
    again, _ = monitor(tmp_path / "b", validation_drop=cfg)
    again.load_state_dict(mon.state_dict(), best_step_on_disk=None)
    assert again.rules[-1].best == 0.8
    assert again.observe(5, {"critic/score/mean": 0.8}, {"val-core/a/reward/mean@1": 0.4})  # stops
