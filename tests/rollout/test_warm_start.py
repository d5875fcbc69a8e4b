"""The start-up warm-up of the Triton kernels: one compiled variant per kernel and combine width, whatever the
batch size, and the background pre-compile (``CompiledFunctions.start_precompile``) leaving the first rollout
nothing to compile."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from klppo.models.llama_weights import meta_layer
from klppo.models.tiny import build_tiny_model
from klppo.rollout import compiled as compiled_module
from klppo.rollout import triton_attention, triton_sampling
from klppo.rollout.base import SamplingParams
from tests.rollout.conftest import HAS_TRITON


def test_warm_kernels_runs_every_attention_variant_and_each_sampling_setting(monkeypatch) -> None:
    """The warm-up runs the split attention with one split and with one split count per combine width (its
    compiled variants) on the engine's layouts — a cache written at the given positions on the CPU reference
    path — and the sampler once per setting and warm split count with its own generator, on float32 logits
    with ``fp32_logits``."""
    config = build_tiny_model(arch="qwen2").config
    attention, samples = [], []
    real = compiled_module.split_attention

    def recording_attention(qkv, cache, positions, splits, rope, dims):
        attention.append((splits, positions.dtype, qkv.shape, cache.shape, dims))
        return real(qkv, cache, positions, splits, rope, dims)

    def recording_sampler(logits, params, *, splits=None, generator=None):
        samples.append((logits.dtype, logits.shape, params, generator, splits))

    monkeypatch.setattr(compiled_module, "split_attention", recording_attention)
    monkeypatch.setattr(compiled_module, "sample_triton", recording_sampler)
    sampled, greedy = SamplingParams(temperature=0.7), SamplingParams(do_sample=False)
    plan = compiled_module._Plan(split=True, compiles=True, fp32_logits=True, sampling=(sampled, greedy))
    compiled_module._warm_kernels(config, torch.float32, torch.device("cpu"), plan)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = config.hidden_size // heads
    assert [a[0] for a in attention] == [1, 2, 4, 8, 16, 32]  # one split, and each combine width
    assert all(a[1] == torch.long and a[4] == (heads, kv_heads, dim) for a in attention)
    assert attention[0][2] == (4, (heads + 2 * kv_heads) * dim) and attention[0][3][1:] == (
        4,
        128,
        kv_heads,
        dim,
    )
    widths = triton_sampling.warm_splits(4, config.vocab_size, sampled)  # the same for greedy (untruncated)
    assert [(s[2], s[4]) for s in samples] == [(p, w) for p in (sampled, greedy) for w in widths]
    assert all(s[0] == torch.float32 and s[1] == (4, config.vocab_size) for s in samples)
    assert samples[0][3] is not None and samples[0][3] is samples[1][3]  # a private generator
    attention.clear()
    samples.clear()
    plan = compiled_module._Plan(split=False, compiles=True, fp32_logits=False, sampling=())
    compiled_module._warm_kernels(config, torch.float32, torch.device("cpu"), plan)
    assert attention == [] and samples == []  # unsplit layers, no Triton sampling: nothing to warm


class _Launches:
    """A stand-in for a Triton kernel (``kernel[grid](*args, **constexprs)``) that records its launches."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.log.append((self.name, grid, args, kwargs))


@pytest.mark.skipif(not HAS_TRITON, reason="sample_triton's kernels are defined with triton only")
def test_warm_kernels_leave_the_default_generator_untouched(monkeypatch) -> None:
    """Through the real :func:`sample_triton` (its kernels recorded, not run), the warm-up draws its seeds
    from its own generator: the default generator's state is the same after it — where a plain call of the
    sampler moves it — and each sampled setting gets a seed tensor."""
    launches: list = []
    for name in ("_race_chunk_kernel", "_race_combine_kernel", "_truncated_kernel"):
        monkeypatch.setattr(triton_sampling, name, _Launches(launches, name))
    config = build_tiny_model(arch="qwen2").config
    sampled, truncated = SamplingParams(temperature=0.7), SamplingParams(top_p=0.9)
    plan = compiled_module._Plan(split=False, compiles=True, fp32_logits=True, sampling=(sampled, truncated))
    logits = torch.zeros(2, config.vocab_size)
    before = torch.get_rng_state()
    triton_sampling.sample_triton(logits, sampled)
    assert not torch.equal(torch.get_rng_state(), before)  # the plain call draws its seed here
    launches.clear()
    before = torch.get_rng_state()
    compiled_module._warm_kernels(
        config, torch.float32, torch.device("cpu"), plan
    )  # unsplit: the sampler alone
    assert torch.equal(torch.get_rng_state(), before)
    names = [name for name, *_ in launches]
    assert "_race_chunk_kernel" in names and "_truncated_kernel" in names


