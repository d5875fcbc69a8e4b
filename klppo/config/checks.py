"""Validation of a resolved configuration (`validate`, run by `load_config`) and `check_trainable`.

`validate` judges the configuration alone: choices, ranges, and the prompt/sample count rules that do not
depend on the number of GPUs (those are in `sizes.derive_sizes`). `check_trainable` is what `klppo train`
adds before loading anything: values that would change results but are not built are refused; values that
only change speed or memory run with a notice (see `unimplemented.py`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from klppo.config._walk import all_keys
from klppo.config.aliases import choice_error
from klppo.config.errors import ConfigError, notice
from klppo.config.schema import KLPPOConfig
from klppo.config.schema_arr import RolloutConfig
from klppo.config.schema_monitor import check_monitor, check_profiler
from klppo.config.sizes import check_prompt_counts, uses_critic

Notify = Callable[[str], None]

ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "grpo_passk",
    "gpg",
    "optimal_token_baseline",
    "rloo_vectorized",
    "grpo_vectorized",
)
IMPLEMENTED_ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "rloo",
    "reinforce_plus_plus",
    "remax",
    "reinforce_plus_plus_baseline",
    "opo",
    "grpo_passk",
    "gpg",
)
# actor_rollout_ref.actor.policy_loss.loss_mode values klppo builds (klppo.algorithms.losses.POLICY_LOSSES)
IMPLEMENTED_POLICY_LOSS_MODES = ("vanilla", "gspo", "clip_cov", "kl_cov", "gpg", "geo_mean")
GROUP_ESTIMATORS = (
    "grpo",
    "rloo",
    "grpo_passk",
    "opo",
    "rloo_vectorized",
    "grpo_vectorized",
    "reinforce_plus_plus_baseline",
    "gpg",
)
# group estimators that give a group whose scores are all equal exactly zero advantage (algorithms.outcome)
ZERO_EQUAL_GROUP_ESTIMATORS = ("grpo", "rloo")
# estimators whose advantages are whitened over the batch's response tokens (mean 0, std 1 by construction;
# tests/algorithms/test_advantages.py checks every estimator against this list)
WHITENED_ESTIMATORS = ("gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
# group estimators that divide by the group's std when algorithm.norm_adv_by_std_in_grpo is true
STD_GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# reward_model.reward_manager values klppo.rewards.RewardManager builds (klppo.rewards.REWARD_MANAGERS)
IMPLEMENTED_REWARD_MANAGERS = ("naive", "batch", "dapo")
# where the notes about the KL settings point: the guide's section that explains them
_KEEP_CLOSE = "docs/training.md, 'Keeping the policy close to its reference'"

_CHOICES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("algorithm.adv_estimator", ADV_ESTIMATORS),
    ("algorithm.kl_ctrl.type", ("fixed", "adaptive", "pi")),
    ("actor_rollout_ref.actor.kl_loss_ctrl.type", ("fixed", "adaptive", "pi")),
    ("actor_rollout_ref.actor.loss_agg_mode", LOSS_AGG_MODES),
    ("critic.loss_agg_mode", LOSS_AGG_MODES),
    ("actor_rollout_ref.rollout.mode", ("sync", "async")),
    ("actor_rollout_ref.rollout.sampler", ("auto", "torch")),
    ("actor_rollout_ref.rollout.decode_attention", ("auto", "sdpa")),
    ("actor_rollout_ref.rollout.layer_kernels", ("auto",)),
    ("actor_rollout_ref.actor.optim.lr_scheduler_type", ("constant", "cosine")),
    ("critic.optim.lr_scheduler_type", ("constant", "cosine")),
    ("data.truncation", ("error", "left", "right", "middle")),
    ("data.bad_row_policy", ("skip", "error")),
    ("data.logged_overlong", ("error", "drop")),
    ("trainer.device", ("auto", "cuda", "cpu")),
    ("trainer.resume_mode", ("auto", "disable", "resume_path")),
)

# verl values naming hardware or tools klppo does not build: refused with the reason, not as a typo
UNBUILT_VALUES: dict[tuple[str, str], str] = {
    ("trainer.device", "npu"): "Ascend NPUs are not supported (klppo runs on CUDA GPUs or the CPU)",
    (
        "global_profiler.tool",
        "npu",
    ): "the Ascend NPU profiler is not supported; use torch, torch_memory or nsys",
}

# klppo engine values that are no choice (one path per job): refused with what to set instead
_AUTO_KERNELS = "set auto, which runs the Triton kernels wherever they run"
REMOVED_VALUES: dict[tuple[str, str], str] = {
    ("actor_rollout_ref.rollout.sampler", "triton"): _AUTO_KERNELS,
    ("actor_rollout_ref.rollout.decode_attention", "triton"): _AUTO_KERNELS,
    (
        "actor_rollout_ref.rollout.decode_attention",
        "flash",
    ): f"{_AUTO_KERNELS}, or sdpa (the torch reference)",
    (
        "actor_rollout_ref.rollout.decode_attention",
        "flash-plain",
    ): f"{_AUTO_KERNELS}, or sdpa (the torch reference)",
    ("actor_rollout_ref.rollout.layer_kernels", "triton"): _AUTO_KERNELS,
    ("actor_rollout_ref.rollout.layer_kernels", "compile"): (
        f"{_AUTO_KERNELS} (torch.compile runs the layers where they do not; enforce_eager=true turns it off)"
    ),
}
_LOCAL_SHARDS = (
    "the trained roles' optimizer step and gradient clip run on the DTensors' local shards (the same state, "
    "checkpoints and results as through DTensor dispatch); remove the key"
)
WITHDRAWN_VALUES: dict[tuple[str, object], str] = {
    ("actor_rollout_ref.actor.fsdp_config.local_shard_optim", False): _LOCAL_SHARDS,
    ("actor_rollout_ref.ref.fsdp_config.local_shard_optim", False): _LOCAL_SHARDS,
    ("critic.model.fsdp_config.local_shard_optim", False): _LOCAL_SHARDS,
}
"""Values of the training side's keys that select no path: refused by name with what to do instead (never
mapped)."""

# (key, lowest allowed, highest allowed or None); None values are skipped (optional keys).
_RANGES: tuple[tuple[str, float, float | None], ...] = (
    ("data.train_batch_size", 1, None),
    ("data.max_prompt_length", 1, None),
    ("data.max_response_length", 1, None),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", 1, None),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 1, None),
    ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", 1, None),
    ("actor_rollout_ref.actor.ppo_epochs", 1, None),
    ("actor_rollout_ref.actor.clip_ratio", 0, None),
    ("actor_rollout_ref.actor.clip_ratio_low", 0, None),
    ("actor_rollout_ref.actor.clip_ratio_high", 0, None),
    ("actor_rollout_ref.actor.kl_loss_coef", 0, None),
    ("actor_rollout_ref.actor.grad_clip", 0, None),
    ("actor_rollout_ref.actor.ulysses_sequence_parallel_size", 1, None),
    ("actor_rollout_ref.actor.optim.lr", 0, None),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", 0, 1),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", 1, None),
    ("actor_rollout_ref.rollout.n", 1, None),
    ("reward_model.num_workers", 1, None),
    ("actor_rollout_ref.rollout.temperature", 0, None),
    ("actor_rollout_ref.rollout.top_p", 0, 1),
    ("actor_rollout_ref.rollout.gpu_memory_utilization", 0.01, 1),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size", 1, None),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", 1, None),
    ("actor_rollout_ref.rollout.val_kwargs.n", 1, None),
    ("critic.ppo_micro_batch_size_per_gpu", 1, None),
    ("critic.ppo_epochs", 1, None),
    ("critic.ulysses_sequence_parallel_size", 1, None),
    ("critic.cliprange_value", 0, None),
    ("data.logged_share", 0, 1),
    ("algorithm.gamma", 0, 1),
    ("algorithm.lam", 0, 1),
    ("algorithm.kl_ctrl.kl_coef", 0, None),
    ("algorithm.kl_ctrl.horizon", 1, None),
    ("trainer.nnodes", 1, None),
    ("trainer.total_epochs", 1, None),
    ("trainer.total_training_steps", 1, None),
    ("trainer.max_nan_steps", 0, None),
    ("trainer.collective_timeout_s", 1, None),
    ("trainer.gpu_memory_gib", 1, None),
    ("trainer.stop_grace_s", 0, None),
    ("trainer.seed", 0, None),
    ("data.seed", 0, None),
    ("data.val_batch_size", 1, None),
)


def value_at(cfg: object, key: str) -> object:
    """The value of dotted `key` in a config tree."""
    node = cfg
    for name in key.split("."):
        node = node[name] if isinstance(node, dict) else getattr(node, name)
    return node


_READ_ONLY_COPIES = (
    ("actor_rollout_ref.actor.rollout_n", "actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.ref.rollout_n", "actor_rollout_ref.rollout.n"),
    ("critic.rollout_n", "actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.rollout.prompt_length", "data.max_prompt_length"),
    ("actor_rollout_ref.rollout.response_length", "data.max_response_length"),
)
"""(copy, source): keys verl derives from another (``${...}``) and klppo never reads; set apart from their
source they would be ignored, so they must agree."""


def _check_reward_model_sizes(rm) -> None:
    """The reward model's sizes ≥ 1, only where they act: with the model on, the token budget with
    ``use_dynamic_bsz`` (it follows the critic's, which a run without a critic never reads)."""
    if not rm.enable:
        return
    sizes = [
        ("micro_batch_size", rm.micro_batch_size),
        ("micro_batch_size_per_gpu", rm.micro_batch_size_per_gpu),
    ]
    if rm.use_dynamic_bsz:
        sizes.append(("forward_max_token_len_per_gpu", rm.forward_max_token_len_per_gpu))
    for key, v in sizes:
        _check_range(f"reward_model.{key}", v, 1, None)


def _check_trainer_keys(cfg: KLPPOConfig, notify: Notify) -> None:
    t = cfg.trainer
    if t.val_only and not cfg.data.val_files:
        raise ConfigError("trainer.val_only=True validates data.val_files, which is null: set data.val_files")
    if t.resume_from_path and t.resume_mode != "resume_path":
        notify(
            f"trainer.resume_from_path={t.resume_from_path} is read only with "
            f"trainer.resume_mode=resume_path (now {t.resume_mode}): not used"
        )


def _check_no_nan(cfg: KLPPOConfig) -> None:
    """NaN is no setting: a ``gamma=nan`` run skipped every step for non-finite advantages and exited 0."""
    for key in all_keys(type(cfg)):
        v = value_at(cfg, key)
        if isinstance(v, float) and math.isnan(v):
            raise ConfigError(f"{key}=nan: must be a number")


def _check_file_lists(cfg: KLPPOConfig) -> None:
    for key in ("data.train_files", "data.val_files"):
        v = value_at(cfg, key)
        if (
            v is None
            or isinstance(v, str)
            or (isinstance(v, (list, tuple)) and all(isinstance(f, str) for f in v))
        ):
            continue
        raise ConfigError(f"{key}={v!r}: must be a Parquet path or a list of paths")


def _check_range(key: str, v: float | None, low: float, high: float | None) -> None:
    """ConfigError naming ``key`` when ``v`` (None: unset, not checked) lies outside [low, high]."""
    if v is None:
        return
    if (
        not (v >= low) or (high is not None and not (v <= high)) or v in (float("inf"), float("-inf"))
    ):  # NaN too
        bound = f"≥ {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(f"{key}={v}: must be {'a finite number ' if math.isinf(v) else ''}{bound}")


_AUTO_BOOL_KEYS = (
    "actor_rollout_ref.actor.fsdp_config.grad_sync_per_mini_batch",
    "critic.model.fsdp_config.grad_sync_per_mini_batch",
    "actor_rollout_ref.actor.fsdp_config.plain_single_gpu",
    "actor_rollout_ref.ref.fsdp_config.plain_single_gpu",
    "critic.model.fsdp_config.plain_single_gpu",
)
"""Keys whose value is auto, true or false."""


def _check_refused_values(cfg: KLPPOConfig) -> None:
    """:data:`UNBUILT_VALUES`, :data:`WITHDRAWN_VALUES` and :data:`REMOVED_VALUES`: ConfigError naming the
    key, the value and why."""
    for (key, value), reason in {**UNBUILT_VALUES, **WITHDRAWN_VALUES}.items():
        current = value_at(cfg, key)
        if current == value and type(current) is type(value):  # False is not 0
            raise ConfigError(f"{key}={value!r}: {reason}")
    for (key, value), instead in REMOVED_VALUES.items():
        if value_at(cfg, key) == value:
            raise ConfigError(f"{key}={value!r} is not a choice of the klppo engine: {instead}")


def validate(cfg: KLPPOConfig, notify: Notify | None = None) -> None:
    """Choices, ranges and world-size-free count rules; ConfigError on the first problem, notes via notify."""
    notify = notify or notice
    _check_refused_values(cfg)
    for key, valid in _CHOICES:
        if value_at(cfg, key) not in valid:
            raise choice_error(key, value_at(cfg, key), valid)
    for key, low, high in _RANGES:
        _check_range(key, value_at(cfg, key), low, high)
    _check_no_nan(cfg)
    _check_file_lists(cfg)
    _check_reward_model_sizes(cfg.reward_model)
    _check_value_forms(cfg)
    _check_engine_keys(cfg.actor_rollout_ref.rollout)
    _check_cross_keys(cfg)
    _check_skip_zero_advantage_rows(cfg)
    _check_kl_controller("algorithm.kl_ctrl", cfg.algorithm.kl_ctrl, cfg.algorithm.kl_ctrl.kl_coef)
    actor = cfg.actor_rollout_ref.actor
    _check_kl_controller("actor_rollout_ref.actor.kl_loss_ctrl", actor.kl_loss_ctrl, actor.kl_loss_coef)
    if actor.kl_loss_ctrl.type != "fixed" and not actor.use_kl_loss:
        raise ConfigError(
            f"actor_rollout_ref.actor.kl_loss_ctrl.type={actor.kl_loss_ctrl.type} controls the KL loss, but "
            "actor_rollout_ref.actor.use_kl_loss=False; set use_kl_loss=True or kl_loss_ctrl.type=fixed"
        )
    crf = cfg.custom_reward_function
    if crf.path and not crf.name:
        raise ConfigError(
            f"custom_reward_function.path={crf.path!r} needs custom_reward_function.name (the function to "
            "call in that file), got null"
        )
    check_prompt_counts(cfg)
    _token_budgets(cfg)
    _compiled_layers(cfg)
    _check_drift_range(cfg)
    check_monitor(cfg.monitor)
    _check_kl_early_stop_target(cfg)
    _check_trainer_keys(cfg, notify)
    check_profiler(cfg.global_profiler.tool, cfg.global_profiler.steps)
    _advice(cfg, notify)


def _check_value_forms(cfg: KLPPOConfig) -> None:
    """Copies that must equal their source, and keys that take ``auto`` or a typed value."""
    for copy, source in _READ_ONLY_COPIES:
        if value_at(cfg, copy) != value_at(cfg, source):
            raise ConfigError(
                f"{copy}={value_at(cfg, copy)!r} differs from {source}={value_at(cfg, source)!r}, "
                f"which it copies in verl's schema and which is what klppo reads: set {source} "
                f"instead, or leave {copy} unset"
            )
    n = cfg.trainer.n_gpus_per_node
    if not (n == "auto" or (isinstance(n, int) and n >= 1)):
        raise ConfigError(f"trainer.n_gpus_per_node={n!r}: expected 'auto' or an integer ≥ 1")
    for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic.model", "reward_model.model"):
        key = f"{role}.fsdp_config.wrap_policy.min_num_params"
        value = value_at(cfg, key)
        if not (value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 0)):
            raise ConfigError(f"{key}={value!r}: expected auto or an integer ≥ 0")
    for key in _AUTO_BOOL_KEYS:
        value = value_at(cfg, key)
        if not (isinstance(value, bool) or value == "auto"):
            raise ConfigError(f"{key}={value!r}: expected auto, true or false")


