"""Policy-loss variants (gspo, clip_cov, kl_cov, gpg, geo_mean), the registry and loss_scale_factor, against
float64 scalar references written from the formulas in docs/algorithms.md."""

import dataclasses
import inspect
import math

import pytest
import torch

from klppo.algorithms import policy_losses as pl
from klppo.algorithms.losses import (
    LOSS_AGG_MODES,
    POLICY_LOSS_KEYS,
    POLICY_LOSS_OPTIONS,
    POLICY_LOSSES,
    agg_loss,
    get_policy_loss,
    policy_loss,
    policy_loss_agg_mode,
)

from . import reference as ref

F64 = torch.float64
STATS = {"pg_clipfrac", "ppo_kl", "pg_clipfrac_lower"}


def _inputs(seed: int, b: int = 6, t: int = 9, scale: float = 0.4):
    gen = torch.Generator().manual_seed(seed)
    m = ref.make_mask(b, t, gen)  # row 0 empty
    old = -torch.rand(b, t, generator=gen, dtype=F64) * 3
    new = old + torch.randn(b, t, generator=gen, dtype=F64) * scale
    adv = torch.randn(b, t, generator=gen, dtype=F64)
    return old, new.requires_grad_(True), adv, m


def _agg_weights(m: torch.Tensor, mode: str, factor: float | None = None) -> torch.Tensor:
    """d agg_loss / d ℓ per token (the aggregation is linear in ℓ)."""
    probe = torch.zeros(m.shape, dtype=F64, requires_grad=True)
    (w,) = torch.autograd.grad(agg_loss(probe, m, mode, factor), probe)
    return w


def _valid_mean(x, m) -> float:
    return ref.mean(ref.valid_values(torch.as_tensor(x, dtype=F64), m))


