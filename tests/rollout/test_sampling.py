"""The samplers' law against a float64 reference computed from the definition of top-k / top-p: χ² tests of
≥ 10⁵ draws (p > 0.01, fixed seeds) and exact log-probs, of the full softmax and of the truncated law sampled
from, for the torch path on CPU and the Triton kernels (on CUDA; and, slow, in Triton's CPU interpreter when
triton is installed)."""

from __future__ import annotations

import copy
import dataclasses
import itertools

import pytest
import torch

from klppo.rollout.base import SamplingParams
from klppo.rollout.sampling import sample
from klppo.rollout.settings import EngineSettings
from tests.rollout.conftest import HAS_TRITON, run_triton_interpreted

# (temperature, top_k, top_p): untruncated, top-k, top-p, both
SETTINGS = [(1.0, -1, 1.0), (0.7, 8, 1.0), (1.3, -1, 0.75), (0.8, 10, 0.9)]


def reference(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the law of the draw [V], the untruncated log-probs [V]) in float64, from the definitions: token i is
    in the top-k set iff fewer than k tokens have larger logits; then in the top-p set iff the renormalised
    mass of the top-k tokens with larger logits is below p."""
    x = logits.double() / temperature
    log_p = torch.log_softmax(x, dim=0)
    larger = x[None, :] > x[:, None]  # larger[i, j]: x_j > x_i
    keep = larger.sum(1) < top_k if top_k > 0 else torch.ones_like(x, dtype=torch.bool)
    q = torch.where(keep, log_p.exp(), 0.0)
    q = q / q.sum()
    if top_p < 1.0:
        keep &= (larger.double() * q[None, :]).sum(1) < top_p
    law = torch.where(keep, log_p.exp(), 0.0)
    return law / law.sum(), log_p


def chi_square_p(tokens: torch.Tensor, law: torch.Tensor) -> float:
    """p-value of the χ² goodness-of-fit of ``tokens`` to ``law`` (no draw may fall outside its support)."""
    counts = torch.bincount(tokens.cpu(), minlength=law.numel()).double()
    support = law > 0
    assert counts[~support].sum() == 0, "a token outside the truncated support was drawn"
    expected = law[support] * counts.sum()
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), stat / 2))


def _logits(vocab: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(vocab, generator=g, dtype=torch.float64).float() * 1.5


def _check(sampler, draws: int, device: str, settings=SETTINGS) -> None:
    logits = _logits()
    for seed, (temperature, top_k, top_p) in enumerate(settings):
        params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
        torch.manual_seed(seed)
        tokens, log_probs, truncated = sampler(logits.to(device).expand(draws, -1).contiguous(), params)
        law, log_p = reference(logits, temperature, top_k, top_p)
        assert chi_square_p(tokens, law) > 0.01, (temperature, top_k, top_p)
        torch.testing.assert_close(log_probs.cpu().double(), log_p[tokens.cpu()], atol=1e-5, rtol=0)
        if top_k < 0 and top_p >= 1.0:
            assert truncated is None
        else:  # the law sampled from: log q = log p − log(kept mass)
            torch.testing.assert_close(truncated.cpu().double(), law.log()[tokens.cpu()], atol=1e-5, rtol=0)


def test_reference_by_hand() -> None:
    """The reference on 4 tokens, worked by hand: p = (0.1, 0.2, 0.3, 0.4) at T = 1."""
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    assert torch.allclose(reference(logits, 1.0, 2, 1.0)[0].float(), torch.tensor([0, 0, 3 / 7, 4 / 7]))
    # top-p 0.5: 0.4 has nothing above (kept), 0.3 has 0.4 < 0.5 above (kept), 0.2 has 0.7 (dropped)
    assert torch.allclose(reference(logits, 1.0, -1, 0.5)[0].float(), torch.tensor([0, 0, 3 / 7, 4 / 7]))
    # top-k 3 renormalises to (2, 3, 4) / 9; top-p 0.4: 3/9 + 4/9 above 0.2 → dropped, 4/9 above 0.3 → kept
    assert torch.allclose(reference(logits, 1.0, 3, 0.5)[0].float(), torch.tensor([0, 0, 3 / 7, 4 / 7]))
    assert torch.allclose(reference(logits, 1.0, 3, 0.4)[0].float(), torch.tensor([0, 0, 0, 1.0]))


def test_torch_sampler_law_and_log_probs() -> None:
    _check(sample, 100_000, "cpu")


def test_torch_sampler_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 0.0, 3.0]])
    tokens, log_probs, truncated = sample(logits, SamplingParams(do_sample=False, top_k=1))
    assert tokens.tolist() == [1, 0] and truncated is None  # ties: the lowest id, as argmax; nothing cut
    torch.testing.assert_close(log_probs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [(1.0, 5, 1.0), (0.7, -1, 0.8), (1.3, 20, 0.6)])
def test_torch_sampler_truncated_log_probs_are_those_of_the_truncated_logits(temperature, top_k, top_p):
    """``log q(token)`` equals ``log_softmax`` of the truncated logits at the token, and is ``log p`` − the
    log of the row's kept mass, for random logits."""
    from klppo.algorithms.sampling import truncate_logits

    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 2
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    tokens, log_p, log_q = sample(logits, params)
    kept = truncate_logits(logits.double() / temperature, top_k, top_p)
    expected = torch.log_softmax(kept, -1).gather(1, tokens[:, None]).squeeze(1)
    assert expected.isfinite().all()  # every draw lies in the kept set
    torch.testing.assert_close(log_q.double(), expected, atol=1e-5, rtol=0)
    kept_mass = torch.softmax(logits.double() / temperature, -1).masked_fill(kept.isinf(), 0).sum(-1)
    assert (kept_mass < 1 - 1e-3).all()  # something is cut on every row
    torch.testing.assert_close((log_p - log_q).double(), kept_mass.log(), atol=1e-5, rtol=0)
    # asked for none, the same draw without them
    torch.manual_seed(0)
    torch.randn(64, 50)
    tokens_2, log_p_2, none = sample(logits, dataclasses.replace(params, law_log_probs=False))
    assert none is None and torch.equal(tokens_2, tokens) and torch.equal(log_p_2, log_p)


