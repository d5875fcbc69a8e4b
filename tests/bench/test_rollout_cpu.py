"""bench/rollout.py mechanically on CPU: the tiny shape, the engine alone, top-k sampling."""

from __future__ import annotations

import json

import pytest

from bench.rollout import main, variant


def test_tiny_engine_rows_on_cpu(tmp_path) -> None:
    out = tmp_path / "rollout.json"
    main(
        [
            "--shapes",
            "tiny",
            "--batches",
            "4",
            "--hf-batches",
            "",
            "--compile-batch",
            "0",
            "--device",
            "cpu",
            "--samplers",
            "auto",
            "--top-k",
            "5",
            "--prompt",
            "8",
            "--new",
            "12",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())
    assert [r["backend"] for r in rows] == ["klppo-cold", "klppo-warm"]
    for r in rows:
        assert r["tokens"] == 4 * 12 and r["ms_per_step"] > 0 and r["sampling"] == "T=1.0 top_k=5 top_p=1.0"


def test_spread_eos_lengths_and_the_compact_variant_on_cpu(tmp_path) -> None:
    out = tmp_path / "rollout.json"
    main(
        [
            "--shapes",
            "tiny",
            "--batches",
            "8",
            "--hf-batches",
            "",
            "--compile-batch",
            "8",
            "--compile-shape",
            "tiny",
            "--no-hf-compile",
            "--variants",
            "compact,autotune",
            "--device",
            "cpu",
            "--eos-every",
            "7",
            "--prompt",
            "8",
            "--new",
            "12",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())
    assert [r["backend"] for r in rows] == [
        "klppo-cold",
        "klppo-warm",
        "klppo-compact-cold",
        "klppo-compact-warm",
        # its own CompiledFunctions (max-autotune-no-cudagraphs; CPU: decode not compiled)
        "klppo-autotune-cold",
        "klppo-autotune-warm",
    ]
    assert all(r["tokens"] < 8 * 12 for r in rows)  # sequences ended at EOS
    assert rows[0]["slot_moves"] == 0  # compaction is off by default


def test_one_engine_run_per_decode_attention_on_cpu(tmp_path) -> None:
    out = tmp_path / "rollout.json"
    main(
        [
            "--shapes",
            "tiny",
            "--batches",
            "4",
            "--hf-batches",
            "",
            "--compile-batch",
            "0",
            "--device",
            "cpu",
            "--decode-attention",
            "auto,sdpa",
            "--prompt",
            "8",
            "--new",
            "6",
            "--out",
            str(out),
        ]
    )
    rows = json.loads(out.read_text())
    names = ["klppo-cold", "klppo-warm", "klppo-attn-sdpa-cold", "klppo-attn-sdpa-warm"]
    assert [r["backend"] for r in rows] == names
    assert all(r["tokens"] == 4 * 6 for r in rows)
    with pytest.raises(ValueError, match="decode_attention must be one of"):  # a setting the engine lacks
        main(
            [
                "--shapes",
                "tiny",
                "--batches",
                "4",
                "--hf-batches",
                "",
                "--compile-batch",
                "0",
                "--device",
                "cpu",
                "--decode-attention",
                "triton",
                "--prompt",
                "8",
                "--new",
                "6",
            ]
        )


def test_variant_names() -> None:
    """``--variants`` takes the names of ``VARIANTS``; a wrong one stops before any model is built."""
    assert variant("sdpa") == dict(decode_attention="sdpa")
    for bad in ("launch:1024:8:4", "no-such-variant"):
        with pytest.raises(SystemExit, match=bad):
            variant(bad)
    with pytest.raises(SystemExit, match="no-such"):
        main(["--shapes", "tiny", "--device", "cpu", "--variants", "same,no-such"])
