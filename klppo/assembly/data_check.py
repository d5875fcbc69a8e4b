"""Start-up check of the prompt data, before any process starts or any weight loads (`klppo train`, its
``--dry-run`` included): every problem is one line and exit code 2.

What it finds: a file that is missing, empty or not Parquet; a missing prompt column; a bad row under
``data.bad_row_policy=error``; a prompt longer than ``data.max_prompt_length`` under
``data.truncation=error`` (anywhere in the files, not when its batch comes up); no usable prompts or fewer
than one batch; a file without the ``reward_model`` column (the ground truth) when the rule reward scores
it. It reports how many prompts are filtered or truncated. The scan is the loader's own construction
scan (tokenizer only), so the trainer ranks repeat it; for a very large set this doubles the start-up
scan, which is the price of refusing bad data before the weights load.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np

from klppo.assembly.logged import build_logged_loader
from klppo.config import KLPPOConfig, logged_prompts_per_step
from klppo.data.dataset import LoaderSettings, PromptLoader
from klppo.data.logged import LoggedLoader
from klppo.data.mixed import MixedLoader
from klppo.data.parquet_rows import DataError
from klppo.models.loading import load_tokenizer, model_dir
from klppo.rewards.registry import SCORERS, check_custom_reward_file

log = logging.getLogger("klppo")
GROUND_TRUTH_COLUMN = "reward_model"


def uses_rule_reward(cfg: KLPPOConfig) -> bool:
    """Scores come from the built-in rule scorers (they need each row's ground truth)."""
    return not cfg.reward_model.enable and not cfg.custom_reward_function.path


def check_ground_truth_columns(cfg: KLPPOConfig, loaders: dict[str, Any]) -> None:
    """With the rule reward, every file needs the ``reward_model`` column (``{"ground_truth": ...}``);
    without it every score would silently be 0."""
    if not uses_rule_reward(cfg):
        return
    for split, loader in loaders.items():
        if isinstance(loader, LoggedLoader) and not loader.num_unscored:
            continue  # every logged sample has its score: nothing is scored by the rule
        for f, path in enumerate(loader.source.paths):
            if GROUND_TRUTH_COLUMN not in loader.source.column_names(f):
                raise DataError(
                    f"{path} ({split} data) has no {GROUND_TRUTH_COLUMN!r} column: the rule reward needs "
                    "each "
                    "row's reward_model.ground_truth (every score would be 0); add the column (`klppo data "
                    "gsm8k` writes it), or set custom_reward_function.path or reward_model.enable=True"
                )
        _check_rule_reward_rows(loader, split)


def _check_rule_reward_rows(loader: Any, split: str) -> None:
    """Every row the loader uses has a ground truth and a data source with a built-in scorer: a row without
    the one scored 0 in silence, one without the other stopped the run with a traceback at its first
    scoring. Rows the loader leaves out (bad, filtered, past ``*_max_samples``) are not judged; in the
    streaming mode (``data.shuffle_buffer_rows``) the loader keeps no list of its rows, and this check
    does not run."""
    kept = getattr(loader, "_valid_ids", None)
    if kept is None:
        return
    key, source = loader.reward_fn_key, loader.source
    kept = np.sort(np.asarray(kept))
    missing: dict[int, list[int]] = {}
    unknown: dict[str, tuple[int, int]] = {}
    for f, _, first, table in source.iter_row_groups([GROUND_TRUTH_COLUMN, key]):
        lo, hi = np.searchsorted(kept, [first, first + table.num_rows])  # kept is sorted: this group's slice
        if lo == hi:
            continue
        truths = table.column(GROUND_TRUTH_COLUMN).to_pylist()
        names = table.column(key).to_pylist() if key in table.column_names else [None] * len(truths)
        for i in kept[lo:hi] - first:
            truth, name = truths[i], names[i] or ""
            if not isinstance(truth, dict) or truth.get("ground_truth") is None:
                missing.setdefault(f, []).append(source.locate(first + int(i))[1])
            if name not in SCORERS and name not in unknown:
                unknown[name] = (f, source.locate(first + int(i))[1])
    if missing:
        f, rows = next(iter(missing.items()))
        raise DataError(
            f"{source.paths[f]} ({split} data): {len(rows)} row(s) without reward_model.ground_truth (first: "
            f"row {rows[0]}): the rule reward would score them 0; fill them in, or set "
            "custom_reward_function.path"
        )
    if unknown:
        name, (f, row) = next(iter(unknown.items()))
        what = (
            f"no {key!r} column (data.reward_fn_key)"
            if key not in source.column_names(f)
            else f"{key} (data.reward_fn_key) {sorted(unknown)[:5]!r} (first: row {row})"
        )
        raise DataError(
            f"{source.paths[f]} ({split} data): {what} — no built-in scorer for it (registered: "
            f"{', '.join(sorted(SCORERS))}); set custom_reward_function.path/name to score other data sources"
        )


def build_loaders(
    cfg: KLPPOConfig, tokenizer: Any
) -> tuple[PromptLoader | LoggedLoader | MixedLoader, PromptLoader | None]:
    """The training loader — prompts to generate for, the logged samples (``data.logged_files`` with
    ``data.logged_share=1``), or both (a share between 0 and 1) — and the validation loader (None without
    ``data.val_files``)."""
    from klppo.assembly.settings import data_paths, loader_settings  # noqa: PLC0415  heavy (roles, engine): not for a bad key

    def make(settings: LoaderSettings | None) -> PromptLoader | None:
        return None if settings is None else PromptLoader(settings, tokenizer)

    val = make(loader_settings(cfg.data, seed=cfg.trainer.seed, validation=True))
    prompts = loader_settings(cfg.data, seed=cfg.trainer.seed, validation=False)
    logged, share = data_paths(cfg.data.logged_files), cfg.data.logged_share
    if logged and share == 0:
        log.info("data.logged_share=0: every sample is generated, data.logged_files is not read")
    if not logged or share == 0:
        return make(prompts), val
    logs = build_logged_loader(cfg, tokenizer, logged)
    log.info("behaviour log-probs of the logged samples: %s (docs/data.md)", logs.behaviour())
    if share == 1:  # logged responses instead of prompts to generate for
        return logs, val
    num_fresh = cfg.data.train_batch_size - logged_prompts_per_step(cfg)
    return MixedLoader(make(dataclasses.replace(prompts, batch_size=num_fresh)), logs), val


def check_data(cfg: KLPPOConfig, tokenizer: Any) -> dict[str, Any]:
    """Scan the train and validation files as the trainer will; returns the loaders by split (their
    ``summary()`` is the caller's to print). Raises :class:`DataError` (or ``FileNotFoundError``) with one
    line on the first problem."""
    fn = cfg.custom_reward_function
    if fn.path:  # before any weights: a bad file is one line, not a traceback after loading
        check_custom_reward_file(fn.path, fn.name)
    train, val = build_loaders(cfg, tokenizer)
    loaders = {"train": train} if val is None else {"train": train, "validation": val}
    check_ground_truth_columns(cfg, by_source(loaders))
    for split, loader in by_source(loaders).items():
        if getattr(loader, "stats", None) is not None and loader.stats.num_truncated:
            log.warning(
                "%s prompts: %d longer than data.max_prompt_length=%d are cut (data.truncation=%s): raise "
                "data.max_prompt_length to keep them whole, or set data.filter_overlong_prompts=True to "
                "leave "
                "them out",
                split,
                loader.stats.num_truncated,
                loader.max_prompt_length,
                loader.truncation,
            )
    return loaders


def by_source(loaders: dict[str, Any]) -> dict[str, Any]:
    """``loaders`` with a mixed run's training loader as its two parts: ``train`` (the prompts) and
    ``train logs``."""
    out: dict[str, Any] = {}
    for split, loader in loaders.items():
        if isinstance(loader, MixedLoader):
            out.update({split: loader.prompts, f"{split} logs": loader.logged})
        else:
            out[split] = loader
    return out


def tokenizer_trusts_code(cfg: KLPPOConfig) -> bool:
    """The policy's tokenizer may run code from its directory: ``data.trust_remote_code`` (what verl's
    launcher passes to it) or ``actor_rollout_ref.model.trust_remote_code`` (what its workers pass)."""
    return bool(cfg.data.trust_remote_code or cfg.actor_rollout_ref.model.trust_remote_code)


def check_data_at_startup(cfg: KLPPOConfig, model_path: str) -> dict[str, Any]:
    """:func:`check_data` with the run's tokenizer (no model weights are read)."""
    mcfg = cfg.actor_rollout_ref.model
    tokenizer = load_tokenizer(
        model_dir(mcfg.tokenizer_path, key="actor_rollout_ref.model.tokenizer_path")
        if mcfg.tokenizer_path
        else model_path,
        trust_remote_code=tokenizer_trusts_code(cfg),
    )
    if mcfg.custom_chat_template:
        tokenizer.chat_template = mcfg.custom_chat_template
    return check_data(cfg, tokenizer)
