"""The split decode layers on two Triton kernels (:mod:`klppo.rollout.triton_layers`): the arithmetic against
float64 with eager's roundings (CPU, the torch path); the kernels against eager torch in Triton's CPU
interpreter (fp32 and fp16: its bf16 casts are wrong) and on CUDA (bf16, fp16, fp32); the layer functions
against the eager split layers written from :mod:`klppo.models.llama_layers`' parts."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from klppo.models import llama_layers, llama_weights
from klppo.models.tiny import build_tiny_model
from klppo.rollout import triton_layers
from tests.rollout.conftest import HAS_TRITON, run_triton_interpreted

# rows (0: nothing launched; 1; a few; more than a warp's worth), hidden (a power of two, not one, Qwen
# 0.5B's)
SHAPES = [(0, 64), (1, 100), (3, 64), (37, 896), (5, 1536)]
ULP = {torch.float32: 2.0**-23, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _rows(rows, hidden, dtype, device, seed, scale=1.0, row_stride=0):
    """[rows, hidden] of ``dtype``; ``row_stride`` > hidden: a column slice of a wider tensor (rows not
    adjacent)."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, max(hidden, row_stride), generator=g) * scale
    return wide.to(device, dtype)[:, :hidden]


def _eager_front(x, m, lw, spec):
    """The split layers' front in eager torch: residual add, RMSNorm, q/k/v (unrotated)."""
    if m is not None:
        x = llama_layers.residual_add(x, m)
    return x, llama_layers.qkv_projection(llama_layers.rms_norm(x, lw.input_norm, spec[3]), lw, spec)


def _eager_back(x, attn, lw, eps):
    """The split layers' back in eager torch: (x + o(attn), the MLP of its norm)."""
    x = llama_layers.residual_add(x, F.linear(attn, lw.o, lw.o_bias))
    return x, llama_layers.mlp(lw, llama_layers.rms_norm(x, lw.post_norm, eps))


def _eager_final(x, m, weight_eps):
    weight, eps = weight_eps
    return llama_layers.rms_norm(x if m is None else llama_layers.residual_add(x, m), weight, eps)


def _rounded(t64, dtype):
    return t64.to(dtype).double()


def test_torch_path_equals_float64_with_eager_roundings() -> None:
    """``add_rms_norm`` / ``silu_mul`` off the kernels: the sum rounded once, the norm in float32 rounded
    before the weight, the product rounded — against the same steps in float64 (a float32 mean differs
    from float64's in its last bits, so a rounding may land one unit away: ≤ 1 ulp, rarely)."""
    for (rows, hidden), dtype in itertools.product(SHAPES[1:], (torch.float32, torch.bfloat16)):
        x, m = _rows(rows, hidden, dtype, "cpu", 0), _rows(rows, hidden, dtype, "cpu", 1)
        w = (1 + 0.3 * torch.randn(hidden, generator=torch.Generator().manual_seed(2))).to(dtype)
        s, h = triton_layers.add_rms_norm(x, m, w, 1e-6)
        s64 = _rounded(x.double() + m.double(), dtype)
        normed = _rounded(s64 / torch.sqrt((s64**2).mean(-1, keepdim=True) + 1e-6), dtype)
        h64 = _rounded(w.double() * normed, dtype)
        assert torch.equal(s.double(), s64)
        # float32: each step rounds (mean, rsqrt, products: a few ulp); bf16: one rounding, rarely moved
        torch.testing.assert_close(h.double(), h64, rtol=8 * ULP[dtype], atol=0)
        if dtype == torch.bfloat16:
            assert (h.double() != h64).float().mean() < 0.02
        gu = _rows(rows, 2 * hidden, dtype, "cpu", 3, scale=3.0)
        g64, u64 = gu.double().chunk(2, dim=-1)
        want = _rounded(_rounded(g64 / (1 + torch.exp(-g64)), dtype) * u64, dtype)
        torch.testing.assert_close(triton_layers.silu_mul(gu).double(), want, rtol=8 * ULP[dtype], atol=0)


