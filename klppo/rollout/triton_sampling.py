"""Token sampling in one pass over the logits as Triton kernels (CUDA): temperature, top-k or top-p and the
sampled token's log-prob, drawn without a sort of the vocabulary or a host synchronisation (capturable in a
CUDA graph).

The law is that of :mod:`klppo.algorithms.sampling` (the pure-torch path: the reference, and the path on
CPU): ``x = logits / T`` in float32, ``log_prob = x[token] − logsumexp(x)`` (the full softmax's).

- Untruncated (no top-k, top-p = 1; greedy too): one read of the logits. Each row's vocabulary is cut into
  chunks spread over several programs (enough to fill the GPU at small batches); a program keeps per lane
  a running max and sum of ``exp`` (the log-normaliser, online) and the Gumbel race: the largest
  ``x + G`` (``G = −log(−log U)``; greedy: ``x``), with its id and ``x``. A small second kernel combines
  the chunks: the log-sum of their normalisers, and the best race value's token (the lowest id on ties, as
  ``argmax``) — a categorical draw from ``softmax(x)``.
- Top-k alone or top-p alone: the kept set is an upper set of the values: token ``i`` is kept iff fewer
  than ``k`` tokens have a larger ``x`` (top-k: ``x_i`` ≥ the k-th largest, ties kept, as
  ``truncate_logits``), or iff the probability mass of the tokens with a larger ``x`` is below ``p``
  (top-p: the sorted prefix whose mass reaches ``p``). One program per row samples it exactly by rejection,
  without sorting. A first pass gives ``logsumexp(x)`` and a candidate ``s`` (the Gumbel race among all
  tokens); each later pass counts the tokens above ``x_s`` and their mass (is ``s`` in the set?) and runs
  the race among those tokens with fresh noise: the next candidate, taken if ``s`` is rejected. Every
  round's candidates contain the kept set (a rejected ``s`` and everything at or below it are outside it),
  so the accepted draw follows the renormalised truncated softmax; the largest token is always kept, so the
  loop ends. Passes: 1 + the rounds, about 1 / (kept mass) at first and fewer as the candidates rise
  (small ``k`` on a flat distribution is the slow case: about log2(V / k) rounds).
- Top-k and top-p together need the top-k set's mass (a selection): :func:`supports` says no, and the
  engine uses the torch path.
- The log-prob under the truncated law, ``x[token] − logsumexp(x over the kept set)``
  (:mod:`klppo.algorithms.sampling`), needs the kept set's mass, which the rounds do not give (the
  accepted round counts the tokens above the drawn one, not the kept ones below it): torch computes it
  after the kernel from the same logits where asked (``SamplingParams.law_log_probs``): a ``topk`` (top-k) or
  the torch path's sort and cumulative sum (top-p) of [B, V], costlier than the kernel (docs/performance.md).

Randomness: one int64 seed per call from the device's default generator (seeded runs reproduce; a CUDA
graph replays fresh noise). Untruncated: four words per Philox call, one per (row, id)
(``_race_chunk_kernel``); truncated: ``tl.randint(seed + round, row·V + id)``; a word becomes Gumbel noise
by ``_gumbel_of_bits``.
Float32 sums in another order than torch's: a top-p boundary token whose mass above lies within rounding
of ``p`` may be kept by one path and not the other (then its truncated log-prob is that of torch's set).
"""

from __future__ import annotations

import os

import torch

from klppo.algorithms.sampling import truncate_logits, truncated_log_probs
from klppo.rollout.base import SamplingParams
from klppo.rollout.sampling import Draw, returns_law_log_probs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch path only
    triton = None

MAX_SPLITS = 64  # programs per row of the untruncated kernel, at most (the default launch)


def available(device: torch.device) -> bool:
    """Whether the Triton sampler can run on ``device`` (CUDA with triton importable)."""
    return triton is not None and torch.device(device).type == "cuda"


