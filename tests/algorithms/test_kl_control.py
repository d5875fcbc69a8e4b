import math

import pytest
import torch

from klppo.algorithms.kl_control import (
    AdaptiveKLController,
    FixedKLController,
    PenaltyShareWatch,
    PIKLController,
    TargetSchedule,
    make_kl_controller,
)


def _reference_adaptive(beta: float, target: float, horizon: int, kls: list[float], n: int) -> list[float]:
    out = []
    for kl in kls:
        err = kl / target - 1.0
        err = 0.2 if err > 0.2 else (-0.2 if err < -0.2 else err)
        beta = beta * (1.0 + err * n / horizon)
        out.append(beta)
    return out


def test_fixed_controller() -> None:
    c = FixedKLController(0.03)
    c.update(10.0, 256)
    assert c.value == 0.03
    d = FixedKLController(1.0)
    d.load_state_dict(c.state_dict())
    assert d.value == 0.03


def test_adaptive_controller_follows_ziegler_rule() -> None:
    kls = [0.0, 0.05, 0.1, 0.11, 0.5, 3.0, 0.09]  # below, at, above target; clipped both ways
    c = AdaptiveKLController(init_kl_coef=0.2, target_kl=0.1, horizon=1000)
    got = []
    for kl in kls:
        c.update(torch.tensor(kl, dtype=torch.float64), n_steps=64)  # 0-dim tensors are accepted
        got.append(c.value)
    assert got == pytest.approx(_reference_adaptive(0.2, 0.1, 1000, kls, 64), rel=1e-12)
    assert got[0] == pytest.approx(0.2 * (1 - 0.2 * 64 / 1000))  # clipped at −0.2
    assert got[2] == pytest.approx(got[1])  # KL on target: β unchanged


def test_adaptive_state_survives_resume() -> None:
    kls = [0.3, 0.01, 0.2, 0.15]
    a = AdaptiveKLController(0.1, 0.1, 500)
    for kl in kls[:2]:
        a.update(kl, 32)
    b = AdaptiveKLController(0.1, 0.1, 500)  # fresh process after a checkpoint
    b.load_state_dict(a.state_dict())
    for kl in kls[2:]:
        a.update(kl, 32)
        b.update(kl, 32)
    assert b.value == a.value
    with pytest.raises(ValueError, match="type"):
        FixedKLController(0.1).load_state_dict(a.state_dict())


def test_controller_validation_and_factory() -> None:
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 0.1, 0)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 10)
    with pytest.raises(ValueError, match="non-finite"):
        AdaptiveKLController(0.1, 0.1, 10).update(math.nan, 4)
    assert isinstance(make_kl_controller("fixed", 0.01, None, 10000), FixedKLController)
    c = make_kl_controller("adaptive", 0.01, 6.0, 10000)
    assert isinstance(c, AdaptiveKLController) and (c.value, c.target, c.horizon) == (0.01, 6.0, 10000)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("adaptive", 0.01, None, 10000)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        make_kl_controller("pid", 0.01, 0.1, 10)


def _reference_pi(beta0, target, kp, ki, lo, hi, kls):
    """Float64 re-derivation of the PI rule on log β (numpy scalars, written independently); ``target`` is
    a number or one target per update."""
    import numpy as np

    b0, integral, out = np.float64(beta0), np.float64(0.0), []
    i_lo, i_hi = (np.log(lo) - np.log(b0)) / ki, (np.log(hi) - np.log(b0)) / ki
    targets = list(target) if isinstance(target, (list, tuple)) else [target] * len(kls)
    for kl, target in zip(kls, targets):
        err = np.clip(np.log(np.maximum(np.float64(kl), 1e-12 * target) / target), -1.0, 1.0)
        integral = np.clip(integral + err, i_lo, i_hi)
        out.append(float(np.exp(np.clip(np.log(b0) + kp * err + ki * integral, np.log(lo), np.log(hi)))))
    return out


