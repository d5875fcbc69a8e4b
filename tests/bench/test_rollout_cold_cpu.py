"""bench/rollout_cold.py on CPU (tiny model, decode compiled): fresh processes get their own empty klppo
cache and compile; a process of the reuse mode loads the graphs from the last fresh one's cache."""

from __future__ import annotations

import json

import pytest

from bench.rollout_cold import main, medians
from tests.bench.gate import device_bench_run


def test_medians_per_mode() -> None:
    runs = [
        dict(mode="a", batch=2, x=1.0),
        dict(mode="a", batch=2, x=5.0),
        dict(mode="a", batch=2, x=2.0),
        dict(mode="b", batch=2, x=7.0),
    ]
    assert medians(runs) == {"a": {"runs": 3, "x": 2.0}, "b": {"runs": 1, "x": 7.0}}


@pytest.mark.slow
@device_bench_run
def test_fresh_then_reused_cache_on_cpu(tmp_path) -> None:
    out = tmp_path / "cold.json"
    main(["--tiny", "--batch", "2", "--modes", "compile,compile-warm-cache", "--out", str(out)])
    result = json.loads(out.read_text())
    fresh, reused = result["runs"]
    assert 0 < fresh["import_torch_s"] <= fresh["import_s"]
    # the fresh process compiles every graph; the reusing one loads each of them and compiles none
    assert fresh["fxgraph_cache_miss"] >= 1 and fresh.get("fxgraph_cache_hit", 0) == 0, fresh
    assert reused["fxgraph_cache_hit"] == fresh["fxgraph_cache_miss"], (fresh, reused)
    assert reused.get("fxgraph_cache_miss", 0) == 0, reused
    assert set(result["median"]) == {"compile", "compile-warm-cache"}
    assert result["median"]["compile"]["to_first_result_s"] == fresh["to_first_result_s"]


def test_the_reuse_mode_gets_the_cache_of_its_own_engine() -> None:
    """``compile-warm-cache`` reuses the cache of the last fresh process with its engine configuration,
    not of one with other compiled functions run after it (``sdpa``)."""
    from bench.rollout_cold import _cache_for

    caches: dict[str, str] = {}
    fresh = _cache_for("compile", caches)
    other = _cache_for("sdpa", caches)
    assert other != fresh and _cache_for("compile-warm-cache", caches) == fresh
    later = _cache_for("precompile", caches)  # fresh, the same engine: the next reuse takes it
    assert later not in (fresh, other) and _cache_for("compile-warm-cache", caches) == later
    alone: dict[str, str] = {}
    assert _cache_for("compile-warm-cache", alone) == _cache_for(
        "compile-warm-cache", alone
    )  # empty, then kept


def test_the_first_call_profile_lists_functions_by_both_times() -> None:
    """``--profile-first``'s summary (in-process: the child process wraps its first call the same way)."""
    from bench.rollout_cold import _start_profile, _top_functions

    def work() -> float:
        return sum(i * i for i in range(20000))

    profiler = _start_profile()
    work()
    top = _top_functions(profiler, 3)
    for key in ("first_call_top_cumulative", "first_call_top_tottime"):
        assert len(top[key]) == 3 and all(r.split("s ", 1)[0].replace(".", "").isdigit() for r in top[key])
    assert any("work" in r or "genexpr" in r for r in top["first_call_top_tottime"])
