"""FSDP2 sharding of a role's model: unit choice by threshold, mesh, prefetch, gathering, clipping.

Order of work, as in torchtitan: choose the units, ``fully_shard`` each unit, then the root, then wire
explicit prefetch unit-to-next-unit. Units decide the all-gather granularity: fewer, larger units mean
fewer collectives and more memory per gather (docs/sharding.md has the rule and measurements).

Knows nothing about PPO, the config tree or roles: it takes :class:`FSDPSettings`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)
from torch.distributed.tensor import DTensor

from klppo.parallel.local_shards import clip_local_shards_, local_total_norm

logger = logging.getLogger(__name__)

Unit = tuple[nn.Module, ...]
"""One FSDP unit: one module, or consecutive siblings of a ``ModuleList`` sharded together."""


@dataclass(frozen=True)
class FSDPSettings:
    """How one role is sharded (verl's ``fsdp_config`` + ``wrap_policy`` fields)."""

    min_num_params: int = 0
    """0: one unit per decoder layer; N > 0: threshold rule of :func:`choose_units`."""
    transformer_layer_cls_to_wrap: list[str] | None = None
    """Class names of decoder layers for ``min_num_params == 0``; None: the model's ``_no_split_modules``."""
    param_offload: bool = False
    """Move this role's parameter shards to CPU while idle (:mod:`klppo.parallel.offload`)."""
    optimizer_offload: bool = False
    """Move this role's optimizer state to CPU while idle."""
    optimizer_step_on_cpu: bool = False
    """Plain path only: masters and optimizer state live on the host and the step runs on the CPU
    (:mod:`klppo.parallel.cpu_optim`)."""
    offload_policy: bool = False
    """FSDP2 ``CPUOffloadPolicy``: shards live on CPU, copied to the device per unit during compute."""
    reshard_after_forward: bool = True
    """Free each unit's gathered weights after its forward (re-gathered in backward)."""
    fsdp_size: int = -1
    """-1: shard over all ranks; k: shard within groups of k, replicate across groups (HSDP)."""
    forward_prefetch: bool = False
    """Explicitly all-gather unit i+1 while unit i runs forward."""
    backward_prefetch: bool = True
    """All-gather unit i-1 while unit i runs backward (False turns FSDP2's default prefetch off)."""
    param_dtype: torch.dtype | None = None
    """Compute dtype of gathered weights (bf16); None: no mixed precision (e.g. CPU fp32)."""
    reduce_dtype: torch.dtype = torch.float32
    """Dtype of gradient reduce-scatter; master weights stay in their loaded dtype."""
    plain: bool = False
    """One process, no FSDP2: compute-dtype parameters and masters beside them (:mod:`klppo.parallel.plain`,
    ``fsdp_config.plain_single_gpu`` resolved); the fields above about units, prefetch and resharding
    then do not apply."""


@dataclass(frozen=True)
class UnitReport:
    """What a threshold did: number of units (root included) and their own parameter counts."""

    count: int
    smallest: int
    largest: int
    total: int

    def __str__(self) -> str:
        return (
            f"{self.count} FSDP units, params per unit: smallest {self.smallest:,}, "
            f"largest {self.largest:,}, total {self.total:,}"
        )


def _own_params(module: nn.Module) -> list[nn.Parameter]:
    return list(module.parameters(recurse=False))


def _shared_param_ids(model: nn.Module) -> set[int]:
    """ids of parameters registered under more than one module (tied embeddings)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return {pid for pid, n in owners.items() if n > 1}


def choose_units(model: nn.Module, min_num_params: int, layer_cls_names: list[str] | None) -> list[Unit]:
    """The FSDP units of ``model``, in forward (pre-order) order, the root last as ``(model,)``.

    - ``min_num_params == 0``: one unit per module whose class name is in ``layer_cls_names``, else in
      ``model._no_split_modules`` (the decoder layer class of HF models).
    - ``min_num_params = N > 0``: walk the tree bottom-up; a module becomes a unit when the parameters
      in its subtree not already inside a unit number at least N. Children of a ``ModuleList`` /
      ``Sequential`` that stay below N on their own are grouped in runs of consecutive siblings, a run
      closing as soon as it reaches N (so N = 3 layers' worth puts 3 layers per unit); a last run below N
      stays with the parent. A value above the model size leaves only the root.
    - A module holding a parameter tied to another module (tied embedding / LM head) is never a unit of
      its own: the shared parameter stays with the root, as FSDP needs each parameter in one unit.
    - A decoder layer (class in ``layer_cls_names``, else ``model._no_split_modules``) is never split:
      no unit is made inside it, so a threshold below one layer's size gives one unit per layer. (Units
      inside a layer break FSDP2 under activation checkpointing with mixed precision — "aten.mm got
      mixed torch.Tensor and DTensor" — and only add collectives.)
    - The root is always a unit; parameters not inside any other unit belong to it.
    """
    if min_num_params < 0:
        raise ValueError(f"min_num_params must be >= 0, got {min_num_params}")
    shared = _shared_param_ids(model)
    units: list[Unit] = []
    if min_num_params == 0:
        names = layer_cls_names or list(getattr(model, "_no_split_modules", None) or [])
        if not names:
            raise ValueError(
                "min_num_params=0 needs transformer_layer_cls_to_wrap or a model with _no_split_modules"
            )
        found = {type(m).__name__ for m in model.modules()}
        if not set(names) & found:
            raise ValueError(f"no module of class {names} in the model (classes present: {sorted(found)})")
        units = [(m,) for m in model.modules() if m is not model and type(m).__name__ in names]
    else:
        atomic = set(layer_cls_names or getattr(model, "_no_split_modules", None) or [])
        _walk(model, model, min_num_params, shared, units, set(), atomic)
        order = {id(m): i for i, m in enumerate(model.modules())}
        units.sort(key=lambda u: order[id(u[0])])
    return units + [(model,)]


def _walk(
    module: nn.Module,
    root: nn.Module,
    n: int,
    shared: set[int],
    units: list[Unit],
    seen: set[int],
    atomic: set[str],
) -> tuple[int, bool]:
    """Post-order walk; returns (params of the subtree not inside a unit, subtree holds a tied param).
    A module whose class is in ``atomic`` is counted as one block: no unit is made inside it."""
    count, tied = 0, False
    whole = type(module).__name__ in atomic
    for p in module.parameters() if whole else _own_params(module):
        tied |= id(p) in shared
        if id(p) not in seen:
            seen.add(id(p))
            count += p.numel()
    children = [] if whole else list(module.children())
    results = [_walk(c, root, n, shared, units, seen, atomic) for c in children]
    if isinstance(module, (nn.ModuleList, nn.Sequential)):
        run: list[nn.Module] = []
        run_count = 0
        for child, (c_count, c_tied) in zip(children, results):
            if c_tied or c_count == 0:  # a tied child, or one already a unit: close the run
                count += run_count + c_count
                tied |= c_tied
                run, run_count = [], 0
                continue
            run.append(child)
            run_count += c_count
            if run_count >= n:
                units.append(tuple(run))
                run, run_count = [], 0
        count += run_count
    else:
        for c_count, c_tied in results:
            count += c_count
            tied |= c_tied
    if module is not root and not tied and count >= n and not isinstance(module, (nn.ModuleList,)):
        units.append((module,))
        return 0, False
    return count, tied


def unit_report(units: list[Unit]) -> UnitReport:
    """Own-parameter counts of ``units`` (as returned by :func:`choose_units`; nested units excluded)."""
    in_unit: dict[int, int] = {}
    sizes = []
    # Pre-order puts an ancestor before its descendants: claim in reverse so the innermost unit wins,
    # and the root (last) only takes what no other unit holds.
    for i in [*reversed(range(len(units) - 1)), len(units) - 1]:
        for module in units[i]:
            for p in module.parameters():
                in_unit.setdefault(id(p), i)
    params = {id(p): p for unit in units for m in unit for p in m.parameters()}
    for i in range(len(units)):
        sizes.append(sum(params[pid].numel() for pid, owner in in_unit.items() if owner == i))
    return UnitReport(len(units), min(sizes), max(sizes), sum(sizes))


def build_mesh(world_size: int, fsdp_size: int, device_type: str) -> DeviceMesh:
    """1-D mesh ``("fsdp",)`` when ``fsdp_size`` is -1 or the world size, else the 2-D HSDP mesh
    ``("replicate", "shard")`` of shape ``(world_size // fsdp_size, fsdp_size)``."""
    if fsdp_size in (-1, world_size):
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))
    if fsdp_size < 1 or world_size % fsdp_size:
        raise ValueError(f"fsdp_size={fsdp_size} must be -1 or divide the world size {world_size}")
    return init_device_mesh(
        device_type, (world_size // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard")
    )


def shard_model(model: nn.Module, settings: FSDPSettings, mesh: DeviceMesh) -> UnitReport:
    """Apply ``fully_shard`` to the units of ``model`` (in place), then to the root; wire prefetch.

    Mixed precision: gathered weights in ``param_dtype`` (None: as stored), gradients reduced in
    ``reduce_dtype``; sharded master weights keep the model's dtype. Returns the unit report, also logged.
    """
    units = choose_units(model, settings.min_num_params, settings.transformer_layer_cls_to_wrap)
    report = unit_report(units)
    logger.info("FSDP2 min_num_params=%d: %s", settings.min_num_params, report)
    mp = MixedPrecisionPolicy(param_dtype=settings.param_dtype, reduce_dtype=settings.reduce_dtype)
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if settings.offload_policy else None
    options = dict(
        mesh=mesh,
        reshard_after_forward=settings.reshard_after_forward,
        mp_policy=mp,
        offload_policy=offload or OffloadPolicy(),
    )
    sharded: list[FSDPModule] = []
    for unit in units[:-1]:
        out = fully_shard(list(unit) if len(unit) > 1 else unit[0], **options)
        sharded.append(out[0] if isinstance(out, list) else out)
    root = fully_shard(model, **options)
    _wire_prefetch(sharded, root, settings)
    return report


def _wire_prefetch(units: list[FSDPModule], root: FSDPModule, settings: FSDPSettings) -> None:
    """Forward order is root, unit 0, 1, …; backward order is root, unit n-1, …, 0.

    Forward prefetch: each prefetches the next in forward order. Backward prefetch: each prefetches the
    next in backward order; off → each 'prefetches' only itself, already unsharded, so no lookahead
    (an explicit list replaces FSDP2's implicit one-unit lookahead).
    """
    forward = [root, *units]
    if settings.forward_prefetch:
        for cur, nxt in zip(forward[:-1], forward[1:]):
            cur.set_modules_to_forward_prefetch([nxt])
    backward = [root, *reversed(units)]
    for i, cur in enumerate(backward):
        if not settings.backward_prefetch:
            cur.set_modules_to_backward_prefetch([cur])
        elif i + 1 < len(backward):
            cur.set_modules_to_backward_prefetch([backward[i + 1]])


def fsdp_modules(model: nn.Module) -> list[FSDPModule]:
    """The FSDP2 modules inside ``model`` (root included), in pre-order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _reshards_after_forward(module: FSDPModule) -> bool:
    group = module._get_fsdp_state()._fsdp_param_group
    return group is not None and group.post_forward_mesh_info is not None


@contextmanager
def gathered_params(model: nn.Module) -> Iterator[nn.Module]:
    """Full (unsharded) weights in place for the rollout engine; resharded on exit.

    Inside the block ``model.named_parameters()`` are plain tensors of full shape (in ``param_dtype``
    under mixed precision) and forwards do not reshard, so generation runs on them without re-gathering.
    No second resident copy is kept: it is FSDP2's own unsharded buffer. A model without FSDP: no-op.
    """
    modules = fsdp_modules(model)
    previous = [_reshards_after_forward(m) for m in modules]
    try:
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
        for m in modules:
            m.unshard()
        yield model
    finally:
        for m, prev in zip(modules, previous):
            m.set_reshard_after_forward(prev, recurse=False)
            m.reshard()


def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale gradients so that their global L2 norm is at most ``max_norm``; return the norm before.

    ``norm = sqrt(sum_p ||g_p||^2)`` over the full (unsharded) gradients: with sharded DTensor grads the
    per-shard squares are summed across ranks. Works on a model without FSDP too. A non-finite norm
    is returned as is (the caller decides to skip the step); gradients are then multiplied by nan (0 for
    an infinite norm, torch's rule). Norm and scaling on the DTensors' local shards
    (:mod:`klppo.parallel.local_shards`, same result); through DTensor where the gradients span several
    meshes or placements, or a CPU-offloaded shard group on NCCL.
    """
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if not grads:
        return torch.zeros(())
    total = local_total_norm(grads)
    if total is not None:
        clip_local_shards_(grads, max_norm, total)
        return total
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def reset_after_failed_pass(model: nn.Module) -> None:
    """Make FSDP2 state clean after a forward/backward aborted mid-flight (an out-of-memory error): the
    root's per-iteration state reset (``reset_iter_state``: parameters resharded, pending collectives
    waited on), and the partial unsharded gradients the aborted backward left behind dropped, so that a
    retried pass accumulates exactly what an uninterrupted one would. A model without FSDP: no-op."""
    modules = fsdp_modules(model)
    if not modules:
        return
    modules[0].reset_iter_state()
    for m in modules:
        for group in m._get_fsdp_state()._fsdp_param_groups:
            for fsdp_param in group.fsdp_params:
                fsdp_param.unsharded_accumulated_grad = None
                if hasattr(fsdp_param, "_unsharded_param"):
                    fsdp_param.unsharded_param.grad = None