def test_pi_controller_matches_float64_reference_over_many_updates() -> None:
    rng = torch.Generator().manual_seed(0)
    # 40 updates: KL ≈ 0 (early training, saturates at min_coef), around the target, spikes, zero
    kls = [0.0] * 8 + (0.05 * torch.rand(16, generator=rng, dtype=torch.float64) * 3).tolist()
    kls += [0.5, 2.0, 0.3, 0.04, 0.0, 0.06] + (0.05 + 0.01 * torch.randn(10, generator=rng)).abs().tolist()
    c = make_kl_controller("pi", 0.04, 0.05, kp=0.7, ki=0.3, min_coef=4e-3, max_coef=2.0)
    assert isinstance(c, PIKLController)
    got = []
    for kl in kls:
        c.update(kl, 256)
        got.append(c.value)
    assert len(got) >= 20
    assert got == pytest.approx(_reference_pi(0.04, 0.05, 0.7, 0.3, 4e-3, 2.0, kls), rel=1e-12)
    assert min(got) == pytest.approx(4e-3) and max(got) <= 2.0


def test_pi_controller_holds_target_on_a_drifting_plant_faster_than_adaptive() -> None:
    """A toy plant: the policy drifts away from the reference by ``a`` per step and the KL term pulls it
    back in proportion to β·KL. The PI controller settles within ±10% of the target in the second half;
    verl's adaptive rule (same start) is still far off there."""

    def run(ctrl, steps=200, a=0.004, b=0.8):
        kl, trace = 0.0, []
        for _ in range(steps):
            ctrl.update(kl, 256)
            kl = max(0.0, kl + a - b * ctrl.value * kl)
            trace.append(kl)
        return trace

    target = 0.05
    pi = run(make_kl_controller("pi", 0.01, target, kp=1.0, ki=0.2, min_coef=1e-3, max_coef=10.0))
    second = pi[100:]
    assert all(abs(k / target - 1) < 0.1 for k in second), second[:10]
    adaptive = run(make_kl_controller("adaptive", 0.01, target, horizon=10000))
    assert sum(adaptive[100:]) / 100 > 1.5 * target  # the horizon-scaled rule has not caught up


