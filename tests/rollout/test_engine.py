"""The klppo engine against the hf reference and independent references (CPU, fp32)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from klppo.models.tiny import build_tiny_model
from klppo.rollout import SamplingParams, make_rollout
from klppo.rollout.engine import KLPPORollout
from klppo.rollout.settings import EngineSettings
from tests.rollout.compile_utils import recording_functions
from tests.rollout.conftest import left_padded, reference_log_probs

PROMPTS = [[1, 10, 20, 30, 40, 50], [1, 7, 8], [1, 99, 100, 101, 102], [5], [3, 4, 5, 6, 7, 8, 9, 10, 11]]

CPU_AND_CUDA = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]
"""``device`` parameters of a test that runs on the CPU and, marked ``gpu``, on CUDA where there is one."""

ARCHS = [
    ("qwen2", {}),  # tied embeddings, q/k/v bias, GQA
    ("qwen2", {"tie_word_embeddings": False}),
    ("llama", {"tie_word_embeddings": False}),
    ("llama", {"num_kv_heads": 4}),  # plain multi-head
    ("qwen3", {}),  # q/k norm
    ("mistral", {}),
]


@pytest.mark.parametrize("arch,kwargs", ARCHS, ids=[f"{a}-{i}" for i, (a, _) in enumerate(ARCHS)])
def test_greedy_identical_to_hf_with_continuous_batching(arch, kwargs) -> None:
    model = build_tiny_model(arch=arch, **kwargs).eval()
    prompts, prompt_mask = left_padded(PROMPTS)
    params = SamplingParams(max_new_tokens=24, n=2, do_sample=False)
    ref = make_rollout("hf", EngineSettings(eos_token_ids=[2], pad_token_id=2)).generate(
        model, prompts, prompt_mask, params
    )
    # 10 sequences through 3 slots: finished slots must take the waiting sequences
    engine = make_rollout(
        "klppo", EngineSettings(eos_token_ids=[2], pad_token_id=2, max_num_seqs=3, eos_check_every=5)
    )
    out = engine.generate(model, prompts, prompt_mask, params)
    assert out.stats["rollout/num_slots"] == 3
    assert torch.equal(out.responses, ref.responses)
    assert torch.equal(out.response_mask, ref.response_mask)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)


def test_rope_scaling_and_eos_mask_match_hf() -> None:
    model = build_tiny_model(arch="llama").eval()
    model.config.rope_parameters = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    model.model.rotary_emb = LlamaRotaryEmbedding(model.config)
    prompts, prompt_mask = left_padded(PROMPTS)
    greedy = SamplingParams(max_new_tokens=16, do_sample=False)
    hf = make_rollout("hf", EngineSettings(eos_token_ids=[2], pad_token_id=2))
    first = hf.generate(model, prompts, prompt_mask, greedy)
    # two EOS ids that the greedy paths emit, pad different from both: masks must cut after the first
    eos_ids = [int(first.responses[0, 4]), int(first.responses[2, 2])]
    ref = make_rollout("hf", EngineSettings(eos_token_ids=eos_ids, pad_token_id=0)).generate(
        model, prompts, prompt_mask, greedy
    )
    out = make_rollout(
        "klppo", EngineSettings(eos_token_ids=eos_ids, pad_token_id=0, max_num_seqs=2, eos_check_every=3)
    ).generate(model, prompts, prompt_mask, greedy)
    assert ref.response_mask[0].sum() <= 5 and ref.response_mask.sum() < ref.response_mask.numel()
    assert torch.equal(out.responses, ref.responses)
    assert torch.equal(out.response_mask, ref.response_mask)


def test_sampled_log_probs_match_full_forward_and_seed_reproducible(tiny_qwen2) -> None:
    prompts, prompt_mask = left_padded(PROMPTS)
    engine = make_rollout(
        "klppo", EngineSettings(eos_token_ids=[2], pad_token_id=2, max_num_seqs=4, eos_check_every=4)
    )
    params = SamplingParams(max_new_tokens=16, n=3, temperature=0.8, top_k=40, top_p=0.9, seed=11)
    out = engine.generate(tiny_qwen2, prompts, prompt_mask, params)
    ref = reference_log_probs(tiny_qwen2, prompts, prompt_mask, out.responses, out.response_mask, 0.8, 3)
    torch.testing.assert_close(out.log_probs.double(), ref, atol=1e-4, rtol=0)
    again = engine.generate(tiny_qwen2, prompts, prompt_mask, params)
    assert torch.equal(out.responses, again.responses)
    other = engine.generate(tiny_qwen2, prompts, prompt_mask, SamplingParams(max_new_tokens=16, n=3, seed=12))
    assert not torch.equal(out.responses, other.responses)
    assert out.responses.shape == (15, 16)


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    keep = probs > 0
    expected = probs[keep] * counts.sum()
    assert counts[~keep].sum() == 0, "sampled a token outside the truncated support"
    return float(((counts[keep] - expected) ** 2 / expected).sum()), int(keep.sum()) - 1


@pytest.mark.parametrize("name", ["klppo", "hf"])
def test_truncated_log_probs_are_those_of_the_distribution_sampled_from(tiny_qwen2, name) -> None:
    """With top-k (and top-k with top-p) the output carries the log-probs of the truncated, renormalised
    distribution each token was drawn from, beside the full softmax's; untruncated, none."""
    prompts, prompt_mask = left_padded(PROMPTS)
    engine = make_rollout(name, EngineSettings(eos_token_ids=[2], pad_token_id=2, max_num_seqs=4))
    for top_k, top_p in ((5, 1.0), (8, 0.7)):
        params = SamplingParams(max_new_tokens=12, n=2, temperature=0.9, top_k=top_k, top_p=top_p, seed=5)
        out = engine.generate(tiny_qwen2, prompts, prompt_mask, params)
        args = (tiny_qwen2, prompts, prompt_mask, out.responses, out.response_mask, 0.9, 2)
        full = reference_log_probs(*args)
        truncated = reference_log_probs(*args, top_k=top_k, top_p=top_p)
        assert truncated.isfinite().all()  # every token lies in its step's kept set
        torch.testing.assert_close(out.log_probs.double(), full, atol=1e-4, rtol=0)
        torch.testing.assert_close(out.truncated_log_probs.double(), truncated, atol=1e-4, rtol=0)
        mask = out.response_mask.bool()
        assert (out.truncated_log_probs[mask] > out.log_probs[mask] + 1e-3).all()  # log q = log p − log K
        assert (out.truncated_log_probs[~mask] == 0).all()
    untruncated = SamplingParams(max_new_tokens=12, n=2, temperature=0.9, seed=5)
    assert engine.generate(tiny_qwen2, prompts, prompt_mask, untruncated).truncated_log_probs is None
    unread = dataclasses.replace(params, law_log_probs=False)  # nothing reads them: none, the same draw
    plain = engine.generate(tiny_qwen2, prompts, prompt_mask, unread)
    assert plain.truncated_log_probs is None and torch.equal(plain.responses, out.responses)


