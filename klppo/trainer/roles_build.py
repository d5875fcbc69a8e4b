"""Builds the roles of a run from the resolved configuration: loads each model, wraps it with FSDP2 and
maps verl's per-role keys onto the roles' settings. A role is created only when the configured algorithm
needs it (the reference for a KL term, the critic for GAE)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from klppo.parallel.mesh import SequenceParallel
from klppo.parallel.offload import OffloadSchedule
from klppo.parallel.ulysses import enable_ulysses_attention
from klppo.trainer.builder import fsdp_settings, micro, optim_settings, to_dtype

HFAssets = dict[str, Callable[[Path], None]]


def sp_size(sp: SequenceParallel | None) -> int:
    """Ranks of the Ulysses group (1 without one): a group's token budget is ``max_token_len × size``."""
    return 1 if sp is None else sp.size


def rollout_temperature(cfg: Any) -> float:
    """The temperature log-probs are computed at (the rollout's; 1 for greedy)."""
    t = float(cfg.actor_rollout_ref.rollout.temperature)
    return t if t > 0 else 1.0


def build_actor(
    cfg: Any,
    sizes: Any,
    model_path: str,
    tokenizer: Any,
    *,
    device: torch.device,
    total_steps: int,
    offload: OffloadSchedule,
    hf_assets: HFAssets,
    sp: SequenceParallel | None = None,
):
    """The policy: ``fsdp_config.model_dtype`` master weights (fp32 by default), FSDP2, AdamW."""
    from klppo.algorithms.losses import POLICY_LOSS_KEYS, get_policy_loss
    from klppo.roles.actor import Actor, ActorSettings

    arr = cfg.actor_rollout_ref
    acfg, rcfg = arr.actor, arr.rollout
    model = load_policy_model(
        cfg, model_path, to_dtype(acfg.fsdp_config.model_dtype), device, train=True, sp=sp
    )
    hf_assets["actor"] = hf_writer(model, tokenizer)
    if arr.model.lora_rank > 0 or arr.model.lora_adapter_path:
        from klppo.models.lora import apply_lora

        model = apply_lora(
            model,
            rank=arr.model.lora_rank,
            alpha=arr.model.lora_alpha,
            target_modules=arr.model.target_modules,
            exclude_modules=arr.model.exclude_modules,
            adapter_path=arr.model.lora_adapter_path,
        )
        hf_assets["actor"] = hf_writer(model, tokenizer)
    shard(model, acfg.fsdp_config, device)
    loss_mode = acfg.policy_loss.loss_mode
    get_policy_loss(loss_mode)  # ValueError naming the built modes
    actor = Actor(
        model,
        ActorSettings(
            ppo_epochs=int(acfg.ppo_epochs),
            mini_batch_size=sizes.actor_mini_batch_samples_per_rank,
            update_micro=micro(
                sizes.actor_micro_batch_size_per_gpu,
                dynamic=acfg.use_dynamic_bsz,
                max_tokens=acfg.ppo_max_token_len_per_gpu * sp_size(sp),
            ),
            log_prob_micro=micro(
                sizes.log_prob_micro_batch_size_per_gpu,
                dynamic=rcfg.log_prob_use_dynamic_bsz,
                max_tokens=rcfg.log_prob_max_token_len_per_gpu * sp_size(sp),
            ),
            grad_clip=float(acfg.grad_clip),
            clip_ratio=float(acfg.clip_ratio),
            clip_ratio_low=acfg.clip_ratio_low,
            clip_ratio_high=acfg.clip_ratio_high,
            clip_ratio_c=float(acfg.clip_ratio_c),
            loss_agg_mode=acfg.loss_agg_mode,
            loss_scale_factor=None if acfg.loss_scale_factor is None else float(acfg.loss_scale_factor),
            loss_mode=loss_mode,
            policy_loss_kwargs={k: float(getattr(acfg.policy_loss, k)) for k in POLICY_LOSS_KEYS[loss_mode]},
            entropy_coeff=float(acfg.entropy_coeff),
            use_kl_loss=bool(acfg.use_kl_loss),
            kl_loss_coef=float(acfg.kl_loss_coef),
            kl_loss_type=acfg.kl_loss_type,
            temperature=rollout_temperature(cfg),
            shuffle=bool(acfg.shuffle),
            use_remove_padding=bool(arr.model.use_remove_padding),
            seed=int(cfg.trainer.seed),
            skip_old_log_prob_on_policy=skips_old_log_prob_pass(cfg),
            use_fused_kernels=bool(acfg.use_fused_kernels),
            sp=sp,
        ),
        optim_settings(acfg.optim, total_steps),
    )
    offload.add(
        actor,
        name="actor",
        model=actor.model,
        optimizer=actor.optimizer,
        params=acfg.fsdp_config.param_offload,
        optimizer_state=acfg.fsdp_config.optimizer_offload,
    )
    return actor


