import math

import pytest
import torch

from klppo.algorithms.kl_control import AdaptiveKLController, FixedKLController, make_kl_controller


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