@pytest.mark.parametrize("top_k,top_p", [(-1, 1.0), (5, 1.0), (-1, 0.6), (6, 0.8)])
def test_sampling_distribution_chi_square(top_k, top_p) -> None:
    """The sampler's first-token law equals the truncated, renormalised softmax (float64 reference)."""
    from klppo.rollout.sampling import sample

    torch.manual_seed(0)
    vocab, draws, temperature = 12, 40000, 0.7
    logits = torch.randn(vocab) * 1.5
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, log_probs, _ = sample(logits.expand(draws, vocab).clone(), params)
    # independent reference (HF order): sort, keep the top k, renormalise, keep the smallest prefix
    # whose renormalised mass reaches top_p
    p = torch.softmax(logits.double() / temperature, dim=0)
    order = torch.argsort(p, descending=True).tolist()
    if top_k > 0:
        order = order[:top_k]
    in_k = sum(float(p[t]) for t in order)
    keep = torch.zeros(vocab, dtype=torch.bool)
    mass = 0.0
    for tok in order:
        if mass >= top_p:
            break
        keep[tok] = True
        mass += float(p[tok]) / in_k
    q = torch.where(keep, p, 0.0)
    q = q / q.sum()
    stat, dof = _chi_square(torch.bincount(tokens, minlength=vocab).double(), q)
    # mean dof, sd sqrt(2 dof): 6 sd above the mean fails (a wrong law gives stat in the hundreds)
    assert stat < dof + 6 * math.sqrt(2 * max(dof, 1)), (stat, dof)
    torch.testing.assert_close(log_probs.double(), torch.log(p)[tokens], atol=1e-5, rtol=0)


