"""Move a role's parameter shards and optimizer state between the device and CPU while it is idle.

E.g. the reference model's shards during the actor update (``param_offload``), the actor's AdamW state
during rollout (``optimizer_offload``). Works on FSDP2 models (``Module.to`` is overridden by FSDP2 to
keep its sharded buffers consistent, and reshards first) and on plain models. Only the rank's shards
move: with K ranks each rank moves 1/K of the role. These functions are synchronous with respect to later
use of the tensors.

:class:`OffloadSchedule` is the schedule the trainer follows: every role is added once (with its
``param_offload`` / ``optimizer_offload`` flags) and used inside ``with schedule.on_device(role): ...``;
what is offloaded lives on the host outside such blocks. Blocks nest (a counter per role and part), and
a role that was never added raises instead of silently staying where it is.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

CPU = torch.device("cpu")


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def offload_params(model: nn.Module) -> None:
    """Move parameters and buffers (and any gradients) of ``model`` to CPU, freeing device memory."""
    device = next(model.parameters()).device
    model.to(CPU)
    _empty_cache(device)


def load_params(model: nn.Module, device: torch.device | str) -> None:
    """Move parameters and buffers of ``model`` back to ``device``."""
    model.to(torch.device(device))


def _move_optimizer_state(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            # AdamW's "step" is a CPU scalar unless capturable/fused: leave it where the optimizer wants it
            if isinstance(value, torch.Tensor) and not (key == "step" and value.dim() == 0):
                state[key] = value.to(device, non_blocking=device.type == "cpu")
    if device.type == "cpu" and torch.cuda.is_available():
        torch.cuda.synchronize()


def offload_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Move the optimizer state (e.g. AdamW ``exp_avg``, ``exp_avg_sq`` shards) to CPU."""
    devices = {v.device for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)}
    _move_optimizer_state(optimizer, CPU)
    for device in devices:
        _empty_cache(device)


def load_optimizer(optimizer: torch.optim.Optimizer, device: torch.device | str) -> None:
    """Move the optimizer state back to ``device`` (before ``optimizer.step()``)."""
    _move_optimizer_state(optimizer, torch.device(device))


@dataclass
class _Entry:
    """A role's offloadable parts, the flags saying which move, and how many blocks use each now."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    params: bool
    optimizer_state: bool
    params_users: int = 0
    optimizer_users: int = 0


class OffloadSchedule:
    """Which role's parameters / optimizer state are on the device when: ``on_device`` blocks.

    ``add`` a role (any object: the handle is the role itself) with its model and optimizer; parts whose
    flag is set move to the host at once and come back to ``device`` for the outermost ``on_device`` block
    that asks for them. Parts whose flag is off never move. ``on_device`` of a role never added raises.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._entries: dict[int, _Entry] = {}

    def add(
        self,
        role: object,
        *,
        name: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        params: bool,
        optimizer_state: bool,
    ) -> None:
        """Track ``role``: with ``params`` its model, with ``optimizer_state`` its optimizer state, is kept
        on the host outside ``on_device`` blocks (offloaded now)."""
        if id(role) in self._entries:
            raise ValueError(f"offload: role {name!r} was added twice")
        if optimizer_state and optimizer is None:
            raise ValueError(f"offload: role {name!r} asks for optimizer offload but has no optimizer")
        self._entries[id(role)] = _Entry(name, model, optimizer, params, optimizer_state)
        if params:
            offload_params(model)
        if optimizer_state:
            offload_optimizer(optimizer)

    def names(self) -> list[str]:
        return [e.name for e in self._entries.values()]

    def _entry(self, role: object) -> _Entry:
        try:
            return self._entries[id(role)]
        except KeyError:
            raise KeyError(
                f"offload: {type(role).__name__} was never added to the schedule (added: {self.names()})"
            ) from None

    @contextmanager
    def on_device(self, role: object, *, optimizer: bool = False) -> Iterator[None]:
        """``role``'s parameters (and with ``optimizer`` its optimizer state) on the device for the block;
        released to the host after the outermost block that loaded them, if offloading is configured."""
        entry = self._entry(role)
        if optimizer and entry.optimizer is None:
            raise ValueError(f"offload: role {entry.name!r} has no optimizer")
        self._acquire(entry, optimizer)
        try:
            yield
        finally:
            self._release(entry, optimizer)

    def _acquire(self, entry: _Entry, optimizer: bool) -> None:
        if entry.params and entry.params_users == 0:
            load_params(entry.model, self.device)
        entry.params_users += 1
        if optimizer:
            if entry.optimizer_state and entry.optimizer_users == 0:
                load_optimizer(entry.optimizer, self.device)
            entry.optimizer_users += 1

    def _release(self, entry: _Entry, optimizer: bool) -> None:
        if optimizer:
            entry.optimizer_users -= 1
            if entry.optimizer_state and entry.optimizer_users == 0:
                offload_optimizer(entry.optimizer)
        entry.params_users -= 1
        if entry.params and entry.params_users == 0:
            offload_params(entry.model)