def _check_engine_keys(rollout: RolloutConfig) -> None:
    """klppo's engine keys are set only with the klppo engine, each to one of its values."""
    if rollout.sampler != "auto" and rollout.name != "klppo":
        raise ConfigError(
            f"actor_rollout_ref.rollout.sampler={rollout.sampler} is klppo's engine's; rollout.name="
            f"{rollout.name} samples its own way: set sampler=auto or rollout.name=klppo"
        )
    if rollout.decode_attention != "auto" and rollout.name != "klppo":
        raise ConfigError(
            f"actor_rollout_ref.rollout.decode_attention={rollout.decode_attention} is klppo's engine's; "
            f"rollout.name={rollout.name}: set decode_attention=auto or rollout.name=klppo"
        )
    if not (isinstance(rollout.compact_slots, bool) or rollout.compact_slots == "auto"):
        raise ConfigError(
            f"actor_rollout_ref.rollout.compact_slots={rollout.compact_slots!r}: expected auto, true or false"
        )
    if rollout.compact_slots is True and rollout.name != "klppo":
        raise ConfigError(
            f"actor_rollout_ref.rollout.compact_slots=true is klppo's engine's; rollout.name={rollout.name}: "
            "set compact_slots=false or rollout.name=klppo"
        )


def _check_cross_keys(cfg: KLPPOConfig) -> None:
    """Rules between keys: the dual clip, a resume path, a critic for GAE."""
    if cfg.actor_rollout_ref.actor.clip_ratio_c <= 1.0:
        raise ConfigError(
            f"actor_rollout_ref.actor.clip_ratio_c={cfg.actor_rollout_ref.actor.clip_ratio_c}: the dual-clip "
            "constant must be > 1.0"
        )
    if cfg.trainer.resume_mode == "resume_path" and not cfg.trainer.resume_from_path:
        raise ConfigError(
            "trainer.resume_mode=resume_path needs trainer.resume_from_path=<global_step_N folder>"
        )
    if uses_critic(cfg) and cfg.critic.enable is False:
        raise ConfigError(
            "algorithm.adv_estimator=gae needs a critic (values), but critic.enable=False; enable the "
            "critic or pick a critic-free estimator (grpo, rloo, reinforce_plus_plus, remax)"
        )


