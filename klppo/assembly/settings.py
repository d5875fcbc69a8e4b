"""Every translation of verl's configuration keys into the settings objects of the lower layers, in one
place: each function takes a typed config group (or the whole ``KLPPOConfig`` where a setting draws on
several groups) and returns a frozen dataclass.

The trainer (``setup.py``, ``roles_build.py``), ``klppo train --dry-run`` and ``klppo tune`` (its CLI and the
memory pre-flight) consume the same objects: the actor's :class:`~klppo.parallel.fsdp.FSDPSettings` that
shards the model is the one the memory model predicts for. The schema holds every default; nothing here
restates one or re-casts a typed field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from klppo.agent.multi_turn import MultiTurnSettings
from klppo.algorithms import rollout_correction as rc
from klppo.algorithms.losses import POLICY_LOSS_KEYS, POLICY_LOSS_OPTIONS
from klppo.config import KLPPOConfig
from klppo.config.schema import DataConfig
from klppo.config.schema_arr import MultiTurnConfig, RolloutConfig
from klppo.config.schema_common import FSDPConfig, OptimConfig
from klppo.config.sizes import Sizes, uses_critic, uses_lora
from klppo.data.dataset import LoaderSettings
from klppo.parallel.fsdp import FSDPSettings
from klppo.parallel.mesh import SequenceParallel
from klppo.roles.actor import ActorSettings
from klppo.roles.critic import CriticSettings
from klppo.roles.forward import MicroBatching
from klppo.roles.optim import OptimSettings
from klppo.rollout.base import SamplingParams
from klppo.rollout.settings import EngineSettings
from klppo.tools.config import load_tools
from klppo.tune.critic import CriticWorkload
from klppo.tune.memory import Point, TuneWorkload, Workload, defers_grad_sync
from klppo.tune.units import WHOLE_MODEL

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def to_dtype(name: str) -> torch.dtype:
    """``fp32 | bf16 | fp16`` (or verl's long names) as a torch dtype."""
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: expected one of {sorted(DTYPES)}") from None


# ---------------------------------------------------------------------------------------------- parallel
ROLE_KEYS = {
    "actor": "actor_rollout_ref.actor",
    "reference": "actor_rollout_ref.ref",
    "critic": "critic.model",
}
"""Where each FSDP-wrapped role's configuration group is (``<key>.fsdp_config``), for messages."""


def fsdp_settings(
    fsdp: FSDPConfig, *, device_type: str, world_size: int, key: str = "fsdp_config"
) -> FSDPSettings:
    """FSDP2 settings of one role (``*.fsdp_config``, at ``key`` in the config for errors) in a run of
    ``world_size`` processes; mixed precision (bf16 compute) only on GPU; ``wrap_policy.min_num_params``
    auto resolved (:func:`resolve_min_num_params`), ``plain_single_gpu`` too (:func:`resolve_plain`)."""
    policy, mp = fsdp.wrap_policy, fsdp.mixed_precision
    min_num_params, _ = resolve_min_num_params(fsdp, world_size=world_size)
    return FSDPSettings(
        min_num_params=min_num_params,
        transformer_layer_cls_to_wrap=list(policy.transformer_layer_cls_to_wrap or []) or None,
        param_offload=fsdp.param_offload,
        optimizer_offload=fsdp.optimizer_offload,
        optimizer_step_on_cpu=check_cpu_step(fsdp, world_size=world_size, key=key),
        offload_policy=fsdp.offload_policy,
        reshard_after_forward=fsdp.reshard_after_forward,
        fsdp_size=fsdp.fsdp_size,
        forward_prefetch=fsdp.forward_prefetch,
        backward_prefetch=fsdp.backward_prefetch,
        param_dtype=to_dtype(mp.param_dtype) if device_type == "cuda" else None,
        reduce_dtype=to_dtype(mp.reduce_dtype),
        plain=resolve_plain(fsdp, world_size=world_size, key=key),
    )


def resolve_plain(fsdp: FSDPConfig, *, world_size: int, key: str = "fsdp_config") -> bool:
    """``fsdp_config.plain_single_gpu`` resolved: auto is on when one process trains and offloads nothing
    (``offload_policy``, ``param_offload``, ``optimizer_offload`` off; :mod:`klppo.parallel.plain`); true
    needs one process and no ``offload_policy``, else a ValueError naming the key (``key``: the role's
    ``fsdp_config`` path)."""
    value = fsdp.plain_single_gpu
    possible = world_size == 1 and not fsdp.offload_policy
    if value is True and not possible:
        why = f"{world_size} processes" if world_size > 1 else "offload_policy=true"
        raise ValueError(
            f"{key}.plain_single_gpu=true needs one process and no offload_policy ({why}): set it to auto or "
            "false"
        )
    # auto leaves offloading roles on FSDP2: the plain path's offload is tested on CPU only
    offloads = fsdp.param_offload or fsdp.optimizer_offload
    return possible and not offloads if value == "auto" else bool(value)


def check_cpu_step(fsdp: FSDPConfig, *, world_size: int, key: str = "fsdp_config") -> bool:
    """``fsdp_config.optimizer_step_on_cpu``, or a ValueError naming the key when the role cannot take it: it
    runs on the plain path (one process; :func:`resolve_plain`), whose masters and optimizer state it keeps on
    the host for the whole run — so ``param_offload``, ``optimizer_offload`` (moving them between phases) and
    ``cuda_graph_update`` (a graph reads device memory only) are refused beside it."""
    if not fsdp.optimizer_step_on_cpu:
        return False
    clashes = [
        k
        for k in ("param_offload", "optimizer_offload", "offload_policy", "cuda_graph_update")
        if getattr(fsdp, k)
    ]
    if world_size > 1 or fsdp.plain_single_gpu is False or clashes:
        why = (
            f"{world_size} processes (FSDP2's offload_policy steps a sharded optimizer on the CPU)"
            if world_size > 1
            else "plain_single_gpu=false"
            if fsdp.plain_single_gpu is False
            else ", ".join(f"{k}=true" for k in clashes)
        )
        raise ValueError(
            f"{key}.optimizer_step_on_cpu=true needs one process on the plain path with the masters and "
            f"AdamW state on the host throughout ({why}): set it to false, or unset those"
        )
    return True


def check_cuda_graph_update(fsdp: FSDPConfig, settings: FSDPSettings, *, device_type: str, key: str) -> None:
    """ValueError naming ``key.cuda_graph_update`` when it is on and the run cannot capture the role's graphs
    (:mod:`klppo.roles.graphed`: the update and the no-grad pass; the reference's log-prob pass): no GPU, not
    the plain path, or parameters offloaded between phases."""
    if not fsdp.cuda_graph_update:
        return
    if device_type != "cuda":
        need = f"a GPU (trainer.device={device_type})"
    elif not settings.plain:
        need = "the plain path (plain_single_gpu: auto on one process that offloads nothing, or true)"
    elif fsdp.param_offload:
        need = "parameters that stay on the device (param_offload=false)"
    else:
        return
    raise ValueError(f"{key}.cuda_graph_update=true needs {need}: set it to false")


def resolve_min_num_params(fsdp: FSDPConfig, *, world_size: int) -> tuple[int, str]:
    """``wrap_policy.min_num_params`` as an integer, and why. ``auto``: one unit for the whole model
    (:data:`~klppo.tune.units.WHOLE_MODEL`) when one process trains and the role offloads nothing —
    a one-rank mesh shards nothing, so per-layer units only add their hooks and per-unit casts at the cost
    of a larger peak (docs/sharding.md); otherwise 0, one unit per decoder layer (verl's default)."""
    value = fsdp.wrap_policy.min_num_params
    if value != "auto":
        return int(value), "set"
    if world_size > 1:
        return 0, f"auto: {world_size} processes, one unit per decoder layer"
    offloads = [k for k in ("param_offload", "optimizer_offload", "offload_policy") if getattr(fsdp, k)]
    if offloads:
        return 0, f"auto: {', '.join(offloads)} asks for memory first, one unit per decoder layer"
    return WHOLE_MODEL, "auto: one process, one unit for the whole model"


def describe_min_num_params(fsdp: FSDPConfig, *, world_size: int) -> str:
    """The resolved layout and why, for logs and the dry-run plan, e.g. "one unit for the whole model
    (auto: one process, one unit for the whole model)"."""
    threshold, why = resolve_min_num_params(fsdp, world_size=world_size)
    layout = "one unit for the whole model" if threshold >= WHOLE_MODEL else f"min_num_params={threshold}"
    return f"{layout} ({why})"


def grad_sync_per_mini_batch(
    fsdp_cfg: FSDPConfig, fsdp: FSDPSettings, *, num_trainable: int, ranks: int, device_bytes: int | None
) -> tuple[bool, str]:
    """A trained role's ``fsdp_config.grad_sync_per_mini_batch`` resolved (auto: :func:`defers_grad_sync`,
    the rule the memory model applies too), and why; its cost one gradient in the reduce dtype (4 bytes in
    fp32) per trainable parameter per rank. The plain path (``fsdp.plain``) has no reduce-scatter: off."""
    if fsdp.plain:
        return False, (
            "no reduce-scatter on the plain path (plain_single_gpu): each micro-batch adds into the master "
            "gradients"
        )
    return defers_grad_sync(
        fsdp_cfg.grad_sync_per_mini_batch,
        ranks=ranks,
        offload=offload_mode(fsdp),
        grad_bytes=fsdp.reduce_dtype.itemsize * num_trainable,
        device_bytes=device_bytes,
    )


# ---------------------------------------------------------------------------------------------- roles
def optim_settings(optim: OptimConfig, total_steps: int) -> OptimSettings:
    """Optimizer and LR schedule of one role (``*.optim``)."""
    return OptimSettings(
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        betas=(optim.betas[0], optim.betas[1]),
        warmup_steps=optim.lr_warmup_steps if optim.lr_warmup_steps > 0 else -1,  # 0 too: from the ratio
        warmup_steps_ratio=optim.lr_warmup_steps_ratio,
        schedule=optim.lr_scheduler_type,  # the loader moved a verl warmup_style here
        min_lr_ratio=optim.min_lr_ratio,
        num_cycles=optim.num_cycles,
        total_steps=max(1, total_steps),
        optimizer=optim.optimizer,
        optimizer_impl=optim.optimizer_impl,
        extra=tuple(sorted((optim.override_optimizer_config or {}).items())),
    )


def micro(size: int | None, *, dynamic: bool, max_tokens: int) -> MicroBatching:
    """Micro-batching of one pass; with ``use_dynamic_bsz`` the size is unset (None) and micro-batches come
    from the token budget alone."""
    return MicroBatching(
        micro_batch_size=max(1, size or 1), use_dynamic_bsz=dynamic, max_token_len=max_tokens
    )


def sp_size(sp: SequenceParallel | None) -> int:
    """Ranks of a Ulysses group (1 without one): a group's token budget is ``max_token_len × size``."""
    return 1 if sp is None else sp.size


def rollout_temperature(rollout: RolloutConfig) -> float:
    """The temperature log-probs are computed at (the rollout's; 1 for greedy)."""
    return rollout.temperature if rollout.temperature > 0 else 1.0


def actor_settings(cfg: KLPPOConfig, sizes: Sizes, *, sp: SequenceParallel | None = None) -> ActorSettings:
    """The actor's update and log-prob settings (``actor_rollout_ref.actor.*``, the rollout's log-prob keys);
    with ``sp`` (its Ulysses group, ``actor.ulysses_sequence_parallel_size``) the group's token budgets."""
    arr = cfg.actor_rollout_ref
    actor, rollout = arr.actor, arr.rollout
    loss_mode = actor.policy_loss.loss_mode
    return ActorSettings(
        ppo_epochs=actor.ppo_epochs,
        mini_batch_size=sizes.actor_mini_batch_samples_per_rank,
        update_micro=micro(
            sizes.actor_micro_batch_size_per_gpu,
            dynamic=actor.use_dynamic_bsz,
            max_tokens=actor.ppo_max_token_len_per_gpu * sp_size(sp),
        ),
        log_prob_micro=micro(
            sizes.log_prob_micro_batch_size_per_gpu,
            dynamic=rollout.log_prob_use_dynamic_bsz,
            max_tokens=rollout.log_prob_max_token_len_per_gpu * sp_size(sp),
        ),
        grad_clip=actor.grad_clip,
        clip_ratio=actor.clip_ratio,
        clip_ratio_low=actor.clip_ratio_low,
        clip_ratio_high=actor.clip_ratio_high,
        clip_ratio_c=actor.clip_ratio_c,
        loss_agg_mode=actor.loss_agg_mode,
        loss_scale_factor=actor.loss_scale_factor,
        loss_mode=loss_mode,
        policy_loss_options=(
            POLICY_LOSS_OPTIONS[loss_mode](
                **{k: getattr(actor.policy_loss, k) for k in POLICY_LOSS_KEYS[loss_mode]}
            )
            if loss_mode in POLICY_LOSS_OPTIONS
            else None
        ),
        entropy_coeff=actor.entropy_coeff,
        use_kl_loss=actor.use_kl_loss,
        kl_loss_coef=actor.kl_loss_coef,
        kl_loss_type=actor.kl_loss_type,
        temperature=rollout_temperature(rollout),
        shuffle=actor.shuffle,
        use_remove_padding=arr.model.use_remove_padding,
        seed=cfg.trainer.seed,
        skip_old_log_prob_on_policy=skips_old_log_prob_pass(cfg),
        use_fused_kernels=actor.use_fused_kernels,
        sp=sp,
        cuda_graph_update=actor.fsdp_config.cuda_graph_update,
        rollout_correction=rollout_correction_settings(cfg),
    )


def rollout_correction_settings(cfg: KLPPOConfig) -> rc.CorrectionSettings | None:
    """``algorithm.rollout_correction`` with its thresholds parsed; None when it changes nothing (no
    importance weights, no rejection, not bypass mode): the step is then the uncorrected one, unreported."""
    rcfg = cfg.algorithm.rollout_correction
    if rcfg.rollout_is is None and rcfg.rollout_rs is None and not rcfg.bypass_mode:
        return None
    rs = () if rcfg.rollout_rs is None else rc.parse_rs_options(rcfg.rollout_rs, rcfg.rollout_rs_threshold)
    return rc.CorrectionSettings(
        rollout_is=rcfg.rollout_is,
        rollout_is_threshold=rcfg.rollout_is_threshold,
        rollout_is_batch_normalize=rcfg.rollout_is_batch_normalize,
        rs_options=rs,
        bypass_mode=rcfg.bypass_mode,
        loss_type=rcfg.loss_type,
    )


def skips_old_log_prob_pass(cfg: KLPPOConfig) -> bool:
    """``actor.skip_old_log_prob_on_policy`` where nothing needs π_old before the update: not the KL in the
    reward (before the advantages), not a decoupled rollout correction (its weights use π_old). A KL-loss
    controller reads this step's KL after the update, from the update's forward. Whether the update is
    on-policy is the actor's test."""
    decoupled = (
        rollout_correction_settings(cfg) is not None and not cfg.algorithm.rollout_correction.bypass_mode
    )
    actor = cfg.actor_rollout_ref.actor
    return actor.skip_old_log_prob_on_policy and not cfg.algorithm.use_kl_in_reward and not decoupled


@dataclass(frozen=True)
class ReferenceSettings:
    """The reference's log-prob pass (``actor_rollout_ref.ref.*``)."""

    micro: MicroBatching
    temperature: float
    use_remove_padding: bool
    use_fused_kernels: bool
    sp: SequenceParallel | None = None
    """Its Ulysses group (``ref.ulysses_sequence_parallel_size``)."""
    cuda_graph: bool = False
    """``ref.fsdp_config.cuda_graph_update``: the log-prob micro-batches replayed as CUDA graphs."""


def reference_settings(
    cfg: KLPPOConfig, sizes: Sizes, *, sp: SequenceParallel | None = None
) -> ReferenceSettings:
    arr = cfg.actor_rollout_ref
    return ReferenceSettings(
        micro=micro(
            sizes.ref_log_prob_micro_batch_size_per_gpu,
            dynamic=arr.ref.log_prob_use_dynamic_bsz,
            max_tokens=arr.ref.log_prob_max_token_len_per_gpu * sp_size(sp),
        ),
        temperature=rollout_temperature(arr.rollout),
        use_remove_padding=arr.model.use_remove_padding,
        use_fused_kernels=arr.model.use_fused_kernels,
        sp=sp,
        cuda_graph=arr.ref.fsdp_config.cuda_graph_update,
    )


def critic_settings(cfg: KLPPOConfig, sizes: Sizes, *, sp: SequenceParallel | None = None) -> CriticSettings:
    """The critic's update and value-pass settings (``critic.*``); with ``sp`` (its Ulysses group) the
    group's token budgets."""
    critic = cfg.critic
    return CriticSettings(
        ppo_epochs=critic.ppo_epochs,
        mini_batch_size=sizes.critic_mini_batch_samples_per_rank,
        update_micro=micro(
            sizes.critic_micro_batch_size_per_gpu,
            dynamic=critic.use_dynamic_bsz,
            max_tokens=critic.ppo_max_token_len_per_gpu * sp_size(sp),
        ),
        forward_micro=micro(
            sizes.critic_forward_micro_batch_size_per_gpu,
            dynamic=critic.use_dynamic_bsz,
            max_tokens=critic.forward_max_token_len_per_gpu * sp_size(sp),
        ),
        grad_clip=critic.grad_clip,
        cliprange_value=critic.cliprange_value,
        loss_agg_mode=critic.loss_agg_mode,
        shuffle=critic.shuffle,
        use_remove_padding=critic.model.use_remove_padding,
        seed=cfg.trainer.seed,
        sp=sp,
        cuda_graph_update=critic.model.fsdp_config.cuda_graph_update,
    )


# ---------------------------------------------------------------------------------------------- rollout
def sampling_params(
    rollout: RolloutConfig, *, response_length: int, validation: bool, law_log_probs: bool = True
) -> SamplingParams:
    """How the rollout samples for training, or for validation (``rollout.val_kwargs``);
    ``law_log_probs``: whether a truncated draw returns the log-probs of the law sampled from
    (:func:`reads_law_log_probs`)."""
    src = rollout.val_kwargs if validation else rollout
    do_sample = src.do_sample and src.temperature > 0
    return SamplingParams(
        n=src.n,
        temperature=src.temperature if do_sample else 1.0,
        top_p=src.top_p,
        top_k=src.top_k,
        do_sample=do_sample,
        max_new_tokens=response_length,
        ignore_eos=rollout.ignore_eos,
        law_log_probs=law_log_probs,
    )


def reads_law_log_probs(cfg: KLPPOConfig) -> bool:
    """Whether training reads the truncated law's log-probs of its samples: a rollout correction compares
    them with π_old or trains against them (bypass mode); without one, ``rollout/log_prob_diff`` compares
    full softmaxes, which the sampler gives without them."""
    return rollout_correction_settings(cfg) is not None


def engine_settings(
    rollout: RolloutConfig, *, tensor_parallel: bool | None = None, eos_token_ids=(), pad_token_id: int = 0
) -> EngineSettings:
    """The engine's settings read from the rollout config (``hf`` reads only the token ids):
    ``enforce_eager`` runs the decode step eagerly (no torch.compile, no CUDA graph capture), as vLLM's flag
    does; ``sampler`` and ``decode_attention`` choose the Triton kernels or the torch reference
    (:mod:`klppo.rollout.backends`); ``compact_slots`` moves busy slots into smaller decode batches once
    nothing waits (``auto``: unless the rollout is tensor-parallel — ``tensor_parallel``, the built
    rollout's, else read from the configured size)."""
    eager = rollout.enforce_eager
    return EngineSettings(
        eos_token_ids=tuple(eos_token_ids),
        pad_token_id=pad_token_id,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        free_cache_engine=rollout.free_cache_engine,
        cuda_graphs=not eager,
        compile_decode=False if eager else None,
        sampler=rollout.sampler,
        decode_attention=rollout.decode_attention,
        compact_slots=compacts_slots(rollout, tensor_parallel=tensor_parallel),
    )


def compacts_slots(rollout: RolloutConfig, *, tensor_parallel: bool | None = None) -> bool:
    """``rollout.compact_slots`` resolved: ``auto`` is on unless the rollout is tensor-parallel
    (``tensor_parallel``: whether it is, as built — LoRA or another backend leave a configured size > 1
    data-parallel; None: read from ``tensor_model_parallel_size``)."""
    if rollout.compact_slots == "auto":
        if tensor_parallel is None:
            tensor_parallel = rollout.tensor_model_parallel_size > 1
        return not tensor_parallel
    return bool(rollout.compact_slots)


# ---------------------------------------------------------------------------------------------- data
def data_paths(value: Any) -> list[str]:
    """``data.*_files``: one path or a list of paths (the schema accepts both)."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def loader_settings(data: DataConfig, *, seed: int, validation: bool) -> LoaderSettings | None:
    """The training loader (``data.seed``, else ``seed``: trainer.seed), or the validation loader (whole set
    per batch unless ``val_batch_size``; None without ``val_files``)."""
    files = data_paths(data.val_files if validation else data.train_files)
    if validation and not files:
        return None
    return LoaderSettings(
        files=files,
        batch_size=(data.val_batch_size or 10**9) if validation else data.train_batch_size,
        shuffle=data.validation_shuffle if validation else data.shuffle,
        seed=0 if validation else (data.seed if data.seed is not None else seed),
        drop_last=not validation,
        shuffle_buffer_rows=None if validation else data.shuffle_buffer_rows,
        max_samples=data.val_max_samples if validation else data.train_max_samples,
        max_prompt_length=data.max_prompt_length,
        prompt_key=data.prompt_key,
        filter_overlong_prompts=data.filter_overlong_prompts,
        truncation=data.truncation,
        return_raw_chat=data.return_raw_chat,
        use_chat_template=data.use_chat_template,
        bad_row_policy=data.bad_row_policy,
        max_cached_row_groups=data.max_cached_row_groups,
        apply_chat_template_kwargs={**data.apply_chat_template_kwargs, **tool_schemas(data.tool_config_path)},
        reward_fn_key=data.reward_fn_key,
    )


def tool_schemas(tool_config_path: str | None) -> dict[str, Any]:
    """``{"tools": [schema, ...]}`` for the chat template of the prompts (``data.tool_config_path``, which
    follows ``multi_turn.tool_config_path``), or ``{}``; loading the file checks it before any weights
    load."""
    if not tool_config_path:
        return {}
    return {"tools": [tool.tool_schema.to_dict() for tool in load_tools(tool_config_path).values()]}


def multi_turn_settings(mt: MultiTurnConfig) -> MultiTurnSettings:
    """The conversation loop's limits (:class:`klppo.agent.multi_turn.MultiTurnSettings`)."""
    return MultiTurnSettings(
        max_assistant_turns=mt.max_assistant_turns,
        max_user_turns=mt.max_user_turns,
        max_parallel_calls=mt.max_parallel_calls,
        max_tool_response_length=mt.max_tool_response_length,
        tool_response_truncate_side=mt.tool_response_truncate_side,
        format=mt.format,
        tool_timeout_s=mt.tool_timeout_s,
    )


# ---------------------------------------------------------------------------------------------- tune
def offload_mode(fsdp: FSDPSettings) -> str:
    """The memory model's offload mode of a role's FSDP settings (``klppo.tune.memory.OFFLOAD_MODES``)."""
    if fsdp.offload_policy:
        return "cpu"
    if fsdp.optimizer_step_on_cpu:
        return "cpu_step"
    return "idle" if fsdp.param_offload or fsdp.optimizer_offload else "off"


def tune_workload(
    cfg: KLPPOConfig,
    fsdp: FSDPSettings,
    *,
    world_size: int,
    device_gib: float,
    critic_config: object | None = None,
) -> TuneWorkload:
    """The run's workload for ``klppo tune`` and the pre-flight, with ``fsdp`` the actor's FSDP settings
    (:func:`fsdp_settings` of ``actor.fsdp_config``, the object the trainer shards with) and, with a critic,
    its own (:func:`critic_workload`; ``critic_config``: the model config of ``critic.model.path`` where it
    names another model than the actor's, None: the actor's backbone)."""
    arr = cfg.actor_rollout_ref
    actor = arr.actor
    prompt, response = cfg.data.max_prompt_length, cfg.data.max_response_length
    workload = Workload(
        world_size=world_size,
        fsdp_size=fsdp.fsdp_size,
        grad_checkpointing=arr.model.enable_gradient_checkpointing,
        response_fraction=response / (prompt + response),
        calculate_entropy=actor.entropy_coeff > 0 or actor.calculate_entropy,
        log_prob_tokens=arr.rollout.log_prob_max_token_len_per_gpu,
        gpu_memory_utilization=arr.rollout.gpu_memory_utilization,
        device_bytes=int(device_gib * 2**30),
        backward_prefetch=fsdp.backward_prefetch,
        reference=(actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)
        and not arr.ref.fsdp_config.param_offload,
        reference_offloaded=(actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)
        and arr.ref.fsdp_config.param_offload
        and arr.model.lora_rank == 0,
        lora=uses_lora(arr.model),
        sequence_parallel=actor.ulysses_sequence_parallel_size,
        rollout_tensor_parallel=arr.rollout.tensor_model_parallel_size,
        grad_sync_per_mini_batch=actor.fsdp_config.grad_sync_per_mini_batch,
        reduce_dtype=str(fsdp.reduce_dtype).removeprefix("torch."),
        graph_update=actor.fsdp_config.cuda_graph_update,
        graph_reference=arr.ref.fsdp_config.cuda_graph_update,
        # as resolve_plain, for every point without offload_policy (a configured offload_policy aside)
        plain=fsdp.plain or (world_size == 1 and actor.fsdp_config.plain_single_gpu is not False),
        plain_offload=actor.fsdp_config.plain_single_gpu is True,
    )
    point = Point(
        fsdp.min_num_params,
        offload_mode(fsdp),
        fsdp.forward_prefetch,
        fsdp.reshard_after_forward,
        actor.ppo_max_token_len_per_gpu,
    )
    fixed_rows = actor.ppo_micro_batch_size_per_gpu if not actor.use_dynamic_bsz else None
    # fixed micro-batches: rows × the padded sequence length, split over a Ulysses group's ranks
    fixed_tokens = -(-(fixed_rows or 0) * (prompt + response) // workload.sequence_parallel)
    return TuneWorkload(
        workload=workload,
        point=point,
        seq_len=prompt + response,
        update_micro_tokens=fixed_tokens if fixed_rows else point.micro_tokens,
        critic=critic_workload(cfg, workload, model_config=critic_config) if uses_critic(cfg) else None,
    )


def critic_workload(cfg: KLPPOConfig, actor: Workload, *, model_config: object | None) -> CriticWorkload:
    """The critic's workload for the memory model (``critic.*``): its FSDP settings, offload, dtypes
    (``fsdp_config.model_dtype`` the masters', bf16 compute on a GPU), gradient checkpointing, LoRA, token
    budgets and Ulysses group, on ``model_config`` (None: the actor's backbone); ranks, sequence layout and
    device as ``actor``'s."""
    critic = cfg.critic
    fsdp = fsdp_settings(
        critic.model.fsdp_config,
        device_type="cuda",
        world_size=actor.world_size,
        key="critic.model.fsdp_config",
    )
    master = torch.empty((), dtype=to_dtype(critic.model.fsdp_config.model_dtype)).element_size()
    seq_len = cfg.data.max_prompt_length + cfg.data.max_response_length
    sp = critic.ulysses_sequence_parallel_size

    def tokens(rows: int | None, budget: int) -> int:  # one micro-batch: the budget, or rows × seq_len
        return budget if critic.use_dynamic_bsz or not rows else -(-rows * seq_len // sp)

    workload = dataclasses.replace(
        actor,
        fsdp_size=fsdp.fsdp_size,
        grad_checkpointing=critic.model.enable_gradient_checkpointing,
        calculate_entropy=False,
        log_prob_tokens=tokens(critic.forward_micro_batch_size_per_gpu, critic.forward_max_token_len_per_gpu),
        master_bytes=master,
        compute_bytes=2 if fsdp.param_dtype is not None else master,
        backward_prefetch=fsdp.backward_prefetch,
        reference=False,
        reference_offloaded=False,
        lora=critic.model.lora_rank > 0,
        value_model=True,
        sequence_parallel=sp,
        rollout_tensor_parallel=1,
        grad_sync_per_mini_batch=critic.model.fsdp_config.grad_sync_per_mini_batch,
        reduce_dtype=str(fsdp.reduce_dtype).removeprefix("torch."),
        graph_update=False,
        graph_reference=False,
        plain=fsdp.plain,
        plain_offload=fsdp.plain,
    )
    point = Point(
        fsdp.min_num_params,
        offload_mode(fsdp),
        fsdp.forward_prefetch,
        fsdp.reshard_after_forward,
        critic.ppo_max_token_len_per_gpu,
    )
    update_tokens = tokens(critic.ppo_micro_batch_size_per_gpu, critic.ppo_max_token_len_per_gpu)
    return CriticWorkload(workload, point, update_tokens, model_config)