def test_failed_warm_up_keeps_the_precompile(monkeypatch, caplog) -> None:
    """A kernel warm-up that fails is logged as such: the compiled functions it follows stay pre-compiled
    (``last_precompile_s`` set), not reported as a skipped pre-compile."""

    def failing(*args):
        raise RuntimeError("out of resources")

    monkeypatch.setattr(compiled_module, "_run_once", lambda *args: None)
    monkeypatch.setattr(compiled_module, "_warm_kernels", failing)
    fns = compiled_module.CompiledFunctions(backend="eager")
    layer = meta_layer(build_tiny_model(arch="qwen2").config, torch.float32)
    with caplog.at_level("WARNING", logger=compiled_module.__name__):
        plan = compiled_module._Plan(split=False, compiles=True, fp32_logits=True, sampling=())
        fns._precompile(None, layer, torch.device("cpu"), plan)
    assert fns.last_precompile_s is not None
    assert "kernel warm-up skipped (RuntimeError: out of resources)" in caplog.text
    assert "pre-compile skipped" not in caplog.text


@pytest.mark.parametrize("sms", [4, 108, 132])
@pytest.mark.parametrize("vocab", [1000, 32000, 49152, 151936])
def test_sampler_warm_splits_cover_every_batch(sms, vocab) -> None:
    """For every batch size, the combine width of the sampler's default launch is one the warm-up launches
    (one launch per width); top-k sampling (the truncated kernel) is launched once."""

    def lanes(splits):
        block = triton_sampling.launch_block(vocab, True)
        return triton_sampling.combine_lanes(triton_sampling.chunking(vocab, splits, block)[1])

    for params in (SamplingParams(temperature=0.7), SamplingParams(do_sample=False)):
        warm = triton_sampling.warm_splits(sms, vocab, params)
        warm_lanes = [lanes(w) for w in warm]
        assert len(set(warm_lanes)) == len(warm_lanes)
        block = triton_sampling.launch_block(vocab, True)
        for batch in range(1, 3000):
            assert lanes(triton_sampling._splits(sms, batch, vocab, block)) in warm_lanes, batch
    assert triton_sampling.warm_splits(sms, vocab, SamplingParams(top_k=5)) == (None,)


def test_attention_warm_splits_cover_every_batch() -> None:
    """Every default launch of the split attention (batch, KV heads, cache length, SM count) has one split or
    a combine width the warm-up launches."""
    warm = {1 << (s - 1).bit_length() for s in triton_attention.warm_splits()}
    for batch, kv_heads, max_len, sms in itertools.product(
        range(1, 700), (1, 2, 8), (64, 512, 8192), (108, 132)
    ):
        splits = triton_attention.num_splits(batch, kv_heads, max_len, sms)
        assert 1 << (splits - 1).bit_length() in warm, (batch, kv_heads, max_len, sms)


