"""Resharding FSDP2's dim-0 shards into the regions another layout wants, one all-to-all per FSDP unit.

FSDP2 holds a parameter ``p`` of ``N`` rows as row chunks over its shard group: shard ``i`` of ``S`` holds
rows ``[min(i·c, N), min((i+1)·c, N))``, ``c = ceil(N / S)`` (``torch.chunk``), and every replica group
(HSDP) holds the same chunks. A destination rank wants one :class:`Region` of each parameter: a range of
rows, a range of columns, or the whole tensor (the caller's ``want``; e.g. a tensor-parallel rank's heads).

For each FSDP unit (the same grouping as the training all-gathers), every rank packs, for each rank of
its replica group, the intersection of its own rows with that rank's region of every parameter of the
unit (cast to the target dtype) into one flat buffer, a single ``all_to_all_single`` moves them, and each
rank unpacks what it received into its region tensors. So:

- no rank ever holds a full parameter, let alone a full unit or model: it receives exactly its regions;
- memory per rank: its regions (the result), plus a send buffer (its rows going out) and a receive
  buffer (a unit's regions arriving), sized for the largest unit and reused unit after unit;
- one collective per unit, issued in forward order; the units are not overlapped (a second unit in
  flight would double the transient buffers).

A parameter that is a plain tensor (a model without FSDP) is read from the rank's own copy, no traffic.
Knows nothing about models: ``want`` decides every region.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from klppo.parallel.fsdp import fsdp_modules


@dataclass(frozen=True)
class Region:
    """Part of a parameter: indices ``[start, stop)`` along ``dim`` (0: rows, 1: columns); ``dim`` None:
    the whole tensor."""

    dim: int | None = None
    start: int = 0
    stop: int = 0

    def shape(self, full: Sequence[int]) -> tuple[int, ...]:
        if self.dim is None:
            return tuple(full)
        out = list(full)
        out[self.dim] = self.stop - self.start
        return tuple(out)

    def rows(self, full: Sequence[int]) -> tuple[int, int]:
        return (self.start, self.stop) if self.dim == 0 else (0, int(full[0]))


WHOLE = Region()


def even_split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``[0, n)`` cut into ``parts`` contiguous ranges whose sizes differ by at most one
    (the first ``n % parts`` one larger)."""
    base, extra = divmod(n, parts)
    start = i * base + min(i, extra)
    return start, start + base + (1 if i < extra else 0)


Want = Callable[[str, torch.Size, int], Region]
"""``want(name, full_shape, destination_rank)``: the region of parameter ``name`` that rank takes."""


@dataclass(frozen=True)
class _Held:
    """How one parameter is held: this rank's rows, and the rows of each rank it exchanges with."""

    local: torch.Tensor
    shape: torch.Size
    rows_of: dict[int, tuple[int, int]]  # rank of this rank's replica group -> rows it holds


