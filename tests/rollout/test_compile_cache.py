"""The rollout's persistent compile cache: which directories it picks, that the user's settings win, and
(slow) that a second process loads the first one's compiled graph from it."""

from __future__ import annotations

import os

import pytest
import torch._functorch.config as functorch_config
import torch._inductor.config as inductor_config

from klppo.models.compile_cache import use_persistent_cache
from klppo.rollout.compiled import CompiledFunctions

VARS = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TRITON_CACHE_DIR",
    "KLPPO_CACHE",
    "XDG_CACHE_HOME",
    "KLPPO_COMPILE_CACHE",
    "TORCHINDUCTOR_FX_GRAPH_CACHE",
    "TORCHINDUCTOR_AUTOGRAD_CACHE",
)


@pytest.fixture
def clean_env(monkeypatch):
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    # the config modules' own patch() restores what the test sets
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield monkeypatch


def test_default_dirs_follow_klppo_cache_then_xdg_then_home(clean_env, tmp_path) -> None:
    clean_env.setenv("HOME", str(tmp_path / "home"))
    assert use_persistent_cache() == {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "home/.cache/klppo/compile/inductor"),
        "TRITON_CACHE_DIR": str(tmp_path / "home/.cache/klppo/compile/triton"),
    }
    assert inductor_config.fx_graph_cache and functorch_config.enable_autograd_cache
    for var in VARS[:2]:
        clean_env.delenv(var)
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert use_persistent_cache()["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "xdg/klppo/compile/inductor")
    for var in VARS[:2]:
        clean_env.delenv(var)
    clean_env.setenv("KLPPO_CACHE", str(tmp_path / "mine"))
    assert use_persistent_cache()["TRITON_CACHE_DIR"] == str(tmp_path / "mine/compile/triton")
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine/compile/triton")  # what triton reads


def test_user_settings_win(clean_env, tmp_path) -> None:
    clean_env.setenv("KLPPO_CACHE", str(tmp_path / "klppo"))
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "user-inductor"))
    clean_env.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    dirs = use_persistent_cache()
    assert dirs["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "user-inductor")
    assert dirs["TRITON_CACHE_DIR"] == str(tmp_path / "klppo/compile/triton")  # the one not set is ours
    assert not inductor_config.fx_graph_cache  # the user's TORCHINDUCTOR_FX_GRAPH_CACHE=0 is left alone
    assert functorch_config.enable_autograd_cache
    clean_env.delenv("TORCHINDUCTOR_CACHE_DIR")
    clean_env.delenv("TRITON_CACHE_DIR")
    clean_env.setenv("KLPPO_COMPILE_CACHE", "0")
    assert use_persistent_cache() == {}
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ and "TRITON_CACHE_DIR" not in os.environ


def test_torch_default_written_by_dynamo_is_not_a_user_setting(clean_env, tmp_path) -> None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    clean_env.setenv("KLPPO_CACHE", str(tmp_path))
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.abspath(default_cache_dir()))
    assert use_persistent_cache()["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile/inductor")


def test_compiled_functions_set_the_cache_for_inductor_only(clean_env, tmp_path) -> None:
    clean_env.setenv("KLPPO_CACHE", str(tmp_path))
    CompiledFunctions(backend=lambda gm, inputs: gm.forward)
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # a test backend: nothing touched
    CompiledFunctions()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "compile/inductor")


# A second process loading the graphs a first one compiled into the klppo cache: the bench's CPU test
# (tests/bench/test_rollout_cold_cpu.py) runs exactly that, fresh then reused, and checks the FX-cache hits.
