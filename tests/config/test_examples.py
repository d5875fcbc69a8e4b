"""The recipes in examples/ load and pass the start-up checks (their figures are in bench/RESULTS.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from klppo.config import load_config
from klppo.config.unimplemented import check_trainable

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_loads(path):
    cfg = load_config([str(path)])
    check_trainable(cfg)
    # every recipe regularises toward the reference: a KL loss or the KL in the reward
    assert cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def test_examples_exist():
    assert len(EXAMPLES) >= 5