def _check(loss, stats, per_tok, dtok, m, mode, new, expected_stats) -> None:
    assert loss.item() == pytest.approx(
        ref.agg(torch.tensor(per_tok, dtype=F64), m, mode), rel=1e-10, abs=1e-12
    )
    (g,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(g, _agg_weights(m, mode) * torch.tensor(dtok, dtype=F64))
    assert set(stats) == STATS
    for key, value in expected_stats.items():
        assert stats[key].item() == pytest.approx(value, rel=1e-10, abs=1e-12), key


# ---------------------------------------------------------------- gspo
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gspo_matches_reference(mode: str) -> None:
    old, new, adv, m = _inputs(1)
    with torch.no_grad():
        new[2, :3] += 15.0  # seq ratio of row 2 hits the clamp at log 10 when its row is short
    lo, hi = 0.2, 0.28
    loss, stats = pl.gspo(
        old, new, adv, m, clip_ratio=0.2, clip_ratio_low=lo, clip_ratio_high=hi, loss_agg_mode=mode
    )
    per_tok, dtok, clip = [], [], []
    for o_r, n_r, a_r, m_r in zip(ref.rows(old), ref.rows(new), ref.rows(adv), ref.mask_rows(m)):
        n_i = max(sum(m_r), 1)
        seq = sum(n - o for n, o, k in zip(n_r, o_r, m_r) if k) / n_i
        s = math.exp(min(seq, 10.0))
        lrow, grow = [], []
        for a in a_r:
            l1, l2 = -a * s, -a * min(max(s, 1 - lo), 1 + hi)
            lrow.append(max(l1, l2))
            grow.append(-a * s if (l1 >= l2 and seq <= 10.0) else 0.0)  # stop-gradient on the sequence term
            clip.append(1.0 if l2 > l1 else 0.0)
        per_tok.append(lrow)
        dtok.append(grow)
    kl = _valid_mean((old - new).detach(), m)
    clipfrac = _valid_mean(torch.tensor(clip).reshape(m.shape), m)
    _check(
        loss,
        stats,
        per_tok,
        dtok,
        m,
        mode,
        new,
        {"ppo_kl": kl, "pg_clipfrac": clipfrac, "pg_clipfrac_lower": 0},
    )


def test_gspo_ratio_is_per_sequence() -> None:
    # token log-ratios ±1 that average to 0 over the row: token-level PPO clips, GSPO does not
    old = torch.zeros(1, 4, dtype=F64)
    new = torch.tensor([[1.0, -1.0, 1.0, -1.0]], dtype=F64, requires_grad=True)
    adv, m = torch.ones(1, 4, dtype=F64), torch.ones(1, 4, dtype=F64)
    loss, stats = pl.gspo(old, new, adv, m)
    assert loss.item() == pytest.approx(-1.0) and stats["pg_clipfrac"].item() == 0.0
    (g,) = torch.autograd.grad(loss, new)
    torch.testing.assert_close(g, torch.full((1, 4), -0.25, dtype=F64))
    _, ppo_stats = policy_loss(old, new, adv, m)
    assert ppo_stats["pg_clipfrac"].item() == 0.5


# ---------------------------------------------------------------- clip_cov
def _clip_cov_reference(old, new, adv, m, lo, hi, ratio, lb, ub, seed):
    o_r, n_r, a_r, m_r = ref.rows(old), ref.rows(new), ref.rows(adv), ref.mask_rows(m)
    valid = [(i, t) for i, row in enumerate(m_r) for t, k in enumerate(row) if k]
    a_mean = ref.mean([a_r[i][t] for i, t in valid])
    lp_mean = ref.mean([n_r[i][t] for i, t in valid])
    cands = []
    terms = {}
    for i, t in valid:
        rho = math.exp(min(max(n_r[i][t] - o_r[i][t], -20), 20))
        a = a_r[i][t]
        l1, l2 = -a * rho, -a * min(max(rho, 1 - lo), 1 + hi)
        terms[i, t] = (l1, l2, rho, a)
        cov = (a - a_mean) * (n_r[i][t] - lp_mean)
        if not l2 > l1 and lb < cov < ub:
            cands.append((i, t))
    num = max(int(ratio * len(valid)), 1)
    perm = torch.randperm(len(cands), generator=torch.Generator().manual_seed(seed)).tolist() if cands else []
    chosen = {cands[j] for j in perm[:num]}
    per_tok = [[0.0] * old.shape[1] for _ in range(old.shape[0])]
    dtok = [[0.0] * old.shape[1] for _ in range(old.shape[0])]
    for (i, t), (l1, l2, rho, a) in terms.items():
        if (i, t) in chosen:
            continue
        per_tok[i][t] = max(l1, l2)
        dtok[i][t] = -a * rho if l1 >= l2 else 0.0
    return per_tok, dtok, len(chosen) / max(len(valid), 1), len(cands)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("bounds", [(0.0, 5.0, 0.2, 1.0), (1.0, 5.0, 0.0002, 4.0), (-10.0, 10.0, 1.0, 1.0)])
def test_clip_cov_matches_reference(mode: str, bounds) -> None:
    old, new, adv, m = _inputs(2, b=7, t=10, scale=0.6)
    lb, ub, ratio, adv_scale = bounds  # verl's default bounds (1, 5) need a wide spread of A · log π
    adv = adv * adv_scale
    loss, stats = pl.clip_cov(
        old,
        new,
        adv,
        m,
        clip_ratio=0.2,
        clip_ratio_high=0.28,
        loss_agg_mode=mode,
        options=pl.ClipCovOptions(ratio, lb, ub, generator=torch.Generator().manual_seed(5)),
    )
    per_tok, dtok, frac, num_cands = _clip_cov_reference(old, new, adv, m, 0.2, 0.28, ratio, lb, ub, 5)
    assert num_cands > 1  # the random choice is exercised
    kl = _valid_mean((old - new).detach(), m)
    _check(
        loss, stats, per_tok, dtok, m, mode, new, {"pg_clipfrac": frac, "ppo_kl": kl, "pg_clipfrac_lower": 0}
    )
    assert 0 < stats["pg_clipfrac"].item() <= max(ratio, 1 / m.sum().item()) + 1e-12


def test_clip_cov_without_candidates_is_single_clip_ppo() -> None:
    old, new, adv, m = _inputs(3)
    loss, stats = pl.clip_cov(
        old, new, adv, m, clip_ratio_c=1e9, options=pl.ClipCovOptions(clip_cov_lb=1e6, clip_cov_ub=1e7)
    )
    ppo, _ = policy_loss(old, new, adv, m, clip_ratio_c=1e9)
    torch.testing.assert_close(loss, ppo)
    assert stats["pg_clipfrac"].item() == 0.0
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        pl.clip_cov(old, new, adv, m, options=pl.ClipCovOptions(clip_cov_ratio=0.0))


# ---------------------------------------------------------------- kl_cov
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("ratio", [0.0002, 0.25])
def test_kl_cov_matches_reference(mode: str, ratio: float) -> None:
    old, new, adv, m = _inputs(4, b=7, t=10)
    coef = 0.7
    loss, stats = pl.kl_cov(old, new, adv, m, loss_agg_mode=mode, options=pl.KLCovOptions(ratio, coef))
    o_r, n_r, a_r, m_r = ref.rows(old), ref.rows(new), ref.rows(adv), ref.mask_rows(m)
    valid = [(i, t) for i, row in enumerate(m_r) for t, k in enumerate(row) if k]
    a_mean = ref.mean([a_r[i][t] for i, t in valid])
    lp_mean = ref.mean([n_r[i][t] for i, t in valid])
    cov = sorted(((a_r[i][t] - a_mean) * (n_r[i][t] - lp_mean), (i, t)) for i, t in valid)
    top = {it for _, it in cov[-max(1, int(len(valid) * ratio)) :]}
    per_tok = [[0.0] * old.shape[1] for _ in range(old.shape[0])]
    dtok = [[0.0] * old.shape[1] for _ in range(old.shape[0])]
    for i, t in valid:
        d = n_r[i][t] - o_r[i][t]
        rho, a = math.exp(d), a_r[i][t]
        per_tok[i][t] = -a * rho + (coef * abs(d) if (i, t) in top else 0.0)
        dtok[i][t] = -a * rho + (coef * math.copysign(1.0, d) if (i, t) in top else 0.0)
    abs_kl = _valid_mean((new - old).detach().abs(), m)
    _check(
        loss, stats, per_tok, dtok, m, mode, new, {"ppo_kl": abs_kl, "pg_clipfrac": 0, "pg_clipfrac_lower": 0}
    )
    loss0, _ = pl.kl_cov(old, new, adv, torch.zeros_like(m))
    assert loss0.item() == 0.0
    with pytest.raises(ValueError, match="kl_cov_ratio"):
        pl.kl_cov(old, new, adv, m, options=pl.KLCovOptions(kl_cov_ratio=0.0))


# ---------------------------------------------------------------- gpg
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_gpg_matches_reference(mode: str) -> None:
    old, new, adv, m = _inputs(5)
    loss, stats = pl.gpg(old, new, adv, m, loss_agg_mode=mode)
    per_tok = [[-n * a for n, a in zip(nr, ar)] for nr, ar in zip(ref.rows(new), ref.rows(adv))]
    dtok = [[-a for a in ar] for ar in ref.rows(adv)]
    kl = _valid_mean((old - new).detach(), m)
    _check(loss, stats, per_tok, dtok, m, mode, new, {"ppo_kl": kl, "pg_clipfrac": 0, "pg_clipfrac_lower": 0})


# ---------------------------------------------------------------- geo_mean
def _geo_mean_reference(old, new, adv, m, lo, hi) -> tuple[float, float, float]:
    losses, clip_hi, clip_lo = [], [], []
    for o_r, n_r, a_r, m_r in zip(ref.rows(old), ref.rows(new), ref.rows(adv), ref.mask_rows(m)):
        n_i = max(sum(m_r), 1)
        s_delta, s_adv = 0.0, 0.0
        for o, n, a, k in zip(o_r, n_r, a_r, m_r):
            d = min(max(n - o, -20.0), 20.0)
            d_c = min(max(d, -lo), hi)
            # positive A: take the smaller log-ratio; negative A: the larger; A = 0: 0
            d_min = min(d, d_c) if a > 0 else (max(d, d_c) if a < 0 else 0.0)
            if k:
                s_delta += d_min
                s_adv += a
                clip_hi.append(1.0 if (d != d_c and a > 0) else 0.0)
                clip_lo.append(1.0 if (d != d_c and a < 0) else 0.0)
        losses.append(-(s_adv / n_i) * math.exp(s_delta / n_i))
    return sum(losses) / len(losses), ref.mean(clip_hi), ref.mean(clip_lo)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_geo_mean_matches_reference(mode: str) -> None:
    old, new, adv, m = _inputs(6, scale=0.6)
    with torch.no_grad():
        adv[3, 1] = 0.0
    loss, stats = pl.geo_mean(old, new, adv, m, clip_ratio=0.4, clip_ratio_low=0.3, loss_agg_mode=mode)
    expected, hi_frac, lo_frac = _geo_mean_reference(old, new, adv, m, 0.3, 0.4)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert stats["pg_clipfrac"].item() == pytest.approx(hi_frac) and hi_frac > 0
    assert stats["pg_clipfrac_lower"].item() == pytest.approx(lo_frac) and lo_frac > 0
    assert stats["ppo_kl"].item() == pytest.approx(_valid_mean((old - new).detach(), m), rel=1e-12)


# ---------------------------------------------------------------- gradients, all modes
@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "gpg", "geo_mean", "vanilla"])
def test_gradcheck(name: str) -> None:
    old, new, adv, m = _inputs(7, b=3, t=5, scale=0.5)
    fn = get_policy_loss(name)

    def f(lp):
        kwargs = {}
        if name == "clip_cov":  # the same choice of tokens at every evaluation
            kwargs["options"] = pl.ClipCovOptions(0.2, 0.0, generator=torch.Generator().manual_seed(0))
        if name == "kl_cov":
            kwargs["options"] = pl.KLCovOptions(kl_cov_ratio=0.3, ppo_kl_coef=0.5)
        return fn(old, lp, adv, m, loss_agg_mode="seq-mean-token-mean", **kwargs)[0]

    assert torch.autograd.gradcheck(f, (new.detach().clone().requires_grad_(True),))


