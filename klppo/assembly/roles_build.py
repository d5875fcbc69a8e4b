"""Builds the roles of a run: loads each model, wraps it with FSDP2 and hands it the settings that
``settings.py`` translated from verl's per-role keys. A role is created only when the configured algorithm
needs it (the reference for a KL term, the critic for GAE)."""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from klppo.algorithms.losses import get_policy_loss
from klppo.assembly.settings import (
    ROLE_KEYS,
    actor_settings,
    check_cuda_graph_update,
    critic_settings,
    describe_min_num_params,
    fsdp_settings,
    grad_sync_per_mini_batch,
    optim_settings,
    reference_settings,
    to_dtype,
)
from klppo.batching.attention import enable_packed_attention
from klppo.config import KLPPOConfig, uses_critic, uses_lora
from klppo.config.schema import CustomRewardFunctionConfig, RewardModelConfig
from klppo.config.schema_arr import ModelConfig
from klppo.config.schema_common import FSDPConfig
from klppo.config.sizes import Sizes
from klppo.models.compiled_layers import compile_packed_layers
from klppo.models.lm_head import compile_token_stats, fp32_lm_head
from klppo.models.loading import load_causal_lm, load_critic, load_reward_model, load_tokenizer, model_dir
from klppo.models.lora import apply_lora, is_lora
from klppo.parallel.collectives import world_size
from klppo.parallel.fsdp import FSDPSettings, build_mesh, shard_model
from klppo.parallel.mesh import SequenceParallel
from klppo.parallel.offload import OffloadSchedule
from klppo.parallel.plain import MasterWeights, cast_params, plain_model
from klppo.parallel.ulysses import enable_ulysses_attention
from klppo.roles.actor import Actor
from klppo.roles.critic import Critic
from klppo.roles.reference import Reference
from klppo.roles.reward import Reward, RewardModelPasses
from klppo.roles.trained import TrainedRole

HFAssets = dict[str, Callable[[Path], None]]


@dataclass(frozen=True)
class Roles:
    """The run's models: the actor always; the reference when a KL term needs it; the critic for GAE."""

    actor: Actor
    reference: Reference | None
    critic: Critic | None
    reward: Reward

    def trained(self) -> dict[str, TrainedRole]:
        """The roles with weights and an optimizer to checkpoint, by name."""
        roles: dict[str, TrainedRole] = {"actor": self.actor}
        if self.critic is not None:
            roles["critic"] = self.critic
        return roles


@dataclass(frozen=True)
class SequenceGroups:
    """Each role's Ulysses group (``*.ulysses_sequence_parallel_size``; None: no sequence parallelism)."""

    actor: SequenceParallel | None = None
    reference: SequenceParallel | None = None
    critic: SequenceParallel | None = None


@dataclass(frozen=True)
class RoleInputs:
    """What every role's builder needs besides its configuration group."""

    cfg: KLPPOConfig
    sizes: Sizes
    model_path: str
    tokenizer: Any  # a transformers tokenizer
    device: torch.device
    total_steps: int
    offload: OffloadSchedule
    hf_assets: HFAssets
    sp: SequenceGroups = SequenceGroups()


def build_roles(inputs: RoleInputs, actor_fsdp: FSDPSettings) -> Roles:
    """Actor (sharded with ``actor_fsdp``, the settings the memory pre-flight saw), reference, critic,
    reward."""
    actor = build_actor(inputs, actor_fsdp)
    return Roles(
        actor=actor,
        reference=build_reference(inputs, actor),
        critic=build_critic(inputs),
        reward=build_reward(
            inputs.cfg.reward_model,
            inputs.cfg.custom_reward_function,
            inputs.tokenizer,
            inputs.device,
            micro_batch_size=inputs.sizes.reward_micro_batch_size_per_gpu,
        ),
    )


def build_actor(inputs: RoleInputs, fsdp: FSDPSettings) -> Actor:
    """The policy: ``fsdp_config.model_dtype`` master weights (fp32 by default), FSDP2, AdamW."""
    cfg, tokenizer = inputs.cfg, inputs.tokenizer
    arr = cfg.actor_rollout_ref
    acfg = arr.actor
    dtype = to_dtype(acfg.fsdp_config.model_dtype)
    sp = inputs.sp.actor
    model = load_policy_model(arr.model, inputs.model_path, dtype, inputs.device, train=True, sp=sp)
    _compile_stats(model, acfg.use_torch_compile, "actor_rollout_ref.actor.use_torch_compile")
    if uses_lora(arr.model):
        model = apply_lora(
            model,
            rank=arr.model.lora_rank,
            alpha=arr.model.lora_alpha,
            target_modules=arr.model.target_modules,
            exclude_modules=arr.model.exclude_modules,
            adapter_path=arr.model.lora_adapter_path,
        )
    inputs.hf_assets["actor"] = hf_writer(model, tokenizer, start_dtype=stored_dtype(inputs.model_path))
    masters = shard(model, fsdp, inputs.device)
    get_policy_loss(acfg.policy_loss.loss_mode)  # ValueError naming the built modes
    settings = actor_settings(cfg, inputs.sizes, sp=sp)
    settings = dataclasses.replace(
        settings, grad_sync_per_mini_batch=_grad_sync("actor", acfg.fsdp_config, fsdp, model, inputs.device)
    )
    actor = Actor(model, settings, optim_settings(acfg.optim, inputs.total_steps), masters=masters)
    _offload_trained(inputs, actor, "actor", fsdp)
    return actor


