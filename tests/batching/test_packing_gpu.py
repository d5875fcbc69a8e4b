"""Packed attention backends on CUDA vs an unpadded per-sequence reference (run on the device).

The reference runs each sequence alone (batch of one, no padding, so no masking at all) and accumulates
the gradients; the packed and the padded paths must both reproduce it. bf16 compares loosely (every
activation is rounded; batched kernels sum in another order), fp32 tightly.
"""

from __future__ import annotations

import pytest
import torch

from klppo.batching.attention import enable_packed_attention, set_packed_attention_backend
from klppo.batching.packing import forward_log_probs
from klppo.models.tiny import build_tiny_model
from tests.batching.reference import make_ragged_batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT_LENS = [40, 3, 17, 64, 1, 25]
RESPONSE_LENS = [100, 7, 64, 1, 33, 128]
P, R = 64, 128
TOL = {torch.bfloat16: (5e-2, 3e-2), torch.float32: (2e-4, 1e-4)}  # (forward atol, relative grad norm)


@pytest.fixture(autouse=True)
def _reset_backend():
    yield
    set_packed_attention_backend(None)


def _run(model, ids, mask, pos, weights, *, packed):
    model.zero_grad(set_to_none=True)
    lp, ent = forward_log_probs(
        model, ids, mask, pos, response_length=R, use_remove_padding=packed, calculate_entropy=True
    )
    ((lp * weights).sum() + (ent * weights).sum()).backward()
    return lp.detach(), ent.detach(), torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])


def _reference(model, ids, mask, weights):
    model.zero_grad(set_to_none=True)
    lp_all = torch.zeros(ids.shape[0], R, device=ids.device)
    ent_all = torch.zeros_like(lp_all)
    for b, r in enumerate(RESPONSE_LENS):
        seq = ids[b][mask[b].bool()].unsqueeze(0)
        ones = torch.ones_like(seq)
        lp, ent = forward_log_probs(
            model, seq, ones, None, response_length=r, use_remove_padding=False, calculate_entropy=True
        )
        ((lp[0] * weights[b, :r]).sum() + (ent[0] * weights[b, :r]).sum()).backward()
        lp_all[b, :r], ent_all[b, :r] = lp[0].detach(), ent[0].detach()
    return lp_all, ent_all, torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "backend,dtype",
    [
        ("torch_varlen", torch.bfloat16),
        ("flex", torch.bfloat16),
        ("flex", torch.float32),
        ("sdpa_block", torch.float32),
        ("sdpa_block", torch.bfloat16),
        ("padded", torch.bfloat16),
        ("padded", torch.float32),
    ],
)
def test_cuda_packed_and_padded_match_unpadded_reference(backend, dtype):
    if backend == "torch_varlen":
        pytest.importorskip("torch.nn.attention.varlen")
    if backend != "padded":
        set_packed_attention_backend(backend)
    ids, mask, pos = (t.cuda() for t in make_ragged_batch(PROMPT_LENS, RESPONSE_LENS, P, R, seed=5))
    model = build_tiny_model(seed=1, hidden_size=128, num_heads=4, num_kv_heads=2, dtype=dtype).cuda()
    enable_packed_attention(model)
    weights = torch.randn(
        len(PROMPT_LENS), R, device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    ref = _reference(model, ids, mask, weights)
    got = _run(model, ids, mask, pos, weights, packed=backend != "padded")
    fwd_tol, grad_tol = TOL[dtype]
    assert torch.isfinite(got[2]).all(), "non-finite gradient"
    rel = ((got[2] - ref[2]).norm() / ref[2].norm()).item()
    err = [(got[i] - ref[i]).abs().max().item() for i in (0, 1)]
    print(
        f"{backend} {dtype}: max |Δ log-prob| {err[0]:.2e}, max |Δ entropy| {err[1]:.2e}, rel Δ grad "
        f"{rel:.2e}"
    )
    assert max(err) <= fwd_tol and rel < grad_tol