# ---------------------------------------------------------------- loss_scale_factor
def test_loss_scale_factor() -> None:
    _, _, x, m = _inputs(8)
    total = sum(ref.valid_values(x, m))
    assert agg_loss(x, m, "seq-mean-token-sum-norm", 64.0).item() == pytest.approx(total / 64.0, rel=1e-12)
    assert agg_loss(x, m, "seq-mean-token-sum-norm", None).item() == pytest.approx(
        total / x.shape[1], rel=1e-12
    )
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):  # ignored, as verl
        assert agg_loss(x, m, mode, 64.0).item() == agg_loss(x, m, mode).item()
    with pytest.raises(ValueError, match="loss_scale_factor"):
        agg_loss(x, m, "seq-mean-token-sum-norm", 0.0)
    old, new, adv, m = _inputs(9)
    for name, fn in POLICY_LOSSES.items():
        kw = (
            {"options": pl.ClipCovOptions(generator=torch.Generator().manual_seed(0))}
            if name == "clip_cov"
            else {}
        )
        by_t, _ = fn(old, new, adv, m, loss_agg_mode="seq-mean-token-sum-norm", **kw)
        kw = (
            {"options": pl.ClipCovOptions(generator=torch.Generator().manual_seed(0))}
            if name == "clip_cov"
            else {}
        )
        by_f, _ = fn(old, new, adv, m, loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=50.0, **kw)
        scale = 1.0 if name == "geo_mean" else m.shape[1] / 50.0  # geo_mean ignores the aggregation
        assert by_f.item() == pytest.approx(by_t.item() * scale, rel=1e-12), name


