import numpy as np
import pytest
import torch

from klppo.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    gae,
    gpg,
    grpo,
    grpo_passk,
    needs_critic,
    opo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    remax,
    rloo,
)

from . import reference as ref

F64 = torch.float64


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def _inputs(seed: int, b: int = 7, t: int = 9, contiguous: bool = True):
    gen = torch.Generator().manual_seed(seed)
    m = ref.make_mask(b, t, gen, contiguous=contiguous)
    r = torch.randn(b, t, generator=gen, dtype=F64) * m  # dense (KL-in-reward style) token rewards
    v = torch.randn(b, t, generator=gen, dtype=F64)
    return r, v, m


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("b", [1, 7])
def test_gae_matches_reference(contiguous: bool, b: int) -> None:
    r, v, m = _inputs(10 + b, b=b, contiguous=contiguous)
    gamma, lam = 0.99, 0.9
    adv, ret = gae(r, v, m, gamma=gamma, lam=lam)
    adv_raw, ret_ref = ref.gae(r, v, m, gamma, lam)
    torch.testing.assert_close(ret, _t(ret_ref))
    torch.testing.assert_close(adv, _t(ref.whiten(_t(adv_raw), m)))
    assert (adv[m == 0] == 0).all() and (ret[m == 0] == 0).all()


def test_gae_without_whitening_signal_is_td_lambda() -> None:
    # γ = λ = 1, zero values: returns are the reward-to-go over the response tokens
    r, _, m = _inputs(20)
    _, ret = gae(r, torch.zeros_like(r), m, gamma=1.0, lam=1.0)
    expected = (r * m).flip(-1).cumsum(-1).flip(-1) * m
    torch.testing.assert_close(ret, expected)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_reference(norm_by_std: bool) -> None:
    r, _, m = _inputs(30, b=9)
    ids = ["p0", "p0", "p0", "p1", "p1", "solo", "p2", "p2", "p2"]  # includes a group of one
    adv, ret = grpo(r, m, ids, eps=1e-6, norm_by_std=norm_by_std)
    expected = ref.group_outcome(r, m, ids, "grpo" if norm_by_std else "grpo_nostd")
    torch.testing.assert_close(adv, _t(expected))
    assert torch.equal(adv, ret)
    # group ids as an integer tensor or a numpy object array give the same result
    as_int = torch.tensor([0, 0, 0, 1, 1, 7, 2, 2, 2])
    torch.testing.assert_close(grpo(r, m, as_int, norm_by_std=norm_by_std)[0], adv)
    torch.testing.assert_close(grpo(r, m, np.array(ids, dtype=object), norm_by_std=norm_by_std)[0], adv)


def test_grpo_groups_of_one_and_equal_scores() -> None:
    r = _t([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [3.0, 0.0]])
    m = torch.ones(4, 2, dtype=F64)
    adv, _ = grpo(r, m, ["a", "b", "c", "c"])
    # singletons: (s − 0)/(1 + eps); equal scores: 0 (std 0 → divided by eps, numerator 0)
    torch.testing.assert_close(adv[:2, 0], _t([1.0, 2.0]) / (1 + 1e-6))
    assert (adv[2:] == 0).all()
    with pytest.raises(ValueError, match="group_ids"):
        grpo(r, m, ["a", "b"])


def test_rloo_matches_reference() -> None:
    r, _, m = _inputs(40, b=8)
    ids = [0, 0, 0, 0, 1, 1, 2, 3]
    adv, ret = rloo(r, m, ids)
    torch.testing.assert_close(adv, _t(ref.group_outcome(r, m, ids, "rloo")))
    assert torch.equal(adv, ret)


@pytest.mark.parametrize("contiguous", [True, False])
def test_reinforce_plus_plus_matches_reference(contiguous: bool) -> None:
    r, _, m = _inputs(50, contiguous=contiguous)
    adv, ret = reinforce_plus_plus(r, m, gamma=0.95)
    ret_ref = _t(ref.discounted_returns(r, m, 0.95))
    torch.testing.assert_close(ret, ret_ref)
    torch.testing.assert_close(adv, _t(ref.whiten(ret_ref, m)))


def test_remax_matches_reference() -> None:
    r, _, m = _inputs(60)
    baseline = torch.randn(r.shape[0], dtype=F64)
    adv, ret = remax(r, baseline, m)
    for i, (rr, mr) in enumerate(zip(ref.rows(r), ref.mask_rows(m))):
        for t in range(len(rr)):
            togo = sum(rr[k] for k in range(t, len(rr)) if mr[k])
            assert ret[i, t].item() == pytest.approx(togo if mr[t] else 0.0, abs=1e-12)
            exp_adv = togo - baseline[i].item() if mr[t] else 0.0
            assert adv[i, t].item() == pytest.approx(exp_adv, abs=1e-12)


