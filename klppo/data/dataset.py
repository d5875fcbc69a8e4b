"""Prompt loader over Parquet files in verl's schema: tokenise, filter, shuffle, left-pad, resume.

Rows carry ``prompt`` (chat messages), ``data_source``, ``reward_model.ground_truth`` and ``extra_info``
(see ``klppo.data.gsm8k``; multi-turn rows: ``extra_info.tools_kwargs`` / ``interaction_kwargs``, and verl's
``agent_name`` column, copied into ``extra_info``). ``PromptLoader`` yields ``klppo.batch.Batch`` objects
holding ``batch_size``
prompts: ``prompts`` [B, P] int64 left-padded with ``pad_token_id`` to the longest prompt of the batch,
``prompt_mask`` [B, P] int64 (1 = real token), and the lists ``data_source``, ``ground_truth``,
``extra_info``, ``raw_prompt`` (the messages) and ``uid`` (``"<file index>:<row in file>"``, stable).

Text: the tokenizer's chat template with ``add_generation_prompt=True``; with no template, or with
``use_chat_template=False``, the message contents joined by newlines (tokenised with the tokenizer's special
tokens, e.g. BOS). As in verl, ``return_raw_chat`` does not change the tokens: it only says the rollout
wants the messages, and ``raw_prompt`` is always filled here. Prompts longer than ``max_prompt_length``
are dropped at construction (``filter_overlong_prompts``) or else cut by ``truncation``: ``left`` keeps the
last tokens, ``right`` the first, ``middle`` the first ⌊P/2⌋ and last ⌈P/2⌉ (counted by the scan and
reported: ``LoaderStats.num_truncated``), ``error`` stops at construction naming the first such row.

Every problem with the data is a :class:`DataError` (a ``ValueError``) raised at construction, naming the
file (and row): a file that is not Parquet or is empty, a missing prompt column, a bad row under
``bad_row_policy='error'``, an overlong prompt under ``truncation='error'``, no usable prompts.

Order. Construction scans every row group once (prompt column only; one row group in memory at a time)
to find bad rows and prompts longer than ``max_prompt_length``. Two shuffle modes:

- exact (default): the ids of the usable rows are kept (8 bytes a row: 80 MB for 10 M rows) and epoch
  ``e`` visits them in the permutation drawn from ``numpy.random.default_rng([seed, e])``. Batches read
  only the row groups they touch, through an LRU cache of ``max_cached_row_groups`` row groups; random
  order over many row groups costs about one row-group read per row, so keep row groups small
  (≤ a few thousand rows) or use the buffer mode.
- bounded buffer (``shuffle_buffer_rows=N``): for sets whose index does not fit. Epoch ``e`` visits the
  row groups in a seeded random order, rows in file order within them, through a buffer of ``N`` ids: each
  step emits a random buffered id and refills from the stream (the classic shuffle buffer: rows move at
  most about ``N`` places from row-group order). Rows are checked again when read and skipped if bad or
  overlong. Only counts are kept in memory. Resuming replays the id stream (integers only, no reads).

``state_dict()`` = {epoch, batch index in the epoch, position = rows of the epoch's order consumed}; a
loader built on the same files with the same arguments and given that state yields the same batches.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from klppo.batch import Batch
from klppo.data.parquet_rows import DataError, RowGroupSource, normalize_prompt

logger = logging.getLogger(__name__)
_META_COLUMNS = ("data_source", "reward_model", "extra_info", "agent_name")
_MAX_REPORTED_BAD_ROWS = 20


@dataclasses.dataclass
class LoaderStats:
    """What the construction scan found (``num_rows`` = usable rows)."""

    num_rows_total: int = 0
    num_bad_rows: int = 0
    num_overlong: int = 0  # longer than max_prompt_length and filtered out
    num_truncated: int = 0  # longer than max_prompt_length and kept, cut by ``truncation``
    num_rows: int = 0
    num_past_max_samples: int = 0  # usable, left out by ``max_samples`` (the first N usable rows are kept)
    bad_rows: list[str] = dataclasses.field(default_factory=list)  # first few, "file:row: reason"
    row_groups_read: int = 0
    max_rows_resident: int = 0


@dataclasses.dataclass(frozen=True)
class LoaderSettings:
    """One prompt loader: its files and batching, and how rows become prompts (verl's ``data.*`` keys;
    :func:`klppo.assembly.settings.loader_settings` builds it from the configuration)."""

    files: str | list[str]
    """Parquet files in verl's schema, read in this order."""
    batch_size: int
    """Prompts per batch."""
    max_prompt_length: int
    """Longest prompt in tokens (after the chat template); longer ones are filtered or truncated."""
    prompt_key: str = "prompt"
    """The column holding the chat messages."""
    shuffle: bool = True
    """Visit the rows in a seeded random order per epoch (module docstring); False: file order."""
    seed: int = 1
    """Seed of the shuffle."""
    filter_overlong_prompts: bool = True
    """Drop prompts longer than ``max_prompt_length`` at construction (else ``truncation`` applies)."""
    truncation: str = "error"
    """``error | left | right | middle``: what happens to an overlong prompt that is kept."""
    return_raw_chat: bool = False
    """Accepted for verl compatibility: ``raw_prompt`` is always filled."""
    use_chat_template: bool = True
    """Render the messages with the tokenizer's chat template (False, or no template: contents joined)."""
    bad_row_policy: str = "skip"
    """``skip | error``: a row whose prompt is not chat messages."""
    drop_last: bool = True
    """Drop an epoch's last, partial batch (False for validation)."""
    shuffle_buffer_rows: int | None = None
    """The bounded-buffer shuffle of this many rows (None: the exact order, module docstring)."""
    max_cached_row_groups: int = 16
    """Row groups kept in memory by the reader's LRU cache."""
    max_samples: int = -1
    """At most this many rows (-1: all; ``data.train_max_samples`` / ``val_max_samples``)."""
    apply_chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Extra keyword arguments of the tokenizer's ``apply_chat_template``."""
    reward_fn_key: str = "data_source"
    """The column that names each row's scorer."""


