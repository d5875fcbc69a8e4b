"""Checkpoint drills: a failure inside torch.distributed.checkpoint's writer (and a real full tmpfs) leaves
no partial directory and a named message; damaged checkpoints are named in one line and the newest intact
older one is used; a planted pickle never runs; `klppo export` refuses a non-empty target."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.utils import base_overrides, run_training

CODE_RAN = "code_ran"


class _Planted:
    """Unpickling this calls builtins.open(path, "w"): it creates a file, i.e. runs the planter's code."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _two_checkpoints(tiny_model_dir, arithmetic_data, run_dir: Path) -> list[str]:
    overrides = base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
        "trainer.total_training_steps=2",
        "trainer.save_freq=1",
    ]
    run_training(overrides)
    assert (run_dir / "global_step_2" / "MANIFEST.json").exists()
    return overrides


def test_truncated_shard_resumes_from_the_previous_checkpoint(
    tiny_model_dir, arithmetic_data, tmp_path, caplog
):
    run_dir = tmp_path / "run"
    overrides = _two_checkpoints(tiny_model_dir, arithmetic_data, run_dir)
    shard = sorted((run_dir / "global_step_2" / "actor").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    with caplog.at_level("WARNING", logger="klppo"):
        state, parts = run_training(overrides + ["trainer.total_training_steps=3", "trainer.save_freq=-1"])
    assert parts.resume_path.name == "global_step_1"
    assert state.global_step == 3
    damaged = [r.getMessage() for r in caplog.records if "is damaged" in r.getMessage()]
    assert len(damaged) == 1 and shard.name in damaged[0] and "\n" not in damaged[0]
    assert any(
        "older intact checkpoint" in r.getMessage() and "global_step_1" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.parametrize(
    "damage, named",
    [
        ("empty_trainer_state", "trainer_state.pt"),
        ("truncated_rng", "rank_0.pt"),
        ("missing_metadata", ".metadata"),
        ("no_manifest_missing_metadata", ".metadata"),
    ],
)
def test_damaged_checkpoint_files_are_named(tiny_model_dir, arithmetic_data, tmp_path_factory, damage, named):
    from klppo.ops.checkpoint import validate_checkpoint

    src = _shared_checkpoint(tiny_model_dir, arithmetic_data, tmp_path_factory)
    ckpt = tmp_path_factory.mktemp(damage) / "global_step_2"
    shutil.copytree(src, ckpt)
    assert validate_checkpoint(ckpt, roles=["actor", "critic"]) is None
    if damage == "empty_trainer_state":
        (ckpt / "trainer_state.pt").write_bytes(b"")
    elif damage == "truncated_rng":
        rng = ckpt / "rng" / "rank_0.pt"
        rng.write_bytes(rng.read_bytes()[:100])
    else:
        (ckpt / "actor" / ".metadata").unlink()
        if damage.startswith("no_manifest"):
            (ckpt / "MANIFEST.json").unlink()
    problem = validate_checkpoint(ckpt, roles=["actor", "critic"])
    assert problem is not None and named in problem and "\n" not in problem


_SHARED: dict[str, Path] = {}


def _shared_checkpoint(tiny_model_dir, arithmetic_data, tmp_path_factory) -> Path:
    if "ckpt" not in _SHARED:
        run_dir = tmp_path_factory.mktemp("shared_run")
        _two_checkpoints(tiny_model_dir, arithmetic_data, run_dir)
        _SHARED["ckpt"] = run_dir / "global_step_2"
    return _SHARED["ckpt"]


def test_every_checkpoint_damaged_stops_with_one_line(tiny_model_dir, arithmetic_data, tmp_path):
    from klppo.ops.checkpoint import CheckpointError

    run_dir = tmp_path / "run"
    overrides = _two_checkpoints(tiny_model_dir, arithmetic_data, run_dir)
    # the newest lost its critic folder: its manifest lists the files, so it is damage (not "saved by a run
    # without a critic", as a review found it refused) and the older intact checkpoint is the one to resume
    from klppo.ops.checkpoint import other_setup, resolve_resume

    shutil.rmtree(run_dir / "global_step_2" / "critic")
    assert other_setup(run_dir / "global_step_2", ["actor", "critic"]) is None
    assert resolve_resume("auto", run_dir, None, roles=["actor", "critic"]) == run_dir / "global_step_1"
    for step in (1, 2):
        (run_dir / f"global_step_{step}" / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no intact checkpoint") as info:
        run_training(overrides + ["trainer.total_training_steps=3"])
    assert "\n" not in str(info.value)


def test_planted_pickle_does_not_execute(tiny_model_dir, arithmetic_data, tmp_path):
    """A planted trainer_state.pt / RNG file / DCP .metadata with a consistent manifest (the attacker rewrote
    it too): loading refuses with one line naming the file, and the planted code never runs."""
    from klppo.ops.checkpoint import CheckpointError, load_checkpoint, write_manifest
    from klppo.parallel.checkpoint import SafeFileSystemReader, UnsafeCheckpointError

    run_dir = tmp_path / "run"
    overrides = _two_checkpoints(tiny_model_dir, arithmetic_data, run_dir)
    ckpt = run_dir / "global_step_2"
    evidence = tmp_path / CODE_RAN
    torch.save({"global_step": 2, "payload": _Planted(evidence)}, ckpt / "trainer_state.pt")
    write_manifest(ckpt, 2)
    with pytest.raises(CheckpointError, match="trainer_state.pt") as info:
        run_training(overrides + ["trainer.total_training_steps=3"])
    assert "\n" not in str(info.value)
    assert not evidence.exists()

    torch.save(_Planted(evidence), ckpt / "rng" / "rank_0.pt")
    shutil.copy(run_dir / "global_step_1" / "trainer_state.pt", ckpt / "trainer_state.pt")
    with pytest.raises(CheckpointError, match="rank_0.pt"):
        load_checkpoint(ckpt, models={})
    assert not evidence.exists()

    import pickle

    with open(ckpt / "actor" / ".metadata", "wb") as f:
        pickle.dump(_Planted(evidence), f)
    with pytest.raises(UnsafeCheckpointError, match=r"refused to load global (builtins|io)\.open"):
        SafeFileSystemReader(str(ckpt / "actor")).read_metadata()
    assert not evidence.exists()


def test_dcp_writer_failure_removes_partial_and_names_full_disk(
    tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    """The error a full disk gives inside DCP's writer thread ("unexpected pos" from the zip writer,
    wrapped in a CheckpointException, which is not an OSError) is cleaned up and named."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    from klppo.ops import checkpoint

    run_dir = tmp_path / "run"
    overrides = base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
        "trainer.total_training_steps=1",
        "trainer.save_freq=1",
    ]
    run_training(overrides)

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 4160 vs 4056")

    monkeypatch.setattr(dcp_fs, "_write_item", full_disk)
    with pytest.raises(checkpoint.CheckpointError) as info:
        run_training(overrides + ["trainer.total_training_steps=2"])
    message = str(info.value)
    assert "\n" not in message and "global_step_2" in message
    assert "the disk is full" in message and "free on" in message and "needs about" in message
    assert "global_step_1 stays the latest" in message
    assert not any(p.name.startswith(".global_step") for p in run_dir.iterdir())
    assert checkpoint.latest_checkpoint(run_dir).name == "global_step_1"


def test_any_save_exception_is_cleaned_up(tiny_model_dir, arithmetic_data, tmp_path, monkeypatch):
    from klppo.ops import checkpoint

    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path) + ["trainer.save_freq=1"]

    def broken(directory):
        raise ValueError("tokenizer cannot be saved")

    real_save = checkpoint.save_checkpoint

    def save_with_broken_assets(*args, **kwargs):
        kwargs["hf_assets"] = {"actor": broken}
        return real_save(*args, **kwargs)

    from klppo.trainer import ppo_trainer

    monkeypatch.setattr(ppo_trainer, "save_checkpoint", save_with_broken_assets)
    with pytest.raises(checkpoint.CheckpointError, match="Hugging Face files failed .ValueError: tokenizer"):
        run_training(overrides)
    assert not any(p.name.startswith(".global_step") for p in tmp_path.iterdir())


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(
        ["unshare", "-rm", "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", "/tmp"], capture_output=True
    )
    return probe.returncode == 0


FILL_THE_DISK = """
import os

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    filler = os.path.join({run_dir!r}, "filler")
    if not os.path.exists(filler):  # during step 1: leave 256 KiB free, less than one checkpoint
        st = os.statvfs({run_dir!r})
        with open(filler, "wb") as f:
            f.write(bytes(st.f_bavail * st.f_frsize - 256 * 1024))
    return 0.0
"""


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="mounting a tmpfs (user namespace) is not allowed here")
def test_real_full_tmpfs(tiny_model_dir, arithmetic_data, tmp_path):
    """`klppo train` on a 32 MiB tmpfs that the reward function fills during step 1 (the start-up space
    check passes): the first checkpoint cannot fit; no partial directory stays, the message names the
    full disk, and the exit code is 1."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fn = tmp_path / "fill.py"
    fn.write_text(FILL_THE_DISK.format(run_dir=str(run_dir)))
    argv = base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
        "trainer.save_freq=1",
        f"custom_reward_function.path={fn}",
    ]
    train = " ".join(f"'{a}'" for a in [sys.executable, "-m", "klppo.cli", "train", *argv])
    script = (
        f"mount -t tmpfs -o size=32m tmpfs '{run_dir}' || exit 99; {train} 2>err.txt; echo rc=$?; "
        f"ls -A '{run_dir}'; tail -n 1 err.txt"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    lines = out.stdout.splitlines()
    assert "rc=1" in lines, out.stdout + out.stderr
    listing = lines[lines.index("rc=1") + 1 : -1]
    assert "filler" in listing  # the disk really was filled
    assert not any(name.startswith(".global_step") or name.startswith("global_step") for name in listing)
    assert "the disk is full" in lines[-1] and "global_step_1" in lines[-1], lines[-1]


def test_export_refuses_a_non_empty_target(tiny_model_dir, arithmetic_data, tmp_path_factory, capsys):
    from klppo.commands.export import main as export_main

    ckpt = _shared_checkpoint(tiny_model_dir, arithmetic_data, tmp_path_factory)
    target = tmp_path_factory.mktemp("base_model")
    shutil.copytree(tiny_model_dir, target, dirs_exist_ok=True)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    assert export_main([str(ckpt), str(target)]) == 2
    assert "is not empty" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert export_main([str(ckpt), str(target), "--overwrite"]) == 0
    assert json.loads((target / "config.json").read_text())


def test_run_directory_keeps_the_users_config(tiny_model_dir, arithmetic_data, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("# my settings\n")
    run_training(base_overrides(tiny_model_dir, arithmetic_data, run_dir))
    assert (run_dir / "config.yaml").read_text() == "# my settings\n"
    assert "actor_rollout_ref" in (run_dir / "resolved_config.yaml").read_text()


def test_resume_messages_say_what_the_checkpoint_is(tiny_model_dir, arithmetic_data, tmp_path):
    """A GRPO checkpoint resumed with a critic, a resume_from_path that does not exist or names the run
    directory: each was reported as a damaged checkpoint."""
    from klppo.ops.checkpoint import CheckpointError, resolve_resume

    run_dir = tmp_path / "grpo"
    grpo = base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
        "algorithm.adv_estimator=grpo",
        "trainer.save_freq=1",
    ]
    run_training(grpo)
    with pytest.raises(
        CheckpointError, match=r"global_step_1 holds no critic state: it was saved by a run without a critic"
    ):
        run_training(
            base_overrides(tiny_model_dir, arithmetic_data, run_dir) + ["trainer.total_training_steps=2"]
        )
    with pytest.raises(CheckpointError, match=r"trainer.resume_from_path=.*nope does not exist"):
        resolve_resume("resume_path", tmp_path / "new", str(tmp_path / "nope"), roles=["actor"])
    with pytest.raises(
        CheckpointError,
        match=r"is a run directory: name one of its checkpoints \(the newest: .*global_step_1\)",
    ):
        resolve_resume("resume_path", tmp_path / "new", str(run_dir), roles=["actor"])
    assert resolve_resume("resume_path", tmp_path / "new", str(run_dir / "global_step_1"), roles=["actor"])
    # and before any weights load: `klppo train`'s start-up checks say the same in one line
    from klppo.assembly.startup_checks import check_before_weights
    from klppo.config import ConfigError, load_config

    gae = load_config(base_overrides(tiny_model_dir, arithmetic_data, run_dir))
    with pytest.raises(ConfigError, match="holds no critic state"):
        check_before_weights(gae, str(tiny_model_dir))
    missing = load_config(
        base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "other")
        + ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp_path / 'nope'}"]
    )
    with pytest.raises(ConfigError, match="nope does not exist"):
        check_before_weights(missing, str(tiny_model_dir))


def test_resume_from_path_outside_its_mode_is_named():
    from klppo.config import load_config

    notes: list[str] = []
    load_config(["trainer.resume_from_path=/x/global_step_3"], notify=notes.append)
    assert any(
        "trainer.resume_from_path=/x/global_step_3 is read only with trainer.resume_mode=resume_path" in n
        for n in notes
    )


def test_a_checkpoint_from_before_the_manifests_without_a_role_is_another_setup(tmp_path):
    from klppo.ops.checkpoint import other_setup

    ckpt = tmp_path / "global_step_1"
    for name in ("COMPLETE", "trainer_state.pt", "rng/rank_0.pt", "actor/.metadata"):
        (ckpt / name).parent.mkdir(parents=True, exist_ok=True)
        (ckpt / name).write_bytes(b"x")
    assert "holds no critic state" in other_setup(ckpt, ["actor", "critic"])
    assert other_setup(ckpt, ["actor"]) is None
    import shutil as sh

    sh.rmtree(ckpt / "actor")  # an actor folder lost: damage (every run has an actor), not another set-up
    assert other_setup(ckpt, ["actor", "critic"]) is None
