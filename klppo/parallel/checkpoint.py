"""Distributed checkpoints of model + optimizer through torch.distributed.checkpoint (DCP).

Resharding-safe: state dicts are keyed by parameter name (``get_state_dict``), each rank writes its own
shards, and a load reads whatever slices the loading ranks own, so a checkpoint written by K ranks loads
on any K' (1 included, also into a model that is not sharded at all, with or without a process group).
Atomicity (temp dir + rename) and trainer state are the trainer's concern: ``save_checkpoint`` writes
into the directory it is given, all ranks taking part.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)


def _optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    return [] if optimizer is None else [optimizer]


def save_checkpoint(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Write ``{"model": ..., "optim": ...}`` into ``directory`` (created); collective over all ranks."""
    model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer))
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    Path(directory).mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(directory))


def load_checkpoint(directory: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load model (and optimizer, when given) state from ``directory`` into the current sharding.

    An optimizer that has not stepped yet gets its state created (zeros) first so DCP can fill it.
    """
    model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer))
    state = {"model": model_sd}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(
        model,
        _optimizers(optimizer),
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
    )


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors keyed by HF parameter name on rank 0; ``{}`` on other ranks.

    Collective: every rank must call it. For export to a Hugging Face directory.
    """
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
