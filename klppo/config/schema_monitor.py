"""The ``monitor`` group: operating rules evaluated on every step's metrics (klppo's own keys, verl style).

Each rule has an ``enable`` switch, its thresholds, and (where a choice exists) the ``action`` it takes; what
the rules do is in `klppo/ops/monitor_rules.py` and `docs/training.md` ("Operating rules").
``check_monitor`` is called by `checks.validate` (choices and ranges, one line naming the key).
"""

from __future__ import annotations

from dataclasses import dataclass

from klppo.config._field import F
from klppo.config.aliases import choice_error
from klppo.config.errors import ConfigError

OPERATING_RULES = "training.md#operating-rules-monitor"


@dataclass(frozen=True)
class KLEarlyStopConfig:
    enable: bool = F(
        False, "Stop when the KL to the reference stays above target_kl for patience_steps steps."
    )
    kl_metric: str = F("actor/ref_kl_k1", "Metric read as the KL to the reference.")
    target_kl: float | None = F(
        None,
        "KL target (null: algorithm.kl_ctrl.target_kl, following its anneal when target_kl_start is set; "
        "required when the KL is not in the reward, or that target is null).",
    )
    patience_steps: int = F(10, "Consecutive steps above the target before the run stops.")


@dataclass(frozen=True)
class RewardPlateauConfig:
    enable: bool = F(False, "Stop when the reward's moving mean has not improved for patience_steps steps.")
    metric: str = F("critic/score/mean", "Metric read as the reward.")
    window: int = F(
        10,
        "[klppo] Steps in the moving mean that is compared with its best (judged once the window is full): "
        "the best of a noisy per-step reward outruns a slow rise.",
    )
    patience_steps: int = F(
        20, "Steps without an improvement of the moving mean by more than min_delta over its best so far."
    )
    min_delta: float = F(0.01, "Smallest rise over the best moving mean that counts as an improvement.")


@dataclass(frozen=True)
class ValidationDropConfig:
    enable: bool = F(False, "Act when a validation score falls below ratio × the training reward.")
    metric: str = F("critic/score/mean", "Training metric the validation score is compared with.")
    ratio: float = F(
        0.9,
        "The rule fires when the validation score is not a new best and falls below ratio × the training "
        "metric of the same step (for a negative training metric: below it by (1 − ratio) × its size).",
    )
    action: str = F(
        "rollback",
        "rollback (best-validation checkpoint, then lr × lr_factor and KL coefficient × kl_coef_factor) | "
        "stop | warn.",
    )
    lr_factor: float = F(0.5, "Actor (and critic) learning rate multiplier applied with a rollback.")
    kl_coef_factor: float = F(
        1.0, "KL coefficient multiplier applied with a rollback (in-reward β, KL loss)."
    )
    keep_best: bool = F(
        True,
        "Save the best-validation weights to <run dir>/best_validation/ (outside max_actor_ckpt_to_keep "
        "rotation); a rollback needs it.",
    )


@dataclass(frozen=True)
class OOMRecoveryConfig:
    enable: bool = F(
        True,
        "Out of memory in an update or a log-prob/value pass: halve that pass's micro-batch (or token "
        "budget) and redo the pass on the same samples (an update's partial gradients dropped first).",
    )
    max_retries: int = F(3, "Halvings per pass before the error stops the run.")


@dataclass(frozen=True)
class KLExplosionConfig:
    enable: bool = F(False, "Multiply the KL coefficient by coef_factor when the KL exceeds threshold.")
    kl_metric: str = F("actor/ref_kl_k1", "Metric read as the KL to the reference.")
    threshold: float = F(1.0, "KL (nats per token) above which the coefficient is raised.")
    coef_factor: float = F(2.0, "Multiplier of the KL coefficient (in-reward β and/or KL-loss coefficient).")
    max_coef: float = F(10.0, "The coefficient is never raised above this (nor lowered when it already is).")
    cooldown_steps: int = F(
        3,
        "[klppo] Steps after a raise before the next one (the KL read is the rollout policy's: a raise shows "
        "about two steps later).",
    )


