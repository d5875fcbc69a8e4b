"""The run watching itself: `Monitor` evaluates the ``monitor.*`` rules (`monitor_rules`) after every step
and carries out what they ask, through `RunControls` (the knobs on the run's parts).

Every action gives a console line (rank 0), ``monitor/*`` metrics in the step's record, a line in
``<run dir>/events.jsonl`` and a count in the end-of-run summary. Every rank evaluates the same rules on
the same (rank-reduced) metrics, so all ranks take the same actions; checkpoint saves and loads inside an
action are collective. The monitor's counters and the coefficients it changed are part of the checkpoint
(``state_dict``), so a resumed run acts as the uninterrupted one would.

Metrics (step k's record): ``monitor/<rule>/<action>`` = 1 for each action taken at step k,
``monitor/num_actions`` (cumulative), each rule's counters, and the coefficients in force *after* step k's
actions — ``monitor/kl_coef/<name>``, ``monitor/entropy_coeff``, ``monitor/lr_scale`` — which step k + 1
trains with."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from klppo.algorithms.kl_control import TargetSchedule
from klppo.config import KLPPOConfig
from klppo.ops.checkpoint import checkpoint_step, latest_checkpoint, load_role, save_checkpoint
from klppo.ops.monitor_rules import Action, build_rules
from klppo.tracking.events import EventLog

if TYPE_CHECKING:
    from klppo.assembly.setup import Run

log = logging.getLogger("klppo")

BEST_DIR = "best_validation"
"""Subdirectory of the run directory holding the best-validation checkpoint (never pruned by
``trainer.max_actor_ckpt_to_keep``, never taken for the latest checkpoint by ``resume_mode=auto``)."""


def _reward_target(ctrl: Any) -> float | TargetSchedule | None:
    """``algorithm.kl_ctrl``'s target as the monitor reads it: its schedule when annealed."""
    if ctrl.target_kl is None or ctrl.target_kl_start is None:
        return ctrl.target_kl
    return TargetSchedule(ctrl.target_kl, ctrl.target_kl_start, ctrl.anneal_begin, ctrl.anneal_steps)


KL_COEF_KEYS = {"kl_ctrl": "algorithm.kl_ctrl β", "kl_loss_coef": "actor_rollout_ref.actor.kl_loss_coef"}
"""The config key behind each coefficient ``RunControls.kl_coefs`` names, for the monitor's messages."""


def _unchanged(old: float, new: float, cap: float) -> str:
    """Why a raise left a coefficient where it was ("" when it moved)."""
    if new != old:
        return ""
    return (
        ", at its cap" if old >= cap else ", unchanged: a coefficient of 0 (or a factor of 1) is not raised"
    )


