"""Bad data is found at start-up by `klppo train` (and `--dry-run`): one line, exit code 2, before any
weight loads; truncation is counted and reported."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.trainer.utils import base_overrides


def _rows(n: int, *, long_rows: tuple[int, ...] = ()) -> list[dict]:
    from klppo.data.arithmetic import arithmetic_rows

    rows = arithmetic_rows(n, split="train", seed=0)
    for i in long_rows:
        rows[i]["prompt"] = [{"role": "user", "content": "what is 1 plus 1 and then" + " and then" * 60}]
    return rows


def _write(path, rows, *, drop: tuple[str, ...] = ()) -> str:
    table = pa.Table.from_pylist(rows)
    table = table.drop_columns(list(drop)) if drop else table
    pq.write_table(table, path, row_group_size=16)
    return str(path)


def _case(name: str, tmp_path, arithmetic_data) -> tuple[list[str], str]:
    """(overrides that make the data bad, a phrase the one-line message must contain)."""
    train = tmp_path / "train.parquet"
    if name == "no_reward_model_column":
        return [
            f"data.train_files={_write(train, _rows(16), drop=('reward_model',))}"
        ], "no 'reward_model' column"
    if name == "late_overlong_row_truncation_error":
        path = _write(train, _rows(64, long_rows=(50,)))
        return [f"data.train_files={path}", "data.filter_overlong_prompts=False", "data.truncation=error"], (
            "train.parquet row 50 has"
        )
    if name == "not_parquet":
        train.write_text("question,answer\n1+1,2\n")
        return [f"data.train_files={train}"], "cannot read"
    if name == "empty_file":
        train.write_bytes(b"")
        return [f"data.train_files={train}"], "is empty (0 bytes)"
    if name == "no_usable_prompts":
        rows = _rows(8)
        for row in rows:
            row["prompt"] = [{"role": "user", "content": "   "}]
        return [f"data.train_files={_write(train, rows)}"], "no usable prompts"
    if name == "bad_row_policy_error":
        rows = _rows(16)
        rows[9]["prompt"] = []
        return [f"data.train_files={_write(train, rows)}", "data.bad_row_policy=error"], "row 9: empty prompt"
    if name == "negative_total_training_steps":
        return ["trainer.total_training_steps=-3"], "trainer.total_training_steps=-3"
    if name == "zero_total_training_steps":
        return ["trainer.total_training_steps=0"], "trainer.total_training_steps=0"
    raise AssertionError(name)


CASES = [
    "no_reward_model_column",
    "late_overlong_row_truncation_error",
    "not_parquet",
    "empty_file",
    "no_usable_prompts",
    "bad_row_policy_error",
    "negative_total_training_steps",
    "zero_total_training_steps",
]


@pytest.mark.parametrize("dry", [False, True], ids=["train", "dry_run"])
@pytest.mark.parametrize("name", CASES)
def test_bad_data_exits_2_with_one_line_before_weights_load(
    name, dry, tiny_model_dir, arithmetic_data, tmp_path, monkeypatch, capsys
):
    from klppo.assembly import setup
    from klppo.commands.train import main

    def no_weights(*args, **kwargs):
        raise AssertionError("build_run (weights) reached with bad data")

    monkeypatch.setattr(setup, "build_run", no_weights)
    bad, phrase = _case(name, tmp_path, arithmetic_data)
    argv = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + bad
    assert main((["--dry-run"] if dry else []) + argv) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("klppo: ")]
    assert len(lines) == 1 and phrase in lines[0], err
    assert "Traceback" not in err


def test_truncation_is_counted_and_reported(tiny_model_dir, arithmetic_data, tmp_path, capsys):
    from klppo.commands.train import main

    path = _write(tmp_path / "train.parquet", _rows(64, long_rows=(3, 50)))
    argv = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        f"data.train_files={path}",
        "data.filter_overlong_prompts=False",
        "data.truncation=left",
    ]
    assert main(["--dry-run", *argv]) == 0
    out = capsys.readouterr().out
    assert (
        "train prompts: 64 rows, 64 usable, 0 bad, 2 longer than max_prompt_length=64 (truncated, left)"
        in out
    )
    # the plan also states each role's layout and why (plain_single_gpu auto on one process: no FSDP2)
    assert "actor: no FSDP2, one process (fsdp_config.plain_single_gpu=auto)" in out
    assert "critic: no FSDP2, one process" in out  # verl's default estimator: GAE, a critic
    assert "FSDP2 actor" not in out


def test_users_file_in_the_run_directory_is_refused_at_start(
    tiny_model_dir, arithmetic_data, tmp_path, capsys
):
    from klppo.commands.train import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("mine\n")
    assert main(base_overrides(tiny_model_dir, arithmetic_data, run_dir)) == 2
    assert "metrics.jsonl, not written by klppo" in capsys.readouterr().err
    assert (run_dir / "metrics.jsonl").read_text() == "mine\n"
