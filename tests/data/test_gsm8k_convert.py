"""GSM8K conversion (synthetic rows, and a sample of the real splits in tests/data/gsm8k), the arithmetic set,
CLI."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest

from klppo.data import LoaderSettings, PromptLoader
from klppo.data.arithmetic import write_arithmetic_parquet
from klppo.data.cli import main as data_main
from klppo.data.gsm8k import INSTRUCTION, convert
from klppo.models.tiny import build_tiny_tokenizer
from klppo.rewards.gsm8k import compute_score

REAL_DIR = os.path.join(os.path.dirname(__file__), "gsm8k")  # 24 train and 20 test rows of GSM8K, unchanged
REAL_ROWS = {"train": 24, "test": 20}


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _synthetic(tmp_path):
    train = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
        {"question": "A car costs $12,500 more.", "answer": "So 1,250 + 11,250 = 12,500\n#### 12,500"},
        {"question": "Temperature drops to?", "answer": "It is -3 degrees.\n#### -3"},
    ]
    test = [{"question": "Half of 5?", "answer": "5/2=2.5\n#### 2.5"}]
    src = tmp_path / "src"
    src.mkdir()
    _write_jsonl(src / "train.jsonl", train)
    _write_jsonl(src / "test.jsonl", test)
    return src, train, test


def test_synthetic_conversion_has_verl_schema_and_values(tmp_path):
    src, train, test = _synthetic(tmp_path)
    assert convert(str(src), str(tmp_path / "out")) == (3, 1)
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert list(rows[0]) == ["data_source", "prompt", "ability", "reward_model", "extra_info"]
    for i, (row, rec) in enumerate(zip(rows, train)):
        assert row["data_source"] == "openai/gsm8k"
        assert row["prompt"] == [{"role": "user", "content": rec["question"] + " " + INSTRUCTION}]
        assert row["ability"] == "math"
        assert row["reward_model"]["style"] == "rule"
        assert row["extra_info"] == {
            "split": "train",
            "index": i,
            "answer": rec["answer"],
            "question": rec["question"],
        }
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "12500", "-3"]
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    (test_row,) = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert test_row["extra_info"]["split"] == "test" and test_row["reward_model"]["ground_truth"] == "2.5"


def test_conversion_errors(tmp_path):
    src, train, _ = _synthetic(tmp_path)
    with pytest.raises(FileNotFoundError, match="test.jsonl"):
        (src / "test.jsonl").unlink()
        convert(str(src), str(tmp_path / "o"))
    _write_jsonl(src / "test.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match=r"test.jsonl \(test row 0\).*####"):
        convert(str(src), str(tmp_path / "o"))


def test_cli(tmp_path, capsys):
    src, _, _ = _synthetic(tmp_path)
    assert data_main(["gsm8k", "--input", str(src), "--output", str(tmp_path / "o")]) == 0
    assert "3 train and 1 test" in capsys.readouterr().out
    assert data_main(["gsm8k", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o")]) == 1
    assert "not found" in capsys.readouterr().err
    assert (
        data_main(["arithmetic", "--output", str(tmp_path / "a"), "--num-train", "10", "--num-test", "5"])
        == 0
    )
    assert pq.read_metadata(tmp_path / "a" / "train.parquet").num_rows == 10


def test_without_input_needs_datasets(tmp_path):
    try:
        import datasets  # noqa: F401

        pytest.skip("`datasets` is installed here; the no-input path would go online")
    except ImportError:
        pass
    with pytest.raises(RuntimeError, match="datasets"):
        convert(None, str(tmp_path / "o"))


def test_real_gsm8k_conversion(tmp_path):
    assert convert(REAL_DIR, str(tmp_path)) == (REAL_ROWS["train"], REAL_ROWS["test"])
    for split, n in REAL_ROWS.items():
        with open(os.path.join(REAL_DIR, f"{split}.jsonl")) as f:
            source = [json.loads(line) for line in f]
        rows = pq.read_table(tmp_path / f"{split}.parquet").to_pylist()
        assert len(rows) == n
        for i, (row, rec) in enumerate(zip(rows, source)):
            truth = rec["answer"].split("####")[-1].strip().replace(",", "")  # independent parse
            assert row["reward_model"]["ground_truth"] == truth
            assert row["extra_info"]["index"] == i and row["extra_info"]["question"] == rec["question"]
            assert row["prompt"][0]["content"].startswith(rec["question"] + " Let's think")
    # Read back through the loader: every prompt's ground truth matches its source answer.
    with open(os.path.join(REAL_DIR, "test.jsonl")) as f:
        source = [json.loads(line) for line in f]
    loader = PromptLoader(
        LoaderSettings(
            str(tmp_path / "test.parquet"),
            batch_size=512,
            max_prompt_length=4096,
            shuffle=False,
            drop_last=False,
        ),
        build_tiny_tokenizer(),
    )
    seen = 0
    for batch in loader:
        for uid, truth, messages in zip(batch.uid, batch.ground_truth, batch.raw_prompt):
            rec = source[int(uid.split(":")[1])]
            assert truth == rec["answer"].split("####")[-1].strip().replace(",", "")
            assert messages[0]["content"].startswith(rec["question"])
            seen += 1
    assert seen == REAL_ROWS["test"] and loader.stats.num_overlong == 0


def test_arithmetic_set(tmp_path):
    train_path, test_path = write_arithmetic_parquet(str(tmp_path / "a"), num_train=40, num_test=20, seed=3)
    again = write_arithmetic_parquet(str(tmp_path / "b"), num_train=40, num_test=20, seed=3)
    train, test = pq.read_table(train_path).to_pylist(), pq.read_table(test_path).to_pylist()
    assert train == pq.read_table(again[0]).to_pylist()  # deterministic by seed
    other = write_arithmetic_parquet(str(tmp_path / "c"), num_train=40, num_test=20, seed=4)
    assert train != pq.read_table(other[0]).to_pylist()
    questions = [r["extra_info"]["question"] for r in train]
    assert len(set(questions)) == 40
    assert not set(questions) & {r["extra_info"]["question"] for r in test}
    ops = set()
    for row in train + test:
        q = row["extra_info"]["question"]
        _, _, a, op, b = q.rstrip("?").split()
        ops.add(op)
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert value >= 0 and row["reward_model"]["ground_truth"] == str(value)
        assert row["data_source"] == "arithmetic"
        assert compute_score(f"so #### {value}", row["reward_model"]["ground_truth"]) == 1.0
    assert ops == {"+", "-"}


def test_arithmetic_set_with_negative_differences(tmp_path):
    train_path, test_path = write_arithmetic_parquet(
        str(tmp_path / "n"), num_train=400, num_test=200, seed=0, negative=True
    )
    train, test = pq.read_table(train_path).to_pylist(), pq.read_table(test_path).to_pylist()
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}
    values = []
    for row in train + test:
        _, _, a, op, b = row["extra_info"]["question"].rstrip("?").split()
        value = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert row["reward_model"]["ground_truth"] == str(value)
        values.append(value)
    negatives = sum(v < 0 for v in values) / len(values)
    assert 0.15 < negatives < 0.35  # about half of the differences, which are about half the questions


def test_arithmetic_rows_name_their_interaction_for_a_multi_turn_run(tmp_path):
    """``klppo data arithmetic --interaction NAME``: each row's ``extra_info.interaction_kwargs`` names the
    interaction and holds the answer, and the loader hands it to the conversation loop; the questions are
    those of the set without the option."""
    out = tmp_path / "r"
    argv = ["arithmetic", "--output", str(out), "--num-train", "12", "--num-test", "4", "--negative"]
    assert data_main([*argv, "--interaction", "arithmetic"]) == 0
    plain = write_arithmetic_parquet(str(tmp_path / "p"), num_train=12, num_test=4, seed=0, negative=True)
    for split, path in zip(("train", "test"), plain):
        rows = pq.read_table(out / f"{split}.parquet").to_pylist()
        plain_rows = pq.read_table(path).to_pylist()
        assert [r["extra_info"]["question"] for r in rows] == [
            r["extra_info"]["question"] for r in plain_rows
        ]
        for row in rows:
            truth = row["reward_model"]["ground_truth"]
            assert row["extra_info"]["interaction_kwargs"] == {"name": "arithmetic", "ground_truth": truth}
    loader = PromptLoader(
        LoaderSettings(str(out / "test.parquet"), batch_size=4, max_prompt_length=512, shuffle=False),
        build_tiny_tokenizer(),
    )
    (batch,) = list(loader)
    assert [info["interaction_kwargs"]["ground_truth"] for info in batch.extra_info] == batch.ground_truth


def test_rows_with_verls_agent_name_column_keep_it(tmp_path):
    """A row's ``agent_name`` (verl's column: ``single_turn_agent`` trains that row in one turn) is written
    as a column and reaches the conversation loop in ``extra_info``."""
    from klppo.data.arithmetic import arithmetic_rows
    from klppo.data.gsm8k import write_rows

    rows = arithmetic_rows(3, split="train", seed=0, interaction="arithmetic")
    rows = [{**r, "agent_name": "single_turn_agent"} for r in rows]
    write_rows(rows, str(tmp_path / "t.parquet"))
    loader = PromptLoader(
        LoaderSettings(str(tmp_path / "t.parquet"), batch_size=3, max_prompt_length=512, shuffle=False),
        build_tiny_tokenizer(),
    )
    (batch,) = list(loader)
    assert {info["agent_name"] for info in batch.extra_info} == {"single_turn_agent"}
