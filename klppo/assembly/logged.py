"""The logged-sample loader of a run (``data.logged_files``): its settings from the configuration, and the
checks that need the configuration as well as the logs (what stands in for missing behaviour log-probs).
Reads the model's config for its vocabulary size, never its weights."""

from __future__ import annotations

import logging
from typing import Any

from transformers import AutoConfig

from klppo.algorithms.advantages import get_advantage_estimator
from klppo.config import KLPPOConfig, logged_prompts_per_step
from klppo.data.logged import LoggedLoader, LoggedSettings
from klppo.data.parquet_rows import DataError
from klppo.models.loading import model_dir

log = logging.getLogger("klppo")


def log_prob_need(cfg: KLPPOConfig) -> str:
    """What the configured rollout correction needs of the behaviour log-probs: ``required`` in bypass mode
    (π_old is the behaviour policy), ``wanted`` with decoupled importance weights or rejection (the
    reference, i.e. the initial model, stands in where the logs lack them), ``no`` without a correction."""
    rc = cfg.algorithm.rollout_correction
    if rc.bypass_mode:
        return "required"
    return "wanted" if rc.rollout_is is not None or rc.rollout_rs is not None else "no"


def model_vocab_size(cfg: KLPPOConfig, tokenizer: Any) -> int:
    """The policy's vocabulary size from its config.json (the tokenizer's length when the config has none)."""
    path = model_dir(cfg.actor_rollout_ref.model.path, key="actor_rollout_ref.model.path")
    config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.actor_rollout_ref.model.trust_remote_code)
    text = getattr(config, "text_config", None) or config
    return int(getattr(text, "vocab_size", None) or len(tokenizer))


def logged_settings(cfg: KLPPOConfig, *, vocab_size: int, files: list[str]) -> LoggedSettings:
    """The loader of ``files`` (``data.logged_files``) for this run's sizes, estimator and correction."""
    data = cfg.data
    needs_groups = get_advantage_estimator(cfg.algorithm.adv_estimator).needs_group_ids
    return LoggedSettings(
        files=files,
        groups_per_batch=logged_prompts_per_step(cfg),
        samples_per_group=cfg.actor_rollout_ref.rollout.n,
        max_prompt_length=data.max_prompt_length,
        max_response_length=data.max_response_length,
        vocab_size=vocab_size,
        min_group_size=2 if needs_groups else 1,
        needs_log_probs=log_prob_need(cfg),
        overlong=data.logged_overlong,
        filter_overlong_prompts=data.filter_overlong_prompts,
        prompt_key=data.prompt_key,
        reward_fn_key=data.reward_fn_key,
        shuffle=data.shuffle,
        seed=data.seed if data.seed is not None else cfg.trainer.seed,
        use_chat_template=data.use_chat_template,
        apply_chat_template_kwargs=dict(data.apply_chat_template_kwargs),
    )


def build_logged_loader(cfg: KLPPOConfig, tokenizer: Any, files: list[str]) -> LoggedLoader:
    """The run's logged-sample loader, checked against what the run needs of it (one line per problem)."""
    if get_advantage_estimator(cfg.algorithm.adv_estimator).needs_reward_baselines:
        raise DataError(
            f"data.logged_files with algorithm.adv_estimator={cfg.algorithm.adv_estimator}: its greedy "
            "baseline needs a generation per step; use grpo, rloo or gae"
        )
    loader = LoggedLoader(
        logged_settings(cfg, vocab_size=model_vocab_size(cfg, tokenizer), files=files), tokenizer
    )
    arr = cfg.actor_rollout_ref
    if loader.behaviour() == "reference" and not (cfg.algorithm.use_kl_in_reward or arr.actor.use_kl_loss):
        raise DataError(
            f"{loader.source.paths[0]}: no column 'response_log_probs' in every row, and the "
            "decoupled rollout correction (algorithm.rollout_correction.rollout_is / rollout_rs) needs "
            "behaviour log-probs; the reference (the initial model) stands in when it is loaded "
            "(actor.use_kl_loss or algorithm.use_kl_in_reward) — set one, log them, or unset rollout_is "
            "and rollout_rs"
        )
    return loader
