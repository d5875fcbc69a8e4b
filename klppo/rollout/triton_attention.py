"""Decode attention fused with the KV-cache write, split over the KV length (flash-decoding), in Triton.

The contract (one layer, one new token per slot, slots ``0..B-1``), shared by the kernels and by
:func:`decode_attention_reference` (pure torch: the path on CPU, and the tests' oracle):

- ``cache`` [2, num_slots, S, H_kv, D] (one layer of the engine's ``kv``): K and V of the new token,
  ``kv_new`` [2, B, H_kv, D], are written at ``cache[:, b, positions[b]]``;
- with ``rope`` = (``cos``, ``sin``) [B, D], ``q`` and the new K are first rotated (RoPE, Hugging Face's
  rotate-half convention) in float32 and rounded once to their dtype — what the compiled unsplit layer
  front computes (:func:`rope_reference`); without it they arrive rotated;
- then each query head ``h`` of ``q`` [B, H, D] attends, with scale ``1/sqrt(D)``, to its KV head
  ``h // (H / H_kv)`` over cache positions ``0..positions[b]`` (inclusive, the new token too); the result
  [B, H, D] has ``q``'s dtype, computed in float32.

The kernels: program ``(b, j, s)`` of a fixed grid ``B × H_kv × splits`` takes the ``H / H_kv`` query
heads of KV head ``j`` (one ``tl.dot`` over rows padded to 16: each K/V block read once per KV head) over
chunk ``s`` of slot ``b``'s ``positions[b] + 1`` entries (the length split evenly in whole blocks of
``BLOCK_N``), with an online softmax. ``splits`` depends only on (B, H_kv, S, SM count)
(:func:`num_splits`), so the launch is the same at every step and can be captured in a CUDA graph; a chunk
past the slot's length runs no iteration and writes a neutral partial (log-sum-exp −inf, zeros). A second
small kernel combines the partials of each (slot, head) by their log-sum-exps; with one split the first
kernel writes the output itself and the combine is skipped.

Write before read, without ordering: the program whose chunk holds ``positions[b]`` stores the new K/V
(its KV head's), and *every* program takes row ``positions[b]`` from registers (``kv_new``) instead of
the cache — the loads are masked to rows ``< positions[b]``. So no program reads the address being
written (no barrier, no dependence on the order of programs or on a store being visible to other threads
of the same program), and the cache holds the new entry once the kernel ends, for the next step.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs: the torch reference only
    triton = None

BLOCK_N = 64  # cache rows per iteration
MAX_SPLITS = 32


def available(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device`` (CUDA with triton importable)."""
    return triton is not None and torch.device(device).type == "cuda"


def runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the kernels run a ``dtype`` cache on ``device``: CUDA, bf16/fp16, triton importable."""
    device = torch.device(device)
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and available(device)


def decode_attention(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    splits: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The contract of the module docstring: the kernels where they run, else the torch reference."""
    if available(q.device):
        return decode_attention_triton(q, kv_new, cache, positions, splits=splits, rope=rope)
    return decode_attention_reference(q, kv_new, cache, positions, rope=rope)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [B, H, D] rotated by ``cos``/``sin`` [B, D] (rotate-half), in float32, rounded once to ``x``'s
    dtype."""
    half = x.shape[-1] // 2
    x32 = x.float()
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos.float()[:, None, :] + rotated * sin.float()[:, None, :]).to(x.dtype)


def decode_attention_reference(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Pure torch (module docstring): rotate (``rope``), write ``kv_new`` at ``positions``, then masked
    softmax in float32."""
    if rope is not None:
        q = rope_reference(q, *rope)
        kv_new = torch.stack((rope_reference(kv_new[0], *rope), kv_new[1]))
    batch, num_heads, head_dim = q.shape
    max_len, num_kv_heads = cache.shape[2], cache.shape[3]
    slots = torch.arange(batch, device=q.device)
    cache[:, slots, positions] = kv_new
    seen = torch.arange(max_len, device=q.device)[None, :] <= positions[:, None]  # [B, S]
    k = cache[0, :batch].float().masked_fill(~seen[:, :, None, None], 0.0)  # [B, S, H_kv, D]
    v = cache[1, :batch].float().masked_fill(~seen[:, :, None, None], 0.0)  # (0 × stale NaN would be NaN)
    qg = q.float().reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.einsum("bjgd,bsjd->bjgs", qg, k) / math.sqrt(head_dim)
    scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    out = torch.einsum("bjgs,bsjd->bjgd", scores.softmax(dim=-1), v)
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def num_splits(batch: int, num_kv_heads: int, max_len: int, sms: int) -> int:
    """Chunks per (slot, KV head): enough programs for about two per SM, at most one per ``BLOCK_N``
    rows of the longest cache and ``MAX_SPLITS``; 1 (no combine) once ``batch × H_kv`` fills the GPU."""
    want = -(-2 * sms // (batch * num_kv_heads))
    return max(1, min(want, max_len // BLOCK_N, MAX_SPLITS))


def warm_splits() -> tuple[int, ...]:
    """A split count for each compiled variant the engine's launches can need, whatever the batch: 1 (the
    first kernel alone) and one per combine width (a power of two up to ``MAX_SPLITS``: the combine reads its
    lanes in registers, so its width follows the split count). The split count itself is a runtime
    argument."""
    return (1, *(2**i for i in range(1, MAX_SPLITS.bit_length())))


def device_splits(device: torch.device, batch: int, num_kv_heads: int, max_len: int) -> int:
    """:func:`num_splits` on ``device`` (its SM count; 4 off CUDA: the interpreter)."""
    device = torch.device(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return num_splits(batch, num_kv_heads, max_len, sms)


def decode_attention_triton(
    q: torch.Tensor,
    kv_new: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    splits: int | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = 4,
    num_stages: int | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The kernels (module docstring); ``splits`` overrides :func:`num_splits` (tests); ``block_n``,
    ``num_warps``, ``num_stages``: the launch configuration (benchmarks; None: Triton's default stages)."""
    batch, num_heads, head_dim = q.shape
    if rope is not None and head_dim % 2:
        raise ValueError(f"decode attention's RoPE needs an even head dimension, got {head_dim}")
    max_len, num_kv_heads = cache.shape[2], cache.shape[3]
    if q.stride(-1) != 1:
        q = q.contiguous()
    if kv_new.stride(-1) != 1:
        kv_new = kv_new.contiguous()
    if cache.stride(-1) != 1:
        raise ValueError("decode attention needs a cache with contiguous head dimension")
    if splits is None:
        splits = device_splits(q.device, batch, num_kv_heads, max_len)
    group = num_heads // num_kv_heads
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype, device=q.device)
    part = lse = out  # unused with one split
    if splits > 1:
        part = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    cos, sin = rope if rope is not None else (q, q)  # unused without rope
    if rope is not None and (cos.stride() != (head_dim, 1) or sin.stride() != (head_dim, 1)):
        cos, sin = cos.contiguous(), sin.contiguous()
    strides = (*q.stride()[:2], *kv_new.stride()[:3], *cache.stride()[:4])
    _partial_kernel[(batch, num_kv_heads, splits)](
        q,
        kv_new,
        cache,
        positions,
        cos,
        sin,
        out,
        part,
        lse,
        *strides,
        1.0 / math.sqrt(head_dim),
        head_dim,
        group,
        splits,
        ROPE=rope is not None,
        ONE=splits == 1,
        GP=max(16, triton.next_power_of_2(group)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        num_warps=num_warps,
        **({} if num_stages is None else {"num_stages": num_stages}),
    )
    if splits > 1:
        _combine_kernel[(batch, num_heads)](
            part,
            lse,
            out,
            head_dim,
            splits,
            SP=triton.next_power_of_2(splits),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out


if triton is not None:
    NEG_INF = tl.constexpr(float("-inf"))

    @triton.jit
    def _chunk(
        q,
        k_new,
        v_new,
        cache,
        sc_kv,
        sc_s,
        pos,
        start,
        end,
        scale,
        d,
        dm,
        GP: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Online softmax of ``q`` [GP, BLOCK_D] over cache rows [start, end) of one (slot, KV head); row
        ``pos`` from ``k_new``/``v_new``. Returns (running max, sum of exp, unnormalised output)."""
        m = tl.full([GP], NEG_INF, tl.float32)
        den = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BLOCK_D], tl.float32)
        for off in range(start, end, BLOCK_N):
            n = off + tl.arange(0, BLOCK_N)
            old = (n < pos)[:, None] & dm[None, :]  # rows written by earlier steps
            ptrs = cache + n[:, None] * sc_s + d[None, :]
            new = (n == pos)[:, None]
            k = tl.where(new, k_new[None, :], tl.load(ptrs, mask=old, other=0.0))
            v = tl.where(new, v_new[None, :], tl.load(ptrs + sc_kv, mask=old, other=0.0))
            x = tl.dot(q, tl.trans(k)) * scale
            x = tl.where((n < end)[None, :], x, NEG_INF)
            m_new = tl.maximum(m, tl.max(x, axis=1))  # finite: column `off` < end is valid
            p = tl.exp(x - m_new[:, None])
            alpha = tl.exp(m - m_new)
            den = den * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        return m, den, acc

    @triton.jit
    def _rotated(ptrs, d, D, c, s, mask):
        """RoPE of the vectors at ``ptrs + d`` (last axis ``d``, ``D`` entries) by ``c``/``s`` [BLOCK_D],
        in float32, rounded once to the element type: ``x·c + rotate_half(x)·s``."""
        half = D // 2
        partner = tl.where(d < half, d + half, d - half)
        x = tl.load(ptrs + d, mask=mask, other=0.0)
        other = tl.load(ptrs + partner, mask=mask, other=0.0).to(tl.float32)
        rotated = tl.where(d < half, -other, other)
        return (x.to(tl.float32) * c + rotated * s).to(x.dtype)

    @triton.jit(do_not_specialize=["SPLITS"])
    def _partial_kernel(
        q_ptr,
        new_ptr,
        cache_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        out_ptr,
        part_ptr,
        lse_ptr,
        sq_b,
        sq_h,
        sn_kv,
        sn_b,
        sn_h,
        sc_kv,
        sc_b,
        sc_s,
        sc_h,
        scale,
        D,
        GROUP,
        SPLITS,
        ROPE: tl.constexpr,
        ONE: tl.constexpr,
        GP: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """Program (slot b, KV head j, chunk s): rotate q and the new K (``ROPE``), write the new K/V if
        the chunk holds ``positions[b]``, attend its ``GROUP`` query heads over the chunk; the output (one
        split) or a partial."""
        b = tl.program_id(0)
        j = tl.program_id(1)
        s = tl.program_id(2)
        pos = tl.load(pos_ptr + b).to(tl.int32)
        per = tl.cdiv(tl.cdiv(pos + 1, SPLITS), BLOCK_N) * BLOCK_N
        start = s * per
        end = tl.minimum(start + per, pos + 1)
        d = tl.arange(0, BLOCK_D)
        dm = d < D
        g = tl.arange(0, GP)
        heads = j * GROUP + g
        hm = (g < GROUP)[:, None] & dm[None, :]
        new = new_ptr + b * sn_b + j * sn_h
        v_new = tl.load(new + sn_kv + d, mask=dm, other=0.0)
        if ROPE:
            c = tl.load(cos_ptr + b * D + d, mask=dm, other=0.0).to(tl.float32)
            sn = tl.load(sin_ptr + b * D + d, mask=dm, other=0.0).to(tl.float32)
            q = _rotated(q_ptr + b * sq_b + heads[:, None] * sq_h, d[None, :], D, c[None, :], sn[None, :], hm)
            k_new = _rotated(new, d, D, c, sn, dm)
        else:
            q = tl.load(q_ptr + b * sq_b + heads[:, None] * sq_h + d[None, :], mask=hm, other=0.0)
            k_new = tl.load(new + d, mask=dm, other=0.0)
        cache = cache_ptr + b.to(tl.int64) * sc_b + j * sc_h
        wm = d < tl.where((pos >= start) & (pos < start + per), D, 0)  # this chunk holds the new position
        tl.store(cache + pos * sc_s + d, k_new, mask=wm)
        tl.store(cache + sc_kv + pos * sc_s + d, v_new, mask=wm)
        m, den, acc = _chunk(
            q, k_new, v_new, cache, sc_kv, sc_s, pos, start, end, scale, d, dm, GP, BLOCK_D, BLOCK_N
        )
        row = b * (GROUP * tl.num_programs(1)) + heads  # output row (slot, query head)
        o = acc / tl.where(den > 0, den, 1.0)[:, None]  # an empty chunk: zeros
        if ONE:
            tl.store(out_ptr + row[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=hm)
        else:
            tl.store(part_ptr + (row[:, None] * SPLITS + s) * D + d[None, :], o, mask=hm)
            lse = tl.where(den > 0, m + tl.log(tl.where(den > 0, den, 1.0)), NEG_INF)
            tl.store(lse_ptr + row * SPLITS + s, lse, mask=g < GROUP)

    @triton.jit(do_not_specialize=["SPLITS"])
    def _combine_kernel(part_ptr, lse_ptr, out_ptr, D, SPLITS, SP: tl.constexpr, BLOCK_D: tl.constexpr):
        """Program (slot, head): the chunks' outputs weighted by ``exp(lse − max lse)`` (chunk 0 is never
        empty, so the max is finite and empty chunks weigh 0)."""
        row = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        s = tl.arange(0, SP)
        d = tl.arange(0, BLOCK_D)
        lse = tl.load(lse_ptr + row * SPLITS + s, mask=s < SPLITS, other=NEG_INF)
        w = tl.exp(lse - tl.max(lse, axis=0))
        mask = (s < SPLITS)[:, None] & (d < D)[None, :]
        o = tl.load(part_ptr + (row * SPLITS + s[:, None]) * D + d[None, :], mask=mask, other=0.0)
        out = tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0)
        tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)
