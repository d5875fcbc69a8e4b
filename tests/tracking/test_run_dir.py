"""Run-directory records: config, command, versions; sample generations."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
import torch
import transformers

import klppo
from klppo.tracking import GenerationLog, write_run_metadata


def test_write_run_metadata(tmp_path):
    run_dir = tmp_path / "run"
    argv = ["klppo", "train", "cfg.yaml", "trainer.experiment_name=a b", "data.path=$HOME/x"]
    versions = write_run_metadata(str(run_dir), config_yaml="a: 1\nb: [2, 3]", argv=argv)
    assert (run_dir / "resolved_config.yaml").read_text() == "a: 1\nb: [2, 3]\n"
    assert shlex.split((run_dir / "command.txt").read_text()) == argv
    on_disk = json.loads((run_dir / "versions.json").read_text())
    assert on_disk == versions
    assert versions["klppo"] == klppo.__version__ and versions["torch"] == torch.__version__
    assert versions["transformers"] == transformers.__version__
    assert versions["python"] == sys.version.split()[0] and versions["cuda"] == torch.version.cuda
    # a second start replaces the files, leaves no temp files
    write_run_metadata(str(run_dir), config_yaml="a: 2\n", argv=["klppo", "train"])
    assert (run_dir / "resolved_config.yaml").read_text() == "a: 2\n"
    assert sorted(p.name for p in run_dir.iterdir()) == [
        ".klppo_files.json",
        "command.txt",
        "resolved_config.yaml",
        "versions.json",
    ]


def test_run_dir_never_overwrites_a_file_it_did_not_create(tmp_path):
    from klppo.tracking.run_dir import RunDirError, claim_run_files

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("mine: 1\n")  # the user's own config, kept in the run directory
    write_run_metadata(str(run_dir), config_yaml="resolved: 1", argv=["klppo", "train"])
    assert (run_dir / "config.yaml").read_text() == "mine: 1\n"
    (run_dir / "notes").mkdir()
    (run_dir / "metrics.jsonl").write_text("user data\n")
    with pytest.raises(RunDirError, match="metrics.jsonl, not written by klppo"):
        claim_run_files(run_dir)
    assert (run_dir / "metrics.jsonl").read_text() == "user data\n"
    (run_dir / "metrics.jsonl").unlink()
    claim_run_files(run_dir)  # now free: claimed, and a second start accepts klppo's own files
    (run_dir / "metrics.jsonl").write_text("")
    claim_run_files(run_dir)


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_generation_log_selects_the_same_prompts_each_time(tmp_path):
    prompts = [f"q{i}" for i in range(10)]
    log = GenerationLog(str(tmp_path))
    first = log.log(
        3,
        prompts=prompts,
        responses=[f"r{i}" for i in range(10)],
        scores=[i / 10 for i in range(10)],
        ground_truths=[str(i) for i in range(10)],
        num_samples=4,
    )
    assert len(first) == 4 and len({r["prompt"] for r in first}) == 4
    for record in first:
        i = int(record["prompt"][1:])
        assert record == {
            "step": 3,
            "prompt": f"q{i}",
            "response": f"r{i}",
            "score": i / 10,
            "ground_truth": str(i),
        }
    # the same prompts, given in another order at a later step, are chosen again
    order = list(reversed(range(10)))
    second = log.log(
        5,
        prompts=[prompts[i] for i in order],
        responses=[f"r{i}" for i in order],
        scores=[0.0] * 10,
        num_samples=4,
    )
    assert [r["prompt"] for r in second] == [r["prompt"] for r in first]
    assert [r["step"] for r in _lines(tmp_path / "generations.jsonl")] == [3] * 4 + [5] * 4


def test_generation_log_write_and_rank(tmp_path):
    GenerationLog(str(tmp_path)).write(2, [{"prompt": "p", "response": "é", "score": 1.0}])
    assert _lines(tmp_path / "generations.jsonl") == [
        {"step": 2, "prompt": "p", "response": "é", "score": 1.0}
    ]
    other = GenerationLog(str(tmp_path / "r1"), rank=1)
    other.write(2, [{"prompt": "p"}])
    assert other.log(2, prompts=["p"], responses=["r"], scores=[1.0], num_samples=1) == []
    assert not (tmp_path / "r1").exists()


def test_generation_log_column_lengths_must_match(tmp_path):
    import pytest

    with pytest.raises(ValueError, match="differ in length"):
        GenerationLog(str(tmp_path)).log(
            1, prompts=["a", "b"], responses=["r"], scores=[1.0, 0.0], num_samples=1
        )