def test_fallback_and_cache_lifecycle(tiny_qwen2) -> None:
    prompts, prompt_mask = left_padded(PROMPTS[:2])
    params = SamplingParams(max_new_tokens=6, do_sample=False)
    keep = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2, free_cache_engine=False))
    first = keep.generate(tiny_qwen2, prompts, prompt_mask, params)
    cache = keep._ws.kv
    second = keep.generate(tiny_qwen2, prompts, prompt_mask, params)
    assert keep._ws.kv is cache and torch.equal(first.responses, second.responses)
    keep.release()
    assert keep._ws is None
    free = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2, free_cache_engine=True))
    free.generate(tiny_qwen2, prompts, prompt_mask, params)
    assert free._ws is None
    gpt2_like = build_tiny_model(arch="mistral").eval()
    gpt2_like.config.model_type = "unsupported-arch"
    with pytest.warns(UserWarning, match="unsupported-arch"):
        out = free.generate(gpt2_like, prompts, prompt_mask, params)
    assert out.stats["rollout/fallback_hf"] == 1.0 and out.responses.shape == (2, 6)
    import warnings

    with warnings.catch_warnings():  # said once per engine: a reason naming the step's length repeated
        warnings.simplefilter("error")
        again = free.generate(gpt2_like, prompts, prompt_mask, dataclasses.replace(params, max_new_tokens=5))
    assert again.stats["rollout/fallback_hf"] == 1.0
    with pytest.raises(ValueError, match="unknown rollout"):
        make_rollout("vllm", EngineSettings(eos_token_ids=[2], pad_token_id=2))


def test_fused_projections_match_and_follow_in_place_weight_updates() -> None:
    """Fused [q;k;v]/[gate;up] copies give hf's (unfused) results, and a kept workspace re-reads the
    weights."""
    model = build_tiny_model(arch="qwen2").eval()  # q/k/v biases
    prompts, prompt_mask = left_padded(PROMPTS)
    params = SamplingParams(max_new_tokens=10, do_sample=False)
    plain = make_rollout("hf", EngineSettings(eos_token_ids=[2], pad_token_id=2))
    kept = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2, free_cache_engine=False))
    ref, out = (
        plain.generate(model, prompts, prompt_mask, params),
        kept.generate(model, prompts, prompt_mask, params),
    )
    assert torch.equal(out.responses, ref.responses)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
    assert out.stats["rollout/fused_weights_gb"] > 0
    fused_qkv = kept._ws.weights.layers[0].qkv
    with torch.no_grad():  # an optimizer step: same addresses, new values
        for p in model.parameters():
            p.mul_(1.5)
    ref = plain.generate(model, prompts, prompt_mask, params)
    out = kept.generate(model, prompts, prompt_mask, params)
    assert kept._ws.weights.layers[0].qkv is fused_qkv  # reused buffers, refreshed values
    assert torch.equal(out.responses, ref.responses)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_split_backend_matches_the_torch_reference_on_gpu() -> None:
    """bf16: the split backend (Triton attention and layer kernels, Triton sampler) gives the torch
    reference's (``decode_attention="sdpa"``, ``sampler="torch"``) greedy tokens and log-probs."""
    model = build_tiny_model(arch="qwen2").to("cuda", torch.bfloat16).eval()
    prompts, prompt_mask = (t.cuda() for t in left_padded(PROMPTS))
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    fast, ref = (
        KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2, max_num_seqs=4, **kw)).generate(
            model, prompts, prompt_mask, params
        )
        for kw in ({}, {"decode_attention": "sdpa", "sampler": "torch"})
    )
    assert (fast.responses == ref.responses).float().mean() > 0.9
    same = (fast.responses == ref.responses).all(dim=1)
    torch.testing.assert_close(fast.log_probs[same], ref.log_probs[same], atol=2e-2, rtol=0)


