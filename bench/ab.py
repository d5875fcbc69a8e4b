"""A/B of two revisions: the same benchmark command on each, in one invocation, alternating order.

    python3 bench/ab.py REV_A REV_B [--repeats N] [--select KEY=VALUE] [--metric KEY] [--out FILE] -- CMD ...

Both revisions (anything ``git rev-parse`` reads: a branch, a commit, ``HEAD~1``) are checked out into
temporary git worktrees of the repository this is run from; a revision given as a directory (a source tree
exported beforehand, for a machine without the history) runs there as it is. ``CMD`` runs ``N`` times in
each, in the order A B B A A B … (each revision first as often as second, so a drift of the machine — clocks,
caches, a
neighbour's load — falls on both), with the worktree as the working directory and first on ``PYTHONPATH``:
``python3 bench/ppo_step.py`` runs that revision's script on that revision's package. The command is not
run through a shell (``bash -c '…'`` for one).

From each run's stdout the JSON objects are read — a line that is one, or a line that ends in one
(``== trl / after: {...}``) — and the last one is kept (``--select KEY=VALUE``: the last one whose ``KEY``
prints as ``VALUE``; repeatable, all must match). Its numeric fields (``--metric``: only those), and the
run's wall time ``wall_s``, are summarised per revision: the median, the spread (min–max) and the ratio of
the medians B/A. A failed run is reported with its exit status and the tail of its output, and left out.
Non-numeric fields equal in every run of both revisions are said to be identical; differing ones are
printed (e.g. ``bench/gguf_convert.py``'s file digests).

    python3 bench/ab.py main HEAD --repeats 3 -- python3 bench/ppo_step.py --workload trl --variants after
    python3 bench/ab.py HEAD~1 HEAD --select engine=klppo --select batch=256 -- python3 bench/rollout.py
    --batches 256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Run:
    """One run of the command on one revision."""

    label: str  # "A" or "B"
    returncode: int
    wall_s: float
    stdout: str
    stderr: str
    record: dict | None = None  # the JSON object kept (see the module docstring)


@dataclass
class Side:
    """One revision: its name as given, its commit, its worktree and runs."""

    label: str
    rev: str
    commit: str
    tree: Path | None = None
    runs: list[Run] = field(default_factory=list)


def run_order(repeats: int) -> list[str]:
    """``A B B A A B …``: ``repeats`` runs of each, each revision first in every other pair."""
    return [x for i in range(repeats) for x in (("A", "B") if i % 2 == 0 else ("B", "A"))]


def json_objects(text: str) -> list[dict]:
    """The JSON objects of ``text``'s lines: a line that is one, or that ends in one after a prefix."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line.endswith("}"):
            continue
        start = line.find("{")
        while start != -1:
            try:
                value = json.loads(line[start:])
            except json.JSONDecodeError:
                start = line.find("{", start + 1)
                continue
            if isinstance(value, dict):
                out.append(value)
            break
    return out


def pick(objects: list[dict], select: list[tuple[str, str]]) -> dict | None:
    """The last of ``objects`` whose fields print as ``select`` says (all of them); None if none does."""
    for obj in reversed(objects):
        if all(k in obj and _text(obj[k]) == v for k, v in select):
            return obj
    return None


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
    ).stdout.strip()


def add_worktree(repo: Path, commit: str, path: Path) -> None:
    _git(repo, "worktree", "add", "--detach", "--quiet", str(path), commit)


def remove_worktree(repo: Path, path: Path) -> None:
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(path)], capture_output=True)
    if repo is not None:
        subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


DIRECTORY = "(directory)"
"""The commit shown for a revision given as a source directory."""


def make_side(label: str, rev: str, repo: Path | None) -> Side:
    """A revision as a git commit of ``repo``, or, when ``rev`` is a directory, that source tree as it is
    (for a machine without the repository's history: e.g. ``git archive REV | tar -x -C old`` made
    beforehand)."""
    if Path(rev).is_dir():
        return Side(label, rev, DIRECTORY, tree=Path(rev).resolve())
    assert repo is not None
    return Side(label, rev, _git(repo, "rev-parse", "--verify", f"{rev}^{{commit}}"))