@dataclass(frozen=True)
class EntropyCollapseConfig:
    enable: bool = F(False, "Act when the policy entropy falls below min_entropy.")
    metric: str = F("actor/entropy", "Metric read as the entropy.")
    min_entropy: float = F(0.1, "Entropy (nats per token) below which the rule fires.")
    action: str = F("raise_coeff", "raise_coeff (entropy bonus) | stop.")
    entropy_coeff: float = F(
        0.001, "raise_coeff: entropy_coeff set to this when lower, else multiplied by coeff_factor."
    )
    coeff_factor: float = F(2.0, "raise_coeff: multiplier when entropy_coeff is already ≥ entropy_coeff.")
    max_coeff: float = F(0.1, "entropy_coeff is never raised above this (nor lowered when it already is).")
    cooldown_steps: int = F(
        3,
        "[klppo] raise_coeff: steps after a raise before the next one (its effect shows about two steps "
        "later).",
    )


@dataclass(frozen=True)
class LearningSignalConfig:
    enable: bool = F(
        True,
        "Act when most groups score equally for patience_steps steps under grpo or rloo, whose equal-score "
        "groups carry no policy gradient (batch/equal_score_groups).",
    )
    max_equal_share: float = F(0.9, "Share of equal-score groups (0-1] at or above which a step counts.")
    patience_steps: int = F(10, "Consecutive such steps before the rule acts (again after the share fell).")
    action: str = F("warn", "warn | stop.")


@dataclass(frozen=True)
class NonFiniteRewardConfig:
    enable: bool = F(True, "Act when the step's mean score is NaN or infinite (a broken reward function).")
    action: str = F("warn", "warn | stop (the step's update was skipped; the last checkpoint is intact).")


@dataclass(frozen=True)
class DriftConfig:
    enable: bool = F(
        True, "Warn (console, events.jsonl, monitor/drift/*) when a watched value leaves its range."
    )
    adv_std_low: float | None = F(
        None,
        "critic/advantages/std below this warns; null: 0.8 where the estimator whitens the advantages over "
        "the "
        "batch, else not watched.",
    )
    adv_std_high: float | None = F(
        None,
        "critic/advantages/std above this warns; null: 1.2 where the estimator whitens, else not watched.",
    )
    max_grad_norm: float = F(1.0, "actor/grad_norm (before clipping) above this warns.")
    max_log_prob_gap: float = F(0.1, "rollout/log_prob_diff (|rollout − actor| log-prob) above this warns.")
    min_gpu_util: float = F(
        85.0,
        "perf/gpu_util (percent, GPU with nvidia-ml-py) below this warns, after gpu_util_warmup_steps.",
    )
    gpu_util_warmup_steps: int = F(
        10,
        "[klppo] Each process's first readings of perf/gpu_util not judged (compilation at new shapes, "
        "allocator growth and CUDA-graph capture).",
    )
    patience_steps: int = F(
        5,
        "[klppo] Consecutive steps out of range before a warning, for every value but the exposed "
        "communication (profiled steps only): one step's grad norm or GPU utilisation is noisy.",
    )
    max_exposed_comm_share: float = F(
        0.1, "perf/exposed_comm_share (profiled steps) above this warns: communication the step waits for."
    )


@dataclass(frozen=True)
class MonitorConfig:
    enable: bool = F(True, "[klppo] Evaluate the operating rules below on every step (false: none).")
    kl_early_stop: KLEarlyStopConfig = F(KLEarlyStopConfig, "[klppo] Early stop on a KL over target.")
    reward_plateau: RewardPlateauConfig = F(RewardPlateauConfig, "[klppo] Early stop on a reward plateau.")
    validation_drop: ValidationDropConfig = F(
        ValidationDropConfig, "[klppo] Rollback or stop on a validation drop."
    )
    oom_recovery: OOMRecoveryConfig = F(
        OOMRecoveryConfig, "[klppo] Out-of-memory retry with smaller micro-batches."
    )
    kl_explosion: KLExplosionConfig = F(
        KLExplosionConfig, "[klppo] Raise the KL coefficient on a KL explosion."
    )
    entropy_collapse: EntropyCollapseConfig = F(EntropyCollapseConfig, "[klppo] Entropy bonus or stop.")
    nonfinite_reward: NonFiniteRewardConfig = F(NonFiniteRewardConfig, "[klppo] NaN/inf reward.")
    learning_signal: LearningSignalConfig = F(
        LearningSignalConfig, "[klppo] Groups without a learning signal (all samples scored the same)."
    )
    drift: DriftConfig = F(DriftConfig, "[klppo] Drift warnings.")