def _check_skip_zero_advantage_rows(cfg: KLPPOConfig) -> None:
    """``actor.skip_zero_advantage_rows``: not with a critic (GAE's advantages are never exactly 0)."""
    actor, key = cfg.actor_rollout_ref.actor, "actor_rollout_ref.actor.skip_zero_advantage_rows=True"
    if actor.skip_zero_advantage_rows and uses_critic(cfg):
        raise ConfigError(
            f"{key} leaves out samples whose advantage is exactly 0, which GAE's never are "
            f"(algorithm.adv_estimator={cfg.algorithm.adv_estimator}, with a critic); use it with grpo or "
            "rloo, or set it False"
        )


def _skip_would_pay(cfg: KLPPOConfig) -> bool:
    """A GRPO/RLOO run with the KL in the loss and one update per step, not leaving out its zero-advantage
    samples: the case ``actor.skip_zero_advantage_rows`` is advised for (with several mini-batches it is
    allowed, not advised)."""
    actor = cfg.actor_rollout_ref.actor
    return (
        not actor.skip_zero_advantage_rows
        and cfg.algorithm.adv_estimator in ZERO_EQUAL_GROUP_ESTIMATORS  # neither reads values (no critic)
        and actor.use_kl_loss
        and not cfg.algorithm.use_kl_in_reward
        and cfg.actor_rollout_ref.rollout.n > 1
        and actor.ppo_epochs == 1
        and actor.ppo_mini_batch_size >= cfg.data.train_batch_size
    )


