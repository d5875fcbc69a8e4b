"""The operating rules: each reads one step's metrics (and the step's validation metrics, when validation
ran) and says what should happen, as `Action` records; `klppo.ops.monitor.Monitor` carries them out.

A rule holds only the counters its decision needs (``state_dict`` / ``load_state_dict`` for exact resume)
and never touches the run. A metric that is absent (e.g. no reference model → no ``actor/ref_kl_k1``)
makes its rule a no-op for that step. Rules and their defaults (``monitor.*`` keys):

==================  =====================================================  ===============================
rule                fires when                                             action
==================  =====================================================  ===============================
kl_early_stop       KL > target_kl for patience_steps consecutive steps    stop
reward_plateau      reward's moving mean not above best + min_delta for    stop
                    patience_steps
validation_drop     val score < ratio × training reward of that step       rollback | stop | warn
kl_explosion        KL > threshold                                         KL coefficient × coef_factor
entropy_collapse    entropy < min_entropy                                  raise entropy_coeff | stop
nonfinite_reward    mean score NaN/inf                                     warn | stop
learning_signal     equal-score groups ≥ max_equal_share for patience      warn | stop (once, again after
                    steps (group estimators)                               the share fell below)
drift               adv std ∉ [low, high], grad norm > max, |rollout −     warn (once per excursion,
                    actor| log-prob > max, GPU util < min for patience     after patience_steps out)
                    steps; exposed communication share > max
==================  =====================================================  ===============================
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from klppo.algorithms.kl_control import TargetSchedule
from klppo.config.checks import WHITENED_ESTIMATORS, ZERO_EQUAL_GROUP_ESTIMATORS, drift_adv_std_range
from klppo.config.schema_monitor import (
    DriftConfig,
    EntropyCollapseConfig,
    KLEarlyStopConfig,
    KLExplosionConfig,
    LearningSignalConfig,
    MonitorConfig,
    NonFiniteRewardConfig,
    RewardPlateauConfig,
    ValidationDropConfig,
)


@dataclass
class Action:
    """What a rule asks for. ``kind``: stop | rollback | scale_kl_coef | raise_entropy_coeff | warn |
    save_best (silent bookkeeping: keep the current weights as the best-validation checkpoint)."""

    rule: str
    kind: str
    message: str
    values: dict[str, float] = field(default_factory=dict)


def _finite(metrics: dict[str, float], key: str) -> float | None:
    value = metrics.get(key)
    if value is None or not math.isfinite(float(value)):
        return None
    return float(value)


def validation_score(val_metrics: dict[str, float]) -> float | None:
    """Mean over data sources of ``val-core/<source>/reward/mean@n`` (None when there is none)."""
    scores = [v for k, v in val_metrics.items() if k.startswith("val-core/") and "/reward/mean@" in k]
    return sum(scores) / len(scores) if scores else None


class Rule:
    """Base: no state. ``observe`` returns the step's actions; ``metrics`` the rule's ``monitor/*`` values."""

    name = "rule"

    def observe(self, step: int, metrics: dict[str, float], val: dict[str, float] | None) -> list[Action]:
        raise NotImplementedError

    def metrics(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if not k.startswith("cfg")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for k, v in state.items():
            setattr(self, k, v)


class KLEarlyStop(Rule):
    name = "kl_early_stop"

    def __init__(self, cfg: KLEarlyStopConfig, target_kl: float | TargetSchedule) -> None:
        """``target_kl``: a number, or the reward-side controller's (annealed) schedule, read at the
        step's update (step t is update t − 1), so a loose early target does not stop the run."""
        self.cfg = cfg
        self.cfg_schedule = (
            target_kl if isinstance(target_kl, TargetSchedule) else TargetSchedule(float(target_kl))
        )
        self.cfg_target = self.cfg_schedule.at(0)
        self.steps_over = 0

    def observe(self, step, metrics, val):
        kl = _finite(metrics, self.cfg.kl_metric)
        if kl is None:
            return []
        self.cfg_target = self.cfg_schedule.at(max(int(step) - 1, 0))
        self.steps_over = self.steps_over + 1 if kl > self.cfg_target else 0
        if self.steps_over < self.cfg.patience_steps:
            return []
        return [
            Action(
                self.name,
                "stop",
                f"{self.cfg.kl_metric}={kl:.4g} above target {self.cfg_target:g} for {self.steps_over} "
                f"steps (monitor.kl_early_stop.patience_steps={self.cfg.patience_steps})",
                {"kl": kl, "target_kl": self.cfg_target, "steps_over": self.steps_over},
            )
        ]

    def metrics(self):
        return {"monitor/kl_early_stop/steps_over_target": float(self.steps_over)}


class RewardPlateau(Rule):
    name = "reward_plateau"

    def __init__(self, cfg: RewardPlateauConfig) -> None:
        self.cfg = cfg
        self.best: float | None = None  # the best moving mean
        self.steps_flat = 0
        self.recent: list[float] = []  # the last `window` rewards

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "recent" not in state:  # a checkpoint from before the moving mean: its best is one step's reward
            return
        super().load_state_dict(state)

    def observe(self, step, metrics, val):
        reward = _finite(metrics, self.cfg.metric)
        if reward is None:
            return []
        c = self.cfg
        self.recent = [*self.recent, reward][-c.window :]
        if len(self.recent) < c.window:
            return []
        mean = sum(self.recent) / len(self.recent)
        if self.best is None or mean > self.best + c.min_delta:
            self.best, self.steps_flat = mean, 0
            return []
        self.steps_flat += 1
        if self.steps_flat < c.patience_steps:
            return []
        return [
            Action(
                self.name,
                "stop",
                f"the {c.window}-step mean of {c.metric} ({mean:.4g}) has not risen above its best "
                f"{self.best:.4g} by more than {c.min_delta:g} for {self.steps_flat} steps "
                f"(monitor.reward_plateau.patience_steps={c.patience_steps}, min_delta, window)",
                {"reward": reward, "mean": mean, "best": self.best, "steps_flat": self.steps_flat},
            )
        ]

    def metrics(self):
        return {"monitor/reward_plateau/steps_without_improvement": float(self.steps_flat)}


class ValidationDrop(Rule):
    """Fires when a validation score < ratio × the training reward of the same step; otherwise a new best
    validation score asks for the weights to be kept (``save_best``), which a later rollback returns to."""

    name = "validation_drop"

    def __init__(self, cfg: ValidationDropConfig) -> None:
        self.cfg = cfg
        self.best: float | None = None
        self.best_step: int | None = None

    def observe(self, step, metrics, val):
        score = validation_score(val or {})
        if score is None:
            return []
        if self.best is None or score > self.best:  # a new best is never a drop (nor rolled back from)
            self.best, self.best_step = score, step
            if self.cfg.keep_best:
                return [
                    Action(self.name, "save_best", f"best validation score {score:.4g}", {"val_score": score})
                ]
            return []
        train = _finite(metrics, self.cfg.metric)
        c = self.cfg
        if train is None or not score < train - (1.0 - c.ratio) * abs(train):  # ratio × train when train ≥ 0
            return []
        values = {"val_score": score, "train_reward": train, "ratio": c.ratio}
        message = (
            f"validation score {score:.4g} (best {self.best:.4g} at step {self.best_step}) below {c.ratio:g} "
            f"× training {c.metric} {train:.4g}"
        )
        if c.action == "rollback":
            values.update(lr_factor=c.lr_factor, kl_coef_factor=c.kl_coef_factor, best_step=self.best_step)
            message += (
                f": back to the best validation's weights, lr × {c.lr_factor:g}, KL coefficient × "
                f"{c.kl_coef_factor:g}"
            )
        hint = " (monitor.validation_drop.ratio" + (
            "; action=warn only warns)" if c.action != "warn" else ")"
        )
        return [Action(self.name, c.action, message + hint, values)]

    def metrics(self):
        return {} if self.best is None else {"monitor/validation_drop/best_val_score": self.best}


def _cooling(last_step: int | None, step: int, cooldown: int) -> bool:
    """True while fewer than ``cooldown`` steps have passed since the rule last acted."""
    return last_step is not None and int(step) - last_step < cooldown


class KLExplosion(Rule):
    name = "kl_explosion"

    def __init__(self, cfg: KLExplosionConfig) -> None:
        self.cfg = cfg
        self.last_step: int | None = None  # the step of the last raise (cooldown_steps before the next)

    def observe(self, step, metrics, val):
        kl = _finite(metrics, self.cfg.kl_metric)
        if kl is None or kl <= self.cfg.threshold or _cooling(self.last_step, step, self.cfg.cooldown_steps):
            return []
        self.last_step = int(step)
        return [
            Action(
                self.name,
                "scale_kl_coef",
                f"{self.cfg.kl_metric}={kl:.4g} above {self.cfg.threshold:g}: KL coefficient × "
                f"{self.cfg.coef_factor:g} (at most {self.cfg.max_coef:g})",
                {"kl": kl, "factor": self.cfg.coef_factor, "max_coef": self.cfg.max_coef},
            )
        ]


class EntropyCollapse(Rule):
    name = "entropy_collapse"

    def __init__(self, cfg: EntropyCollapseConfig) -> None:
        self.cfg = cfg
        self.last_step: int | None = None  # the step of the last raise (cooldown_steps before the next)

    def observe(self, step, metrics, val):
        entropy = _finite(metrics, self.cfg.metric)
        c = self.cfg
        if entropy is None or entropy >= c.min_entropy:
            return []
        message = f"{c.metric}={entropy:.4g} below {c.min_entropy:g}"
        if c.action == "stop":
            return [Action(self.name, "stop", message, {"entropy": entropy})]
        if _cooling(self.last_step, step, c.cooldown_steps):
            return []
        self.last_step = int(step)
        return [
            Action(
                self.name,
                "raise_entropy_coeff",
                message + ": entropy bonus raised",
                {
                    "entropy": entropy,
                    "entropy_coeff": c.entropy_coeff,
                    "factor": c.coeff_factor,
                    "max_coeff": c.max_coeff,
                },
            )
        ]


class NonFiniteReward(Rule):
    name = "nonfinite_reward"

    def __init__(self, cfg: NonFiniteRewardConfig) -> None:
        self.cfg = cfg

    def observe(self, step, metrics, val):
        score = metrics.get("critic/score/mean")
        if score is None or math.isfinite(float(score)):
            return []
        return [
            Action(
                self.name,
                self.cfg.action,
                f"the mean score is {score}: the reward function returned NaN/inf (the update of this "
                "step was skipped; check the reward function)",
                {"score": float(score)},
            )
        ]


class LearningSignal(Rule):
    """GRPO/RLOO-style estimators give a group whose samples all scored the same advantage 0: when most
    groups do so for ``patience_steps`` steps, most of each step's samples teach the policy nothing. Acts
    once per such stretch; the message says which end of the score range the groups sit at (failing: the
    prompts are too hard for the policy; succeeding: already solved)."""

    name = "learning_signal"

    def __init__(self, cfg: LearningSignalConfig) -> None:
        self.cfg = cfg
        self.steps_equal = 0

    def observe(self, step, metrics, val):
        share = _finite(metrics, "batch/equal_score_groups")
        if share is None:  # not a group estimator (or no groups this step): state kept
            return []
        c = self.cfg
        self.steps_equal = self.steps_equal + 1 if share >= c.max_equal_share else 0
        if self.steps_equal != c.patience_steps:  # acts on reaching the patience, not on every step after
            return []
        where = _where_equal_groups_score(metrics)
        message = (
            f"batch/equal_score_groups={share:.3g} ≥ {c.max_equal_share:g} for {self.steps_equal} steps: "
            f"those groups' samples carry no policy gradient{where}"
        )
        return [
            Action(self.name, c.action, message, {"equal_score_groups": share, "steps": self.steps_equal})
        ]

    def metrics(self):
        return {"monitor/learning_signal/steps_equal": float(self.steps_equal)}


def _where_equal_groups_score(metrics: dict[str, float]) -> str:
    """Where the equal-score groups' own mean score sits in the step's score range: at the low end (the
    prompts are too hard), the high end (solved), or both (groups at each end); "" when unknown."""
    group, low, high = (
        _finite(metrics, k)
        for k in ("batch/equal_score_groups_score", "critic/score/min", "critic/score/max")
    )
    if group is None or low is None or high is None:
        return ""
    if high - low <= 1e-12:
        return f"; every sample scored {group:.4g}"
    position = (group - low) / (high - low)
    if position <= 0.25:
        return (
            f"; those groups score {group:.4g} on average, near the lowest score ({low:.4g}): the prompts "
            "are too hard for the policy — more samples per prompt (actor_rollout_ref.rollout.n), easier "
            "prompts or a shaped reward"
        )
    if position >= 0.75:
        return (
            f"; those groups score {group:.4g} on average, near the highest score ({high:.4g}): the prompts "
            "are solved — harder prompts, or stop"
        )
    return (
        f"; those groups score {group:.4g} on average, between the lowest ({low:.4g}) and the highest "
        f"({high:.4g}): some too hard, some solved"
    )


GRAD_NORM_ADVICE = (
    "the gradient clip (actor_rollout_ref.actor.grad_clip) cuts update after update: lower "
    "actor_rollout_ref.actor.optim.lr, or raise monitor.drift.max_grad_norm where such norms are expected"
)
LOG_PROB_GAP_ADVICE = (
    "the rollout's log-probs of its own tokens differ from the actor's: a rollout in another precision "
    "(actor_rollout_ref.rollout.dtype) or weights out of sync; algorithm.rollout_correction weighs for it"
)
GPU_UTIL_ADVICE = (
    "the GPU idles part of each step (the timing_s/* phases say where): most often micro-batches too small "
    "for the GPU — actor_rollout_ref.actor.use_dynamic_bsz=True with a larger ppo_max_token_len_per_gpu "
    "(`klppo tune` sizes it), actor_rollout_ref.model.compile_packed_layers=True; with a large "
    "timing_s/reward, reward_model.launch_reward_fn_async=True"
)


DRIFT_ADVICE = {
    "grad_norm": GRAD_NORM_ADVICE,
    "log_prob_gap": LOG_PROB_GAP_ADVICE,
    "gpu_util": GPU_UTIL_ADVICE,
}


class Drift(Rule):
    """Warnings only, once when a value leaves its range (again after it came back). ``whitened``: the
    advantage estimator whitens over the batch, so ``adv_std_low/high`` left null mean 0.8 / 1.2; otherwise
    null leaves the advantage std unwatched (a set bound applies to any estimator). A value warns after
    ``patience_steps`` steps in a row out of range (the exposed communication, read on profiled steps only,
    at once); each process's first ``gpu_util_warmup_steps`` GPU utilisation readings (compilation at new
    shapes, allocator growth, graph capture) are not judged."""

    name = "drift"

    def __init__(self, cfg: DriftConfig, *, whitened: bool = True) -> None:
        self.cfg = cfg
        self.outside: dict[str, bool] = {}
        self.streak: dict[str, int] = {}  # consecutive steps out of range
        # cfg_*: from the config or this process, never from a checkpoint (Rule.state_dict leaves them out)
        self.cfg_adv_std = drift_adv_std_range(cfg, whitened=whitened)
        self.cfg_seen: dict[str, int] = {}  # readings of a warmed-up value in this process

    def _ranges(self) -> list[tuple[str, str, float | None, float | None, int]]:
        """(name, metric, lowest fine value or None, highest or None, steps out of range before a warning)."""
        c = self.cfg
        n = c.patience_steps
        return [
            ("adv_std", "critic/advantages/std", *self.cfg_adv_std, n),
            ("grad_norm", "actor/grad_norm", None, c.max_grad_norm, n),
            ("log_prob_gap", "rollout/log_prob_diff", None, c.max_log_prob_gap, n),
            ("gpu_util", "perf/gpu_util", c.min_gpu_util, None, n),
            ("exposed_comm", "perf/exposed_comm_share", None, c.max_exposed_comm_share, 1),
        ]

    def observe(self, step, metrics, val):
        actions = []
        for name, key, low, high, patience in self._ranges():
            value = _finite(metrics, key)
            if value is None or (low is None and high is None):
                continue  # not measured this step (no critic, CPU, not a profiled step) or not watched
            if name == "gpu_util" and self.cfg_seen.get(name, 0) < self.cfg.gpu_util_warmup_steps:
                self.cfg_seen[name] = self.cfg_seen.get(name, 0) + 1  # compilation and warm-up, not drift
                self.streak[name] = 0  # nor a streak a checkpoint carried: counted again after the warm-up
                continue
            bad = (low is not None and value < low) or (high is not None and value > high)
            self.streak[name] = self.streak.get(name, 0) + 1 if bad else 0
            if self.streak[name] >= patience and not self.outside.get(name, False):
                where = f"below {low:g}" if low is not None and value < low else f"above {high:g}"
                if patience > 1:
                    where += f" for {patience} steps"
                advice = DRIFT_ADVICE.get(name, "")
                advice = f"; {advice}" if advice else ""
                actions.append(
                    Action(f"drift/{name}", "warn", f"{key}={value:.4g} {where}{advice}", {"value": value})
                )
            self.outside[name] = self.streak[name] >= patience
        return actions

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        patience = {r[0]: r[4] for r in self._ranges()}
        # a checkpoint from before the streaks: already warned where it was outside
        for name, out in self.outside.items():
            self.streak.setdefault(name, patience.get(name, 1) if out else 0)

    def metrics(self):
        return {f"monitor/drift/{name}": float(v) for name, v in sorted(self.outside.items())}


def build_rules(
    cfg: MonitorConfig, *, default_target_kl: float | TargetSchedule | None, adv_estimator: str | None = None
) -> list[Rule]:
    """The enabled rules of a ``monitor`` config group, in evaluation order. ``default_target_kl``: the
    reward-side controller's target (a schedule when annealed), for ``kl_early_stop.target_kl: null``;
    ``adv_estimator``: ``learning_signal`` watches only estimators that zero equal-score groups (GRPO,
    RLOO: with a critic or a batch baseline such groups still get advantages)."""
    m = cfg
    rules: list[Rule] = []
    if m.nonfinite_reward.enable:
        rules.append(NonFiniteReward(m.nonfinite_reward))
    if m.learning_signal.enable and adv_estimator in ZERO_EQUAL_GROUP_ESTIMATORS:
        rules.append(LearningSignal(m.learning_signal))
    if m.drift.enable:
        rules.append(Drift(m.drift, whitened=adv_estimator is None or adv_estimator in WHITENED_ESTIMATORS))
    if m.kl_explosion.enable:
        rules.append(KLExplosion(m.kl_explosion))
    if m.entropy_collapse.enable:
        rules.append(EntropyCollapse(m.entropy_collapse))
    if m.validation_drop.enable:
        rules.append(ValidationDrop(m.validation_drop))
    if m.kl_early_stop.enable:
        target = m.kl_early_stop.target_kl if m.kl_early_stop.target_kl is not None else default_target_kl
        rules.append(KLEarlyStop(m.kl_early_stop, target))
    if m.reward_plateau.enable:
        rules.append(RewardPlateau(m.reward_plateau))
    return rules