def test_precompile_leaves_nothing_to_compile_and_matches_eager() -> None:
    """A background pre-compile from the config alone makes every graph the torch backend needs: generate on
    an engine handed the same CompiledFunctions then compiles nothing (greedy and tempered sampling, several
    batch buckets) and equals the eager engine."""
    model = build_tiny_model(arch="qwen2").eval()
    fns, graphs = recording_functions()
    settings = EngineSettings(compile_decode=True)
    thread = fns.start_precompile(model.config, settings, dtype=torch.float32, device="cpu")
    assert thread is not None
    fns.wait()
    made = len(graphs)
    # two layer blocks, each for batches from 2 and for a batch of 1
    assert made == 4 and fns.last_precompile_s is not None
    for params, batch in (
        (SamplingParams(max_new_tokens=9, do_sample=False), PROMPTS),
        (SamplingParams(max_new_tokens=9, n=2, temperature=0.7, seed=3), PROMPTS),
        (SamplingParams(max_new_tokens=9, temperature=0.7, seed=3), PROMPTS[:1]),
    ):
        prompts, prompt_mask = left_padded(batch)
        ours = make_rollout(
            "klppo",
            EngineSettings(eos_token_ids=[2], pad_token_id=2, compile_decode=True, max_num_seqs=3),
            compiled=fns,
        )
        eager = KLPPORollout(
            EngineSettings(eos_token_ids=[2], pad_token_id=2, compile_decode=False, max_num_seqs=3)
        )
        a = ours.generate(model, prompts, prompt_mask, params)
        b = eager.generate(model, prompts, prompt_mask, params)
        assert torch.equal(a.responses, b.responses)
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-6, rtol=0)
    assert len(graphs) == made, "the rollout compiled graphs the pre-compile had not made"
    torch._dynamo.reset()


def test_split_backend_equals_the_torch_backend(monkeypatch) -> None:
    """The split backend driven by the engine on the CPU (its attention's and layer kernels' torch
    references): a pre-compile for it compiles nothing, and its tokens and log-probs equal the torch
    backend's (unsplit layers, RoPE outside the attention)."""
    from klppo.rollout import backends, compiled

    model = build_tiny_model(arch="qwen2").eval()
    fns, graphs = recording_functions()
    for module in (backends, compiled):  # what the CPU would never choose
        monkeypatch.setattr(module, "backend_class", lambda *a, tensor_parallel: backends.SplitBackend)
    fns.start_precompile(model.config, EngineSettings(compile_decode=True), dtype=torch.float32, device="cpu")
    fns.wait()
    assert graphs == []
    params = SamplingParams(max_new_tokens=9, n=2, temperature=0.7, seed=3)
    prompts, prompt_mask = left_padded(PROMPTS)
    split = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2, max_num_seqs=3), compiled=fns)
    out = split.generate(model, prompts, prompt_mask, params)
    assert graphs == []
    monkeypatch.undo()
    unsplit = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2, max_num_seqs=3))
    want = unsplit.generate(model, prompts, prompt_mask, params)
    assert torch.equal(out.responses, want.responses)
    torch.testing.assert_close(out.log_probs, want.log_probs, atol=1e-5, rtol=0)
    torch._dynamo.reset()


