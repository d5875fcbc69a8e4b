"""A run directory is one run's truth (issue 51), the parts that need no training: the lock proves the run
dead (every rank's process), a fresh start over an earlier run, the resume identity, a reward time limit,
manifest-less checkpoints, one-line failures and their exit codes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch


# ---------------------------------------------------------------------------------------- case 1: lock
def test_lock_is_refused_while_a_rank_of_a_dead_launcher_runs(tmp_path):
    from klppo.ops.run_lock import LOCK_NAME, RANKS_DIR, RunLock, RunLockError

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # the launcher, killed with -9
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # its orphaned rank
    try:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"host": socket.gethostname(), "pid": gone.pid}))
        (tmp_path / RANKS_DIR).mkdir()
        record = {"host": socket.gethostname(), "pid": rank.pid, "start_time": None, "rank": 1}
        (tmp_path / RANKS_DIR / f"x-{rank.pid}.json").write_text(json.dumps(record))
        with pytest.raises(RunLockError, match=f"still run there .PID {rank.pid} .rank 1."):
            RunLock(tmp_path).acquire()
        assert (tmp_path / LOCK_NAME).exists()  # the dead launcher's lock is not replaced while its rank runs
    finally:
        rank.kill()
        rank.wait()
    with RunLock(tmp_path):  # now the run is dead: taken over, the records cleared
        assert not list((tmp_path / RANKS_DIR).glob("*.json"))
    assert not (tmp_path / RANKS_DIR).exists()


# ------------------------------------------------------------------------------- case 2: a fresh start
def _earlier_run(root: Path, *, checkpoint: bool) -> None:
    root.mkdir(parents=True, exist_ok=True)
    if checkpoint:
        (root / "global_step_8").mkdir()
        (root / "latest_checkpointed_iteration.txt").write_text("8\n")
    (root / "metrics.jsonl").write_text('{"step": 1}\n')
    (root / "wandb_run_id.txt").write_text("abc123\n")
    (root / "config.yaml").write_text("mine: 1\n")  # the user's: never moved


def test_fresh_start_over_an_earlier_run_is_refused_archived_or_removed(tmp_path):
    from klppo.ops.run_records import RunExistsError, prepare_fresh_start

    root = tmp_path / "run"
    _earlier_run(root, checkpoint=True)
    with pytest.raises(
        RunExistsError, match="trainer.run_dir_exists=archive .* trainer.run_dir_exists=remove"
    ):
        prepare_fresh_start(root, policy="refuse", resume_mode="disable")
    assert (root / "global_step_8").is_dir() and (root / "metrics.jsonl").read_text() == '{"step": 1}\n'

    prepare_fresh_start(root, policy="archive", resume_mode="disable")
    archived = root / "archive" / "001"
    assert {p.name for p in archived.iterdir()} >= {"global_step_8", "metrics.jsonl", "wandb_run_id.txt"}
    assert not (root / "wandb_run_id.txt").exists()  # a fresh run never continues the old W&B page
    assert sorted(p.name for p in root.iterdir()) == ["archive", "config.yaml"]

    _earlier_run(root, checkpoint=True)
    prepare_fresh_start(root, policy="remove", resume_mode="disable")
    assert sorted(p.name for p in root.iterdir()) == ["archive", "config.yaml"]

    _earlier_run(root, checkpoint=False)  # a start that stopped before its first save: records archived
    prepare_fresh_start(root, policy="refuse", resume_mode="auto")
    assert (root / "archive" / "002" / "metrics.jsonl").exists() and not (root / "metrics.jsonl").exists()


def test_every_start_is_recorded_side_by_side(tmp_path):
    from klppo.ops.run_records import record_start

    first = record_start(tmp_path, config_yaml="a: 1", argv=["klppo", "train", "x=1"])
    second = record_start(tmp_path, config_yaml="a: 2", argv=["klppo", "train", "x=2"])
    assert (first.name, second.name) == ("001", "002")
    assert (first / "command.txt").read_text() == "klppo train x=1\n"
    assert (second / "resolved_config.yaml").read_text() == "a: 2\n"
    assert (tmp_path / "starts" / "latest").read_text() == "002\n"


# ------------------------------------------------------------------------------- case 5: what a resume
# continues
def test_weights_digest_tells_other_weights_under_the_same_shapes(tmp_path):
    from klppo.models.tiny import save_tiny_model_dir
    from klppo.ops.resume_check import architecture, weights_digest

    a = save_tiny_model_dir(tmp_path / "a", num_layers=2, hidden_size=32)
    b = save_tiny_model_dir(tmp_path / "b", num_layers=2, hidden_size=32, seed=1)
    assert architecture(a) == architecture(b)
    assert weights_digest(a) != weights_digest(b)
    assert weights_digest(a) == weights_digest(
        save_tiny_model_dir(tmp_path / "a2", num_layers=2, hidden_size=32)
    )


def _identity(**config) -> dict:
    arch = {"model_type": "llama", "hidden_size": 32}
    return {
        "model": {"path": "/m", "architecture": arch, "weights_digest": "sha256:1"},
        "tokenizer": {"path": "/m", "digest": "sha256:t"},
        "config": {
            "data.train_batch_size": 4,
            "algorithm.adv_estimator": "grpo",
            "actor_rollout_ref.actor.optim.lr": 1e-3,
            **config,
        },
    }


def test_resume_refuses_a_changed_run_by_name_and_notes_what_may_change(tmp_path, caplog):
    from klppo.ops.resume_check import ResumeMismatchError, check_resume

    saved = _identity()
    other = _identity(**{"data.train_batch_size": 8, "algorithm.adv_estimator": "rloo"})
    with pytest.raises(
        ResumeMismatchError,
        match=r"algorithm.adv_estimator 'grpo' → 'rloo'; data.train_batch_size 4 → "
        r"8.*trainer.allow_resume_changes=True",
    ):
        check_resume(saved, other, checkpoint=tmp_path, allow=False)
    weights = _identity()
    weights["model"] = {**weights["model"], "path": "/other", "weights_digest": "sha256:2"}
    with pytest.raises(ResumeMismatchError, match="the model weights .*now /other"):
        check_resume(saved, weights, checkpoint=tmp_path, allow=False)
    arch = _identity()
    arch["model"] = {**arch["model"], "architecture": {"model_type": "qwen2", "hidden_size": 32}}
    with pytest.raises(ResumeMismatchError, match="the model architecture .model_type"):
        check_resume(saved, arch, checkpoint=tmp_path, allow=False)
    with caplog.at_level("WARNING", logger="klppo"):
        check_resume(
            saved, _identity(**{"actor_rollout_ref.actor.optim.lr": 5e-4}), checkpoint=tmp_path, allow=False
        )
        check_resume(saved, other, checkpoint=tmp_path, allow=True)  # on purpose
    notes = [r.getMessage() for r in caplog.records]
    assert len(notes) == 2 and "actor_rollout_ref.actor.optim.lr 0.001 → 0.0005" in notes[0]


# ----------------------------------------------------------------------------- case 4: reward time limit
def test_a_hung_reward_function_is_stopped_at_the_limit_naming_the_row():
    from klppo.roles.reward_limit import RewardTimeoutError, deadline, sample_where

    start = time.monotonic()
    with pytest.raises(RewardTimeoutError, match=r"batch row 1 \(data_source 'gsm8k', file 0 row 17\)"):
        with deadline(0.5, lambda: sample_where(1, ["gsm8k", "gsm8k"], ["0:3", "0:17"])):
            time.sleep(30)
    assert time.monotonic() - start < 5
    with deadline(5, lambda: "unused"):  # a function that returns in time is untouched
        time.sleep(0.01)


# -------------------------------------------------------------------- case 6: one line, an exit code
def test_a_failure_is_one_line_with_its_exit_code_and_the_traceback_in_the_run_directory(tmp_path, capsys):
    from klppo.config import ConfigError
    from klppo.ops.failures import report_failure
    from klppo.roles.reward_limit import RewardTimeoutError

    def raised(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as caught:  # noqa: B036  a traceback to log
            return caught

    full = OSError(28, "No space left on device")
    assert report_failure(raised(full), run_dir=tmp_path, rank=1, world_size=2) == 1
    assert report_failure(raised(ConfigError("bad sizes")), run_dir=tmp_path, rank=0, world_size=1) == 2
    assert (
        report_failure(raised(RewardTimeoutError("rank 1: slow")), run_dir=tmp_path, rank=1, world_size=2)
        == 3
    )
    assert report_failure(raised(KeyboardInterrupt()), run_dir=tmp_path, rank=0, world_size=1) == 130
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith("klppo: rank 1: OSError: [Errno 28] No space left on device (traceback: ")
    assert lines[1].startswith("klppo: bad sizes (traceback: ")
    assert lines[2].startswith("klppo: rank 1: slow (traceback: ")  # the rank named once
    assert "Traceback (most recent call last)" in (tmp_path / "logs" / "rank1.log").read_text()


def test_a_yaml_error_names_its_line_and_column(tmp_path):
    from klppo.config import ConfigError, load_config

    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  seed: 1\n   device: cpu\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: not a readable YAML mapping \(line 3, column \d+: "):
        load_config([str(bad)], notify=lambda _m: None)


def test_ranks_import_the_launchers_klppo_not_a_folder_of_the_working_directory(tmp_path):
    from klppo.parallel.launch import rank_environment

    (tmp_path / "klppo").mkdir()
    (tmp_path / "klppo" / "__init__.py").write_text("")  # no __version__
    here = os.getcwd()
    try:
        os.chdir(tmp_path)
        env = rank_environment(dict(os.environ))
    finally:
        os.chdir(here)
    out = subprocess.run(
        [sys.executable, "-c", "import klppo; print(klppo.__version__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout.strip(), out.stderr


# ---------------------------------------------------------------- checkpoints without a manifest
def _checkpoint(root: Path, step: int) -> Path:
    from klppo.ops.checkpoint import MANIFEST, save_checkpoint

    model = torch.nn.Linear(64, 64)
    path = save_checkpoint(
        root, step, models={"actor": (model, None)}, hf_assets={}, trainer_state={"global_step": step}
    )
    (path / MANIFEST).unlink()  # as written before manifests existed
    return path


def test_a_checkpoint_without_manifest_is_verified_by_loading_and_falls_back(tmp_path):
    from klppo.ops.checkpoint import resolve_resume, validate_checkpoint

    older, newer = _checkpoint(tmp_path, 1), _checkpoint(tmp_path, 2)
    assert validate_checkpoint(newer) is None
    shard = next((newer / "actor").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # cut short
    assert "has 100 bytes" in validate_checkpoint(newer)
    assert resolve_resume("auto", tmp_path, None, roles=["actor"]) == older


def test_a_garbage_trainer_state_is_named_without_torchs_advice(tmp_path):
    import pickle

    from klppo.ops.checkpoint import validate_checkpoint

    path = _checkpoint(tmp_path, 1)
    (path / "trainer_state.pt").write_bytes(pickle.dumps(socket.socket))  # a pickle naming a global
    problem = validate_checkpoint(path)
    assert "trainer_state.pt" in problem and "not written by klppo" in problem
    assert "weights_only" not in problem


def test_export_checks_the_checkpoint_first(tmp_path, capsys):
    from klppo.commands.export import main

    path = _checkpoint(tmp_path, 1)
    (path / "trainer_state.pt").write_bytes(b"\x80")  # cut to one byte
    assert main([str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and err[0].startswith(f"klppo export: {path} is damaged: ")
        and "trainer_state.pt" in err[0]
    )
