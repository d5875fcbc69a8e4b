"""The ONE table of verl keys that klppo accepts but does not (yet) act on, and what happens if set.

Each entry is a key pattern (`*` matches any part, e.g. `*.fsdp_config.use_orig_params`), an effect and a
reason. Effects, applied when the value differs from klppo's default:
  - `warn`:   accepted, no effect yet — `warn_unimplemented` prints one line at start;
  - `refuse`: would change results — `check_trainable` raises ConfigError (klppo config still accepts it);
  - `notice`: changes only speed or memory — `check_trainable` runs with a one-line notice.
`docs/configuration.md` prints this table; keys not listed here are implemented. When a feature lands,
delete its row."""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable

from klppo.algorithms import rollout_correction as rc
from klppo.config._walk import all_keys
from klppo.config.checks import (
    IMPLEMENTED_ADV_ESTIMATORS,
    IMPLEMENTED_POLICY_LOSS_MODES,
    IMPLEMENTED_REWARD_MANAGERS,
    value_at,
)
from klppo.config.errors import ConfigError, notice
from klppo.config.loader import load_config
from klppo.config.schema import KLPPOConfig
from klppo.config.sizes import uses_critic

Notify = Callable[[str], None]
_ROLES = ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic", "reward_model")

UNIMPLEMENTED: tuple[tuple[str, str, str], ...] = (
    # changes results: refused by `klppo train`
    (
        "reward_model.ulysses_sequence_parallel_size",
        "refuse",
        "the reward model runs without sequence parallelism",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.use_inference_chat_template",
        "refuse",
        "multi-turn rollouts keep the sampled token ids (verl's false)",
    ),
    (
        "actor_rollout_ref.rollout.multi_turn.num_repeat_rollouts",
        "refuse",
        "repeated interaction rollouts are not built",
    ),
    ("actor_rollout_ref.rollout.multi_turn.format", "refuse", "only the hermes tool-call format is parsed"),
    (
        "actor_rollout_ref.rollout.skip_rollout",
        "refuse",
        "verl's cache of this trainer's own rollouts is not "
        "built; to train on logged responses set data.logged_files (docs/data.md)",
    ),
    ("actor_rollout_ref.rollout.quantization", "refuse", "quantized rollout is not built"),
    (
        "actor_rollout_ref.rollout.logprobs_mode",
        "refuse",
        "the engine reports the log-probs of the distribution it sampled from (processed_logprobs)",
    ),
    ("algorithm.use_pf_ppo", "refuse", "PF-PPO reweighting is not built"),
    ("data.tokenizer", "refuse", "the dataset always uses the model's tokenizer"),
    ("data.custom_cls.*", "refuse", "custom dataset classes are not supported"),
    ("data.sampler.*", "refuse", "custom samplers are not supported"),
    ("data.datagen.*", "refuse", "dynamic data generation is not supported"),
    ("actor_rollout_ref.actor.tau_pos", "refuse", "SAPO's soft-gate loss is not built"),
    ("actor_rollout_ref.actor.tau_neg", "refuse", "SAPO's soft-gate loss is not built"),
    (
        "actor_rollout_ref.actor.use_prefix_grouper",
        "refuse",
        "prefix-grouped forward is not built (it changes the log-prob computation)",
    ),
    (
        "actor_rollout_ref.actor.calculate_sum_pi_squared",
        "refuse",
        "Σπ² statistics (optimal-token baseline) are not built",
    ),
    ("*.router_replay.*", "refuse", "MoE routing replay is not built"),
    ("actor_rollout_ref.rollout.enable_rollout_routing_replay", "refuse", "MoE routing replay is not built"),
    ("actor_rollout_ref.rollout.mtp", "refuse", "speculative decoding with MTP heads is not built"),
    ("actor_rollout_ref.model.mtp.*", "refuse", "multi-token-prediction heads are not built"),
    ("actor_rollout_ref.rollout.quantization_config_file", "refuse", "quantized rollout is not built"),
    (
        "actor_rollout_ref.model.hf_config_path",
        "refuse",
        "a config directory other than the model's is not supported (its own config.json is read)",
    ),
    ("actor_rollout_ref.actor.freeze_vision_tower", "refuse", "vision-language models are not built"),
    ("reward_manager.source", "refuse", "user reward-manager classes are not supported"),
    ("reward_manager.module.*", "refuse", "user reward-manager classes are not supported"),
    ("reward_model.reward_loop_source", "refuse", "user reward-loop classes are not supported"),
    ("reward_model.reward_loop_module_path", "refuse", "user reward-loop classes are not supported"),
    ("reward_model.reward_loop_class_name", "refuse", "user reward-loop classes are not supported"),
    ("reward_model.sandbox_fusion.url", "refuse", "scoring code in an execution sandbox is not built"),
    (
        "actor_rollout_ref.rollout.agent.default_agent_loop",
        "refuse",
        "choosing the agent loop is not supported: multi_turn.enable runs the tool loop, agent_name picks "
        "per row",
    ),
    ("actor_rollout_ref.rollout.agent.agent_loop_config_path", "refuse", "agent loops are not built"),
    ("actor_rollout_ref.rollout.agent.custom_async_server.*", "refuse", "agent loops are not built"),
    # speed or memory only: run with a notice
    (
        "actor_rollout_ref.rollout.data_parallel_size",
        "notice",
        "rollout parallelism follows the training ranks",
    ),
    ("actor_rollout_ref.rollout.expert_parallel_size", "notice", "no expert parallelism in rollout"),
    (
        "actor_rollout_ref.rollout.pipeline_model_parallel_size",
        "notice",
        "no pipeline parallelism in rollout",
    ),
    ("*.tiled_mlp.*", "notice", "the MLP runs untiled (more activation memory, same results)"),
    ("reward_model.enable_resource_pool", "notice", "the reward model shares the training ranks"),
    ("reward_model.n_gpus_per_node", "notice", "the reward model shares the training ranks"),
    ("reward_model.nnodes", "notice", "the reward model shares the training ranks"),
    (
        "reward_model.rollout.*",
        "notice",
        "klppo runs the reward model in the step, loaded whole on each rank (reward_model.max_length bounds "
        "its input); serving options do not apply",
    ),
    ("transfer_queue.enable", "notice", "batches move between phases in process memory"),
    # accepted, no effect yet
    ("actor_rollout_ref.hybrid_engine", "warn", "klppo always generates on the actor's own weights"),
    (
        "actor_rollout_ref.rollout.over_sample_rate",
        "warn",
        "verl defines it and acts on it nowhere (its rollouts never abort early): no effect there either",
    ),
    ("actor_rollout_ref.nccl_timeout", "warn", "use trainer.collective_timeout_s"),
    ("*.use_shm", "warn", "shared-memory model/data copies are not used"),
    ("data.dataloader_num_workers", "warn", "the loader reads Parquet row groups in the main process"),
    ("data.filter_overlong_prompts_workers", "warn", "filtering runs in the main process"),
    ("data.return_multi_modal_inputs", "warn", "text only"),
    ("data.return_raw_input_ids", "warn", "not needed by klppo's rollout"),
    ("data.return_full_prompt", "warn", "not needed by klppo's rollout"),
    ("actor_rollout_ref.model.enable_activation_offload", "warn", "activation offload is not built"),
    ("actor_rollout_ref.model.use_liger", "warn", "Liger kernels are not used"),
    (
        "actor_rollout_ref.model.fused_kernel_options",
        "warn",
        "impl_backend is not read: use_fused_kernels runs klppo's chunked torch LM head (models/lm_head.py)",
    ),
    ("critic.model.enable_activation_offload", "warn", "activation offload is not built"),
    (
        "*.mixed_precision.buffer_dtype",
        "warn",
        "FSDP2's MixedPrecisionPolicy has no buffer dtype: buffers stay in model_dtype",
    ),
    ("*.data_loader_seed", "warn", "mini-batch shuffling is seeded from trainer.seed"),
    ("data.validation_shuffle", "warn", "validation order does not change its metrics"),
    ("trainer.max_critic_ckpt_to_keep", "warn", "the critic is kept with the actor's checkpoints"),
    (
        "*.entropy_from_logits_with_chunking",
        "warn",
        "entropy is computed by klppo.algorithms (memory-bounded)",
    ),
    ("*.entropy_checkpointing", "warn", "not built"),
    ("actor_rollout_ref.actor.calculate_entropy", "warn", "entropy is always logged"),
    (
        "*.checkpoint.*",
        "warn",
        "checkpoints always hold model, optimizer and trainer state, written synchronously",
    ),
    ("*.profiler.enable", "warn", "per-role profiler options are not used (global_profiler.* is)"),
    ("*.profiler.all_ranks", "warn", "per-role profiler options are not used (global_profiler.* is)"),
    ("*.profiler.ranks", "warn", "per-role profiler options are not used (global_profiler.* is)"),
    ("*.profiler.tool_config", "warn", "per-role profiler options are not used (global_profiler.* is)"),
    ("*.fsdp_config.use_orig_params", "warn", "FSDP2 always keeps original parameters"),
    ("*.fsdp_config.seed", "warn", "seeding comes from trainer.seed"),
    ("*.fsdp_config.full_determinism", "warn", "deterministic kernels are not forced"),
    ("*.fsdp_config.ulysses_sequence_parallel_size", "warn", "use the role's ulysses_sequence_parallel_size"),
    ("*.fsdp_config.entropy_*", "warn", "engine copy of a role key"),
    ("*.fsdp_config.use_torch_compile", "warn", "engine copy of a role key"),
    ("*.fsdp_config.forward_only", "warn", "set by role"),
    ("*.fsdp_config.dtype", "warn", "compute dtype is fsdp_config.mixed_precision.param_dtype"),
    ("*.optim.clip_grad", "warn", "use the role's grad_clip"),
    ("*.optim.optimizer_impl", "warn", "torch.optim.AdamW is used"),
    ("*.optim.zero_indexed_step", "warn", "the scheduler counts steps from 0"),
    ("actor_rollout_ref.rollout.mode", "warn", "klppo generates in-process (no server)"),
    ("actor_rollout_ref.rollout.max_num_batched_tokens", "warn", "vLLM engine option"),
    ("actor_rollout_ref.rollout.max_model_len", "warn", "the KV cache holds prompt_length + response_length"),
    ("actor_rollout_ref.rollout.max_num_seqs", "warn", "vLLM engine option"),
    (
        "actor_rollout_ref.rollout.cudagraph_capture_sizes",
        "warn",
        "the klppo engine captures one graph per decode batch bucket it uses "
        "(enforce_eager turns graphs off)",
    ),
    ("actor_rollout_ref.rollout.enable_chunked_prefill", "warn", "vLLM engine option"),
    ("actor_rollout_ref.rollout.enable_prefix_caching", "warn", "vLLM engine option"),
    ("actor_rollout_ref.rollout.load_format", "warn", "weights come from the actor's shards"),
    ("actor_rollout_ref.rollout.disable_log_stats", "warn", "vLLM engine option"),
    ("actor_rollout_ref.rollout.multi_stage_wake_up", "warn", "vLLM engine option"),
    ("actor_rollout_ref.rollout.engine_kwargs", "warn", "vLLM/SGLang engine options"),
    ("actor_rollout_ref.rollout.calculate_log_probs", "warn", "old log-probs are recomputed by the actor"),
    (
        "actor_rollout_ref.rollout.update_weights_bucket_megabytes",
        "warn",
        "weights are gathered per FSDP unit",
    ),
    (
        "actor_rollout_ref.rollout.skip_dump_dir",
        "warn",
        "verl's rollout cache is not built; see data.logged_files",
    ),
    ("actor_rollout_ref.rollout.skip_tokenizer_init", "warn", "vLLM engine option"),
    ("actor_rollout_ref.rollout.layered_summon", "warn", "weights are gathered per FSDP unit"),
    ("actor_rollout_ref.rollout.scheduling_policy", "warn", "vLLM engine option"),
    (
        "actor_rollout_ref.rollout.multi_turn.tokenization_sanity_check_mode",
        "warn",
        "token ids are never re-tokenized, so there is nothing to check",
    ),
    ("actor_rollout_ref.rollout.agent.*", "warn", "agent loops are not built"),
    ("actor_rollout_ref.rollout.trace.*", "warn", "rollout tracing is not built"),
    ("reward_model.sandbox_fusion.*", "warn", "no code-execution sandbox"),
    ("algorithm.pf_ppo.*", "warn", "PF-PPO is not built"),
    ("trainer.esi_redundant_time", "warn", "preemption is handled by SIGTERM (checkpoint, then exit)"),
    ("trainer.default_hdfs_dir", "warn", "no HDFS copy"),
    ("trainer.del_local_ckpt_after_load", "warn", "checkpoints are kept"),
    ("trainer.ray_wait_register_center_timeout", "warn", "no Ray: klppo uses torchrun"),
    ("trainer.use_legacy_worker_impl", "warn", "one implementation"),
    ("ray_kwargs.*", "warn", "no Ray: klppo uses torchrun"),
    ("actor_rollout_ref.actor.sum_pi_squared_checkpointing", "warn", "Σπ² statistics are not built"),
    (
        "actor_rollout_ref.rollout.checkpoint_engine.*",
        "warn",
        "weights are gathered per FSDP unit in-process",
    ),
    ("actor_rollout_ref.rollout.prometheus.*", "warn", "no rollout server to export metrics from"),
    ("data.image_patch_size", "warn", "text only"),
    ("reward_model.use_reward_loop", "warn", "scores are computed in the step, in process (same scores)"),
)


