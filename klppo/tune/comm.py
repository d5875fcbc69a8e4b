"""Communication model: bytes per unit per step, a link-bandwidth probe, and whether prefetch hides it.

Per micro-batch, for a unit of ``U`` own parameters (per rank of a shard group of ``f`` ranks):

- all-gathers: ``U·c`` bytes gathered (the unsharded unit in the compute dtype), once in forward and,
  when ``reshard_after_forward``, again in backward (activation recomputation under checkpointing runs
  inside the backward gather, no third one). The root too (counted on FSDP2, torch 2.13).
- reduce-scatter: ``U·r`` bytes in (gradients in the reduce dtype, ``r`` = 4 for fp32, 2 for
  ``mixed_precision.reduce_dtype=bf16``), once per micro-batch in backward — or once per
  optimizer step when the role defers it to the mini-batch's last micro-batch
  (``fsdp_config.grad_sync_per_mini_batch``, :func:`klppo.tune.memory.defers_grad_sync`; on by default
  with more than one rank): per micro-batch that is ``U·r / num_micro`` on average.
- bus bytes a rank moves for a collective of ``B`` bytes: ``B·(f − 1)/f`` (ring); time = that / the
  probed bus bandwidth. ``f = 1``: nothing to move.

Hiding: with prefetch, unit ``i+1``'s gather runs while unit ``i`` computes: of its communication
``max(0, t_comm(i+1) − t_compute(i))`` is exposed (the longer neighbour's compute covers it; without
prefetch all of it), and it is hidden when that is 0. The exposure is partial, not all or nothing: at a link
where one unit's traffic takes about as long as its neighbour's compute, counting a unit as wholly hidden or
wholly exposed would flip whole rows of a sweep with a few GB/s. Compute time of a unit: ``2·M_i·T`` FLOPs
forward (``M_i``: its matmul
parameters, ``T`` tokens) and twice that in backward (plus one forward more under checkpointing),
divided by a matmul rate (measured with :func:`matmul_rate` or assumed).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from klppo.tune.memory import Point, Workload, point_defers_grad_sync
from klppo.tune.units import UnitSizes


@dataclass(frozen=True)
class UnitComm:
    """One unit's traffic and times for one micro-batch (bytes; seconds)."""

    index: int
    params: int
    all_gather_bytes: float
    reduce_scatter_bytes: float
    comm_s: float
    compute_s: float
    exposed_s: float = 0.0
    """The part of ``comm_s`` no neighbour's compute covers (all of it without prefetch)."""

    @property
    def hidden(self) -> bool:
        """Prefetching this unit during its neighbour's compute covers all of its communication."""
        return self.exposed_s == 0.0


def gathers_per_micro(units: UnitSizes, index: int, point: Point) -> int:
    """All-gathers of unit ``index`` per micro-batch (same for every unit, the root included)."""
    return 2 if point.reshard_after_forward else 1


def syncs_per_step(units: UnitSizes, point: Point, w: Workload, num_micro: int) -> int:
    """Gradient reduce-scatters per unit and optimizer step: 1 when the sync is deferred to the
    mini-batch's last micro-batch (the trainer's rule, :func:`point_defers_grad_sync`), else ``num_micro``."""
    return 1 if point_defers_grad_sync(w, point, units.total) else num_micro


def unit_bytes(units: UnitSizes, point: Point, w: Workload, num_micro: int = 1) -> list[tuple[float, float]]:
    """(all-gathered, reduce-scattered) bytes per micro-batch of each unit, in forward order; with the
    gradient sync deferred the reduce-scatter is the step's one over its ``num_micro`` micro-batches."""
    share = syncs_per_step(units, point, w, num_micro) / num_micro
    return [
        (gathers_per_micro(units, i, point) * size * w.compute_bytes, size * float(w.reduce_bytes) * share)
        for i, size in enumerate(units.sizes)
    ]


def step_bytes(units: UnitSizes, point: Point, w: Workload, num_micro: int) -> tuple[float, float]:
    """Totals over one optimizer step of ``num_micro`` micro-batches."""
    per = unit_bytes(units, point, w, num_micro)
    return num_micro * sum(a for a, _ in per), num_micro * sum(r for _, r in per)


def predict_units(
    units: UnitSizes,
    point: Point,
    w: Workload,
    *,
    bus_bandwidth: float,
    flops_per_s: float,
    num_micro: int = 1,
) -> list[UnitComm]:
    """Per-unit communication vs compute time for one micro-batch (module docstring), the reduce-scatter
    averaged over the step's ``num_micro`` micro-batches when it is deferred."""
    f = w.shard_ranks
    factor = (f - 1) / f if f > 1 else 0.0
    passes = 4.0 if w.grad_checkpointing else 3.0  # forward, backward (2×), recompute
    sent = unit_bytes(units, point, w, num_micro)
    compute = [passes * 2.0 * matmul * point.micro_tokens / flops_per_s for matmul in units.matmul]
    prefetch = point.forward_prefetch or w.backward_prefetch
    out = []
    for i, (ag, rs) in enumerate(sent):
        comm = (ag + rs) * factor / bus_bandwidth if factor else 0.0
        # unit i's traffic overlaps its longer neighbour's compute when prefetched
        neighbours = [compute[j] for j in (i - 1, i + 1) if 0 <= j < len(sent)]
        cover = max(neighbours, default=0.0) if prefetch else 0.0
        out.append(UnitComm(i, units.sizes[i], ag, rs, comm, compute[i], exposed_s=max(0.0, comm - cover)))
    return out


def probe_bandwidth(nbytes: int = 64 * 2**20, iters: int = 5, group=None) -> float:
    """Bus bandwidth (bytes/s) of ``all_gather_into_tensor`` on ``group`` (default group): each rank
    contributes ``nbytes / f``; bus bytes = ``nbytes·(f − 1)/f`` per call. ``inf`` for one rank."""
    f = dist.get_world_size(group)
    if f == 1:
        return float("inf")
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    device = device or torch.device("cpu")
    shard = torch.ones(nbytes // f // 2, dtype=torch.bfloat16, device=device)
    out = torch.empty(shard.numel() * f, dtype=shard.dtype, device=device)
    dist.all_gather_into_tensor(out, shard, group=group)  # warm-up (connection set-up)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        dist.all_gather_into_tensor(out, shard, group=group)
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - t0) / iters
    return out.numel() * 2 * (f - 1) / f / seconds


def matmul_rate(device: torch.device, n: int = 4096, iters: int = 10) -> float:
    """Measured FLOP/s of an ``n×n`` matmul (bf16 on GPU, fp32 on CPU with n capped at 512)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else min(n, 512)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2.0 * n**3 * iters / (time.perf_counter() - t0)