class RunControls:
    """The knobs the rules turn: KL coefficients, the entropy bonus, learning rates, best-validation
    weights. ``save_best(step)`` and ``rollback() -> step or None`` are the trainer's (collective)."""

    def __init__(
        self, run: Run, *, save_best: Callable[[int], None], rollback: Callable[[], int | None]
    ) -> None:
        self.run = run
        self.save_best = save_best
        self.rollback = rollback
        self.lr_scale = 1.0
        self.coef_scales: dict[str, float] = {}  # product of the changes made to each β

    def kl_coefs(self) -> dict[str, float]:
        """The KL coefficients in use: in-reward β (``algorithm.kl_ctrl``) and the KL-loss β
        (``actor.kl_loss_ctrl``)."""
        out = {}
        if self.run.cfg.algorithm.use_kl_in_reward:
            out["kl_ctrl"] = float(self.run.kl_ctrl.value)
        if self.run.roles.actor.settings.use_kl_loss:
            out["kl_loss_coef"] = float(self.run.kl_loss_ctrl.value)
        return out

    def _controller(self, name: str) -> Any:
        return self.run.kl_ctrl if name == "kl_ctrl" else self.run.kl_loss_ctrl

    def set_kl_coef(self, name: str, value: float) -> None:
        """Set β; a controller that recomputes β from its initial value each step (``pi``) gets that value
        scaled alike, so that the change holds (fixed and adaptive controllers move on from β itself)."""
        ctrl = self._controller(name)
        ratio = float(value) / ctrl.value if ctrl.value > 0 else 1.0
        ctrl.value = float(value)
        self.coef_scales[name] = self.coef_scales.get(name, 1.0) * ratio
        if hasattr(ctrl, "init"):
            ctrl.init *= ratio

    @property
    def entropy_coeff(self) -> float:
        return float(self.run.roles.actor.settings.entropy_coeff)

    def set_entropy_coeff(self, value: float) -> None:
        self._set_actor(entropy_coeff=float(value))

    def _set_actor(self, **changes: float) -> None:
        actor = self.run.roles.actor
        actor.settings = dataclasses.replace(actor.settings, **changes)

    def scale_lr(self, factor: float) -> None:
        """Multiply the trained roles' learning rates (the schedule's base, so it holds for later steps)."""
        self.lr_scale *= factor
        for role in self.run.roles.trained().values():
            sched = role.scheduler
            sched.base_lrs = [base * factor for base in sched.base_lrs]
            self.sync_lr(role)

    @staticmethod
    def sync_lr(role: Any) -> None:
        """Set each param group's lr to what the schedule says now (after a rollback restored old ones)."""
        sched = role.scheduler
        for group, base, fn in zip(role.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
            group["lr"] = base * fn(sched.last_epoch)

    def _oom_roles(self) -> list[Any]:
        roles = self.run.roles
        return [r for r in (roles.actor, roles.critic, roles.reference) if r is not None]

    def set_oom_retries(self, max_retries: int) -> None:
        for role in self._oom_roles():
            role.oom.max_retries = max_retries

    def drain_oom_events(self) -> list[dict[str, Any]]:
        out = []
        for role in self._oom_roles():
            out += role.oom.events
            role.oom.events = []
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "entropy_coeff": self.entropy_coeff,
            "lr_scale": self.lr_scale,
            "coef_scales": self.coef_scales,
            "oom_micro": {role.oom.role: role.oom.state_dict() for role in self._oom_roles()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpointed run's changes: the entropy bonus; β values come back with the controllers'
        own state (a ``pi`` controller's initial β is re-scaled here), learning rates with the schedulers."""
        self._set_actor(entropy_coeff=state["entropy_coeff"])
        self.lr_scale = float(state["lr_scale"])
        self.coef_scales = dict(state["coef_scales"])
        for role in self._oom_roles():  # micro-batches halved after out-of-memory errors stay halved
            role.oom.load_state_dict(state.get("oom_micro", {}).get(role.oom.role, {}))
        for name, scale in self.coef_scales.items():
            ctrl = self._controller(name)
            if hasattr(ctrl, "init"):
                ctrl.init *= scale


class Monitor:
    """``observe(step, metrics, val)`` after each step (``val``: that step's validation metrics or None)
    → True when a rule stops the run; ``finish(step)`` writes the summary."""

    def __init__(
        self, cfg: KLPPOConfig, controls: RunControls, *, run_dir: Path, rank: int, resume_step: int | None
    ) -> None:
        m = cfg.monitor
        self.controls = controls
        self.rank = rank
        self.rules = (
            build_rules(
                m,
                default_target_kl=_reward_target(cfg.algorithm.kl_ctrl),
                adv_estimator=cfg.algorithm.adv_estimator,
            )
            if m.enable
            else []
        )
        self.events = EventLog(run_dir, rank=rank, resume_step=resume_step)
        self.counts: dict[str, int] = {}
        self.stop_reason: str | None = None
        if m.enable and m.oom_recovery.enable:
            controls.set_oom_retries(m.oom_recovery.max_retries)

    # ------------------------------------------------------------------ per step
    def observe(self, step: int, metrics: dict[str, float], val: dict[str, float] | None) -> bool:
        """Run the rules on step ``step``; act; add ``monitor/*`` to ``metrics`` in place."""
        fired: dict[str, float] = {}
        retries = self._record_oom_retries(step)
        if retries:
            fired["monitor/oom_recovery/retries"] = float(retries)
        for rule in self.rules:
            for action in rule.observe(step, metrics, val):
                self._act(step, action)
                if action.kind != "save_best":
                    fired[f"monitor/{action.rule}/{action.kind}"] = 1.0
        metrics.update(fired)
        metrics.update(self.metrics())
        return self.stop_reason is not None

    def _record_oom_retries(self, step: int) -> int:
        records = self.controls.drain_oom_events()
        for r in records:
            self._record(
                step, Action(f"oom_recovery/{r.pop('role')}", "halve_micro_batch", r.pop("message"), r)
            )
        return len(records)

    def observe_validation(self, step: int, val: dict[str, float]) -> None:
        """A validation outside a training step (before the first): the best-validation bookkeeping."""
        self.observe(step, {}, val)

    def metrics(self) -> dict[str, float]:
        c = self.controls
        out = {"monitor/num_actions": float(sum(self.counts.values()))}
        for rule in self.rules:
            out.update(rule.metrics())
        out.update({f"monitor/kl_coef/{k}": v for k, v in c.kl_coefs().items()})
        out["monitor/entropy_coeff"] = c.entropy_coeff
        out["monitor/lr_scale"] = c.lr_scale
        return out

    # ------------------------------------------------------------------ actions
    def _act(self, step: int, a: Action) -> None:
        c, v = self.controls, a.values
        if a.kind == "save_best":
            c.save_best(step)
            self.events.write({"step": step, "rule": a.rule, "action": a.kind, "message": a.message, **v})
            return
        if a.kind == "stop":
            self.stop_reason = f"{a.rule}: {a.message}"
        elif a.kind == "rollback":
            restored = c.rollback()
            if restored is None:
                a.message += " — no best-validation checkpoint yet: weights kept"
            v["restored_step"] = -1 if restored is None else restored
            c.scale_lr(a.values["lr_factor"])
            for name, old in c.kl_coefs().items():
                c.set_kl_coef(name, old * a.values["kl_coef_factor"])
                v[f"{name}_new"] = old * a.values["kl_coef_factor"]
            v["lr_scale"] = c.lr_scale
        elif a.kind == "scale_kl_coef":
            coefs = c.kl_coefs()
            if not coefs:
                a.message += " — no KL coefficient in use (use_kl_in_reward and use_kl_loss are off)"
            changes = []
            for name, old in coefs.items():
                new = max(old, min(old * v["factor"], v["max_coef"]))  # never lowered, never over the cap
                c.set_kl_coef(name, new)
                v[f"{name}_old"], v[f"{name}_new"] = old, new
                changes.append(
                    f"{KL_COEF_KEYS[name]} {old:.4g} → {new:.4g}" + _unchanged(old, new, v["max_coef"])
                )
            if changes:
                a.message += f" ({'; '.join(changes)})"
        elif a.kind == "raise_entropy_coeff":
            old = c.entropy_coeff
            new = v["entropy_coeff"] if old < v["entropy_coeff"] else old * v["factor"]
            new = max(old, min(new, v["max_coeff"]))  # never lowered, never over the cap
            c.set_entropy_coeff(new)
            v["entropy_coeff_old"], v["entropy_coeff_new"] = old, new
            cap = _unchanged(old, new, v["max_coeff"])
            a.message += f" (actor_rollout_ref.actor.entropy_coeff {old:g} → {new:g}{cap})"
        elif a.kind != "warn":
            raise AssertionError(f"unknown monitor action {a.kind!r}")
        self._record(step, a)

    def _record(self, step: int, a: Action) -> None:
        key = f"{a.rule}/{a.kind}"
        self.counts[key] = self.counts.get(key, 0) + 1
        if self.rank == 0:
            verb = "stopping the run" if a.kind == "stop" else a.kind.replace("_", " ")
            log.warning("monitor: step %d: %s: %s → %s", step, a.rule, a.message, verb)
        self.events.write({"step": step, "rule": a.rule, "action": a.kind, "message": a.message, **a.values})

    # ------------------------------------------------------------------ end of run
    def finish(self, step: int) -> dict[str, Any]:
        """Console summary and the last events.jsonl line; returns the summary."""
        self._record_oom_retries(step)  # retries of a step that failed after all
        summary = {
            "step": step,
            "rule": "summary",
            "action": "summary",
            "counts": dict(sorted(self.counts.items())),
            "stopped_by": self.stop_reason,
            "coefficients": self.metrics(),
        }
        if self.rank == 0:
            if self.counts:
                done = ", ".join(f"{k} ×{n}" for k, n in sorted(self.counts.items()))
                log.warning(
                    "monitor summary (step %d): %s%s",
                    step,
                    done,
                    f"; stopped by {self.stop_reason}" if self.stop_reason else "",
                )
            else:
                log.info("monitor summary (step %d): no rule fired", step)
        self.events.write(summary)
        return summary

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {
            "rules": {r.name: r.state_dict() for r in self.rules},
            "counts": dict(self.counts),
            "controls": self.controls.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], *, best_step_on_disk: int | None) -> None:
        for rule in self.rules:
            if rule.name in state["rules"]:
                rule.load_state_dict(state["rules"][rule.name])
            if rule.name == "validation_drop" and rule.cfg.keep_best and rule.best_step != best_step_on_disk:
                # the best-validation checkpoint on disk is not the one this state remembers (written
                # after the checkpoint by the interrupted run): forget it, the next validation starts anew
                rule.best, rule.best_step = None, None
        self.counts = dict(state["counts"])
        self.controls.load_state_dict(state["controls"])


def build_monitor(run: Run, trainer_state: Callable[[], dict[str, Any]], *, rank: int) -> Monitor:
    """The run's monitor; ``trainer_state()`` gives what a checkpoint's ``trainer_state.pt`` holds."""

    controls = RunControls(
        run,
        save_best=lambda step: save_best_checkpoint(run, step, trainer_state()),
        rollback=lambda: load_best_weights(run),
    )
    resume_step = checkpoint_step(run.resume_path) if run.resume_path else None
    return Monitor(run.cfg, controls, run_dir=run.run_dir, rank=rank, resume_step=resume_step)


def best_checkpoint_step(run_dir: Path) -> int | None:
    path = latest_checkpoint(Path(run_dir) / BEST_DIR)
    return None if path is None else checkpoint_step(path)


def save_best_checkpoint(run: Run, step: int, trainer_state: dict[str, Any]) -> None:
    """The current weights as ``<run dir>/best_validation/global_step_<step>`` (one kept; collective)."""

    save_checkpoint(
        Path(run.run_dir) / BEST_DIR,
        step,
        models={name: (role.state_model, role.optimizer) for name, role in run.roles.trained().items()},
        hf_assets=run.hf_assets,
        trainer_state=trainer_state,
        max_to_keep=1,
        frozen_bases=run.frozen_bases,
    )


def load_best_weights(run: Run) -> int | None:
    """Models and optimizer states of the best-validation checkpoint, loaded in place (the step count,
    data position, schedules and RNG go on); its step, or None when there is none (collective)."""

    path = latest_checkpoint(Path(run.run_dir) / BEST_DIR)
    if path is None:
        return None
    for name, role in run.roles.trained().items():
        load_role(path / name, role.state_model, role.optimizer)
    return checkpoint_step(path)
