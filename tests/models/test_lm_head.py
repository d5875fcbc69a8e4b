"""Float32 logits from a bf16 LM head: values, gradients, and the model surgery."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from klppo.models.lm_head import FP32LogitsLinear, fp32_lm_head, fp32_logits_linear
from klppo.models.tiny import build_tiny_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_values_and_gradients_against_float64(device) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 2).to(device, torch.bfloat16).requires_grad_()
    w = torch.randn(97, 64, generator=g).to(device, torch.bfloat16).requires_grad_()
    out = fp32_logits_linear(x, w)
    exact = x.detach().double() @ w.detach().double().t()
    assert out.dtype == torch.float32 and out.shape == (3, 5, 97)
    # float32 result of the bf16 operands: relative error ~1e-6, where a bf16 result is ~4e-3
    assert ((out.double() - exact).abs() / exact.abs().clamp(min=1)).max() < 1e-5
    bf16 = F.linear(x.detach(), w.detach()).double()
    assert ((bf16 - exact).abs() / exact.abs().clamp(min=1)).max() > 1e-4  # the rounding it removes
    upstream = torch.randn(3, 5, 97, generator=g).to(device)
    out.backward(upstream)
    g64 = upstream.double()
    ref_x = g64 @ w.detach().double()
    ref_w = g64.reshape(-1, 97).t() @ x.detach().double().reshape(-1, 64)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), ref_x, atol=0.05, rtol=0.02)
    torch.testing.assert_close(w.grad.double(), ref_w, atol=0.05, rtol=0.02)


def test_model_surgery_keeps_parameters_and_improves_log_probs() -> None:
    model = build_tiny_model(arch="qwen2").eval()  # tied embeddings
    plain = build_tiny_model(arch="qwen2").eval()
    plain.load_state_dict(model.state_dict())
    for m in (model, plain):
        m.to(torch.bfloat16)
    keys = list(model.state_dict())
    assert fp32_lm_head(model)
    assert isinstance(model.lm_head, FP32LogitsLinear) and list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tying kept
    exact = build_tiny_model(arch="qwen2").eval()
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    exact.double()
    ids = torch.randint(3, 200, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        base = plain(input_ids=ids).logits
        truth = torch.log_softmax(exact(input_ids=ids).logits, -1)
    assert ours.dtype == torch.float32 and base.dtype == torch.bfloat16
    err_ours = (torch.log_softmax(ours.double(), -1) - truth).abs().mean()
    err_base = (torch.log_softmax(base.double(), -1) - truth).abs().mean()
    assert err_ours < err_base
    # float32 models and heads with a bias are left alone
    fp32 = build_tiny_model(arch="llama").eval()
    assert fp32_lm_head(fp32) and fp32(input_ids=ids).logits.dtype == torch.float32
    biased = torch.nn.Module()
    biased.get_output_embeddings = lambda: torch.nn.Linear(4, 4)
    assert not fp32_lm_head(biased)
