"""KL coefficient controllers: β for the KL penalty in the reward (verl ``algorithm.kl_ctrl.*``).

Host-side objects holding one float; the trainer calls ``update`` once per step with the batch KL
(``stats["kl"]`` of :func:`klppo.algorithms.kl.apply_kl_penalty`) and saves ``state_dict()`` in the
checkpoint so that β survives a resume (verl loses it).
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

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if not target_kl > 0:
            raise ValueError(f"adaptive KL control needs target_kl > 0, got {target_kl}")
        if not horizon > 0:
            raise ValueError(f"adaptive KL control needs horizon > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move β toward keeping the measured KL at ``target_kl``; ``current_kl`` may be a 0-dim tensor."""
        kl = float(current_kl)
        if not math.isfinite(kl):
            raise ValueError(f"KL controller got a non-finite KL ({kl}); β would become {kl}")
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": "adaptive", "value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore β. ``target``/``horizon`` come from the (possibly changed) config, not the checkpoint."""
        _check_state_type(state, "adaptive")
        self.value = float(state["value"])


def make_kl_controller(
    type: str, kl_coef: float, target_kl: float | None = None, horizon: int = 10000
) -> FixedKLController | AdaptiveKLController:
    """Controller from ``algorithm.kl_ctrl.{type, kl_coef, target_kl, horizon}``.

    ``type`` is ``fixed`` or ``adaptive``; ``adaptive`` requires ``target_kl > 0`` and ``horizon > 0``.
    """
    if type == "fixed":
        return FixedKLController(kl_coef)
    if type == "adaptive":
        if target_kl is None:
            raise ValueError("algorithm.kl_ctrl.type=adaptive needs algorithm.kl_ctrl.target_kl")
        return AdaptiveKLController(kl_coef, target_kl, horizon)
    raise ValueError(f"unknown KL controller type {type!r}; valid types: fixed, adaptive")
