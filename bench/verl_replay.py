"""Replay verl's launch commands through `klppo config` and `klppo train --dry-run` (CPU, tiny model).

    python bench/verl_replay.py --verl ~/src/verl --work /tmp/verl_replay [--fake-loggers]

1. Collects the launches: every shell script under the verl checkout's `examples/` and
   `tests/special_e2e/` that names `main_ppo`, and every code block of `docs/` that does (written out as
   scripts under WORK). Runs each with `bash` in the checkout, with `python`/`python3` (and `ray`, `srun`,
   `torchrun`, ...) replaced by a stub that records its arguments when they name `main_ppo` (and `rm` by
   one that deletes nothing, so no script removes files of the checkout), so the scripts' shell variables
   are expanded as they would be, with a cluster launcher's variables (`ENV`) set. Nothing of verl is
   copied into this repository.
2. Replays each recorded `verl.trainer.main_ppo` launch, plus `tests/config/conftest.py`'s ISSUE_LIST:
   `klppo config ARGS`, then `klppo train --dry-run ARGS`, both with what the user of any launch supplies
   replaced — the model (and critic) by a tiny one, the data files by small Parquet files shaped like the
   set the launch names (its prompt column, enough rows for its batch, an image column for a vision set),
   the run directory by one under WORK — on CPU, in the checkout's directory as the scripts ran: the files
   a launch names inside verl's tree (a `--config-path`, a multi-turn tool or interaction config, a reward
   function) are read there, relative paths included, as verl reads them.
3. Classifies: accepted (both exit 0), refused (the message names an unbuilt feature), env (a logger
   package is missing; `--fake-loggers` puts importable stand-ins on the path to look past it), failed
   (anything else: read the message). Writes WORK/replay.jsonl and prints the counts.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import textwrap
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REFUSAL = re.compile(r"not built|not supported|cannot honour|does not build|trains PPO only")
ENVIRONMENT = re.compile(r"package is not installed")
STUB = """#!/usr/bin/env bash
for a in "$@"; do case "$a" in *main_ppo*)
  {py} -c 'import json,os,sys; open(os.environ["RECORD"],"a").write(json.dumps(sys.argv[1:])+"\\n")' "$@"
  exit 0;; esac; done
exit 0
"""
STUBBED = (
    "rm",
    "python",
    "python3",
    "ray",
    "torchrun",
    "srun",
    "sbatch",
    "scontrol",
    "nvidia-smi",
    "npu-smi",
    "huggingface-cli",
    "hf",
    "pip",
    "pip3",
    "wget",
    "curl",
    "modelscope",
    "conda",
    "docker",
    "apptainer",
    "singularity",
    "mpirun",
    "accelerate",
    "uv",
    "sleep",
)
# what a cluster's launcher sets (Slurm, ByteDance's Arnold): stand-ins, as for any launch's model and data
ENV = {
    "SLURM_GPUS_PER_NODE": "8",
    "SLURM_NNODES": "1",
    "SLURM_JOB_NUM_NODES": "1",
    "GPUS_PER_NODE": "8",
    "NNODES": "1",
    "ARNOLD_WORKER_GPU": "8",
    "ARNOLD_WORKER_NUM": "1",
}


def doc_blocks(verl: Path, out: Path) -> list[Path]:
    """Each docs code block (markdown fences, rst `::` / `.. code-block::`) naming main_ppo, as a script."""
    out.mkdir(parents=True, exist_ok=True)
    scripts = []
    for doc in sorted([*verl.glob("docs/**/*.md"), *verl.glob("docs/**/*.rst")]):
        lines = doc.read_text(errors="replace").splitlines()
        blocks: list[list[str]] = []
        if doc.suffix == ".md":
            cur: list[str] | None = None
            for ln in lines:
                if ln.strip().startswith("```"):
                    if cur is None:
                        cur = []
                    else:
                        blocks.append(cur)
                        cur = None
                elif cur is not None:
                    cur.append(ln)
        else:
            i = 0
            while i < len(lines):
                if lines[i].rstrip().endswith("::") or ".. code" in lines[i]:
                    j, blk = i + 1, []
                    while j < len(lines) and (not lines[j].strip() or lines[j].startswith((" ", "\t"))):
                        blk.append(lines[j])
                        j += 1
                    blocks.append(textwrap.dedent("\n".join(blk)).splitlines())
                    i = j
                else:
                    i += 1
        for k, block in enumerate(b for b in blocks if "main_ppo" in "\n".join(b)):
            text = "\n".join(ln for ln in block if not ln.strip().startswith(":"))
            path = out / (str(doc.relative_to(verl)).replace("/", "__") + f"__{k + 1}.sh")
            path.write_text(text + "\n")
            scripts.append(path)
    return scripts


def record(verl: Path, work: Path) -> list[tuple[str, list[str]]]:
    """(name, argv after main_ppo) of every recorded `verl.trainer.main_ppo` launch."""
    stub_dir = work / "stub"
    stub_dir.mkdir(parents=True, exist_ok=True)
    for name in STUBBED:
        (stub_dir / name).write_text(STUB.format(py=sys.executable))
        (stub_dir / name).chmod(0o755)
    scripts = [p for d in ("examples", "tests/special_e2e") for p in sorted((verl / d).glob("**/*.sh"))]
    scripts = [p for p in scripts if "main_ppo" in p.read_text(errors="replace")]
    scripts += doc_blocks(verl, work / "docsnips")
    launches = []
    for script in scripts:
        rec = work / "record.jsonl"
        rec.unlink(missing_ok=True)
        env = {**ENV, "RECORD": str(rec), "HOME": str(work / "home"), "PATH": f"{stub_dir}:/usr/bin:/bin"}
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(["bash", str(script)], cwd=verl, env=env, timeout=20, capture_output=True)
        name = str(script.relative_to(verl) if script.is_relative_to(verl) else script.relative_to(work))
        for i, line in enumerate(rec.read_text().splitlines() if rec.exists() else []):
            argv = json.loads(line)
            at = [j for j, a in enumerate(argv) if a.endswith("verl.trainer.main_ppo")]
            if at:
                launches.append((f"{name}#{i + 1}", argv[at[0] + 1 :]))
    spec = importlib.util.spec_from_file_location("conftest", ROOT / "tests" / "config" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    return [*launches, ("ISSUE_LIST", list(conftest.ISSUE_LIST))]


def _value(argv: list[str], key: str, default: str | None = None) -> str | None:
    for a in argv:
        k, _, v = a.lstrip("+").partition("=")
        if k == key:
            default = v
    return default


def data_for(work: Path, name: str, argv: list[str]) -> tuple[str, str]:
    """Train/val Parquet files shaped like the set the launch names."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from klppo.data.arithmetic import arithmetic_rows

    batch = _value(argv, "data.train_batch_size", "1024") or "1024"
    n = max(int(float(batch)) if re.fullmatch(r"[0-9.e+]+", batch) else 1024, 8)
    key = _value(argv, "data.prompt_key", "prompt") or "prompt"
    vision = any(
        re.search(r"geo3k|VL|vl-|multimodal|image", a)
        for a in argv
        if a.startswith(("data.", "actor_rollout_ref.model.path"))
    )
    d = work / "data" / re.sub(r"[^A-Za-z0-9_.-]", "_", name)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, rows_n in (("train", n), ("test", 16)):
        rows = arithmetic_rows(min(rows_n, 16000), split=split, seed=0)
        while len(rows) < rows_n:
            rows += rows[: rows_n - len(rows)]
        cols = {c: [r[c] for r in rows] for c in rows[0]}
        cols[key] = cols.pop("prompt")
        if vision:
            cols[key] = [[{**m, "content": "<image>" + m["content"]} for m in p] for p in cols[key]]
            cols["images"] = [[{"bytes": b"\x89PNG", "path": None}] for _ in rows]
        path = d / f"{split}.parquet"
        pq.write_table(pa.table(cols), path)
        paths.append(str(path))
    return paths[0], paths[1]


