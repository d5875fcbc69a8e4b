"""Logged responses: the open Parquet schema of ``docs/data.md``, checked at construction and batched as
samples for a training step that generates nothing.

A row is one sample: verl's prompt columns (``prompt``, ``data_source``, ``reward_model.ground_truth``,
``extra_info``) plus the response (``response_ids`` token ids, or ``response`` text), and optionally the
behaviour policy's per-token log-probs (``response_log_probs``; with top-k / top-p, those of the truncated law
and the log of its kept mass, ``response_log_kept_mass``), a ``score``, a ``group_id`` (the prompt a
sample answers: GRPO/RLOO groups; without it, rows with the same prompt messages form a group), a
per-token ``response_mask`` (1 = a token the model produced), the ``model`` and ``tokenizer`` that made it,
a ``tokenizer_hash`` (:func:`tokenizer_fingerprint`) and the sampling settings (``temperature``, ``top_p``,
``top_k``).

:class:`LoggedLoader` reads the rows of every file once, checks them, and keeps the token ids in memory (two
int lists per sample). Every problem is a :class:`DataError` of one line naming the file, row and column:
a token id beyond the model's vocabulary, a tokenizer fingerprint that is not the run's, a response longer
than ``max_response_length`` (``overlong='error'``; ``'drop'`` leaves out the sample's group, counted), a
missing log-prob where the correction needs it (``needs_log_probs='required'``), a group whose size is not
``samples_per_group`` or is one where the estimator compares samples, a ``response_mask`` with a 0 (tokens
the model did not produce are kept in the schema but not trained yet).

Batches are ``groups_per_batch`` whole groups (``samples_per_group`` consecutive rows each), the groups of
epoch ``e`` in the permutation of ``numpy.random.default_rng([seed, e])``. A batch holds what a rollout
leaves: ``prompts``/``prompt_mask`` (left-padded), ``responses``/``response_mask`` (right-padded to
``max_response_length``), ``rollout_log_probs`` (None unless every sample has them),
``rollout_log_kept_mass`` (with them, where a sample logged ``response_log_kept_mass``: 0 for the others),
``token_level_scores`` (the logged score on the last response token, NaN there where no score was logged:
the trainer scores those samples), ``from_logs`` (all True) and ``uid`` (the group). Knows nothing of
models or the training loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from klppo.batch import Batch
from klppo.data.dataset import encode_prompts
from klppo.data.parquet_rows import DataError, RowGroupSource, normalize_prompt

RESPONSE_IDS, RESPONSE_TEXT, RESPONSE_MASK = "response_ids", "response", "response_mask"
LOG_PROBS, SCORE, GROUP_ID, TOKENIZER_HASH = "response_log_probs", "score", "group_id", "tokenizer_hash"
KEPT_MASS = "response_log_kept_mass"
META_COLUMNS = (
    "data_source",
    "reward_model",
    "extra_info",
    "model",
    "tokenizer",
    "temperature",
    "top_p",
    "top_k",
)
SAMPLE_COLUMNS = (
    RESPONSE_IDS,
    RESPONSE_TEXT,
    RESPONSE_MASK,
    LOG_PROBS,
    KEPT_MASS,
    SCORE,
    GROUP_ID,
    TOKENIZER_HASH,
)
LOG_PROB_NEEDS = ("no", "wanted", "required")
SAMPLE_TYPES = {
    RESPONSE_IDS: pa.list_(pa.int64()),
    RESPONSE_TEXT: pa.string(),
    LOG_PROBS: pa.list_(pa.float32()),
    KEPT_MASS: pa.list_(pa.float32()),
    RESPONSE_MASK: pa.list_(pa.int8()),
    SCORE: pa.float64(),
    GROUP_ID: pa.string(),
    "model": pa.string(),
    "tokenizer": pa.string(),
    TOKENIZER_HASH: pa.string(),
    "temperature": pa.float64(),
    "top_p": pa.float64(),
    "top_k": pa.int64(),
}
"""The types of the schema's sample columns (docs/data.md); the prompt columns are verl's."""


def write_logged(path: str, rows: list[dict[str, Any]], *, row_group_size: int = 1024) -> None:
    """Write logged samples to ``path``: verl's prompt columns as the rows hold them, the sample columns
    that any row sets with the types of :data:`SAMPLE_TYPES`."""
    if not rows:
        raise ValueError(f"no samples to write to {path}")
    verl = [c for c in rows[0] if c not in SAMPLE_TYPES]
    table = pa.Table.from_pylist([{c: r.get(c) for c in verl} for r in rows])
    for name, kind in SAMPLE_TYPES.items():
        if any(name in r for r in rows):
            table = table.append_column(
                pa.field(name, kind), pa.array([r.get(name) for r in rows], type=kind)
            )
    pq.write_table(table, path, row_group_size=row_group_size)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """16 hex digits of the SHA-256 of the tokenizer's vocabulary (token → id, sorted): equal for two
    tokenizers that map every token to the same id."""
    vocab = sorted(tokenizer.get_vocab().items())
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class LoggedSettings:
    """One logged-sample loader (``data.logged_files`` and the keys around it;
    :func:`klppo.assembly.settings.logged_settings` builds it)."""

    files: list[str]
    """Parquet files in the schema of docs/data.md."""
    groups_per_batch: int
    """Groups (prompts) per batch: ``data.train_batch_size`` × ``data.logged_share``, rounded."""
    samples_per_group: int
    """Samples of each group: ``rollout.n`` (a step's size is that of an online step)."""
    max_prompt_length: int
    max_response_length: int
    vocab_size: int
    """The model's vocabulary size (token ids must be below it)."""
    min_group_size: int = 1
    """2 where the advantage estimator compares a prompt's samples (GRPO, RLOO, …)."""
    needs_log_probs: str = "no"
    """``required`` (bypass mode: every sample needs them), ``wanted`` (decoupled correction: the reference
    stands in where they are missing) or ``no``."""
    overlong: str = "error"
    """``error | drop``: a response longer than ``max_response_length`` (drop: its whole group)."""
    filter_overlong_prompts: bool = False
    """Drop a group whose prompt is longer than ``max_prompt_length`` (else an error)."""
    prompt_key: str = "prompt"
    reward_fn_key: str = "data_source"
    shuffle: bool = True
    seed: int = 1
    use_chat_template: bool = True
    apply_chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: list[float] | None
    kept_mass: list[float] | None
    score: float | None
    row: dict[str, Any]
    where: str


class LoggedLoader:
    """Batches of logged samples (whole groups) from Parquet files in the schema of docs/data.md."""

    def __init__(self, settings: LoggedSettings, tokenizer: Any) -> None:
        if settings.overlong not in ("error", "drop"):
            raise ValueError(f"data.logged_overlong must be 'error' or 'drop', got {settings.overlong!r}")
        assert settings.needs_log_probs in LOG_PROB_NEEDS, settings.needs_log_probs
        self.settings, self.tokenizer = settings, tokenizer
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        self.use_template = (
            settings.use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        )
        self.source = RowGroupSource(settings.files)
        for f, path in enumerate(self.source.paths):
            names = self.source.column_names(f)
            if settings.prompt_key not in names:
                raise DataError(
                    f"{path}: no column {settings.prompt_key!r} (data.prompt_key); columns: {names}"
                )
            if RESPONSE_IDS not in names and RESPONSE_TEXT not in names:
                raise DataError(
                    f"{path}: no column {RESPONSE_IDS!r} or {RESPONSE_TEXT!r} (the response); columns: "
                    f"{names} (docs/data.md)"
                )
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.num_dropped = 0
        samples = self._scan()
        self._groups = self._group(samples)
        self.has_log_probs = all(s.log_probs is not None for g in self._groups for s in g)
        self.num_unscored = sum(s.score is None for g in self._groups for s in g)
        self._check_log_probs()
        self.epoch, self._batch_index = 0, 0

    # ---- construction scan ---------------------------------------------------------------------
    def _scan(self) -> list[_Sample]:
        s = self.settings
        columns = [s.prompt_key, s.reward_fn_key, *META_COLUMNS, *SAMPLE_COLUMNS]
        out: list[_Sample] = []
        for f, _, first, table in self.source.iter_row_groups(list(dict.fromkeys(columns))):
            rows = table.to_pylist()
            messages = []
            for i, row in enumerate(rows):
                msgs, reason = normalize_prompt(row.get(s.prompt_key))
                if reason is not None:
                    raise DataError(f"{self._where(first + i)}, column {s.prompt_key!r}: {reason}")
                messages.append(msgs)
            prompt_ids = encode_prompts(
                self.tokenizer, messages, use_template=self.use_template, kwargs=s.apply_chat_template_kwargs
            )
            for i, row in enumerate(rows):
                row["_messages"], row["_file"] = messages[i], f
                out.append(self._sample(row, prompt_ids[i], self._where(first + i)))
        return out

    def _where(self, global_id: int) -> str:
        f, row, _ = self.source.locate(global_id)
        return f"{self.source.paths[f]} row {row}"

    def _sample(self, row: dict[str, Any], prompt_ids: list[int], where: str) -> _Sample:
        s = self.settings
        fp = row.get(TOKENIZER_HASH)
        if fp is not None and fp != self.fingerprint:
            raise DataError(
                f"{where}, column {TOKENIZER_HASH!r}: the log's tokenizer {row.get('tokenizer')!r} "
                f"({fp}) is not the run's ({self.fingerprint}): its token ids mean other tokens; "
                "set actor_rollout_ref.model.tokenizer_path to the log's tokenizer"
            )
        ids = row.get(RESPONSE_IDS)
        if ids is None:
            text = row.get(RESPONSE_TEXT)
            if not isinstance(text, str):
                raise DataError(
                    f"{where}, columns {RESPONSE_IDS!r}/{RESPONSE_TEXT!r}: no response (both null)"
                )
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
            ids += [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        ids = [int(t) for t in ids]
        if not ids:
            raise DataError(f"{where}, column {RESPONSE_IDS!r}: empty response")
        bad = [t for t in ids if not 0 <= t < s.vocab_size]
        if bad:
            raise DataError(
                f"{where}, column {RESPONSE_IDS!r}: token id {bad[0]} is beyond the model's "
                f"vocabulary of {s.vocab_size}"
            )
        mask = row.get(RESPONSE_MASK)
        if mask is not None and (len(mask) != len(ids) or any(m != 1 for m in mask)):
            k = next((k for k, m in enumerate(mask) if m != 1), len(mask))
            raise DataError(
                f"{where}, column {RESPONSE_MASK!r}: "
                + (
                    f"{len(mask)} values for {len(ids)} response tokens"
                    if len(mask) != len(ids)
                    else f"0 at token {k}: tokens the model did not produce (tool output) are not trained yet"
                )
            )
        log_probs, kept = row.get(LOG_PROBS), row.get(KEPT_MASS)
        if kept is not None and log_probs is None:
            raise DataError(f"{where}, column {KEPT_MASS!r}: set without {LOG_PROBS!r}, which it completes")
        for column, values in ((LOG_PROBS, log_probs), (KEPT_MASS, kept)):
            _check_log_values(values, column, len(ids), where)
        score = row.get(SCORE)
        if score is not None and not math.isfinite(float(score)):
            raise DataError(f"{where}, column {SCORE!r}: {score} is not finite (null: the reward scores it)")
        return _Sample(prompt_ids, ids, log_probs, kept, None if score is None else float(score), row, where)

    def _overlong(self, sample: _Sample) -> str | None:
        s = self.settings
        if len(sample.response_ids) > s.max_response_length:
            return (
                f"{sample.where}, column {RESPONSE_IDS!r}: {len(sample.response_ids)} response tokens > "
                f"data.max_response_length={s.max_response_length} (data.logged_overlong=error; 'drop' "
                "leaves out the sample's group)"
            )
        if len(sample.prompt_ids) > s.max_prompt_length:
            return (
                f"{sample.where}, column {s.prompt_key!r}: {len(sample.prompt_ids)} prompt tokens > "
                f"data.max_prompt_length={s.max_prompt_length} (set data.filter_overlong_prompts=True to "
                "leave out the group)"
            )
        return None

    def _group(self, samples: list[_Sample]) -> list[list[_Sample]]:
        """Samples by ``group_id`` (else by prompt), in order of first appearance; overlong ones' groups
        dropped or refused; every group of ``samples_per_group`` samples."""
        s = self.settings
        groups: dict[Any, list[_Sample]] = {}
        for sample in samples:
            gid = sample.row.get(GROUP_ID)
            key = ("id", gid) if gid is not None else ("prompt", json.dumps(sample.row["_messages"]))
            groups.setdefault(key, []).append(sample)
        kept = []
        for group in groups.values():
            problems = [p for p in map(self._overlong, group) if p is not None]
            response_long = any(len(x.response_ids) > s.max_response_length for x in group)
            drop = s.overlong == "drop" if response_long else s.filter_overlong_prompts
            if problems and not drop:
                raise DataError(problems[0])
            if problems:
                self.num_dropped += 1
                continue
            n, first = len(group), group[0]
            if n < s.min_group_size:
                raise DataError(
                    f"{first.where}, column {GROUP_ID!r}: a group of {n} sample(s) — the advantage "
                    "estimator compares a prompt's samples and needs several; log n ≥ 2 samples per "
                    "prompt, or use algorithm.adv_estimator=gae with a critic"
                )
            if n != s.samples_per_group:
                raise DataError(
                    f"{first.where}, column {GROUP_ID!r}: a group of {n} sample(s), but "
                    f"actor_rollout_ref.rollout.n={s.samples_per_group} (samples per prompt in a step)"
                )
            kept.append(group)
        if len(kept) < s.groups_per_batch:
            raise DataError(
                f"{', '.join(self.source.paths)}: {len(kept)} usable groups ({self.num_dropped} "
                f"dropped), fewer than the {s.groups_per_batch} of a step (data.train_batch_size × "
                "data.logged_share)"
            )
        return kept

    def _check_log_probs(self) -> None:
        if self.has_log_probs or self.settings.needs_log_probs != "required":
            return
        first = next(x for g in self._groups for x in g if x.log_probs is None)
        raise DataError(
            f"{first.where}, column {LOG_PROBS!r}: no behaviour log-probs, and "
            "algorithm.rollout_correction.bypass_mode=true takes the PPO ratio against them; log them "
            "(klppo data log does), or set bypass_mode=false"
        )

    def behaviour(self) -> str:
        """Where the step's behaviour log-probs come from: ``logged``, ``reference`` (the reference's, i.e.
        the initial model's, stand in: a decoupled correction without them) or ``none`` (not needed)."""
        if self.has_log_probs:
            return "logged"
        return "reference" if self.settings.needs_log_probs == "wanted" else "none"

    def summary(self) -> str:
        """One line: samples, groups, dropped groups, where the behaviour log-probs come from, scores."""
        samples = [x for g in self._groups for x in g]
        scored = sum(x.score is not None for x in samples)
        return (
            f"{len(samples)} logged samples in {len(self._groups)} groups of "
            f"{self.settings.samples_per_group} ({self.num_dropped} groups dropped); behaviour log-probs: "
            f"{self.behaviour()}; {scored} logged scores, {len(samples) - scored} scored by the reward"
        )

    # ---- batches -------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch."""
        return len(self._groups) // self.settings.groups_per_batch

    def next_batch(self) -> Batch:
        """The next batch of whole groups, moving to the next epoch when the current one is done."""
        if self._batch_index >= len(self):
            self.epoch, self._batch_index = self.epoch + 1, 0
        n = len(self._groups)
        order = (
            np.random.default_rng([self.settings.seed, self.epoch]).permutation(n)
            if self.settings.shuffle
            else np.arange(n)
        )
        k = self.settings.groups_per_batch
        picked = order[self._batch_index * k : (self._batch_index + 1) * k]
        self._batch_index += 1
        return self._collate([x for g in picked for x in self._groups[int(g)]])

    def _collate(self, samples: list[_Sample]) -> Batch:
        b, r = len(samples), self.settings.max_response_length
        width = max(len(x.prompt_ids) for x in samples)
        prompts = torch.full((b, width), self.pad_token_id, dtype=torch.long)
        prompt_mask = torch.zeros((b, width), dtype=torch.long)
        responses = torch.full((b, r), self.pad_token_id, dtype=torch.long)
        response_mask = torch.zeros((b, r), dtype=torch.float32)
        log_probs = torch.zeros((b, r), dtype=torch.float32)
        kept = torch.zeros((b, r), dtype=torch.float32)
        scores = torch.zeros((b, r), dtype=torch.float32)
        for i, x in enumerate(samples):
            p, n = len(x.prompt_ids), len(x.response_ids)
            prompts[i, width - p :] = torch.tensor(x.prompt_ids, dtype=torch.long)
            prompt_mask[i, width - p :] = 1
            responses[i, :n] = torch.tensor(x.response_ids, dtype=torch.long)
            response_mask[i, :n] = 1
            if x.log_probs is not None:
                log_probs[i, :n] = torch.tensor(x.log_probs, dtype=torch.float32)
            if x.kept_mass is not None:
                kept[i, :n] = torch.tensor(x.kept_mass, dtype=torch.float32)
            scores[i, n - 1] = float("nan") if x.score is None else x.score
        rows = [x.row for x in samples]
        return Batch(
            prompts=prompts,
            prompt_mask=prompt_mask,
            responses=responses,
            response_mask=response_mask,
            rollout_log_probs=log_probs if self.has_log_probs else None,
            rollout_log_kept_mass=kept if self.has_log_probs and any(x.kept_mass for x in samples) else None,
            token_level_scores=scores,
            from_logs=torch.ones(b, dtype=torch.bool),
            data_source=[row.get(self.settings.reward_fn_key) or "" for row in rows],
            ground_truth=[(row.get("reward_model") or {}).get("ground_truth") for row in rows],
            extra_info=[row.get("extra_info") or {} for row in rows],
            raw_prompt=[row["_messages"] for row in rows],
            uid=[f"logged:{_group_key(x)}" for x in samples],
        )

    # ---- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "batch_index": self._batch_index,
            "num_groups": len(self._groups),
            "seed": self.settings.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("num_groups") != len(self._groups) or state["seed"] != self.settings.seed:
            raise ValueError(
                f"loader state is for {state.get('num_groups')} logged groups and seed {state['seed']}, "
                f"but this loader has {len(self._groups)} and seed {self.settings.seed}: the logs or "
                "data.seed changed"
            )
        self.epoch, self._batch_index = int(state["epoch"]), int(state["batch_index"])


def _check_log_values(values: list[float] | None, column: str, num_tokens: int, where: str) -> None:
    """A per-token column of logs (``response_log_probs``, ``response_log_kept_mass``): one value per
    response token, each finite and ≤ 0; ``None`` (not logged) passes."""
    if values is None:
        return
    if len(values) != num_tokens:
        raise DataError(f"{where}, column {column!r}: {len(values)} values for {num_tokens} response tokens")
    if any(v is None or not math.isfinite(v) or v > 1e-6 for v in values):
        raise DataError(f"{where}, column {column!r}: a value that is null, not finite or above 0")


def _group_key(sample: _Sample) -> Any:
    gid = sample.row.get(GROUP_ID)
    return (
        gid
        if gid is not None
        else hashlib.sha256(json.dumps(sample.row["_messages"]).encode()).hexdigest()[:16]
    )
