"""With the rule reward every row needs a ground truth and a data source with a built-in scorer, checked
at start-up: a row without a ground truth scored 0 in silence, an unknown data source stopped the run with
a traceback at its first scoring (after both models loaded)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from klppo.assembly.data_check import build_loaders, check_ground_truth_columns
from klppo.config import load_config
from klppo.data.parquet_rows import DataError
from klppo.models.loading import load_tokenizer
from klppo.rewards.gsm8k import compute_score


def _variant(src: Path, dst: Path, change) -> Path:
    rows = pq.read_table(src).to_pylist()
    for i, row in enumerate(rows):
        change(i, row)
    pq.write_table(pa.Table.from_pylist(rows), dst)
    return dst


def _check(tiny_model_dir, train: Path, val: Path, *over: str) -> None:
    cfg = load_config(
        [
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            f"data.train_files={train}",
            f"data.val_files={val}",
            "data.train_batch_size=4",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            *over,
        ]
    )
    train_loader, val_loader = build_loaders(cfg, load_tokenizer(str(tiny_model_dir)))
    check_ground_truth_columns(cfg, {"train": train_loader, "validation": val_loader})


def test_rows_without_ground_truth_or_scorer_are_refused_at_start(tiny_model_dir, arithmetic_data, tmp_path):
    train, val = arithmetic_data
    _check(tiny_model_dir, train, val)  # the generator's files pass

    def no_truth(i, row):
        if i in (3, 7):
            row["reward_model"] = None if i == 3 else {"style": "rule", "ground_truth": None}

    bad = _variant(train, tmp_path / "no_truth.parquet", no_truth)
    with pytest.raises(
        DataError,
        match=r"no_truth.parquet \(train data\): 2 row\(s\) without reward_model.ground_truth \(first: row "
        r"3\)",
    ):
        _check(tiny_model_dir, bad, val)
    _check(
        tiny_model_dir, bad, val, f"custom_reward_function.path={tmp_path / 'fn.py'}"
    )  # not the rule reward

    def source(i, row):
        row["data_source"] = "my/unknown" if i == 5 else row["data_source"]

    odd = _variant(val, tmp_path / "odd.parquet", source)
    with pytest.raises(
        DataError,
        match=r"odd.parquet \(validation data\): data_source \(data.reward_fn_key\) \['my/unknown'\] "
        r"\(first: row 5\) — no built-in scorer",
    ):
        _check(tiny_model_dir, train, odd)

    def drop(i, row):
        del row["data_source"]

    none = _variant(val, tmp_path / "none.parquet", drop)
    with pytest.raises(
        DataError, match=r"none.parquet \(validation data\): no 'data_source' column \(data.reward_fn_key\)"
    ):
        _check(tiny_model_dir, train, none)


def test_rows_the_loader_leaves_out_are_not_judged(tiny_model_dir, arithmetic_data, tmp_path):
    """Past data.train_max_samples, or a bad row the loader skips: never scored, so not refused."""
    train, val = arithmetic_data

    def tail_elsewhere(i, row):
        if i >= 32:
            row["data_source"], row["reward_model"] = "my/other", None
        if i == 5:
            row["prompt"], row["reward_model"] = [], None  # a bad row (empty prompt), skipped by the loader

    mixed = _variant(train, tmp_path / "mixed.parquet", tail_elsewhere)
    _check(tiny_model_dir, mixed, val, "data.train_max_samples=31")  # rows 0–31 without the bad row 5
    with pytest.raises(DataError, match=r"mixed.parquet \(train data\): 32 row\(s\) without"):
        _check(tiny_model_dir, mixed, val)


def test_a_number_ground_truth_scores_as_its_text():
    assert compute_score("#### 25", 25) == 1.0 and compute_score("#### 25", 25.0) == 1.0
    assert compute_score("#### 25", "25") == 1.0 and compute_score("#### 26", 25) == 0.0


def test_the_custom_reward_file_is_checked_before_any_weights_without_running_it(
    tiny_model_dir, arithmetic_data, tmp_path
):
    """A missing file, one that does not compile or lacks the function failed only after both models
    loaded (a traceback). The check does not run the file: its top-level code (a judge model, a port) runs
    once, where the trainer imports it."""
    from klppo.assembly.data_check import check_data
    from klppo.rewards.registry import RewardFunctionError

    train, val = arithmetic_data
    tok = load_tokenizer(str(tiny_model_dir))

    def cfg(path):
        return load_config(
            [
                f"actor_rollout_ref.model.path={tiny_model_dir}",
                f"data.train_files={train}",
                f"data.val_files={val}",
                "data.train_batch_size=4",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                f"custom_reward_function.path={path}",
            ]
        )

    with pytest.raises(FileNotFoundError, match="custom_reward_function.path: file not found"):
        check_data(cfg(tmp_path / "missing.py"), tok)
    broken = tmp_path / "broken.py"
    broken.write_text("def compute_score(:\n")
    with pytest.raises(
        RewardFunctionError, match=r"custom_reward_function.path: .*broken.py does not compile"
    ):
        check_data(cfg(broken), tok)
    other = tmp_path / "other.py"
    other.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\ndef score(*a):\n    return 0.0\n")
    with pytest.raises(
        RewardFunctionError, match=r"defines no 'compute_score' at its top level; defined there: score"
    ):
        check_data(cfg(other), tok)
    fine = tmp_path / "fine.py"
    fine.write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\ndef compute_score(*a, **k):\n    return 0.0\n")
    check_data(cfg(fine), tok)
    assert not (tmp_path / "ran").exists()  # never executed by the check
