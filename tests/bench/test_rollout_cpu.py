"""bench/rollout.py mechanically on CPU: the tiny shape, the engine alone, top-k sampling."""

from __future__ import annotations

import json

from bench.rollout import main


def test_tiny_engine_rows_on_cpu(tmp_path) -> None:
    out = tmp_path / "rollout.json"
    main(["--shapes", "tiny", "--batches", "4", "--hf-batches", "", "--compile-batch", "0", "--device", "cpu",
          "--samplers", "torch", "--top-k", "5", "--prompt", "8", "--new", "12", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())
    assert [r["backend"] for r in rows] == ["klppo-cold", "klppo-warm"]
    for r in rows:
        assert r["tokens"] == 4 * 12 and r["ms_per_step"] > 0 and r["sampling"] == "T=1.0 top_k=5 top_p=1.0"


def test_spread_eos_lengths_and_the_compact_variant_on_cpu(tmp_path) -> None:
    out = tmp_path / "rollout.json"
    main(["--shapes", "tiny", "--batches", "8", "--hf-batches", "", "--compile-batch", "8", "--compile-shape", "tiny", "--no-hf-compile",
          "--variants", "compact", "--device", "cpu", "--eos-every", "7", "--prompt", "8", "--new", "12",
          "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())
    assert [r["backend"] for r in rows] == [
        "klppo-cold",
        "klppo-warm",
        "klppo-compact-cold",
        "klppo-compact-warm",
    ]
    assert all(r["tokens"] < 8 * 12 for r in rows)  # sequences ended at EOS
    assert rows[0]["slot_moves"] == 0  # compaction is off by default
