"""bench/rollout.py mechanically on CPU: the tiny shape, the engine alone, top-k sampling."""

from __future__ import annotations

import json

import pytest

from bench.rollout import main, variant


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
          "--variants", "compact,autotune", "--device", "cpu", "--eos-every", "7", "--prompt", "8", "--new", "12",
          "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())
    assert (
        [r["backend"] for r in rows]
        == [
            "klppo-cold",
            "klppo-warm",
            "klppo-compact-cold",
            "klppo-compact-warm",
            "klppo-autotune-cold",  # its own CompiledFunctions (max-autotune-no-cudagraphs; CPU: decode not compiled)
            "klppo-autotune-warm",
        ]
    )
    assert all(r["tokens"] < 8 * 12 for r in rows)  # sequences ended at EOS
    assert rows[0]["slot_moves"] == 0  # compaction is off by default


def test_one_engine_run_per_decode_attention_on_cpu(tmp_path) -> None:
    out = tmp_path / "rollout.json"
    main(["--shapes", "tiny", "--batches", "4", "--hf-batches", "", "--compile-batch", "0", "--device", "cpu",
          "--decode-attention", "auto,sdpa", "--prompt", "8", "--new", "6", "--out", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())
    names = ["klppo-cold", "klppo-warm", "klppo-attn-sdpa-cold", "klppo-attn-sdpa-warm"]
    assert [r["backend"] for r in rows] == names
    assert all(r["tokens"] == 4 * 6 for r in rows)
    with pytest.raises(ValueError, match="decode_attention=triton .* needs a CUDA"):  # the kernels: CUDA only
        main(["--shapes", "tiny", "--batches", "4", "--hf-batches", "", "--compile-batch", "0", "--device", "cpu",
              "--decode-attention", "triton", "--prompt", "8", "--new", "6"])  # fmt: skip


def test_addmm_residual_variant_replaces_the_back_of_split_and_unsplit_layers() -> None:
    """``--variants addmm-residual`` times the O projection's residual folded into ``addmm`` whichever
    layers the engine decodes on: the split layers' back too (the default with the Triton attention),
    else the variant would time the default engine under another name."""
    import torch

    from bench.rollout import VARIANTS
    from klppo.rollout.compiled import CompiledFunctions
    from klppo.rollout.engine import SPLIT_LAYER_NAMES

    variant = VARIANTS["addmm-residual"]["compiled"]()
    for name in ("attn_out_mlp", SPLIT_LAYER_NAMES[1]):
        assert variant.functions[name] is not CompiledFunctions.functions[name], name
    g = torch.Generator().manual_seed(0)

    class Layer:  # no biases, unfused gate/up
        o, post_norm = torch.randn(8, 8, generator=g), torch.randn(8, generator=g)
        gate, up, down = (torch.randn(*shape, generator=g) for shape in ((16, 8), (16, 8), (8, 16)))
        o_bias = gate_up = gate_bias = up_bias = down_bias = None

    x, attn = torch.randn(3, 8, generator=g), torch.randn(3, 8, generator=g)
    want = CompiledFunctions.functions[SPLIT_LAYER_NAMES[1]](x, attn, Layer, 1e-6)
    for got, expected in zip(variant.functions[SPLIT_LAYER_NAMES[1]](x, attn, Layer, 1e-6), want):
        torch.testing.assert_close(got, expected)


def test_variant_names_and_the_sampler_launch() -> None:
    """``--variants launch:B:W:S`` sets the engine's Triton-sampler launch; a wrong name or a malformed launch
    stops before any model is built, naming the entry."""
    assert variant("launch:1024:8:4") == dict(
        _attributes=dict(sampler_launch=dict(block=1024, num_warps=8, splits=4))
    )
    assert variant("noise-of-floats") == dict(_attributes=dict(sampler_noise_of_bits=False))
    for bad in ("launch:1024:8", "launch:a:8:4", "no-such-variant"):
        with pytest.raises(SystemExit, match=bad):
            variant(bad)
    with pytest.raises(SystemExit, match="no-such"):
        main(["--shapes", "tiny", "--device", "cpu", "--variants", "same,no-such"])