@functools.cache
def _expanded() -> tuple[tuple[str, str, str], ...]:
    """(key, effect, reason) for every leaf key matched by a table pattern (first match wins)."""
    keys = all_keys(KLPPOConfig)
    out: dict[str, tuple[str, str]] = {}
    for pattern, effect, reason in UNIMPLEMENTED:
        hits = [k for k in keys if fnmatch.fnmatchcase(k, pattern)]
        assert hits, f"unimplemented-table pattern {pattern!r} matches no key"
        for k in hits:
            out.setdefault(k, (effect, reason))
    return tuple((k, e, r) for k, (e, r) in out.items())


@functools.cache
def _defaults() -> KLPPOConfig:
    return load_config([], notify=lambda _msg: None)


def _set_entries(cfg: KLPPOConfig, effect: str) -> list[tuple[str, object, str]]:
    base = _defaults()
    out = []
    for key, eff, reason in _expanded():
        if eff != effect:
            continue
        value = value_at(cfg, key)
        if hasattr(value, "__dataclass_fields__"):
            continue  # a group: its leaves have their own rows
        if value != value_at(base, key):
            out.append((key, value, reason))
    return out


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# verl's defaults for the global_tool_config entries klppo does not act on (a verl YAML carries them)
_NSIGHT = {"trace": "cuda,nvtx,cublas,ucx", "cuda-memory-usage": "true", "cuda-graph-trace": "graph"}
_VERL_PROFILER_DEFAULTS: dict[tuple[str, ...], object] = {
    ("nsys", "discrete"): False,
    ("nsys", "controller_nsight_options"): _NSIGHT,
    ("nsys", "worker_nsight_options"): {
        **_NSIGHT,
        "capture-range": "cudaProfilerApi",
        "capture-range-end": None,
        "kill": "none",
    },
    ("torch_memory", "stack_depth"): 32,
    ("torch_memory", "kw_args"): {},
}
_NSIGHT_OPTIONS = ("controller_nsight_options", "worker_nsight_options")
_PROFILER_READ = {
    ("torch", "contents"),
    ("torch_memory", "trace_alloc_max_entries"),
    ("torch_memory", "context"),
    ("torch_memory", "stacks"),
}


