"""`klppo train --dry-run`'s plan, printed once every start-up check (``klppo.commands.startup``) passed."""

from __future__ import annotations

import dataclasses
import logging

import torch

from klppo.assembly.memory_check import DEFAULT_DEVICE_GIB, forecast, forecast_lines
from klppo.assembly.settings import ROLE_KEYS, describe_min_num_params, resolve_plain
from klppo.commands.startup import Startup
from klppo.config import derive_sizes, uses_critic, uses_lora
from klppo.tune.host import host_ram_bytes

__all__ = ["dry_run"]

log = logging.getLogger("klppo")


def dry_run(found: Startup) -> int:
    """`klppo train --dry-run ...` once the start-up checks passed: the plan — the model, the checkpoint
    estimate, the prompts, whether a resumed run has steps left, the process layout, the roles that will be
    built, the per-rank sizes, and (on GPU, or with a known model) the memory model's predicted peak per
    phase, the host memory the offload needs, and the refusal a GPU run would meet. Loads no weights."""
    cfg, device, nproc, model_path = found.cfg, found.device, found.nproc, found.model_path
    world = nproc * cfg.trainer.nnodes
    sizes = derive_sizes(cfg, world)
    arr, algo = cfg.actor_rollout_ref, cfg.algorithm
    lora = uses_lora(arr.model)
    roles = ["actor" + (" (LoRA)" if lora else "")]
    sharded = [("actor", arr.actor.fsdp_config)]  # the roles with a model of their own to shard
    if algo.use_kl_in_reward or arr.actor.use_kl_loss:
        roles.append("reference" + (" (= actor, adapters off)" if lora else ""))
        if not lora:  # with LoRA the reference is the actor's model, adapters off
            sharded.append(("reference", arr.ref.fsdp_config))
    if uses_critic(cfg):
        roles.append("critic")
        sharded.append(("critic", cfg.critic.model.fsdp_config))
    roles.append("reward model" if cfg.reward_model.enable else "reward (rules / custom function)")
    print(f"model: {model_path}")
    for line in found.plan:
        print(line)
    for split, loader in found.loaders.items():
        print(f"{split} prompts: {loader.summary()}")
    if found.finished is not None:
        print(f"resume: {found.finished}")
    print(f"processes: {nproc} per node × {cfg.trainer.nnodes} node(s) on {device.type}")
    print(f"roles: {', '.join(roles)}; rollout engine: {arr.rollout.name}")
    for role, fsdp_cfg in sharded:
        if resolve_plain(fsdp_cfg, world_size=world, key=f"{ROLE_KEYS[role]}.fsdp_config"):
            print(f"{role}: no FSDP2, one process (fsdp_config.plain_single_gpu={fsdp_cfg.plain_single_gpu})")
        else:
            print(f"FSDP2 {role}: {describe_min_num_params(fsdp_cfg, world_size=world)}")
    print("sizes per rank (samples unless named prompts):")
    for field in dataclasses.fields(sizes):
        print(f"  {field.name}: {getattr(sizes, field.name)}")
    on_gpu = device.type == "cuda"
    device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30 if on_gpu else DEFAULT_DEVICE_GIB
    where = "this GPU" if on_gpu else f"an {DEFAULT_DEVICE_GIB:.0f} GiB GPU"
    try:  # on a GPU a refusal ended the start-up checks (klppo.assembly.memory_check.check_memory_fit)
        found_memory = forecast(
            cfg, model_path, world_size=world, device_gib=device_gib, host_bytes=host_ram_bytes(nproc)
        )
        print("\n".join(forecast_lines(found_memory, where)))
    except Exception as exc:  # the memory model is advice
        print(f"memory prediction unavailable: {exc}")
    return 0
