"""Rank programs for tests/parallel/test_fsdp.py (and the checks of test_local_shards.py and test_plain.py):
started by torch.multiprocessing (spawn), gloo on CPU.

Each launch runs many checks (one factor at a time) and rank 0 writes its results to ``out_dir``; the
assertions are made in the pytest process against a plain single-process reference.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import local_shards_worker
import plain_worker
import torch
import torch.distributed as dist

from klppo.models.tiny import build_tiny_model
from klppo.parallel.checkpoint import full_model_state_dict, load_checkpoint, save_checkpoint
from klppo.parallel.dist import CollectiveTimeoutError, destroy, init_distributed, phase
from klppo.parallel.fsdp import FSDPSettings, build_mesh, clip_grad_norm_, gathered_params, shard_model
from klppo.parallel.offload import load_optimizer, load_params, offload_optimizer, offload_params

NUM_LAYERS, STEPS, BATCH, SEQ, LR, MAX_NORM = 4, 3, 4, 16, 1e-2, 1.0
MID_THRESHOLD = 40_000  # two decoder layers per unit on the tiny model (see test_units.py)
BIG_THRESHOLD = 10**12  # root only

CONFIGS: dict[str, FSDPSettings] = {
    "baseline": FSDPSettings(),
    "threshold_mid": FSDPSettings(min_num_params=MID_THRESHOLD),
    "threshold_big": FSDPSettings(min_num_params=BIG_THRESHOLD),
    "forward_prefetch": FSDPSettings(forward_prefetch=True),
    "no_backward_prefetch": FSDPSettings(backward_prefetch=False),
    "no_reshard": FSDPSettings(reshard_after_forward=False),
    "param_offload": FSDPSettings(param_offload=True),
    "optimizer_offload": FSDPSettings(optimizer_offload=True),
    "offload_policy": FSDPSettings(offload_policy=True),
    "fsdp_size_1": FSDPSettings(fsdp_size=1),
    "fsdp_size_2": FSDPSettings(fsdp_size=2),
    "grad_checkpointing": FSDPSettings(),  # HF activation checkpointing inside FSDP2 units
}
COUNTED = ("baseline", "threshold_mid", "threshold_big", "no_reshard", "forward_prefetch")


def batches() -> torch.Tensor:
    """Token ids, shape (STEPS, BATCH, SEQ): the same global data for every world size."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, 384, (STEPS, BATCH, SEQ), generator=g)


def new_model() -> torch.nn.Module:
    return build_tiny_model(num_layers=NUM_LAYERS, seed=0)


def new_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)


def train_step(model, opt, x_BT: torch.Tensor, settings: FSDPSettings | None = None) -> tuple[float, float]:
    """One AdamW step on this rank's rows; returns (global mean loss, global grad norm before clipping).

    Every rank has the same number of tokens, so the mean of rank means is the global token mean, and
    FSDP's gradient average over ranks gives the gradient of the global mean.
    """
    s = settings or FSDPSettings()
    if s.param_offload:
        load_params(model, "cpu")
    if s.optimizer_offload:
        load_optimizer(opt, "cpu")
    loss = model(input_ids=x_BT, labels=x_BT).loss
    loss.backward()
    norm = clip_grad_norm_(model, MAX_NORM)
    opt.step()
    opt.zero_grad(set_to_none=True)
    if s.param_offload:
        offload_params(model)
    if s.optimizer_offload:
        offload_optimizer(opt)
    loss = loss.detach().clone()
    if dist.is_initialized():
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss.item(), norm.item()


class CommCounter:
    """Counts FSDP2's all-gathers and reduce-scatters (calls, bytes) by wrapping torch.distributed."""

    NAMES = {
        "all_gather_into_tensor": "ag",
        "all_gather_single": "ag",
        "reduce_scatter_tensor": "rs",
        "reduce_scatter_single": "rs",
    }

    def __init__(self) -> None:
        self.calls = {"ag": 0, "rs": 0}
        self.bytes = {"ag": 0, "rs": 0}
        self._saved: dict[str, object] = {}

    def __enter__(self) -> CommCounter:
        for name, kind in self.NAMES.items():
            if hasattr(dist, name):
                self._saved[name] = fn = getattr(dist, name)
                setattr(dist, name, self._wrap(fn, kind))
        return self

    def _wrap(self, fn, kind):
        def wrapper(*args, **kwargs):
            output = kwargs.get("output", kwargs.get("output_tensor", args[0] if args else None))
            inp = kwargs.get("input", kwargs.get("input_tensor", args[1] if len(args) > 1 else None))
            big = output if kind == "ag" else inp  # the full (unsharded, padded) side
            self.calls[kind] += 1
            self.bytes[kind] += big.numel() * big.element_size()
            return fn(*args, **kwargs)

        return wrapper

    def __exit__(self, *exc) -> None:
        for name, fn in self._saved.items():
            setattr(dist, name, fn)


def _setup(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1"
    )
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=60)