def test_micro_batches_stay_exact_with_constant_scale_factor_and_geo_mean() -> None:
    """Gradient accumulation (klppo.batching.dynamic.micro_batch_loss_weight, micro-batches of full width)
    reproduces the mini-batch loss for a constant loss_scale_factor and for geo_mean's row mean."""
    from klppo.batching.dynamic import micro_batch_loss_weight

    old, new, adv, m = _inputs(10, b=8)
    parts = [[0, 1, 2], [3, 4], [5, 6, 7]]
    rows, tokens, seqs = m.shape[0], m.sum().item(), (m.sum(-1) > 0).sum().item()
    for name, agg, factor in [("vanilla", "seq-mean-token-sum-norm", 37.0), ("geo_mean", "token-mean", None)]:
        fn, mode = get_policy_loss(name), policy_loss_agg_mode(name, agg)
        whole, _ = fn(old, new, adv, m, loss_agg_mode=agg, loss_scale_factor=factor)
        acc = 0.0
        for idx in parts:
            part, _ = fn(old[idx], new[idx], adv[idx], m[idx], loss_agg_mode=agg, loss_scale_factor=factor)
            w = micro_batch_loss_weight(mode, m[idx], tokens, seqs, horizon=m.shape[1], mini_num_rows=rows)
            acc = acc + w * part
        assert acc.item() == pytest.approx(whole.item(), rel=1e-12), name