def profiler_option_lines(tool_config: dict) -> list[str]:
    """``global_profiler.global_tool_config`` (a free-form dict, so not in the table): one line per entry
    klppo does not act on, set away from verl's default."""
    lines = []
    for tool, options in dict(tool_config or {}).items():
        for key, value in (dict(options) if isinstance(options, dict) else {"": options}).items():
            path = (tool, key) if key else (tool,)
            name = "global_profiler.global_tool_config." + ".".join(path)
            if path in _PROFILER_READ or path[-1].startswith("_"):  # read, or a marker such as _target_
                continue
            if _VERL_PROFILER_DEFAULTS.get(path, _MISSING) == value:
                continue
            if tool == "nsys" and key in _NSIGHT_OPTIONS:
                lines.append(
                    f"{name}={_short(value)} is not used: klppo does not start Nsight Systems; run it as "
                    "`nsys profile --capture-range=cudaProfilerApi <your options> klppo train …`"
                )
            else:
                lines.append(
                    f"{name}={_short(value)} is accepted but has no effect (klppo reads torch.contents and "
                    "torch_memory.trace_alloc_max_entries/context/stacks)"
                )
    return lines


_MISSING = object()


def warn_unimplemented(cfg: KLPPOConfig, notify: Notify | None = None) -> list[str]:
    """One line per key set away from its default that klppo accepts but does not act on; returns them."""
    notify = notify or notice
    lines = [
        f"{k}={_short(v)} is accepted but has no effect yet ({r})" for k, v, r in _set_entries(cfg, "warn")
    ]
    lines += profiler_option_lines(cfg.global_profiler.global_tool_config)
    for line in lines:
        notify(line)
    return lines


