"""Helpers for the end-to-end trainer tests."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


def base_overrides(model_dir: Path, data: tuple[Path, Path], run_dir: Path) -> list[str]:
    train, test = data
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={train}",
        f"data.val_files={test}",
        "data.train_batch_size=4",
        "data.max_prompt_length=64",
        "data.max_response_length=8",
        "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.rollout.name=hf",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "critic.forward_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-3",
        "critic.optim.lr=1e-3",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "critic.model.enable_gradient_checkpointing=False",
        "reward_model.reward_kwargs={method: flexible}",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
        "trainer.logger=[jsonl]",
        "trainer.val_before_train=False",
        "trainer.test_freq=-1",
        "trainer.save_freq=-1",
        "trainer.total_training_steps=1",
        f"trainer.default_local_dir={run_dir}",
    ]


def run_training(overrides: list[str]):
    """Train in this process (world size 1); returns (state, run) for inspection."""
    from klppo.assembly.setup import build_run
    from klppo.config import load_config
    from klppo.parallel import dist
    from klppo.trainer.ppo_trainer import PPOTrainer

    torch.set_num_threads(1)
    cfg = load_config(overrides)
    info = dist.init_distributed("cpu", 120.0)
    try:
        run = build_run(cfg, device=info.device, argv=overrides)
        state = PPOTrainer(run).fit()
        return state, run
    finally:
        dist.destroy()


def assert_resume_matches(
    overrides, full_dir: Path, cut_dir: Path, keys: tuple[str, ...], steps: int = 4, stop: int = 2
) -> None:
    """Train ``overrides(full_dir)`` for ``steps`` steps, and ``overrides(cut_dir)`` for ``stop`` steps (a
    checkpoint there) then resumed to ``steps``: every step after ``stop`` logs ``keys`` as the uninterrupted
    run does (rel 1e-5, abs 1e-7)."""
    run_training(overrides(full_dir) + [f"trainer.total_training_steps={steps}"])
    cut = overrides(cut_dir)
    run_training(cut + [f"trainer.total_training_steps={stop}", f"trainer.save_freq={stop}"])
    run_training(cut + [f"trainer.total_training_steps={steps}"])
    want, got = read_metrics(full_dir), {m["step"]: m for m in read_metrics(cut_dir)}
    for step in range(stop + 1, steps + 1):
        for key in keys:
            assert got[step][key] == pytest.approx(want[step - 1][key], rel=1e-5, abs=1e-7), (step, key)


def read_metrics(run_dir: Path) -> list[dict]:
    import json

    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def train_rank(rank: int, port: int, argv: list[str]) -> int:
    """Rank ``rank`` of `klppo train ARGV` on 2 gloo processes, as torchrun starts it under `klppo train`
    (rank environment, data checked and run directory locked by the launcher): a task of the rank pool."""
    from klppo.commands.train import STARTUP_CHECKED_ENV, main
    from klppo.ops.run_lock import HELD_ENV
    from klppo.parallel import dist

    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        **{STARTUP_CHECKED_ENV: "1", HELD_ENV: "1"},
    )
    torch.set_num_threads(1)
    try:
        return main(argv)
    finally:
        dist.destroy()


def train_two_ranks(rank_pool, argv: list[str]) -> int:
    """`klppo train ARGV` with ``trainer.n_gpus_per_node=2`` on the rank pool's two processes (the launcher's
    own part, torchrun and signals, is tested by test_distributed.py and test_signals.py): 0 when both
    ranks returned 0, else the first non-zero exit status."""
    from klppo.parallel.dist import free_port

    assert "trainer.n_gpus_per_node=2" in argv
    codes = rank_pool.run(train_rank, free_port(), argv)
    return next((c for c in codes if c), 0)