def test_chunking_of_the_untruncated_kernel() -> None:
    from klppo.rollout.triton_sampling import chunking

    assert chunking(40, 3, 16) == (16, 3)  # what the kernel tests use
    assert chunking(40, 1, 16) == (48, 1)
    assert chunking(4, 2, 2) == (2, 2)
    assert chunking(151936, 3, 2048) == (51200, 3)  # whole blocks per program; the last chunk shorter
    assert chunking(151936, 64, 2048) == (4096, 38)  # never an empty chunk
    chunk, splits = chunking(151936, 9, 2048)
    assert chunk % 2048 == 0 and (splits - 1) * chunk < 151936 <= splits * chunk


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_triton_sampler_block_is_a_power_of_two() -> None:
    """A block of 6 made the four-per-Philox kernel read quarters of one id: ids 4 and 5 of each block of 6
    skipped, no error (the one-per-call kernel fails to compile)."""
    from klppo.rollout.triton_sampling import sample_triton

    with pytest.raises(ValueError, match="power of two, got 6"):
        sample_triton(torch.zeros(1, 8), SamplingParams(do_sample=False), block=6)


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_triton_sampler_size_limit_is_named() -> None:
    """Past the kernels' int32 offsets the error names the size, not the sampling settings (it said "does not
    take top_k=-1 with top_p=1.0" for a plain untruncated call on 20,000 × 151,936 logits)."""
    from klppo.rollout.triton_sampling import sample_triton

    with pytest.raises(ValueError, match="20000 rows × 151936"):
        sample_triton(torch.zeros(1, 1).expand(20000, 151936), SamplingParams())
    with pytest.raises(ValueError, match="does not take top_k=5 with top_p=0.5"):
        sample_triton(torch.zeros(2, 8), SamplingParams(top_k=5, top_p=0.5))


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_untruncated_launch_spreads_a_row_over_at_least_eight_programs() -> None:
    """Programs per row: four per SM over the batch, at least 8, at most 64, and only as
    many as the row has four blocks of ids for (on CPU the SM count is taken as 4)."""
    from klppo.rollout.triton_sampling import _splits

    assert [_splits(4, b, 151936, 1024) for b in (1, 2, 4, 256)] == [16, 8, 8, 8]
    assert _splits(4, 256, 3 * 4 * 1024, 1024) == 3 and _splits(4, 256, 1000, 1024) == 1
    assert [_splits(132, b, 151936, 1024) for b in (1, 8, 64, 66, 256)] == [37, 37, 9, 8, 8]  # 132 SMs


