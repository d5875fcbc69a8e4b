"""The collectives the roles and the trainer use: rank, world size, sums, maxima and gathers over the
data-parallel ranks (no-ops in a single process). CPU tensors travel on the backend's device."""

from __future__ import annotations

import torch
import torch.distributed as dist


def world_size() -> int:
    """Number of ranks (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of ``t`` over all ranks (a new tensor; CPU tensors are reduced on the backend's device)."""
    if world_size() == 1:
        return t.clone()
    device = _comm_device()
    out = t.to(device).clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(t.device)


def all_reduce_max(value: int) -> int:
    """Largest ``value`` over all ranks."""
    return int(all_reduce_max_values([float(value)])[0])


def all_reduce_max_values(values: list[float]) -> list[float]:
    """Element-wise largest of ``values`` over all ranks (one collective; none on one rank)."""
    return _all_reduce_values(values, dist.ReduceOp.MAX)


def all_reduce_sum_values(values: list[float]) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (one collective; none on one rank)."""
    return _all_reduce_values(values, dist.ReduceOp.SUM)


def _all_reduce_values(values: list[float], op: dist.ReduceOp) -> list[float]:
    if world_size() == 1:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=_comm_device())
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """Concatenate equal-shaped per-rank tensors along dim 0, in rank order."""
    if world_size() == 1:
        return t
    device = _comm_device()
    local = t.to(device).contiguous()
    parts = [torch.empty_like(local) for _ in range(world_size())]
    dist.all_gather(parts, local)
    return torch.cat(parts, dim=0).to(t.device)


def all_reduce_min(value: int, group: dist.ProcessGroup | None = None) -> int:
    """Smallest ``value`` over the ranks of ``group`` (all ranks when None)."""
    if world_size() == 1:
        return int(value)
    t = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def group_all_gather(t: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[size, *t.shape]: every rank of ``group``'s equal-shaped ``t``, in group order, on ``t``'s device.

    No host synchronisation (capturable in a CUDA graph on NCCL: one ``all_gather_into_tensor``); ``t``
    must be on the backend's device."""
    size = dist.get_world_size(group)
    t = t.contiguous()
    if dist.get_backend(group) == "nccl":
        out = torch.empty((size * t.shape[0], *t.shape[1:]), dtype=t.dtype, device=t.device)
        dist.all_gather_into_tensor(out, t, group=group)
        return out.view(size, *t.shape)
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t, group=group)
    return torch.stack(parts)


def all_gather_objects(obj: object) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def _comm_device() -> torch.device:
    backend = dist.get_backend()
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
