"""Distributed checkpoints of model + optimizer through torch.distributed.checkpoint (DCP).

Resharding-safe: state dicts are keyed by parameter name (``get_state_dict``), each rank writes its own
shards, and a load reads whatever slices the loading ranks own, so a checkpoint written by K ranks loads
on any K' (1 included, also into a model that is not sharded at all, with or without a process group).
Atomicity (temp dir + rename) and trainer state are the trainer's concern: ``save_checkpoint`` writes
into the directory it is given, all ranks taking part.

Loading never runs code from the checkpoint: DCP reads tensors with ``torch.load(weights_only=True)``, and
its ``.metadata`` file (a pickle) is read here through an unpickler that admits only DCP's metadata
classes, ``torch.Size``, dtypes and paths (:class:`SafeFileSystemReader`); anything else is refused as
:class:`UnsafeCheckpointError` before it is built.
"""

from __future__ import annotations

import enum
import pathlib
import pickle
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.metadata as md
from torch import nn
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import StorageMeta
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint's pickle names a global that no klppo/DCP checkpoint contains."""


_PATH_CLASSES = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what DCP's ``.metadata`` holds: its metadata dataclasses/enums, the storage-info record,
    ``torch.Size``, dtypes, the layout helper and paths; every other global is refused."""

    def find_class(self, module: str, name: str):
        if module == md.__name__ and not name.startswith("__"):
            obj = getattr(md, name, None)
            if isinstance(obj, type) and (hasattr(obj, "__dataclass_fields__") or issubclass(obj, enum.Enum)):
                return obj
        if module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo":
            return _StorageInfo
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout
        if module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES:
            return getattr(pathlib, name)
        raise UnsafeCheckpointError(f"refused to load global {module}.{name} (not part of a checkpoint)")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader with ``.metadata`` read by :class:`_MetadataUnpickler`."""

    def read_metadata(self, *args, **kwargs):
        rank = kwargs.get("rank")
        path = self._get_metadata_path(rank)
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def shards_problem(directory: str | Path) -> str | None:
    """None when ``directory``'s DCP ``.metadata`` reads (through :class:`_MetadataUnpickler`) and every
    item it lists lies within the bytes of its shard file; else one phrase naming the file. Reads the
    metadata only: the check a checkpoint without a manifest gets before it is trusted."""
    directory = Path(directory)
    try:
        metadata = SafeFileSystemReader(directory).read_metadata()
    except Exception as exc:  # truncated, not a pickle, a refused global
        return f"{directory / '.metadata'} cannot be read ({type(exc).__name__})"
    sizes: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)
        if name not in sizes:
            f = directory / name
            sizes[name] = f.stat().st_size if f.is_file() else -1
        if sizes[name] < 0:
            return f"{directory / name} is missing"
        if info.offset + info.length > sizes[name]:
            return f"{directory / name} has {sizes[name]} bytes, its items need {info.offset + info.length}"
    return None


def _optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    return [] if optimizer is None else [optimizer]


def _options(trained_only: bool) -> StateDictOptions:
    """Every entry of the state dict, or with ``trained_only`` all but the frozen parameters (those with
    ``requires_grad`` off: a LoRA model's base weights); a load then leaves the frozen ones as they are."""
    return StateDictOptions(ignore_frozen_params=trained_only, strict=not trained_only)


_WRAPPERS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Name parts of wrapper modules that the state dict's keys leave out."""


def _plain_name(name: str) -> str:
    return ".".join(part for part in name.split(".") if part not in _WRAPPERS)


def _model_state(model: nn.Module, model_sd: dict, *, trained_only: bool) -> dict:
    """``model_sd``, with ``trained_only`` without the entries of frozen parameters under any of their
    names: ``ignore_frozen_params`` drops a tied matrix under its first name only (the embedding), and
    would keep a frozen tied LM head."""
    if not trained_only:
        return model_sd
    frozen = {
        _plain_name(name) for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad
    }
    return {k: v for k, v in model_sd.items() if _plain_name(k) not in frozen}


def save_checkpoint(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    trained_only: bool = False,
) -> None:
    """Write ``{"model": ..., "optim": ...}`` into ``directory`` (created); collective over all ranks.
    ``trained_only``: the frozen parameters left out (:func:`_options`)."""
    model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer), options=_options(trained_only))
    state = {"model": _model_state(model, model_sd, trained_only=trained_only)}
    if optimizer is not None:
        state["optim"] = optim_sd
    Path(directory).mkdir(parents=True, exist_ok=True)
    dcp.save(state, checkpoint_id=str(directory))


def load_checkpoint(
    directory: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    trained_only: bool = False,
) -> None:
    """Load model (and optimizer, when given) state from ``directory`` into the current sharding;
    ``trained_only``: the trained parameters only, the frozen ones kept as they are (a checkpoint written
    with ``trained_only``, or any other: the frozen entries it holds are then not read).

    An optimizer that has not stepped yet gets its state created (zeros) first so DCP can fill it.
    """
    options = _options(trained_only)
    model_sd, optim_sd = get_state_dict(model, _optimizers(optimizer), options=options)
    state = {"model": _model_state(model, model_sd, trained_only=trained_only)}
    if optimizer is not None:
        state["optim"] = optim_sd
    dcp.load(state, storage_reader=SafeFileSystemReader(str(directory)))
    kernels = _kernel_choices(optimizer)
    set_state_dict(
        model,
        _optimizers(optimizer),
        model_state_dict=state["model"],
        optim_state_dict=state.get("optim", {}),
        options=options,
    )
    if optimizer is not None:  # this run's kernel choice, not the writer's (a GPU's fused, the CPU's foreach)
        for group, choice in zip(optimizer.param_groups, kernels, strict=True):
            group.update(choice)


_KERNEL_KEYS = ("fused", "foreach", "capturable")
"""Param-group keys that choose an implementation for the parameters' device, not the optimization."""


def _kernel_choices(optimizer: torch.optim.Optimizer | None) -> list[dict]:
    groups = [] if optimizer is None else optimizer.param_groups
    return [{k: g[k] for k in _KERNEL_KEYS if k in g} for g in groups]


def full_model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU tensors keyed by HF parameter name on rank 0; ``{}`` on other ranks.

    Collective: every rank must call it. For export to a Hugging Face directory.
    """
    if not dist.is_initialized():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