def test_engine_sampler_option_is_checked(tiny_qwen2) -> None:
    from klppo.rollout.engine import KLPPORollout

    for removed in ("fast", "triton"):
        with pytest.raises(ValueError, match="sampler must be one of"):
            EngineSettings(eos_token_ids=[2], pad_token_id=2, sampler=removed)
    prompts = torch.tensor([[1, 5, 7]])
    for sampler in ("auto", "torch"):  # CPU: the torch path
        engine = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2, sampler=sampler))
        out = engine.generate(
            tiny_qwen2, prompts, torch.ones_like(prompts), SamplingParams(max_new_tokens=2, seed=0)
        )
        assert out.responses.shape == (1, 2)


def test_samples_on_triton_where_the_kernels_take_the_settings(monkeypatch) -> None:
    """``sampler="auto"``: the Triton kernels on CUDA (with triton) for the settings they take, not top-k with
    top-p; ``sampler="torch"`` and the CPU: never."""
    from klppo.rollout import backends

    monkeypatch.setattr(backends, "triton_sampling_available", lambda device: True)
    auto, torch_only = EngineSettings(), EngineSettings(sampler="torch")
    assert backends.samples_on_triton(auto, True, SamplingParams(top_p=0.5))
    assert not backends.samples_on_triton(auto, True, SamplingParams(top_k=5, top_p=0.5))
    assert not backends.samples_on_triton(auto, False, SamplingParams())
    assert not backends.samples_on_triton(torch_only, True, SamplingParams())


def _race_noise(device: str) -> torch.Tensor:
    """[3, 20] the Gumbel noise the untruncated kernel gives each (row, id), read off one program's race value
    with ``x = 0`` at a single id of each chunk (``-inf`` elsewhere): blocks of 8 (four quarters of two ids),
    chunks of 8 over 3 splits (the last one ending mid-block), the same seed in every launch."""
    from klppo.rollout.triton_sampling import _race_chunk_kernel, chunking

    rows, vocab, block = 3, 20, 8
    chunk, splits = chunking(vocab, 3, block)
    seed = torch.tensor([12345], dtype=torch.int64, device=device)
    noise = torch.full((rows, vocab), float("nan"))
    ids = torch.arange(vocab)
    for position in range(chunk):
        logits = torch.where(ids % chunk == position, 0.0, float("-inf")).expand(rows, -1).contiguous()
        part = torch.empty(rows, splits, 4, device=device)
        _race_chunk_kernel[(rows, splits)](
            logits.to(device),
            vocab,
            vocab,
            chunk,
            1.0,
            seed,
            part,
            splits,
            GREEDY=False,
            BLOCK=block,
            SCALE=False,
        )
        part = part.cpu()
        for row, split in itertools.product(range(rows), range(splits)):
            if split * chunk + position < vocab:
                assert part[row, split, 2] == split * chunk + position
                noise[row, split * chunk + position] = part[row, split, 1]
    return noise


