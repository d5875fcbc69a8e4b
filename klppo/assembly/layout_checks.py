"""Checks of the training layout that `klppo train` (and its `--dry-run`) runs before any weight loads, from
the model's `config.json` alone (`check_layout`), each failure a `ConfigError` of one line:

- `check_ulysses_heads`: every Ulysses group that will be built (actor, reference, critic) splits the model's
  attention heads as `parallel/ulysses.py` needs (`check_heads`: the query heads divisible by the size, the
  KV heads a multiple or a divisor of it). On a Megatron launch the message names
  `megatron.context_parallel_size`, which the translation (`config/megatron.py`) turns into the size.
- `check_translated_memory`: a Megatron launch runs on FSDP2 in a layout its author did not size, so the
  actor's memory per GPU is predicted by `klppo tune`'s model (`settings.tune_workload`, the object the
  trainer shards with; `tune/lora.py` with LoRA) for the launch's own GPU count, on this machine's GPU or,
  with none visible, one of `trainer.gpu_memory_gib`. A launch predicted above the whole GPU in any phase is
  refused with the figure and the settings predicted to fit (more offload, a larger Ulysses group with the
  same micro-batches, LoRA). Launches written for FSDP keep the pre-flight's warning (`tune/preflight.py`):
  the model is within ~15%, so only a layout predicted past the device itself is refused, and the reference
  and critic models are not counted (it errs low).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from transformers import AutoConfig

from klppo.assembly.settings import fsdp_settings, tune_workload
from klppo.config import ConfigError, KLPPOConfig, uses_critic, uses_lora
from klppo.models.loading import model_dir
from klppo.parallel.ulysses import check_heads
from klppo.tune.lora import lora_peaks_gib
from klppo.tune.memory import predict
from klppo.tune.units import ModelFacts

A = "actor_rollout_ref.actor"
LORA_RANK = 64
"""The adapter rank the memory refusal suggests (its memory hardly depends on it)."""


def launch_world_size(cfg: KLPPOConfig) -> int:
    """The launch's own GPU count: `trainer.n_gpus_per_node` (auto: the GPUs visible, at least 1) × nnodes."""
    n = cfg.trainer.n_gpus_per_node
    per_node = (torch.cuda.device_count() or 1) if n in (None, "auto") else int(n)
    return per_node * cfg.trainer.nnodes


def device_memory_gib(cfg: KLPPOConfig) -> tuple[float, str]:
    """(GiB per GPU, where the figure comes from): the visible GPU's, else `trainer.gpu_memory_gib`."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory / 2**30, "this machine's GPU"
    return cfg.trainer.gpu_memory_gib, "trainer.gpu_memory_gib, no GPU visible"


def _heads(model_config: Any) -> tuple[int, int]:
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    heads = text.num_attention_heads
    return heads, getattr(text, "num_key_value_heads", None) or heads


def _heads_split(model_config: Any, size: int) -> bool:
    try:
        check_heads(*_heads(model_config), size)
    except ValueError:
        return False
    return True


def check_layout(cfg: KLPPOConfig, model_path: str) -> None:
    """:func:`check_ulysses_heads`, then :func:`check_translated_memory`, with the actor's (and critic's)
    model config read from its path."""
    actor_config = AutoConfig.from_pretrained(model_path)
    critic_config = None
    if uses_critic(cfg):
        critic_path = model_dir(cfg.critic.model.path, key="critic.model.path")
        critic_config = actor_config if critic_path == model_path else AutoConfig.from_pretrained(critic_path)
    check_ulysses_heads(cfg, actor_config, critic_config)
    check_translated_memory(cfg, actor_config)


def check_ulysses_heads(cfg: KLPPOConfig, actor_config: Any, critic_config: Any | None) -> None:
    """ConfigError naming the key (and, on a Megatron launch, `megatron.context_parallel_size`) when a role's
    Ulysses size does not split the model's attention heads, with the sizes that do for this GPU count."""
    arr = cfg.actor_rollout_ref
    roles = [(A, arr.actor.ulysses_sequence_parallel_size, actor_config, arr.actor.strategy)]
    if (arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward) and not uses_lora(arr.model):
        roles.append(
            (
                "actor_rollout_ref.ref",
                arr.ref.ulysses_sequence_parallel_size,
                actor_config,
                arr.actor.strategy,
            )
        )
    if critic_config is not None and uses_critic(cfg):
        roles.append(
            ("critic", cfg.critic.ulysses_sequence_parallel_size, critic_config, cfg.critic.strategy)
        )
    world = launch_world_size(cfg)
    for role, size, model_config, strategy in roles:
        if size <= 1 or _heads_split(model_config, size):
            continue
        heads, kv_heads = _heads(model_config)
        origin = (
            f" (from Megatron's {role}.megatron.context_parallel_size={size}, context parallelism run as "
            "Ulysses)"
            if strategy == "megatron"
            else ""
        )
        valid = [s for s in range(1, world + 1) if world % s == 0 and _heads_split(model_config, s)]
        raise ConfigError(
            f"{role}.ulysses_sequence_parallel_size={size}{origin} does not split the model's attention "
            f"heads: Ulysses gives each rank of its group num_attention_heads / {size} query heads ({heads} "
            f"here) and needs num_key_value_heads ({kv_heads}) a multiple or a divisor of {size}; sizes that "
            "fit "
            f"this model on {world} GPUs: {', '.join(map(str, valid))}"
        )