RM_WHOLE = (
    "the reward model is loaded whole on each rank in reward_model.model.fsdp_config.model_dtype (on GPU) "
    "and scores in the step: not sharded, not offloaded"
)
# the reward model's keys klppo does not act on (it is loaded whole), with the values that say nothing:
# klppo's defaults and verl's (min_num_params 0 in verl's YAML)
_RM_INERT_KEYS = (
    "fsdp_config.param_offload",
    "fsdp_config.optimizer_offload",
    "fsdp_config.offload_policy",
    "fsdp_config.reshard_after_forward",
    "fsdp_config.fsdp_size",
    "fsdp_config.forward_prefetch",
    "fsdp_config.backward_prefetch",
    "fsdp_config.grad_sync_per_mini_batch",
    "fsdp_config.local_shard_optim",
    "fsdp_config.plain_single_gpu",
    "fsdp_config.cuda_graph_update",
    "fsdp_config.wrap_policy.min_num_params",
    "fsdp_config.wrap_policy.transformer_layer_cls_to_wrap",
    "fsdp_config.mixed_precision.param_dtype",
    "fsdp_config.mixed_precision.reduce_dtype",
    "use_remove_padding",
)
_RM_SILENT_VALUES = {"fsdp_config.wrap_policy.min_num_params": (0,)}