def supports(params: SamplingParams, batch: int, vocab: int) -> bool:
    """Whether :func:`sample_triton` handles ``params`` at this size (module docstring)."""
    both = params.top_k > 0 and params.top_p < 1.0 and not params.greedy
    return not both and batch * vocab < 2**31 and vocab < 2**24


def sample_triton(
    logits: torch.Tensor,
    params: SamplingParams,
    *,
    splits: int | None = None,
    block: int | None = None,
    num_warps: int = 8,
    generator: torch.Generator | None = None,
) -> Draw:
    """Tokens, log-probs and truncated log-probs (:func:`klppo.rollout.sampling.sample`'s) drawn from
    ``logits`` [B, V] (module docstring).

    ``splits``: programs per row of the untruncated kernel (default :func:`_splits`); ``block``: ids a
    program reads at once (a power of two; default :func:`launch_block`); ``num_warps``: the launch's;
    ``generator``: draws the seed (None: the device's default; the warm-up passes its own)."""
    batch, vocab = logits.shape
    if not supports(params, batch, vocab):
        if batch * vocab >= 2**31 or vocab >= 2**24:
            raise ValueError(
                "the Triton sampler takes fewer than 2**31 logits a call and a vocabulary below 2**24 "
                f"(int32 offsets, float32 ids), got {batch} rows × {vocab}"
            )
        raise ValueError(f"the Triton sampler does not take top_k={params.top_k} with top_p={params.top_p}")
    # the four-per-Philox kernel covers 4·(block // 4) ids a block: a block of 6 would skip ids
    if block is not None and (block < 1 or block & (block - 1)):
        raise ValueError(f"the Triton sampler's block must be a power of two, got {block}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    device = logits.device
    greedy = params.greedy
    temperature = 1.0 if greedy else float(params.temperature)
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    if not greedy:
        seed = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64, device=device, generator=generator)
    tokens = torch.empty(batch, dtype=torch.int64, device=device)
    log_probs = torch.empty(batch, dtype=torch.float32, device=device)
    top_k, top_p = truncation(params, vocab)
    untruncated = top_k == 0 and top_p >= 1.0
    block = launch_block(vocab, untruncated, block)
    if untruncated:
        chunk, splits = chunking(vocab, splits or _splits(device_sms(device), batch, vocab, block), block)
        part = torch.empty(batch, splits, 4, dtype=torch.float32, device=device)
        _race_chunk_kernel[(batch, splits)](
            logits,
            logits.stride(0),
            vocab,
            chunk,
            temperature,
            seed,
            part,
            splits,
            GREEDY=greedy,
            BLOCK=block,
            SCALE=temperature != 1.0,
            num_warps=num_warps,
        )
        _race_combine_kernel[(batch,)](part, splits, tokens, log_probs, SP=combine_lanes(splits))
        return tokens, log_probs, log_probs if returns_law_log_probs(params) else None  # top-k ≥ V: q = p
    _truncated_kernel[(batch,)](
        logits,
        logits.stride(0),
        vocab,
        temperature,
        seed,
        top_k,
        top_p,
        tokens,
        log_probs,
        USE_K=top_k > 0,
        USE_P=top_p < 1.0,
        BLOCK=block,
        SCALE=temperature != 1.0,
        num_warps=num_warps,
    )
    if not params.law_log_probs:
        return tokens, log_probs, None
    x = logits.float() / temperature  # the kept set's mass: torch, from the same logits (module docstring)
    return tokens, log_probs, truncated_log_probs(x, truncate_logits(x, top_k, top_p), tokens)