def _call(fn, argv: list[str]) -> tuple[object, str]:
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            rc = fn(list(argv))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # a crash is the finding here: recorded with its traceback, never hidden
            rc = "EXC"
            err.write(traceback.format_exc())
    return rc, err.getvalue()


def replay(launches: list[tuple[str, list[str]]], work: Path, verl: Path) -> list[dict]:
    """Each launch's verdict (module docstring, 2-3), run in ``verl``, the directory its script ran in."""
    from klppo.commands.train import main as train_main
    from klppo.config.cli import main as config_main
    from klppo.models.tiny import save_tiny_model_dir

    tiny = work / "tiny"
    if not (tiny / "config.json").exists():
        save_tiny_model_dir(tiny, num_layers=2, hidden_size=64)
    results = []
    for k, (name, argv) in enumerate(launches):
        train, val = data_for(work, name, argv)
        # what the user of every launch supplies (model, data, run directory): the script's own value, even
        # one it leaves to an unset variable as a placeholder, decides nothing here
        stand_ins = [
            f"actor_rollout_ref.model.path={tiny}",
            f"data.train_files={train}",
            f"data.val_files={val}",
            f"trainer.default_local_dir={work}/runs/{k}",
        ]
        if _value(argv, "critic.model.path") is not None:
            stand_ins.append(f"critic.model.path={tiny}")
        replaced = {a.partition("=")[0] for a in stand_ins}
        argv_here = [a for a in argv if a.lstrip("+").partition("=")[0] not in replaced]
        with contextlib.chdir(verl):
            rc, err = _call(config_main, [*argv_here, *stand_ins])
            if _value(argv, "trainer.device") == "cuda":
                stand_ins.append("trainer.device=cpu")  # replayed on CPU
            rc2, err2 = _call(train_main, ["--dry-run", *argv_here, *stand_ins])
        text = err2 if rc == 0 else err
        if rc == 0 and rc2 == 0:
            verdict = "accepted"
        elif "EXC" not in (rc, rc2) and REFUSAL.search(text):
            verdict = "refused"
        elif "EXC" not in (rc, rc2) and ENVIRONMENT.search(text):
            verdict = "env"
        else:
            verdict = "failed"
        lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("klppo: note")]
        results.append(
            {"name": name, "config": rc, "dry_run": rc2, "verdict": verdict, "message": lines[-8:]}
        )
        print(f"{verdict:9} {name}: {lines[-1] if lines else ''}"[:220], flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--verl", type=Path, required=True, help="a verl checkout")
    ap.add_argument("--work", type=Path, default=Path("/tmp/verl_replay"))
    ap.add_argument("--fake-loggers", action="store_true", help="importable wandb/mlflow/swanlab stand-ins")
    args = ap.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    if args.fake_loggers:
        for m in ("wandb", "mlflow", "swanlab"):
            (work / "fake_loggers" / m).mkdir(parents=True, exist_ok=True)
            (work / "fake_loggers" / m / "__init__.py").write_text("")
        sys.path.insert(0, str(work / "fake_loggers"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    verl = args.verl.resolve()
    results = replay(record(verl, work), work, verl)
    with open(work / "replay.jsonl", "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    counts = Counter(r["verdict"] for r in results)
    print(
        dict(counts),
        "config ok",
        sum(r["config"] == 0 for r in results),
        "dry-run ok",
        sum(r["dry_run"] == 0 for r in results),
        "of",
        len(results),
    )


if __name__ == "__main__":
    main()