def _reward_model_notes(cfg: KLPPOConfig, notify: Notify) -> None:
    """With ``reward_model.enable``: one line per key of its sharding that klppo does not act on."""
    if not cfg.reward_model.enable:
        return
    default = type(cfg.reward_model.model)()
    for key in _RM_INERT_KEYS:
        value = value_at(cfg.reward_model.model, key)
        if value != value_at(default, key) and value not in _RM_SILENT_VALUES.get(key, ()):
            why = (
                "the reward model scores right-padded micro-batches"
                if key == "use_remove_padding"
                else RM_WHOLE
            )
            notify(f"reward_model.model.{key}={value!r}: {why}")


def _reward_notes(cfg: KLPPOConfig, notify: Notify) -> None:
    """The background-scoring keys where they do nothing, and the reward model's inert ones."""
    _reward_model_notes(cfg, notify)
    rm = cfg.reward_model
    if rm.num_workers != 1 and not rm.launch_reward_fn_async:
        notify(
            f"reward_model.num_workers={rm.num_workers} acts with reward_model.launch_reward_fn_async=True "
            "only (that many scoring processes per rank); without it the trainer scores in the step, in its "
            "own process"
        )
    if rm.launch_reward_fn_async and rm.enable:
        notify(
            "reward_model.launch_reward_fn_async=True has no effect with reward_model.enable=True: the "
            "reward model scores on the device in the step (the background processes run reward functions "
            "only)"
        )


def drift_adv_std_range(drift, *, whitened: bool) -> tuple[float | None, float | None]:
    """``monitor.drift``'s advantage-std bounds as the rule applies them: a bound left null is 0.8 / 1.2
    where the estimator whitens over the batch, unwatched (None) otherwise."""
    low, high = (0.8, 1.2) if whitened else (None, None)
    return (
        low if drift.adv_std_low is None else drift.adv_std_low,
        high if drift.adv_std_high is None else drift.adv_std_high,
    )


def _check_drift_range(cfg: KLPPOConfig) -> None:
    """One bound set against the other's default can invert the range: every step would warn."""
    est = cfg.algorithm.adv_estimator
    low, high = drift_adv_std_range(cfg.monitor.drift, whitened=est in WHITENED_ESTIMATORS)
    if low is not None and high is not None and low > high:
        raise ConfigError(
            f"monitor.drift: the advantage-std range [{low}, {high}] is empty "
            f"(adv_std_low={cfg.monitor.drift.adv_std_low}, adv_std_high={cfg.monitor.drift.adv_std_high}; a "
            "null bound is "
            f"{'0.8 / 1.2' if est in WHITENED_ESTIMATORS else 'unwatched'} with adv_estimator={est}): set "
            "adv_std_low ≤ adv_std_high"
        )


def _check_kl_early_stop_target(cfg: KLPPOConfig) -> None:
    """A null monitor.kl_early_stop.target_kl reads the reward-side controller's target: only where that
    controller runs and has one (else a KL-loss-only run was stopped against an unused default)."""
    stop = cfg.monitor.kl_early_stop
    if not (cfg.monitor.enable and stop.enable) or stop.target_kl is not None:
        return
    ctrl = cfg.algorithm.kl_ctrl
    if not cfg.algorithm.use_kl_in_reward or ctrl.target_kl is None or ctrl.type == "fixed":
        why = (
            "algorithm.use_kl_in_reward is off"
            if not cfg.algorithm.use_kl_in_reward
            else "algorithm.kl_ctrl.target_kl is null"
            if ctrl.target_kl is None
            else "algorithm.kl_ctrl.type=fixed does not use its target_kl"
        )
        raise ConfigError(
            f"monitor.kl_early_stop.target_kl is null and {why}: set monitor.kl_early_stop.target_kl (in the "
            f"units of monitor.kl_early_stop.kl_metric={stop.kl_metric})"
        )


