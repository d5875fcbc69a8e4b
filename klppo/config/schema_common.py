"""Schema groups shared by several roles: FSDP2 engine, optimizer, checkpoint contents, profiler.

Every field carries verl's name and (unless documented otherwise) verl v0.7's default. Units: batch sizes
in `*_per_gpu` keys are samples (prompt × response pairs); dtypes are `fp32 | bf16 | fp16` (verl's
long names `float32 | bfloat16 | float16` are accepted and printed short).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from klppo.config._field import SEL, F

SHARDING_RULE = "sharding.md#the-rule-wrap_policymin_num_params-choose_units"


@dataclass(frozen=True)
class WrapPolicyConfig:
    min_num_params: int | str = F(
        "auto",
        "FSDP unit threshold in parameters: 0 = one unit per decoder layer, N > 0 = units of at least N, "
        "auto (klppo's default) = one unit when one process trains and offloads nothing, else 0.",
        see=SHARDING_RULE,
    )
    transformer_layer_cls_to_wrap: list[str] | None = F(
        None,
        "[klppo] class names that form one unit each when min_num_params=0 (null: the model's "
        "_no_split_modules).",
    )


@dataclass(frozen=True)
class MixedPrecisionConfig:
    param_dtype: str = F("bf16", "[klppo] dtype of parameters during forward/backward on GPU (CPU: fp32).")
    reduce_dtype: str = F("fp32", "[klppo] dtype of gradient reduce-scatter.")
    buffer_dtype: str = F("fp32", "[klppo] dtype of module buffers.")


@dataclass(frozen=True)
class FSDPConfig:
    wrap_policy: WrapPolicyConfig = F(
        WrapPolicyConfig, "How modules are grouped into FSDP units.", see=SHARDING_RULE
    )
    param_offload: bool = F(False, "Keep this role's parameter shards on CPU while the role is idle.")
    optimizer_offload: bool = F(False, "Keep optimizer state on CPU while the role is idle.")
    offload_policy: bool = F(False, "FSDP2 CPUOffloadPolicy: parameters live on CPU during compute too.")
    optimizer_step_on_cpu: bool = F(
        False,
        "[klppo] Keep the fp32 master weights and the AdamW state on the host and run the optimizer step on "
        "the CPU, gradients streamed out and weights back per chunk (one process, plain path).",
        see="sharding.md#optimizer-step-on-the-cpu-optimizer_step_on_cpu",
    )
    reshard_after_forward: bool = F(True, "Free gathered parameters after each unit's forward.")
    fsdp_size: int = F(
        -1, "Shard group size: -1 = all ranks; k = shard within k ranks, replicate across (HSDP)."
    )
    forward_prefetch: bool = F(
        False, "Prefetch the next unit's all-gather during the current unit's forward."
    )
    backward_prefetch: bool = F(True, "[klppo] Prefetch the previous unit's all-gather during backward.")
    grad_sync_per_mini_batch: bool | str = F(
        "auto",
        "[klppo] Reduce-scatter gradients once per mini-batch instead of per micro-batch: false | true | "
        "auto "
        "(several ranks, no offload, unsharded fp32 gradients within 10% of the device).",
        see="sharding.md#gradient-sync-once-per-mini-batch-grad_sync_per_mini_batch",
    )
    local_shard_optim: bool = F(
        True,
        "[klppo] true only: the Adam/AdamW step and the gradient clip run on the local shards of FSDP2's "
        "DTensor parameters (the same state and results as through DTensor dispatch); false is refused.",
        see="sharding.md#optimizer-step-on-the-local-shards-local_shard_optim",
    )
    plain_single_gpu: bool | str = F(
        "auto",
        "[klppo] Train on one process without FSDP2, with FSDP2's arithmetic (fp32 masters beside the "
        "compute "
        "copy): false | true | auto (one process that offloads nothing).",
        see="sharding.md#one-process-no-fsdp2-plain_single_gpu",
    )
    cuda_graph_update: bool = F(
        False,
        "[klppo] Replay the role's update and no-grad micro-batches as CUDA graphs once their shapes repeat "
        "(GPU, plain path, packed rows, no offload or Ulysses).",
        see="sharding.md#the-update-as-cuda-graphs-cuda_graph_update",
    )
    model_dtype: str = F("fp32", "[klppo default per role] dtype the role's weights are stored in.")
    mixed_precision: MixedPrecisionConfig = F(
        MixedPrecisionConfig,
        "[klppo] FSDP2 mixed-precision policy.",
        see="sharding.md#knobs-and-their-effect",
    )
    use_orig_params: bool = F(False, "FSDP1 option; FSDP2 always keeps original parameters.")
    seed: int = F(42, "Engine seed in verl's new worker; klppo seeds from trainer.seed.")
    full_determinism: bool = F(False, "Deterministic kernels (slower).")
    ulysses_sequence_parallel_size: int = F(1, "Engine copy of the role's Ulysses size (verl v0.7).")
    entropy_from_logits_with_chunking: bool = F(False, "Engine copy of the role's key (verl v0.7).")
    use_torch_compile: bool = F(True, "Engine copy of the role's key (verl v0.7).")
    entropy_checkpointing: bool = F(False, "Engine copy of the role's key (verl v0.7).")
    forward_only: bool = F(False, "Engine flag: role never trains (verl v0.7).")
    strategy: str = F("fsdp2", "Engine strategy; fsdp is read as fsdp2.")
    dtype: str = F("bf16", "Engine compute dtype (verl v0.7); klppo uses mixed_precision.param_dtype.")


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = F("AdamW", "Optimizer class name.")
    optimizer_impl: str = F("torch.optim", "Module the optimizer class comes from.")
    lr: float = F(1e-6, "Learning rate.")
    lr_warmup_steps_ratio: float = F(0.0, "Warmup steps as a fraction of total training steps.")
    total_training_steps: int = F(-1, "Set by the trainer; -1 = from trainer settings.")
    weight_decay: float = F(0.01, "AdamW weight decay.")
    lr_warmup_steps: int | None = F(-1, "Warmup steps; -1 or null = use lr_warmup_steps_ratio.")
    betas: list[float] = F([0.9, 0.999], "AdamW betas.")
    clip_grad: float = F(1.0, "verl v0.7 engine gradient clip; klppo uses the role's grad_clip.")
    min_lr_ratio: float = F(0.0, "Cosine schedule floor as a fraction of lr.")
    num_cycles: float = F(0.5, "Cosine schedule cycles.")
    lr_scheduler_type: str = F("constant", "constant | cosine (after warmup).")
    zero_indexed_step: bool = F(True, "Scheduler step counting starts at 0.")
    warmup_style: str | None = F(None, "Deprecated verl name of lr_scheduler_type (alias).")
    override_optimizer_config: dict[str, Any] | None = F(None, "Extra optimizer keyword arguments.")


@dataclass(frozen=True)
class CheckpointConfig:
    save_contents: list[str] = F(["model", "optimizer", "extra"], "What a checkpoint holds.")
    load_contents: list[str] = F("${.save_contents}", "What is loaded on resume (default: save_contents).")
    async_save: bool = F(False, "Write checkpoints in the background.")


@dataclass(frozen=True)
class ProfilerConfig:
    tool: str | None = F(SEL("global_profiler.tool", "null"), "Profiler tool (follows global_profiler.tool).")
    enable: bool = F(False, "Profile this role.")
    all_ranks: bool = F(False, "Profile every rank.")
    ranks: list[int] = F([], "Ranks to profile.")
    save_path: str | None = F(SEL("global_profiler.save_path", "null"), "Where profiles go.")
    tool_config: dict[str, Any] | None = F({}, "Tool-specific options.")
