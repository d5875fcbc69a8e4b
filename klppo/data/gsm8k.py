"""GSM8K → Parquet in verl's schema (the same rows ``examples/data_preprocess/gsm8k.py`` writes).

Each output row::

    data_source:  "openai/gsm8k"
    prompt:       [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability:      "math" reward_model: {"style": "rule", "ground_truth": <number after the first "#### ",
    commas removed>}
    extra_info:   {"split": "train"|"test", "index": <row number in the split>, "answer": <full answer>,
                   "question": <question>}

Input: GSM8K's original ``train.jsonl``/``test.jsonl`` (keys ``question``, ``answer``), or, without an
input folder, ``openai/gsm8k`` (config ``main``) fetched through the ``datasets`` library when installed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_ANSWER_RE = re.compile(r"#### (-?[0-9.,]+)")

SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [
                    ("split", pa.string()),
                    ("index", pa.int64()),
                    ("answer", pa.string()),
                    ("question", pa.string()),
                ]
            ),
        ),
    ]
)


def extract_ground_truth(answer: str) -> str:
    """The number after the first ``#### `` of a GSM8K answer, commas removed (ValueError if absent)."""
    match = _ANSWER_RE.search(answer)
    if match is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer[-80:]!r}")
    return match.group(1).replace(",", "")


def make_row(question: str, answer: str, *, split: str, index: int, data_source: str = DATA_SOURCE) -> dict:
    """One verl-format row for a (question, answer) pair."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": question + " " + INSTRUCTION}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": extract_ground_truth(answer)},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }


INTERACTION_KWARGS = pa.struct([("name", pa.string()), ("ground_truth", pa.string())])
"""``extra_info.interaction_kwargs`` of a multi-turn row: the interaction's name and the answer it checks."""


def schema_of(rows: list[dict]) -> pa.Schema:
    """``SCHEMA``, with ``extra_info.interaction_kwargs`` and verl's ``agent_name`` column when the first row
    carries them (multi-turn rows; docs/multi_turn.md)."""
    schema = SCHEMA
    first = rows[0] if rows else {}
    if "interaction_kwargs" in first.get("extra_info", {}):
        info = schema.field("extra_info").type
        fields = [*info, pa.field("interaction_kwargs", INTERACTION_KWARGS)]
        schema = schema.set(schema.get_field_index("extra_info"), pa.field("extra_info", pa.struct(fields)))
    if "agent_name" in first:
        schema = schema.append(pa.field("agent_name", pa.string()))
    return schema


def write_rows(rows: list[dict], path: str) -> None:
    """Write verl-format rows to ``path`` (Parquet, schema :func:`schema_of` the rows)."""
    pq.write_table(pa.Table.from_pylist(rows, schema=schema_of(rows)), path)


def _read_jsonl(path: str) -> list[dict]:
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{line_no}: not valid JSON ({exc})") from None
            if not isinstance(record.get("question"), str) or not isinstance(record.get("answer"), str):
                raise ValueError(f"{path}:{line_no}: expected string fields 'question' and 'answer'")
            records.append(record)
    return records


def _fetch_hub() -> dict[str, list[dict]]:
    try:
        import datasets  # type: ignore[import-not-found]  # noqa: PLC0415  optional: Hugging Face datasets only to download GSM8K
    except ImportError:
        raise RuntimeError(
            "no --input folder given and the `datasets` library is not installed: pass --input DIR holding "
            "GSM8K's train.jsonl and test.jsonl, or `pip install datasets` on a machine that is online"
        ) from None
    try:
        ds = datasets.load_dataset("openai/gsm8k", "main")
    except Exception as exc:
        raise RuntimeError(
            f"fetching openai/gsm8k through `datasets` failed ({exc!r}); pass --input DIR with the jsonl "
            "files"
        ) from exc
    return {split: [dict(r) for r in ds[split]] for split in ("train", "test")}


def _convert_split(records: Iterable[dict], split: str, source: str) -> list[dict]:
    rows = []
    for index, record in enumerate(records):
        try:
            rows.append(make_row(record["question"], record["answer"], split=split, index=index))
        except ValueError as exc:
            raise ValueError(f"{source} ({split} row {index}): {exc}") from None
    return rows


def convert(input_dir: str | None, output_dir: str) -> tuple[int, int]:
    """Write ``train.parquet`` and ``test.parquet`` into ``output_dir``; returns (n_train, n_test).

    ``input_dir`` holds ``train.jsonl`` and ``test.jsonl``; ``None`` fetches from the Hugging Face hub.
    """
    if input_dir is None:
        splits = _fetch_hub()
        sources = {s: f"openai/gsm8k[{s}]" for s in splits}
    else:
        input_dir = os.path.expanduser(input_dir)
        splits, sources = {}, {}
        for split in ("train", "test"):
            path = os.path.join(input_dir, f"{split}.jsonl")
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"GSM8K input: {path} not found (expected train.jsonl and test.jsonl)"
                )
            splits[split], sources[split] = _read_jsonl(path), path
    output_dir = os.path.expanduser(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    counts = []
    for split in ("train", "test"):
        rows = _convert_split(splits[split], split, sources[split])
        write_rows(rows, os.path.join(output_dir, f"{split}.parquet"))
        counts.append(len(rows))
    return counts[0], counts[1]