def test_decode_buckets_from_one() -> None:
    from klppo.rollout.scheduler import buckets as _buckets

    assert _buckets(1) == [1]
    assert _buckets(2) == [1, 2]
    assert _buckets(3) == [1, 2, 3]
    assert _buckets(64) == [1, 2, 4, 8, 16, 32, 64]
    assert _buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def _batch_of_one_then_three(model, fns, graphs: list, device: str = "cpu") -> list[int]:
    """Generate for 1 prompt (n = 1), then 3, with ``fns`` (compile_decode): greedy equals hf (fp32) or
    the eager engine (bf16: most tokens); tempered sampling's log-probs equal a float64 recomputation, and
    on the CPU its tokens the eager engine's (the same sampler). Returns the number of compiled ``graphs``
    after each batch."""
    greedy = SamplingParams(max_new_tokens=9, do_sample=False)
    tempered = SamplingParams(max_new_tokens=9, temperature=0.7, seed=3)
    fp32 = next(model.parameters()).dtype == torch.float32
    counts = []
    for batch in (PROMPTS[:1], PROMPTS[:3]):
        prompts, prompt_mask = (t.to(device) for t in left_padded(batch))
        ours = KLPPORollout(
            EngineSettings(eos_token_ids=[2], pad_token_id=2, compile_decode=True), compiled=fns
        )
        eager = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2, compile_decode=False))
        hf = make_rollout("hf", EngineSettings(eos_token_ids=[2], pad_token_id=2)) if fp32 else eager
        a, b = (e.generate(model, prompts, prompt_mask, greedy) for e in (ours, hf))
        assert a.stats["rollout/cuda_graphs"] == float(device == "cuda")
        agree = (a.responses == b.responses).float().mean()
        assert agree == 1 if fp32 else agree > 0.9  # bf16: compiled kernels round differently from eager
        a = ours.generate(model, prompts, prompt_mask, tempered)
        ref = reference_log_probs(model, prompts, prompt_mask, a.responses, a.response_mask, 0.7, 1)
        delta = (a.log_probs.double().cpu() - ref).abs()
        assert delta.max() < 1e-4 if fp32 else delta.sum() / a.response_mask.sum() < 0.05, delta
        if device == "cpu":
            assert torch.equal(a.responses, eager.generate(model, prompts, prompt_mask, tempered).responses)
        counts.append(len(graphs))
    return counts


def test_batch_of_one_and_larger_batches_compile_once_each() -> None:
    """One prompt, n = 1 (a one-row prefill, decode on bucket 1, no padding row): greedy equals hf,
    tempered sampling equals the eager engine; then 3 prompts (buckets 2 and 3) compile one graph per
    function for both sizes (the batch dim is dynamic from 2, batch 1 specialised: compiled._batch_dynamic),
    and a batch of 2 after them none."""
    model = build_tiny_model(arch="qwen2").eval()
    fns, graphs = recording_functions()
    one, three = _batch_of_one_then_three(model, fns, graphs)
    assert one == 2, graphs  # two layer blocks, made at batch 1
    assert three == 4, "batch 3 (buckets 2 and 3) should add one graph per function, not one per bucket"
    prompts, prompt_mask = left_padded(PROMPTS[:2])
    KLPPORollout(
        EngineSettings(eos_token_ids=[2], pad_token_id=2, compile_decode=True), compiled=fns
    ).generate(model, prompts, prompt_mask, SamplingParams(max_new_tokens=5, temperature=0.7, seed=1))
    assert len(graphs) == three, "a batch of 2 compiled again"
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_of_one_with_inductor_and_cuda_graphs(dtype) -> None:
    """The same with inductor kernels and CUDA graphs (bucket 1 captured): float32 on the torch backend's
    compiled layers; bf16 on the split backend, which compiles nothing (Triton kernels)."""
    from torch._inductor.compile_fx import compile_fx

    from klppo.rollout import triton_attention

    model = build_tiny_model(arch="qwen2").to("cuda", dtype).eval()
    fns, graphs = recording_functions(compile=compile_fx)
    one, three = _batch_of_one_then_three(model, fns, graphs, device="cuda")
    per_batch = 0 if triton_attention.runs(torch.device("cuda"), dtype) else 2  # the two layer blocks
    assert (one, three) == (per_batch, 2 * per_batch), graphs
    torch._dynamo.reset()


