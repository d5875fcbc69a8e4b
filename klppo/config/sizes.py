"""The one place batch sizes are derived per rank: `derive_sizes(cfg, world_size) -> Sizes`.

verl's units, stated once: `data.train_batch_size` and `ppo_mini_batch_size` count PROMPTS; every
`*_micro_batch_size_per_gpu` counts SAMPLES (prompt × response pairs) on one GPU; a step holds
`train_batch_size × rollout.n` samples. Each rank generates for `train_batch_size / world_size` prompts
(so a prompt's n samples stay on one rank, as group advantages need); training splits each update's
samples over the `world_size / ulysses_sequence_parallel_size` data-parallel groups.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from klppo.config.errors import ConfigError
from klppo.config.schema import KLPPOConfig, RewardModelConfig, TrainerConfig
from klppo.config.schema_arr import ModelConfig

CRITIC_ESTIMATORS = ("gae",)


@dataclass(frozen=True)
class Sizes:
    """Per-step and per-rank sizes (samples unless the name says prompts); micro sizes are None when
    `use_dynamic_bsz` forms micro-batches by token budget instead."""

    world_size: int
    actor_dp_size: int
    samples_per_step: int
    prompts_per_rank: int
    samples_per_rank: int
    num_mini_batches: int  # per ppo epoch, same for actor and critic when they share the mini size
    num_actor_updates_per_step: int  # optimizer steps = ppo_epochs × num_mini_batches
    actor_mini_batch_samples_per_rank: int
    actor_micro_batch_size_per_gpu: int | None
    actor_grad_accum_steps: int | None
    log_prob_micro_batch_size_per_gpu: int | None  # old log-probs (rollout.log_prob_*)
    ref_log_prob_micro_batch_size_per_gpu: int | None
    uses_critic: bool
    critic_dp_size: int | None
    critic_mini_batch_samples_per_rank: int | None
    critic_micro_batch_size_per_gpu: int | None
    critic_forward_micro_batch_size_per_gpu: int | None
    num_critic_updates_per_step: int | None
    reward_micro_batch_size_per_gpu: int | None = None  # the reward model's forwards (None: token budget)
    logged_prompts_per_step: int = 0  # prompt groups read from data.logged_files, not generated


def uses_critic(cfg: KLPPOConfig) -> bool:
    """Whether the run builds and trains a critic: exactly when the advantage estimator reads values (GAE;
    ``klppo.algorithms.advantages.needs_critic`` says the same, tested). ``critic.enable`` does not change
    it: False with GAE is refused and True with a critic-free estimator gets a note at load
    (``config.checks``), so the sizes, the checks, the plan and the roles built all read this one rule."""
    return cfg.algorithm.adv_estimator in CRITIC_ESTIMATORS


def uses_lora(model: ModelConfig) -> bool:
    """Whether the actor trains LoRA adapters (``actor_rollout_ref.model``: a rank, or an adapter to start
    from); the reference is then the actor's own model with the adapters off, not a model of its own."""
    return model.lora_rank > 0 or bool(model.lora_adapter_path)


def logged_prompts_per_step(cfg: KLPPOConfig) -> int:
    """The prompt groups of a step read from ``data.logged_files`` (``rollout.n`` logged samples each); the
    step generates for the other ``train_batch_size`` minus this many prompts. ``logged_share`` ×
    ``train_batch_size`` rounded to the nearest whole group, halves up; 0 without logged files."""
    data = cfg.data
    if not data.logged_files:
        return 0
    return math.floor(data.logged_share * data.train_batch_size + 0.5)


def check_logged_share(cfg: KLPPOConfig) -> None:
    """A share strictly between 0 and 1 (a mixed run) needs logged files and must give each source at least
    one prompt group of a step."""
    share, tb = cfg.data.logged_share, cfg.data.train_batch_size
    if share in (0, 1):
        return
    if not cfg.data.logged_files:
        raise ConfigError(
            f"data.logged_share={share} reads part of each step from data.logged_files, which is not set: "
            "set it, or data.logged_share=0 to generate every sample"
        )
    num_logged = logged_prompts_per_step(cfg)
    if num_logged in (0, tb):
        source = "the logs" if num_logged == 0 else "generation"
        raise ConfigError(
            f"data.logged_share={share} leaves {source} none of the data.train_batch_size={tb} prompt "
            f"groups of a step ({share} × {tb} rounds to {num_logged} from the logs): for a mixed step "
            f"choose a share in [{0.5 / tb:.4g}, {1 - 0.5 / tb:.4g}), or 0 (generate only) or 1 (logs only)"
        )


