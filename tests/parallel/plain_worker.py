"""Checks for tests/parallel/test_plain.py, run inside tests/parallel/fsdp_worker.py's launches (gloo on CPU,
a world of 1, then of 2: no spawn of their own): the actor trained on the plain path (one process without
FSDP2, :mod:`klppo.parallel.plain`) against the same actor under FSDP2, in mixed precision (bf16 compute,
fp32 reduce and masters), and checkpoints moved between the two paths and world sizes."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from klppo.assembly.roles_build import shard
from klppo.assembly.settings import fsdp_settings
from klppo.batch import Batch
from klppo.config import load_config
from klppo.models.tiny import build_tiny_model
from klppo.parallel.checkpoint import load_checkpoint, save_checkpoint
from klppo.parallel.fsdp import FSDPSettings, build_mesh, shard_model
from klppo.parallel.plain import plain_model
from klppo.roles.actor import Actor, ActorSettings
from klppo.roles.forward import MicroBatching
from klppo.roles.optim import OptimSettings

# per update call, global: 2 mini-batches of 4 rows, 2 micro-batches of 2 rows each (world of 1)
ROWS, MINI = 8, 4
CALLS = 5  # update calls before the checkpoint (10 optimizer steps, two calls skipped)
NAN_CALL = 2  # this call's advantages hold a nan: its first optimizer step is skipped, and the rest of it
INF_CALL = 3  # this call's first loss is finite, its gradient infinite: the step skipped for the grad norm
GRAD_CLIP = 0.3  # under most steps' norm: the clip scales them
SETTINGS = FSDPSettings(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
OPTIM = OptimSettings(lr=2e-2, weight_decay=0.1, betas=(0.9, 0.99), warmup_steps=2, total_steps=10)


def actor_settings(world: int) -> ActorSettings:
    return ActorSettings(
        mini_batch_size=MINI // world,
        update_micro=MicroBatching(micro_batch_size=2 // world),
        grad_clip=GRAD_CLIP,
        use_kl_loss=True,
        kl_loss_type="low_var_kl",
        entropy_coeff=0.01,
    )


def batch(call: int, rank: int = 0, world: int = 1) -> Batch:
    """Call ``call``'s rows on ``rank`` (the same global rows for every world size)."""
    g = torch.Generator().manual_seed(100 + call)
    P, R = 5, 6
    mask = torch.ones(ROWS, R)
    mask[1, 3:] = 0
    mask[5, 1:] = 0
    advantages = torch.randn(ROWS, R, generator=g) * mask
    if call == NAN_CALL:
        advantages[0, 0] = float("nan")
    full = Batch(
        prompts=torch.randint(3, 300, (ROWS, P), generator=g),
        prompt_mask=torch.ones(ROWS, P, dtype=torch.long),
        responses=torch.randint(3, 300, (ROWS, R), generator=g),
        response_mask=mask,
        old_log_probs=-5.0 + 0.1 * torch.randn(ROWS, R, generator=g) * mask,
        ref_log_probs=-5.0 + 0.1 * torch.randn(ROWS, R, generator=g) * mask,
        advantages=advantages,
    )
    return full.select(rank_rows(rank, world))


def rank_rows(rank: int, world: int) -> list[int]:
    """The global rows ``rank`` holds: its share of each global mini-batch of 4 rows, so that the world's
    mini-batch is the same rows on every world size."""
    share = MINI // world
    return [start + rank * share + j for start in range(0, ROWS, MINI) for j in range(share)]


def new_actor(path: str, world: int) -> Actor:
    """The tiny model (fp32 masters) as an actor on ``path``: ``plain`` or ``fsdp`` (FSDP2 over the world)."""
    model = build_tiny_model(seed=0)
    masters = None
    if path == "plain":
        masters = plain_model(model, SETTINGS)
    else:
        shard_model(model, SETTINGS, build_mesh(world, -1, "cpu"))
    return Actor(model, actor_settings(world), OPTIM, masters=masters)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def state(actor: Actor) -> dict:
    """DCP's model and optimizer state dicts of the actor (what a checkpoint holds), as full tensors."""
    model_sd, optim_sd = get_state_dict(actor.state_model, [actor.optimizer])

    def walk(tree):
        if isinstance(tree, dict):
            return {k: walk(v) for k, v in tree.items()}
        if isinstance(tree, list):
            return [walk(v) for v in tree]
        return full(tree) if isinstance(tree, torch.Tensor) else tree

    return {"model": walk(model_sd), "optim": walk(optim_sd)}


