import math

import pytest
import torch

from klppo.algorithms.kl import kl_penalty
from klppo.algorithms.losses import (
    LOSS_AGG_MODES,
    agg_loss,
    entropy_from_logits,
    kl_loss,
    policy_loss,
    value_loss,
)
from klppo.algorithms.masked import explained_variance, masked_mean, masked_var, masked_whiten

from . import reference as ref

F64 = torch.float64


def _data(seed: int, b: int = 6, t: int = 8):
    gen = torch.Generator().manual_seed(seed)
    m = ref.make_mask(b, t, gen)
    x = torch.randn(b, t, generator=gen, dtype=F64)
    return gen, m, x


def test_masked_statistics() -> None:
    gen, m, x = _data(0)
    vals = ref.valid_values(x, m)
    assert masked_mean(x, m).item() == pytest.approx(ref.mean(vals), rel=1e-12)
    assert masked_var(x, m).item() == pytest.approx(ref.var_unbiased(vals), rel=1e-12)
    row_means = masked_mean(x, m, dim=-1)
    for i in range(x.shape[0]):
        assert row_means[i].item() == pytest.approx(ref.mean(ref.valid_values(x[i : i + 1], m[i : i + 1])))
    torch.testing.assert_close(masked_whiten(x, m), torch.tensor(ref.whiten(x, m), dtype=F64))
    # garbage (inf) at masked positions never leaks
    y = torch.where(m.bool(), x, torch.tensor(math.inf, dtype=F64))
    assert masked_mean(y, m).item() == pytest.approx(ref.mean(vals), rel=1e-12)
    # empty and single-element masks: 0, not NaN
    none, one = torch.zeros_like(m), torch.zeros_like(m)
    one[2, 0] = 1
    for mask in (none, one):
        assert masked_mean(x, mask).isfinite() and masked_var(x, mask).item() == 0.0
        assert (masked_whiten(x, mask) == 0).all()


def test_explained_variance() -> None:
    gen, m, ret = _data(1)
    val = ret + 0.3 * torch.randn(ret.shape, generator=gen, dtype=F64)
    rv, vv = ref.valid_values(ret, m), ref.valid_values(val, m)
    expected = 1 - ref.var_unbiased([a - b for a, b in zip(rv, vv)]) / (ref.var_unbiased(rv) + 1e-5)
    assert explained_variance(val, ret, m).item() == pytest.approx(expected, rel=1e-12)
    assert explained_variance(val, ret, torch.zeros_like(m)).item() == 1.0


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_agg_loss_modes(mode: str) -> None:
    _, m, x = _data(2)
    assert agg_loss(x, m, mode).item() == pytest.approx(ref.agg(x, m, mode), rel=1e-12, abs=1e-15)
    assert agg_loss(x, torch.zeros_like(m), mode).item() == 0.0
    one_row = agg_loss(x[1:2], m[1:2], mode)
    assert one_row.item() == pytest.approx(ref.agg(x[1:2], m[1:2], mode), rel=1e-12)


def test_agg_loss_unknown_mode() -> None:
    with pytest.raises(ValueError, match="token-mean"):
        agg_loss(torch.zeros(2, 2), torch.ones(2, 2), "token-sum")


