"""One micro-batching and packing (ForwardPlan) shared by the old-log-prob and reference passes: the same
results as each role cutting and packing for itself, the plan built once, and a plan with other
micro-batching settings not used."""

from __future__ import annotations

import pytest
import torch

from klppo.batch import Batch
from klppo.batching.attention import enable_packed_attention
from klppo.models.tiny import build_tiny_model
from klppo.roles import forward
from klppo.roles.actor import Actor, ActorSettings
from klppo.roles.forward import ForwardPlan, MicroBatching
from klppo.roles.optim import OptimSettings
from klppo.roles.reference import Reference


def _batch() -> Batch:
    g = torch.Generator().manual_seed(0)
    B, P, R = 6, 7, 5
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, :3] = 0
    prompt_mask[4, :1] = 0
    mask = torch.ones(B, R)
    mask[1, 2:] = 0
    mask[3, 4:] = 0
    return Batch(
        prompts=torch.randint(3, 300, (B, P), generator=g),
        prompt_mask=prompt_mask,
        responses=torch.randint(3, 300, (B, R), generator=g),
        response_mask=mask,
    )


def _model(seed: int):
    model = build_tiny_model(seed=seed)
    enable_packed_attention(model)
    return model


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("dynamic", [False, True])
def test_shared_plan_gives_each_roles_own_results(packed, dynamic, monkeypatch):
    torch.set_num_threads(1)
    micro = MicroBatching(micro_batch_size=4, use_dynamic_bsz=dynamic, max_token_len=30)
    batch = _batch()
    actor = Actor(_model(0), ActorSettings(log_prob_micro=micro, use_remove_padding=packed), OptimSettings())
    reference = Reference(_model(1), micro=micro, use_remove_padding=packed)
    own = actor.compute_log_prob(batch), reference.compute_ref_log_prob(batch)

    builds = []
    real_build = ForwardPlan.build.__func__
    monkeypatch.setattr(
        forward.ForwardPlan,
        "build",
        classmethod(lambda cls, *a, **k: builds.append(1) or real_build(cls, *a, **k)),
    )
    plan = actor.log_prob_plan(batch)
    assert len(plan.partitions) == (3 if dynamic else 2)
    shared = actor.compute_log_prob(batch, plan=plan), reference.compute_ref_log_prob(batch, plan=plan)
    assert len(builds) == 1  # neither pass cut or packed the batch again
    for a, b in zip(own, shared):
        torch.testing.assert_close(b, a, rtol=0, atol=0)
    assert not torch.equal(shared[0], shared[1])  # two models: the plan carries no results
    assert (shared[0][1, 2:] == 0).all()

    # a reference with other micro-batching builds its own plan (its own token order)
    other = Reference(_model(1), micro=MicroBatching(micro_batch_size=2), use_remove_padding=packed)
    torch.testing.assert_close(other.compute_ref_log_prob(batch, plan=plan), own[1], rtol=1e-6, atol=1e-6)
    assert len(builds) == 2
