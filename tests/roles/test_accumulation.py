"""The actor's gradient accumulation is exact: one micro-batch per mini-batch and one row per micro-batch
give the same update, for every loss mode × aggregation, with the entropy bonus and the KL loss on (each
term weighted by its own aggregation)."""

from __future__ import annotations

import pytest
import torch

from klppo.batch import Batch
from klppo.models.tiny import build_tiny_model
from klppo.roles.actor import Actor, ActorSettings
from klppo.roles.forward import MicroBatching
from klppo.roles.optim import OptimSettings


def _batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    B, P, R = 4, 5, 6
    prompts = torch.randint(3, 300, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    responses = torch.randint(3, 300, (B, R), generator=g)
    mask = torch.ones(B, R)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    return Batch(
        prompts=prompts,
        prompt_mask=prompt_mask,
        responses=responses,
        response_mask=mask,
        old_log_probs=-5.0 + 0.1 * torch.randn(B, R, generator=g) * mask,
        ref_log_probs=-5.0 + 0.1 * torch.randn(B, R, generator=g) * mask,
        advantages=torch.randn(B, R, generator=g) * mask,
    )


def _update(micro_size: int, loss_mode: str, agg: str, batch: Batch | None = None) -> list[torch.Tensor]:
    model = build_tiny_model(seed=0)
    actor = Actor(
        model,
        ActorSettings(
            mini_batch_size=4,
            update_micro=MicroBatching(micro_batch_size=micro_size),
            loss_agg_mode=agg,
            loss_mode=loss_mode,
            entropy_coeff=0.01,
            use_kl_loss=True,
            kl_loss_type="low_var_kl",
            grad_clip=1e9,
        ),
        OptimSettings(lr=0.1, optimizer="SGD", weight_decay=0.0),
    )
    actor.update_policy(_batch() if batch is None else batch)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("loss_mode", ["vanilla", "geo_mean", "gspo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_micro_batching_does_not_change_the_update(loss_mode, agg):
    torch.set_num_threads(1)
    whole = _update(4, loss_mode, agg)
    split = _update(1, loss_mode, agg)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_attended_tokens_outside_the_loss_mask_weigh_nothing(agg):
    """Tokens the model attends to but no loss counts (``response_attention_mask`` 1, ``response_mask`` 0:
    a multi-turn rollout's tool output, a rejected token or row) leave the micro-batch weights alone: one
    micro-batch and one row per micro-batch give the same update."""
    torch.set_num_threads(1)
    batch = _batch()
    attention = batch.response_mask.clone()
    mask = attention.clone()
    mask[0, 2:4] = 0  # appended / rejected tokens inside a row
    mask[3] = 0  # a whole row rejected
    batch = batch.replace(response_mask=mask, response_attention_mask=attention)
    whole = _update(4, "vanilla", agg, batch)
    split = _update(1, "vanilla", agg, batch)
    for a, b in zip(whole, split):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
