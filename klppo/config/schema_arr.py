"""Schema of `actor_rollout_ref`: the policy model, its trainer (actor), the frozen reference, the rollout.

Units (verl's, the most common source of confusion): `ppo_mini_batch_size` counts PROMPTS (each update
uses ppo_mini_batch_size × rollout.n samples); every `*micro_batch_size_per_gpu` counts SAMPLES on one
GPU; token budgets (`*_max_token_len_per_gpu`) count prompt + response tokens on one GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from klppo.config._field import II, SEL, F
from klppo.config.schema_common import CheckpointConfig, FSDPConfig, OptimConfig, ProfilerConfig

COMPILED_PASSES = "training.md#compiled-passes-use_torch_compile-compile_packed_layers"
KL_LOSS = "algorithms.md#kl-loss-actoruse_kl_loss-actorkl_loss_type-actorkl_loss_coef"
KL_CONTROLLERS = "algorithms.md#kl-coefficient-controllers-algorithmkl_ctrl"
ROLLOUT_SETTINGS = "rollout.md#"
ULYSSES = "sharding.md#ulysses-sequence-parallelism-ulysses_sequence_parallel_size"
MULTI_TURN = "multi_turn.md#the-keys"


@dataclass(frozen=True)
class TiledMLPConfig:
    enabled: bool = F(False, "Tile the MLP over the sequence.")
    num_shards: int = F(4, "Tiles.")


@dataclass(frozen=True)
class MtpConfig:
    enable: bool = F(False, "Load the model's multi-token-prediction layers.")
    enable_train: bool = F(False, "Train them (adds their loss).")
    enable_rollout: bool = F(False, "Use them for speculative decoding.")
    detach_encoder: bool = F(False, "Stop gradients from the MTP loss into the trunk.")
    mtp_loss_scaling_factor: float = F(0.1, "Weight of the MTP loss.")
    speculative_algorithm: str = F("EAGLE", "Speculative decoding algorithm.")
    speculative_num_steps: int = F(2, "Draft steps.")
    speculative_eagle_topk: int = F(2, "EAGLE top-k.")
    speculative_num_draft_tokens: int = F(4, "Draft tokens.")
    method: str = F("mtp", "Draft method.")
    num_speculative_tokens: int = F(1, "Speculative tokens.")


@dataclass(frozen=True)
class RouterReplayConfig:
    mode: str = F("disabled", "MoE routing replay: disabled | R2 | R3 (record or replay expert choices).")
    record_file: str | None = F(None, "Where recorded routing decisions go.")
    replay_file: str | None = F(None, "Routing decisions to replay.")


@dataclass(frozen=True)
class ModelConfig:
    path: str = F(
        "~/models/deepseek-llm-7b-chat", "Hugging Face directory (or hub id in the local cache, or .gguf)."
    )
    tokenizer_path: str | None = F(None, "Tokenizer directory (null: the model's).")
    custom_chat_template: str | None = F(None, "Jinja chat template replacing the tokenizer's.")
    use_shm: bool = F(False, "Copy the model to shared memory before loading.")
    external_lib: str | None = F(None, "Python module imported before loading (registers custom models).")
    override_config: dict[str, Any] = F({}, "Keys overriding the model's config.json.")
    enable_gradient_checkpointing: bool = F(True, "Recompute activations in backward to save memory.")
    enable_activation_offload: bool = F(False, "Offload activations to CPU.")
    use_remove_padding: bool = F(True, "Pack sequences without padding (alias: data.use_sequence_packing).")
    lora_rank: int = F(0, "LoRA rank; 0 = full fine-tuning.", see="training.md#lora")
    lora_alpha: int = F(16, "LoRA alpha.")
    target_modules: Any = F("all-linear", "LoRA target modules (name or list).")
    exclude_modules: Any = F(None, "LoRA modules left out.")
    lora_adapter_path: str | None = F(None, "Pretrained LoRA adapter to start from.")
    use_liger: bool = F(False, "Liger kernels.")
    use_fused_kernels: bool = F(
        False,
        "Log-prob and entropy from the LM head in chunks of rows (no float32 [tokens, vocab] logits); "
        "actor and reference.",
    )
    fused_kernel_options: dict[str, Any] = F({"impl_backend": "torch"}, "Options of the fused kernels.")
    compile_packed_layers: bool = F(
        False,
        "[klppo] torch.compile the decoder layers for the actor's and reference's packed forwards, with "
        "dynamic "
        "token dims; needs use_remove_padding, not with Ulysses.",
        see=COMPILED_PASSES,
    )
    trust_remote_code: bool = F(False, "Allow model code from the model directory.")
    hf_config_path: str | None = F(
        None, "A config.json directory other than the model's (null: the model's)."
    )
    tiled_mlp: TiledMLPConfig = F(TiledMLPConfig, "Compute the MLP in sequence tiles (memory).")
    mtp: MtpConfig = F(MtpConfig, "Multi-token prediction heads (training and speculative decoding).")


@dataclass(frozen=True)
class PolicyLossConfig:
    loss_mode: str = F(
        "vanilla", "vanilla (clipped PPO, dual-clip) | gspo | clip_cov | kl_cov | gpg | geo_mean"
    )
    clip_cov_ratio: float = F(0.0002, "clip_cov: fraction of tokens clipped.")
    clip_cov_lb: float = F(1.0, "clip_cov: lower bound.")
    clip_cov_ub: float = F(5.0, "clip_cov: upper bound.")
    kl_cov_ratio: float = F(0.0002, "kl-cov: fraction of tokens penalized.")
    ppo_kl_coef: float = F(0.1, "kl-cov: coefficient.")


@dataclass(frozen=True)
class KLLossControlConfig:
    type: str = F("fixed", "fixed | adaptive (verl's rule) | pi: controller of kl_loss_coef (initial β).")
    target_kl: float = F(
        0.05, "Target of adaptive/pi: token mean over the batch of kl_loss_type(π_old‖π_ref)."
    )
    horizon: int = F(10000, "adaptive: horizon in samples (all ranks, all n samples of a step).")
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
class ActorConfig:
    strategy: str = F(
        "fsdp2",
        "Training backend: fsdp2 (fsdp is read as fsdp2); megatron runs the launch on FSDP2, translating its "
        "megatron.* keys.",
        see="verl_compat.md#megatron-launches",
    )
    ppo_mini_batch_size: int = F(256, "PROMPTS per optimizer step (× rollout.n samples), over all GPUs.")
    ppo_micro_batch_size: int | None = F(None, "Deprecated: SAMPLES per micro-batch over all GPUs.")
    ppo_micro_batch_size_per_gpu: int | None = F(None, "SAMPLES per forward/backward on one GPU.")
    use_dynamic_bsz: bool = F(False, "Form micro-batches by token budget instead of sample count.")
    ppo_max_token_len_per_gpu: int = F(16384, "Token budget of one micro-batch on one GPU (use_dynamic_bsz).")
    clip_ratio: float = F(
        0.2,
        "PPO clip range ε.",
        see="algorithms.md#policy-loss-actorclip_ratio-clip_ratio_low-clip_ratio_high-clip_ratio_c",
    )
    clip_ratio_low: float = F(0.2, "Lower clip range (1 − ε_low).")
    clip_ratio_high: float = F(0.2, "Upper clip range (1 + ε_high).")
    tau_pos: float = F(1.0, "SAPO soft-gate temperature for positive advantages.")
    tau_neg: float = F(1.05, "SAPO soft-gate temperature for negative advantages.")
    freeze_vision_tower: bool = F(False, "Vision-language models: keep the vision encoder frozen.")
    policy_loss: PolicyLossConfig = F(
        PolicyLossConfig,
        "Policy-loss variant.",
        see="algorithms.md#policy-loss-variants-actorpolicy_lossloss_mode",
    )
    clip_ratio_c: float = F(3.0, "Dual-clip constant c for negative advantages.")
    loss_agg_mode: str = F(
        "token-mean",
        "token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm.",
        see="algorithms.md#aggregation-actor_rollout_refactorloss_agg_mode-criticloss_agg_mode",
    )
    loss_scale_factor: float | None = F(None, "Constant divisor for seq-mean-token-sum-norm.")
    entropy_coeff: float = F(
        0.0, "Entropy bonus coefficient.", see="algorithms.md#entropy-actorentropy_coeff"
    )
    calculate_entropy: bool = F(False, "Compute entropy even when entropy_coeff is 0.")
    use_kl_loss: bool = F(False, "Add β·KL(π‖π_ref) to the policy loss (GRPO style).", see=KL_LOSS)
    use_prefix_grouper: bool = F(
        False, "Forward a prompt once for all its responses (shared-prefix attention)."
    )
    use_torch_compile: bool = F(
        True,
        "torch.compile the LM head's log-prob and entropy statistics on CUDA (actor; the reference follows "
        "it).",
        see=COMPILED_PASSES,
    )
    kl_loss_coef: float = F(0.001, "β of the KL loss (the initial β when kl_loss_ctrl.type is not fixed).")
    kl_loss_ctrl: KLLossControlConfig = F(
        KLLossControlConfig, "Controller of the KL loss coefficient.", see=KL_CONTROLLERS
    )
    kl_loss_type: str = F(
        "low_var_kl", "KL estimator: kl|abs|mse|low_var_kl|full (k1|k2|k3 accepted), '+' suffix.", see=KL_LOSS
    )
    ppo_epochs: int = F(1, "Passes over each step's samples.")
    skip_old_log_prob_on_policy: bool = F(
        True,
        "[klppo] One epoch over one mini-batch (on-policy): no old-log-prob pass, π_old = the update's own "
        "log-probs, detached (ratio 1); not with algorithm.use_kl_in_reward.",
    )
    skip_zero_advantage_rows: bool = F(
        False,
        "[klppo] Leave out of the actor update the samples whose advantage is 0 at every token (grpo/rloo "
        "equal-score groups), which carry no policy gradient; not with a critic.",
        see="training.md#samples-without-advantage-skip_zero_advantage_rows",
    )
    shuffle: bool = F(False, "Shuffle samples between epochs.")
    data_loader_seed: int = F(42, "Seed of that shuffle.")
    checkpoint: CheckpointConfig = F(CheckpointConfig, "Checkpoint contents.")
    optim: OptimConfig = F(OptimConfig, "Optimizer and LR schedule.")
    use_fused_kernels: bool = F(SEL("actor_rollout_ref.model.use_fused_kernels", "false"), "Follows model.")
    profiler: ProfilerConfig = F(ProfilerConfig, "Per-role profiler.")
    router_replay: RouterReplayConfig = F(RouterReplayConfig, "MoE routing replay.")
    grad_clip: float = F(1.0, "Gradient-norm clip (over all shards).")
    ulysses_sequence_parallel_size: int = F(1, "Ulysses sequence-parallel group size.", see=ULYSSES)
    entropy_from_logits_with_chunking: bool = F(False, "Compute entropy in chunks.")
    entropy_checkpointing: bool = F(False, "Recompute entropy in backward.")
    fsdp_config: FSDPConfig = F(FSDPConfig, "FSDP2 sharding of the actor.", see="sharding.md")
    use_remove_padding: bool = F(SEL("actor_rollout_ref.model.use_remove_padding", "false"), "Follows model.")
    rollout_n: int = F(SEL("actor_rollout_ref.rollout.n", "1"), "Follows rollout.n (read-only copy).")
    calculate_sum_pi_squared: bool = F(False, "Compute Σπ² per token (optimal-token-baseline statistics).")
    sum_pi_squared_checkpointing: bool = F(False, "Recompute Σπ² in backward.")


def _ref_fsdp() -> FSDPConfig:
    return FSDPConfig(model_dtype="bf16", forward_only=True)


@dataclass(frozen=True)
class RefConfig:
    strategy: str = F(II("actor_rollout_ref.actor.strategy"), "Follows actor.strategy.")
    use_torch_compile: bool = F(
        SEL("actor_rollout_ref.actor.use_torch_compile", "true"),
        "Follows actor: the reference's log-prob statistics compiled on CUDA (with LoRA the reference is "
        "the actor's model and follows actor.use_torch_compile).",
    )
    log_prob_micro_batch_size: int | None = F(None, "Deprecated: SAMPLES per micro-batch over all GPUs.")
    log_prob_micro_batch_size_per_gpu: int | None = F(None, "SAMPLES per reference forward on one GPU.")
    log_prob_use_dynamic_bsz: bool = F(
        SEL("actor_rollout_ref.actor.use_dynamic_bsz", "false"), "Follows actor."
    )
    log_prob_max_token_len_per_gpu: int = F(
        SEL("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "16384"), "Follows actor's token budget."
    )
    profiler: ProfilerConfig = F(ProfilerConfig, "Per-role profiler.")
    router_replay: RouterReplayConfig = F(RouterReplayConfig, "MoE routing replay.")
    model: dict[str, Any] | None = F(None, "A different reference model (null: the actor's initial weights).")
    fsdp_config: FSDPConfig = F(
        None, "FSDP2 sharding of the reference (weights bf16 by default).", factory=_ref_fsdp
    )
    ulysses_sequence_parallel_size: int = F(
        SEL("actor_rollout_ref.actor.ulysses_sequence_parallel_size", "1"), "Follows actor."
    )
    entropy_from_logits_with_chunking: bool = F(False, "Compute entropy in chunks.")
    entropy_checkpointing: bool = F(False, "Recompute entropy in backward.")
    rollout_n: int = F(SEL("actor_rollout_ref.rollout.n", "1"), "Follows rollout.n (read-only copy).")


@dataclass(frozen=True)
class ValKwargsConfig:
    top_k: int = F(-1, "Validation top-k (-1 = off).")
    top_p: float = F(1.0, "Validation nucleus p.")
    temperature: float = F(0.0, "Validation temperature (0 = greedy).")
    n: int = F(1, "Samples per validation prompt.")
    do_sample: bool = F(False, "Sample during validation (false = greedy).")


@dataclass(frozen=True)
class MultiTurnConfig:
    enable: bool = F(
        False, "Conversations with tools or a simulated user instead of one response.", see=MULTI_TURN
    )
    max_assistant_turns: int | None = F(
        None, "Model turns per conversation (null: until the response budget).", see=MULTI_TURN
    )
    tool_config_path: str | None = F(
        None, "YAML file of the tools (class_name, config, tool_schema).", see=MULTI_TURN
    )
    max_user_turns: int | None = F(
        None, "Tool or user turns per conversation (null: until the response budget).", see=MULTI_TURN
    )
    max_parallel_calls: int = F(
        1, "Tool calls run per model turn; later calls of the turn are ignored.", see=MULTI_TURN
    )
    max_tool_response_length: int = F(
        256, "Characters of a tool's answer kept (cut with a marker).", see=MULTI_TURN
    )
    tool_response_truncate_side: str = F(
        "middle", "left keeps the start of a long answer, right its end, middle both.", see=MULTI_TURN
    )
    interaction_config_path: str | None = F(
        None, "YAML file of the interactions (name, class_name, config).", see=MULTI_TURN
    )
    use_inference_chat_template: bool = F(
        False, "Re-render history with the template (klppo keeps sampled ids: false).", see=MULTI_TURN
    )
    tokenization_sanity_check_mode: str = F(
        "strict", "verl's re-tokenization check; klppo never re-tokenizes.", see=MULTI_TURN
    )
    format: str = F(
        "hermes", "Tool-call format of the model: hermes (<tool_call>{json}</tool_call>).", see=MULTI_TURN
    )
    num_repeat_rollouts: int | None = F(None, "Repeated rollouts per interaction.", see=MULTI_TURN)
    tool_timeout_s: float = F(
        60.0, "Seconds one tool or interaction method may take before it answers an error.", see=MULTI_TURN
    )


@dataclass(frozen=True)
class CustomAsyncServerConfig:
    path: str | None = F(None, "Server module path.")
    name: str | None = F(None, "Server class name.")


@dataclass(frozen=True)
class AgentConfig:
    num_workers: int = F(8, "Agent-loop workers.")
    default_agent_loop: str = F("single_turn_agent", "Agent loop name.")
    agent_loop_config_path: str | None = F(None, "Agent loop definitions.")
    custom_async_server: CustomAsyncServerConfig = F(CustomAsyncServerConfig, "Custom server.")


@dataclass(frozen=True)
class TraceConfig:
    backend: str | None = F(None, "Trace backend (weave | mlflow).")
    token2text: bool = F(False, "Decode tokens in traces.")
    max_samples_per_step_per_worker: int | None = F(None, "Trace sampling.")


@dataclass(frozen=True)
class CheckpointEngineConfig:
    backend: str = F("naive", "How weights reach the rollout engine.")
    update_weights_bucket_megabytes: int = F(2048, "Transfer bucket size.")
    engine_kwargs: dict[str, Any] = F({}, "Backend options.")


@dataclass(frozen=True)
class PrometheusConfig:
    enable: bool = F(False, "Export rollout-server metrics to Prometheus.")
    port: int = F(9090, "Prometheus port.")
    file: str = F("/tmp/ray/session_latest/metrics/prometheus/prometheus.yml", "Prometheus config file.")
    served_model_name: str | None = F(None, "Model name in metrics (verl: the model path).")


@dataclass(frozen=True)
class RolloutConfig:
    name: str = F(
        "klppo", "Generation engine: klppo (ours) | hf (transformers generate); vllm|sglang|trtllm → klppo."
    )
    mode: str = F("async", "sync | async (verl's server mode); klppo generates in-process.")
    temperature: float = F(1.0, "Sampling temperature.")
    top_k: int = F(-1, "Top-k (-1 = off).")
    top_p: float = F(1.0, "Nucleus p.")
    prompt_length: int = F(SEL("data.max_prompt_length", "512"), "Follows data.max_prompt_length.")
    response_length: int = F(SEL("data.max_response_length", "512"), "Follows data.max_response_length.")
    dtype: str = F("bf16", "Generation dtype on GPU.")
    gpu_memory_utilization: float = F(0.5, "Fraction of GPU memory the engine may fill (weights + KV cache).")
    ignore_eos: bool = F(False, "Keep generating after EOS.")
    enforce_eager: bool = F(
        False, "Run the klppo engine's decode step eagerly (no torch.compile / CUDA graphs)."
    )
    cudagraph_capture_sizes: list[int] | None = F(None, "Batch sizes captured as CUDA graphs.")
    sampler: str = F(
        "auto",
        "[klppo] How the klppo engine samples: auto (the Triton kernels on a CUDA GPU for the settings they "
        "take, else torch) | torch (the reference sampler everywhere).",
        see=ROLLOUT_SETTINGS + "sampler-sampler",
    )
    decode_attention: str = F(
        "auto",
        "[klppo] The klppo engine's decode: auto (Triton split-KV attention and layer kernels on a CUDA GPU "
        "in bf16/fp16, masked SDPA elsewhere) | sdpa (the torch reference everywhere).",
        see=ROLLOUT_SETTINGS + "decode-attention-decode_attention",
    )
    layer_kernels: str = F(
        "auto",
        "[klppo] auto (the only value): the decode layers' elementwise work runs on Triton kernels with the "
        "Triton attention, on torch elsewhere.",
        see=ROLLOUT_SETTINGS + "decode-layer-kernels-layer_kernels",
    )
    compact_slots: bool | str = F(
        "auto",
        "[klppo] Move busy slots into a smaller decode batch once no sequence waits: auto (on, except with a "
        "tensor-parallel rollout) | true | false.",
        see=ROLLOUT_SETTINGS + "slot-compaction-compact_slots",
    )
    free_cache_engine: bool = F(
        True,
        "Free the KV cache after each rollout (false: the klppo engine keeps cache, graphs and a weight copy "
        "for the next rollout of the same shape).",
        see=ROLLOUT_SETTINGS + "keeping-the-engine-between-rollouts-free_cache_engine",
    )
    tensor_model_parallel_size: int = F(
        1,
        "[klppo default; verl 2] Rollout tensor parallelism: groups of this many ranks generate on "
        "tensor-parallel slices resharded from the FSDP2 shards (must divide the world size).",
        see="rollout.md#tensor-parallel-rollout-klpporollouttppy-klppoparallelreshardpy",
    )
    data_parallel_size: int = F(1, "Rollout data parallelism (engine side).")
    expert_parallel_size: int = F(1, "Rollout expert parallelism.")
    pipeline_model_parallel_size: int = F(1, "Rollout pipeline parallelism.")
    max_num_batched_tokens: int = F(8192, "Engine prefill token budget.")
    max_model_len: int | None = F(None, "Engine context length (null: prompt + response).")
    max_num_seqs: int = F(1024, "Engine concurrent sequences.")
    enable_chunked_prefill: bool = F(True, "Chunked prefill.")
    enable_prefix_caching: bool = F(True, "Prefix caching.")
    load_format: str = F("dummy", "Engine weight loading.")
    log_prob_micro_batch_size: int | None = F(None, "Deprecated: SAMPLES per micro-batch over all GPUs.")
    log_prob_micro_batch_size_per_gpu: int | None = F(None, "SAMPLES per old-log-prob forward on one GPU.")
    log_prob_use_dynamic_bsz: bool = F(
        SEL("actor_rollout_ref.actor.use_dynamic_bsz", "false"), "Follows actor."
    )
    log_prob_max_token_len_per_gpu: int = F(
        SEL("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "16384"), "Follows actor's token budget."
    )
    disable_log_stats: bool = F(True, "Engine statistics logging off.")
    do_sample: bool = F(True, "Sample (false = greedy).")
    n: int = F(1, "Responses per prompt.")
    over_sample_rate: float = F(0.0, "verl: abort the rest once (1 - rate) of requests are done; unused.")
    multi_stage_wake_up: bool = F(False, "Load weights before KV cache on wake-up.")
    engine_kwargs: dict[str, Any] = F({"vllm": {}, "sglang": {}}, "Engine-specific options.")
    val_kwargs: ValKwargsConfig = F(ValKwargsConfig, "Sampling during validation.")
    multi_turn: MultiTurnConfig = F(MultiTurnConfig, "Multi-turn rollout.")
    calculate_log_probs: bool = F(False, "Return the engine's sampling log-probs.")
    agent: AgentConfig = F(AgentConfig, "Agent loop.")
    update_weights_bucket_megabytes: int = F(512, "Weight sync bucket size.")
    trace: TraceConfig = F(TraceConfig, "Rollout tracing.")
    skip_rollout: bool = F(False, "Load dumped rollouts instead of generating.")
    skip_dump_dir: str = F("/tmp/rollout_dump", "Where dumped rollouts live.")
    skip_tokenizer_init: bool = F(True, "Engine skips tokenizer init.")
    checkpoint_engine: CheckpointEngineConfig = F(CheckpointEngineConfig, "Weight transfer to the engine.")
    enable_rollout_routing_replay: bool = F(False, "Record MoE routing during rollout for replay.")
    prometheus: PrometheusConfig = F(PrometheusConfig, "Rollout-server metrics.")
    profiler: ProfilerConfig = F(ProfilerConfig, "Per-role profiler.")
    layered_summon: bool = F(False, "Gather weights layer by layer for the engine.")
    logprobs_mode: str = F("processed_logprobs", "The sampled (tempered, truncated) law's log-probs.")
    scheduling_policy: str = F("fcfs", "Engine scheduling.")
    quantization: str | None = F(None, "Engine weight quantization.")
    quantization_config_file: str | None = F(None, "Engine quantization settings file.")
    mtp: dict[str, Any] | None = F(
        SEL("actor_rollout_ref.model.mtp", "null"), "Speculative decoding with MTP heads (follows model.mtp)."
    )


@dataclass(frozen=True)
class ActorRolloutRefConfig:
    hybrid_engine: bool = F(True, "Actor and rollout share weights (klppo: always).")
    nccl_timeout: int = F(600, "verl's NCCL timeout in seconds; klppo uses trainer.collective_timeout_s.")
    model: ModelConfig = F(ModelConfig, "The policy model.")
    actor: ActorConfig = F(ActorConfig, "Policy training.")
    ref: RefConfig = F(RefConfig, "Frozen reference policy.")
    rollout: RolloutConfig = F(RolloutConfig, "Generation.", see="rollout.md")
