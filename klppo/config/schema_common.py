"""Schema groups shared by several roles: FSDP2 engine, optimizer, checkpoint contents, profiler.

Every field carries verl's name and (unless documented otherwise) verl v0.7's default. Units: batch sizes
in `*_per_gpu` keys are samples (prompt × response pairs); dtypes are `fp32 | bf16 | fp16` (verl's
long names `float32 | bfloat16 | float16` are accepted and printed short).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from klppo.config._field import SEL, F


@dataclass(frozen=True)
class WrapPolicyConfig:
    min_num_params: int | str = F(
        "auto",
        "FSDP unit threshold in parameters: 0 = one unit per decoder layer; N > 0 = group modules bottom-up "
        "into units of at least N parameters (the root is always a unit). auto (klppo's default; verl's is 0): "
        "one unit for the whole model when one process trains and this role offloads nothing (per-layer units "
        "buy nothing there and cost host work: SmolLM2-135M GRPO step −20% on an H200, +2.7 GiB peak, "
        "bench/RESULTS.md session 9), else 0.",
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
    wrap_policy: WrapPolicyConfig = F(WrapPolicyConfig, "How modules are grouped into FSDP units.")
    param_offload: bool = F(False, "Keep this role's parameter shards on CPU while the role is idle.")
    optimizer_offload: bool = F(False, "Keep optimizer state on CPU while the role is idle.")
    offload_policy: bool = F(False, "FSDP2 CPUOffloadPolicy: parameters live on CPU during compute too.")
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
        "[klppo] Reduce-scatter gradients once per mini-batch (after its last micro-batch) instead of after "
        "every micro-batch: false | true | auto. Costs 4 bytes per trainable parameter per rank (unsharded "
        "fp32 gradients) during the update. auto: on with more than one rank, no offload, and that cost at "
        "most 10% of the device's memory (measured on 2 H200s: PPO step −4%, bench/RESULTS.md session 7). "
        "Read by the trained roles (actor, critic).",
    )
    local_shard_optim: bool = F(
        True,
        "[klppo] Run the optimizer step (torch's Adam/AdamW) and the gradient-norm clip on the local shards "
        "of FSDP2's DTensor parameters (the same storage) instead of through DTensor dispatch: the same "
        "state dicts and checkpoints, the same results (bit for bit on CPU; the fused kernel on the same "
        "shards on CUDA), the norm's squares summed over the shard group in one all-reduce. false: the "
        "DTensor path (an A/B switch). Read by the trained roles (actor, critic).",
    )
    plain_single_gpu: bool | str = F(
        "auto",
        "[klppo] One process without FSDP2: the parameters in mixed_precision.param_dtype, fp32 master weights "
        "beside them for the optimizer, each micro-batch's gradients added into fp32 master gradients (FSDP2's "
        "arithmetic on one rank: the same results, bit for bit on CPU), no per-unit copies, hooks or DTensor "
        "dispatch; checkpoints keyed as under FSDP2 (they resume on any world size). false | true | auto. "
        "auto: on with one process that offloads nothing (offload_policy, param_offload and optimizer_offload off: "
        "the plain path's offload has not yet run on a GPU; true takes it with param_offload/optimizer_offload); "
        "true with several processes or offload_policy is an error. Read by the actor, "
        "the critic and the reference (no masters: the compute copy alone). On this path FSDP2's own keys "
        "have no effect: wrap_policy, reshard_after_forward, forward_prefetch, backward_prefetch, "
        "fsdp_size, grad_sync_per_mini_batch (off: no reduce-scatter) and local_shard_optim (no DTensors).",
    )
    cuda_graph_update: bool = F(
        False,
        "[klppo] Replay the role's micro-batches as CUDA graphs: each update micro-batch's forward, loss and "
        "backward, and each micro-batch of the role's no-grad forward pass — the actor's old log-probs, the "
        "critic's values, the reference's log-probs (actor_rollout_ref.ref.fsdp_config.cuda_graph_update: the "
        "reference's one pass). A micro-batch shape runs eagerly the first time, is captured the second, "
        "replayed after (at most 4 shapes per role and pass; a role's graphs share one memory pool — the "
        "larger of an update step's and a forward's activations — and the update's one set of compute-dtype "
        "gradients, held for the run and counted by the memory pre-flight; the reference has a pool of its "
        "own). Removes the per-kernel launch cost (one H200, the TRL workload: training phases 1.44 -> 0.87 s "
        "with the updates graphed, 0.72 s with the no-grad passes too and the compiled head statistics, "
        "bench/RESULTS.md sessions 19-20; a run whose update shapes all repeat logs this "
        "advice). Needs a GPU, the plain path (the role's plain_single_gpu on: one process), packed rows "
        "(use_remove_padding), param_offload off, no sequence parallelism and, for the actor, kl_loss_type "
        "other than full and policy_loss.loss_mode other than clip_cov and kl_cov (they read token counts on "
        "the host); the reference also a model of its own (not LoRA's adapters-off actor). Pays off when "
        "micro-batch shapes repeat (fixed-length responses, or rows padded alike); other shapes run eagerly; "
        "a capture that fails leaves that pass eager with a warning naming this key. Same results as eager "
        "(bit for bit on CPU with a stand-in capture). Read by the actor, the critic and the reference.",
    )
    model_dtype: str = F("fp32", "[klppo default per role] dtype the role's weights are stored in.")
    mixed_precision: MixedPrecisionConfig = F(MixedPrecisionConfig, "[klppo] FSDP2 mixed-precision policy.")
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