def check_trainable(cfg: KLPPOConfig, notify: Notify | None = None) -> None:
    """ConfigError listing every value `klppo train` cannot honour; notices for speed/memory-only ones."""
    notify = notify or notice
    for key, value, reason in _set_entries(cfg, "notice"):
        notify(f"{key}={value!r}: {reason}")
    problems = [f"{k}={v!r}: {r}" for k, v, r in _set_entries(cfg, "refuse")]
    est = cfg.algorithm.adv_estimator
    if est not in IMPLEMENTED_ADV_ESTIMATORS:
        problems.append(f"algorithm.adv_estimator={est!r}: built are {', '.join(IMPLEMENTED_ADV_ESTIMATORS)}")
    if est == "grpo_passk" and cfg.actor_rollout_ref.rollout.n < 2:
        problems.append(
            "algorithm.adv_estimator='grpo_passk' compares the samples of a prompt: "
            "it needs actor_rollout_ref.rollout.n >= 2"
        )
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if loss_mode not in IMPLEMENTED_POLICY_LOSS_MODES:
        problems.append(
            f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode!r}: "
            f"built are {', '.join(IMPLEMENTED_POLICY_LOSS_MODES)}"
        )
    actor = cfg.actor_rollout_ref.actor
    if (
        cfg.actor_rollout_ref.model.lora_rank > 0
        and actor.use_kl_loss
        and actor.kl_loss_type.startswith("full")
    ):
        problems.append(
            "kl_loss_type='full' with LoRA is not built (the reference is the actor with its "
            "adapters off); use low_var_kl, kl or mse"
        )
    problems += ulysses_problems(cfg)
    problems += rollout_correction_problems(cfg)
    rm = cfg.reward_model
    if rm.reward_manager not in IMPLEMENTED_REWARD_MANAGERS:
        problems.append(
            f"reward_model.reward_manager={rm.reward_manager!r}: "
            f"built are {', '.join(IMPLEMENTED_REWARD_MANAGERS)}"
        )
    if rm.reward_manager == "batch" and not cfg.custom_reward_function.path:
        problems.append(
            "reward_model.reward_manager='batch' calls a batched custom_reward_function: set its path"
        )
    if rm.reward_manager == "batch" and rm.launch_reward_fn_async and not rm.enable and rm.num_workers > 1:
        problems.append(
            f"reward_model.num_workers={rm.num_workers} with reward_manager='batch': the batched "
            "compute_score would see a slice of the batch per process, not the whole batch as in the step "
            "(a function that ranks, normalises or groups within the batch would score differently); set "
            "num_workers=1"
        )
    if rm.enable and rm.strategy not in ("fsdp", "fsdp2", "megatron"):
        problems.append(
            f"reward_model.strategy={rm.strategy!r}: klppo's reward model runs in PyTorch (fsdp/fsdp2 "
            f"configs), loaded whole on each rank"
        )
    if problems:
        raise ConfigError(
            "klppo train cannot honour these settings (they would change results):\n  - "
            + "\n  - ".join(problems)
            + "\n(`klppo config` accepts them; remove them or set them to their defaults to train)"
        )