def check_kernels(device: str, dtypes) -> None:
    """The kernels (they run: CUDA, or CPU under the interpreter) against eager torch on every shape, with
    and without ``m``, rows adjacent and not; a weight of another dtype takes the torch path."""
    assert triton_layers._kernels_take(torch.zeros(2, 8, device=device))
    for (rows, hidden), dtype, stride in itertools.product(SHAPES, dtypes, (0, 2000)):
        msg = f"{rows}x{hidden} {dtype} row stride {stride}"
        x, m = _rows(rows, hidden, dtype, device, 0, row_stride=stride), _rows(rows, hidden, dtype, device, 1)
        w = (1 + 0.3 * torch.randn(hidden, generator=torch.Generator().manual_seed(2))).to(device, dtype)
        s, h = triton_layers.add_rms_norm(x, m, w, 1e-6)
        want_s = llama_layers.residual_add(x, m)
        assert torch.equal(s, want_s), msg
        want_h = llama_layers.rms_norm(want_s, w, 1e-6)
        torch.testing.assert_close(h.float(), want_h.float(), rtol=8 * ULP[dtype], atol=0, msg=msg)
        if rows and dtype != torch.float32:
            assert (h != want_h).float().mean() < 0.02, msg  # a rounding tie moved by the sum's order, rarely
        s, h = triton_layers.add_rms_norm(x, None, w, 1e-6)
        assert s is x
        torch.testing.assert_close(
            h.float(), llama_layers.rms_norm(x, w, 1e-6).float(), rtol=8 * ULP[dtype], atol=0
        )
        gu = _rows(rows, 2 * hidden + 6, dtype, device, 3, scale=3.0, row_stride=stride)
        gate, up = gu.chunk(2, dim=-1)
        out = triton_layers.silu_mul(gu)
        want = F.silu(gate) * up
        torch.testing.assert_close(out.float(), want.float(), rtol=8 * ULP[dtype], atol=0, msg=msg)
        if rows and dtype != torch.float32:  # the exponential's last bits move a rounding, rarely
            assert (out != want).float().mean() < 0.02, msg
    for dtype in dtypes:
        if dtype == torch.float32:
            continue
        x = torch.randn(3, 64, device=device).to(dtype)
        w32 = torch.rand(64, device=device)
        # another dtype's weight: eager's promotion (a float32 result), on the torch path
        assert not triton_layers._kernels_take(x, None, w32)
        h = triton_layers.add_rms_norm(x, None, w32, 1e-6)[1]
        assert h.dtype == torch.float32
        torch.testing.assert_close(h, llama_layers.rms_norm(x, w32, 1e-6))


def check_layers(device: str, dtype: torch.dtype) -> None:
    """The three split layer functions against :mod:`klppo.models.llama_layers`', on a Qwen2 layer (fused and
    unfused projections) and a Qwen3 one (per-head q/k norms: eager inside)."""
    spec_of = lambda model: (  # noqa: E731
        model.config.num_attention_heads,
        model.config.num_key_value_heads,
        model.config.hidden_size // model.config.num_attention_heads,
        model.config.rms_norm_eps,
    )
    tol = dict(rtol=4 * ULP[dtype], atol=4 * ULP[dtype])
    for arch, fuse in (("qwen2", True), ("qwen2", False), ("qwen3", True)):
        model = build_tiny_model(arch=arch).to(device, dtype)
        lw = llama_weights.LayerWeights.read(model.model.layers[0])
        lw = lw.fused() if fuse else lw
        spec, hidden = spec_of(model), model.config.hidden_size
        x, m = _rows(4, hidden, dtype, device, 5), _rows(4, hidden, dtype, device, 6)
        for mm in (None, m):
            got, want = triton_layers.attn_in_qkv(x, mm, lw, spec), _eager_front(x, mm, lw, spec)
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a.float(), b.float(), **tol, msg=f"{arch} fuse={fuse}")
        attn = _rows(4, spec[0] * spec[2], dtype, device, 7)
        got = triton_layers.attn_out_mlp_split(x, attn, lw, spec[3])
        want = _eager_back(x, attn, lw, spec[3])
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a.float(), b.float(), **tol, msg=f"{arch} fuse={fuse}")
        w = (model.model.norm.weight.detach(), spec[3])
        torch.testing.assert_close(
            triton_layers.final_norm(x, m, w).float(), _eager_final(x, m, w).float(), **tol
        )


def test_layer_functions_on_the_torch_path_equal_eager() -> None:
    check_layers("cpu", torch.float32)


CHILD = """
import torch
from tests.rollout.test_triton_layers import check_kernels, check_layers
check_kernels("cpu", [torch.float32, torch.float16])
check_layers("cpu", torch.float32)
check_layers("cpu", torch.float16)
print("OK")
"""


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package (its CPU interpreter)")
def test_kernels_in_the_interpreter() -> None:
    run_triton_interpreted(CHILD, timeout=600)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON), reason="needs CUDA and triton")
