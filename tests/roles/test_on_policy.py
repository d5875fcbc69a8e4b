"""The on-policy skip of the old-log-prob pass: an update whose π_old is its own detached log-probs gives the
same losses, statistics and gradients (fp32) as one after a separate old-log-prob pass; and it is refused
when the update is not on-policy."""

from __future__ import annotations

import pytest
import torch

from klppo.algorithms.losses import masked_mean
from klppo.batch import Batch
from klppo.batching.attention import enable_packed_attention
from klppo.models.tiny import build_tiny_model
from klppo.roles.actor import Actor, ActorSettings
from klppo.roles.forward import MicroBatching
from klppo.roles.optim import OptimSettings


def _batch(seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    B, P, R = 4, 5, 6
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :2] = 0
    mask = torch.ones(B, R)
    mask[1, 3:] = 0
    mask[2, 1:] = 0
    return Batch(
        prompts=torch.randint(3, 300, (B, P), generator=g),
        prompt_mask=prompt_mask,
        responses=torch.randint(3, 300, (B, R), generator=g),
        response_mask=mask,
        rollout_log_probs=-5.0 + 0.1 * torch.randn(B, R, generator=g) * mask,
        ref_log_probs=-5.0 + 0.1 * torch.randn(B, R, generator=g) * mask,
        advantages=torch.randn(B, R, generator=g) * mask,
    )


def _actor(loss_mode: str, *, skip: bool, mini: int = 4, epochs: int = 1) -> Actor:
    model = build_tiny_model(seed=0)
    enable_packed_attention(model)
    return Actor(
        model,
        ActorSettings(
            mini_batch_size=mini,
            ppo_epochs=epochs,
            update_micro=MicroBatching(micro_batch_size=2),
            log_prob_micro=MicroBatching(micro_batch_size=3),
            loss_mode=loss_mode,
            entropy_coeff=0.01,
            use_kl_loss=True,
            kl_loss_type="low_var_kl",
            grad_clip=1e9,
            use_remove_padding=True,
            skip_old_log_prob_on_policy=skip,
        ),
        OptimSettings(lr=1.0, optimizer="SGD", weight_decay=0.0),  # parameter change = −gradient
    )


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo", "geo_mean"])
def test_skip_gives_the_recompute_update(loss_mode):
    torch.set_num_threads(1)
    batch = _batch()
    # before: a separate no-grad pass fills old_log_probs
    recompute = _actor(loss_mode, skip=False)
    before = [p.detach().clone() for p in recompute.model.parameters()]
    assert not recompute.skips_old_log_prob(len(batch))
    full = batch.replace(old_log_probs=recompute.compute_log_prob(batch))
    m_re = recompute.update_policy(full)
    grads_re = [b - p.detach() for b, p in zip(before, recompute.model.parameters())]
    # after: no old_log_probs; the update's own log-probs, detached, are π_old
    skip = _actor(loss_mode, skip=True)
    assert skip.skips_old_log_prob(len(batch))
    m_skip = skip.update_policy(batch)
    grads_skip = [b - p.detach() for b, p in zip(before, skip.model.parameters())]

    assert any(g.abs().max() > 1e-4 for g in grads_re)  # the update moved the weights
    for a, b in zip(grads_re, grads_skip):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
        assert m_skip[key] == pytest.approx(m_re[key], rel=1e-5, abs=1e-7), key
    # the statistics the skipped pass gave, from the update's own log-probs
    mask = batch.response_mask
    diff = masked_mean((full.old_log_probs - batch.rollout_log_probs).abs(), mask)
    kl_k1 = masked_mean(full.old_log_probs - batch.ref_log_probs, mask)
    assert m_skip["rollout/log_prob_diff"] == pytest.approx(float(diff), rel=1e-5)
    assert m_skip["actor/ref_kl_k1"] == pytest.approx(float(kl_k1), rel=1e-5, abs=1e-7)
    assert "rollout/log_prob_diff" not in m_re


def test_off_policy_updates_keep_the_pass():
    batch = _batch()
    for actor in (_actor("vanilla", skip=True, mini=2), _actor("vanilla", skip=True, epochs=2)):
        assert not actor.skips_old_log_prob(len(batch))
        with pytest.raises(ValueError, match="old_log_probs missing"):
            actor.update_policy(batch)
    assert not _actor("vanilla", skip=False).skips_old_log_prob(len(batch))