# ---------------------------------------------------------------- registry
def test_registry_signatures_and_keys() -> None:
    assert POLICY_LOSSES["vanilla"] is policy_loss
    assert (
        set(POLICY_LOSSES)
        == set(POLICY_LOSS_KEYS)
        == {"vanilla", "gspo", "clip_cov", "kl_cov", "gpg", "geo_mean"}
    )
    base = list(inspect.signature(policy_loss).parameters.values())
    for name, fn in POLICY_LOSSES.items():
        params = list(inspect.signature(fn).parameters.values())
        assert [p.name for p in params[: len(base)]] == [p.name for p in base], name
        assert [p.default for p in params[4 : len(base)]] == [p.default for p in base[4:]], name
        extra = {p.name for p in params[len(base) :]}
        assert all(p.kind is p.KEYWORD_ONLY for p in params[len(base) :]), name
        assert extra == ({"options"} if name in POLICY_LOSS_OPTIONS else set()), name
        if name in POLICY_LOSS_OPTIONS:  # the options' floats are the config keys the mode reads
            assert params[len(base)].default == POLICY_LOSS_OPTIONS[name]()
            fields = {f.name for f in dataclasses.fields(POLICY_LOSS_OPTIONS[name])}
            assert set(POLICY_LOSS_KEYS[name]) == fields - {"generator"}, name
    with pytest.raises(ValueError, match="vanilla"):
        get_policy_loss("sapo")
    assert policy_loss_agg_mode("gspo", "token-mean") == "token-mean"
    assert policy_loss_agg_mode("geo_mean", "token-mean") == "seq-mean-token-sum"


def test_config_lists_match_the_registries() -> None:
    """The config's lists of built names (klppo.config.checks) are the algorithms' registries."""
    from klppo.algorithms.advantages import ADVANTAGE_ESTIMATORS
    from klppo.config.checks import IMPLEMENTED_ADV_ESTIMATORS, IMPLEMENTED_POLICY_LOSS_MODES

    assert set(IMPLEMENTED_ADV_ESTIMATORS) == set(ADVANTAGE_ESTIMATORS)
    assert set(IMPLEMENTED_POLICY_LOSS_MODES) == set(POLICY_LOSSES)


def test_train_refuses_unbuilt_loss_modes_and_passk_without_groups() -> None:
    from klppo.config import ConfigError, load_config
    from klppo.config.unimplemented import check_trainable

    quiet = {"notify": lambda _m: None}
    for mode in POLICY_LOSSES:
        cfg = load_config([f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}"], **quiet)
        check_trainable(cfg, **quiet)
    check_trainable(load_config(["actor_rollout_ref.actor.loss_scale_factor=512"], **quiet), **quiet)
    with pytest.raises(ConfigError, match="loss_mode='sapo': built are vanilla"):
        check_trainable(load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=sapo"], **quiet), **quiet)
    passk = ["algorithm.adv_estimator=grpo_passk", "actor_rollout_ref.rollout.n=1"]
    with pytest.raises(ConfigError, match="rollout.n >= 2"):
        check_trainable(load_config(passk, **quiet), **quiet)
