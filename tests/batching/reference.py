"""Independent references for the batching tests."""

from __future__ import annotations

import torch


def agg_loss_reference(loss: torch.Tensor, mask: torch.Tensor, mode: str) -> torch.Tensor:
    """verl core_algos.agg_loss written out; a fully masked row is a zero term of seq-mean-token-sum and no
    term of seq-mean-token-mean (verl would give NaN there).

    Computed in float64 when given float64; the dtype of ``loss`` otherwise (keeps autograd).
    """
    mask = mask.to(loss.dtype)
    token_sum = (loss * mask).sum(-1)
    has_tokens = mask.sum(-1) > 0
    if mode == "token-mean":
        return token_sum.sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return token_sum.mean()
    if mode == "seq-mean-token-mean":
        return (token_sum[has_tokens] / mask.sum(-1)[has_tokens]).mean()
    if mode == "seq-mean-token-sum-norm":
        return token_sum.sum() / mask.shape[-1]
    raise AssertionError(mode)


def make_ragged_batch(prompt_lens, response_lens, prompt_width, response_width, *, vocab=380, seed=0):
    """input_ids, attention_mask, position_ids [B, P+R]: left-padded prompts, right-padded responses."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(prompt_lens)
    ids = torch.randint(3, vocab, (batch, prompt_width + response_width), generator=gen)
    mask = torch.zeros(batch, prompt_width + response_width, dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        mask[b, prompt_width - p : prompt_width] = 1
        mask[b, prompt_width : prompt_width + r] = 1
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, 2))  # pad id 2
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    return ids, mask, position_ids
