"""Short real actor-update steps for one grid point: peak memory, step time, exposed communication.

One *step* is what the actor does per optimizer step: (``offload="idle"``: load the parameter shards
and AdamW state to the device) → ``num_micro`` micro-batches of ``micro_tokens`` tokens, each a packed
forward to response-token log-probs (:func:`klppo.batching.packing.forward_log_probs`) and a backward
of their mean → gradient clipping → AdamW step → (``idle``: offload both again). On the plain path
(:meth:`Workload.runs_plain`: one process, no FSDP2) the trainer's arithmetic
(:class:`klppo.roles.trained.TrainedRole`): each micro-batch's backward is added into the master gradients
(:meth:`MasterWeights.accumulate_grads`), the clip and AdamW work on the masters, which are copied back
into the compute copy after the step; ``idle`` moves both copies (what the trainer's offload schedule
moves, ``TrainedRole.resident``) and the AdamW state. Weights are random
(timing and memory do not depend on their values). Each point starts from a fresh model and optimizer;
after it, everything is freed. An out-of-memory error is caught and reported as ``"oom"`` (the sweep
goes on). Exposed communication comes from a profiled step: the time of collective kernels (NCCL on
GPU; gloo ops on CPU) not covered by any compute kernel (:func:`exposed_time`). On one GPU it is ~0.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM

from klppo.batching.attention import enable_packed_attention
from klppo.batching.packing import forward_log_probs
from klppo.parallel.fsdp import FSDPSettings, build_mesh, clip_grad_norm_, shard_model
from klppo.parallel.offload import load_optimizer, load_params, offload_optimizer, offload_params
from klppo.parallel.plain import MasterWeights, plain_model
from klppo.roles.optim import OptimSettings, build_optimizer
from klppo.tune.intervals import Interval, exposed_time
from klppo.tune.memory import Point, Workload


@dataclass
class Measurement:
    """Outcome of one grid point; times in seconds, memory in bytes (peak of the timed steps)."""

    point: Point
    status: str
    """ok | oom | error | skipped (ruled out by the memory model or the time budget)."""
    peak_bytes: float = math.nan
    step_s: float = math.nan
    exposed_comm_s: float = math.nan
    comm_s: float = math.nan
    predicted_bytes: float = math.nan
    note: str = ""


_COLLECTIVE_WORDS = (
    "nccl",
    "gloo:",
    "c10d::allgather",
    "c10d::_allgather",
    "c10d::reduce_scatter",
    "c10d::_reduce",
)
_CPU_COMPUTE = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot_product", "aten::_flash")


def split_profile(events, device_type: str) -> tuple[list[Interval], list[Interval]]:
    """(collective, compute) intervals in seconds from a profiler's ``events()``.

    GPU: CUDA kernels, collectives are those whose name contains "nccl". CPU (gloo, mechanics only):
    gloo / c10d collective ops against matmul-like aten ops.
    """
    comm, compute = [], []
    for e in events:
        name = e.name.lower()
        span = (e.time_range.start / 1e6, e.time_range.end / 1e6)
        is_comm = any(w in name for w in _COLLECTIVE_WORDS)
        if device_type == "cuda":
            if str(e.device_type).endswith("CUDA") and "memcpy" not in name and "memset" not in name:
                (comm if is_comm else compute).append(span)
        elif is_comm:
            comm.append(span)
        elif any(name.startswith(w) for w in _CPU_COMPUTE):
            compute.append(span)
    return comm, compute


def build(config, point: Point, w: Workload, device: torch.device):
    """A random actor sharded for ``point`` (fp32 master weights) and its AdamW; on the plain path
    (:meth:`Workload.runs_plain`) the actor's :class:`MasterWeights` (the model: ``.model``) instead of
    an FSDP2 model, the AdamW over its masters, as the trainer builds them."""

    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False
    if w.grad_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    enable_packed_attention(model)
    settings = FSDPSettings(
        min_num_params=point.min_num_params,
        param_offload=point.offload == "idle",
        optimizer_offload=point.offload == "idle",
        offload_policy=point.offload == "cpu",
        reshard_after_forward=point.reshard_after_forward,
        fsdp_size=w.fsdp_size,
        forward_prefetch=point.forward_prefetch,
        backward_prefetch=w.backward_prefetch,
        param_dtype=torch.bfloat16 if device.type == "cuda" else None,
        reduce_dtype=getattr(torch, w.reduce_dtype),  # the configured one, as the models assume
        plain=w.runs_plain(point),
    )
    if settings.plain:
        masters = plain_model(model, settings)
        return masters, build_optimizer(masters.module.parameters(), OptimSettings())
    shard_model(model, settings, build_mesh(w.world_size, w.fsdp_size, device.type))
    # the trainer's optimizer: AdamW (lr 1e-6, weight decay 0.01) on the local shards, fused on CUDA
    optimizer = build_optimizer(model.parameters(), OptimSettings())
    return model, optimizer


def micro_batch(config, point: Point, w: Workload, seq_len: int, device: torch.device, seed: int):
    """``micro_tokens`` tokens as rows of ``seq_len`` (prompt + response), no padding."""
    seq_len = min(seq_len, point.micro_tokens)
    rows = max(1, point.micro_tokens // seq_len)
    response = max(1, round(seq_len * w.response_fraction))
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, config.vocab_size, (rows, seq_len), generator=gen).to(device)
    mask = torch.ones_like(input_ids)
    positions = torch.arange(seq_len, device=device).expand(rows, seq_len)
    return input_ids, mask, positions, response


def actor_step(model, optimizer, batches, point: Point, device: torch.device) -> None:
    """One optimizer step over ``batches`` (the module docstring's sequence); ``model`` as :func:`build`
    returns it: an FSDP2 model, or the plain path's :class:`MasterWeights`."""
    masters = model if isinstance(model, MasterWeights) else None
    if point.offload == "idle":
        load_params(model, device)  # on the plain path both copies (MasterWeights.to)
        load_optimizer(optimizer, device)
    for input_ids, mask, positions, response in batches:
        log_probs, _ = forward_log_probs(
            model if masters is None else masters.model,
            input_ids,
            mask,
            positions,
            response_length=response,
            use_remove_padding=True,
        )
        (-log_probs.mean() / len(batches)).backward()
        if masters is not None:  # FSDP2's one-rank reduce into the master gradients
            masters.accumulate_grads()
    if masters is None:
        clip_grad_norm_(model, 1.0)
        optimizer.step()
    else:
        masters.clip_grad_norm_(1.0)
        optimizer.step()
        masters.copy_to_model()
    optimizer.zero_grad(set_to_none=True)
    if point.offload == "idle":
        offload_optimizer(optimizer)
        offload_params(model)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_point(
    config,
    point: Point,
    w: Workload,
    *,
    device: torch.device,
    steps: int = 2,
    num_micro: int = 2,
    seq_len: int = 1024,
    profile: bool = True,
) -> Measurement:
    """Warm-up step, ``steps`` timed steps (median time, peak memory), and one profiled step."""
    model, optimizer = build(config, point, w, device)
    batches = [micro_batch(config, point, w, seq_len, device, seed=i) for i in range(num_micro)]
    if point.offload == "idle":
        offload_params(model)
    actor_step(model, optimizer, batches, point, device)  # warm-up: AdamW state, kernels, caches
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        actor_step(model, optimizer, batches, point, device)
        _sync(device)
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else math.nan
    comm = exposed = math.nan
    if profile:
        comm, exposed = _profiled_step(model, optimizer, batches, point, device)
    return Measurement(point, "ok", peak, statistics.median(times), exposed, comm)


def _profiled_step(model, optimizer, batches, point: Point, device: torch.device) -> tuple[float, float]:
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        actor_step(model, optimizer, batches, point, device)
        _sync(device)
    comm, compute = split_profile(prof.events(), device.type)
    return exposed_time(comm, compute)


def free_memory(device: torch.device) -> None:
    """Collect garbage and return cached blocks, so the next point starts from an empty device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def safe_measure(fn: Callable[[], Measurement], point: Point, device: torch.device) -> Measurement:
    """``fn()``, with an out-of-memory error turned into ``status="oom"`` (any other exception into
    ``"error"`` with its message) and the memory freed after, so that a sweep goes on."""
    try:
        result = fn()
    except torch.OutOfMemoryError as e:
        result = Measurement(point, "oom", note=str(e).splitlines()[0][:120])
    except Exception as e:  # an allocator failure raised as a plain RuntimeError, or a point that fails
        status = "oom" if "out of memory" in str(e).lower() else "error"
        result = Measurement(point, status, note=f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    free_memory(device)
    return result