def skips_old_log_prob_pass(cfg: Any) -> bool:
    """``actor.skip_old_log_prob_on_policy`` where nothing needs π_old before the update: not the KL in the
    reward (before the advantages). A KL-loss controller reads this step's KL after the update, from the
    update's forward. Whether the update is on-policy is the actor's test."""
    acfg = cfg.actor_rollout_ref.actor
    return bool(acfg.skip_old_log_prob_on_policy) and not cfg.algorithm.use_kl_in_reward


def build_reference(
    cfg: Any,
    sizes: Any,
    model_path: str,
    *,
    device: torch.device,
    offload: OffloadSchedule,
    actor: Any = None,
    sp: SequenceParallel | None = None,
):
    """The frozen initial policy; None when neither KL in the reward nor a KL loss needs it. With LoRA,
    the actor's own model with its adapters off (no second model)."""
    from klppo.roles.reference import Reference

    arr = cfg.actor_rollout_ref
    if not (cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss):
        return None
    from klppo.models.lora import is_lora

    micro_ref = micro(
        sizes.ref_log_prob_micro_batch_size_per_gpu,
        dynamic=arr.ref.log_prob_use_dynamic_bsz,
        max_tokens=arr.ref.log_prob_max_token_len_per_gpu * sp_size(sp),
    )
    settings = dict(
        micro=micro_ref,
        temperature=rollout_temperature(cfg),
        use_remove_padding=bool(arr.model.use_remove_padding),
        use_fused_kernels=bool(arr.model.use_fused_kernels),
        sp=sp,
    )
    if actor is not None and is_lora(actor.model):
        reference = Reference(actor.model, adapters_off=True, **settings)
        offload.add(reference, name="reference", model=actor.model, params=False, optimizer_state=False)
        return reference
    # on CPU every role keeps fp32 weights: bf16 matmuls there are slow and would put a rounding KL
    # between the actor and its reference from the first step
    dtype = torch.float32
    if device.type == "cuda":
        dtype = to_dtype(arr.ref.fsdp_config.model_dtype, torch.bfloat16)
    ref_path = (arr.ref.model or {}).get("path")  # verl: a different reference model, else the actor's start
    if ref_path:
        from klppo.models.loading import model_dir

        model_path = model_dir(ref_path)
    model = load_policy_model(cfg, model_path, dtype, device, train=False, sp=sp)
    shard(model, arr.ref.fsdp_config, device)
    reference = Reference(model, **settings)
    offload.add(
        reference,
        name="reference",
        model=model,
        params=arr.ref.fsdp_config.param_offload,
        optimizer_state=False,
    )
    return reference


