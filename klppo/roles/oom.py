"""Out-of-memory recovery of a role's passes (``monitor.oom_recovery``): a pass that runs out of device
memory is redone with half the micro-batch (rows, or the token budget with ``use_dynamic_bsz``) — the same
samples, so nothing is lost, and for an update the same accumulated gradient.

One `OOMRecovery` per role holds, per phase (``update``, ``log_prob``, ``values``), the micro-batching in
force after any halving (it stays halved for the rest of the run, and through a checkpoint via
``state_dict``), and the retries made since the trainer last drained ``events``.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from klppo.parallel.fsdp import reset_after_failed_pass
from klppo.roles.forward import MicroBatching

T = TypeVar("T")


def halved(micro: MicroBatching) -> tuple[str, int, int] | None:
    """(field, old, new) halving ``micro``: rows, or the token budget with use_dynamic_bsz; None at 1."""
    key = "max_token_len" if micro.use_dynamic_bsz else "micro_batch_size"
    old = getattr(micro, key)
    return (key, old, old // 2) if old > 1 else None


OOM_KEYS = {
    ("actor", "update"): "actor_rollout_ref.actor.ppo",
    ("actor", "log_prob"): "actor_rollout_ref.rollout.log_prob",
    ("ref", "log_prob"): "actor_rollout_ref.ref.log_prob",
    ("critic", "update"): "critic.ppo",
    ("critic", "values"): "critic.forward",
}
"""(role, phase) → the prefix of the config keys of that pass's micro-batching (``_micro_batch_size_per_gpu``
or ``_max_token_len_per_gpu`` follows)."""


def config_key(role: str, phase: str, field: str) -> str | None:
    """The config key a user sets to start a run at the micro-batching ``field`` names; None if unknown."""
    prefix = OOM_KEYS.get((role, phase))
    if prefix is None:
        return None
    return prefix + ("_max_token_len_per_gpu" if field == "max_token_len" else "_micro_batch_size_per_gpu")


class OOMRecovery:
    def __init__(self, role: str, *, sp_size: int = 1, update_rows: int | None = None) -> None:
        self.role = role
        self.sp_size = sp_size  # a Ulysses group's token budget is the config's × its size
        # samples per rank in an update's mini-batch: its micro-batch divides it
        self.update_rows = update_rows
        self.max_retries = 0  # set by the trainer's monitor from monitor.oom_recovery
        self.micro: dict[str, MicroBatching] = {}
        self.events: list[dict[str, Any]] = []

    def current(self, phase: str, default: MicroBatching) -> MicroBatching:
        """The micro-batching of ``phase``: ``default`` unless an out-of-memory retry halved it."""
        return self.micro.get(phase, default)

    def run(self, phase: str, default: MicroBatching, attempt: Callable[[MicroBatching], T], model) -> T:
        """``attempt(micro)`` with this phase's micro-batching; on out of memory: FSDP2 state of ``model``
        reset, the micro-batch halved, ``attempt`` called again (at most ``max_retries`` times)."""
        retries = 0
        while True:
            micro = self.current(phase, default)
            try:
                return attempt(micro)
            except torch.OutOfMemoryError as exc:
                change = halved(micro)
                if retries >= self.max_retries or change is None:
                    raise
                error = (str(exc).splitlines() or ["out of memory"])[0][:200]
            # outside the except block: the failed pass's frames (and tensors) are released by now
            _reset(model)
            key, old, new = change
            self.micro[phase] = dataclasses.replace(micro, **{key: new})
            self.events.append(
                {
                    "role": self.role,
                    "phase": phase,
                    key + "_old": old,
                    key + "_new": new,
                    "message": f"out of memory in the {self.role} {phase} pass ({error}): redone with {key} "
                    f"{old} → {new}"
                    + _start_there(self.role, phase, key, self._config_value(key, new, phase)),
                }
            )
            retries += 1

    def _config_value(self, field: str, value: int, phase: str = "") -> int:
        """The config's value for an in-run ``value``: a Ulysses group's token budget is the key's × its
        size; an update's micro-batch the largest divisor of its mini-batch up to ``value`` (the size check
        refuses others)."""
        if field == "max_token_len":
            return max(1, value // self.sp_size)
        if phase == "update" and self.update_rows:
            return max(d for d in range(1, max(1, value) + 1) if self.update_rows % d == 0)
        return value

    def state_dict(self) -> dict[str, dict[str, Any]]:
        return {phase: dataclasses.asdict(m) for phase, m in self.micro.items()}

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        self.micro = {phase: MicroBatching(**fields) for phase, fields in state.items()}


def _reset(model: torch.nn.Module) -> None:
    reset_after_failed_pass(model)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _start_there(role: str, phase: str, field: str, new: int) -> str:
    key = config_key(role, phase, field)
    return (
        ""
        if key is None
        else f" (kept for this run and its resumes; a new run starts there with {key}={new})"
    )