def _kl_controller_notes(cfg: KLPPOConfig, notify: Notify) -> None:
    """Notes on the PI controllers: floors far below the start, and a constant KL-loss target (ramp it)."""
    actor = cfg.actor_rollout_ref.actor
    for prefix, ctrl, init_key, init_coef, on in (
        (
            "algorithm.kl_ctrl",
            cfg.algorithm.kl_ctrl,
            "kl_coef",
            cfg.algorithm.kl_ctrl.kl_coef,
            cfg.algorithm.use_kl_in_reward,
        ),
        (
            "actor_rollout_ref.actor.kl_loss_ctrl",
            actor.kl_loss_ctrl,
            "actor.kl_loss_coef",
            actor.kl_loss_coef,
            actor.use_kl_loss,
        ),
    ):
        if on and ctrl.type == "pi":
            _pi_floor_note(prefix, ctrl, init_key, init_coef, notify)
    if actor.use_kl_loss and actor.kl_loss_ctrl.type == "pi" and actor.kl_loss_ctrl.target_kl_start is None:
        notify(
            "actor_rollout_ref.actor.kl_loss_ctrl: a constant target is overshot in the first steps, before "
            "β catches up; a target ramped up from below keeps the early steps under it: kl_loss_coef=0.3, "
            "kl_loss_ctrl.target_kl_start=0.02, anneal_begin=0, anneal_steps=40 "
            f"(examples/arithmetic_grpo_kl_ramp.yaml; {_KEEP_CLOSE})"
        )


def _advice(cfg: KLPPOConfig, notify: Notify) -> None:
    """Settings that run but rarely do what their author wants: one note each, naming the keys and what to
    set (the GRPO and PI notes: docs/training.md, "Keeping the policy close to its reference")."""
    _kl_controller_notes(cfg, notify)
    actor = cfg.actor_rollout_ref.actor
    est, n_samples = cfg.algorithm.adv_estimator, cfg.actor_rollout_ref.rollout.n
    if est in GROUP_ESTIMATORS and n_samples == 1:
        notify(
            f"algorithm.adv_estimator={est} with actor_rollout_ref.rollout.n=1: every group has one "
            "response, so the group baseline is 0 (as in verl) and the advantages are the raw scores, "
            "without the variance reduction the estimator exists for; set rollout.n ≥ 2"
        )
    if actor.skip_zero_advantage_rows and (
        cfg.algorithm.use_kl_in_reward or est not in ZERO_EQUAL_GROUP_ESTIMATORS
    ):
        why = "the KL penalty is in the rewards" if cfg.algorithm.use_kl_in_reward else f"adv_estimator={est}"
        notify(
            f"actor_rollout_ref.actor.skip_zero_advantage_rows=True with {why}: samples rarely have an "
            "advantage of exactly 0 then (grpo and rloo give it to groups whose scores are all equal), so "
            "few or none are left out"
        )
    if cfg.trainer.advise and _skip_would_pay(cfg):
        notify(
            "tip (not set): actor_rollout_ref.actor.skip_zero_advantage_rows=True would leave the samples of "
            f"{est}'s equal-score groups (advantage exactly 0: no policy gradient) out of this "
            "one-update-per-step actor update, which then costs less; the KL and entropy terms act on the "
            "kept samples, the KL metrics "
            "and controller still see all (docs/training.md, 'Samples without advantage')"
        )
    if cfg.critic.enable and not uses_critic(cfg):
        notify(
            f"critic.enable=True has no effect with algorithm.adv_estimator={est}: the estimator reads no "
            "values, so klppo builds no critic (verl would train one whose values nothing uses); leave "
            "critic.enable unset, or set algorithm.adv_estimator=gae for PPO with a critic"
        )
    tp, why = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size, tp_rollout_unbuilt(cfg)
    if tp > 1 and why:
        notify(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} is not built with {why}: the rollout "
            "runs data-parallel on gathered weights (same results, the whole model in memory on every GPU)"
        )
    if cfg.algorithm.use_kl_in_reward and cfg.actor_rollout_ref.actor.use_kl_loss:
        notify("both algorithm.use_kl_in_reward and actor.use_kl_loss are on: the KL is penalized twice")
    _reward_notes(cfg, notify)
    if (
        cfg.algorithm.use_kl_in_reward
        and est in STD_GROUP_ESTIMATORS
        and cfg.algorithm.norm_adv_by_std_in_grpo
    ):
        notify(
            f"algorithm.use_kl_in_reward=True with adv_estimator={est} and norm_adv_by_std_in_grpo=True: in "
            "a group whose task scores are all equal (most groups while the reward is sparse) the division "
            "by the "
            "group's std turns the KL penalty alone into advantages of size ~1, whatever kl_ctrl.kl_coef, "
            "and they pull every response toward the reference instead of toward the task; put the KL in "
            "the loss (actor.use_kl_loss=True, use_kl_in_reward=False) or set "
            f"algorithm.norm_adv_by_std_in_grpo=False ({_KEEP_CLOSE})"
        )