def test_samples_of_a_prompt_share_its_prefill(tiny_qwen2) -> None:
    """n samples run their prompt once (K/V copied to the other slots); a sample admitted later copies the
    prefix from a sibling still in a slot; outputs equal hf's and the float64 reference log-probs."""
    prompts, prompt_mask = left_padded(PROMPTS)
    lengths = prompt_mask.sum(1).tolist()
    params = SamplingParams(max_new_tokens=12, n=4, do_sample=False)
    ref = make_rollout("hf", EngineSettings(eos_token_ids=[2], pad_token_id=2)).generate(
        tiny_qwen2, prompts, prompt_mask, params
    )
    roomy = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2))
    out = roomy.generate(tiny_qwen2, prompts, prompt_mask, params)
    assert torch.equal(out.responses, ref.responses)
    assert out.stats["rollout/prefill_tokens"] == sum(lengths)  # once per prompt, not 4×
    tight = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2, max_num_seqs=3, eos_check_every=3))
    out = tight.generate(tiny_qwen2, prompts, prompt_mask, params)
    assert torch.equal(out.responses, ref.responses)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
    assert sum(lengths) <= out.stats["rollout/prefill_tokens"] < 4 * sum(lengths)
    # sampled: siblings finish at different times, so later samples copy the prefix from a busy sibling
    params = SamplingParams(max_new_tokens=12, n=4, temperature=1.3, seed=7)
    many_eos = KLPPORollout(
        EngineSettings(eos_token_ids=list(range(2, 120)), pad_token_id=2, max_num_seqs=3, eos_check_every=1)
    )
    out = many_eos.generate(tiny_qwen2, prompts, prompt_mask, params)
    assert out.stats["rollout/prefix_reused"] > 0
    ref = reference_log_probs(tiny_qwen2, prompts, prompt_mask, out.responses, out.response_mask, 1.3, 4)
    torch.testing.assert_close(out.log_probs.double(), ref, atol=1e-4, rtol=0)


def test_precompile_waits_while_model_loading_switches_the_default_dtype() -> None:
    """The background compile takes the default-dtype lock per function: while model loading holds it
    (transformers switching the default dtype), nothing is compiled; afterwards everything is."""
    import time

    from klppo.models.loading import DEFAULT_DTYPE_LOCK, default_dtype_change

    model = build_tiny_model(arch="llama").eval()
    fns, graphs = recording_functions(record=lambda gm: torch.get_default_dtype())
    with default_dtype_change(torch.bfloat16):  # as load_causal_lm(dtype=bf16) does
        assert DEFAULT_DTYPE_LOCK.locked()
        torch.set_default_dtype(torch.bfloat16)
        try:
            fns.start_precompile(
                model.config, EngineSettings(compile_decode=True), dtype=torch.float32, device="cpu"
            )
            time.sleep(0.5)
            assert graphs == []
        finally:
            torch.set_default_dtype(torch.float32)
    with default_dtype_change(torch.float32):  # no change: no lock
        assert not DEFAULT_DTYPE_LOCK.locked()
    fns.wait()
    assert graphs == [torch.float32] * 4  # two functions, for batches from 2 and for a batch of 1
    torch._dynamo.reset()


