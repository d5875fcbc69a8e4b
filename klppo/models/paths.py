"""Where a model lives: local directory, `.gguf` file, or a hub id resolved from the local HF cache.

klppo never downloads: training machines are often offline, and a run that silently fetches 15 GB is
worse than one that stops with a clear message. A string that looks like a hub id
(``Qwen/Qwen2.5-7B-Instruct``) is looked up in the local Hugging Face cache (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``), whose layout is::

    models--Qwen--Qwen2.5-7B-Instruct/
        refs/main                 # text file: the commit hash the branch points to
        snapshots/<commit>/       # config.json, *.safetensors, tokenizer files (symlinks into blobs/)

Every user error is a `ModelLoadError` (a `ValueError`) whose message says what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

GGUF_MAGIC = b"GGUF"
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*(/[A-Za-z0-9][A-Za-z0-9_.\-]*)?$")


class ModelLoadError(ValueError):
    """A model path that cannot be used, with a message that says why and what to pass instead."""


def hf_hub_cache_dir() -> Path:
    """The Hugging Face hub cache directory, read from the environment at call time."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "huggingface" / "hub"


def looks_like_hub_id(path: str) -> bool:
    """True for ``org/name`` or ``name`` strings that are not local paths (no leading ``/ . ~``)."""
    return bool(_HUB_ID.match(path)) and not path.endswith((".gguf", ".json"))


def is_gguf_file(path: str | Path) -> bool:
    """True when ``path`` is a file starting with the GGUF magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _hub_snapshot(repo_id: str, cache_dir: Path) -> Path | None:
    """The cached snapshot directory of ``repo_id`` (refs/main first, else the newest snapshot)."""
    repo_dir = cache_dir / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / "main"
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip()
        if candidate.is_dir():
            return candidate
    found = sorted((p for p in snapshots.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def _check_model_dir(path: Path, shown: str) -> None:
    """Raise `ModelLoadError` unless ``path`` holds a Hugging Face model (a config.json)."""
    if (path / "config.json").is_file():
        return
    hint = ""
    ggufs = sorted(p.name for p in path.glob("*.gguf"))
    if ggufs:
        hint = f" It holds GGUF file(s) {ggufs}: pass the file itself, e.g. {str(path / ggufs[0])!r}."
    elif sorted(path.glob("global_step_*")):
        hint = (
            " It looks like a klppo run directory: export a checkpoint first with "
            "`klppo export <run_dir>/global_step_N <out_dir>` and pass <out_dir>."
        )
    raise ModelLoadError(
        f"{shown!r} is a directory but not a Hugging Face model directory (no config.json).{hint}"
    )


def resolve_model_path(path: str) -> str:
    """Turn a user-given model path into a local directory or `.gguf` file path.

    Contract:
    - ``~`` is expanded; an existing directory must contain ``config.json``; an existing file must be a
      GGUF file (checked by its magic bytes), else `ModelLoadError`.
    - A string that does not exist locally and looks like a hub id is resolved to its snapshot directory
      in the local Hugging Face cache; when it is not cached, `ModelLoadError` says the machine is
      offline (klppo never downloads) and to pass a local directory.
    - Returns an absolute path (str). A `.gguf` is returned as is: `load_causal_lm` converts it.
    """
    if not isinstance(path, str) or not path.strip():
        raise ModelLoadError(f"model path must be a non-empty string, got {path!r}")
    local = Path(path).expanduser()
    if local.is_dir():
        _check_model_dir(local, path)
        return str(local.resolve())
    if local.is_file():
        if not is_gguf_file(local):
            raise ModelLoadError(
                f"{path!r} is a file but not a GGUF model file. Pass a Hugging Face model directory "
                "(with config.json) or a .gguf file."
            )
        return str(local.resolve())
    if looks_like_hub_id(path):
        cache = hf_hub_cache_dir()
        snapshot = _hub_snapshot(path, cache)
        if snapshot is not None:
            _check_model_dir(snapshot, f"{path} (cached at {snapshot})")
            return str(snapshot)
        raise ModelLoadError(
            f"{path!r} looks like a Hugging Face hub id, but it is not in the local cache ({cache}) and "
            "klppo does not download models (this machine may be offline). Download it elsewhere "
            f"(e.g. `huggingface-cli download {path} --local-dir DIR`) and pass the local directory."
        )
    raise ModelLoadError(f"model path {path!r} does not exist.")