def check_translated_memory(cfg: KLPPOConfig, actor_config: Any) -> None:
    """On a Megatron launch, ConfigError when the actor's predicted peak per GPU exceeds the GPU, naming the
    phase, the figure, the GPU size and its source, and the settings predicted to fit (or that none does)."""
    if cfg.actor_rollout_ref.actor.strategy != "megatron":
        return
    world = launch_world_size(cfg)
    gib, source = device_memory_gib(cfg)
    try:
        facts = ModelFacts.from_config(actor_config)
        peaks = _peaks_gib(cfg, facts, world, gib)
    except Exception:  # an architecture the memory model does not know: nothing to refuse on
        return
    worst = max(peaks, key=peaks.get)
    if peaks[worst] <= gib:
        return
    singles, together = _alternatives(cfg, actor_config, world)
    fits = []
    for overrides in singles + [together]:
        if overrides is together and (fits or not together or together in singles):
            break  # all together only when no single setting fits
        peak = max(_peaks_gib(_with(cfg, overrides), facts, world, gib).values())
        if peak <= gib:
            fits.append(" ".join(f"{k}={v}" for k, v in overrides.items()) + f" ({peak:.1f} GiB)")
    summary = ", ".join(f"{name} {p:.1f}" for name, p in peaks.items())
    advice = (
        f"settings predicted to fit: {'; or '.join(fits)}"
        if fits
        else "no offload, Ulysses or LoRA setting is predicted to fit: more GPUs (trainer.n_gpus_per_node, "
        "trainer.nnodes) or a smaller model"
    )
    raise ConfigError(
        f"this Megatron launch, run on FSDP2 over {world} GPU(s), is predicted to need {peaks[worst]:.1f} "
        f"GiB per GPU in the {worst} phase (GiB: {summary}) but a GPU holds {gib:.0f} ({source}); {advice}. "
        "`klppo tune <same arguments> --dry-run` shows each term"
    )


def _peaks_gib(cfg: KLPPOConfig, facts: ModelFacts, world: int, gib: float) -> dict[str, float]:
    """The actor's predicted peak GiB per phase for ``cfg`` (its FSDP settings as the trainer builds them)."""
    fsdp = fsdp_settings(cfg.actor_rollout_ref.actor.fsdp_config, device_type="cuda", world_size=world)
    workload = tune_workload(cfg, fsdp, world_size=world, device_gib=gib)
    if uses_lora(cfg.actor_rollout_ref.model):
        return lora_peaks_gib(workload, facts)
    phases = predict(facts, workload.update_point, workload.workload)
    return {name: phase.total / 2**30 for name, phase in phases.items()}


def _alternatives(
    cfg: KLPPOConfig, actor_config: Any, world: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(overrides that each change one thing towards less memory, the strongest of them together): offload
    between phases (the reference's too), then FSDP2's offload policy; each larger Ulysses size that splits
    the heads, the token budgets divided so that a group forms the same micro-batches; LoRA."""
    arr = cfg.actor_rollout_ref
    fsdp, sp = arr.actor.fsdp_config, arr.actor.ulysses_sequence_parallel_size
    offload: list[dict[str, Any]] = []
    idle = {f"{A}.fsdp_config.param_offload": True, f"{A}.fsdp_config.optimizer_offload": True}
    if arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        idle["actor_rollout_ref.ref.fsdp_config.param_offload"] = True
    if not fsdp.offload_policy and not (fsdp.param_offload and fsdp.optimizer_offload):
        offload.append(idle)
    if not fsdp.offload_policy:
        offload.append({**idle, f"{A}.fsdp_config.offload_policy": True})
    ulysses: list[dict[str, Any]] = []
    for size in range(sp + 1, world + 1):
        if world % size == 0 and _heads_split(actor_config, size):
            one: dict[str, Any] = {f"{A}.ulysses_sequence_parallel_size": size}
            if arr.actor.use_dynamic_bsz:
                one[f"{A}.ppo_max_token_len_per_gpu"] = -(-arr.actor.ppo_max_token_len_per_gpu * sp // size)
                budget = arr.rollout.log_prob_max_token_len_per_gpu
                one["actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"] = -(-budget * sp // size)
            ulysses.append(one)
    lora = [] if uses_lora(arr.model) else [{"actor_rollout_ref.model.lora_rank": LORA_RANK}]
    together = {k: v for o in offload[-1:] + ulysses[-1:] + lora for k, v in o.items()}
    return offload + ulysses + lora, together


def _with(cfg: Any, overrides: dict[str, Any]) -> Any:
    """``cfg`` (frozen dataclasses) with each dotted key of ``overrides`` replaced."""
    for key, value in overrides.items():
        cfg = _replace(cfg, key.split("."), value)
    return cfg


def _replace(node: Any, parts: list[str], value: Any) -> Any:
    if len(parts) == 1:
        return dataclasses.replace(node, **{parts[0]: value})
    return dataclasses.replace(node, **{parts[0]: _replace(getattr(node, parts[0]), parts[1:], value)})
