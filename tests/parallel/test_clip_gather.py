"""clip_grad_norm_ and gathered_params on a model without FSDP (no process group needed)."""

from __future__ import annotations

import torch
from torch import nn

from klppo.parallel.fsdp import clip_grad_norm_, gathered_params


def _model_with_grads() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3, bias=False))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def test_clip_grad_norm_matches_float64_reference():
    model = _model_with_grads()
    grads = [p.grad.double().clone() for p in model.parameters()]
    want = torch.sqrt(sum((g**2).sum() for g in grads))
    norm = clip_grad_norm_(model, max_norm=1.0)
    assert abs(norm.item() - want.item()) < 1e-5 * want.item()
    scale = 1.0 / (want.item() + 1e-6)
    assert want.item() > 1.0
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad.double(), g * scale, rtol=1e-5, atol=1e-7)


def test_clip_below_max_leaves_grads():
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm_(model, max_norm=1e6)
    assert norm.item() > 0
    for p, g in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, g)


def test_clip_reports_non_finite_norm():
    model = _model_with_grads()
    next(model.parameters()).grad[0, 0] = float("nan")
    assert not torch.isfinite(clip_grad_norm_(model, 1.0))


def test_gathered_params_is_noop_without_fsdp():
    model = _model_with_grads()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with gathered_params(model) as m:
        assert m is model
        out = model(torch.ones(2, 5))
    assert out.shape == (2, 3)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