def test_compacted_slots_match_hf_and_the_float64_reference(tiny_qwen2) -> None:
    """``compact_slots``: sequences ending at different steps are moved into the smaller buckets; greedy
    stays identical to hf, sampled log-probs equal a float64 recomputation."""
    prompts, prompt_mask = left_padded(PROMPTS)
    eos = list(range(2, 60))  # many ids end a sequence: lengths spread out
    greedy = SamplingParams(max_new_tokens=16, n=2, do_sample=False)
    ref = make_rollout("hf", EngineSettings(eos_token_ids=eos, pad_token_id=2)).generate(
        tiny_qwen2, prompts, prompt_mask, greedy
    )
    engine = KLPPORollout(
        EngineSettings(
            eos_token_ids=eos, pad_token_id=2, eos_check_every=1, compact_slots=True, compact_min_bucket=2
        )
    )
    out = engine.generate(tiny_qwen2, prompts, prompt_mask, greedy)
    assert torch.equal(out.responses, ref.responses) and torch.equal(out.response_mask, ref.response_mask)
    torch.testing.assert_close(out.log_probs, ref.log_probs, atol=1e-5, rtol=0)
    lengths = ref.response_mask.sum(1)
    assert lengths.min() < lengths.max() and out.stats["rollout/slot_moves"] > 0
    sampled = SamplingParams(max_new_tokens=16, n=2, temperature=1.2, seed=5)
    out = engine.generate(tiny_qwen2, prompts, prompt_mask, sampled)
    assert out.stats["rollout/slot_moves"] > 0
    expected = reference_log_probs(tiny_qwen2, prompts, prompt_mask, out.responses, out.response_mask, 1.2, 2)
    torch.testing.assert_close(out.log_probs.double(), expected, atol=1e-4, rtol=0)
    # seeded reproducibility with the moves (what exact resume rests on): again, and from a new engine
    fresh = KLPPORollout(
        EngineSettings(
            eos_token_ids=eos, pad_token_id=2, eos_check_every=1, compact_slots=True, compact_min_bucket=2
        )
    )
    for again in (
        engine.generate(tiny_qwen2, prompts, prompt_mask, sampled),
        fresh.generate(tiny_qwen2, prompts, prompt_mask, sampled),
    ):
        assert torch.equal(again.responses, out.responses) and torch.equal(again.log_probs, out.log_probs)
        assert again.stats["rollout/slot_moves"] == out.stats["rollout/slot_moves"]
    off = KLPPORollout(EngineSettings(eos_token_ids=eos, pad_token_id=2, eos_check_every=1))
    assert off.generate(tiny_qwen2, prompts, prompt_mask, greedy).stats["rollout/slot_moves"] == 0


def test_compiled_functions_pass_their_mode_and_refuse_modes_with_graphs(monkeypatch) -> None:
    """``CompiledFunctions(mode=...)`` compiles with that ``torch.compile`` mode; the modes that capture
    CUDA graphs of their own (inside the engine's graphs) are refused."""
    from klppo.rollout.compiled import CompiledFunctions

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw) or fn)
    CompiledFunctions(backend="eager", mode="max-autotune-no-cudagraphs").get("attn_in")
    CompiledFunctions(backend="eager").get("attn_in")
    assert seen == [
        dict(backend="eager", mode="max-autotune-no-cudagraphs"),
        dict(backend="eager", mode=None),
    ]
    for mode in ("reduce-overhead", "max-autotune"):
        with pytest.raises(ValueError, match="no-cudagraphs"):
            CompiledFunctions(backend="eager", mode=mode)


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_a_kept_workspace_serves_later_calls_with_new_seeds_weights_and_addresses(device) -> None:
    """``free_cache_engine=False``: a later call with another seed, changed weights — updated in place, or
    replaced by new tensors (as FSDP2 re-gathers them each step) — and a shorter prompt batch reuses the
    workspace (cache, graphs, resident weight copies) and gives exactly what a fresh engine gives; a
    prompt batch past its positions gets a new one. On CUDA (fp32, compiled, CUDA graphs): the graphs
    captured under the first seed replay the later seeds' noise and weights."""
    model = build_tiny_model(arch="qwen2").eval().to(device)
    prompts, prompt_mask = (t.to(device) for t in left_padded(PROMPTS))
    kept = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2, free_cache_engine=False))

    def fresh(seed: int, p=prompts, m=prompt_mask):
        params = SamplingParams(max_new_tokens=9, n=2, temperature=0.8, seed=seed)
        return KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2)).generate(model, p, m, params)

    def same(a, b) -> None:
        assert torch.equal(a.responses, b.responses)
        torch.testing.assert_close(a.log_probs, b.log_probs, atol=1e-6, rtol=0)

    params = SamplingParams(max_new_tokens=9, n=2, temperature=0.8, seed=1)
    same(kept.generate(model, prompts, prompt_mask, params), fresh(1))
    ws = kept._ws
    assert ws is not None and ws.weights.layers[0].q.data_ptr() == ws.weights.layers[0].qkv.data_ptr()
    # one copy of every weight, tied embeddings once (q/k/v, gate/up: views of the fused rows)
    one_copy = sum(p.numel() * p.element_size() for p in model.parameters())
    inv_freq = model.model.rotary_emb.inv_freq
    assert ws.fused_bytes() == one_copy + inv_freq.numel() * inv_freq.element_size()
    same(kept.generate(model, prompts, prompt_mask, dataclasses.replace(params, seed=2)), fresh(2))
    assert kept._ws is ws, "another seed allocated a new workspace"
    with torch.no_grad():  # an update in place
        for p in model.parameters():
            p.mul_(1.05)
    same(kept.generate(model, prompts, prompt_mask, dataclasses.replace(params, seed=3)), fresh(3))
    for module in model.modules():  # new tensors at new addresses, as a re-gather gives
        for name, p in list(module.named_parameters(recurse=False)):
            setattr(module, name, torch.nn.Parameter(p.detach().clone() * 0.97, requires_grad=False))
    model.tie_weights()
    same(kept.generate(model, prompts, prompt_mask, dataclasses.replace(params, seed=4)), fresh(4))
    shorter, shorter_mask = (t.to(device) for t in left_padded([p[:3] for p in PROMPTS]))
    out = kept.generate(model, shorter, shorter_mask, dataclasses.replace(params, seed=5))
    same(out, fresh(5, shorter, shorter_mask))
    assert kept._ws is ws
    longer, longer_mask = (
        t.to(device) for t in left_padded([PROMPTS[0] * 12])
    )  # past the 64-rounded positions
    kept.generate(model, longer, longer_mask, dataclasses.replace(params, seed=6))
    assert kept._ws is not ws


