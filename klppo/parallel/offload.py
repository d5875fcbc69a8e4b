"""Move a role's parameter shards and optimizer state between the device and CPU while it is idle.

E.g. the reference model's shards during the actor update (``param_offload``), the actor's AdamW state
during rollout (``optimizer_offload``). Works on FSDP2 models (``Module.to`` is overridden by FSDP2 to
keep its sharded buffers consistent, and reshards first) and on plain models. Only the rank's shards
move: with K ranks each rank moves 1/K of the role. The caller owns the schedule (offload after use,
load before use); these functions are synchronous with respect to later use of the tensors.
"""

from __future__ import annotations

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
