"""Checks for tests/parallel/test_local_shards.py, run inside tests/parallel/fsdp_worker.py's launches (gloo
on CPU, a world of 1 and of 2: no spawn of their own): the optimizer step and the gradient clip on the
DTensors' local shards (``local``: klppo's) against the DTensor path (``dtensor``: torch's AdamW and clip on
the DTensors, the oracle) on the same FSDP2 model."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from klppo.parallel.checkpoint import load_checkpoint, save_checkpoint
from klppo.parallel.fsdp import build_mesh, clip_grad_norm_
from klppo.parallel.local_shards import local_total_norm
from klppo.roles.optim import OptimSettings, build_optimizer, build_scheduler

STEPS, ROWS, MAX_NORM = 4, 8, 0.05
SMALL_STEP = STEPS - 1  # its loss scaled by 1e-4: a norm under MAX_NORM, so the clip must leave it as it is
# a warm-up of 2 steps: the scheduler changes the lr at every step
OPTIM = OptimSettings(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), warmup_steps=2, total_steps=STEPS)
PATHS = {"dtensor": False, "local": True}


def optimizer(params, local: bool) -> torch.optim.Optimizer:
    """klppo's optimizer (local shards), or the oracle: torch's AdamW with the same arguments."""
    if local:
        return build_optimizer(params, OPTIM)
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=OPTIM.lr,
        betas=OPTIM.betas,
        weight_decay=OPTIM.weight_decay,
    )


def clip(model: nn.Module, local: bool) -> torch.Tensor:
    """klppo's clip (local shards), or the oracle: torch's total norm and clip on the DTensors."""
    if local:
        return clip_grad_norm_(model, MAX_NORM)
    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
    total = total.full_tensor() if isinstance(total, DTensor) else total
    torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
    return total


def new_model(mesh) -> nn.Module:
    """Three linear layers (dim 0 of 8, 5 and 1 rows: uneven shards, an empty one on 2 ranks), a frozen
    bias; FSDP2 units: the first two layers and the root."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5), nn.Tanh(), nn.Linear(5, 1))
    model[0].bias.requires_grad_(False)
    for unit in (model[0], model[2]):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def batch(step: int, rank: int, world: int) -> torch.Tensor:
    rows = ROWS // world
    return torch.randn(ROWS, 6, generator=torch.Generator().manual_seed(step))[
        rank * rows : (rank + 1) * rows
    ]


def backward(model: nn.Module, step: int) -> None:
    """The gradient of the global mean of out² (FSDP2 averages over ranks holding equal rows)."""
    scale = 1e-4 if step == SMALL_STEP else 1.0
    (scale * (model(batch(step, dist.get_rank(), dist.get_world_size())) ** 2).mean()).backward()


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    """DCP's state dicts as the checkpoint sees them: full values, and each tensor's type and placements."""
    model_sd, optim_sd = get_state_dict(model, [opt])

    def walk(tree):
        if isinstance(tree, dict):
            return {k: walk(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [walk(v) for v in tree]
        if isinstance(tree, torch.Tensor):
            return (type(tree).__name__, str(getattr(tree, "placements", None)), full(tree))
        return tree

    return {"model": walk(model_sd), "optim": walk(optim_sd)}


def train(mesh, local: bool) -> dict:
    """STEPS steps of clip + AdamW under the scheduler; the full gradients before each clip recorded."""
    model = new_model(mesh)
    opt = optimizer(model.parameters(), local)
    scheduler = build_scheduler(opt, OPTIM)
    out = {"initial": {k: full(p) for k, p in model.named_parameters()}, "grads": [], "norms": [], "lrs": []}
    out["step_lists"] = seen = []  # per step: did the functional update get any DTensor?
    init_group = opt._init_group

    def recording(group, *lists):
        has_complex = init_group(group, *lists)
        seen.append(any(isinstance(t, DTensor) for items in lists if isinstance(items, list) for t in items))
        return has_complex

    opt._init_group = recording
    for step in range(STEPS):
        backward(model, step)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        out.setdefault("clip_local", []).append(local_total_norm(grads) is not None)
        out["grads"].append({k: full(p.grad) for k, p in model.named_parameters() if p.grad is not None})
        out["norms"].append(clip(model, local))
        out["lrs"].append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
        opt.zero_grad(set_to_none=True)
    out["class"] = type(opt).__name__
    out["state"] = full_state(model, opt)
    del opt._init_group  # the instance attribute (pickling and later use see the class's method)
    out["model"], out["opt"] = model, opt
    return out


def non_finite(mesh, value: float) -> dict:
    """One gradient element set to ``value`` (nan or inf) on rank 0's shard: norm and clipped gradients."""
    out = {}
    for name, local in PATHS.items():
        model = new_model(mesh)
        backward(model, 0)
        if dist.get_rank() == 0:
            with torch.no_grad():
                model[2].weight.grad.to_local()[0, 1] = value
        norm = clip(model, local)
        out[name] = {
            "norm": norm,
            "grads": {k: full(p.grad) for k, p in model.named_parameters() if p.grad is not None},
        }
    return out


def cross_load(mesh, runs: dict, directory: Path) -> dict:
    """Each path's checkpoint loaded into a fresh model and optimizer of the other path: its state."""
    out = {}
    for name, local in PATHS.items():
        other = "dtensor" if local else "local"
        save_checkpoint(directory / name, runs[name]["model"], runs[name]["opt"])
        model = new_model(mesh)
        opt = optimizer(model.parameters(), not local)
        build_scheduler(opt, OPTIM)  # as the trainer does before loading (the groups' initial_lr)
        load_checkpoint(directory / name, model, opt)
        out[f"{name}_into_{other}"] = full_state(model, opt)
    return out


def checks(world: int, out_dir: str) -> dict:
    """Every check on a world of ``world`` (the caller's process group, all ranks calling); the world of 2
    also resumes the world of 1's checkpoint, so it runs second. What rank 0 keeps: full tensors."""
    mesh = build_mesh(world, -1, "cpu")
    out = Path(out_dir) / "local_shards"
    runs = {name: train(mesh, local) for name, local in PATHS.items()}
    result = {"cross": cross_load(mesh, runs, out / f"ckpt_w{world}")}
    result["nan"], result["inf"] = non_finite(mesh, float("nan")), non_finite(mesh, float("inf"))
    if world == 2:
        model = new_model(mesh)
        opt = optimizer(model.parameters(), True)
        build_scheduler(opt, OPTIM)
        load_checkpoint(out / "ckpt_w1" / "local", model, opt)
        result["from_w1"] = full_state(model, opt)
    for run in runs.values():
        del run["model"], run["opt"]
    result["runs"] = runs
    return result
