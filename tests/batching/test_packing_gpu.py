"""Packed attention backends on CUDA: packed vs padded forward and backward agree (run on the device)."""

from __future__ import annotations

import pytest
import torch

from klppo.batching.attention import enable_packed_attention, set_packed_attention_backend
from klppo.batching.packing import forward_log_probs
from klppo.models.tiny import build_tiny_model
from tests.batching.reference import make_ragged_batch

pytestmark = pytest.mark.gpu

PROMPT_LENS = [40, 3, 17, 64, 1, 25]
RESPONSE_LENS = [100, 7, 64, 1, 33, 128]
P, R = 64, 128
# bf16: one rounding of every activation → compare loosely; fp32 backends tightly.
TOL = {torch.bfloat16: (3e-2, 2e-2), torch.float32: (2e-4, 1e-4)}


@pytest.fixture(autouse=True)
def _reset_backend():
    yield
    set_packed_attention_backend(None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "backend,dtype",
    [("torch_varlen", torch.bfloat16), ("flex", torch.bfloat16), ("flex", torch.float32),
     ("sdpa_block", torch.float32), (None, torch.bfloat16)],
)  # fmt: skip
def test_cuda_packed_matches_padded(backend, dtype):
    if backend == "torch_varlen":
        pytest.importorskip("torch.nn.attention.varlen")
    set_packed_attention_backend(backend)
    ids, mask, pos = (t.cuda() for t in make_ragged_batch(PROMPT_LENS, RESPONSE_LENS, P, R, seed=5))
    model = build_tiny_model(seed=1, hidden_size=128, num_heads=4, num_kv_heads=2, dtype=dtype).cuda()
    enable_packed_attention(model)
    weights = torch.randn(
        len(PROMPT_LENS), R, device="cuda", generator=torch.Generator("cuda").manual_seed(0)
    )
    results = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        lp, ent = forward_log_probs(
            model, ids, mask, pos, response_length=R, use_remove_padding=packed, calculate_entropy=True
        )
        ((lp * weights).sum() + (ent * weights).sum()).backward()
        grads = torch.cat([p.grad.float().reshape(-1) for p in model.parameters()])
        results[packed] = (lp.detach(), ent.detach(), grads)
    fwd_tol, grad_tol = TOL[dtype]
    for i in (0, 1):
        torch.testing.assert_close(results[True][i], results[False][i], rtol=0, atol=fwd_tol)
    g_pad, g_pack = results[False][2], results[True][2]
    rel = (g_pack - g_pad).norm() / g_pad.norm()
    assert rel < grad_tol, f"relative gradient difference {rel:.2e}"