def encode_prompts(
    tokenizer: Any, batch_messages: list[list[dict[str, str]]], *, use_template: bool, kwargs: dict[str, Any]
) -> list[list[int]]:
    """Token ids of each prompt: the chat template with ``add_generation_prompt=True`` (``kwargs`` passed
    on), or without ``use_template`` the contents joined by newlines with the tokenizer's special tokens."""
    if not batch_messages:
        return []
    if use_template:
        texts = [
            tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False, **kwargs)
            for m in batch_messages
        ]
    else:
        texts = ["\n".join(m["content"] for m in messages) for messages in batch_messages]
    return tokenizer(texts, add_special_tokens=not use_template)["input_ids"]


class PromptLoader:
    """Batches of tokenised prompts from Parquet files; ``val`` use: ``shuffle=False, drop_last=False``."""

    def __init__(self, settings: LoaderSettings, tokenizer: Any) -> None:
        batch_size, max_prompt_length = settings.batch_size, settings.max_prompt_length
        truncation, bad_row_policy = settings.truncation, settings.bad_row_policy
        shuffle_buffer_rows, max_samples = settings.shuffle_buffer_rows, settings.max_samples
        prompt_key, reward_fn_key = settings.prompt_key, settings.reward_fn_key
        if batch_size <= 0 or max_prompt_length <= 0:
            raise ValueError(
                f"batch_size and max_prompt_length must be positive ({batch_size}, {max_prompt_length})"
            )
        if truncation not in ("error", "left", "right", "middle"):
            raise ValueError(f"truncation must be 'error', 'left', 'right' or 'middle', got {truncation!r}")
        if bad_row_policy not in ("skip", "error"):
            raise ValueError(f"bad_row_policy must be 'skip' or 'error', got {bad_row_policy!r}")
        if shuffle_buffer_rows is not None and shuffle_buffer_rows <= 0:
            raise ValueError(f"data.shuffle_buffer_rows must be positive or null, got {shuffle_buffer_rows}")
        if max_samples > 0 and shuffle_buffer_rows is not None:
            raise ValueError(
                "max_samples (data.*_max_samples) needs the exact-order mode (shuffle_buffer_rows=None)"
            )
        self.chat_template_kwargs = dict(settings.apply_chat_template_kwargs)
        self.reward_fn_key = reward_fn_key
        self.tokenizer = tokenizer
        self.pad_token_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        if self.pad_token_id is None:
            raise ValueError("tokenizer has neither pad_token_id nor eos_token_id: cannot left-pad prompts")
        self.batch_size, self.max_prompt_length = batch_size, max_prompt_length
        self.prompt_key, self.shuffle, self.seed = prompt_key, settings.shuffle, settings.seed
        self.filter_overlong_prompts, self.truncation = settings.filter_overlong_prompts, truncation
        self.bad_row_policy, self.drop_last = bad_row_policy, settings.drop_last
        self.shuffle_buffer_rows = shuffle_buffer_rows
        self.return_raw_chat = settings.return_raw_chat  # verl compatibility; raw_prompt is always filled
        self.use_template = (
            settings.use_chat_template and getattr(tokenizer, "chat_template", None) is not None
        )
        files = settings.files
        paths = [files] if isinstance(files, str) else list(files)
        self.source = RowGroupSource(paths, max_cached_row_groups=settings.max_cached_row_groups)
        for f, path in enumerate(self.source.paths):
            if prompt_key not in self.source.column_names(f):
                raise DataError(
                    f"{path} has no column {prompt_key!r} (data.prompt_key); columns: "
                    f"{self.source.column_names(f)}"
                )
            if reward_fn_key != "data_source" and reward_fn_key not in self.source.column_names(f):
                raise DataError(
                    f"{path} has no column {reward_fn_key!r} (data.reward_fn_key); columns: "
                    f"{self.source.column_names(f)}"
                )
        self.stats = LoaderStats(num_rows_total=self.source.num_rows)
        self._valid_ids = self._scan()
        if max_samples > 0 and self._valid_ids is not None and len(self._valid_ids) > max_samples:
            # the first N usable rows in file order (before any shuffling), so the subset is stable
            self.stats.num_past_max_samples = len(self._valid_ids) - max_samples
            self._valid_ids = self._valid_ids[:max_samples]
            self.stats.num_rows = max_samples
        self._check_not_empty()
        self.epoch, self._batch_index, self._position = 0, 0, 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)
        self._stream: Iterator[int] | None = None

    # ---- construction scan ---------------------------------------------------------------------
    def _where(self, global_id: int) -> str:
        f, row, _ = self.source.locate(global_id)
        return f"{self.source.paths[f]} row {row}"

    def _scan(self) -> np.ndarray | None:
        """Validate and measure every row; the usable ids (exact mode) or None (buffer mode)."""
        kept: list[np.ndarray] = []
        for _, _, first, table in self.source.iter_row_groups([self.prompt_key]):
            values = table.column(self.prompt_key).to_pylist()
            ok = np.ones(len(values), dtype=bool)
            messages = []
            for i, value in enumerate(values):
                msgs, reason = normalize_prompt(value)
                if reason is not None:
                    ok[i] = False
                    self._report_bad(first + i, reason)
                messages.append(msgs)
            idx = np.flatnonzero(ok)
            lengths = np.asarray(
                [len(ids) for ids in self._encode([messages[i] for i in idx])], dtype=np.int64
            )
            overlong = idx[lengths > self.max_prompt_length]
            if self.filter_overlong_prompts:
                ok[overlong] = False
                self.stats.num_overlong += len(overlong)
            elif len(overlong) and self.truncation == "error":
                first_long = int(overlong[0])
                raise DataError(
                    f"prompt in {self._where(first + first_long)} has {int(lengths[idx == first_long][0])} "
                    f"tokens > max_prompt_length={self.max_prompt_length} (data.truncation=error); set "
                    "data.filter_overlong_prompts=True or data.truncation=left|right|middle, or raise "
                    "data.max_prompt_length"
                )
            else:
                self.stats.num_truncated += len(overlong)
            self.stats.num_rows += int(ok.sum())
            if self.shuffle_buffer_rows is None:
                kept.append(first + np.flatnonzero(ok).astype(np.int64))
        self.stats.row_groups_read = self.source.stats.row_groups_read
        self.stats.max_rows_resident = self.source.stats.max_rows_resident
        if self.shuffle_buffer_rows is not None:
            return None
        return np.concatenate(kept) if kept else np.empty(0, dtype=np.int64)

    def summary(self) -> str:
        """One line: rows, usable (and how many of them ``max_samples`` keeps), bad, and overlong ones
        filtered or truncated. The loader logs nothing itself: its caller says this once per run."""
        s, p = self.stats, self.max_prompt_length
        longer = (
            f"{s.num_overlong} longer than max_prompt_length={p} (filtered)"
            if self.filter_overlong_prompts
            else f"{s.num_truncated} longer than max_prompt_length={p} (truncated, {self.truncation})"
        )
        usable = f"{s.num_rows} usable"
        if s.num_past_max_samples:
            usable = (
                f"{s.num_rows + s.num_past_max_samples} usable (the first {s.num_rows} kept: max_samples)"
            )
        return f"{s.num_rows_total} rows, {usable}, {s.num_bad_rows} bad, {longer}"

    def _report_bad(self, global_id: int, reason: str) -> None:
        where = f"{self._where(global_id)}: {reason}"
        if self.bad_row_policy == "error":
            raise DataError(f"bad row in {where} (data bad-row policy 'error'; 'skip' skips such rows)")
        self.stats.num_bad_rows += 1
        if len(self.stats.bad_rows) < _MAX_REPORTED_BAD_ROWS:
            self.stats.bad_rows.append(where)
            logger.warning("skipping bad row in %s", where)

    def _check_not_empty(self) -> None:
        s = self.stats
        why = (
            f"{s.num_rows_total} rows in {len(self.source.paths)} file(s); {s.num_bad_rows} bad "
            f"(missing/wrongly typed/empty prompt), {s.num_overlong} longer than "
            f"max_prompt_length={self.max_prompt_length}"
        )
        if s.num_rows == 0:
            raise DataError(f"no usable prompts in {', '.join(self.source.paths)}: {why}")
        if self.drop_last and s.num_rows < self.batch_size:
            raise DataError(
                f"only {s.num_rows} usable prompts in {', '.join(self.source.paths)}, fewer than one batch "
                f"of {self.batch_size} (data.train_batch_size; data.train_max_samples and "
                f"data.val_max_samples cap the rows read): {why}"
            )

    # ---- text → ids ----------------------------------------------------------------------------
    def _encode(self, batch_messages: list[list[dict[str, str]]]) -> list[list[int]]:
        return encode_prompts(
            self.tokenizer, batch_messages, use_template=self.use_template, kwargs=self.chat_template_kwargs
        )

    # ---- epoch order ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch."""
        n = self.stats.num_rows
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def _epoch_order(self) -> np.ndarray:
        if self._order_epoch != self.epoch:
            n = len(self._valid_ids)
            if self.shuffle:
                perm = np.random.default_rng([self.seed, self.epoch]).permutation(n)
                self._order = self._valid_ids[perm]
            else:
                self._order = self._valid_ids
            self._order_epoch = self.epoch
        return self._order

    def _id_stream(self, epoch: int) -> Iterator[int]:
        """Buffer mode: global ids of epoch ``epoch`` (row groups shuffled, then a shuffle buffer)."""
        groups = [(f, g) for f in range(len(self.source.paths)) for g in range(self.source.num_row_groups(f))]
        rng = np.random.default_rng([self.seed, epoch])
        if self.shuffle:
            groups = [groups[i] for i in rng.permutation(len(groups))]

        def ids_in_order() -> Iterator[int]:
            for f, g in groups:
                start = int(self.source.file_starts[f] + self.source.rg_starts[f][g])
                stop = int(self.source.file_starts[f] + self.source.rg_starts[f][g + 1])
                yield from range(start, stop)

        if not self.shuffle:
            yield from ids_in_order()
            return
        buffer: list[int] = []
        for gid in ids_in_order():
            if len(buffer) < self.shuffle_buffer_rows:
                buffer.append(gid)
                continue
            j = int(rng.integers(len(buffer)))
            buffer[j], gid = gid, buffer[j]
            yield gid
        while buffer:
            j = int(rng.integers(len(buffer)))
            buffer[j], buffer[-1] = buffer[-1], buffer[j]
            yield buffer.pop()

    def _stream_for_position(self) -> Iterator[int]:
        if self._stream is None:
            self._stream = self._id_stream(self.epoch)
            for _ in range(self._position):
                next(self._stream)
        return self._stream

    # ---- batches -------------------------------------------------------------------------------
    def _columns(self) -> list[str]:
        extra = [self.reward_fn_key] if self.reward_fn_key not in _META_COLUMNS else []
        return [self.prompt_key, *_META_COLUMNS, *extra]

    def _next_rows(self) -> list[dict[str, Any]]:
        """The rows of the next batch of the current epoch (fewer than batch_size only at its end)."""
        if self.shuffle_buffer_rows is None:
            order = self._epoch_order()
            ids = order[self._position : self._position + self.batch_size]
            self._position += len(ids)
            return self.source.take(ids.tolist(), self._columns())
        rows: list[dict[str, Any]] = []
        stream = self._stream_for_position()
        while len(rows) < self.batch_size:
            ids = [gid for _, gid in zip(range(self.batch_size - len(rows)), stream)]
            if not ids:
                break
            self._position += len(ids)
            for row in self.source.take(ids, self._columns()):
                msgs, reason = normalize_prompt(row.get(self.prompt_key))
                if reason is None and self.filter_overlong_prompts:
                    reason = "overlong" if len(self._encode([msgs])[0]) > self.max_prompt_length else None
                if reason is None:
                    rows.append(row)
        return rows

    def _start_epoch(self, epoch: int) -> None:
        self.epoch, self._batch_index, self._position, self._stream = epoch, 0, 0, None

    def _next_in_epoch(self) -> Batch | None:
        if self._batch_index >= len(self):
            return None
        rows = self._next_rows()
        if not rows or (self.drop_last and len(rows) < self.batch_size):
            self._batch_index = len(self)  # the epoch ran out early (buffer mode, files changed)
            return None
        self._batch_index += 1
        return self._collate(rows)

    def next_batch(self) -> Batch:
        """The next batch, moving to the next epoch when the current one is done (never ends)."""
        batch = self._next_in_epoch()
        if batch is None:
            self._start_epoch(self.epoch + 1)
            batch = self._next_in_epoch()
            assert batch is not None, "an epoch produced no batch"
        return batch

    def __iter__(self) -> Iterator[Batch]:
        """The remaining batches of the current epoch (a full new epoch if the current one is done)."""
        if self._batch_index >= len(self):
            self._start_epoch(self.epoch + 1)
        while (batch := self._next_in_epoch()) is not None:
            yield batch

    def _collate(self, rows: list[dict[str, Any]]) -> Batch:
        messages = []
        for row in rows:
            msgs, reason = normalize_prompt(row.get(self.prompt_key))
            if reason is not None:  # only possible if a file changed after the scan
                raise DataError(f"{self.source.paths[row['_file']]} row {row['_row']}: {reason}")
            messages.append(msgs)
        encoded = self._encode(messages)
        for k, ids in enumerate(encoded):
            if len(ids) > self.max_prompt_length:
                encoded[k] = self._truncate(ids, rows[k])
        width = max(len(ids) for ids in encoded)
        prompts = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for k, ids in enumerate(encoded):
            if ids:
                prompts[k, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
                mask[k, width - len(ids) :] = 1
        return Batch(
            prompts=prompts,
            prompt_mask=mask,
            data_source=[row.get(self.reward_fn_key) or "" for row in rows],
            ground_truth=[(row.get("reward_model") or {}).get("ground_truth") for row in rows],
            extra_info=[_extra_info(row) for row in rows],
            raw_prompt=messages,
            uid=[f"{row['_file']}:{row['_row']}" for row in rows],
        )

    def _truncate(self, ids: list[int], row: dict[str, Any]) -> list[int]:
        p = self.max_prompt_length
        if self.truncation == "left":
            return ids[-p:]
        if self.truncation == "right":
            return ids[:p]
        if self.truncation == "middle":
            return ids[: p // 2] + ids[len(ids) - (p - p // 2) :]
        raise DataError(  # only possible if a file changed after the scan
            f"prompt in {self.source.paths[row['_file']]} row {row['_row']} has {len(ids)} tokens > "
            f"max_prompt_length={p}; set data.filter_overlong_prompts=True or "
            "data.truncation=left|right|middle"
        )

    # ---- resume --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        """Exact position: the epoch, batches already yielded in it, and rows of its order consumed."""
        return {
            "epoch": self.epoch,
            "batch_index": self._batch_index,
            "position": self._position,
            "num_rows": self.stats.num_rows,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_rows"] != self.stats.num_rows or state["seed"] != self.seed:
            raise ValueError(
                f"loader state is for {state['num_rows']} usable rows and seed {state['seed']}, but this "
                f"loader has {self.stats.num_rows} rows and seed {self.seed}: the data or data.seed changed"
            )
        self._start_epoch(int(state["epoch"]))
        self._batch_index, self._position = int(state["batch_index"]), int(state["position"])


def _extra_info(row: dict[str, Any]) -> dict[str, Any]:
    """The row's ``extra_info``, with verl's ``agent_name`` column in it when the row has one (multi-turn)."""
    info = row.get("extra_info") or {}
    return {**info, "agent_name": row["agent_name"]} if row.get("agent_name") else info
