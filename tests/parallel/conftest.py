"""The FSDP2 launches shared by test_fsdp.py, test_local_shards.py and test_plain.py: one spawn of 1 rank,
then one of 2 (gloo on CPU, in the session's rank pool: tests/rank_pool.py), every check of these modules
inside them; the modules are in the ``rank_pool`` xdist group so that one worker runs them and the launches
happen once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_worker as W  # noqa: E402

from klppo.parallel.dist import free_port  # noqa: E402


@pytest.fixture(scope="session")
def fsdp_runs(tmp_path_factory, rank_pool) -> dict:
    out = tmp_path_factory.mktemp("fsdp")
    rank_pool.run(W.main_one, free_port(), str(out), nprocs=1)
    ckpt_in = str(out / "ckpt_from_1")
    rank_pool.run(W.main_two, free_port(), str(out), ckpt_in)
    return {
        "one": torch.load(out / "one.pt", weights_only=False),
        "two": torch.load(out / "two.pt", weights_only=False),
        "out": out,
    }