def build_critic(
    cfg: Any,
    sizes: Any,
    model_path: str,
    tokenizer: Any,
    *,
    device: torch.device,
    total_steps: int,
    offload: OffloadSchedule,
    hf_assets: HFAssets,
    sp: SequenceParallel | None = None,
):
    """A value head on a causal-LM backbone (``critic.model.path``, default the actor's); None unless the
    advantage estimator needs values."""
    from klppo.algorithms.advantages import needs_critic
    from klppo.batching.attention import enable_packed_attention
    from klppo.models.loading import load_critic, model_dir
    from klppo.roles.critic import Critic, CriticSettings

    if not needs_critic(cfg.algorithm.adv_estimator):
        return None
    ccfg = cfg.critic
    model = load_critic(
        model_dir(ccfg.model.path or model_path),
        dtype=to_dtype(ccfg.model.fsdp_config.model_dtype),
        gradient_checkpointing=bool(ccfg.model.enable_gradient_checkpointing),
    )
    enable_packed_attention(model)
    if sp is not None:
        enable_ulysses_attention(model, sp.size)
    model = model.to(device)
    if ccfg.model.lora_rank > 0:
        from klppo.models.lora import apply_lora

        # the backbone gets adapters; the value head ("score") trains in full
        model = apply_lora(
            model,
            rank=ccfg.model.lora_rank,
            alpha=ccfg.model.lora_alpha,
            target_modules=ccfg.model.target_modules,
            task_type="TOKEN_CLS",
            modules_to_save=["score"],
        )
    hf_assets["critic"] = hf_writer(model, tokenizer)
    shard(model, ccfg.model.fsdp_config, device)
    critic = Critic(
        model,
        CriticSettings(
            ppo_epochs=int(ccfg.ppo_epochs),
            mini_batch_size=sizes.critic_mini_batch_samples_per_rank,
            update_micro=micro(
                sizes.critic_micro_batch_size_per_gpu,
                dynamic=ccfg.use_dynamic_bsz,
                max_tokens=ccfg.ppo_max_token_len_per_gpu * sp_size(sp),
            ),
            forward_micro=micro(
                sizes.critic_forward_micro_batch_size_per_gpu,
                dynamic=ccfg.use_dynamic_bsz,
                max_tokens=ccfg.forward_max_token_len_per_gpu * sp_size(sp),
            ),
            grad_clip=float(ccfg.grad_clip),
            cliprange_value=float(ccfg.cliprange_value),
            loss_agg_mode=ccfg.loss_agg_mode,
            shuffle=bool(ccfg.shuffle),
            use_remove_padding=bool(ccfg.model.use_remove_padding),
            seed=int(cfg.trainer.seed),
            sp=sp,
        ),
        optim_settings(ccfg.optim, total_steps),
    )
    offload.add(
        critic,
        name="critic",
        model=critic.model,
        optimizer=critic.optimizer,
        params=ccfg.model.fsdp_config.param_offload,
        optimizer_state=ccfg.model.fsdp_config.optimizer_offload,
    )
    return critic


def build_reward(cfg: Any, tokenizer: Any, device: torch.device):
    """Rule scorers / the user's function by ``data_source``, or a sequence-classification reward model."""
    from klppo.roles.reward import Reward

    rm, crf = cfg.reward_model, cfg.custom_reward_function
    reward_model = reward_tokenizer = None
    if rm.enable:
        from klppo.models.loading import load_reward_model, load_tokenizer, model_dir

        path = model_dir(rm.model.path)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        reward_model = load_reward_model(path, dtype=dtype).to(device).eval()
        reward_tokenizer = load_tokenizer(model_dir(rm.model.input_tokenizer or path))
    return Reward(
        tokenizer,
        custom_fn_path=crf.path,
        custom_fn_name=crf.name or "compute_score",
        reward_kwargs=dict(rm.reward_kwargs or {}),
        reward_manager=rm.reward_manager,
        reward_model=reward_model,
        reward_tokenizer=reward_tokenizer,
        max_length=rm.max_length,
    )


def load_policy_model(
    cfg: Any,
    path: str,
    dtype: torch.dtype,
    device: torch.device,
    *,
    train: bool,
    sp: SequenceParallel | None = None,
):
    """A causal LM for the actor or the reference, with klppo's attention (see below), on ``device``;
    with ``sp`` its Ulysses variant (all-to-alls around the same attention)."""
    from klppo.batching.attention import enable_packed_attention
    from klppo.models.lm_head import fp32_lm_head
    from klppo.models.loading import load_causal_lm

    m = cfg.actor_rollout_ref.model
    if m.external_lib:  # verl: a module that registers custom model classes with transformers
        import importlib

        importlib.import_module(m.external_lib)
    model = load_causal_lm(
        path,
        dtype=dtype,
        device="cpu",
        trust_remote_code=bool(m.trust_remote_code),
        gradient_checkpointing=bool(m.enable_gradient_checkpointing) and train,
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
    return model.to(device)


def shard(model: torch.nn.Module, fsdp_cfg: Any, device: torch.device) -> None:
    """FSDP2 over all ranks (or HSDP groups of ``fsdp_size``); logs the units chosen."""
    from klppo.models.lora import is_lora
    from klppo.parallel.collectives import world_size
    from klppo.parallel.fsdp import build_mesh, shard_model

    settings = fsdp_settings(fsdp_cfg, device=device)
    # with LoRA the FSDP root is the Hugging Face model inside the PeftModel: generate() and the adapter
    # wrappers call it directly, and FSDP2 needs every forward to enter through its root
    root = model.get_base_model() if is_lora(model) else model
    shard_model(root, settings, build_mesh(world_size(), settings.fsdp_size, device.type))


def hf_writer(model: torch.nn.Module, tokenizer: Any) -> Callable[[Path], None]:
    """Writes the model's config, generation config and the tokenizer (captured before sharding)."""
    config = model.config
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
