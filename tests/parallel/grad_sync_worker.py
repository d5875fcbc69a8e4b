"""Rank program of tests/parallel/test_grad_sync.py (spawned, gloo on CPU): the actor's and the critic's
update under FSDP2 with the gradient reduce-scatter per micro-batch (FSDP2's default) and once per mini-batch
(``grad_sync_per_mini_batch``), fp32; rank 0 writes what the test compares.

Per role and switch: the full gradients each optimizer step sees, the full weights after the update, the
collectives of the update (reduce-scatters, all-gathers, all-reduces; FSDP2's ``foreach_reduce`` calls,
which run on one rank too), and with the switch on a checkpoint save → load → second update.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_param_group
from torch.distributed.tensor import DTensor

from klppo.batch import Batch
from klppo.models.tiny import build_tiny_model
from klppo.parallel.checkpoint import full_model_state_dict, load_checkpoint, save_checkpoint
from klppo.parallel.dist import destroy, init_distributed
from klppo.parallel.fsdp import FSDPSettings, build_mesh, fsdp_modules, shard_model
from klppo.roles.actor import Actor, ActorSettings
from klppo.roles.critic import Critic, CriticSettings
from klppo.roles.forward import MicroBatching
from klppo.roles.optim import OptimSettings

ROWS, PROMPT, RESPONSE = 8, 5, 6  # global rows of the update batch
MINI_ROWS = 4  # global rows of a mini-batch: 2 optimizer steps
NUM_LAYERS = 2  # FSDP units: one per layer + the root
OPTIM = OptimSettings(lr=0.1, optimizer="SGD", weight_decay=0.0, extra=(("momentum", 0.9),))


class Counter:
    """Calls of the torch.distributed collectives FSDP2 and the update use, and of FSDP2's foreach_reduce."""

    NAMES = {
        "reduce_scatter_tensor": "reduce_scatter",
        "reduce_scatter_single": "reduce_scatter",
        "all_gather_into_tensor": "all_gather",
        "all_gather_single": "all_gather",
        "all_reduce": "all_reduce",
    }

    def __init__(self) -> None:
        self.calls = {name: 0 for name in ("reduce_scatter", "all_gather", "all_reduce", "foreach_reduce")}
        self._saved: list[tuple[object, str, object]] = []

    def _patch(self, owner, name: str, key: str) -> None:
        fn = getattr(owner, name)

        def wrapper(*args, **kwargs):
            self.calls[key] += 1
            return fn(*args, **kwargs)

        self._saved.append((owner, name, fn))
        setattr(owner, name, wrapper)

    def __enter__(self) -> Counter:
        for name, key in self.NAMES.items():
            if hasattr(dist, name):
                self._patch(dist, name, key)
        self._patch(_fsdp_param_group, "foreach_reduce", "foreach_reduce")
        return self

    def __exit__(self, *exc) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)