def _token_budgets(cfg: KLPPOConfig) -> None:
    arr, d = cfg.actor_rollout_ref, cfg.data
    longest = d.max_prompt_length + d.max_response_length
    budgets = []
    if arr.actor.use_dynamic_bsz:
        sp = arr.actor.ulysses_sequence_parallel_size
        budgets.append(
            ("actor_rollout_ref.actor.ppo_max_token_len_per_gpu", arr.actor.ppo_max_token_len_per_gpu, sp)
        )
    if arr.rollout.log_prob_use_dynamic_bsz:
        budgets.append(
            (
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu",
                arr.rollout.log_prob_max_token_len_per_gpu,
                arr.actor.ulysses_sequence_parallel_size,
            )
        )
    if arr.ref.log_prob_use_dynamic_bsz:
        budgets.append(
            (
                "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
                arr.ref.log_prob_max_token_len_per_gpu,
                arr.ref.ulysses_sequence_parallel_size,
            )
        )
    if uses_critic(cfg) and cfg.critic.use_dynamic_bsz:
        sp = cfg.critic.ulysses_sequence_parallel_size
        budgets.append(("critic.ppo_max_token_len_per_gpu", cfg.critic.ppo_max_token_len_per_gpu, sp))
        budgets.append(("critic.forward_max_token_len_per_gpu", cfg.critic.forward_max_token_len_per_gpu, sp))
    for key, budget, sp in budgets:
        if budget * sp < longest:
            raise ConfigError(
                f"{key}={budget} tokens (× ulysses {sp}) cannot hold one sequence of "
                f"data.max_prompt_length={d.max_prompt_length} + "
                f"data.max_response_length={d.max_response_length} = {longest} tokens; set it ≥ "
                f"{-(-longest // sp)}"
            )


def _packed_roles(cfg: KLPPOConfig) -> list[tuple[str, object, int]]:
    """(key prefix, model group, Ulysses size) of each model whose packed passes ``compile_packed_layers``
    compiles: the actor's (with the reference's passes) and the critic's."""
    arr = cfg.actor_rollout_ref
    return [
        (
            "actor_rollout_ref.model",
            arr.model,
            max(arr.actor.ulysses_sequence_parallel_size, arr.ref.ulysses_sequence_parallel_size),
        ),
        ("critic.model", cfg.critic.model, cfg.critic.ulysses_sequence_parallel_size),
    ]


def _compiled_layers(cfg: KLPPOConfig) -> None:
    """``*.model.compile_packed_layers`` compiles the packed forwards only, without Ulysses."""
    for prefix, model, sp in _packed_roles(cfg):
        if not model.compile_packed_layers:
            continue
        if not model.use_remove_padding:
            raise ConfigError(
                f"{prefix}.compile_packed_layers=True compiles the packed forwards, but "
                f"{prefix}.use_remove_padding=False; set it to True"
            )
        if sp > 1:
            raise ConfigError(
                f"{prefix}.compile_packed_layers=True is not built with Ulysses sequence parallelism "
                f"(ulysses_sequence_parallel_size={sp}); set it to False"
            )
        if os.environ.get("KLPPO_COMPILE_DYNAMIC_TOKENS", "").strip():
            raise ConfigError(
                f"{prefix}.compile_packed_layers=True: KLPPO_COMPILE_DYNAMIC_TOKENS is not a klppo setting "
                "(the compiled layers always run unpadded with dynamic token dims; there are no static "
                "token buckets); unset it"
            )


def compiled_layers_advice(cfg: KLPPOConfig) -> list[str]:
    """On a GPU: for each role whose packed passes could run compiled decoder layers but do not
    (``compile_packed_layers`` off with ``use_remove_padding`` on and no Ulysses), the sentence that says what
    to set and what it costs; the critic only when the run has one."""
    out = []
    for prefix, model, sp in _packed_roles(cfg):
        if prefix == "critic.model" and not uses_critic(cfg):
            continue
        if not model.compile_packed_layers and model.use_remove_padding and sp == 1:
            out.append(_COMPILED_LAYERS_ADVICE[prefix])
    return out


def background_scoring_advice(cfg: KLPPOConfig) -> str | None:
    """On a GPU, where reward functions score in the step (no reward model, ``launch_reward_fn_async``
    off, as verl's default): the sentence that says to score in the background."""
    rm = cfg.reward_model
    if rm.enable or rm.launch_reward_fn_async:
        return None
    return (
        "reward_model.launch_reward_fn_async=True decodes the responses and runs the reward function in "
        "worker processes (reward_model.num_workers per rank) while the log-prob, reference and value "
        "passes "
        "run, with the same scores (docs/training.md, 'Rewards')"
    )