def check_prompt_counts(cfg: KLPPOConfig) -> None:
    """World-size-free rules on prompt counts (train_batch_size vs ppo_mini_batch_size, the logged share)."""
    check_logged_share(cfg)
    tb, n = cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n
    for key, mini in (
        ("actor_rollout_ref.actor.ppo_mini_batch_size", cfg.actor_rollout_ref.actor.ppo_mini_batch_size),
        ("critic.ppo_mini_batch_size", cfg.critic.ppo_mini_batch_size),
    ):
        if key.startswith("critic") and not uses_critic(cfg):
            continue
        if mini > tb:
            raise ConfigError(
                f"{key}={mini} prompts is larger than data.train_batch_size={tb} prompts (both count "
                f"prompts; each is multiplied by rollout.n={n} samples): set {key} ≤ {tb}"
            )
        if tb % mini:
            raise ConfigError(
                f"data.train_batch_size={tb} prompts is not a multiple of {key}={mini} prompts, so a step "
                f"would not split into whole mini-batches (updates of {mini}×{n}={mini * n} samples); choose "
                f"a divisor of {tb}, e.g. {_divisor_near(tb, mini)}"
            )


def total_training_steps(trainer: TrainerConfig, batches_per_epoch: int) -> int:
    """The run's last step: ``trainer.total_training_steps``, else ``total_epochs`` × batches per epoch."""
    return trainer.total_training_steps or batches_per_epoch * trainer.total_epochs


def derive_sizes(cfg: KLPPOConfig, world_size: int) -> Sizes:
    """All per-rank sizes for `world_size` processes; ConfigError with the numbers when they do not divide."""
    if world_size < 1:
        raise ConfigError(f"world size must be ≥ 1, got {world_size}")
    check_prompt_counts(cfg)
    arr = cfg.actor_rollout_ref
    actor, rollout, ref = arr.actor, arr.rollout, arr.ref
    tb, n = cfg.data.train_batch_size, rollout.n
    samples = tb * n
    if tb % world_size:
        raise ConfigError(
            f"data.train_batch_size={tb} prompts is not divisible by the {world_size} "
            f"ranks{_ranks_src(cfg, world_size)}: each rank generates rollout.n={n} samples for its own "
            f"share of prompts; choose a multiple of {world_size}"
        )
    num_logged = logged_prompts_per_step(cfg)
    if num_logged % world_size:
        raise ConfigError(
            f"data.logged_share={cfg.data.logged_share} reads {num_logged} of the {tb} prompt groups of a "
            f"step from the logs, not divisible by the {world_size} ranks{_ranks_src(cfg, world_size)}: each "
            "rank takes its share of the logged groups and generates for its share of the other prompts; "
            f"choose a share that gives a multiple of {world_size} groups"
        )
    a_dp, a_mini, a_micro = _role(
        "actor_rollout_ref.actor",
        actor.ppo_mini_batch_size,
        n,
        world_size,
        actor.ulysses_sequence_parallel_size,
        actor.ppo_micro_batch_size,
        actor.ppo_micro_batch_size_per_gpu,
        actor.use_dynamic_bsz,
    )
    lp = _micro(
        "actor_rollout_ref.rollout.log_prob",
        rollout.log_prob_micro_batch_size,
        rollout.log_prob_micro_batch_size_per_gpu,
        world_size,
        rollout.log_prob_use_dynamic_bsz,
        a_micro or samples // world_size,
    )
    ref_lp = _micro(
        "actor_rollout_ref.ref.log_prob",
        ref.log_prob_micro_batch_size,
        ref.log_prob_micro_batch_size_per_gpu,
        world_size,
        ref.log_prob_use_dynamic_bsz,
        lp,
    )
    num_mini = tb // actor.ppo_mini_batch_size
    has_critic = uses_critic(cfg)
    c_dp, c_mini, c_micro, c_fwd, c_updates = _critic_sizes(cfg, world_size) if has_critic else (None,) * 5
    _check_rollout_tp(cfg, world_size)
    rm_micro = _reward_micro(cfg.reward_model, world_size)
    return Sizes(
        world_size=world_size,
        actor_dp_size=a_dp,
        samples_per_step=samples,
        prompts_per_rank=tb // world_size,
        samples_per_rank=samples // world_size,
        num_mini_batches=num_mini,
        num_actor_updates_per_step=actor.ppo_epochs * num_mini,
        actor_mini_batch_samples_per_rank=a_mini,
        actor_micro_batch_size_per_gpu=a_micro,
        actor_grad_accum_steps=None if a_micro is None else a_mini // a_micro,
        log_prob_micro_batch_size_per_gpu=lp,
        ref_log_prob_micro_batch_size_per_gpu=ref_lp,
        uses_critic=has_critic,
        critic_dp_size=c_dp,
        critic_mini_batch_samples_per_rank=c_mini,
        critic_micro_batch_size_per_gpu=c_micro,
        critic_forward_micro_batch_size_per_gpu=c_fwd,
        num_critic_updates_per_step=c_updates,
        reward_micro_batch_size_per_gpu=rm_micro,
        logged_prompts_per_step=num_logged,
    )


