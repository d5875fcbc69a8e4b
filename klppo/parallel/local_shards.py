"""The optimizer step and the gradient clip on the local shards of FSDP2's DTensor parameters.

FSDP2 keeps each parameter as a DTensor sharded over the mesh, and its gradient too. torch's Adam/AdamW
step and ``get_total_norm``/``clip_grads_with_norm_`` on DTensors dispatch every operator through DTensor
(sharding propagation per op, foreach and fused ops included), which makes them host-bound. Both are
elementwise per shard except the norm, so here they run on
``to_local()`` — the same storage — and the per-gradient squared norms are summed over the shard group
with one all-reduce (none on a one-rank mesh).

What stays the same: the optimizer is torch's class with torch's own ``step`` and state, keyed by the
DTensor parameters (``exp_avg``/``exp_avg_sq`` DTensors, ``step`` as torch makes it), so ``state_dict``,
DCP's ``get_state_dict``/``set_state_dict`` and checkpoints on any world size are unchanged. On CPU the
results equal the DTensor path's bit for bit (tests/parallel/test_local_shards.py: same single-tensor
AdamW, the norm in DTensor's arithmetic); on CUDA with fused AdamW (klppo's default) the same kernel
runs on the same shards; with ``{fused: false}`` both take torch's foreach path on CUDA, and the norm's
foreach kernel may round differently from the per-tensor one in the last bit.

Leaves alone: optimizers other than torch's Adam/AdamW (:func:`local_shard_class` returns them as they
are), and a clip over gradients on several meshes or placements, or over a CPU-offloaded shard group on
NCCL (those take the DTensor path).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (its storage: under no_grad ``to_local`` returns it without an autograd
    node), a plain tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


class _LocalShardStep:
    """Mixin for torch's Adam family: ``step`` is torch's own, but the lists that ``_init_group`` fills
    (parameters, gradients, moments; state created as torch creates it, DTensors for DTensor parameters)
    hold the local tensors when the functional update runs."""

    def _init_group(self, group, *lists):
        has_complex = super()._init_group(group, *lists)
        for items in lists:  # torch 2.x: the lists, and (older AdamW) a bool amsgrad among them
            if isinstance(items, list):
                items[:] = [_local(t) for t in items]
        return has_complex


class LocalShardAdamW(_LocalShardStep, torch.optim.AdamW):
    """``torch.optim.AdamW`` whose step runs on the DTensor parameters' local shards."""


class LocalShardAdam(_LocalShardStep, torch.optim.Adam):
    """``torch.optim.Adam`` whose step runs on the DTensor parameters' local shards."""


_LOCAL_SHARD_CLASSES: dict[type, type] = {
    torch.optim.AdamW: LocalShardAdamW,
    torch.optim.Adam: LocalShardAdam,
}


def steps_on_local_shards(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step runs on the local shards (one of this module's classes)."""
    return isinstance(optimizer, _LocalShardStep)


def local_shard_class(cls: type) -> type:
    """The local-shard variant of optimizer class ``cls`` (torch's Adam, AdamW), else ``cls`` itself."""
    return _LOCAL_SHARD_CLASSES.get(cls, cls)


def _shard_groups(grads: list[torch.Tensor]) -> list[dist.ProcessGroup] | None:
    """The process groups over which the gradients' squared norms are summed: the mesh dimensions the
    gradients are sharded on (FSDP2: ``Shard(0)`` on ``fsdp`` or HSDP's ``shard``); [] without DTensors or
    on a one-rank shard group. None when the local path does not apply: gradients on different meshes or
    placements, a mix of DTensors and plain tensors, a placement other than Shard/Replicate, or shards on
    another device type than the mesh's (a CPU-offloaded shard group on NCCL)."""
    first = grads[0]
    if not isinstance(first, DTensor):
        return [] if not any(isinstance(g, DTensor) for g in grads) else None
    mesh, placements = first.device_mesh, first.placements
    for g in grads:
        if not isinstance(g, DTensor) or (g.device_mesh is not mesh and g.device_mesh != mesh):
            return None
        if g.placements != placements:
            return None
    if not all(p.is_shard() or p.is_replicate() for p in placements):
        return None
    dims = [d for d, p in enumerate(placements) if p.is_shard() and mesh.size(d) > 1]
    if dims and first.device.type != mesh.device_type:
        return None
    return [mesh.get_group(d) for d in dims]


@torch.no_grad()
def local_total_norm(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """L2 norm of the full gradients from their local shards, in the DTensor path's arithmetic (so that the
    two agree bit for bit): each gradient's norm ``n_i = (Σ_ranks ‖local_i‖²)^½`` — the vector of local
    norms squared, summed over the shard group in one all-reduce (none on a one-rank mesh), square root —
    then the norm of the vector ``n``. None when the local path does not apply (:func:`_shard_groups`)."""
    groups = _shard_groups(grads)
    if groups is None:
        return None
    tensors = [_local(g) for g in grads]
    if not isinstance(grads[0], DTensor):
        return torch.nn.utils.get_total_norm(tensors, norm_type=2.0)
    return norm_of_shards(tensors, groups)


@torch.no_grad()
def norm_of_shards(tensors: list[torch.Tensor], groups: list[dist.ProcessGroup]) -> torch.Tensor:
    """The DTensor path's norm arithmetic on plain (local) tensors: per-tensor norms, squared, summed over
    each of ``groups`` (none: a one-rank mesh, or the plain path of :mod:`klppo.parallel.plain`), square
    root, then the norm of that vector — not ``get_total_norm``'s (``sqrt(n²)`` may differ from ``n`` in
    the last bit)."""
    norms: list[torch.Tensor] = []  # torch's get_total_norm order: grouped by device and dtype
    for (device, _), ([group_tensors], _) in _group_tensors_by_device_and_dtype([tensors]).items():
        if _has_foreach_support(group_tensors, device):
            norms.extend(torch._foreach_norm(group_tensors, 2.0))
        else:
            norms.extend(torch.linalg.vector_norm(t, 2.0) for t in group_tensors)
    squared = torch.stack([n.to(tensors[0].device) for n in norms]) ** 2.0
    for group in groups:
        dist.all_reduce(squared, op=dist.ReduceOp.SUM, group=group)
    return torch.linalg.vector_norm(squared ** (1.0 / 2.0), 2.0)


@torch.no_grad()
def clip_local_shards_(grads: list[torch.Tensor], max_norm: float, total: torch.Tensor) -> None:
    """Scale the gradients' local shards in place by ``min(1, max_norm / (total + 1e-6))`` — torch's
    ``clip_grads_with_norm_`` (a non-finite ``total`` gives nan, or 0 for inf, as there), one foreach
    multiply per device and dtype."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        local = _local(g)
        groups.setdefault((local.device, local.dtype), []).append(local)
    for (device, _), tensors in groups.items():
        torch._foreach_mul_(tensors, coef.to(device))