def critic_budget_advice(cfg: KLPPOConfig, *, critic_mini_batch_tokens: int | None) -> str | None:
    """On a GPU, with token-budget micro-batches for actor and critic and the critic on the actor's model:
    when the critic's mini-batch (``critic_mini_batch_tokens`` per rank, an upper bound) takes several
    micro-batches of a budget smaller than the actor's, the sentence that says to give the critic the
    actor's budget. At equal tokens its passes need less memory than the actor's (a value head where the
    actor has vocabulary logits; both models are resident in either update), so the actor's budget — which
    the pre-flight weighs — is safe for it, and fewer micro-batches cut the host work per step."""
    arr, critic = cfg.actor_rollout_ref, cfg.critic
    if not uses_critic(cfg) or not (arr.actor.use_dynamic_bsz and critic.use_dynamic_bsz):
        return None
    if critic.model.path not in (None, arr.model.path) or not critic_mini_batch_tokens:
        return None
    actor_budget, budget = arr.actor.ppo_max_token_len_per_gpu, critic.ppo_max_token_len_per_gpu
    if budget >= actor_budget or critic_mini_batch_tokens <= budget:
        return None
    return (
        f"critic.ppo_max_token_len_per_gpu={budget} cuts the critic's mini-batch (up to "
        f"{critic_mini_batch_tokens:,} tokens per rank) into up to {-(-critic_mini_batch_tokens // budget)} "
        f"micro-batches; critic.ppo_max_token_len_per_gpu={actor_budget} and "
        f"critic.forward_max_token_len_per_gpu={actor_budget} (the actor's budget) need less memory than the "
        "actor's passes at that budget (a value head instead of vocabulary logits), and fewer, larger "
        "micro-batches cut the per-step host work"
    )


_COMPILED_PASSES = "docs/training.md, 'Compiled passes'"
_COMPILED_LAYERS_ADVICE = {
    "actor_rollout_ref.model": (
        "actor_rollout_ref.model.compile_packed_layers=True compiles the decoder layers of the actor's and "
        "the reference's packed passes, which then take less time and memory, for a compilation in the "
        f"first passes ({_COMPILED_PASSES})"
    ),
    "critic.model": (
        "critic.model.compile_packed_layers=True compiles the critic's packed passes, which then take less "
        f"time at more peak memory ({_COMPILED_PASSES})"
    ),
}


def tp_rollout_unbuilt(cfg: KLPPOConfig) -> str | None:
    """Why a tensor-parallel rollout cannot run with this config (the rollout then runs data-parallel on
    gathered weights), or None: LoRA (the adapters would have to be merged into the slices) or the hf
    backend."""
    arr = cfg.actor_rollout_ref
    if arr.model.lora_rank > 0:
        return "LoRA (model.lora_rank > 0)"
    if arr.rollout.name != "klppo":
        return f"rollout.name={arr.rollout.name}"
    return None


PI_CLIMB_NOTE_STEPS = 25


def _pi_floor_note(prefix: str, ctrl, init_key: str, init_coef: float, notify: Notify) -> None:
    """A note when the pi controller's floor is far below its start: while the KL is ≈ 0 (the first steps)
    β sinks to min_coef, and ln β climbs back by at most ki per step (log error clipped to ±1)."""
    steps = math.log(init_coef / ctrl.min_coef) / ctrl.ki
    if steps > PI_CLIMB_NOTE_STEPS:
        notify(
            f"{prefix}: with min_coef={ctrl.min_coef:g} and ki={ctrl.ki:g}, β can sink to the floor while "
            f"the KL is ≈ 0 in the first steps and then needs ≥ {steps:.0f} steps to climb back to "
            f"{init_key}={init_coef:g} once the policy moves, while the KL runs over its target; raise "
            f"min_coef toward {init_coef:g} or ki ({_KEEP_CLOSE})"
        )


def _check_kl_controller(prefix: str, ctrl, init_coef: float) -> None:
    """A controller's target, anneal and (pi) bounds, named by key, before anything loads."""
    if ctrl.type == "fixed":
        if ctrl.target_kl_start is not None:
            raise ConfigError(
                f"{prefix}.target_kl_start={ctrl.target_kl_start}: an annealed target needs {prefix}.type "
                "adaptive or pi (fixed keeps β constant and has no target)"
            )
        return
    if ctrl.target_kl_start is not None and ctrl.target_kl_start <= 0:
        raise ConfigError(
            f"{prefix}.target_kl_start={ctrl.target_kl_start}: the annealed target needs a start > 0"
        )
    if ctrl.anneal_begin < 0 or ctrl.anneal_steps < 0:
        raise ConfigError(
            f"{prefix}.anneal_begin={ctrl.anneal_begin}, anneal_steps={ctrl.anneal_steps}: both must be ≥ 0"
        )
    if ctrl.target_kl_start is None and (ctrl.anneal_begin or ctrl.anneal_steps):
        raise ConfigError(
            f"{prefix}.anneal_begin/anneal_steps are set but {prefix}.target_kl_start is null: set "
            "target_kl_start (the target before the decay) or drop the anneal keys"
        )
    if ctrl.target_kl is None or ctrl.target_kl <= 0:
        raise ConfigError(
            f"{prefix}.target_kl={ctrl.target_kl}: the {ctrl.type} controller needs a target > 0"
        )
    if ctrl.type == "pi":
        if not 0 < ctrl.min_coef <= init_coef <= ctrl.max_coef:
            raise ConfigError(
                f"{prefix}.min_coef={ctrl.min_coef}, max_coef={ctrl.max_coef}: the pi controller needs 0 < "
                f"min_coef ≤ the initial coefficient ({init_coef}) ≤ max_coef"
            )
        if ctrl.kp < 0 or ctrl.ki <= 0:
            raise ConfigError(
                f"{prefix}.kp={ctrl.kp}, ki={ctrl.ki}: the pi controller needs kp ≥ 0 and ki > 0"
            )