def check_profiler(tool: str | None, steps: list[int] | None) -> None:
    """``global_profiler.tool`` among those klppo runs; ``steps`` positive."""

    if tool is not None and tool not in ("torch", "torch_memory", "nsys"):
        raise choice_error("global_profiler.tool", tool, ("torch", "torch_memory", "nsys", "null"))
    if any(s < 1 for s in steps or []):
        raise ConfigError(f"global_profiler.steps={list(steps)}: training steps count from 1")


def check_monitor(m: MonitorConfig) -> None:
    """Choices and ranges of the monitor group; ConfigError naming the key."""

    choices = (
        ("monitor.validation_drop.action", m.validation_drop.action, ("rollback", "stop", "warn")),
        ("monitor.entropy_collapse.action", m.entropy_collapse.action, ("raise_coeff", "stop")),
        ("monitor.nonfinite_reward.action", m.nonfinite_reward.action, ("warn", "stop")),
        ("monitor.learning_signal.action", m.learning_signal.action, ("warn", "stop")),
    )
    for key, value, valid in choices:
        if value not in valid:
            raise choice_error(key, value, valid)
    positive = (
        ("monitor.kl_early_stop.patience_steps", m.kl_early_stop.patience_steps),
        ("monitor.reward_plateau.patience_steps", m.reward_plateau.patience_steps),
        ("monitor.reward_plateau.window", m.reward_plateau.window),
        ("monitor.validation_drop.lr_factor", m.validation_drop.lr_factor),
        ("monitor.validation_drop.kl_coef_factor", m.validation_drop.kl_coef_factor),
        ("monitor.kl_explosion.coef_factor", m.kl_explosion.coef_factor),
        ("monitor.entropy_collapse.coeff_factor", m.entropy_collapse.coeff_factor),
        ("monitor.learning_signal.patience_steps", m.learning_signal.patience_steps),
        ("monitor.drift.patience_steps", m.drift.patience_steps),
        ("monitor.kl_explosion.cooldown_steps", m.kl_explosion.cooldown_steps),
        ("monitor.entropy_collapse.cooldown_steps", m.entropy_collapse.cooldown_steps),
    )
    for key, value in positive:
        if not value > 0:
            raise ConfigError(f"{key}={value}: must be > 0")
    if not 0 < m.learning_signal.max_equal_share <= 1:
        raise ConfigError(
            f"monitor.learning_signal.max_equal_share={m.learning_signal.max_equal_share}: must be in (0, 1]"
        )
    v = m.validation_drop
    if m.enable and v.enable and v.action == "rollback" and not v.keep_best:
        raise ConfigError(
            "monitor.validation_drop.action=rollback needs monitor.validation_drop.keep_best=True (the "
            "rollback returns to the best-validation weights it keeps); or set action=warn or stop"
        )
    if m.drift.gpu_util_warmup_steps < 0:
        raise ConfigError(f"monitor.drift.gpu_util_warmup_steps={m.drift.gpu_util_warmup_steps}: must be ≥ 0")
    if m.oom_recovery.max_retries < 0:
        raise ConfigError(f"monitor.oom_recovery.max_retries={m.oom_recovery.max_retries}: must be ≥ 0")
    if m.kl_early_stop.target_kl is not None and not m.kl_early_stop.target_kl > 0:
        raise ConfigError(f"monitor.kl_early_stop.target_kl={m.kl_early_stop.target_kl}: must be > 0 or null")
    # the advantage-std range: klppo.config.checks._check_drift_range (its defaults depend on the estimator)
