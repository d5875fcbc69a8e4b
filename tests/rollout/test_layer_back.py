"""The decode layer back (klppo/models/llama_layers.py ``attn_out_mlp``): its first residual written so that
Inductor does not fold it into cuBLAS ``addmm`` with the residual as C (a device copy a layer on CUDA).
The same values as ``x + linear`` in eager (bf16, fp16: float32 add, one rounding); on a GPU, the compiled
back calls ``addmm`` once (the down projection), not twice."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from klppo.models.llama_layers import attn_out_mlp, mlp, rms_norm


class _Layer:
    def __init__(self, hidden: int, inner: int, device: str, dtype: torch.dtype) -> None:
        g = torch.Generator(device="cpu").manual_seed(0)

        def rand(*shape):
            return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(device, dtype)

        self.o, self.o_bias = rand(hidden, hidden), None
        self.gate_up, self.gate_up_bias = rand(2 * inner, hidden), None
        self.down, self.down_bias = rand(hidden, inner), None
        self.post_norm = 1 + 0.1 * rand(hidden)


def _unfolded(x, attn, lw, eps):
    x = x + F.linear(attn, lw.o, lw.o_bias)
    return x + mlp(lw, rms_norm(x, lw.post_norm, eps))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_eager_back_equals_the_plain_residual_add(dtype):
    lw = _Layer(64, 96, "cpu", dtype)
    x, attn = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    assert torch.equal(attn_out_mlp(x, attn, lw, 1e-6), _unfolded(x, attn, lw, 1e-6))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_back_folds_one_residual_into_addmm():
    from torch._inductor.utils import run_and_get_code

    lw = _Layer(896, 4864, "cuda", torch.bfloat16)
    x = torch.randn(256, 896, device="cuda", dtype=torch.bfloat16)
    attn = torch.randn(256, 896, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.reset()
    out, (code, *_) = run_and_get_code(torch.compile(attn_out_mlp), x, attn, lw, 1e-6)
    _, (old_code, *_) = run_and_get_code(torch.compile(_unfolded), x, attn, lw, 1e-6)
    assert old_code.count("extern_kernels.addmm(") == 2  # the fold this avoids (else the test proves nothing)
    assert code.count("extern_kernels.addmm(") == 1
    torch.testing.assert_close(out, _unfolded(x, attn, lw, 1e-6), atol=0.06, rtol=0.02)
