"""bench/decode_kernels.py's gate/up GEMM fused with SiLU·mul: the torch reference against float64 (CPU); the
Triton kernel against float64 and the reference in Triton's CPU interpreter (fp32 and fp16: the interpreter's
``tl.dot`` mishandles bf16) and on CUDA (fp32, bf16, fp16); the tile choice and the sweep's grid (CPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.decode_kernels import (
    Tiles,
    choose_gate_up_tiles,
    gate_up_sweep,
    silu_mul_gate_up_reference,
    ulps,
)
from tests.rollout.conftest import HAS_TRITON, run_triton_interpreted

# (M, I, H, tiles): M, I and H ragged against the tiles (one row tile short, the reduction's tail masked),
# a batch of three row tiles with five rows in the last, an exact fit (no mask on the reduction), a longer
# reduction of 16-wide blocks, and a row tile wider than the batch
CASES = [
    (5, 40, 48, Tiles(16, 32, 32, 1)),
    (37, 70, 100, Tiles(16, 32, 32, 1)),
    (64, 64, 64, Tiles(32, 32, 64, 1)),
    (19, 24, 200, Tiles(16, 16, 16, 1)),
    (3, 72, 40, Tiles(32, 64, 16, 1)),
]


def _inputs(case, dtype, bias: bool, device="cpu", seed=0, grid=False):
    """``h`` [M, H], ``gate_up_weight`` [2I, H], ``bias`` [2I] or None. ``grid``: values on a coarse dyadic
    grid (h in k/8, the weight in k/64, the bias in k/16, |k| ≤ 8 or 16), exact in fp16 and bf16 with every
    product and partial sum exact in float32, so ``g`` and ``u`` come out the same in any summation order."""
    m, inner, hidden, _ = case
    g = torch.Generator().manual_seed(seed)
    if grid:
        h = torch.randint(-8, 9, (m, hidden), generator=g) / 8
        w = torch.randint(-8, 9, (2 * inner, hidden), generator=g) / 64
        b = torch.randint(-16, 17, (2 * inner,), generator=g) / 16
    else:
        h = torch.randn(m, hidden, generator=g)
        w = torch.randn(2 * inner, hidden, generator=g) / hidden**0.5
        b = torch.randn(2 * inner, generator=g)
    return h.to(device, dtype), w.to(device, dtype), b.to(device, dtype) if bias else None


def naive(h, w, bias):
    """float64: ``silu(h W_gateᵀ + b_gate) · (h W_upᵀ + b_up)``, the gate the first half of ``w``'s rows."""
    inner = w.shape[0] // 2
    g = h.double() @ w[:inner].double().t()
    u = h.double() @ w[inner:].double().t()
    if bias is not None:
        g, u = g + bias[:inner].double(), u + bias[inner:].double()
    return g / (1 + torch.exp(-g)) * u


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_reference_equals_float64(case, bias) -> None:
    h, w, b = _inputs(case, torch.float32, bias)
    torch.testing.assert_close(
        silu_mul_gate_up_reference(h, w, b).double(), naive(h, w, b), rtol=1e-5, atol=1e-5
    )
    h, w, b = _inputs(case, torch.float16, bias)  # float32 math, rounded once
    g, u = F.linear(h.float(), w.float(), None if b is None else b.float()).chunk(2, dim=-1)
    assert torch.equal(silu_mul_gate_up_reference(h, w, b), (F.silu(g) * u).half())


def test_ulps_counts_the_spacing_at_the_reference() -> None:
    one = torch.ones(3, dtype=torch.bfloat16)
    assert ulps(one + torch.tensor([0.0, 2**-7, -(2**-8)]), one) == 1.0  # spacing 2⁻⁷ at 1 (bf16)
    assert ulps(torch.tensor([2**-24]), torch.zeros(1, dtype=torch.float16)) == 1.0  # fp16's smallest step


def test_default_tiles_fill_the_device_at_the_bench_shapes() -> None:
    assert choose_gate_up_tiles(256, 4864, 132) == Tiles(64, 128, 64, 1)  # 4 × 38 = 152 programs
    assert choose_gate_up_tiles(64, 4864, 132) == Tiles(64, 32, 64, 1)  # 1 × 152
    assert choose_gate_up_tiles(256, 8960, 132) == Tiles(64, 128, 64, 1)  # 4 × 70
    assert choose_gate_up_tiles(5, 40, 132) == Tiles(16, 32, 64, 1)


def test_sweep_grid_fits_shared_memory_and_stays_small() -> None:
    smem = 232448  # H100/H200: 227 KiB a block
    grids = {rows: gate_up_sweep(rows, smem) for rows in (64, 256)}
    assert [len(grid) for grid in grids.values()] == [101, 116]
    assert len(set(grids[64]) | set(grids[256])) == 142  # what one process compiles for both batches
    for rows, grid in grids.items():
        assert all(t.num_stages * (t.block_m + 2 * t.block_n) * t.block_k * 2 <= smem for t in grid)
        assert all(2 * t.block_m * t.block_n <= 128 * 32 * t.num_warps for t in grid)  # accumulator registers
        assert {t.block_m for t in grid} == ({16, 32, 64} if rows == 64 else {32, 64, 128})


def check_kernel(device: str, dtypes) -> None:
    """The kernel on every case, with and without bias: float32 within 1e-5 of float64 (relative to the O(1)
    scale of ``g`` and ``u``; IEEE float32 products on CUDA, not TF32); 16-bit outputs, from grid inputs
    (exact ``g`` and ``u``), within one ulp of the reference and of float64 rounded once."""
    from bench.decode_kernels import silu_mul_gate_up_triton  # needs triton (skipped without)

    for case in CASES:
        for dtype in dtypes:
            for bias in (False, True):
                msg = f"{case} {dtype} bias={bias}"
                if dtype == torch.float32:
                    h, w, b = _inputs(case, dtype, bias, device)
                    out = silu_mul_gate_up_triton(h, w, b, tiles=case[-1])
                    want = naive(h, w, b)
                    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5, msg=msg)
                else:
                    h, w, b = _inputs(case, dtype, bias, device, grid=True)
                    out = silu_mul_gate_up_triton(h, w, b, tiles=case[-1])
                    assert out.dtype == dtype and out.shape == (case[0], case[1]), msg
                    assert ulps(out, silu_mul_gate_up_reference(h, w, b)) <= 1, msg
                    assert ulps(out, naive(h, w, b).to(dtype)) <= 1, msg
    if device == "cuda":  # the default tiles of this GPU, at the 0.5B shape, batch 256
        h, w, _ = _inputs((256, 4864, 896, None), torch.bfloat16, False, device, grid=True)
        assert ulps(silu_mul_gate_up_triton(h, w), silu_mul_gate_up_reference(h, w)) <= 1


CHILD = """
import torch
from tests.bench.test_decode_kernels import check_kernel
check_kernel("cpu", [torch.float16, torch.float32])
print("OK")
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package (its CPU interpreter)")
def test_kernel_in_the_interpreter() -> None:
    run_triton_interpreted(CHILD, timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_kernel_on_gpu() -> None:
    check_kernel("cuda", [torch.float32, torch.bfloat16, torch.float16])