VARIANTS_CHILD = """
import collections, os, pathlib, torch, triton
from klppo.rollout import triton_attention as ta, triton_sampling as ts
from klppo.rollout.base import SamplingParams

def compiled():
    return collections.Counter(p.stem for p in pathlib.Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin"))

dev, dt = "cuda", torch.bfloat16
heads, kv_heads, dim, max_len, vocab = 14, 2, 64, 512, 151936
sampled = SamplingParams(temperature=0.7)
attention_widths, sampler_widths = set(), set()
for batch in (1, 2, 3, 8, 17, 64, 100, 256):
    splits = ta.device_splits(torch.device(dev), batch, kv_heads, max_len)
    attention_widths |= {triton.next_power_of_2(splits)} if splits > 1 else set()
    block = ts.launch_block(vocab, True)
    s = ts.chunking(vocab, ts._splits(ts.device_sms(torch.device(dev)), batch, vocab, block), block)[1]
    sampler_widths.add(ts.combine_lanes(s))
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, device=dev, dtype=dt)
    cache = torch.zeros(2, batch, max_len, kv_heads, dim, device=dev, dtype=dt)
    pos = torch.randint(0, max_len, (batch,), device=dev)
    rope = tuple(torch.randn(batch, dim, device=dev, dtype=dt) for _ in range(2))
    from klppo.rollout.llama import split_attention
    split_attention(qkv, cache, pos, splits, rope, (heads, kv_heads, dim))
    ts.sample_triton(torch.randn(batch, vocab, device=dev), sampled)
torch.cuda.synchronize()
print("COUNTS", dict(compiled()))
want = {"_partial_kernel": 2, "_combine_kernel": len(attention_widths), "_race_chunk_kernel": 1,
        "_race_combine_kernel": len(sampler_widths)}
assert len(attention_widths) > 1 and len(sampler_widths) > 1 and compiled() == want, (compiled(), want)
print("OK")
"""

ENGINE_CHILD = """
import collections, os, pathlib, torch
from klppo.models.tiny import build_tiny_model
from klppo.rollout.base import SamplingParams
from klppo.rollout.compiled import CompiledFunctions
from klppo.rollout.engine import KLPPORollout
from klppo.rollout.settings import EngineSettings
from tests.rollout.conftest import left_padded

def compiled():
    return collections.Counter(p.stem for p in pathlib.Path(os.environ["TRITON_CACHE_DIR"]).rglob("*.cubin"))

model = build_tiny_model(arch="qwen2").to("cuda", torch.bfloat16).eval()
sampled = SamplingParams(max_new_tokens=140, temperature=0.7, seed=1, ignore_eos=True)
greedy = SamplingParams(max_new_tokens=140, do_sample=False, ignore_eos=True)
fns = CompiledFunctions()
fns.start_precompile(model.config, EngineSettings(), dtype=torch.bfloat16, device="cuda",
                     sampling=(sampled, greedy))
fns.wait()
warmed = compiled()
engine = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2), compiled=fns)
for batch in (1, 3, 17, 64):
    prompts, mask = left_padded([[1, 5 + i, 6, 7] for i in range(batch)])
    for params in (sampled, greedy):
        out = engine.generate(model, prompts.cuda(), mask.cuda(), params)
        assert out.stats["rollout/cuda_graphs"] == 1.0
print("WARMED", dict(warmed))
assert warmed["_partial_kernel"] == 2 and warmed["_combine_kernel"] == 5, warmed
assert warmed["_race_chunk_kernel"] == 2, warmed
assert compiled() == warmed, (compiled() - warmed)
print("OK")
"""


def _run_fresh(source: str, tmp_path) -> str:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), KLPPO_CACHE=str(tmp_path / "klppo"))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", source], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (
        proc.stdout[-2000:] + proc.stderr[-3000:]
    )
    return proc.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_attention_and_sampler_compile_one_variant_for_every_batch(tmp_path) -> None:
    """Eight batch sizes (split counts 1 to 8 for the attention, 8 to 37 programs a row for the sampler) on a
    fresh Triton cache: two attention variants (one split, several) and one sampler chunk kernel whatever the
    split count; one combine per combine width met."""
    _run_fresh(VARIANTS_CHILD, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_precompile_leaves_the_rollout_no_triton_kernel_to_compile(tmp_path) -> None:
    """After the background pre-compile (Triton layers, attention, sampled and greedy sampling) on a fresh
    cache, rollouts of four batch sizes with CUDA graphs compile no further kernel."""
    _run_fresh(ENGINE_CHILD, tmp_path)
