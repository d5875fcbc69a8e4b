"""2 gloo processes (one launch, tests/tune/tune_worker.py): the memory model's params/grads/optimizer
terms vs the real sharded storage (within 15%), the communication model vs counted collective bytes
(exact: every dimension of the tiny model divides by 2, so no padding), and the profiled step's
collective time (mechanics: gloo on CPU overlaps nothing, so exposed == total)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import tune_worker as W  # noqa: E402

from klppo.parallel.dist import free_port  # noqa: E402

# slow: multi-process or long (minutes on 2 busy cores), `-m 'not slow'` skips it; its launch (a module
# fixture) happens once, in the session's rank pool (tests/rank_pool.py) of the xdist worker running the group
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("rank_pool")]


@pytest.fixture(scope="module")
def result(tmp_path_factory, rank_pool) -> dict:
    out = tmp_path_factory.mktemp("tune")
    rank_pool.run(W.run, free_port(), str(out))
    return json.loads((out / "result.json").read_text())


@pytest.mark.parametrize("term", ["params", "grads", "optimizer"])
def test_sharded_state_terms_match_storage(result, term):
    measured, model = result["storage"]["measured"][term], result["storage"]["model"][term]
    assert measured > 0
    assert abs(model - measured) / measured <= 0.15, (term, model, measured)


@pytest.mark.parametrize("label", ["per_layer", "no_reshard", "whole"])
def test_comm_bytes_match_counted(result, label):
    counted, model = result["comm"][label]["counted"], result["comm"][label]["model"]
    assert counted["ag"] > 0 and counted["rs"] > 0
    assert model["ag"] == pytest.approx(counted["ag"], rel=1e-6)
    assert model["rs"] == pytest.approx(counted["rs"], rel=1e-6)


def test_profiled_collectives(result):
    prof = result["profile"]
    assert 0 < prof["comm_s"] <= prof["step_s"] * 2
    assert 0 <= prof["exposed_s"] <= prof["comm_s"] + 1e-9
