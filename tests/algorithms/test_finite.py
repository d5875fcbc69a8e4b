"""No NaN/inf out of any function for finite inputs, including all-masked rows and extreme log-ratios."""

import pytest
import torch

from klppo.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_KINDS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    FixedKLController,
    agg_loss,
    apply_kl_penalty,
    compute_advantages,
    entropy_from_logits,
    explained_variance,
    kl_loss,
    kl_penalty,
    kl_penalty_full,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    value_loss,
)


def _finite(*xs: torch.Tensor) -> bool:
    return all(torch.isfinite(x.float()).all() for x in xs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mask_kind", ["all_masked_rows", "all_masked", "batch_of_one"])
def test_everything_finite(dtype: torch.dtype, mask_kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    b, t, v = (1, 6, 9) if mask_kind == "batch_of_one" else (4, 6, 9)
    m = torch.ones(b, t)
    if mask_kind == "all_masked_rows":
        m[0] = 0
        m[2] = 0
    elif mask_kind == "all_masked":
        m.zero_()
    lp = (torch.rand(b, t, generator=gen) * -100).to(dtype)  # log-ratios up to ±100
    rp = (torch.rand(b, t, generator=gen) * -100).to(dtype)
    x = (torch.randn(b, t, generator=gen) * 1e3).to(dtype)
    lp_g = lp.clone().requires_grad_(True)
    for kind in KL_KINDS:
        if kind == "full":
            continue
        out = kl_penalty(lp_g, rp, kind)
        (g,) = torch.autograd.grad(out.sum(), lp_g)
        assert _finite(out, g), kind
    for mode in LOSS_AGG_MODES:
        assert _finite(agg_loss(x, m, mode), kl_loss(lp, rp, m, "k3", mode))
        loss, stats = policy_loss(rp, lp_g, x, m, loss_agg_mode=mode)
        (g,) = torch.autograd.grad(loss, lp_g)
        assert _finite(loss, g, *stats.values())
        for name, fn in POLICY_LOSSES.items():
            loss, stats = fn(rp, lp_g, x, m, loss_agg_mode=mode, loss_scale_factor=7.0)
            (g,) = torch.autograd.grad(loss, lp_g)
            assert _finite(loss, g, *stats.values()), (name, mode)
        vloss, vstats = value_loss(x, x * 0.5, x * 0.9, m, 0.5, mode)
        assert _finite(vloss, *vstats.values())
    assert _finite(masked_mean(x, m), masked_var(x, m), masked_whiten(x, m), explained_variance(x, x * 2, m))
    rewards, kstats = apply_kl_penalty(x, lp, rp, m, FixedKLController(0.1), "low_var_kl")
    assert _finite(rewards, *kstats.values())
    for name in ADVANTAGE_ESTIMATORS:
        if name == "grpo_passk" and b == 1:
            continue  # needs groups of two (raises, tested in test_outcome)
        adv, ret = compute_advantages(
            name,
            token_level_rewards=rewards,
            response_mask=m,
            values=x,
            group_ids=list(range(b // 2)) * 2 if b > 1 else [0],
            reward_baselines=x[:, 0],
            gamma=1.0,
            lam=0.95,
        )
        assert _finite(adv, ret), name
    logits = (torch.randn(b, t, v, generator=gen) * 1e4).to(dtype).requires_grad_(True)
    ref_logits = (torch.randn(b, t, v, generator=gen) * 1e4).to(dtype)
    h = entropy_from_logits(logits)
    full = kl_penalty_full(logits, ref_logits, m)
    (g,) = torch.autograd.grad(h.sum() + full.sum(), logits)
    assert _finite(h, full, g)
