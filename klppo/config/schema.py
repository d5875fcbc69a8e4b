"""The typed configuration tree: verl's `ppo_trainer.yaml` key names and groups, plus klppo's own keys.

`KLPPOConfig` is the root. Defaults are verl v0.7's except where `docs/configuration.md` says otherwise
(keys marked [klppo] in the help text are ours). Build one with `klppo.config.load_config`, which merges
these defaults, a user YAML and dotted overrides, resolves `${...}` interpolations and freezes it;
constructing `KLPPOConfig()` directly leaves interpolations unresolved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from klppo.config._field import II, SEL, F
from klppo.config.schema_arr import (
    COMPILED_PASSES,
    KL_CONTROLLERS,
    ULYSSES,
    ActorRolloutRefConfig,
    TiledMLPConfig,
)
from klppo.config.schema_common import CheckpointConfig, FSDPConfig, OptimConfig, ProfilerConfig
from klppo.config.schema_monitor import OPERATING_RULES, MonitorConfig

ESTIMATORS = "algorithms.md#advantage-estimators-algorithmadv_estimator"
ROLLOUT_CORR = "algorithms.md#rollout-correction-algorithmrollout_correction"
REWARDS = "training.md#rewards"


@dataclass(frozen=True)
class ClassRefConfig:
    path: str | None = F(None, "Python file.")
    name: str | None = F(None, "Name in that file.")


@dataclass(frozen=True)
class SamplerConfig:
    class_path: str | None = F(None, "Python file of a custom sampler.")
    class_name: str | None = F(None, "Sampler class name.")


@dataclass(frozen=True)
class DataConfig:
    tokenizer: str | None = F(None, "Tokenizer for the dataset (null: the model's).")
    use_shm: bool = F(False, "Copy data to shared memory.")
    train_files: Any = F("~/data/rlhf/gsm8k/train.parquet", "Parquet file or list of files (~ expanded).")
    val_files: Any = F("~/data/rlhf/gsm8k/test.parquet", "Parquet file or list of files for validation.")
    train_max_samples: int = F(-1, "Use at most this many training rows (-1 = all).")
    val_max_samples: int = F(-1, "Use at most this many validation rows (-1 = all).")
    prompt_key: str = F("prompt", "Column holding the chat messages.")
    reward_fn_key: str = F("data_source", "Column choosing the reward function.")
    max_prompt_length: int = F(512, "Prompt tokens (longer prompts: see filter_overlong_prompts/truncation).")
    max_response_length: int = F(512, "Generated tokens per response.")
    train_batch_size: int = F(1024, "PROMPTS per training step (samples per step = this × rollout.n).")
    val_batch_size: int | None = F(None, "Prompts per validation batch (null: whole set).")
    tool_config_path: str | None = F(
        SEL("actor_rollout_ref.rollout.multi_turn.tool_config_path", "null"), "Tools of multi-turn rollout."
    )
    return_raw_input_ids: bool = F(False, "Also return unpadded prompt ids.")
    return_raw_chat: bool = F(False, "Also return the chat messages (verl v0.6 default).")
    return_full_prompt: bool = F(False, "Also return the templated prompt text.")
    shuffle: bool = F(True, "Shuffle training prompts.")
    seed: int | None = F(None, "Shuffle seed (null: trainer.seed).")
    dataloader_num_workers: int = F(8, "Loader worker processes.")
    image_patch_size: int = F(14, "Vision models: image patch size.")
    validation_shuffle: bool = F(False, "Shuffle validation prompts.")
    filter_overlong_prompts: bool = F(False, "Drop prompts longer than max_prompt_length (count reported).")
    filter_overlong_prompts_workers: int = F(1, "Processes for that filter.")
    truncation: str = F("error", "Overlong prompt not filtered: error | left | right | middle.")
    image_key: str = F("images", "Image column: a file that has it is refused (text-only models).")
    video_key: str = F("videos", "Video column: a file that has it is refused (text-only models).")
    trust_remote_code: bool = F(
        False, "Allow tokenizer code from its directory (as actor_rollout_ref.model.trust_remote_code does)."
    )
    custom_cls: ClassRefConfig = F(ClassRefConfig, "Custom dataset class.")
    return_multi_modal_inputs: bool = F(True, "Multimodal inputs.")
    sampler: SamplerConfig = F(SamplerConfig, "Custom sampler.")
    datagen: ClassRefConfig = F(ClassRefConfig, "Dynamic data generation.")
    apply_chat_template_kwargs: dict[str, Any] = F({}, "Extra arguments to apply_chat_template.")
    bad_row_policy: str = F("skip", "[klppo] Row with missing/wrong/empty prompt: skip (counted) | error.")
    use_chat_template: bool = F(
        True, "[klppo] Apply the tokenizer's chat template (false: raw message text)."
    )
    shuffle_buffer_rows: int | None = F(
        None,
        "[klppo] null: exact per-epoch permutation of all rows; N: row-group order shuffled, then an N-row "
        "shuffle buffer (for sets whose row index does not fit in memory).",
    )
    max_cached_row_groups: int = F(16, "[klppo] Parquet row groups kept decoded in memory while reading.")
    logged_files: Any = F(
        None,
        "[klppo] Parquet files of logged responses to train on (logged_share of each step; null: generate).",
        see="data.md#logged-responses",
    )
    logged_share: float = F(
        1.0,
        "[klppo] The share of each step's prompt groups read from logged_files, the rest generated (1: logs "
        "only; 0: generate all).",
        see="data.md#mixed-runs",
    )
    logged_overlong: str = F(
        "error",
        "[klppo] A logged response longer than max_response_length: error | drop (its group).",
        see="data.md#checks",
    )


@dataclass(frozen=True)
class CriticModelConfig:
    path: str = F(II("actor_rollout_ref.model.path"), "Critic backbone (default: the actor's model).")
    tokenizer_path: str = F(
        SEL("actor_rollout_ref.model.path", '"~/models/deepseek-llm-7b-chat"'), "Tokenizer."
    )
    override_config: dict[str, Any] = F({}, "Keys overriding the model's config.json.")
    external_lib: str | None = F(SEL("actor_rollout_ref.model.external_lib", "null"), "Follows the actor's.")
    trust_remote_code: bool = F(SEL("actor_rollout_ref.model.trust_remote_code", "false"), "Follows actor's.")
    use_shm: bool = F(False, "Copy the model to shared memory.")
    enable_gradient_checkpointing: bool = F(True, "Recompute activations in backward.")
    enable_activation_offload: bool = F(False, "Offload activations to CPU.")
    use_remove_padding: bool = F(False, "Pack sequences without padding (alias: data.use_sequence_packing).")
    compile_packed_layers: bool = F(
        False,
        "[klppo] torch.compile the critic's decoder layers for packed forwards (values and update); needs "
        "use_remove_padding, not with Ulysses.",
        see=COMPILED_PASSES,
    )
    fsdp_config: FSDPConfig = F(FSDPConfig, "FSDP2 sharding of the critic.", see="sharding.md")
    lora_rank: int = F(0, "LoRA rank; 0 = full fine-tuning.")
    lora_alpha: int = F(16, "LoRA alpha.")
    target_modules: Any = F("all-linear", "LoRA target modules.")
    tiled_mlp: TiledMLPConfig = F(TiledMLPConfig, "Compute the MLP in sequence tiles (memory).")


def _critic_optim() -> OptimConfig:
    return OptimConfig(lr=1e-5)


@dataclass(frozen=True)
class CriticConfig:
    rollout_n: int = F(SEL("actor_rollout_ref.rollout.n", "1"), "Follows rollout.n (read-only copy).")
    strategy: str = F("fsdp2", "Training backend (fsdp is read as fsdp2; megatron is translated to FSDP2).")
    enable: bool | None = F(
        None,
        "Use a critic; klppo builds one exactly when adv_estimator=gae (false with gae is refused, true "
        "without it has no effect).",
        see=ESTIMATORS,
    )
    optim: OptimConfig = F(None, "Optimizer (lr 1e-5).", factory=_critic_optim)
    model: CriticModelConfig = F(CriticModelConfig, "Value model.")
    ppo_mini_batch_size: int = F(
        SEL("actor_rollout_ref.actor.ppo_mini_batch_size", "256"), "PROMPTS per critic optimizer step."
    )
    ppo_micro_batch_size: int | None = F(None, "Deprecated: SAMPLES per micro-batch over all GPUs.")
    ppo_micro_batch_size_per_gpu: int | None = F(
        SEL(".ppo_micro_batch_size", "null"), "SAMPLES per GPU pass."
    )
    use_dynamic_bsz: bool = F(SEL("actor_rollout_ref.actor.use_dynamic_bsz", "false"), "Follows actor.")
    ppo_max_token_len_per_gpu: int = F(32768, "Token budget of one critic micro-batch on one GPU.")
    forward_max_token_len_per_gpu: int = F(
        II(".ppo_max_token_len_per_gpu"), "Token budget for value forward."
    )
    ppo_epochs: int = F(SEL("actor_rollout_ref.actor.ppo_epochs", "1"), "Follows actor.")
    shuffle: bool = F(SEL("actor_rollout_ref.actor.shuffle", "false"), "Follows actor.")
    data_loader_seed: int = F(42, "Shuffle seed.")
    cliprange_value: float = F(0.5, "Value clip range.", see="algorithms.md#value-loss-criticcliprange_value")
    loss_agg_mode: str = F(SEL("actor_rollout_ref.actor.loss_agg_mode", "token-mean"), "Follows actor.")
    checkpoint: CheckpointConfig = F(CheckpointConfig, "Checkpoint contents.")
    profiler: ProfilerConfig = F(ProfilerConfig, "Per-role profiler.")
    forward_micro_batch_size: int | None = F(SEL(".ppo_micro_batch_size", "null"), "Deprecated global size.")
    forward_micro_batch_size_per_gpu: int | None = F(
        SEL(".ppo_micro_batch_size_per_gpu", "null"), "SAMPLES per value forward on one GPU."
    )
    ulysses_sequence_parallel_size: int = F(1, "Ulysses sequence-parallel group size.", see=ULYSSES)
    grad_clip: float = F(1.0, "Gradient-norm clip.")


@dataclass(frozen=True)
class RewardModelModelConfig:
    input_tokenizer: str | None = F(
        II("actor_rollout_ref.model.path"),
        "Tokenizer of the policy's text (verl); klppo decodes with the policy's tokenizer and re-encodes "
        "with "
        "the reward model's own, whatever this says.",
    )
    path: str = F("~/models/FsfairX-LLaMA3-RM-v0.1", "Sequence-classification reward model.")
    external_lib: str | None = F(SEL("actor_rollout_ref.model.external_lib", "null"), "Follows actor's.")
    trust_remote_code: bool = F(False, "Allow the reward model's and its tokenizer's code.")
    override_config: dict[str, Any] = F({}, "Keys overriding the reward model's config.json.")
    use_shm: bool = F(False, "Shared-memory copy.")
    use_remove_padding: bool = F(False, "Pack sequences.")
    use_fused_kernels: bool = F(SEL("actor_rollout_ref.model.use_fused_kernels", "false"), "Follows model.")
    fsdp_config: FSDPConfig = F(
        None,
        "model_dtype: the reward model's weights on GPU (fp32 on CPU); the sharding and offload keys are not "
        "acted on (loaded whole on each rank: a notice says so).",
        factory=lambda: FSDPConfig(model_dtype="bf16"),
    )


@dataclass(frozen=True)
class SandboxFusionConfig:
    url: str | None = F(None, "Code sandbox URL.")
    max_concurrent: int = F(64, "Concurrent requests.")
    memory_limit_mb: int = F(1024, "Sandbox memory.")


@dataclass(frozen=True)
class RewardRolloutConfig:
    name: str | None = F(None, "Engine serving the reward model in verl's reward loop (vllm | sglang).")
    dtype: str = F("bf16", "Serving dtype.")
    gpu_memory_utilization: float = F(0.5, "Serving memory fraction.")
    enforce_eager: bool = F(True, "Serving without CUDA graphs.")
    cudagraph_capture_sizes: list[int] | None = F(None, "Captured batch sizes.")
    free_cache_engine: bool = F(True, "Free the KV cache between steps.")
    data_parallel_size: int = F(1, "Serving data parallelism.")
    expert_parallel_size: int = F(1, "Serving expert parallelism.")
    tensor_model_parallel_size: int = F(2, "Serving tensor parallelism.")
    max_num_batched_tokens: int = F(8192, "Serving prefill budget.")
    max_model_len: int | None = F(None, "Serving context length.")
    max_num_seqs: int = F(1024, "Serving concurrent sequences.")
    load_format: str = F("auto", "Serving weight loading.")
    engine_kwargs: dict[str, Any] = F({}, "Serving engine options.")
    limit_images: int | None = F(None, "Images per prompt.")
    enable_chunked_prefill: bool = F(True, "Chunked prefill.")
    enable_prefix_caching: bool = F(True, "Prefix caching.")
    disable_log_stats: bool = F(True, "Engine statistics off.")
    skip_tokenizer_init: bool = F(False, "Engine skips tokenizer init.")
    prompt_length: int = F(2048, "Serving prompt budget.")
    response_length: int = F(2048, "Serving response budget.")


@dataclass(frozen=True)
class RewardModelConfig:
    enable: bool = F(False, "Score with a reward model instead of rules only.", see=REWARDS)
    enable_resource_pool: bool = F(False, "verl: a separate GPU pool for the reward model.")
    n_gpus_per_node: int = F(8, "GPUs per node of that pool.")
    nnodes: int = F(0, "Nodes of that pool.")
    strategy: str = F("fsdp2", "Backend (fsdp is read as fsdp2; megatron is translated to FSDP2).")
    model: RewardModelModelConfig = F(RewardModelModelConfig, "Reward model.")
    micro_batch_size: int | None = F(
        None,
        "Deprecated: SAMPLES per reward-model forward over all GPUs (divided by the data-parallel size).",
    )
    micro_batch_size_per_gpu: int | None = F(
        None, "SAMPLES per reward-model forward on one GPU (null: 16); not with use_dynamic_bsz."
    )
    max_length: int | None = F(None, "Max tokens scored.")
    use_dynamic_bsz: bool = F(
        II("critic.use_dynamic_bsz"),
        "Follows critic: reward-model forwards in micro-batches of forward_max_token_len_per_gpu tokens "
        "instead of micro_batch_size_per_gpu samples.",
    )
    forward_max_token_len_per_gpu: int = F(II("critic.forward_max_token_len_per_gpu"), "Follows critic.")
    reward_manager: str = F(
        "naive", "How scores are computed over a batch (naive | batch | prime | dapo).", see=REWARDS
    )
    reward_loop_source: str = F("register", "verl reward loop: register | importlib (a user class).")
    reward_loop_module_path: str | None = F(None, "File of a user reward-loop class.")
    reward_loop_class_name: str | None = F(None, "Name of that class.")
    launch_reward_fn_async: bool = F(
        False,
        "Score the responses in worker processes while the log-prob, reference and value passes run; not "
        "with "
        "a reward model.",
        see=REWARDS,
    )
    sandbox_fusion: SandboxFusionConfig = F(SandboxFusionConfig, "Code execution sandbox.")
    profiler: ProfilerConfig = F(ProfilerConfig, "Per-role profiler.")
    ulysses_sequence_parallel_size: int = F(1, "Ulysses group size.")
    use_reward_loop: bool = F(True, "verl: score through the asynchronous reward loop.")
    timeout_s: float = F(
        600.0,
        "[klppo] Seconds a batch's scoring (rule or custom function) may take on a rank before the run stops "
        "(0 = no limit).",
    )
    num_workers: int = F(
        1,
        "With launch_reward_fn_async: scoring processes per rank, each given a contiguous slice of its rows "
        "(1 with reward_manager=batch).",
        see=REWARDS,
    )
    rollout: RewardRolloutConfig = F(RewardRolloutConfig, "verl: serving of the reward model in the loop.")
    reward_kwargs: dict[str, Any] = F(
        {}, "[klppo] Passed to the scorer, e.g. {method: flexible, format_score: 0.1} for GSM8K."
    )


@dataclass(frozen=True)
class CustomRewardFunctionConfig:
    path: str | None = F(
        None, "Python file with a reward function (null: built-in by data_source).", see=REWARDS
    )
    name: str | None = F("compute_score", "Function name in that file (null only when path is null).")


@dataclass(frozen=True)
class KLControlConfig:
    type: str = F(
        "fixed",
        "fixed | adaptive (Ziegler et al. 2019) | pi (PI control of log β; ours).",
        see=KL_CONTROLLERS,
    )
    kl_coef: float = F(0.001, "β of the KL penalty in the reward (initial β when adaptive or pi).")
    horizon: int = F(10000, "Adaptive controller horizon, in samples (all ranks, all n samples of a step).")
    target_kl: float | None = F(
        0.1, "Target of adaptive/pi: batch mean of the per-response token-mean KL (null: none, fixed only)."
    )
    kp: float = F(1.0, "pi: proportional gain on the log error ln(KL/target).")
    ki: float = F(0.2, "pi: integral gain (per step).")
    min_coef: float = F(1e-4, "pi: lower bound of β (also bounds the integral: anti-windup).")
    max_coef: float = F(10.0, "pi: upper bound of β.")
    target_kl_start: float | None = F(
        None, "adaptive/pi: annealed target — the target until anneal_begin (null: target_kl throughout)."
    )
    anneal_begin: int = F(0, "adaptive/pi: controller updates (steps) at target_kl_start before the decay.")
    anneal_steps: int = F(0, "adaptive/pi: steps of geometric decay from target_kl_start to target_kl.")


@dataclass(frozen=True)
class PFPPOConfig:
    reweight_method: str = F("pow", "pow | max_min | max_random.")
    weight_pow: float = F(2.0, "Exponent of pow.")


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    rollout_is: str | None = F(
        None, "Importance weights π_old/π_rollout per token or sequence (null: off).", see=ROLLOUT_CORR
    )
    rollout_is_threshold: float | str = F(
        2.0,
        "A number u truncates the weights at u (TIS); 'l_u' zeroes weights outside [l, u] (IcePop).",
        see=ROLLOUT_CORR,
    )
    rollout_rs: str | None = F(
        None,
        "Rejection of mismatched tokens or rows, e.g. token_k1,seq_mean_k3 (null: off).",
        see=ROLLOUT_CORR,
    )
    rollout_rs_threshold: float | str | None = F(
        None,
        "Rejection bounds: one shared value or one per rollout_rs option, comma-separated.",
        see=ROLLOUT_CORR,
    )
    bypass_mode: bool = F(
        False,
        "Take the rollout's log-probs as π_old (no old-log-prob pass); corrections then per micro-batch.",
        see=ROLLOUT_CORR,
    )
    loss_type: str = F("ppo_clip", "Policy loss in bypass mode: ppo_clip | reinforce.", see=ROLLOUT_CORR)
    rollout_is_batch_normalize: bool = F(
        False, "Divide the importance weights by their batch mean.", see=ROLLOUT_CORR
    )


@dataclass(frozen=True)
class AlgorithmConfig:
    rollout_correction: RolloutCorrectionConfig = F(
        RolloutCorrectionConfig, "Correction of the rollout/training policy mismatch."
    )
    gamma: float = F(1.0, "Discount.")
    lam: float = F(1.0, "GAE λ.")
    adv_estimator: str = F("gae", "gae | grpo | rloo | reinforce_plus_plus | remax | ...", see=ESTIMATORS)
    norm_adv_by_std_in_grpo: bool = F(True, "GRPO divides by the group std (false: Dr.GRPO).")
    use_kl_in_reward: bool = F(
        False,
        "Subtract β·KL from token rewards.",
        see="algorithms.md#kl-penalty-in-the-reward-algorithmuse_kl_in_rewardtrue",
    )
    kl_penalty: str = F("kl", "KL estimator in the reward: kl|abs|mse|low_var_kl|full (k1|k2|k3 accepted).")
    kl_ctrl: KLControlConfig = F(KLControlConfig, "β controller.", see=KL_CONTROLLERS)
    use_pf_ppo: bool = F(False, "Preference-feedback PPO reweighting.")
    pf_ppo: PFPPOConfig = F(PFPPOConfig, "PF-PPO options.")


@dataclass(frozen=True)
class TrainerConfig:
    balance_batch: bool = F(True, "Balance sequence lengths across ranks.")
    total_epochs: int = F(30, "Passes over the training prompts.")
    total_training_steps: int | None = F(None, "Stop after this many steps (null: total_epochs).")
    project_name: str = F("verl_examples", "Tracker project.")
    experiment_name: str = F("gsm8k", "Tracker run name.")
    logger: list[str] = F(
        ["console", "jsonl"],
        "[klppo default] console|jsonl|tensorboard|wandb|mlflow|swanlab ('file' = jsonl).",
    )
    log_val_generations: int = F(0, "Validation samples written per validation.")
    rollout_data_dir: str | None = F(None, "Dump rollouts as JSONL here.")
    validation_data_dir: str | None = F(None, "Dump validation generations here.")
    nnodes: int = F(1, "Nodes.", see="distributed.md")
    n_gpus_per_node: int | str = F(
        "auto", "[klppo default] processes per node: auto (all GPUs; 1 on CPU) or N."
    )
    save_freq: int = F(-1, "Checkpoint every N steps (-1 = only at the end if at all).")
    esi_redundant_time: int = F(0, "Seconds reserved before an expected preemption.")
    resume_mode: str = F("auto", "auto | disable | resume_path.", see="training.md#checkpoints-and-resume")
    resume_from_path: str | None = F(None, "Checkpoint folder when resume_mode=resume_path.")
    run_dir_exists: str = F(
        "refuse",
        "[klppo] A fresh start where an earlier run's checkpoints are: refuse | archive (moved to "
        "archive/NNN/) "
        "| remove.",
    )
    allow_resume_changes: bool = F(
        False,
        "[klppo] Resume even when the model, tokenizer, algorithm or batch geometry differ from the "
        "checkpoint's.",
    )
    val_before_train: bool = F(True, "Validate before the first step.")
    val_only: bool = F(False, "Only validate.")
    test_freq: int = F(-1, "Validate every N steps (-1 = never).")
    critic_warmup: int = F(0, "Steps that train only the critic.")
    default_hdfs_dir: str | None = F(None, "HDFS copy of checkpoints.")
    del_local_ckpt_after_load: bool = F(False, "Delete local checkpoint after loading.")
    default_local_dir: str = F(
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
        "Run directory.",
        see="training.md#the-run-directory-trainerdefault_local_dir",
    )
    max_actor_ckpt_to_keep: int | None = F(None, "Keep at most N actor checkpoints.")
    max_critic_ckpt_to_keep: int | None = F(None, "Keep at most N critic checkpoints.")
    ray_wait_register_center_timeout: int = F(300, "Ray start-up timeout.")
    device: str = F("auto", "[klppo default] auto (cuda if present, else cpu) | cuda | cpu.")
    use_legacy_worker_impl: str = F("auto", "verl worker implementation switch.")
    seed: int = F(1, "[klppo] Seed of model init (value head), sampling and data order (with data.seed).")
    max_nan_steps: int = F(
        3, "[klppo] Steps skipped for a NaN/inf (reward, KL, loss, ...) before the run stops."
    )
    collective_timeout_s: int = F(
        1800,
        "[klppo] Seconds a collective may wait before the run fails.",
        see="distributed.md#failures-and-timeouts",
    )
    gpu_memory_gib: float = F(
        80.0,
        "[klppo] GiB per GPU that a Megatron launch's memory check assumes when no GPU is visible (a visible "
        "GPU's own size is used).",
        see="verl_compat.md#megatron-launches",
    )
    stop_grace_s: int = F(
        600,
        "[klppo] After SIGTERM/SIGINT to `klppo train`, seconds its ranks get to finish the step and save.",
    )
    advise: bool = F(
        True, "[klppo] Print advice on settings this run could gain from (the quickstart's recipes: off)."
    )


@dataclass(frozen=True)
class GlobalProfilerConfig:
    tool: str | None = F(None, "nsys | torch | torch_memory | npu.")
    steps: list[int] | None = F(None, "Steps to profile.")
    profile_continuous_steps: bool = F(False, "Merge consecutive steps into one profile.")
    save_path: str = F("outputs/profile", "Profile directory.")
    global_tool_config: dict[str, Any] = F({}, "Tool options (nsys, torch_memory, ...).")


@dataclass(frozen=True)
class RayInitConfig:
    num_cpus: int | None = F(None, "Ray CPUs.")


@dataclass(frozen=True)
class RayKwargsConfig:
    ray_init: RayInitConfig = F(RayInitConfig, "ray.init arguments.")
    timeline_json_file: str | None = F(None, "Ray timeline output.")


@dataclass(frozen=True)
class ModuleRefConfig:
    path: str | None = F(None, "Python file.")
    name: str = F("custom_reward_manager", "Class name in that file.")


@dataclass(frozen=True)
class RewardManagerConfig:
    source: str = F("register", "register (by name) | importlib (a user class from module.path).")
    name: str = F(
        SEL("reward_model.reward_manager", "naive"), "Reward manager (sets reward_model.reward_manager)."
    )
    module: ModuleRefConfig = F(ModuleRefConfig, "User reward-manager class.")


@dataclass(frozen=True)
class TransferQueueConfig:
    enable: bool = F(False, "verl's TransferQueue data plane between workers.")


@dataclass(frozen=True)
class KLPPOConfig:
    data: DataConfig = F(DataConfig, "Prompts.")
    actor_rollout_ref: ActorRolloutRefConfig = F(ActorRolloutRefConfig, "Policy, reference, rollout.")
    critic: CriticConfig = F(CriticConfig, "Value model.")
    reward_model: RewardModelConfig = F(RewardModelConfig, "Reward model and scorer options.")
    reward_manager: RewardManagerConfig = F(RewardManagerConfig, "verl's newer reward-manager group.")
    custom_reward_function: CustomRewardFunctionConfig = F(
        CustomRewardFunctionConfig, "User reward function."
    )
    algorithm: AlgorithmConfig = F(AlgorithmConfig, "Advantages and KL.")
    trainer: TrainerConfig = F(TrainerConfig, "Loop, logging, checkpoints, devices.")
    global_profiler: GlobalProfilerConfig = F(
        GlobalProfilerConfig, "Profiling.", see="training.md#profiling-global_profiler"
    )
    monitor: MonitorConfig = F(
        MonitorConfig, "[klppo] Operating rules that act on each step's metrics.", see=OPERATING_RULES
    )
    ray_kwargs: RayKwargsConfig = F(RayKwargsConfig, "verl's Ray options (no effect: klppo uses torchrun).")
    transfer_queue: TransferQueueConfig = F(TransferQueueConfig, "verl's data plane (no effect here).")