def _policy_reference(old, new, adv, m, lo, hi, c, mode):
    """Per-token loss, d(loss_token)/d(log π), and stats, from scalar math."""
    losses, grads = [], []
    clip, dual, neg_kl = [], [], []
    for o_r, n_r, a_r in zip(ref.rows(old), ref.rows(new), ref.rows(adv)):
        lrow, grow = [], []
        for o, n, a in zip(o_r, n_r, a_r):
            d = min(max(n - o, -20.0), 20.0)
            rho = math.exp(d)
            unclipped, clipped = -a * rho, -a * min(max(rho, 1 - lo), 1 + hi)
            ppo = max(unclipped, clipped)
            loss = min(ppo, -a * c) if a < 0 else ppo
            active_unclipped = loss == unclipped and unclipped >= clipped and -20 < n - o < 20
            lrow.append(loss)
            grow.append(-a * rho if active_unclipped else 0.0)
            clip.append(1.0 if clipped > unclipped else 0.0)
            dual.append(1.0 if (a < 0 and ppo > -a * c) else 0.0)
            neg_kl.append(-d)
        losses.append(lrow)
        grads.append(grow)
    shape = old.shape
    return (
        torch.tensor(losses, dtype=F64),
        torch.tensor(grads, dtype=F64),
        {
            k: torch.tensor(v, dtype=F64).reshape(shape)
            for k, v in [("clip", clip), ("dual", dual), ("kl", neg_kl)]
        },
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("clip", [(0.2, None, None), (0.2, 0.2, 0.28)])
def test_policy_loss_matches_reference(mode: str, clip) -> None:
    gen, m, adv = _data(3, b=5, t=10)
    old = -torch.rand(5, 10, generator=gen, dtype=F64) * 3
    new = old + torch.randn(5, 10, generator=gen, dtype=F64) * 0.5
    new[1, 0], new[2, 1] = old[1, 0] + 50, old[2, 1] - 50  # extreme log-ratios
    new[3, 2], new[4, 3] = old[3, 2] + 50, old[4, 3] + 1.5  # A < 0 with ρ > c: dual clip active
    adv[2, 1], adv[1, 0], adv[3, 2], adv[4, 3] = -1.0, 1.0, -2.0, -0.5
    m[1, 0] = m[2, 1] = m[3, 2] = m[4, 3] = 1.0
    new.requires_grad_(True)
    ratio, low, high = clip
    loss, stats = policy_loss(
        old,
        new,
        adv,
        m,
        clip_ratio=ratio,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=3.0,
        loss_agg_mode=mode,
    )
    lo, hi = low or ratio, high or ratio
    per_tok, dtok, st = _policy_reference(old, new, adv, m, lo, hi, 3.0, mode)
    assert loss.item() == pytest.approx(ref.agg(per_tok, m, mode), rel=1e-10, abs=1e-12)
    assert stats["pg_clipfrac"].item() == pytest.approx(ref.mean(ref.valid_values(st["clip"], m)))
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(ref.mean(ref.valid_values(st["dual"], m)))
    assert stats["pg_clipfrac_lower"].item() > 0 and stats["pg_clipfrac"].item() > 0
    assert stats["ppo_kl"].item() == pytest.approx(ref.mean(ref.valid_values(st["kl"], m)), rel=1e-12)
    # gradient: the aggregation is linear, so d loss / d log π = (d agg / d ℓ) · dℓ/d log π per token
    (g,) = torch.autograd.grad(loss, new)
    probe = torch.zeros(5, 10, dtype=F64, requires_grad=True)
    (w,) = torch.autograd.grad(agg_loss(probe, m, mode), probe)
    torch.testing.assert_close(g, w * dtok)
    assert torch.isfinite(loss) and all(torch.isfinite(v) for v in stats.values())


def test_policy_loss_validation_and_low_precision() -> None:
    gen, m, adv = _data(4)
    old = -torch.rand(adv.shape, generator=gen, dtype=F64)
    new = old + 0.1 * torch.randn(adv.shape, generator=gen, dtype=F64)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        policy_loss(old, new, adv, m, clip_ratio_c=1.0)
    ref_loss, _ = policy_loss(old, new, adv, m)
    for dtype in (torch.bfloat16, torch.float16):
        lo_new = new.to(dtype).requires_grad_(True)
        loss, stats = policy_loss(old.to(dtype), lo_new, adv.to(dtype), m.to(dtype))
        assert loss.dtype == torch.float32
        assert loss.item() == pytest.approx(ref_loss.item(), abs=2e-2)
        loss.backward()
        assert lo_new.grad.dtype == dtype and torch.isfinite(lo_new.grad.float()).all()
    loss, stats = policy_loss(old, new, adv, torch.zeros_like(m))
    assert loss.item() == 0.0 and all(v.item() == 0.0 for v in stats.values())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_value_loss_matches_reference(mode: str) -> None:
    gen, m, ret = _data(5)
    old = ret + torch.randn(ret.shape, generator=gen, dtype=F64)
    new = old + torch.randn(ret.shape, generator=gen, dtype=F64) * 0.5
    c = 0.3
    loss, stats = value_loss(new, ret, old, m, cliprange_value=c, loss_agg_mode=mode)
    per_tok, clipped = [], []
    for nr, rr, orow in zip(ref.rows(new), ref.rows(ret), ref.rows(old)):
        prow, crow = [], []
        for n, r, o in zip(nr, rr, orow):
            vc = min(max(n, o - c), o + c)
            e1, e2 = (n - r) ** 2, (vc - r) ** 2
            prow.append(max(e1, e2))
            crow.append(1.0 if e2 > e1 else 0.0)
        per_tok.append(prow)
        clipped.append(crow)
    expected = 0.5 * ref.agg(torch.tensor(per_tok, dtype=F64), m, mode)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats["vf_clipfrac"].item() == pytest.approx(ref.mean(ref.valid_values(torch.tensor(clipped), m)))
    assert stats["vpred_mean"].item() == pytest.approx(ref.mean(ref.valid_values(new, m)), rel=1e-12)


def test_kl_loss_is_aggregated_estimator() -> None:
    gen, m, _ = _data(6)
    lp = -torch.rand(m.shape, generator=gen, dtype=F64) * 4
    rp = -torch.rand(m.shape, generator=gen, dtype=F64) * 4
    for kind in ("low_var_kl", "k1", "k3+"):
        for mode in LOSS_AGG_MODES:
            per_tok = [
                [ref.kl_estimate(a, b, kind.rstrip("+")) for a, b in zip(x, y)]
                for x, y in zip(ref.rows(lp), ref.rows(rp))
            ]
            expected = ref.agg(torch.tensor(per_tok, dtype=F64), m, mode)
            assert kl_loss(lp, rp, m, kind, mode).item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(
        kl_loss(lp, rp, m), agg_loss(kl_penalty(lp, rp, "low_var_kl"), m, "token-mean")
    )


def test_entropy_from_logits() -> None:
    gen = torch.Generator().manual_seed(7)
    z = torch.randn(2, 3, 13, generator=gen, dtype=F64) * 4
    z[0, 0, :] = torch.linspace(-1e4, 1e4, 13, dtype=F64)  # near-deterministic, huge finite logits
    expected = torch.tensor(
        [[-sum(p * math.log(p) for p in ref.softmax_row(row) if p > 0) for row in seq] for seq in z.tolist()],
        dtype=F64,
    )
    for chunk in (None, 1, 4):
        torch.testing.assert_close(entropy_from_logits(z, chunk_rows=chunk), expected, rtol=1e-10, atol=1e-12)
    small = z[1:, :2, :6].clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda a: entropy_from_logits(a, chunk_rows=1), (small,))
    for dtype in (torch.bfloat16, torch.float16):
        zl = z[1:].to(dtype).requires_grad_(True)
        h = entropy_from_logits(zl)
        assert h.dtype == torch.float32
        torch.testing.assert_close(
            h.double(), entropy_from_logits(zl.detach().double()), rtol=1e-5, atol=1e-5
        )
        h.sum().backward()
        assert zl.grad.dtype == dtype and torch.isfinite(zl.grad.float()).all()