def ulysses_problems(cfg: KLPPOConfig) -> list[str]:
    """What Ulysses sequence parallelism (``ulysses_sequence_parallel_size`` > 1, per role) cannot run
    with: padded sequences (it splits packed ones) and the full-vocabulary KL loss."""
    arr = cfg.actor_rollout_ref
    problems = []
    padding = [
        (
            "actor_rollout_ref.model.use_remove_padding",
            arr.model.use_remove_padding,
            max(arr.actor.ulysses_sequence_parallel_size, arr.ref.ulysses_sequence_parallel_size),
        )
    ]
    if uses_critic(cfg):
        padding.append(
            (
                "critic.model.use_remove_padding",
                cfg.critic.model.use_remove_padding,
                cfg.critic.ulysses_sequence_parallel_size,
            )
        )
    for key, packed, sp in padding:
        if sp > 1 and not packed:
            problems.append(
                f"{key}=False with ulysses_sequence_parallel_size={sp}: Ulysses sequence parallelism splits "
                "packed sequences; set it True"
            )
    sp = arr.actor.ulysses_sequence_parallel_size
    if sp > 1 and arr.actor.use_kl_loss and arr.actor.kl_loss_type.startswith("full"):
        problems.append(
            "actor_rollout_ref.actor.kl_loss_type='full' with ulysses_sequence_parallel_size > 1 "
            "is not built (it needs full-vocabulary logits); use low_var_kl, kl or mse"
        )
    return problems