@pytest.mark.parametrize("device", CPU_AND_CUDA)
def test_the_eos_check_takes_many_ids_without_a_host_sync(device) -> None:
    """Hundreds of EOS ids (``bench/rollout.py --eos-every``, a tokenizer with many stop ids): the check
    equals ``torch.isin``, and the decode loop never calls ``unique`` — ``torch.isin`` does once the id
    list outgrows the batch (10·B^0.145 ids), a device→host sync that invalidates a CUDA-graph capture.
    On CUDA the same generate, with and without slot compaction, runs with graphs
    and matches eager decoding."""
    from torch.profiler import profile

    from klppo.rollout.steps import ends

    for rows, num_ids in ((1, 1), (16, 3), (256, 600), (7, 600)):
        tokens = torch.randint(0, 2000, (rows,), device=device)
        eos = torch.randperm(2000, device=device)[:num_ids]
        assert torch.equal(ends(tokens, eos), torch.isin(tokens, eos))
    model = build_tiny_model(arch="qwen2").eval().to(device)
    prompts, prompt_mask = (t.to(device) for t in left_padded(PROMPTS))
    # 600 ids, as many as --eos-every 256 gives on a 152k vocabulary: 58 the model emits (lengths spread, as
    # in the compaction test) and 542 past its vocabulary (never sampled, but as many entries for the check)
    vocab = model.config.vocab_size
    eos = list(range(2, 60)) + list(range(vocab, vocab + 542))
    greedy = SamplingParams(max_new_tokens=12, n=2, do_sample=False)
    engine = KLPPORollout(EngineSettings(eos_token_ids=eos, pad_token_id=2, eos_check_every=1))
    with profile() as prof:
        out = engine.generate(model, prompts, prompt_mask, greedy)
    assert not [e.name for e in prof.events() if e.name == "aten::_unique"]
    eager = KLPPORollout(
        EngineSettings(
            eos_token_ids=eos, pad_token_id=2, eos_check_every=1, cuda_graphs=False, compile_decode=False
        )
    ).generate(model, prompts, prompt_mask, greedy)
    assert torch.equal(out.responses, eager.responses) and torch.equal(out.response_mask, eager.response_mask)
    lengths = out.response_mask.sum(1)
    assert 1 < lengths.max() and lengths.min() < greedy.max_new_tokens and lengths.min() < lengths.max()
    # with slot compaction: graphs of the smaller buckets
    compact = KLPPORollout(
        EngineSettings(
            eos_token_ids=eos, pad_token_id=2, eos_check_every=1, compact_slots=True, compact_min_bucket=2
        )
    ).generate(model, prompts, prompt_mask, greedy)
    assert compact.stats["rollout/slot_moves"] > 0
    assert torch.equal(compact.responses, eager.responses)