def _infinite_gradient(actor: Actor):
    """The actor's micro-batch loss with its first term's gradient made infinite (the loss stays finite)."""
    real = actor._micro_loss

    def micro_loss(mb, *args):
        terms, stats = real(mb, *args)
        (first, mode), *rest = terms
        first.register_hook(lambda grad: grad * float("inf"))
        return [(first, mode), *rest], stats

    return micro_loss


def run_calls(actor: Actor, calls: range, rank: int, world: int) -> list[dict]:
    """Update calls; per call the metrics and the log-probs of the next call's rows under the new weights
    (the forward on the compute copy)."""
    out = []
    for call in calls:
        if call == INF_CALL:
            actor._micro_loss = _infinite_gradient(actor)
        metrics = actor.update_policy(batch(call, rank, world))
        actor.__dict__.pop("_micro_loss", None)
        log_probs = actor.compute_log_prob(batch(call + 1, rank, world))
        out.append({"metrics": metrics, "log_probs": log_probs, "lr": actor.scheduler.get_last_lr()[0]})
    return out


def path_taken(world: int) -> dict:
    """What the trainer's builder does with the default config (``plain_single_gpu: auto``) on this world:
    FSDP2 modules and DTensor parameters, or masters."""
    cfg = load_config([])
    settings = fsdp_settings(cfg.actor_rollout_ref.actor.fsdp_config, device_type="cpu", world_size=world)
    model = build_tiny_model(seed=0)
    masters = shard(model, settings, torch.device("cpu"))
    return {
        "plain": settings.plain,
        "masters": masters is not None,
        "fsdp_modules": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "dtensor_params": sum(isinstance(p, DTensor) for p in model.parameters()),
    }


def checks(world: int, out_dir: str) -> dict:
    """Every check on a world of ``world`` (all ranks calling). World 1: both paths trained side by side,
    checkpointed, the plain one continued. World 2 (runs second): each world-1 checkpoint resumed under
    FSDP2 and continued, the one from the plain path saved again (the test loads it back onto the plain
    path in its own process). What rank 0 keeps: full tensors."""
    torch.manual_seed(0)
    rank = dist.get_rank()
    ckpts = Path(out_dir) / "plain"
    result: dict = {"path_taken": path_taken(world)}
    if world == 1:
        for path in ("fsdp", "plain"):
            actor = new_actor(path, 1)
            calls = run_calls(actor, range(CALLS), rank, 1)
            result[path] = {"calls": calls, "state": state(actor), "skipped": actor.num_skipped_updates}
            if path == "plain":
                result[path]["dtypes"] = sorted({str(p.dtype) for p in actor.model.parameters()})
                result[path]["compute_is_master_cast"] = all(
                    torch.equal(p, m.to(p.dtype)) for p, m in zip(actor.masters.params, actor.masters.masters)
                )
            save_checkpoint(ckpts / path, actor.state_model, actor.optimizer)
            torch.save(actor.extra_state(), ckpts / f"{path}_extra.pt")
            if path == "plain":
                calls = run_calls(actor, range(CALLS, CALLS + 1), rank, 1)
                result[path]["continued"] = {"calls": calls, "state": state(actor)}
    else:
        for origin in ("fsdp", "plain"):
            actor = new_actor("fsdp", 2)
            load_checkpoint(ckpts / origin, actor.state_model, actor.optimizer)
            actor.load_extra_state(torch.load(ckpts / f"{origin}_extra.pt", weights_only=False))
            loaded = state(actor)
            calls = run_calls(actor, range(CALLS, CALLS + 1), rank, 2)
            result[f"from_{origin}"] = {"loaded": loaded, "calls": calls, "state": state(actor)}
            if origin == "plain":  # saved for the test's resume on the plain path, and one more call
                save_checkpoint(ckpts / "fsdp_w2", actor.state_model, actor.optimizer)
                if rank == 0:
                    torch.save(actor.extra_state(), ckpts / "fsdp_w2_extra.pt")
                calls = run_calls(actor, range(CALLS + 1, CALLS + 2), rank, 2)
                result["from_plain"]["second"] = {"calls": calls, "state": state(actor)}
    return result
