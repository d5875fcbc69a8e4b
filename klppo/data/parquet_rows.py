"""Row-group access to a set of Parquet files: global row ids, bounded-memory reads, row validation.

A *global id* numbers every row of every file in order (file 0's rows first). ``RowGroupSource`` maps
ids to (file, row group, row) from the Parquet footers alone, reads whole row groups (only the columns
asked for) through a small LRU cache, and never reads a file whole: resident memory is at most
``max_cached_row_groups`` row groups (plus the one being scanned). Knows nothing of tokenizers.
"""

from __future__ import annotations

import dataclasses
import os
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq


class DataError(ValueError):
    """A problem with the prompt data (file, column, rows), found at start-up; the message names the file."""


@dataclasses.dataclass
class ReadStats:
    """Counters of the reading path (tests check that reads stay per row group)."""

    row_groups_read: int = 0
    max_rows_resident: int = 0  # most rows held in decoded row groups at one time


class RowGroupSource:
    """The rows of ``paths`` (Parquet files), addressed by global id, read one row group at a time."""

    def __init__(self, paths: Sequence[str], *, max_cached_row_groups: int = 16) -> None:
        if not paths:
            raise DataError("no Parquet files given (data.train_files / data.val_files)")
        self.paths = [os.path.abspath(os.path.expanduser(p)) for p in paths]
        self._files: list[pq.ParquetFile] = []
        rows_per_file, self.rg_starts = [], []
        for path in self.paths:
            if os.path.isdir(path):
                raise DataError(
                    f"{path} is a directory: name its Parquet files (data.train_files / data.val_files take "
                    "a path or a list of paths)"
                )
            if not os.path.isfile(path):
                raise FileNotFoundError(f"Parquet file not found: {path}")
            if os.path.getsize(path) == 0:
                raise DataError(f"{path} is empty (0 bytes), not a Parquet file")
            try:
                pf = pq.ParquetFile(path)
            except (pa.ArrowInvalid, OSError) as exc:
                raise DataError(f"cannot read {path} as Parquet: {exc}") from None
            self._files.append(pf)
            sizes = [pf.metadata.row_group(g).num_rows for g in range(pf.metadata.num_row_groups)]
            self.rg_starts.append(np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]))
            rows_per_file.append(int(pf.metadata.num_rows))
        self.file_starts = np.concatenate([[0], np.cumsum(rows_per_file, dtype=np.int64)])
        self.max_cached_row_groups = max(1, max_cached_row_groups)
        self._cache: OrderedDict[tuple[int, int], pa.Table] = OrderedDict()
        self.stats = ReadStats()

    @property
    def num_rows(self) -> int:
        return int(self.file_starts[-1])

    def column_names(self, file_index: int) -> list[str]:
        return list(self._files[file_index].schema_arrow.names)

    def num_row_groups(self, file_index: int) -> int:
        return len(self.rg_starts[file_index]) - 1

    def locate(self, global_id: int) -> tuple[int, int, int]:
        """(file index, row index within the file, row group index) of a global id."""
        f = int(np.searchsorted(self.file_starts, global_id, side="right") - 1)
        row = int(global_id - self.file_starts[f])
        g = int(np.searchsorted(self.rg_starts[f], row, side="right") - 1)
        return f, row, g

    def _columns(self, f: int, wanted: Sequence[str]) -> list[str]:
        present = set(self.column_names(f))
        return [c for c in wanted if c in present]

    def _read(self, f: int, g: int, columns: Sequence[str], *, cache: bool) -> pa.Table:
        key = (f, g)
        if cache and key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        table = self._files[f].read_row_group(g, columns=self._columns(f, columns))
        self.stats.row_groups_read += 1
        resident = table.num_rows + sum(t.num_rows for t in self._cache.values())
        self.stats.max_rows_resident = max(self.stats.max_rows_resident, resident)
        if cache:
            self._cache[key] = table
            while len(self._cache) > self.max_cached_row_groups:
                self._cache.popitem(last=False)
        return table

    def iter_row_groups(self, columns: Sequence[str]) -> Iterator[tuple[int, int, int, pa.Table]]:
        """(file index, row group index, global id of its first row, table) for every row group in order,
        bypassing the cache (a scan holds one row group at a time)."""
        for f in range(len(self.paths)):
            for g in range(self.num_row_groups(f)):
                first = int(self.file_starts[f] + self.rg_starts[f][g])
                yield f, g, first, self._read(f, g, columns, cache=False)

    def take(self, global_ids: Sequence[int], columns: Sequence[str]) -> list[dict[str, Any]]:
        """Rows ``global_ids`` as dicts (missing columns absent), in the order given. Each row group
        touched is read once (through the cache); each row also gets ``_file`` and ``_row`` (row in file)."""
        located = [self.locate(int(i)) for i in global_ids]
        by_group: dict[tuple[int, int], list[int]] = {}
        for pos, (f, _, g) in enumerate(located):
            by_group.setdefault((f, g), []).append(pos)
        out: list[dict[str, Any]] = [{} for _ in located]
        for (f, g), positions in by_group.items():
            table = self._read(f, g, columns, cache=True)
            local = [located[p][1] - int(self.rg_starts[f][g]) for p in positions]
            for p, row in zip(positions, table.take(pa.array(local, type=pa.int64())).to_pylist()):
                row["_file"], row["_row"] = f, located[p][1]
                out[p] = row
        return out


def normalize_prompt(value: Any) -> tuple[list[dict[str, str]] | None, str | None]:
    """(chat messages, None) for a usable prompt value, or (None, reason) for a bad one.

    Usable: a non-empty list of ``{"role": str, "content": str}`` whose contents are not all blank, or a
    non-blank string (taken as one user message).
    """
    if value is None:
        return None, "missing prompt (null)"
    if isinstance(value, str):
        if not value.strip():
            return None, "empty prompt text"
        return [{"role": "user", "content": value}], None
    if not isinstance(value, (list, tuple)) or isinstance(value, (bytes, bytearray)):
        return None, f"prompt has type {type(value).__name__}, expected a list of chat messages or a string"
    if not value:
        return None, "empty prompt (no messages)"
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return None, f"prompt message {i} has type {type(message).__name__}, expected a dict"
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            return None, (
                f"prompt message {i} needs string 'role' and 'content' "
                f"(got {type(role).__name__}, {type(content).__name__})"
            )
        messages.append({"role": role, "content": content})
    if not any(m["content"].strip() for m in messages):
        return None, "empty prompt text"
    return messages, None