def run_once(command: list[str], tree: Path, label: str) -> Run:
    """``command`` in ``tree`` with ``tree`` first on PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [env.get("PYTHONPATH")])])
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True)
    return Run(label, proc.returncode, time.perf_counter() - start, proc.stdout, proc.stderr)


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarise(sides: dict[str, Side], metrics: list[str]) -> dict:
    """Per metric and revision: median, min, max, n (the runs that succeeded); the ratio B/A of the medians;
    and the non-numeric fields, identical in every run or not."""
    good = {k: [r for r in s.runs if r.returncode == 0] for k, s in sides.items()}
    records = {k: [r.record or {} for r in runs] for k, runs in good.items()}
    numeric = sorted({key for rs in records.values() for r in rs for key, v in r.items() if _number(v)})
    keys = metrics or numeric
    table: dict[str, dict] = {}
    for key in ["wall_s", *keys]:
        row = {}
        for label, runs in good.items():
            raw = [r.wall_s for r in runs] if key == "wall_s" else [r.get(key) for r in records[label]]
            values = [float(v) for v in raw if _number(v)]
            if values:
                row[label] = spread(values)
        if "A" in row and "B" in row and row["A"]["median"]:
            row["B/A"] = row["B"]["median"] / row["A"]["median"]
        table[key] = row
    others = {}
    for key in sorted({key for rs in records.values() for r in rs for key, v in r.items() if not _number(v)}):
        seen = [json.dumps(r.get(key), sort_keys=True) for rs in records.values() for r in rs]
        others[key] = (
            "identical" if len(set(seen)) == 1 else {k: [r.get(key) for r in rs] for k, rs in records.items()}
        )
    return {"metrics": table, "fields": others}


def _number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def print_summary(sides: dict[str, Side], summary: dict) -> None:
    for label, side in sides.items():
        failed = sum(r.returncode != 0 for r in side.runs)
        print(
            f"{label}: {side.rev} ({side.commit[:12]}), {len(side.runs)} runs"
            + (f", {failed} failed" if failed else "")
        )
    print("\n| metric | A median [min–max] | B median [min–max] | B/A |\n|---|---|---|---|")
    for key, row in summary["metrics"].items():
        cells = [
            f"{row[x]['median']:.6g} [{row[x]['min']:.6g}–{row[x]['max']:.6g}]" if x in row else "–"
            for x in "AB"
        ]
        ratio = f"{row['B/A']:.4f}" if "B/A" in row else "–"
        print(f"| {key} | {cells[0]} | {cells[1]} | {ratio} |")
    for key, value in summary["fields"].items():
        print(f"{key}: {value if value == 'identical' else json.dumps(value)}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("usage: bench/ab.py REV_A REV_B [options] -- CMD ...", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rev_a")
    parser.add_argument("rev_b")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each revision (default 3)")
    parser.add_argument("--select", action="append", default=[], help="KEY=VALUE: which JSON object to keep")
    parser.add_argument("--metric", action="append", default=[], help="summarise only these fields")
    parser.add_argument("--repo", default=".", help="the git repository (default: the current directory's)")
    parser.add_argument("--out", default=None, help="write the runs and the summary as JSON here")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1 :]
    if not command or args.repeats < 1:
        parser.error("a command after --, and --repeats at least 1")
    select = [tuple(s.split("=", 1)) for s in args.select]
    if any(len(s) != 2 for s in select):
        parser.error("--select takes KEY=VALUE")
    revs = (("A", args.rev_a), ("B", args.rev_b))
    repo = (
        None
        if all(Path(rev).is_dir() for _, rev in revs)
        else Path(_git(Path(args.repo), "rev-parse", "--show-toplevel"))
    )
    sides = {label: make_side(label, rev, repo) for label, rev in revs}
    with tempfile.TemporaryDirectory(prefix="klppo_ab_") as root:
        try:
            for side in sides.values():
                if side.tree is None:
                    side.tree = Path(root) / side.label
                    add_worktree(repo, side.commit, side.tree)
            for i, label in enumerate(run_order(args.repeats)):
                side = sides[label]
                run = run_once(command, side.tree, label)
                run.record = pick(json_objects(run.stdout), select)
                side.runs.append(run)
                status = "ok" if run.returncode == 0 else f"FAILED (exit {run.returncode})"
                print(
                    f"[{i + 1}/{2 * args.repeats}] {label} {side.commit[:12]}: {run.wall_s:.2f} s, {status}",
                    flush=True,
                )
                if run.returncode != 0:
                    print("\n".join((run.stdout + run.stderr).splitlines()[-20:]), flush=True)
                elif run.record is None:
                    print(
                        "  (no JSON object in its output" + (" matching --select)" if select else ")"),
                        flush=True,
                    )
                else:  # each run's figures as it ends: a cut-off invocation still leaves them
                    shown = {k: v for k, v in run.record.items() if not args.metric or k in args.metric}
                    print("  " + json.dumps(shown), flush=True)
        finally:
            for side in sides.values():
                if side.tree is not None and side.commit != DIRECTORY:
                    remove_worktree(repo, side.tree)
    summary = summarise(sides, args.metric)
    print_summary(sides, summary)
    if args.out:
        runs = {
            k: [
                {"returncode": r.returncode, "wall_s": r.wall_s, "record": r.record, "stdout": r.stdout}
                for r in s.runs
            ]
            for k, s in sides.items()
        }
        revs = {k: {"rev": s.rev, "commit": s.commit} for k, s in sides.items()}
        Path(args.out).write_text(
            json.dumps({"command": command, "revisions": revs, "runs": runs, "summary": summary}, indent=1)
        )
    return 0 if all(r.returncode == 0 for s in sides.values() for r in s.runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
