"""The group outcome estimators added after GRPO/RLOO: REINFORCE++-baseline, OPO, GRPO pass@k, GPG."""

import pytest
import torch

from klppo.algorithms.advantages import compute_advantages
from klppo.algorithms.outcome import gpg, grpo, grpo_passk, opo, reinforce_plus_plus_baseline

from . import reference as ref

F64 = torch.float64
IDS = ["p0", "p0", "p0", "p1", "p1", "solo", "p2", "p2", "p2"]  # includes a group of one


def _t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def _dense(seed: int, b: int = 9, t: int = 7, contiguous: bool = True):
    """Dense token rewards (KL-in-reward style); row 0 is empty when b > 1."""
    gen = torch.Generator().manual_seed(seed)
    m = ref.make_mask(b, t, gen, contiguous=contiguous)
    return torch.randn(b, t, generator=gen, dtype=F64) * m, m


def _outcome(seed: int, b: int = 9, t: int = 7, values=(0.0, 1.0)):
    """One score per row at its last response token, drawn from ``values`` (ties are common)."""
    gen = torch.Generator().manual_seed(seed)
    m = ref.make_mask(b, t, gen)
    r = torch.zeros(b, t, dtype=F64)
    pick = torch.randint(0, len(values), (b,), generator=gen)
    for i in range(b):
        n = int(m[i].sum())
        if n:
            r[i, n - 1] = values[int(pick[i])]
    return r, m


def _check_outputs(adv, ret, m, expected) -> None:
    torch.testing.assert_close(adv, _t(expected))
    assert torch.equal(adv, ret)
    assert (adv[m == 0] == 0).all()


@pytest.mark.parametrize("contiguous", [True, False])
def test_reinforce_plus_plus_baseline_matches_reference(contiguous: bool) -> None:
    r, m = _dense(1, contiguous=contiguous)
    adv, ret = reinforce_plus_plus_baseline(r, m, IDS)
    _check_outputs(adv, ret, m, ref.rf_pp_baseline(r, m, IDS))
    # whitened over the batch's response tokens: mean 0, unbiased variance ≈ 1
    vals = ref.valid_values(adv, m)
    assert abs(ref.mean(vals)) < 1e-10 and ref.var_unbiased(vals) == pytest.approx(1.0, rel=1e-6)


@pytest.mark.parametrize("contiguous", [True, False])
def test_opo_matches_reference(contiguous: bool) -> None:
    r, m = _dense(2, contiguous=contiguous)
    adv, ret = opo(r, m, IDS)
    _check_outputs(adv, ret, m, ref.opo(r, m, IDS))
    # length weighting: two rows, lengths 1 and 3 → b = (1·s0 + 3·s1)/4
    r2 = _t([[2.0, 0.0, 0.0], [0.0, 0.0, 6.0]])
    m2 = _t([[1, 0, 0], [1, 1, 1]])
    adv2, _ = opo(r2, m2, [0, 0])
    b = (1 * 2.0 + 3 * 6.0) / 4
    torch.testing.assert_close(adv2, _t([[2.0 - b, 0, 0], [6.0 - b] * 3]))


def test_opo_group_of_empty_rows_is_zero_not_nan() -> None:
    r = torch.zeros(3, 4, dtype=F64)
    r[0, 0], r[1, 0] = 1.0, 2.0  # scores on rows whose responses are empty
    m = torch.zeros(3, 4, dtype=F64)
    m[2, :2] = 1
    adv, _ = opo(r, m, ["a", "a", "b"])
    assert torch.isfinite(adv).all() and (adv[:2] == 0).all()


@pytest.mark.parametrize("norm_by_std", [True, False])
@pytest.mark.parametrize("values", [(0.0, 1.0), (0.0, 0.5, 1.0, 2.0)])
def test_grpo_passk_matches_reference(norm_by_std: bool, values) -> None:
    ids = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 3, 3, 3]
    for seed in range(6):
        r, m = _outcome(seed, b=len(ids), values=values)
        adv, ret = grpo_passk(r, m, ids, eps=1e-6, norm_by_std=norm_by_std)
        _check_outputs(adv, ret, m, ref.grpo_passk(r, m, ids, norm_by_std))
    # dense scores (no ties): exactly one non-zero row per group, and it is the best one
    r, m = _dense(3, b=8)
    m = torch.ones_like(m)
    adv, _ = grpo_passk(r, m, [0, 0, 0, 1, 1, 1, 1, 1], norm_by_std=norm_by_std)
    _check_outputs(adv, adv, m, ref.grpo_passk(r, m, [0, 0, 0, 1, 1, 1, 1, 1], norm_by_std))
    assert int((adv[:, 0] != 0).sum()) == 2 and (adv[:, 0] >= 0).all()