def local_rows(world: int, rank: int) -> list[int]:
    """This rank's rows of the global batch, ordered so that the i-th mini-batch of every world size holds
    the same global rows (2 ranks: rank 0 rows 0-3, rank 1 rows 4-7, mini-batch 0 = rows 0, 1, 4, 5)."""
    if world == 2:
        return list(range(rank * ROWS // 2, (rank + 1) * ROWS // 2))
    return [0, 1, 4, 5, 2, 3, 6, 7]


def update_batch() -> Batch:
    """The global batch (same on every world size), split by :func:`local_rows`."""
    g = torch.Generator().manual_seed(7)
    B, P, R = ROWS, PROMPT, RESPONSE
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    mask = torch.ones(B, R)
    mask[1, 3:] = 0
    mask[5, 1:] = 0
    return Batch(
        prompts=torch.randint(3, 300, (B, P), generator=g),
        prompt_mask=prompt_mask,
        responses=torch.randint(3, 300, (B, R), generator=g),
        response_mask=mask,
        old_log_probs=(-5.0 + 0.1 * torch.randn(B, R, generator=g)) * mask,
        ref_log_probs=(-5.0 + 0.1 * torch.randn(B, R, generator=g)) * mask,
        advantages=torch.randn(B, R, generator=g) * mask,
        values=0.1 * torch.randn(B, R, generator=g) * mask,
        returns=torch.randn(B, R, generator=g) * mask,
    )


def new_model(role: str) -> torch.nn.Module:
    policy = build_tiny_model(num_layers=NUM_LAYERS, seed=0)
    if role == "actor":
        return policy
    from transformers import AutoModelForTokenClassification

    config = policy.config
    config.num_labels, config.classifier_dropout = 1, 0.0  # as klppo.models.loading.load_critic
    torch.manual_seed(1)
    return AutoModelForTokenClassification.from_config(config)


def new_role(role: str, world: int, defer: bool):
    model = new_model(role)
    shard_model(model, FSDPSettings(), build_mesh(world, -1, "cpu"))
    common = dict(
        mini_batch_size=MINI_ROWS // world,
        update_micro=MicroBatching(micro_batch_size=1),  # 4 // world micro-batches per mini-batch
        grad_clip=1e9,
        grad_sync_per_mini_batch=defer,
    )
    if role == "actor":
        return Actor(model, ActorSettings(**common, use_kl_loss=True, entropy_coeff=0.01), OPTIM)
    return Critic(model, CriticSettings(**common), OPTIM)


def run_update(obj, role: str, batch: Batch) -> dict:
    return obj.update_policy(batch) if role == "actor" else obj.update_critic(batch)


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full weights, copied: on one rank ``full_model_state_dict`` may return the CPU parameters
    themselves."""
    return {k: v.clone() for k, v in full_model_state_dict(model).items()}


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def record_step_grads(obj) -> list[dict[str, torch.Tensor]]:
    """Full gradients seen by each optimizer step of ``obj`` (appended to the returned list)."""
    seen: list[dict[str, torch.Tensor]] = []
    step = obj.optimizer.step
    names = {id(p): n for n, p in obj.model.named_parameters()}

    def recording_step(*args, **kwargs):
        seen.append({names[id(p)]: full(p.grad) for g in obj.optimizer.param_groups for p in g["params"]})
        return step(*args, **kwargs)

    obj.optimizer.step = recording_step
    return seen


def run_case(role: str, world: int, rank: int, defer: bool, ckpt: Path) -> dict:
    batch = update_batch()
    local = batch.select(local_rows(world, rank))
    obj = new_role(role, world, defer)
    grads = record_step_grads(obj)
    with Counter() as counter:
        metrics = run_update(obj, role, local)
    grads = list(grads)  # this update's steps only
    weights = full_weights(obj.model)
    sync_restored = all(
        group.reduce_grads
        for m in fsdp_modules(obj.model)
        for group in m._get_fsdp_state()._fsdp_param_groups
    )
    out = {
        "grads": grads,
        "weights": weights,
        "calls": counter.calls,
        "grad_norm": metrics[f"{role}/grad_norm"],
        "sync_restored": sync_restored,
    }
    if defer:  # checkpoint: save after the update, load into a fresh role, one more update on both
        save_checkpoint(ckpt, obj.model, obj.optimizer)
        resumed = new_role(role, world, defer)
        load_checkpoint(ckpt, resumed.model, resumed.optimizer)
        run_update(obj, role, local)
        run_update(resumed, role, local)
        out.update(second=full_weights(obj.model), second_resumed=full_weights(resumed.model))
    return out


def main(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    init_distributed("cpu", timeout_s=120)
    out = Path(out_dir)
    results = {}
    for role in ("actor", "critic"):
        for defer in (False, True):
            results[(role, defer)] = run_case(role, world, rank, defer, out / f"ckpt_{world}_{role}_{defer}")
    if rank == 0:
        torch.save(results, out / f"grad_sync_{world}.pt")
    destroy()