def chunking(vocab: int, splits: int, block: int) -> tuple[int, int]:
    """(ids per program, programs per row) of the untruncated kernel: whole blocks, no empty chunk."""
    per_split = -(-vocab // splits)
    chunk = -(-per_split // block) * block
    return chunk, -(-vocab // chunk)


def _next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` without triton (the launch arithmetic is also computed on CPU installs)."""
    return 1 << (n - 1).bit_length()


def combine_lanes(splits: int) -> int:
    """The combine kernel's lanes (a constexpr: one compiled variant per width, :func:`warm_splits`)."""
    return _next_power_of_2(splits)


def truncation(params: SamplingParams, vocab: int) -> tuple[int, float]:
    """(top-k, top-p) in force for ``params`` over ``vocab`` ids: (0, 1.0) when sampling is untruncated."""
    if params.greedy:
        return 0, 1.0
    return (params.top_k if 0 < params.top_k < vocab else 0), (params.top_p if params.top_p < 1.0 else 1.0)


def launch_block(vocab: int, untruncated: bool, block: int | None = None) -> int:
    """Ids a program reads at once: ``block`` (None: 1024 untruncated, 2048 truncated), at least 4 and at
    most the vocabulary's next power of two (:func:`sample_triton`'s ``block``)."""
    return max(4, min(block or (1024 if untruncated else 2048), _next_power_of_2(vocab)))


def warm_splits(sms: int, vocab: int, params: SamplingParams) -> tuple[int | None, ...]:
    """``splits`` values launching every compiled variant the default launch of ``params`` can need on
    ``sms`` SMs at some batch size: one per combine width (untruncated), ``(None,)`` (truncated)."""
    if truncation(params, vocab) != (0, 1.0):
        return (None,)
    block = launch_block(vocab, True)
    by_width: dict[int, int] = {}
    for batch in range(1, 4 * sms + 1):  # from 4·SMs rows on the default is 8 splits (or the vocab's cap)
        wanted = _splits(sms, batch, vocab, block)
        by_width.setdefault(combine_lanes(chunking(vocab, wanted, block)[1]), wanted)
    return tuple(sorted(by_width.values()))


def device_sms(device: torch.device) -> int:
    """The SM count of ``device`` (4 off CUDA: the interpreter's stand-in)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _splits(sms: int, batch: int, vocab: int, block: int) -> int:
    """Programs per row: about four per SM over the batch and at least 8, each with at least four blocks of
    work, at most 64."""
    return max(1, min(max(-(-4 * sms // batch), 8), vocab // (4 * block), MAX_SPLITS))


if triton is not None:
    from triton.language.extra import libdevice

    NEG_INF = tl.constexpr(float("-inf"))
    LN2 = tl.constexpr(0.6931471805599453)
    # Triton's CPU interpreter has no libdevice fast-math: there the noise's two logarithms are tl.log2
    INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

    @triton.jit
    def _log2(x):
        """``log2 x``: one special-function instruction on the GPU (``lg2.approx``: absolute error ≤ 2⁻²² on
        [0.5, 2], 2 ulp elsewhere; subnormal inputs flush to zero)."""
        if INTERPRETED:
            return tl.log2(x)
        else:
            return libdevice.fast_log2f(x)

    @triton.jit
    def _gumbel_of_bits(k):
        """Gumbel noise ``−ln E`` of 32 random bits ``k`` (uint32): ``E = −ln(1 − w)`` is exponential, ``w =
        (k + ½)·2⁻³²`` uniform, all in float32 to its rounding: below ``w = 2⁻⁴`` (the small ``E``, the race's
        winners) from ``w`` by its series (truncation < 10⁻⁸ of ``E``), above from ``1 − w = (~k + ½)·2⁻³²``
        (no cancellation; ``log2``'s absolute error < 3·10⁻⁶ of ``E`` ≥ 0.0645). Never infinite or NaN: ``E``
        lies
        in [2⁻³³, 22.9). Two fast ``log2`` and six FMAs."""
        w = (k.to(tl.float32) + 0.5) * 2.3283064365386963e-10
        small = w * (
            1.0 + w * (0.5 + w * (0.3333333333333333 + w * (0.25 + w * (0.2 + w * 0.16666666666666666))))
        )
        one_minus = ((~k).to(tl.float32) + 0.5) * 2.3283064365386963e-10
        e = tl.where(k < 268435456, small, _log2(one_minus) * -LN2)  # k < 2**28: w < 2**-4
        return _log2(e) * -LN2

    @triton.jit
    def _scaled(x, temperature, SCALE: tl.constexpr):
        """``x / temperature`` in float32 (``SCALE`` False: temperature 1, the division skipped: exact)."""
        x = x.to(tl.float32)
        if SCALE:
            x = x / temperature
        return x

    @triton.jit
    def _online(m, s, x):
        """Per-lane running max ``m`` and sum of ``exp(x - m)`` ``s``, updated with ``x`` (−inf adds 0)."""
        m_new = tl.maximum(m, x)
        ref = tl.where(m_new > NEG_INF, m_new, 0.0)
        return m_new, s * tl.exp(m - ref) + tl.exp(x - ref)

    @triton.jit
    def _lse_of_lanes(m, s):
        """``log Σ s · exp(m)`` over the lanes (−inf when every lane is empty)."""
        top = tl.max(m, axis=0)
        ref = tl.where(top > NEG_INF, top, 0.0)
        return ref + tl.log(tl.sum(s * tl.exp(m - ref), axis=0))

    @triton.jit
    def _gumbel(seed, offsets):
        """Gumbel noise at Philox counters ``offsets`` (one call each)."""
        return _gumbel_of_bits(tl.randint(seed, offsets))

    @triton.jit
    def _race_start(N: tl.constexpr, V):
        """Empty per-lane state of ``N`` lanes: running max and sum of ``exp`` (``_online``) and the race's
        best value, its id (``V``: none yet) and its ``x``."""
        m = tl.full([N], NEG_INF, tl.float32)
        return m, tl.zeros([N], tl.float32), m, tl.full([N], V, tl.int32), m

    @triton.jit
    def _race_update(best_r, best_i, best_x, r, idx, x):
        """Per lane, keep the larger race value (the first one on ties: the lower id), its id and ``x``."""
        win = r > best_r
        return tl.where(win, r, best_r), tl.where(win, idx, best_i), tl.where(win, x, best_x)

    @triton.jit
    def _race_winner(best_r, best_i, best_x, sentinel):
        """The lanes' best race value, its (lowest) id and its ``x``."""
        top = tl.max(best_r, axis=0)
        idx = tl.min(tl.where(best_r == top, best_i, sentinel), axis=0)
        return top, idx, tl.max(tl.where(best_i == idx, best_x, NEG_INF), axis=0)

    @triton.jit
    def _store_partial(out, m, s, best_r, best_i, best_x, V):
        """A chunk's result at ``out[0:4]``: its log-normaliser, best race value, that id and its ``x``."""
        top, idx, x_win = _race_winner(best_r, best_i, best_x, V)
        tl.store(out, _lse_of_lanes(m, s))
        tl.store(out + 1, top)
        tl.store(out + 2, idx.to(tl.float32))  # ids < 2**24: exact in float32
        tl.store(out + 3, x_win)

    @triton.jit
    def _race_quarter(x, idx, ok, g, best_r, best_i, best_x, GREEDY: tl.constexpr):
        """The Gumbel race over one quarter's ids ``idx`` (``x`` already scaled), ``g`` their noise."""
        r = x
        if not GREEDY:
            r = tl.where(ok, x + g, NEG_INF)
        return _race_update(best_r, best_i, best_x, r, idx, x)

    @triton.jit
    def _gumbel4(seed, offsets):
        """Four Gumbel noises per Philox call at counters ``offsets``, of its four words."""
        k0, k1, k2, k3 = tl.randint4x(seed, offsets)
        return _gumbel_of_bits(k0), _gumbel_of_bits(k1), _gumbel_of_bits(k2), _gumbel_of_bits(k3)

    @triton.jit
    def _online4(m, s, x0, x1, x2, x3):
        """``_online`` for four values a lane: one rescale of the running sum instead of four."""
        m_new = tl.maximum(tl.maximum(m, tl.maximum(x0, x1)), tl.maximum(x2, x3))
        ref = tl.where(m_new > NEG_INF, m_new, 0.0)
        total = (tl.exp(x0 - ref) + tl.exp(x1 - ref)) + (tl.exp(x2 - ref) + tl.exp(x3 - ref))
        return m_new, s * tl.exp(m - ref) + total

    @triton.jit(do_not_specialize=["S"])  # the split count: one variant for every batch
    def _race_chunk_kernel(
        logits_ptr,
        stride,
        V,
        chunk,
        temperature,
        seed_ptr,
        part_ptr,
        S,
        GREEDY: tl.constexpr,
        BLOCK: tl.constexpr,
        SCALE: tl.constexpr,
    ):
        """Program (row, split): normaliser and race winner of ``chunk`` ids → part[row, split, 0:4], with
        four noises per Philox call (``_gumbel4``): each block of ``BLOCK`` ids is four quarters of ``Q =
        BLOCK /
        4`` consecutive ids, lane ``i`` of quarter ``q`` taking word ``q`` of the call at counter
        ``row · G + off / 4 + i`` (``G``: the counters of a row, distinct over rows and blocks), and the
        running sum of ``exp`` rescaled once per four ids (``_online4``). A lane meets its ids in increasing
        order, so
        ties go to the lowest id."""
        Q: tl.constexpr = BLOCK // 4
        row = tl.program_id(0)
        split = tl.program_id(1)
        base = logits_ptr + row.to(tl.int64) * stride
        seed = tl.load(seed_ptr)
        start = split * chunk
        end = tl.minimum(start + chunk, V)
        counters = row * (tl.cdiv(V, BLOCK) * Q)
        i = tl.arange(0, Q)
        m, s, best_r, best_i, best_x = _race_start(Q, V)
        for off in range(start, end, BLOCK):
            if GREEDY:
                g0 = tl.zeros([Q], tl.float32)  # unused: the race is on x
                g1 = g0
                g2 = g0
                g3 = g0
            else:
                g0, g1, g2, g3 = _gumbel4(seed, counters + off // 4 + i)
            i0, i1, i2, i3 = off + i, off + Q + i, off + 2 * Q + i, off + 3 * Q + i
            ok0, ok1, ok2, ok3 = i0 < end, i1 < end, i2 < end, i3 < end
            x0 = _scaled(tl.load(base + i0, mask=ok0, other=NEG_INF), temperature, SCALE)
            x1 = _scaled(tl.load(base + i1, mask=ok1, other=NEG_INF), temperature, SCALE)
            x2 = _scaled(tl.load(base + i2, mask=ok2, other=NEG_INF), temperature, SCALE)
            x3 = _scaled(tl.load(base + i3, mask=ok3, other=NEG_INF), temperature, SCALE)
            m, s = _online4(m, s, x0, x1, x2, x3)
            best_r, best_i, best_x = _race_quarter(x0, i0, ok0, g0, best_r, best_i, best_x, GREEDY)
            best_r, best_i, best_x = _race_quarter(x1, i1, ok1, g1, best_r, best_i, best_x, GREEDY)
            best_r, best_i, best_x = _race_quarter(x2, i2, ok2, g2, best_r, best_i, best_x, GREEDY)
            best_r, best_i, best_x = _race_quarter(x3, i3, ok3, g3, best_r, best_i, best_x, GREEDY)
        _store_partial(part_ptr + (row * S + split) * 4, m, s, best_r, best_i, best_x, V)

    @triton.jit(do_not_specialize=["S"])
    def _race_combine_kernel(part_ptr, S, tokens_ptr, logp_ptr, SP: tl.constexpr):
        """Program row: combine the row's ``S`` chunks into its token and log-prob."""
        row = tl.program_id(0)
        j = tl.arange(0, SP)
        ok = j < S
        p = part_ptr + (row * S + j) * 4
        lse = _lse_of_lanes(tl.load(p, mask=ok, other=NEG_INF), tl.where(ok, 1.0, 0.0))
        r = tl.load(p + 1, mask=ok, other=NEG_INF)
        ids = tl.load(p + 2, mask=ok, other=2.0**30)
        x = tl.load(p + 3, mask=ok, other=NEG_INF)
        top, idx, x_win = _race_winner(r, ids, x, 2.0**30)
        idx = tl.where(top > NEG_INF, idx, 0.0)  # no winner (a row of -inf or NaN): id 0, as torch's argmax
        tl.store(tokens_ptr + row, idx.to(tl.int64))
        tl.store(logp_ptr + row, x_win - lse)  # NaN for such a row

    @triton.jit
    def _row_first(base, V, temperature, seed, row, BLOCK: tl.constexpr, SCALE: tl.constexpr):
        """One pass over the row: its log-normaliser, and the Gumbel race among all ids (round 0)."""
        m, s, best_r, best_i, best_x = _race_start(BLOCK, V)
        for off in range(0, V, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            x = _scaled(tl.load(base + idx, mask=idx < V, other=NEG_INF), temperature, SCALE)
            m, s = _online(m, s, x)
            best_r, best_i, best_x = _race_update(
                best_r, best_i, best_x, x + _gumbel(seed, row * V + idx), idx, x
            )
        _, idx, x_win = _race_winner(best_r, best_i, best_x, V)
        return _lse_of_lanes(m, s), idx, x_win

    @triton.jit
    def _row_check_and_race(
        base, V, temperature, x_s, lse, seed, row, BLOCK: tl.constexpr, SCALE: tl.constexpr
    ):
        """One pass over the row: how many ids have ``x > x_s`` and their probability mass (the check of
        the candidate ``x_s``), and the Gumbel race among those ids (the next candidate, used if this one
        is rejected; ``seed``: this round's noise)."""
        count = tl.zeros([BLOCK], tl.int32)
        _, mass, best_r, best_i, best_x = _race_start(BLOCK, V)
        for off in range(0, V, BLOCK):
            idx = off + tl.arange(0, BLOCK)
            x = _scaled(tl.load(base + idx, mask=idx < V, other=NEG_INF), temperature, SCALE)
            above = x > x_s
            count += above.to(tl.int32)
            mass += tl.where(above, tl.exp(x - lse), 0.0)
            r = tl.where(above, x + _gumbel(seed, row * V + idx), NEG_INF)
            best_r, best_i, best_x = _race_update(best_r, best_i, best_x, r, idx, x)
        _, idx, x_win = _race_winner(best_r, best_i, best_x, V)
        return tl.sum(count, axis=0), tl.sum(mass, axis=0), idx, x_win

    @triton.jit
    def _truncated_kernel(
        logits_ptr,
        stride,
        V,
        temperature,
        seed_ptr,
        top_k,
        top_p,
        tokens_ptr,
        logp_ptr,
        USE_K: tl.constexpr,
        USE_P: tl.constexpr,
        BLOCK: tl.constexpr,
        SCALE: tl.constexpr,
    ):
        """Program row: top-k or top-p sampling by rejection (module docstring), one pass per round."""
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride
        seed = tl.load(seed_ptr)
        lse, token, x_s = _row_first(base, V, temperature, seed, row, BLOCK, SCALE)
        rnd = row * 0 + 1
        searching = row * 0 + 1
        while searching > 0:
            count, mass, next_token, next_x = _row_check_and_race(
                base, V, temperature, x_s, lse, seed + rnd, row, BLOCK, SCALE
            )
            keep = count >= 0
            if USE_K:
                keep = keep & (count < top_k)
            if USE_P:
                keep = keep & (mass < top_p)
            searching = 1 - keep.to(tl.int32)
            token = tl.where(keep, token, next_token)
            x_s = tl.where(keep, x_s, next_x)
            rnd += 1
        token = tl.where(token < V, token, 0)  # no winner (a row of -inf or NaN): id 0, as torch's argmax
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logp_ptr + row, x_s - lse)
