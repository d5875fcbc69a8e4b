"""The FSDP2 launches shared by test_fsdp.py and test_local_shards.py: one spawn of 1 rank, then one of 2
(gloo on CPU), every check of both modules inside them; both modules are in the ``fsdp_runs`` xdist group so
that one worker runs them and the launches happen once."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))
import fsdp_worker as W  # noqa: E402

from klppo.parallel.dist import free_port  # noqa: E402


@pytest.fixture(scope="session")
def fsdp_runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("fsdp")
    mp.start_processes(W.main_one, args=(free_port(), str(out)), nprocs=1, start_method="spawn")
    ckpt_in = str(out / "ckpt_from_1")
    mp.start_processes(W.main_two, args=(free_port(), str(out), ckpt_in), nprocs=2, start_method="spawn")
    return {
        "one": torch.load(out / "one.pt", weights_only=False),
        "two": torch.load(out / "two.pt", weights_only=False),
        "out": out,
    }