def run_config(name: str, settings: FSDPSettings, world_size: int, rank: int) -> dict:
    """Train STEPS steps under ``settings``; returns losses, norms, comm counts, final full weights."""
    mesh = build_mesh(world_size, settings.fsdp_size, "cpu")
    model = new_model()
    if name == "grad_checkpointing":
        model.gradient_checkpointing_enable()
        model.train()
    report = shard_model(model, settings, mesh)
    opt = new_optimizer(model)
    rows = BATCH // world_size
    losses, norms, comm = [], [], None
    for step, x in enumerate(batches()):
        x_local = x[rank * rows : (rank + 1) * rows]
        if step == 1 and name in COUNTED:
            with CommCounter() as counter:
                loss, norm = train_step(model, opt, x_local, settings)
            comm = {"calls": counter.calls, "bytes": counter.bytes}
        else:
            loss, norm = train_step(model, opt, x_local, settings)
        losses.append(loss)
        norms.append(norm)
    if settings.param_offload:
        load_params(model, "cpu")
    weights = full_model_state_dict(model)
    return {"losses": losses, "norms": norms, "comm": comm, "units": report.count, "weights": weights}


def greedy_check(world_size: int, rank: int) -> dict:
    """Greedy generation on gathered weights (sharded by threshold 0) and the gathered params."""
    model = new_model()
    shard_model(model, FSDPSettings(), build_mesh(world_size, -1, "cpu"))
    prompt = batches()[0, :2, :6]
    with torch.no_grad(), gathered_params(model):
        params = {k: v.detach().clone() for k, v in model.named_parameters()}
        out = model.generate(input_ids=prompt, max_new_tokens=6, do_sample=False)
    is_dtensor_after = type(next(model.parameters())).__name__ == "DTensor"
    return {"tokens": out, "params": params, "resharded": is_dtensor_after}


def timeout_check(rank: int) -> str:
    """Rank 1 skips a collective; rank 0 must fail within the group's 1.5 s with the phase named."""
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=1.5))
    message = ""
    if rank == 0:
        try:
            with phase("timeout-probe"):
                dist.all_reduce(torch.ones(1), group=group)
        except CollectiveTimeoutError as e:
            message = str(e)
    else:
        time.sleep(3.0)
    return message


def main_two(rank: int, port: int, out_dir: str, ckpt_in: str) -> None:
    """The 2-rank launch: every config, greedy generation, checkpoint 1 → 2 and 2 → 1, timeout."""
    _setup(rank, 2, port)
    results = {name: run_config(name, s, 2, rank) for name, s in CONFIGS.items()}
    results["greedy"] = greedy_check(2, rank)
    results["resume"] = resume_from(ckpt_in, 2, rank)
    save_after_two_steps(Path(out_dir) / "ckpt_from_2", 2, rank)
    results["timeout_message"] = timeout_check(rank)
    results["local_shards"] = local_shards_worker.checks(2, out_dir)  # test_local_shards.py
    results["plain"] = plain_worker.checks(2, out_dir)  # test_plain.py
    if rank == 0:
        torch.save(results, Path(out_dir) / "two.pt")
    destroy()


def main_one(rank: int, port: int, out_dir: str) -> None:
    """The 1-rank launch (FSDP over a world of 1): save after 2 steps, run step 3; time vs plain."""
    _setup(rank, 1, port)
    ckpt = Path(out_dir) / "ckpt_from_1"
    model, opt = save_after_two_steps(ckpt, 1, rank)
    loss, norm = train_step(model, opt, batches()[2])
    result = {"step3_loss": loss, "step3_weights": full_model_state_dict(model)}
    result["overhead"] = overhead_1proc()
    result["local_shards"] = local_shards_worker.checks(1, out_dir)  # test_local_shards.py
    result["plain"] = plain_worker.checks(1, out_dir)  # test_plain.py
    torch.save(result, Path(out_dir) / "one.pt")
    destroy()


def save_after_two_steps(directory: Path, world_size: int, rank: int):
    model = new_model()
    shard_model(model, FSDPSettings(), build_mesh(world_size, -1, "cpu"))
    opt = new_optimizer(model)
    rows = BATCH // world_size
    for x in batches()[:2]:
        train_step(model, opt, x[rank * rows : (rank + 1) * rows])
    save_checkpoint(directory, model, opt)
    return model, opt


def resume_from(directory: str, world_size: int, rank: int) -> dict:
    """Load a checkpoint (written by another world size) into fresh shards and run step 3."""
    model = new_model()
    shard_model(model, FSDPSettings(), build_mesh(world_size, -1, "cpu"))
    opt = new_optimizer(model)
    load_checkpoint(directory, model, opt)
    rows = BATCH // world_size
    loss, _ = train_step(model, opt, batches()[2][rank * rows : (rank + 1) * rows])
    return {"step3_loss": loss, "step3_weights": full_model_state_dict(model)}


def overhead_1proc(steps: int = 5) -> dict:
    """Seconds per training step: plain model vs the same model fully_shard-ed over a world of 1."""
    times = {}
    for label in ("plain", "fsdp_world1"):
        model = new_model()
        if label == "fsdp_world1":
            shard_model(model, FSDPSettings(), build_mesh(1, -1, "cpu"))
        opt = new_optimizer(model)
        x = batches()[0]
        train_step(model, opt, x)  # warm-up (lazy init)
        start = time.perf_counter()
        for _ in range(steps):
            train_step(model, opt, x)
        times[label] = (time.perf_counter() - start) / steps
    return times
