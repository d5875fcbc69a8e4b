"""The run's persistent compile cache: TorchInductor's and Triton's on-disk caches under klppo's cache
directory, so a later process (a resumed run, the next job) loads compiled kernels instead of compiling them.

:func:`use_persistent_cache` puts them in ``$KLPPO_CACHE/compile/{inductor,triton}`` (``$KLPPO_CACHE``
defaults to ``$XDG_CACHE_HOME/klppo``, else ``~/.cache/klppo``) instead of torch's default under the
temporary directory, and turns inductor's FX graph cache and the AOTAutograd cache on where the torch version
has them. The user's settings win: a ``TORCHINDUCTOR_CACHE_DIR`` or ``TRITON_CACHE_DIR`` already set is kept
(except a ``TORCHINDUCTOR_CACHE_DIR`` equal to torch's own default, which importing dynamo writes there
itself), as are ``TORCHINDUCTOR_FX_GRAPH_CACHE`` / ``TORCHINDUCTOR_AUTOGRAD_CACHE``;
``KLPPO_COMPILE_CACHE=0`` leaves torch's defaults untouched. Call it before the process's first compilation
(inductor fixes its cache directory on first use).
"""

from __future__ import annotations

import importlib
import os

from klppo.models.gguf import klppo_cache_dir

CACHE_FLAGS = (  # (config module, flag, the environment variable through which the user sets it)
    ("torch._inductor.config", "fx_graph_cache", "TORCHINDUCTOR_FX_GRAPH_CACHE"),
    ("torch._functorch.config", "enable_autograd_cache", "TORCHINDUCTOR_AUTOGRAD_CACHE"),
)


def use_persistent_cache(root: str | os.PathLike | None = None) -> dict[str, str]:
    """Point the inductor and Triton caches at ``root`` (default ``klppo_cache_dir() / "compile"``) where
    the user has not chosen, and turn the FX graph and AOTAutograd caches on (module docstring).

    Returns the cache directories in force, by variable (empty with ``KLPPO_COMPILE_CACHE=0``).
    """
    if os.environ.get("KLPPO_COMPILE_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return {}
    base = os.fspath(root) if root is not None else os.fspath(klppo_cache_dir() / "compile")
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        if os.environ.get(var, "") in ("", _torch_default(var)):
            os.environ[var] = os.path.join(base, sub)
    for module, flag, var in CACHE_FLAGS:
        config = importlib.import_module(module)
        if hasattr(config, flag) and var not in os.environ:
            setattr(config, flag, True)
    return {var: os.environ[var] for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}


def _torch_default(var: str) -> str | None:
    """Torch's own default for ``var``: importing dynamo writes inductor's default cache directory into
    ``TORCHINDUCTOR_CACHE_DIR``, so that value does not mean the user chose it."""
    if var != "TORCHINDUCTOR_CACHE_DIR":
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: PLC0415  private, may move
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())
