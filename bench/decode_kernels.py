"""The decode step's kernels alone: the MLP tail, the gate/up GEMM with its activation, the
split-KV attention, the seam between layers (``down``: the down projection and the next norm, written
several ways) and the step's end (``head``: LM head and sampler), graph-replayed.

    PYTHONPATH=$PWD python3 bench/decode_kernels.py [--parts mlp,attention,gateup,down,head] [--shapes
    0.5b,1.5b]
        [--batches 64,256] [--sweep] [--out kernels.json]

``mlp``: ``residual + down(silu(gate) * up)`` from the fused ``[gate; up]`` output, per layer, as the
engine's compiled layer back computes it (Inductor: a pointwise activation kernel, cuBLAS's GEMM with
the residual) against a Triton kernel written here (an alternative the engine does not use) that computes the
activation where its split-K GEMM loads ``gate_up``
(no [M, I] intermediate) and sums the float32 partials with the residual in a second, deterministic
kernel, with its chosen tiles, and with ``--sweep`` every tile configuration of a grid (the best five
printed). ``gateup``: ``silu(h W_gateᵀ) · (h W_upᵀ)`` from the norm's output ``h`` and the fused
``[gate; up]`` weight, as the engine runs it (cuBLAS's GEMM writing ``gate_up`` in bf16, then Inductor's
SiLU·mul kernel reading it back) against one Triton kernel written here that keeps both products of an
output tile in float32 registers and writes only the activation (no [M, 2I] intermediate, one rounding
instead of two), with its chosen tiles and with ``--sweep`` a grid of tiles (compiled in parallel first,
timed briefly, the best five again in full; a setting compiles once per process, every shape and batch
here specialising alike). ``attention``: :func:`klppo.rollout.triton_attention.decode_attention_triton`
at the engine's configuration and, with ``--sweep``, over splits × ``BLOCK_N`` × warps × stages. Context:
each slot at a random position in [256, 512) (the bench's prompt 256 + 256 new tokens). Times:
microseconds per call, ``triton.testing.do_bench_cudagraph`` (a CUDA graph of the call replayed: kernel
time and launch gaps as inside the engine's graph). The floor: the bytes read and written once at 4.8 TB/s
(H200). The rows print as JSON lines, then as a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU: the script needs a GPU anyway
    triton = None

HBM = 4.8e12
SHAPES = {  # hidden, heads, kv heads, head dim, intermediate
    "0.5b": (896, 14, 2, 64, 4864),
    "1.5b": (1536, 12, 2, 128, 8960),
}


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One launch configuration: row, column and reduction tiles, splits of ``I``, warps, pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    splits: int
    num_warps: int = 4
    num_stages: int = 3


def choose_tiles(rows: int, cols: int, inner: int, sms: int) -> Tiles:
    """Tiles for ``rows`` × ``cols`` outputs over ``inner``: row tiles of up to 64, column tiles of 64,
    and ``I`` split until the grid has about two programs per SM (each split at least 4 blocks of 64)."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    block_n, block_k = 64, 64
    tiles = -(-rows // block_m) * -(-cols // block_n)
    splits = max(1, min(-(-2 * sms // tiles), inner // (4 * block_k)))
    return Tiles(block_m, block_n, block_k, splits)


def silu_mul_down_reference(
    gate_up: torch.Tensor, down: torch.Tensor, residual: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Pure torch (module docstring)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (F.silu(gate) * up).to(down.dtype)
    y = torch.matmul(act.float(), down.float().t()) + residual.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(residual.dtype)


def silu_mul_down_triton(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    residual: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """The kernels (module docstring); ``tiles`` overrides :func:`choose_tiles` (tests, benchmarks)."""
    rows, cols, inner = gate_up.shape[0], down.shape[0], down.shape[1]
    if gate_up.shape[1] != 2 * inner or residual.shape != (rows, cols):
        raise ValueError(
            f"silu_mul_down: shapes {tuple(gate_up.shape)}, {tuple(down.shape)}, {tuple(residual.shape)}"
        )
    gate_up, down, residual = gate_up.contiguous(), down.contiguous(), residual.contiguous()
    if tiles is None:
        sms = torch.cuda.get_device_properties(gate_up.device).multi_processor_count
        tiles = choose_tiles(rows, cols, inner, sms)
    out = torch.empty_like(residual)
    per = -(-inner // (tiles.splits * tiles.block_k)) * tiles.block_k  # whole blocks per split
    splits = -(-inner // per)  # no empty split
    part = out if splits == 1 else torch.empty(splits, rows, cols, dtype=torch.float32, device=out.device)
    has_bias = bias is not None
    grid = (triton.cdiv(rows, tiles.block_m), triton.cdiv(cols, tiles.block_n), splits)
    _down_kernel[grid](
        gate_up,
        down,
        residual,
        bias if has_bias else residual,
        out,
        part,
        rows,
        cols,
        inner,
        per,
        SPLITS=splits,
        HAS_BIAS=has_bias,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if splits > 1:
        block = 1024
        _sum_kernel[(triton.cdiv(rows * cols, block),)](
            part,
            residual,
            bias if has_bias else residual,
            out,
            rows * cols,
            cols,
            SPLITS=splits,
            HAS_BIAS=has_bias,
            BLOCK=block,
        )
    return out


if triton is not None:

    @triton.jit
    def _down_kernel(
        gu_ptr,
        w_ptr,
        res_ptr,
        bias_ptr,
        out_ptr,
        part_ptr,
        M,
        N,
        K,
        PER,
        SPLITS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Program (row tile, column tile, split s): the float32 product of the activation of ``gate_up``'s
        rows with ``down``'s columns over ``K`` range [s·PER, (s+1)·PER); ``out`` itself with one split,
        else the partial ``part[s]``."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        s = tl.program_id(2)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = rows < M
        cm = cols < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        start = s * PER
        stop = tl.minimum(start + PER, K)
        for k0 in range(start, stop, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            km = k < stop
            a_mask = rm[:, None] & km[None, :]
            a_ptrs = gu_ptr + rows[:, None].to(tl.int64) * (2 * K) + k[None, :]
            g = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
            u = tl.load(a_ptrs + K, mask=a_mask, other=0.0).to(tl.float32)
            act = (g * tl.sigmoid(g) * u).to(w_ptr.dtype.element_ty)
            w = tl.load(
                w_ptr + cols[None, :].to(tl.int64) * K + k[:, None], mask=km[:, None] & cm[None, :], other=0.0
            )
            acc = tl.dot(act, w, acc)
        offs = rows[:, None] * N + cols[None, :]
        mask = rm[:, None] & cm[None, :]
        if SPLITS == 1:
            y = acc + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_BIAS:
                y += tl.load(bias_ptr + cols, mask=cm, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(part_ptr + s * M * N + offs, acc, mask=mask)

    @triton.jit
    def _sum_kernel(
        part_ptr,
        res_ptr,
        bias_ptr,
        out_ptr,
        MN,
        N,
        SPLITS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """``out = residual + Σ_s part[s] (+ bias)``, the splits summed in order (deterministic)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        y = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        for s in tl.static_range(SPLITS):
            y += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def choose_gate_up_tiles(rows: int, cols: int, sms: int) -> Tiles:
    """Tiles for :func:`silu_mul_gate_up_triton`'s [rows, cols] output: row tiles of the batch rounded up to
    a power of two (16 to 64), reduction blocks of 64, the widest column tile of 128, 64 and 32 that still
    gives every SM a program (else 32), 4 warps, 3 stages (at most 3 × (64 + 2·128) × 64 × 2 B = 120 KiB of
    shared memory); no split of the reduction."""
    block_m = min(64, max(16, 1 << (rows - 1).bit_length()))
    tiles_m = -(-rows // block_m)
    block_n = next((n for n in (128, 64) if tiles_m * -(-cols // n) >= sms), 32)
    return Tiles(block_m, block_n, 64, 1, num_warps=4, num_stages=3)


def gate_up_sweep(rows: int, smem: int, elem: int = 2) -> list[Tiles]:
    """The ``--sweep`` grid for a batch of ``rows``: ``BLOCK_M`` 16–128 from an eighth of the batch up to the
    batch rounded up to a power of two (more row tiles re-read every weight tile once more), ``BLOCK_N``
    and ``BLOCK_K`` 32/64/128, 4 or 8 warps, 2–4 stages; 8 warps only on tiles of at least 64 × 64, 4 only
    where the two float32 accumulators take at most 128 registers a thread (2·BLOCK_M·BLOCK_N ≤ 128 × 128
    threads), and none whose pipeline buffers (stages × (BLOCK_M + 2 BLOCK_N) × BLOCK_K × ``elem`` bytes)
    exceed ``smem``. At 227 KiB (H100, H200) and bf16: 101 settings at batch 64, 116 at 256, 142 for both."""
    top = max(16, 1 << (rows - 1).bit_length())
    grid = itertools.product((16, 32, 64, 128), (32, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    return [
        Tiles(bm, bn, bk, 1, num_warps=nw, num_stages=ns)
        for bm, bn, bk, nw, ns in grid
        if rows <= 8 * bm <= 8 * top
        and (bm * bn <= 64 * 128 if nw == 4 else bm * bn >= 64 * 64)
        and ns * (bm + 2 * bn) * bk * elem <= smem
    ]


def silu_mul_gate_up_reference(
    h: torch.Tensor, gate_up_weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """[M, I] ``silu(g) · u`` for ``h`` [M, H] and ``gate_up_weight`` [2I, H] (rows 0..I-1 the gate's, I..2I-1
    the up projection's; ``bias`` [2I] likewise): ``g = float(h) @ float(W_gate)ᵀ (+ float(b_gate))``, ``u``
    likewise with the up rows, ``silu(g) = g · sigmoid(g)``, every step in float32 from the inputs converted
    exactly, rounded to ``h.dtype`` once at the end — ``(F.silu(g) * u).to(h.dtype)`` on float32 ``g`` and
    ``u``. The engine differs by one rounding: its GEMM writes ``g`` and ``u`` in ``h.dtype`` before the
    activation (computed in float32 by Inductor) reads them."""
    b = None if bias is None else bias.float()
    g, u = F.linear(h.float(), gate_up_weight.float(), b).chunk(2, dim=-1)
    return (F.silu(g) * u).to(h.dtype)


def silu_mul_gate_up_triton(
    h: torch.Tensor,
    gate_up_weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """:func:`silu_mul_gate_up_reference` in one kernel (the same up to float32 summation order; float32
    inputs multiply in IEEE float32, not TF32); ``tiles`` (``splits`` 1) overrides
    :func:`choose_gate_up_tiles`."""
    rows, inner = h.shape
    cols = gate_up_weight.shape[0] // 2
    if (
        gate_up_weight.shape != (2 * cols, inner)
        or gate_up_weight.dtype != h.dtype
        or (bias is not None and bias.shape != (2 * cols,))
    ):
        raise ValueError(
            f"silu_mul_gate_up: h {tuple(h.shape)} {h.dtype}, gate_up_weight {tuple(gate_up_weight.shape)} "
            f"{gate_up_weight.dtype}, bias {None if bias is None else tuple(bias.shape)}"
        )
    h, gate_up_weight = h.contiguous(), gate_up_weight.contiguous()
    if tiles is None:
        sms = torch.cuda.get_device_properties(h.device).multi_processor_count
        tiles = choose_gate_up_tiles(rows, cols, sms)
    if tiles.splits != 1:
        raise ValueError(f"silu_mul_gate_up: no split of the reduction ({tiles})")
    out = torch.empty(rows, cols, dtype=h.dtype, device=h.device)
    _gate_up_launch(h, gate_up_weight, None if bias is None else bias.contiguous(), out, tiles)
    return out


def _gate_up_launch(
    h: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tiles: Tiles,
    warmup: bool = False,
) -> None:
    """``_gate_up_kernel`` on contiguous operands into ``out`` (``kernel[grid](...)`` is ``kernel.run(...,
    grid=grid, warmup=False)``); ``warmup``: compile only, no launch."""
    (rows, inner), cols = h.shape, out.shape[1]
    has_bias = bias is not None
    grid = (triton.cdiv(rows, tiles.block_m) * triton.cdiv(cols, tiles.block_n),)
    _gate_up_kernel.run(
        h,
        w,
        bias if has_bias else h,
        out,
        rows,
        cols,
        inner,
        HAS_BIAS=has_bias,
        EVEN_K=inner % tiles.block_k == 0,
        PRECISION="ieee" if h.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        grid=grid,
        warmup=warmup,
    )


def precompile_gate_up(h: torch.Tensor, w: torch.Tensor, grid: list[Tiles]) -> float:
    """Compile ``_gate_up_kernel`` for every setting of ``grid`` at the specialisation of ``h`` and ``w`` (no
    bias) on a thread per CPU (``triton.AsyncCompileMode``; Triton's compiler releases the GIL), so that the
    sweep finds each one compiled; what fails here compiles (or fails) again at its first call in the sweep.
    The seconds taken (0 where this Triton lacks ``AsyncCompileMode``)."""
    if not hasattr(triton, "AsyncCompileMode"):
        return 0.0
    out = torch.empty(h.shape[0], w.shape[0] // 2, dtype=h.dtype, device=h.device)
    start = time.perf_counter()
    try:
        with ThreadPoolExecutor(os.cpu_count()) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
            for tiles in grid:
                _gate_up_launch(h, w, None, out, tiles, warmup=True)
    except Exception as e:  # noqa: BLE001  the sweep compiles what is missing, one by one
        print(f"precompile stopped: {type(e).__name__}: {e}", file=sys.stderr)
    return time.perf_counter() - start


if triton is not None:

    @triton.jit
    def _gate_up_kernel(
        h_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        M,
        N,
        K,
        HAS_BIAS: tl.constexpr,
        EVEN_K: tl.constexpr,
        PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """Program p: output tile (p mod ⌈M/BLOCK_M⌉, p div ⌈M/BLOCK_M⌉) — the row tiles of one column tile
        adjacent, so its gate and up weight rows come from memory once and then from L2. Two float32
        accumulators, ``h`` against the gate rows ``cols`` and the up rows ``N + cols``, over ``K`` in
        ``BLOCK_K`` steps; rows and columns past the end are read wrapped (``% M``, ``% N``: in bounds) and
        not stored, the reduction's tail masked to zero unless ``EVEN_K``."""
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        rows = (pid % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = (pid // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + (rows % M)[:, None].to(tl.int64) * K + k[None, :]
        g_ptrs = w_ptr + (cols % N)[None, :].to(tl.int64) * K + k[:, None]  # [BLOCK_K, BLOCK_N]: W_gateᵀ
        u_ptrs = g_ptrs + N.to(tl.int64) * K
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(h_ptrs)
                wg = tl.load(g_ptrs)
                wu = tl.load(u_ptrs)
            else:
                km = k < K - k0
                a = tl.load(h_ptrs, mask=km[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=km[:, None], other=0.0)
                wu = tl.load(u_ptrs, mask=km[:, None], other=0.0)
            acc_g = tl.dot(a, wg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=PRECISION)
            h_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        if HAS_BIAS:
            acc_g += tl.load(bias_ptr + cols % N).to(tl.float32)[None, :]
            acc_u += tl.load(bias_ptr + N + cols % N).to(tl.float32)[None, :]
        act = acc_g * tl.sigmoid(acc_g) * acc_u  # Inductor's order: (g · sigmoid(g)) · u
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        out_ptrs = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out_ptrs, act.to(out_ptr.dtype.element_ty), mask=mask)


def timed(fn, rep: int = 50) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=rep) * 1e3  # µs


def best_five(settings: list, call, keep: int | None = 5) -> list[tuple[float, object]]:
    """(µs, setting) of the five (``keep``; None: all) fastest ``call(setting)`` (graph-replayed, ``timed``),
    fastest first; a setting that fails (out of resources) is named on stderr and skipped."""
    found = []
    for setting in settings:
        try:
            found.append((timed(lambda setting=setting: call(setting)), setting))
        except Exception as e:  # noqa: BLE001  a configuration out of resources is skipped
            print(f"skip {setting}: {type(e).__name__}", file=sys.stderr)
    return sorted(found, key=lambda f: f[0])[:keep]


def ulps(x: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest ``|x - ref|`` in units of ``ref.dtype``'s spacing at ``|ref|`` (that of the smallest
    normal number below it)."""
    info = torch.finfo(ref.dtype)
    _, exponent = torch.frexp(ref.float().abs().clamp_min(info.tiny))
    spacing = torch.ldexp(torch.full_like(exponent, info.eps, dtype=torch.float32), exponent - 1)
    return ((x.float() - ref.float()).abs() / spacing).max().item()


def mlp_rows(shape: str, batch: int, sweep: bool) -> list[dict]:
    hidden, _, _, _, inner = SHAPES[shape]
    dev, dt = "cuda", torch.bfloat16
    gu = torch.randn(batch, 2 * inner, device=dev, dtype=dt)
    w = torch.randn(hidden, inner, device=dev, dtype=dt) / inner**0.5
    res = torch.randn(batch, hidden, device=dev, dtype=dt)

    def tail(gu, w, res):
        gate, up = gu.chunk(2, dim=-1)
        return res + F.linear(F.silu(gate) * up, w)

    compiled = torch.compile(tail)
    torch._dynamo.maybe_mark_dynamic(gu, 0)
    torch._dynamo.maybe_mark_dynamic(res, 0)
    ref = silu_mul_down_reference(gu, w, res)
    err = (silu_mul_down_triton(gu, w, res).float() - ref.float()).abs().max().item()
    floor = (gu.numel() + w.numel() + 2 * res.numel()) * 2 / HBM * 1e6
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = dict(part="mlp", shape=shape, batch=batch, floor_us=round(floor, 2), max_abs_err_vs_reference=err)
    rows = [
        dict(base, impl="inductor (the engine's)", us=round(timed(lambda: compiled(gu, w, res)), 2)),
        dict(base, impl="eager torch", us=round(timed(lambda: tail(gu, w, res)), 2)),
        dict(
            base,
            impl=f"triton {choose_tiles(batch, hidden, inner, sms)}",
            us=round(timed(lambda: silu_mul_down_triton(gu, w, res)), 2),
        ),
    ]
    if sweep:
        grid = [
            Tiles(bm, bn, bk, sp, 4, ns)
            for bm, bn, bk, sp, ns in itertools.product(
                (16, 32, 64), (64, 128), (64, 128), (1, 2, 4, 8), (3, 4)
            )
        ]
        for us, tiles in best_five(grid, lambda t: silu_mul_down_triton(gu, w, res, tiles=t)):
            rows.append(dict(base, impl=f"triton sweep {tiles}", us=round(us, 2)))
    return rows


def down_rows(shape: str, batch: int, sweep: bool) -> list[dict]:
    """The seam between two decode layers as the split layers run it: the down projection
    ``m = act W_downᵀ`` (one compiled function, the back's end), then ``rms_norm(x + m)`` (the next
    front's start, compiled apart), against other ways to write the GEMM — its transpose ``W_down actᵀ``
    (cuBLAS picks kernels by shape: the transposed problem has ``hidden`` rows, so it may not split the
    reduction), and ``m`` kept in float32 (``out_dtype``: the next norm adds it in float32 anyway, one
    rounding fewer than eager) — and the residual folded into ``addmm`` (what Inductor makes of ``x +
    linear``). ``sweep`` is unused (no tile grid)."""
    from klppo.models.llama_layers import residual_add, rms_norm

    hidden, _, _, _, inner = SHAPES[shape]
    dev, dt = "cuda", torch.bfloat16
    act = torch.randn(batch, inner, device=dev, dtype=dt)
    w = torch.randn(hidden, inner, device=dev, dtype=dt) / inner**0.5
    x = torch.randn(batch, hidden, device=dev, dtype=dt)
    nw = torch.rand(hidden, device=dev, dtype=dt) + 0.5
    for t in (act, x):
        torch._dynamo.maybe_mark_dynamic(t, 0)
    seam = torch.compile(lambda x, m: rms_norm(residual_add(x, m), nw, 1e-6))
    seam_t = torch.compile(lambda x, m_t: rms_norm(residual_add(x, m_t.t()), nw, 1e-6))
    folded = torch.compile(lambda act, w, x: x + F.linear(act, w))
    norm_only = torch.compile(lambda y: rms_norm(y, nw, 1e-6))
    down = torch.compile(lambda act, w: F.linear(act, w))
    down_t = torch.compile(lambda act, w: torch.mm(w, act.t()))
    variants = {
        "split layers (the engine's): compiled F.linear, then norm(x + m)": lambda: seam(x, down(act, w)),
        "transposed GEMM, compiled: W actᵀ, then norm(x + mᵀ)": lambda: seam_t(x, down_t(act, w)),
        "transposed GEMM, eager cuBLAS": lambda: seam_t(x, torch.mm(w, act.t())),
        "float32 m (out_dtype)": lambda: seam(x, torch.mm(act, w.t(), out_dtype=torch.float32)),
        "float32 m, transposed": lambda: seam_t(x, torch.mm(w, act.t(), out_dtype=torch.float32)),
        "x + linear folded into addmm, then norm": lambda: norm_only(folded(act, w, x)),
    }
    want = rms_norm(residual_add(x, F.linear(act, w)), nw, 1e-6)
    floor = (act.numel() + w.numel() + 2 * x.numel()) * 2 / HBM * 1e6
    rows = []
    for name, fn in variants.items():
        try:
            err = (fn().float() - want.float()).abs().max().item()
            rows.append(
                dict(
                    part="down",
                    shape=shape,
                    batch=batch,
                    floor_us=round(floor, 2),
                    impl=name,
                    us=round(timed(fn), 2),
                    max_abs_diff_vs_engine=err,
                )
            )
        except Exception as e:  # noqa: BLE001  a variant this torch lacks (out_dtype) is reported and skipped
            print(f"down {shape} b{batch} {name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    return rows


def head_rows(shape: str, batch: int, sweep: bool) -> list[dict]:
    """A decode step's end as the engine runs it: the final norm's output through the LM head with float32
    logits (``klppo.models.lm_head.lm_head_logits``), then the one-pass Triton sampler (temperature 1,
    untruncated) — each alone and the two together; the floor counts the head's weight read and the
    logits written and read once. Vocabulary 151,936 (Qwen2.5). ``sweep``: the sampler's launch settings
    (ids per block, warps, programs per row; 45), all of them, fastest first."""
    from klppo.models.lm_head import lm_head_logits
    from klppo.rollout.base import SamplingParams
    from klppo.rollout.triton_sampling import sample_triton

    hidden, vocab = SHAPES[shape][0], 151936
    dev, dt = "cuda", torch.bfloat16
    h = torch.randn(batch, hidden, device=dev, dtype=dt)
    w = torch.randn(vocab, hidden, device=dev, dtype=dt) / hidden**0.5
    params = SamplingParams(max_new_tokens=1, temperature=1.0, top_p=1.0, top_k=-1, seed=0)
    logits = lm_head_logits(h, w, True)
    parts = {
        "LM head, float32 logits": (lambda: lm_head_logits(h, w, True), (w.numel() * 2 + logits.numel() * 4)),
        "Triton sampler": (lambda: sample_triton(logits, params), logits.numel() * 4),
        "Triton sampler, temperature 0.7": (
            lambda: sample_triton(logits, SamplingParams(max_new_tokens=1, temperature=0.7)),
            logits.numel() * 4,
        ),
        "LM head + sampler": (
            lambda: sample_triton(lm_head_logits(h, w, True), params),
            w.numel() * 2 + logits.numel() * 8,
        ),
    }
    rows = [
        dict(
            part="head",
            shape=shape,
            batch=batch,
            floor_us=round(nbytes / HBM * 1e6, 2),
            impl=name,
            us=round(timed(fn), 2),
        )
        for name, (fn, nbytes) in parts.items()
    ]
    if sweep:  # the untruncated sampler's launch: ids per block, warps, programs per row (None: its default)
        grid = [
            dict(block=block, num_warps=warps, splits=splits)
            for block, warps, splits in itertools.product((1024, 2048, 4096), (4, 8, 16), (None, 1, 2, 4, 8))
        ]
        for us, kw in best_five(grid, lambda kw: sample_triton(logits, params, **kw), keep=None):
            rows.append(
                dict(
                    part="head",
                    shape=shape,
                    batch=batch,
                    floor_us=round(logits.numel() * 4 / HBM * 1e6, 2),
                    impl=f"Triton sampler sweep {kw}",
                    us=round(us, 2),
                )
            )
    return rows


def attention_rows(shape: str, batch: int, sweep: bool) -> list[dict]:
    from klppo.rollout import triton_attention as ta

    _, heads, kv_heads, head_dim, _ = SHAPES[shape]
    dev, dt, max_len = "cuda", torch.bfloat16, 512
    q = torch.randn(batch, heads, head_dim, device=dev, dtype=dt)
    kv_new = torch.randn(2, batch, kv_heads, head_dim, device=dev, dtype=dt)
    cache = torch.randn(2, batch, max_len, kv_heads, head_dim, device=dev, dtype=dt)
    pos = torch.randint(256, max_len, (batch,), device=dev)
    ctx = pos.float().mean().item() + 1
    floor = (batch * ctx * kv_heads * head_dim * 2 * 2 + 2 * q.numel() * 2) / HBM * 1e6
    splits = ta.device_splits(q.device, batch, kv_heads, max_len)
    base = dict(part="attention", shape=shape, batch=batch, floor_us=round(floor, 2))
    rows = [
        dict(
            base,
            impl=f"engine (splits {splits}, BLOCK_N {ta.BLOCK_N}, 4 warps)",
            us=round(timed(lambda: ta.decode_attention_triton(q, kv_new, cache, pos, splits=splits)), 2),
        )
    ]
    if sweep:
        grid = [
            dict(splits=sp, block_n=bn, num_warps=nw, num_stages=ns)
            for sp, bn, nw, ns in itertools.product((1, 2, 4), (32, 64, 128), (4, 8), (2, 3))
        ]
        for us, kw in best_five(grid, lambda kw: ta.decode_attention_triton(q, kv_new, cache, pos, **kw)):
            rows.append(dict(base, impl=f"sweep {kw}", us=round(us, 2)))
    return rows


def gateup_rows(shape: str, batch: int, sweep: bool) -> list[dict]:
    hidden, _, _, _, inner = SHAPES[shape]
    dev, dt = "cuda", torch.bfloat16
    h = torch.randn(batch, hidden, device=dev, dtype=dt)
    w = torch.randn(2 * inner, hidden, device=dev, dtype=dt) / hidden**0.5

    def engine(h, w):  # klppo/models/llama_layers.py mlp up to the down projection (fused weight, no bias)
        gate, up = F.linear(h, w).chunk(2, dim=-1)
        return F.silu(gate) * up

    compiled = torch.compile(engine)  # as CompiledFunctions: default mode, the batch dim dynamic
    torch._dynamo.maybe_mark_dynamic(h, 0)
    want, ref = compiled(h, w), silu_mul_gate_up_reference(h, w)

    def errors(out: torch.Tensor) -> dict:
        return dict(
            max_abs_diff_vs_engine=(out.float() - want.float()).abs().max().item(),
            max_ulps_vs_engine=ulps(out, want),
            max_ulps_vs_reference=ulps(out, ref),
        )

    floor = (h.numel() + w.numel() + batch * inner) * 2 / HBM * 1e6
    props = torch.cuda.get_device_properties(0)
    default = choose_gate_up_tiles(batch, inner, props.multi_processor_count)
    base = dict(part="gateup", shape=shape, batch=batch, floor_us=round(floor, 2))
    rows = [
        dict(
            base,
            impl="inductor (the engine's)",
            us=round(timed(lambda: compiled(h, w)), 2),
            max_ulps_vs_reference=ulps(want, ref),
        ),
        dict(
            base,
            impl=f"triton {default}",
            us=round(timed(lambda: silu_mul_gate_up_triton(h, w)), 2),
            **errors(silu_mul_gate_up_triton(h, w)),
        ),
    ]
    if sweep:
        smem = getattr(props, "shared_memory_per_block_optin", 232448)
        grid = gate_up_sweep(batch, smem)
        compile_s = precompile_gate_up(h, w, grid)
        found, start = [], time.perf_counter()
        for tiles in grid:
            try:  # a short first pass (rep 10 ms); the best five re-timed as every other row
                found.append((timed(lambda t=tiles: silu_mul_gate_up_triton(h, w, tiles=t), rep=10), tiles))
            except Exception as e:  # noqa: BLE001  a configuration out of resources is skipped
                print(f"skip {tiles}: {type(e).__name__}", file=sys.stderr)
        print(
            f"gateup {shape} b{batch}: {len(found)} of {len(grid)} tile settings timed, compiled in "
            f"{compile_s:.0f} s, timed in {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
        for _, tiles in sorted(found, key=lambda f: f[0])[:5]:
            us = timed(lambda t=tiles: silu_mul_gate_up_triton(h, w, tiles=t))
            out = silu_mul_gate_up_triton(h, w, tiles=tiles)
            rows.append(dict(base, impl=f"triton sweep {tiles}", us=round(us, 2), **errors(out)))
    return rows


PARTS = {
    "mlp": mlp_rows,
    "attention": attention_rows,
    "gateup": gateup_rows,
    "down": down_rows,
    "head": head_rows,
}


def print_table(rows: list[dict]) -> None:
    """The rows again, one line each: part, shape, batch, µs, floor, the error columns present, impl."""
    for r in rows:
        err = " ".join(f"{k}={v:.3g}" for k, v in r.items() if k.startswith("max_"))
        print(
            f"{r['part']:9} {r['shape']:4} {r['batch']:4} {r['us']:8.2f} us  floor {r['floor_us']:6.2f}  "
            f"{err:64} {r['impl']}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="mlp,attention", help=f"comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    unknown = [p for p in args.parts.split(",") if p not in PARTS]
    if unknown:
        ap.error(f"--parts: unknown {unknown}; the parts are {list(PARTS)}")
    torch.manual_seed(0)
    rows = []
    for part in args.parts.split(","):
        for shape in args.shapes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                for row in PARTS[part](shape, batch, args.sweep):
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