def rollout_correction_problems(cfg: KLPPOConfig) -> list[str]:
    """What ``algorithm.rollout_correction`` cannot run with: values verl rejects too (named by key), and
    the parts klppo does not build — rejection in bypass mode with ``seq-mean-token-mean`` (verl divides
    each row by its kept tokens, decided per micro-batch), weights with ``geo_mean``, batch normalisation
    and another policy loss in bypass mode (verl replaces the loss there), and a KL penalty in the reward in
    bypass mode on logged samples (π_old there is the log's behaviour policy)."""
    rcfg = cfg.algorithm.rollout_correction
    key = "algorithm.rollout_correction"
    problems = []
    if rcfg.rollout_is is not None and rcfg.rollout_is not in rc.IS_LEVELS:
        problems.append(f"{key}.rollout_is={rcfg.rollout_is!r}: valid are {', '.join(rc.IS_LEVELS)} or null")
    try:
        rc.parse_is_threshold(rcfg.rollout_is_threshold)
    except ValueError as exc:
        problems.append(f"{key}.rollout_is_threshold: {exc}")
    if rcfg.rollout_rs is not None:
        try:
            rc.parse_rs_options(rcfg.rollout_rs, rcfg.rollout_rs_threshold)
        except ValueError as exc:
            problems.append(f"{key}.rollout_rs: {exc}")
        agg = cfg.actor_rollout_ref.actor.loss_agg_mode
        if rcfg.bypass_mode and agg == "seq-mean-token-mean":
            problems.append(
                f"{key}.rollout_rs={rcfg.rollout_rs!r} with bypass_mode=True and loss_agg_mode={agg!r} is "
                "not built (verl divides each row by its kept tokens, decided per micro-batch); use "
                "token-mean or the decoupled mode (bypass_mode=False)"
            )
    if rcfg.loss_type not in rc.BYPASS_LOSS_TYPES:
        problems.append(f"{key}.loss_type={rcfg.loss_type!r}: valid are {', '.join(rc.BYPASS_LOSS_TYPES)}")
    loss_mode = cfg.actor_rollout_ref.actor.policy_loss.loss_mode
    if rcfg.bypass_mode and loss_mode != "vanilla":
        problems.append(
            f"{key}.bypass_mode=True with policy_loss.loss_mode={loss_mode!r}: bypass mode's loss "
            "is loss_type (ppo_clip is the vanilla loss), as in verl"
        )
    if rcfg.bypass_mode and rcfg.rollout_is_batch_normalize:
        problems.append(
            f"{key}.rollout_is_batch_normalize=True with bypass_mode=True is not built (verl takes "
            "the mean over all ranks inside each micro-batch's loss)"
        )
    if rcfg.rollout_is is not None and not rcfg.bypass_mode and loss_mode == "geo_mean":
        problems.append(f"{key}.rollout_is with policy_loss.loss_mode='geo_mean' is not built")
    if rcfg.bypass_mode and cfg.algorithm.use_kl_in_reward and cfg.data.logged_files:
        problems.append(
            f"algorithm.use_kl_in_reward=True with {key}.bypass_mode=True on data.logged_files: the penalty "
            "is computed from π_old, here the logged behaviour policy, not the trained one (docs/data.md, "
            '"KL to the reference"); set actor_rollout_ref.actor.use_kl_loss=True instead, or '
            f"{key}.bypass_mode=False (π_old from the actor)"
        )
    return problems