def _compile_stats(model: torch.nn.Module, on: bool, key: str) -> None:
    """The model's LM-head statistics compiled as ``key`` says; said when the key is on and the head cannot
    take it (not a bias-free linear layer: its log-probs stay eager)."""
    if not compile_token_stats(model, on) and on:
        logging.getLogger("klppo").warning(
            "%s=true is not applied: the model's LM head is not a bias-free linear layer "
            "(its log-prob statistics run eagerly)",
            key,
        )


def role_fsdp(role: str, fsdp_cfg: FSDPConfig, device: torch.device) -> FSDPSettings:
    """A role's FSDP2 settings for this run, with the resolved ``min_num_params`` logged (auto: why)."""
    key = f"{ROLE_KEYS[role]}.fsdp_config"
    settings = fsdp_settings(fsdp_cfg, device_type=device.type, world_size=world_size(), key=key)
    check_cuda_graph_update(fsdp_cfg, settings, device_type=device.type, key=key)  # the reference's: its pass
    if settings.plain:
        logging.getLogger("klppo").info("%s: no FSDP2, one process (fsdp_config.plain_single_gpu)", role)
    else:
        layout = describe_min_num_params(fsdp_cfg, world_size=world_size())
        logging.getLogger("klppo").info("%s: FSDP2 %s", role, layout)
    return settings


def _grad_sync(
    role: str, fsdp_cfg: FSDPConfig, fsdp: FSDPSettings, model: torch.nn.Module, device: torch.device
) -> bool:
    """``fsdp_config.grad_sync_per_mini_batch`` of a trained role, resolved for this run and logged."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    on, why = grad_sync_per_mini_batch(
        fsdp_cfg, fsdp, num_trainable=trainable, ranks=world_size(), device_bytes=device_bytes
    )
    if fsdp.plain:  # nothing to reduce: said as such, not as a reduce-scatter per micro-batch
        logging.getLogger("klppo").info("%s: %s", role, why)
    else:
        logging.getLogger("klppo").info(
            "%s: gradient reduce-scatter once per %s (%s)", role, "mini-batch" if on else "micro-batch", why
        )
    return on


def _offload_trained(inputs: RoleInputs, role: TrainedRole, name: str, fsdp: FSDPSettings) -> None:
    """Add a trained role to the offload schedule: its resident model and optimizer, as ``fsdp`` says."""
    inputs.offload.add(
        role,
        name=name,
        model=role.resident,
        optimizer=role.optimizer,
        params=fsdp.param_offload,
        optimizer_state=fsdp.optimizer_offload,
    )


def build_reference(inputs: RoleInputs, actor: Actor) -> Reference | None:
    """The frozen initial policy; None when neither KL in the reward nor a KL loss needs it. With LoRA,
    the actor's own model with its adapters off (no second model)."""
    cfg, device = inputs.cfg, inputs.device
    arr = cfg.actor_rollout_ref
    if not (cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss):
        return None
    s = reference_settings(cfg, inputs.sizes, sp=inputs.sp.reference)
    settings = dict(
        micro=s.micro,
        temperature=s.temperature,
        use_remove_padding=s.use_remove_padding,
        use_fused_kernels=s.use_fused_kernels,
        sp=s.sp,
        cuda_graph=s.cuda_graph,
    )
    if is_lora(actor.model):
        if arr.ref.use_torch_compile != arr.actor.use_torch_compile:
            logging.getLogger("klppo").warning(
                "actor_rollout_ref.ref.use_torch_compile is not read with LoRA: the reference is the actor's "
                "model, compiled as actor_rollout_ref.actor.use_torch_compile says"
            )
        reference = Reference(actor.model, adapters_off=True, **settings)
        inputs.offload.add(
            reference, name="reference", model=actor.model, params=False, optimizer_state=False
        )
        return reference
    # on CPU every role keeps fp32 weights: bf16 matmuls there are slow and would put a rounding KL
    # between the actor and its reference from the first step
    dtype = to_dtype(arr.ref.fsdp_config.model_dtype) if device.type == "cuda" else torch.float32
    ref_path = (arr.ref.model or {}).get("path")  # verl: a different reference model, else the actor's start
    model_path = (
        model_dir(ref_path, key="actor_rollout_ref.ref.model.path") if ref_path else inputs.model_path
    )
    model = load_policy_model(arr.model, model_path, dtype, device, train=False, sp=s.sp)
    _compile_stats(model, arr.ref.use_torch_compile, "actor_rollout_ref.ref.use_torch_compile")
    fsdp = role_fsdp("reference", arr.ref.fsdp_config, device)
    if fsdp.plain:  # no gradients: the compute copy alone, no masters
        cast_params(model, fsdp.param_dtype)
    else:
        shard(model, fsdp, device)
    reference = Reference(model, **settings)
    inputs.offload.add(
        reference, name="reference", model=model, params=fsdp.param_offload, optimizer_state=False
    )
    return reference


