"""KL coefficient controllers: β for the KL penalty in the reward (``algorithm.kl_ctrl.*``) and β of the
actor's KL loss (``actor_rollout_ref.actor.kl_loss_ctrl.*``).

Host-side objects holding one float; the trainer calls ``update`` once per step with the batch KL and
saves ``state_dict()`` in the checkpoint so that β survives a resume (verl loses it).

- ``fixed``: β constant.
- ``adaptive``: verl's rule (Ziegler et al. 2019), a proportional step on β scaled by samples / horizon.
- ``pi``: a proportional-integral controller on log β toward ``target_kl`` (ours): reacts within one step
  to a KL spike (proportional term) and holds the target without a steady-state error (integral term).

``adaptive`` and ``pi`` can follow an annealed target (:class:`TargetSchedule`): a looser target while the
policy learns, then a geometric decay to ``target_kl``, which holds after.
"""

from __future__ import annotations

import math
from typing import Any, Protocol


class KLController(Protocol):
    """What the trainer needs from a controller."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def _check_state_type(state: dict[str, Any], expected: str) -> None:
    if state.get("type") != expected:
        raise ValueError(
            f"KL controller state is of type {state.get('type')!r}, this controller is {expected!r}"
        )


class TargetSchedule:
    """Target KL of the controller's update number t (t = 0 for the first update)::

        t < begin:                 start
        begin ≤ t < begin + steps: start · (final / start) ** ((t − begin) / steps)   (geometric)
        otherwise:                 final

    ``start=None`` is the constant target ``final``.
    """

    def __init__(self, final: float, start: float | None = None, begin: int = 0, steps: int = 0) -> None:
        if not final > 0:
            raise ValueError(f"the KL controller needs target_kl > 0, got {final}")
        if start is not None and not start > 0:
            raise ValueError(f"the annealed KL target's start must be > 0, got {start}")
        if begin < 0 or steps < 0:
            raise ValueError(f"anneal_begin and anneal_steps must be ≥ 0, got {begin} and {steps}")
        self.final, self.start, self.begin, self.steps = float(final), start, int(begin), int(steps)

    @property
    def annealed(self) -> bool:
        return self.start is not None

    def at(self, t: int) -> float:
        if self.start is None or t >= self.begin + self.steps:
            return self.final
        if t < self.begin:
            return float(self.start)
        return float(self.start) * (self.final / float(self.start)) ** ((t - self.begin) / self.steps)


def _load_updates(state: dict[str, Any], schedule: TargetSchedule) -> int:
    if "updates" in state:
        return int(state["updates"])
    if schedule.annealed:
        raise ValueError(
            "this checkpoint's KL controller state has no update count (saved before annealed targets), "
            "so the annealed target cannot resume where it was; resume without target_kl_start"
        )
    return 0


class FixedKLController:
    """β stays ``kl_coef`` (``algorithm.kl_ctrl.type=fixed``)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op (kept so the trainer treats every controller the same)."""

    def state_dict(self) -> dict[str, Any]:
        return {"type": "fixed", "value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_state_type(state, "fixed")
        self.value = float(state["value"])


class AdaptiveKLController:
    """Adaptive β (Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", §2.2).

    update: e = clip(KL / target_kl − 1, −0.2, 0.2);  β ← β · (1 + e · n_steps / horizon).

    As in verl, ``n_steps`` is the number of samples in the training step and ``horizon`` is counted in
    samples (``algorithm.kl_ctrl.horizon``, default 10000). The multiplier stays positive as long as
    n_steps < 5 · horizon.
    """

    def __init__(
        self, init_kl_coef: float, target_kl: float, horizon: int, schedule: TargetSchedule | None = None
    ) -> None:
        if not target_kl > 0:
            raise ValueError(f"adaptive KL control needs target_kl > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"adaptive KL control needs horizon > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.schedule = schedule or TargetSchedule(target_kl)
        self.updates = 0
        self.target = self.schedule.at(0)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β toward keeping the measured KL at ``target_kl``; ``current_kl`` may be a 0-dim tensor."""
        kl = float(current_kl)
        if not math.isfinite(kl):
            raise ValueError(f"KL controller got a non-finite KL ({kl}); β would become {kl}")
        self.target = self.schedule.at(self.updates)
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {
            "type": "adaptive",
            "value": self.value,
            "target": self.target,
            "horizon": self.horizon,
            "updates": self.updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore β. ``target``/``horizon`` come from the (possibly changed) config, not the checkpoint."""
        _check_state_type(state, "adaptive")
        self.value = float(state["value"])
        self.updates = _load_updates(state, self.schedule)
        self.target = self.schedule.at(max(self.updates - 1, 0))  # the target of the last update


class PIKLController:
    """Proportional-integral control of log β toward ``target_kl``.

    With the measured KL_t (floored at 1e-12 · target) and β_0 the initial coefficient::

        e_t   = clip(ln(KL_t / target_kl), −1, 1)                       (log error: symmetric in ratio)
        I_t   = clip(I_{t−1} + e_t, I_lo, I_hi),   I_lo/hi = ln(min_coef/β_0)/ki, ln(max_coef/β_0)/ki
        ln β_t = clip(ln β_0 + kp · e_t + ki · I_t, ln min_coef, ln max_coef)

    The integral's clip (anti-windup) keeps ``ki · I`` inside the coefficient bounds, so a long stretch far
    below the target (early training, KL ≈ 0) cannot delay the response once the KL reaches it. ``n_steps``
    is ignored: the controller acts per training step, whatever the batch size.
    """

    def __init__(
        self,
        init_kl_coef: float,
        target_kl: float,
        *,
        kp: float = 1.0,
        ki: float = 0.2,
        min_coef: float = 1e-4,
        max_coef: float = 10.0,
        schedule: TargetSchedule | None = None,
    ) -> None:
        if not target_kl > 0:
            raise ValueError(f"the pi KL controller needs target_kl > 0, got {target_kl}")
        if not 0 < min_coef <= init_kl_coef <= max_coef:
            raise ValueError(
                "the pi KL controller needs 0 < min_coef ≤ initial coefficient ≤ max_coef, got "
                f"min_coef={min_coef}, initial={init_kl_coef}, max_coef={max_coef}"
            )
        if kp < 0 or not ki > 0:
            raise ValueError(f"the pi KL controller needs kp ≥ 0 and ki > 0, got kp={kp}, ki={ki}")
        self.init = float(init_kl_coef)
        self.schedule = schedule or TargetSchedule(target_kl)
        self.updates = 0
        self.target = self.schedule.at(0)
        self.kp, self.ki = float(kp), float(ki)
        self.log_min, self.log_max = math.log(min_coef), math.log(max_coef)
        self.integral = 0.0
        self.value = self.init

    def update(self, current_kl: float, n_steps: int = 1) -> None:
        kl = float(current_kl)
        if not math.isfinite(kl):
            raise ValueError(f"KL controller got a non-finite KL ({kl}); β would become {kl}")
        self.target = self.schedule.at(self.updates)
        error = min(max(math.log(max(kl, 1e-12 * self.target) / self.target), -1.0), 1.0)
        log_init = math.log(self.init)
        lo, hi = (self.log_min - log_init) / self.ki, (self.log_max - log_init) / self.ki
        self.integral = min(max(self.integral + error, lo), hi)
        log_beta = log_init + self.kp * error + self.ki * self.integral
        self.value = math.exp(min(max(log_beta, self.log_min), self.log_max))
        self.updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"type": "pi", "value": self.value, "integral": self.integral, "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore β and the integral; gains, target and bounds come from the (possibly changed) config."""
        _check_state_type(state, "pi")
        self.value = float(state["value"])
        self.integral = float(state["integral"])
        self.updates = _load_updates(state, self.schedule)
        self.target = self.schedule.at(max(self.updates - 1, 0))  # the target of the last update


KL_CONTROLLER_TYPES = ("fixed", "adaptive", "pi")


def make_kl_controller(
    type: str,
    kl_coef: float,
    target_kl: float | None = None,
    horizon: int = 10000,
    *,
    kp: float = 1.0,
    ki: float = 0.2,
    min_coef: float = 1e-4,
    max_coef: float = 10.0,
    target_kl_start: float | None = None,
    anneal_begin: int = 0,
    anneal_steps: int = 0,
) -> FixedKLController | AdaptiveKLController | PIKLController:
    """Controller from a ``kl_ctrl`` group: ``{type, kl_coef, target_kl, horizon, kp, ki, min_coef, max_coef,
    target_kl_start, anneal_begin, anneal_steps}``.

    ``type`` is one of :data:`KL_CONTROLLER_TYPES`; ``adaptive`` and ``pi`` require ``target_kl > 0``; the
    anneal keys (:class:`TargetSchedule`) apply to those two only.
    """
    if type == "fixed":
        if target_kl_start is not None:
            raise ValueError("an annealed KL target (target_kl_start) needs an adaptive or pi controller")
        return FixedKLController(kl_coef)
    if type in ("adaptive", "pi") and target_kl is None:
        raise ValueError(f"KL controller type {type} needs a target_kl")
    schedule = TargetSchedule(target_kl, target_kl_start, anneal_begin, anneal_steps)
    if type == "adaptive":
        return AdaptiveKLController(kl_coef, target_kl, horizon, schedule)
    if type == "pi":
        return PIKLController(
            kl_coef, target_kl, kp=kp, ki=ki, min_coef=min_coef, max_coef=max_coef, schedule=schedule
        )
    raise ValueError(f"unknown KL controller type {type!r}; valid types: {', '.join(KL_CONTROLLER_TYPES)}")


class PenaltyShareWatch:
    """Warns when the KL penalty in the reward outweighs the task score for ``patience`` steps in a row.

    ``update(share)`` with share = mean_i(β · Σ_t KL_i,t) / mean_i |Σ_t score_i,t| returns True on the step
    the streak reaches ``patience`` (and every ``patience`` steps after, while it lasts).
    """

    def __init__(self, threshold: float = 1.0, patience: int = 5) -> None:
        self.threshold, self.patience = float(threshold), int(patience)
        self.streak = 0

    def update(self, share: float) -> bool:
        self.streak = self.streak + 1 if share > self.threshold else 0
        return self.streak > 0 and self.streak % self.patience == 0