def test_kernels_on_gpu() -> None:
    check_kernels("cuda", [torch.bfloat16, torch.float16, torch.float32])
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        check_layers("cuda", dtype)


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_which_widths_launch_the_kernels(monkeypatch) -> None:
    """The SwiGLU kernel takes any width (blocks of columns; the 1.5B shape's [gate | up] is 17,920 wide),
    the norm up to ``MAX_HIDDEN`` (a
    row in registers), wider rows the torch path. Launches recorded, nothing run."""
    launched = []

    class Kernel:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((self.name, grid))

    monkeypatch.setattr(triton_layers, "_INTERPRETED", True)  # CPU tensors count as the kernels' own
    monkeypatch.setattr(triton_layers, "_silu_mul_kernel", Kernel("silu"))
    monkeypatch.setattr(triton_layers, "_add_rms_norm_kernel", Kernel("norm"))
    triton_layers.silu_mul(torch.zeros(2, 2 * 8960, dtype=torch.bfloat16))
    assert launched == [("silu", (2, 9))]
    width = triton_layers.MAX_HIDDEN
    triton_layers.add_rms_norm(torch.zeros(2, width), None, torch.ones(width), 1e-6)
    assert launched[-1] == ("norm", (2,))
    triton_layers.add_rms_norm(torch.ones(2, width + 1), None, torch.ones(width + 1), 1e-6)  # torch path
    assert len(launched) == 2


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_launch_settings_reach_the_launch(monkeypatch) -> None:
    """``silu_mul(block=, num_warps=)`` and ``add_rms_norm(num_warps=)`` launch with the settings given (the
    micro-benchmarks sweep them). Launches recorded, nothing run."""
    launched = []

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append((grid, kwargs))

    monkeypatch.setattr(triton_layers, "_INTERPRETED", True)
    monkeypatch.setattr(triton_layers, "_silu_mul_kernel", Kernel())
    monkeypatch.setattr(triton_layers, "_add_rms_norm_kernel", Kernel())
    triton_layers.silu_mul(torch.zeros(2, 2 * 1000), block=256, num_warps=2)
    grid, kwargs = launched[-1]
    assert grid == (2, 4) and kwargs["BLOCK"] == 256 and kwargs["num_warps"] == 2
    triton_layers.silu_mul(torch.zeros(2, 2 * 1000))
    grid, kwargs = launched[-1]
    assert grid == (2, 1) and kwargs["BLOCK"] == triton_layers.SILU_BLOCK and kwargs["num_warps"] == 4
    triton_layers.add_rms_norm(torch.zeros(2, 64), None, torch.ones(64), 1e-6, num_warps=1)
    assert launched[-1][1]["num_warps"] == 1


def test_silu_mul_takes_what_eager_takes() -> None:
    """Any leading shape gives eager's result (the kernel takes 2-D rows only); an odd width fails as eager
    does."""
    gu = torch.randn(2, 3, 8)
    gate, up = gu.chunk(2, dim=-1)
    torch.testing.assert_close(triton_layers.silu_mul(gu), F.silu(gate) * up, rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        triton_layers.silu_mul(torch.randn(2, 7))


@pytest.mark.skipif(not HAS_TRITON, reason="needs the triton package")
def test_what_the_kernels_cannot_index_goes_to_eager(monkeypatch) -> None:
    """An ``m`` of another shape (broadcast) and a last dim that is not contiguous are not launched: eager
    computes them (its broadcast and strides), equal to ``llama``'s functions. Launches recorded."""
    launched = []
    monkeypatch.setattr(triton_layers, "_INTERPRETED", True)
    monkeypatch.setattr(
        triton_layers, "_add_rms_norm_kernel", type("K", (), {"__getitem__": lambda s, g: launched.append})
    )
    x, w = torch.randn(3, 8), torch.rand(8)
    m = torch.randn(1, 8)
    s, h = triton_layers.add_rms_norm(x, m, w, 1e-6)
    torch.testing.assert_close(s, llama_layers.residual_add(x, m))
    torch.testing.assert_close(h, llama_layers.rms_norm(llama_layers.residual_add(x, m), w, 1e-6))
    xt = torch.randn(8, 3).t()  # [3, 8], last dim strided
    torch.testing.assert_close(
        triton_layers.add_rms_norm(xt, None, w, 1e-6)[1], llama_layers.rms_norm(xt, w, 1e-6)
    )
    assert launched == []