def test_registry_dispatch_and_requirements() -> None:
    r, v, m = _inputs(70, b=6)
    ids = [0, 0, 1, 1, 2, 2]
    base = torch.randn(6, dtype=F64)
    direct = {
        "gae": gae(r, v, m, gamma=0.9, lam=0.8),
        "grpo": grpo(r, m, ids, norm_by_std=False),
        "rloo": rloo(r, m, ids),
        "reinforce_plus_plus": reinforce_plus_plus(r, m, gamma=0.9),
        "remax": remax(r, base, m),
        "reinforce_plus_plus_baseline": reinforce_plus_plus_baseline(r, m, ids),
        "opo": opo(r, m, ids),
        "grpo_passk": grpo_passk(r, m, ids, norm_by_std=False),
        "gpg": gpg(r, m, ids),
    }
    assert set(direct) == set(ADVANTAGE_ESTIMATORS)
    for name, (adv, ret) in direct.items():
        got_adv, got_ret = compute_advantages(
            name,
            token_level_rewards=r,
            response_mask=m,
            values=v,
            group_ids=ids,
            reward_baselines=base,
            gamma=0.9,
            lam=0.8,
            norm_by_std=False,
        )
        torch.testing.assert_close(got_adv, adv)
        torch.testing.assert_close(got_ret, ret)
    assert [n for n in ADVANTAGE_ESTIMATORS if needs_critic(n)] == ["gae"]
    for name, missing in [
        ("gae", "values"),
        ("grpo", "group_ids"),
        ("rloo", "group_ids"),
        ("remax", "reward_baselines"),
        ("reinforce_plus_plus_baseline", "group_ids"),
        ("opo", "group_ids"),
        ("grpo_passk", "group_ids"),
        ("gpg", "group_ids"),
    ]:
        with pytest.raises(ValueError, match=missing):
            compute_advantages(name, token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="grpo"):
        compute_advantages("ppo2", token_level_rewards=r, response_mask=m)


def test_the_whitened_estimators_are_exactly_those_the_drift_monitor_expects() -> None:
    """klppo.config.checks.WHITENED_ESTIMATORS (the monitor's advantage-std range applies to them by
    default) lists exactly the estimators whose advantages come out with masked mean 0 and unbiased std 1
    over the batch's response tokens, on random float64 inputs (groups of 3)."""
    from klppo.algorithms.masked import masked_mean, masked_var
    from klppo.config.checks import WHITENED_ESTIMATORS

    r, v, m = _inputs(90, b=12, t=9)
    ids = [i // 3 for i in range(12)]
    base = torch.randn(12, dtype=F64, generator=torch.Generator().manual_seed(91))
    whitened = set()
    for name in ADVANTAGE_ESTIMATORS:
        adv, _ = compute_advantages(
            name,
            token_level_rewards=r,
            response_mask=m,
            values=v,
            group_ids=ids,
            reward_baselines=base,
            gamma=0.9,
            lam=0.8,
        )
        mean, var = masked_mean(adv, m).item(), masked_var(adv, m, unbiased=True).item()
        if abs(mean) < 1e-6 and abs(var - 1) < 1e-4:
            whitened.add(name)
    assert whitened == set(WHITENED_ESTIMATORS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_and_all_masked(dtype: torch.dtype) -> None:
    r, v, m = _inputs(80, b=4)
    ids = [0, 0, 1, 1]
    base = torch.zeros(4)
    kwargs = dict(values=v.to(dtype), group_ids=ids, reward_baselines=base, gamma=1.0, lam=0.95)
    for name in ADVANTAGE_ESTIMATORS:
        adv, ret = compute_advantages(name, token_level_rewards=r.to(dtype), response_mask=m, **kwargs)
        assert adv.dtype == torch.float32 and ret.dtype == torch.float32
        exp_adv, exp_ret = compute_advantages(
            name,
            token_level_rewards=r.to(dtype).double(),
            response_mask=m,
            **{**kwargs, "values": v.to(dtype).double()},
        )
        torch.testing.assert_close(adv.double(), exp_adv, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ret.double(), exp_ret, rtol=1e-4, atol=1e-4)
        # every row masked: zeros, never NaN
        none = torch.zeros_like(m)
        adv0, ret0 = compute_advantages(name, token_level_rewards=r.to(dtype), response_mask=none, **kwargs)
        assert (adv0 == 0).all() and (ret0 == 0).all()


@pytest.mark.parametrize("value", [0.1, 0.2, 0.3, 0.7])
def test_equal_fractional_groups_get_exactly_zero(value):
    """A group whose 8 samples all scored ``value``: GRPO and RLOO give exactly 0 (the float32 group mean of
    0.1 × 8 is an ulp off 0.1, and (s − mean) / (std + 1e-6) made that 0.007–0.1 before); a mixed group
    beside it keeps its float64-reference advantages; a group of one keeps verl's convention."""
    from klppo.algorithms.outcome import grpo, rloo

    n = 8
    rewards = torch.zeros(2 * n + 1, 3)
    rewards[:n, 2] = value
    rewards[n : 2 * n, 2] = torch.linspace(0, 1, n)
    rewards[2 * n, 2] = value
    mask = torch.ones_like(rewards)
    ids = [0] * n + [1] * n + [2]
    g, _ = grpo(rewards, mask, ids)
    r, _ = rloo(rewards, mask, ids)
    assert torch.equal(g[:n], torch.zeros(n, 3)) and torch.equal(r[:n], torch.zeros(n, 3))
    mixed = rewards[n : 2 * n, 2].double()
    ref_g = (mixed - mixed.mean()) / (mixed.std() + 1e-6)
    ref_r = mixed * n / (n - 1) - mixed.mean() * n / (n - 1)
    torch.testing.assert_close(g[n : 2 * n, 0].double(), ref_g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(r[n : 2 * n, 0].double(), ref_r, rtol=1e-5, atol=1e-6)
    assert float(g[2 * n, 0]) == pytest.approx(value / (1 + 1e-6)) and float(r[2 * n, 0]) == pytest.approx(
        value
    )