def test_pi_state_survives_resume_and_validation() -> None:
    kls = [0.0, 0.01, 0.2, 0.08, 0.05, 0.03]
    a = make_kl_controller("pi", 0.1, 0.05, min_coef=1e-3, max_coef=5.0)
    for kl in kls[:3]:
        a.update(kl)
    b = make_kl_controller("pi", 0.1, 0.05, min_coef=1e-3, max_coef=5.0)
    b.load_state_dict(a.state_dict())
    for kl in kls[3:]:
        a.update(kl)
        b.update(kl)
    assert (b.value, b.integral) == (a.value, a.integral)
    with pytest.raises(ValueError, match="type"):
        AdaptiveKLController(0.1, 0.1, 500).load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="min_coef"):
        make_kl_controller("pi", 0.1, 0.05, min_coef=0.2)
    with pytest.raises(ValueError, match="target_kl"):
        make_kl_controller("pi", 0.1, 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        a.update(math.inf)


def test_penalty_share_watch() -> None:
    w = PenaltyShareWatch(threshold=1.0, patience=3)
    fired = [w.update(s) for s in [2.0, 2.0, 0.5, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0]]
    assert fired == [False, False, False, False, False, True, False, False, True]


def _reference_schedule(start: float, final: float, begin: int, steps: int, n: int) -> list[float]:
    """The annealed target by hand: hold ``start`` for ``begin`` updates, then exp of a straight line in
    log space from ln start to ln final over ``steps`` updates, then ``final``."""
    out = []
    for t in range(n):
        if t < begin:
            out.append(start)
        elif t < begin + steps:
            frac = (t - begin) / steps
            out.append(math.exp((1 - frac) * math.log(start) + frac * math.log(final)))
        else:
            out.append(final)
    return out


def test_target_schedule_holds_decays_geometrically_and_ends_at_target() -> None:
    sched = TargetSchedule(0.05, start=0.2, begin=3, steps=4)
    got = [sched.at(t) for t in range(10)]
    assert got == pytest.approx(_reference_schedule(0.2, 0.05, 3, 4, 10), rel=1e-14)
    assert got[:3] == [0.2] * 3 and got[3] == 0.2 and got[5] == pytest.approx(0.1)  # halfway: √(0.2·0.05)
    assert got[7:] == [0.05] * 3
    assert [TargetSchedule(0.05).at(t) for t in (0, 9)] == [0.05, 0.05]  # no start: constant
    assert [TargetSchedule(0.05, start=0.2, begin=2).at(t) for t in (1, 2)] == [0.2, 0.05]  # steps 0: a jump
    with pytest.raises(ValueError, match="start"):
        TargetSchedule(0.05, start=0.0)
    with pytest.raises(ValueError, match="anneal"):
        TargetSchedule(0.05, start=0.1, steps=-1)


def test_annealed_controllers_match_float64_reference_over_many_updates() -> None:
    rng = torch.Generator().manual_seed(3)
    kls = (0.3 * torch.rand(30, generator=rng, dtype=torch.float64)).tolist()
    targets = _reference_schedule(0.25, 0.08, 8, 12, len(kls))
    pi = make_kl_controller(
        "pi",
        0.04,
        0.08,
        kp=0.3,
        ki=0.05,
        min_coef=0.02,
        max_coef=1.0,
        target_kl_start=0.25,
        anneal_begin=8,
        anneal_steps=12,
    )
    got, seen = [], []
    for kl in kls:
        pi.update(kl, 256)
        got.append(pi.value)
        seen.append(pi.target)
    assert seen == pytest.approx(targets, rel=1e-14)
    assert got == pytest.approx(_reference_pi(0.04, targets, 0.3, 0.05, 0.02, 1.0, kls), rel=1e-12)
    ad = make_kl_controller(
        "adaptive", 0.04, 0.08, 500, target_kl_start=0.25, anneal_begin=8, anneal_steps=12
    )
    beta, ref = 0.04, []
    for kl, target in zip(kls, targets):
        ad.update(kl, 64)
        beta = _reference_adaptive(beta, target, 500, [kl], 64)[0]
        ref.append(beta)
        assert ad.value == pytest.approx(beta, rel=1e-12)
    assert ref[0] != ref[8]  # the run covered the hold, the decay and the final target


def test_annealed_state_resumes_mid_decay_and_old_states_are_refused() -> None:
    kls = [0.0, 0.1, 0.3, 0.2, 0.15, 0.1, 0.12, 0.09]
    args = dict(min_coef=0.01, max_coef=1.0, target_kl_start=0.3, anneal_begin=2, anneal_steps=4)
    for kind in ("pi", "adaptive"):
        a = make_kl_controller(kind, 0.05, 0.08, 1000, **args)
        for kl in kls[:4]:  # into the decay
            a.update(kl, 8)
        b = make_kl_controller(kind, 0.05, 0.08, 1000, **args)
        b.load_state_dict(a.state_dict())
        assert (b.updates, b.target) == (4, a.target)
        for kl in kls[4:]:
            a.update(kl, 8)
            b.update(kl, 8)
            assert (b.value, b.target) == (a.value, a.target)
        old = {k: v for k, v in a.state_dict().items() if k != "updates"}  # saved before the anneal keys
        with pytest.raises(ValueError, match="update count"):
            make_kl_controller(kind, 0.05, 0.08, 1000, **args).load_state_dict(old)
        plain = make_kl_controller(kind, 0.05, 0.08, 1000, min_coef=0.01, max_coef=1.0)
        plain.load_state_dict(old)
        assert plain.updates == 0 and plain.value == a.value
    with pytest.raises(ValueError, match="adaptive or pi"):
        make_kl_controller("fixed", 0.05, None, target_kl_start=0.3)