def build_critic(inputs: RoleInputs) -> Critic | None:
    """A value head on a causal-LM backbone (``critic.model.path``, default the actor's); None unless the
    advantage estimator needs values."""
    cfg, device = inputs.cfg, inputs.device
    if not uses_critic(cfg):
        return None
    ccfg = cfg.critic
    path = model_dir(ccfg.model.path or inputs.model_path, key="critic.model.path")
    model = load_critic(
        path,
        dtype=to_dtype(ccfg.model.fsdp_config.model_dtype),
        gradient_checkpointing=ccfg.model.enable_gradient_checkpointing,
        trust_remote_code=ccfg.model.trust_remote_code,
        override_config=dict(ccfg.model.override_config or {}),
    )
    enable_packed_attention(model)
    sp = inputs.sp.critic
    if sp is not None:
        enable_ulysses_attention(model, sp.size)
    if ccfg.model.compile_packed_layers:
        compile_packed_layers(model)
    model = model.to(device)
    if ccfg.model.lora_rank > 0:
        # the backbone gets adapters; the value head ("score") trains in full
        model = apply_lora(
            model,
            rank=ccfg.model.lora_rank,
            alpha=ccfg.model.lora_alpha,
            target_modules=ccfg.model.target_modules,
            task_type="TOKEN_CLS",
            modules_to_save=["score"],
        )
    inputs.hf_assets["critic"] = hf_writer(model, inputs.tokenizer, start_dtype=stored_dtype(path))
    fsdp = role_fsdp("critic", ccfg.model.fsdp_config, device)
    masters = shard(model, fsdp, device)
    settings = critic_settings(cfg, inputs.sizes, sp=sp)
    settings = dataclasses.replace(
        settings,
        grad_sync_per_mini_batch=_grad_sync("critic", ccfg.model.fsdp_config, fsdp, model, device),
    )
    critic = Critic(model, settings, optim_settings(ccfg.optim, inputs.total_steps), masters=masters)
    _offload_trained(inputs, critic, "critic", fsdp)
    return critic


def build_reward(
    rm: RewardModelConfig,
    crf: CustomRewardFunctionConfig,
    tokenizer: Any,
    device: torch.device,
    *,
    micro_batch_size: int | None = None,
) -> Reward:
    """Rule scorers / the user's function by ``data_source``, or a sequence-classification reward model
    (``micro_batch_size``: samples per forward, ``Sizes.reward_micro_batch_size_per_gpu``)."""
    reward_model = reward_tokenizer = None
    if rm.enable:
        path, trust = model_dir(rm.model.path, key="reward_model.model.path"), rm.model.trust_remote_code
        # the responses are decoded with the policy's tokenizer (reward_model.model.input_tokenizer's role
        # in verl) and re-encoded in the reward model's own chat template and vocabulary; the model reads
        # its score at the last token that is not that tokenizer's pad
        reward_tokenizer = _reward_tokenizer(rm, path, trust)
        dtype = to_dtype(rm.model.fsdp_config.model_dtype) if device.type == "cuda" else torch.float32
        reward_model = load_reward_model(
            path,
            dtype=dtype,
            trust_remote_code=trust,
            override_config=dict(rm.model.override_config or {}),
            pad_token_id=reward_tokenizer.pad_token_id,
        )
        reward_model = reward_model.to(device).eval()
    return Reward(
        tokenizer,
        custom_fn_path=crf.path,
        custom_fn_name=crf.name or "compute_score",
        reward_kwargs=dict(rm.reward_kwargs or {}),
        reward_manager=rm.reward_manager,
        model=RewardModelPasses(
            model=reward_model,
            tokenizer=reward_tokenizer,
            max_length=rm.max_length,
            micro_batch_size=micro_batch_size,
            max_token_len=rm.forward_max_token_len_per_gpu if rm.use_dynamic_bsz else None,
        ),
        background=rm.launch_reward_fn_async,
        num_workers=rm.num_workers,
        timeout_s=rm.timeout_s,
    )