def _held(param: torch.Tensor, me: int) -> _Held:
    if not isinstance(param, DTensor):
        return _Held(param.detach(), param.shape, {me: (0, int(param.shape[0]))})
    *replicate, shard = param.placements
    if shard != Shard(0) or any(p != Replicate() for p in replicate):
        raise ValueError(f"reshard expects FSDP2 placements (Replicate…, Shard(0)), got {param.placements}")
    ranks = param.device_mesh.mesh  # global ranks laid out as the mesh
    coords = (ranks == me).nonzero()[0].tolist()
    group = ranks[tuple(coords[:-1])].tolist()  # my replica group, by shard index
    n = int(param.shape[0])
    c = -(-n // len(group))
    rows_of = {int(g): (min(i * c, n), min((i + 1) * c, n)) for i, g in enumerate(group)}
    local = param.to_local().detach()
    a, b = rows_of[me]
    if local.shape[0] != b - a:
        raise AssertionError(
            f"FSDP2 shard of {tuple(param.shape)} has {local.shape[0]} rows, expected {b - a}"
        )
    return _Held(local, param.shape, rows_of)


def _piece(rows: tuple[int, int], held_rows: tuple[int, int], region: Region) -> tuple[int, int] | None:
    """Global rows [lo, hi) of ``region`` that a rank holding ``held_rows`` has (None: none)."""
    lo, hi = max(rows[0], held_rows[0]), min(rows[1], held_rows[1])
    return (lo, hi) if lo < hi else None


def _cols(t: torch.Tensor, region: Region) -> torch.Tensor:
    return t[:, region.start : region.stop] if region.dim == 1 else t


@dataclass
class _UnitPlan:
    """One unit's exchange, sizes in elements: what this rank sends to each rank (views of its shards,
    in order), what it receives from each (param index, rows [lo, hi) of its region, numel), in order."""

    names: list[str]
    shapes: list[tuple[int, ...]]  # this rank's region shapes
    send: list[torch.Tensor]
    send_sizes: list[int]
    recv: list[tuple[int, int, int, int]]
    recv_sizes: list[int]


def _plan_unit(params: Sequence[tuple[str, torch.Tensor]], want: Want, me: int, world: int) -> _UnitPlan:
    held = [_held(p, me) for _, p in params]
    regions = {d: [want(name, h.shape, d) for (name, _), h in zip(params, held)] for d in range(world)}
    send: list[torch.Tensor] = []
    send_sizes = [0] * world
    for d in range(world):
        for h, region in zip(held, regions[d]):
            if d not in h.rows_of:
                continue
            got = _piece(region.rows(h.shape), h.rows_of[me], region)
            if got is not None:
                a = h.rows_of[me][0]
                piece = _cols(h.local[got[0] - a : got[1] - a], region)
                send.append(piece)
                send_sizes[d] += piece.numel()
    recv: list[tuple[int, int, int, int]] = []
    recv_sizes = [0] * world
    for s in range(world):
        for i, (h, region) in enumerate(zip(held, regions[me])):
            if s not in h.rows_of:
                continue
            rows = region.rows(h.shape)
            got = _piece(rows, h.rows_of[s], region)
            if got is not None:
                numel = (got[1] - got[0]) * _row_numel(region.shape(h.shape))
                recv.append((i, got[0] - rows[0], got[1] - rows[0], numel))
                recv_sizes[s] += numel
    shapes = [region.shape(h.shape) for h, region in zip(held, regions[me])]
    return _UnitPlan([name for name, _ in params], shapes, send, send_sizes, recv, recv_sizes)


def _exchange(plan: _UnitPlan, send: torch.Tensor, recv: torch.Tensor, out: dict[str, torch.Tensor]) -> None:
    """Pack ``plan``'s pieces into ``send``, one all-to-all into ``recv``, unpack into ``out``'s tensors."""
    offset = 0
    for piece in plan.send:
        send[offset : offset + piece.numel()].view(piece.shape).copy_(piece)
        offset += piece.numel()
    send, recv = send[: sum(plan.send_sizes)], recv[: sum(plan.recv_sizes)]
    dist.all_to_all_single(recv, send, output_split_sizes=plan.recv_sizes, input_split_sizes=plan.send_sizes)
    offset = 0
    for i, lo, hi, numel in plan.recv:
        dst = out[plan.names[i]][lo:hi]
        dst.copy_(recv[offset : offset + numel].view(dst.shape))
        offset += numel


def _row_numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape[1:]:
        n *= int(s)
    return n


def fsdp_unit_params(model: torch.nn.Module) -> list[list[tuple[str, torch.Tensor]]]:
    """The parameters of ``model`` grouped by FSDP2 unit (pre-order, the root first), by their names in
    ``model.named_parameters()``; a model without FSDP is one group of all its parameters."""
    names = {id(p): n for n, p in model.named_parameters()}
    units = []
    for module in fsdp_modules(model):
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None:
            units.append([(names[id(fp.sharded_param)], fp.sharded_param) for fp in group.fsdp_params])
    if not units:
        return [list(model.named_parameters())]
    return units


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype the forward computes in: FSDP2's ``param_dtype`` (mixed precision), else the stored one."""
    for module in fsdp_modules(model):
        group = module._get_fsdp_state()._fsdp_param_group
        if group is not None and group.fsdp_params:
            return group.mp_policy.param_dtype or group.fsdp_params[0].sharded_param.dtype
    return next(model.parameters()).dtype


def reshard(
    model: torch.nn.Module,
    want: Want,
    *,
    device: torch.device,
    dtype: torch.dtype | None = None,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's region of every parameter of the FSDP2-sharded ``model``, by name, in ``dtype`` (None:
    :func:`compute_dtype`) on ``device``: one all-to-all per FSDP unit (module docstring).

    Collective over the default group (every rank calls it). The send and receive buffers are allocated
    once, at the size of the largest unit's exchange, and reused unit after unit. ``into``: tensors of
    the right shapes to fill (their addresses kept, e.g. for captured graphs), by name.
    """
    dtype = dtype or compute_dtype(model)
    me, world = dist.get_rank(), dist.get_world_size()
    plans = [_plan_unit(unit, want, me, world) for unit in fsdp_unit_params(model)]
    send = torch.empty(max(sum(p.send_sizes) for p in plans), dtype=dtype, device=device)
    recv = torch.empty(max(sum(p.recv_sizes) for p in plans), dtype=dtype, device=device)
    into = into or {}
    out: dict[str, torch.Tensor] = {}
    for plan in plans:
        for name, shape in zip(plan.names, plan.shapes):
            t = into.get(name)
            if t is None or tuple(t.shape) != shape or t.dtype != dtype or t.device != device:
                t = torch.empty(shape, dtype=dtype, device=device)
            out[name] = t
        _exchange(plan, send, recv, out)
    return out
