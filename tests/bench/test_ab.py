"""bench/ab.py on a temporary git repository of two commits: each revision's code runs from its own
worktree (cwd and PYTHONPATH), in the order A B B A …, and the JSON figures are summarised per revision."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.ab import json_objects, main, pick, run_order

SCRIPT = """
import json, sys
from pathlib import Path
from pkg.value import VALUE  # from this revision's tree (PYTHONPATH)
with open(sys.argv[1], "a") as log:
    log.write(f"{VALUE} {Path.cwd().name}\\n")
print("noise line")
print("== result:", json.dumps({"median_ms": VALUE, "name": "fake", "files": {"a": "1"}}))
"""


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "pkg").mkdir(parents=True)
    _git(repo, "init", "-q")
    _git(repo, "config", "user.email", "t@t")
    _git(repo, "config", "user.name", "t")
    (repo / "bench.py").write_text(SCRIPT)
    (repo / "pkg" / "__init__.py").write_text("")
    for value in (10, 20):
        (repo / "pkg" / "value.py").write_text(f"VALUE = {value}\n")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", f"value {value}")
    return repo


def test_order_alternates_and_each_revision_runs_its_own_code(tmp_path, capsys):
    repo = _repo(tmp_path)
    log = tmp_path / "log.txt"
    out = tmp_path / "ab.json"
    rc = main(
        [
            "HEAD~1",
            "HEAD",
            "--repeats",
            "3",
            "--repo",
            str(repo),
            "--out",
            str(out),
            "--",
            sys.executable,
            "bench.py",
            str(log),
        ]
    )
    assert rc == 0
    lines = log.read_text().split()
    assert lines[0::2] == ["10", "20", "20", "10", "10", "20"]  # A B B A A B
    assert set(lines[1::2]) == {"A", "B"}  # each run's working directory is its revision's worktree
    result = json.loads(out.read_text())
    metrics = result["summary"]["metrics"]
    assert metrics["median_ms"]["A"] == {"median": 10.0, "min": 10.0, "max": 10.0, "n": 3}
    assert metrics["median_ms"]["B"]["median"] == 20.0 and metrics["median_ms"]["B/A"] == 2.0
    assert metrics["wall_s"]["A"]["n"] == 3
    assert result["summary"]["fields"] == {"files": "identical", "name": "identical"}
    printed = capsys.readouterr().out
    assert "| median_ms | 10 [10–10] | 20 [20–20] | 2.0000 |" in printed
    assert _git(repo, "worktree", "list").count("\n") == 1  # the temporary worktrees are gone


def test_a_failing_revision_is_reported_and_left_out(tmp_path, capsys):
    repo = _repo(tmp_path)
    (repo / "pkg" / "value.py").write_text("raise SystemExit(3)\n")
    _git(repo, "commit", "-q", "-am", "broken")
    rc = main(
        [
            "HEAD~1",
            "HEAD",
            "--repeats",
            "1",
            "--repo",
            str(repo),
            "--",
            sys.executable,
            "bench.py",
            str(tmp_path / "log.txt"),
        ]
    )
    assert rc == 1
    assert "FAILED (exit 3)" in capsys.readouterr().out


def test_json_lines_and_selection():
    text = (
        'x\n{"batch": 64, "ms": 1.5}\nrow: {"batch": 256, "ms": 3.0}\n'
        '{"batch": 256, "ms": 2.0, "e": "hf"}\n{bad}'
    )
    objects = json_objects(text)
    assert [o["ms"] for o in objects] == [1.5, 3.0, 2.0]
    assert pick(objects, [("batch", "256")])["ms"] == 2.0
    assert pick(objects, [("batch", "256"), ("e", "hf")])["ms"] == 2.0
    assert pick(objects, [("batch", "64")])["ms"] == 1.5
    assert pick(objects, [("batch", "1")]) is None
    assert run_order(2) == ["A", "B", "B", "A"]


def test_usage_without_a_command():
    assert main(["a", "b"]) == 2
    with pytest.raises(SystemExit):
        main(["a", "b", "--"])


def test_revisions_given_as_directories_run_as_they_are(tmp_path):
    """A machine without the history (the GPU machine) gets the revisions as exported source trees."""
    repo = _repo(tmp_path)
    old = tmp_path / "old"
    old.mkdir()
    archive = subprocess.run(["git", "-C", str(repo), "archive", "HEAD~1"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(old)], input=archive.stdout, check=True)
    log = tmp_path / "log.txt"
    out = tmp_path / "ab.json"
    rc = main(
        [
            str(old),
            str(repo),
            "--repeats",
            "1",
            "--repo",
            str(tmp_path),
            "--out",
            str(out),
            "--",
            sys.executable,
            "bench.py",
            str(log),
        ]
    )
    assert rc == 0
    assert log.read_text().split() == ["10", "old", "20", "repo"]
    assert json.loads(out.read_text())["summary"]["metrics"]["median_ms"]["B/A"] == 2.0