def _triton_checks(draws: int, device: str) -> None:
    from klppo.rollout.triton_sampling import sample_triton

    settings = [s for s in SETTINGS if not (s[1] > 0 and s[2] < 1.0)]  # both at once: the torch path
    _check(sample_triton, draws, device, settings)
    # the chunked untruncated kernel, one and several programs per row, a temperature and none; the
    # interpreter (time): one program per row with a temperature, three without
    combos = [
        (splits, t)
        for splits, t in itertools.product((1, 3), (0.9, 1.0))
        if device == "cuda" or (splits == 1) == (t < 1.0)
    ]
    for seed, (splits, t) in enumerate(combos):
        params = SamplingParams(max_new_tokens=1, temperature=t)
        x = _logits().to(device).expand(draws // 4, -1).contiguous()
        generator = torch.Generator(device).manual_seed(100 + seed)  # each combo its own fixed draws
        tokens, log_probs, truncated = sample_triton(x, params, splits=splits, block=16, generator=generator)
        assert truncated is None
        # Bonferroni: 1% for the family together (tests at 1% each fail together by chance more often)
        law, log_p = reference(_logits(), t, -1, 1.0)
        p = chi_square_p(tokens, law)
        assert p > 0.01 / len(combos), (splits, t, p)
        # the temperature is seen in the log-probs (χ² at the interpreter's 75 draws passed without it, p =
        # 0.35)
        torch.testing.assert_close(log_probs.cpu().double(), log_p[tokens.cpu()], atol=1e-5, rtol=0)
    # ties: 2.0 at ids 1 and 5 (two chunks of 4); 3.0 at ids 0 and 3 (one chunk, two quarters) and 4 (the
    # next)
    logits = torch.tensor(
        [[0.5, 2.0, -1.0, -1.0, -1.0, 2.0, 0.0, 0.0], [3.0, 1.0, 0.0, 3.0, 3.0, 0.0, 0.0, 0.0]], device=device
    )
    tokens, log_probs, _ = sample_triton(logits, SamplingParams(do_sample=False), splits=2, block=4)
    assert tokens.tolist() == [1, 0]  # the lowest id
    torch.testing.assert_close(log_probs.cpu(), torch.log_softmax(logits.cpu(), -1)[[0, 1], [1, 0]])
    _no_winner_checks(sample_triton, device, launch=True)
    # no uniform serves two (row, id): a reuse keeps each row's law (χ² blind to it across rows) and needs
    # many draws to show within one
    noise = _race_noise(device)
    assert noise.isfinite().all() and noise.unique().numel() == noise.numel()
    _noise_of_bits_check(device)


def _noise_of_bits_check(device: str) -> None:
    """``_gumbel_of_bits`` against ``−ln(−ln(1 − w))``, ``w = (k + ½)·2⁻³²``, in float64: at both ends of
    the 32 bits, around its series' threshold (2²⁸) and at random bits; finite everywhere. The GPU's fast
    ``log2`` (absolute error 2⁻²² near 1) is allowed more than the interpreter's."""
    edges = [0, 1, 2, 3, 1000, 2**28 - 2, 2**28 - 1, 2**28, 2**28 + 1, 2**31, 2**32 - 2, 2**32 - 1]
    g = torch.Generator().manual_seed(0)
    k = torch.cat([torch.tensor(edges), torch.randint(0, 2**32, (1024 - len(edges),), generator=g)])
    out = torch.empty(1024, device=device)
    _noise_kernel[(1,)]((k - (k >= 2**31).long() * 2**32).int().to(device), out, N=1024)
    w = (k.double() + 0.5) / 2**32
    torch.testing.assert_close(
        out.cpu().double(), -torch.log(-torch.log1p(-w)), rtol=0, atol=1e-5 if device == "cuda" else 2e-6
    )


if HAS_TRITON:
    import triton
    import triton.language as tl

    from klppo.rollout.triton_sampling import _gumbel_of_bits

    @triton.jit
    def _noise_kernel(k_ptr, g_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(g_ptr + i, _gumbel_of_bits(tl.load(k_ptr + i).to(tl.uint32, bitcast=True)))


def _no_winner_checks(sampler, device: str, launch: bool = False) -> None:
    """A row of -inf or NaN logits (a model gone non-finite) draws id 0 — in range, what torch's argmax
    gives — with a NaN log-prob (the trainer's non-finite checks see it), beside a normal row, for every
    sampling law; an out-of-range id would fail the next step's embedding lookup on the device."""
    logits = torch.tensor(
        [[float("-inf")] * 8, [float("nan")] * 8, [0.0, 0.0, 5.0, 0.0, 0.0, 0.0, 0.0, 0.0]], device=device
    )
    for params in (
        SamplingParams(),
        SamplingParams(do_sample=False),
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.5),
    ):
        kwargs = {} if not launch else dict(splits=2, block=4)
        if launch and not (params.top_k < 0 and params.top_p >= 1.0):
            kwargs = dict(block=4)  # the truncated kernel: no splits, one kernel
        torch.manual_seed(0)
        tokens, log_probs, truncated = sampler(logits, params, **kwargs)
        assert tokens[:2].tolist() == [0, 0], (params, tokens.tolist())
        assert log_probs[:2].isnan().all() and log_probs[2].isfinite(), (params, log_probs.tolist())
        if truncated is not None:
            assert truncated[:2].isnan().all() and truncated[2].isfinite(), (params, truncated.tolist())


def test_torch_sampler_draws_id_zero_from_a_row_without_a_winner() -> None:
    _no_winner_checks(sample, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_triton_sampler_law_and_log_probs_on_gpu() -> None:
    _triton_checks(200_000, "cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_triton_sampler_matches_torch_at_full_vocabulary_on_gpu() -> None:
    """Qwen-sized rows (V = 151936, batch 64): log-probs equal the torch path's formula; top-k draws lie in
    the top k; greedy equals argmax; the same seed gives the same draws."""
    from klppo.rollout.triton_sampling import sample_triton

    torch.manual_seed(0)
    logits = torch.randn(64, 151936, device="cuda") * 3
    for params in (
        SamplingParams(temperature=0.8),
        SamplingParams(top_k=20),
        SamplingParams(top_p=0.5),
        SamplingParams(do_sample=False),
    ):
        torch.manual_seed(1)
        tokens, log_probs, _ = sample_triton(logits, params)
        torch.manual_seed(1)
        again, _, _ = sample_triton(logits, params)
        assert torch.equal(tokens, again)
        t = 1.0 if params.greedy else params.temperature
        ref = torch.log_softmax(logits.double() / t, -1).gather(1, tokens[:, None]).squeeze(1)
        torch.testing.assert_close(log_probs.double(), ref, atol=1e-5, rtol=0)
        if params.greedy:
            assert torch.equal(tokens, logits.argmax(-1))
        if params.top_k > 0:
            assert (logits.gather(1, tokens[:, None]) >= logits.topk(20, -1).values[:, -1:]).all()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_triton_truncated_log_probs_match_the_torch_reference_on_gpu() -> None:
    """The Triton sampler's ``log q`` of its tokens equals the float64 torch reference's for the same logits
    and tokens (Qwen-sized rows, float32 and bf16 logits, with a temperature); a top-k of the whole
    vocabulary cuts nothing (``log q = log p``); untruncated gives None."""
    from klppo.algorithms.sampling import truncate_logits, truncated_log_probs
    from klppo.rollout.triton_sampling import sample_triton

    torch.manual_seed(0)
    logits = torch.randn(64, 151936, device="cuda") * 3
    for dtype, params in (  # bf16: ties at the k-th value, kept by both; top-p on float32 (ties split there)
        (torch.float32, SamplingParams(top_k=20)),
        (torch.bfloat16, SamplingParams(top_k=1000, temperature=0.7)),
        (torch.float32, SamplingParams(top_p=0.5)),
        (torch.float32, SamplingParams(top_p=0.9, temperature=1.3)),
    ):
        x = logits.to(dtype)
        tokens, log_p, log_q = sample_triton(x, params)
        x64 = x.double() / params.temperature
        ref = truncated_log_probs(x64, truncate_logits(x64, params.top_k, params.top_p), tokens)
        torch.testing.assert_close(log_q.double(), ref, atol=1e-5, rtol=0)
        assert (log_q > log_p).all()  # something is cut on every row: the kept mass is below 1
    tokens, log_p, log_q = sample_triton(logits, SamplingParams(top_k=151936))
    assert torch.equal(log_q, log_p)
    assert sample_triton(logits, SamplingParams())[2] is None
    for params in (
        SamplingParams(top_p=0.9, law_log_probs=False),
        SamplingParams(top_k=151936, law_log_probs=False),
    ):
        assert sample_triton(logits, params)[2] is None  # not asked for: no kept-mass pass


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_engine_with_triton_sampler_on_gpu(tiny_qwen2) -> None:
    """The engine with the Triton sampler (the default on CUDA; CUDA graphs): log-probs equal a recomputed
    forward, a seed reproduces the draws."""
    from klppo.rollout.engine import KLPPORollout

    model = copy.deepcopy(tiny_qwen2).to("cuda")
    prompts = torch.randint(3, 100, (4, 6), device="cuda")
    mask = torch.ones_like(prompts)
    engine = KLPPORollout(EngineSettings(eos_token_ids=[2], pad_token_id=2))
    for params in (
        SamplingParams(max_new_tokens=12, n=2, seed=3),
        SamplingParams(max_new_tokens=12, top_p=0.7, temperature=0.9, seed=3),
    ):
        out = engine.generate(model, prompts, mask, params)
        again = engine.generate(model, prompts, mask, params)
        assert torch.equal(out.responses, again.responses)
        ids = torch.cat([prompts.repeat_interleave(params.n, 0), out.responses], 1)
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, prompts.shape[1] - 1 : -1].float() / params.temperature
        ref = (
            torch.log_softmax(logits, -1).gather(-1, out.responses[..., None]).squeeze(-1) * out.response_mask
        )
        torch.testing.assert_close(out.log_probs, ref, atol=1e-4, rtol=0)


CHILD = """
from tests.rollout.test_sampling import _triton_checks
_triton_checks(300, "cpu")
print("OK")
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package (its CPU interpreter)")
def test_triton_kernels_in_the_interpreter() -> None:
    """The kernels' logic on CPU through ``TRITON_INTERPRET=1`` (fewer draws: the interpreter is slow)."""
    run_triton_interpreted(CHILD)


def test_vocab_parallel_truncated_draw_returns_the_law_only_when_asked(tmp_path) -> None:
    """The tensor-parallel sampler's truncated draw (one gloo process) gives the same tokens and log-probs
    with and without ``law_log_probs``, and the law's log-probs only with it."""
    import torch.distributed as dist

    from klppo.parallel.mesh import TensorParallel
    from klppo.rollout.sampling import vocab_parallel_sampler

    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        tp = TensorParallel(dist.group.WORLD, 1, 0, (0,))
        logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)) * 2
        params = SamplingParams(temperature=0.9, top_k=5)
        draws = []
        for law in (True, False):
            torch.manual_seed(1)
            draws.append(
                vocab_parallel_sampler(dataclasses.replace(params, law_log_probs=law), tp, 50)(logits)
            )
        (tokens, log_p, log_q), (tokens_2, log_p_2, none) = draws
        assert none is None and torch.equal(tokens_2, tokens) and torch.equal(log_p_2, log_p)
        assert (log_q > log_p).all()  # top-5 of 50: the kept mass is below 1
    finally:
        dist.destroy_process_group()