def _critic_sizes(cfg: KLPPOConfig, world_size: int) -> tuple[int, int, int | None, int | None, int]:
    """The critic's (data-parallel size, mini-batch samples per rank, update micro-batch, forward
    micro-batch, updates per step)."""
    crit, tb = cfg.critic, cfg.data.train_batch_size
    c_dp, c_mini, c_micro = _role(
        "critic",
        crit.ppo_mini_batch_size,
        cfg.actor_rollout_ref.rollout.n,
        world_size,
        crit.ulysses_sequence_parallel_size,
        crit.ppo_micro_batch_size,
        crit.ppo_micro_batch_size_per_gpu,
        crit.use_dynamic_bsz,
    )
    c_fwd = _micro(
        "critic.forward",
        crit.forward_micro_batch_size,
        crit.forward_micro_batch_size_per_gpu,
        world_size,
        crit.use_dynamic_bsz,
        c_micro,
    )
    return c_dp, c_mini, c_micro, c_fwd, crit.ppo_epochs * (tb // crit.ppo_mini_batch_size)


def _check_rollout_tp(cfg: KLPPOConfig, world_size: int) -> None:
    """The rollout's tensor-parallel size divides the ranks."""
    tp = cfg.actor_rollout_ref.rollout.tensor_model_parallel_size
    if tp > 1 and world_size % tp:
        raise ConfigError(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp} does not divide the {world_size} "
            "ranks"
            f"{_ranks_src(cfg, world_size)}: the rollout's tensor-parallel groups are {tp} consecutive "
            f"ranks; choose a divisor of {world_size}"
        )


def _reward_micro(rm: RewardModelConfig, world_size: int) -> int | None:
    """The reward model's micro-batch per GPU (None without a reward model)."""
    if not rm.enable:
        return None
    return _micro(
        "reward_model.",
        rm.micro_batch_size,
        rm.micro_batch_size_per_gpu,
        world_size,
        rm.use_dynamic_bsz,
        16,
    )


def _role(
    prefix: str,
    mini: int,
    n: int,
    world: int,
    sp: int,
    micro_global: int | None,
    micro: int | None,
    dynamic: bool,
) -> tuple[int, int, int | None]:
    """(data-parallel size, mini-batch samples per rank, micro-batch samples per GPU or None)."""
    if world % sp:
        raise ConfigError(f"{prefix}.ulysses_sequence_parallel_size={sp} does not divide the {world} ranks")
    dp = world // sp
    mini_samples = mini * n
    if mini_samples % dp:
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size={mini} prompts × rollout.n={n} = {mini_samples} samples per "
            f"update is not divisible by {dp} data-parallel ranks ({world} ranks / ulysses {sp}); choose "
            f"ppo_mini_batch_size so that {mini}×{n} is a multiple of {dp}"
        )
    per_rank = mini_samples // dp
    micro = _micro(prefix + ".ppo", micro_global, micro, dp, dynamic, per_rank)
    if micro is not None and per_rank % micro:
        raise ConfigError(
            f"{prefix}.ppo_mini_batch_size={mini} prompts × rollout.n={n} = {mini_samples} samples per "
            f"update / {dp} data-parallel ranks = {per_rank} samples per GPU, not divisible by "
            f"{prefix}.ppo_micro_batch_size_per_gpu={micro} samples; choose a divisor of {per_rank} (e.g. "
            f"{_divisor_near(per_rank, micro)}) or use_dynamic_bsz=True"
        )
    return dp, per_rank, micro


def _micro(
    prefix: str, global_size: int | None, per_gpu: int | None, dp: int, dynamic: bool, fallback: int | None
) -> int | None:
    """Micro-batch samples per GPU: per_gpu, else deprecated global size / dp, else `fallback`. ``prefix``
    ends the key before ``micro_batch_size`` (``critic.forward_`` style is written ``critic.forward``; the
    reward model's ``reward_model.``)."""
    if not prefix.endswith("."):
        prefix += "_"
    if dynamic:
        return None
    if global_size is not None and per_gpu is not None and global_size // dp != per_gpu:
        raise ConfigError(
            f"{prefix}micro_batch_size={global_size} (samples over all GPUs, deprecated) and "
            f"{prefix}micro_batch_size_per_gpu={per_gpu} are both set; set only the _per_gpu one"
        )
    if per_gpu is not None:
        return per_gpu
    if global_size is not None:
        if global_size % dp:
            raise ConfigError(
                f"{prefix}micro_batch_size={global_size} samples over all GPUs is not divisible by {dp} "
                f"data-parallel ranks; set {prefix}micro_batch_size_per_gpu instead"
            )
        return global_size // dp
    return fallback


def _divisor_near(total: int, want: int) -> int:
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    return min(divisors, key=lambda d: (abs(d - want), -d))


def _ranks_src(cfg: KLPPOConfig, world_size: int) -> str:
    t = cfg.trainer
    if config_world_size(cfg) != world_size or not isinstance(t.n_gpus_per_node, int):
        return ""
    return f" (trainer.n_gpus_per_node={t.n_gpus_per_node} × trainer.nnodes={t.nnodes})"


def config_world_size(cfg: KLPPOConfig) -> int:
    """World size judged from the config alone: n_gpus_per_node × nnodes when set, else 1 (auto)."""
    n = cfg.trainer.n_gpus_per_node
    return n * cfg.trainer.nnodes if isinstance(n, int) else 1