def test_grpo_passk_needs_groups_of_two() -> None:
    r, m = _dense(4)
    with pytest.raises(ValueError, match="at least 2 samples"):
        grpo_passk(r, m, IDS)
    with pytest.raises(ValueError, match="at least 2 samples"):
        grpo_passk(r[:1], m[:1], ["only"])  # batch of one


def test_gpg_matches_reference() -> None:
    r, m = _dense(5)
    adv, ret = gpg(r, m, IDS)
    _check_outputs(adv, ret, m, ref.gpg(r, m, IDS))
    # α = B / #non-zero scores: binary rewards with many zeros scale the advantages up
    r, m = _outcome(6, b=9)
    adv, _ = gpg(r, m, IDS)
    _check_outputs(adv, adv, m, ref.gpg(r, m, IDS))
    # all scores zero: α = B / 1, advantages 0
    adv0, _ = gpg(torch.zeros_like(r), m, IDS)
    assert (adv0 == 0).all()


@pytest.mark.parametrize("name", ["reinforce_plus_plus_baseline", "opo", "gpg"])
def test_batch_of_one_and_groups_of_one(name: str) -> None:
    r, m = _dense(7, b=1)
    m[0, 0] = 1.0
    expected = {
        "reinforce_plus_plus_baseline": ref.rf_pp_baseline,
        "opo": ref.opo,
        "gpg": ref.gpg,
    }[name]
    adv, _ = compute_advantages(name, token_level_rewards=r, response_mask=m, group_ids=["x"])
    torch.testing.assert_close(adv, _t(expected(r, m, ["x"])))
    # every row its own group
    r, m = _dense(8)
    ids = list(range(r.shape[0]))
    adv, _ = compute_advantages(name, token_level_rewards=r, response_mask=m, group_ids=ids)
    torch.testing.assert_close(adv, _t(expected(r, m, ids)))


@pytest.mark.parametrize("name", ["reinforce_plus_plus_baseline", "opo", "grpo_passk", "gpg"])
def test_group_ids_as_tensor_and_validation(name: str) -> None:
    r, m = _dense(9, b=6)
    ids = ["a", "a", "b", "b", "c", "c"]
    adv, _ = compute_advantages(name, token_level_rewards=r, response_mask=m, group_ids=ids)
    as_int = torch.tensor([5, 5, 1, 1, 9, 9])
    adv_int, _ = compute_advantages(name, token_level_rewards=r, response_mask=m, group_ids=as_int)
    torch.testing.assert_close(adv_int, adv)
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages(name, token_level_rewards=r, response_mask=m)
    with pytest.raises(ValueError, match="group_ids has 2 entries"):
        compute_advantages(name, token_level_rewards=r, response_mask=m, group_ids=["a", "b"])


def test_grpo_std_division_scales_a_tiny_kl_penalty_to_unit_advantages() -> None:
    """Why klppo warns on GRPO + KL in the reward (config/checks.py): a group whose 8 responses all score 0
    gets advantages from -β·ΣKL alone, divided by their std: size ~1 for any β > 0 (hand-computed, float64);
    without the std division they stay of size β·ΣKL."""
    gen = torch.Generator().manual_seed(0)
    beta, n, t = 1e-3, 8, 5
    kl = torch.rand(n, t, generator=gen, dtype=torch.float64) * 0.2
    token_rewards = -beta * kl  # task score 0 on every response
    mask = torch.ones(n, t, dtype=torch.float64)
    adv, _ = grpo(token_rewards, mask, [0] * n, norm_by_std=True)
    seq = token_rewards.sum(-1)
    expected = (seq - seq.mean()) / (seq.std() + 1e-6)
    torch.testing.assert_close(adv[:, 0], expected, rtol=1e-9, atol=1e-12)
    assert 0.9 < float(adv[:, 0].std()) <= 1.0  # unit size, from a penalty of ~1e-4 per response
    raw, _ = grpo(token_rewards, mask, [0] * n, norm_by_std=False)
    assert float(raw.abs().max()) < beta
