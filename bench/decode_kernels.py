"""The decode step's kernels alone (issue 19): the MLP tail and the split-KV attention, graph-replayed.

    PYTHONPATH=$PWD python3 bench/decode_kernels.py [--parts mlp,attention] [--shapes 0.5b,1.5b]
        [--batches 64,256] [--sweep] [--out kernels.json]

``mlp``: ``residual + down(silu(gate) * up)`` from the fused ``[gate; up]`` output, per layer, as the
engine's compiled layer back computes it (Inductor: a pointwise activation kernel, cuBLAS's GEMM with
the residual) against a Triton kernel written here (session 21; not adopted: slower than Inductor + cuBLAS
at every shape, bench/RESULTS.md) that computes the activation where its split-K GEMM loads ``gate_up``
(no [M, I] intermediate) and sums the float32 partials with the residual in a second, deterministic
kernel, with its chosen tiles, and with ``--sweep`` every tile configuration of a grid (the best five
printed). ``attention``: :func:`klppo.rollout.triton_attention.decode_attention_triton` at the engine's
configuration and, with ``--sweep``, over splits × ``BLOCK_N`` × warps × stages. Context: each slot at a
random position in [256, 512) (the bench's prompt 256 + 256 new tokens). Times: microseconds per call,
``triton.testing.do_bench_cudagraph`` (a CUDA graph of the call replayed: kernel time and launch gaps as
inside the engine's graph). The floor: the bytes read and written once at 4.8 TB/s (H200).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

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
        gate_up, down, residual, bias if has_bias else residual, out, part, rows, cols, inner, per,
        SPLITS=splits, HAS_BIAS=has_bias, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_kernel[(triton.cdiv(rows * cols, block),)](
            part, residual, bias if has_bias else residual, out, rows * cols, cols,
            SPLITS=splits, HAS_BIAS=has_bias, BLOCK=block,
        )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _down_kernel(gu_ptr, w_ptr, res_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, PER, SPLITS: tl.constexpr,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
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
    def _sum_kernel(part_ptr, res_ptr, bias_ptr, out_ptr, MN, N, SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    BLOCK: tl.constexpr):  # fmt: skip
        """``out = residual + Σ_s part[s] (+ bias)``, the splits summed in order (deterministic)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        y = tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        for s in tl.static_range(SPLITS):
            y += tl.load(part_ptr + s * MN + offs, mask=mask, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def timed(fn) -> float:
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3  # µs


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
    rows = [dict(base, impl="inductor (engine today)", us=round(timed(lambda: compiled(gu, w, res)), 2)),
            dict(base, impl="eager torch", us=round(timed(lambda: tail(gu, w, res)), 2)),
            dict(base, impl=f"triton {choose_tiles(batch, hidden, inner, sms)}",
                 us=round(timed(lambda: silu_mul_down_triton(gu, w, res)), 2))]  # fmt: skip
    if sweep:
        found = []
        for bm, bn, bk, sp, ns in itertools.product((16, 32, 64), (64, 128), (64, 128), (1, 2, 4, 8), (3, 4)):
            tiles = Tiles(bm, bn, bk, sp, 4, ns)
            try:
                found.append((timed(lambda t=tiles: silu_mul_down_triton(gu, w, res, tiles=t)), tiles))
            except Exception as e:  # noqa: BLE001  a configuration out of resources is skipped
                print(f"skip {tiles}: {type(e).__name__}", file=sys.stderr)
        for us, tiles in sorted(found, key=lambda f: f[0])[:5]:
            rows.append(dict(base, impl=f"triton sweep {tiles}", us=round(us, 2)))
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
    rows = [dict(base, impl=f"engine (splits {splits}, BLOCK_N {ta.BLOCK_N}, 4 warps)",
                 us=round(timed(lambda: ta.decode_attention_triton(q, kv_new, cache, pos, splits=splits)), 2))]  # fmt: skip
    if sweep:
        found = []
        for sp, bn, nw, ns in itertools.product((1, 2, 4), (32, 64, 128), (4, 8), (2, 3)):
            kw = dict(splits=sp, block_n=bn, num_warps=nw, num_stages=ns)
            try:
                found.append(
                    (timed(lambda kw=kw: ta.decode_attention_triton(q, kv_new, cache, pos, **kw)), kw)
                )
            except Exception as e:  # noqa: BLE001  a configuration out of resources is skipped
                print(f"skip {kw}: {type(e).__name__}", file=sys.stderr)
        for us, kw in sorted(found, key=lambda f: f[0])[:5]:
            rows.append(dict(base, impl=f"sweep {kw}", us=round(us, 2)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="mlp,attention")
    ap.add_argument("--shapes", default="0.5b,1.5b")
    ap.add_argument("--batches", default="64,256")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for part in args.parts.split(","):
        for shape in args.shapes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                fn = mlp_rows if part == "mlp" else attention_rows
                for row in fn(shape, batch, args.sweep):
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1
            )


if __name__ == "__main__":
    main()
