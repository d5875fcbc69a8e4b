"""Packed vs padded forward/backward on the tiny model, and dynamic vs fixed micro-batch gradients.

Tolerances (fp32 CPU): forward outputs atol 2e-5, gradients rtol 1e-4 / atol 1e-6 — the two paths run the
same math in a different order of float additions (other rows, other matmul shapes).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from klppo.algorithms.losses import agg_loss
from klppo.batching.attention import enable_packed_attention
from klppo.batching.dynamic import (
    LOSS_AGG_MODES,
    fixed_micro_batches,
    micro_batch_loss_weight,
    partition_by_token_budget,
)
from klppo.batching.packing import forward_log_probs, forward_values, pack, unpack
from klppo.models.tiny import build_tiny_model
from tests.batching.reference import agg_loss_reference, make_ragged_batch

PROMPT_LENS = [9, 3, 1, 6, 9, 4, 2]
RESPONSE_LENS = [11, 2, 7, 1, 5, 11, 9]
P, R = 9, 11
FWD_ATOL = 2e-5


@pytest.fixture(scope="module")
def batch():
    return make_ragged_batch(PROMPT_LENS, RESPONSE_LENS, P, R, seed=1)


@pytest.fixture(scope="module")
def policy():
    model = build_tiny_model(seed=3).eval()
    enable_packed_attention(model)
    return model


@pytest.fixture(scope="module")
def critic():
    from transformers import AutoModelForTokenClassification

    config = build_tiny_model(seed=4).config
    config.num_labels = 1
    torch.manual_seed(4)
    model = AutoModelForTokenClassification.from_config(config).eval()
    enable_packed_attention(model)
    return model


def _reference_log_probs(model, ids, mask):
    """Each sequence alone, unpadded, batch of one; log-softmax in float64."""
    out = torch.zeros(ids.shape[0], R, dtype=torch.float64)
    ent = torch.zeros_like(out)
    for b in range(ids.shape[0]):
        seq = ids[b][mask[b].bool()].unsqueeze(0)
        with torch.no_grad():
            logits = model(input_ids=seq, use_cache=False).logits[0].double()
        r = RESPONSE_LENS[b]
        logp = torch.log_softmax(logits[-r - 1 : -1], dim=-1)
        out[b, :r] = logp.gather(-1, seq[0, -r:].unsqueeze(-1)).squeeze(-1)
        ent[b, :r] = -(logp.exp() * logp).sum(-1)
    return out, ent


def test_pack_unpack_roundtrip(batch):
    ids, mask, pos = batch
    packed = pack(ids, mask, pos)
    assert packed.input_ids.shape == (1, int(mask.sum()))
    assert packed.cu_seqlens.tolist() == [
        0,
        *torch.tensor(PROMPT_LENS).add(torch.tensor(RESPONSE_LENS)).cumsum(0),
    ]
    assert packed.max_seqlen == max(p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS))
    starts = packed.cu_seqlens[:-1].long()
    assert packed.position_ids[0, starts].eq(0).all()  # positions restart per sequence
    restored = unpack(packed.input_ids.unsqueeze(-1), packed).squeeze(-1)
    torch.testing.assert_close(restored, ids * mask, rtol=0, atol=0)
    torch.testing.assert_close(pack(ids, mask).position_ids, packed.position_ids, rtol=0, atol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_matches_padded_and_reference(policy, batch, temperature):
    ids, mask, pos = batch
    outs = {}
    for packed in (False, True):
        lp, ent = forward_log_probs(
            policy,
            ids,
            mask,
            pos,
            response_length=R,
            temperature=temperature,
            use_remove_padding=packed,
            calculate_entropy=True,
        )
        outs[packed] = (lp, ent)
    response_mask = mask[:, P:].bool()
    for lp, ent in outs.values():
        assert lp.shape == ent.shape == (len(PROMPT_LENS), R) and lp.dtype == torch.float32
        assert lp[~response_mask].eq(0).all() and ent[~response_mask].eq(0).all()
    torch.testing.assert_close(outs[True][0], outs[False][0], rtol=0, atol=FWD_ATOL)
    torch.testing.assert_close(outs[True][1], outs[False][1], rtol=0, atol=FWD_ATOL)
    if temperature == 1.0:
        ref_lp, ref_ent = _reference_log_probs(policy, ids, mask)
        torch.testing.assert_close(outs[True][0].double(), ref_lp, rtol=0, atol=FWD_ATOL)
        torch.testing.assert_close(outs[True][1].double(), ref_ent, rtol=0, atol=FWD_ATOL)


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("stock_sdpa", [False, True])
def test_packed_backward_matches_padded(batch, stock_sdpa):
    """Gradients of a loss on log-probs + entropy agree; also with transformers' own sdpa packing."""
    ids, mask, pos = batch
    model = build_tiny_model(seed=5)  # train mode, attention dropout 0
    if not stock_sdpa:
        enable_packed_attention(model)
    weights = torch.randn(len(PROMPT_LENS), R, generator=torch.Generator().manual_seed(0))
    grads = {}
    for packed in (False, True):
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the dense-mask advice for stock sdpa
            lp, ent = forward_log_probs(
                model, ids, mask, pos, response_length=R, use_remove_padding=packed, calculate_entropy=True
            )
        ((lp * weights).sum() + 0.3 * (ent * weights.flip(0)).sum()).backward()
        grads[packed] = _grads(model)
    assert grads[True].keys() == grads[False].keys() and len(grads[True]) > 10
    for name, g in grads[False].items():
        torch.testing.assert_close(grads[True][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_values_packed_matches_padded_forward_and_backward(critic, batch):
    ids, mask, pos = batch
    results = {}
    for packed in (False, True):
        critic.zero_grad(set_to_none=True)
        values = forward_values(critic, ids, mask, pos, response_length=R, use_remove_padding=packed)
        (values.square().sum()).backward()
        results[packed] = (values.detach(), _grads(critic))
    values, ref_grads = results[False]
    assert values.shape == (len(PROMPT_LENS), R) and values[~mask[:, P:].bool()].eq(0).all()
    torch.testing.assert_close(results[True][0], values, rtol=0, atol=FWD_ATOL)
    for name, g in ref_grads.items():
        torch.testing.assert_close(results[True][1][name], g, rtol=1e-4, atol=1e-6, msg=name)
    # Independent check of the alignment: the value of response token j is the output before it.
    b = 0
    seq = ids[b][mask[b].bool()].unsqueeze(0)
    with torch.no_grad():
        alone = critic(input_ids=seq, use_cache=False).logits[0, :, 0]
    r = RESPONSE_LENS[b]
    torch.testing.assert_close(values[b, :r], alone[-r - 1 : -1], rtol=0, atol=FWD_ATOL)


def _ppo_token_loss(log_probs, old_log_probs, advantages, clip=0.2):
    ratio = torch.exp(log_probs - old_log_probs)
    return torch.maximum(-advantages * ratio, -advantages * ratio.clamp(1 - clip, 1 + clip))


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_dynamic_and_fixed_micro_batches_give_the_mini_batch_gradient(batch, mode):
    ids, mask, pos = batch
    n = ids.shape[0]
    model = build_tiny_model(seed=6)
    enable_packed_attention(model)
    gen = torch.Generator().manual_seed(7)
    response_mask = mask[:, P:].float()
    old = -5.9 + 0.3 * torch.randn(n, R, generator=gen)
    adv = torch.randn(n, R, generator=gen)
    mini_tokens = response_mask.sum()
    mini_seqs = (response_mask.sum(-1) > 0).sum()

    def accumulate(parts, packed):
        model.zero_grad(set_to_none=True)
        for p in parts:
            idx = torch.tensor(p)
            lp, _ = forward_log_probs(
                model, ids[idx], mask[idx], pos[idx], response_length=R, use_remove_padding=packed
            )
            loss = agg_loss(_ppo_token_loss(lp, old[idx], adv[idx]), response_mask[idx], mode)
            weight = micro_batch_loss_weight(
                mode, response_mask[idx], mini_tokens, mini_seqs, R, mini_num_rows=n
            )
            (weight * loss).backward()
        return _grads(model)

    model.zero_grad(set_to_none=True)
    lp, _ = forward_log_probs(model, ids, mask, pos, response_length=R, use_remove_padding=False)
    agg_loss_reference(_ppo_token_loss(lp, old, adv), response_mask, mode).backward()
    reference = _grads(model)

    fixed = accumulate(fixed_micro_batches(n, 3), packed=False)
    seq_lens = mask.sum(1).tolist()
    with pytest.warns(UserWarning, match="longer than the token budget"):
        parts = partition_by_token_budget(seq_lens, 19)  # the longest (20 tokens) runs alone
    assert len(parts) > 2
    dynamic = accumulate(parts, packed=True)
    for name, g in reference.items():
        torch.testing.assert_close(fixed[name], g, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(dynamic[name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_trim_padding_columns_keeps_results(policy, batch):
    from klppo.batching.packing import trim_padding_columns

    ids, mask, pos = batch
    rows = torch.tensor([1, 3])  # short prompts and responses: most columns are padding
    t_ids, t_mask, t_pos, new_r = trim_padding_columns(ids[rows], mask[rows], pos[rows], R)
    assert new_r == max(RESPONSE_LENS[1], RESPONSE_LENS[3])
    assert t_ids.shape[1] == max(PROMPT_LENS[1], PROMPT_LENS[3]) + new_r
    full, _ = forward_log_probs(
        policy, ids[rows], mask[rows], pos[rows], response_length=R, use_remove_padding=False
    )
    trimmed, _ = forward_log_probs(
        policy, t_ids, t_mask, t_pos, response_length=new_r, use_remove_padding=False
    )
    torch.testing.assert_close(trimmed, full[:, :new_r], rtol=0, atol=FWD_ATOL)
    assert full[:, new_r:].eq(0).all()