def _reward_tokenizer(rm: RewardModelConfig, path: str, trust: bool) -> Any:
    """The reward model's own tokenizer; where its directory has none (nothing loads, or an empty
    vocabulary), ``input_tokenizer``'s (the policy's by default), with a note."""
    try:
        tokenizer = load_tokenizer(path, trust_remote_code=trust)
        if len(tokenizer) > 1:
            return tokenizer
        why = "its tokenizer has an empty vocabulary"
    except (OSError, ValueError) as exc:
        why = f"no tokenizer loads from it ({type(exc).__name__})"
    fallback = (
        model_dir(rm.model.input_tokenizer, key="reward_model.model.input_tokenizer")
        if rm.model.input_tokenizer
        else None
    )
    if fallback is None:
        raise ValueError(
            f"reward_model.model.path={path}: {why}, and reward_model.model.input_tokenizer is null; put the "
            "reward model's tokenizer in its directory"
        )
    logging.getLogger("klppo").info(
        "reward_model.model.path=%s: %s; its input is encoded with reward_model.model.input_tokenizer's (%s)",
        path,
        why,
        fallback,
    )
    return load_tokenizer(fallback, trust_remote_code=trust)


def load_policy_model(
    m: ModelConfig,
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    train: bool,
    sp: SequenceParallel | None = None,
) -> torch.nn.Module:
    """A causal LM for the actor or the reference, with klppo's attention (see below), on ``device``;
    with ``sp`` its Ulysses variant (all-to-alls around the same attention)."""
    if m.external_lib:  # verl: a module that registers custom model classes with transformers
        importlib.import_module(m.external_lib)
    model = load_causal_lm(
        path,
        dtype=dtype,
        device="cpu",
        trust_remote_code=m.trust_remote_code,
        gradient_checkpointing=m.enable_gradient_checkpointing and train,
        override_config=dict(m.override_config or {}),
    )
    # klppo_packed: block-diagonal attention for packed rows, and for padded rows SDPA with rows that see
    # no key (left padding) attending to themselves, which keeps bf16 gradients finite on GPU
    enable_packed_attention(model)
    if sp is not None:
        enable_ulysses_attention(model, sp.size)
    # float32 logits from the bf16 head (no rounding of the logits to bf16; the rollout engine computes its
    # log-probs the same way, see klppo.models.lm_head); float32 models are unaffected
    fp32_lm_head(model)
    if m.compile_packed_layers:  # packed forwards only; config checks: use_remove_padding, no Ulysses
        compile_packed_layers(model)
    return model.to(device)


def shard(model: torch.nn.Module, settings: FSDPSettings, device: torch.device) -> MasterWeights | None:
    """FSDP2 over all ranks (or HSDP groups of ``fsdp_size``; logs the units chosen), or with
    ``settings.plain`` (one process) no FSDP2: the model in the compute dtype, its masters returned."""
    if settings.plain:
        return plain_model(model, settings)
    # with LoRA the FSDP root is the Hugging Face model inside the PeftModel: generate() and the adapter
    # wrappers call it directly, and FSDP2 needs every forward to enter through its root
    root = model.get_base_model() if is_lora(model) else model
    shard_model(root, settings, build_mesh(world_size(), settings.fsdp_size, device.type))
    return None


def stored_dtype(path: str) -> str | None:
    """The dtype the model at ``path`` is stored in (its config's ``dtype``, older ``torch_dtype``), or
    None."""
    config, _ = PretrainedConfig.get_config_dict(path)
    dtype = config.get("dtype") or config.get("torch_dtype")
    return str(dtype).removeprefix("torch.") if dtype else None


def hf_writer(
    model: torch.nn.Module, tokenizer: Any, *, start_dtype: str | None = None
) -> Callable[[Path], None]:
    """Writes the model's config, generation config and the tokenizer (captured before sharding). The config's
    ``dtype`` is ``start_dtype`` when given: the dtype of the model the run started from, which `klppo export`
    writes (the checkpoint's weights are the ``fsdp_config.model_dtype`` masters, fp32 by default)."""
    config = copy.deepcopy(model.config)
    if start_dtype is not None:
        config.dtype = start_dtype
    generation_config = getattr(model, "generation_config", None)
    peft_config = getattr(model, "peft_config", None)

    def write(path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(path)
        if peft_config:  # LoRA: the adapter layout, so `klppo export` can rebuild and merge
            peft_config["default"].save_pretrained(path)
        if generation_config is not None:
            generation_config.save_pretrained(path)
        tokenizer.save_pretrained(path)

    return write
