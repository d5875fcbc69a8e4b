"""reverse_linear_scan against a sequential loop; gae and reinforce_plus_plus against their former loops."""

import pytest
import torch

from klppo.algorithms.advantages import gae, reinforce_plus_plus
from klppo.algorithms.masked import as_bool_mask, compute_dtype, masked_whiten
from klppo.algorithms.scan import reverse_linear_scan

F64 = torch.float64
DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")]
    ),
]


def _loop_scan(x: torch.Tensor, coef: float | torch.Tensor) -> torch.Tensor:
    """y_t = x_t + a_t y_{t+1}, y_T = 0, one position at a time, float64."""
    x = x.to(F64)
    a = torch.broadcast_to(torch.as_tensor(coef, dtype=F64, device=x.device), x.shape)
    y = torch.zeros_like(x)
    nxt = torch.zeros(x.shape[:-1], dtype=F64, device=x.device)
    for t in reversed(range(x.shape[-1])):
        nxt = x[..., t] + a[..., t] * nxt
        y[..., t] = nxt
    return y


@torch.no_grad()
def _loop_gae(token_level_rewards, values, response_mask, gamma, lam):
    """klppo.algorithms.advantages.gae before the scan (the specification), unchanged."""
    dtype = compute_dtype(token_level_rewards, values)
    rewards, vals = token_level_rewards.to(dtype), values.to(dtype)
    mask = as_bool_mask(response_mask)
    batch, length = rewards.shape
    next_value = torch.zeros(batch, dtype=dtype, device=rewards.device)
    last_gae = torch.zeros_like(next_value)
    adv = torch.zeros_like(rewards)
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        candidate = delta + gamma * lam * last_gae
        next_value = torch.where(mask[:, t], vals[:, t], next_value)
        last_gae = torch.where(mask[:, t], candidate, last_gae)
        adv[:, t] = last_gae
    returns = torch.where(mask, adv + vals, 0.0)
    return masked_whiten(adv, mask), returns


@torch.no_grad()
def _loop_reinforce_plus_plus(token_level_rewards, response_mask, gamma=1.0):
    """klppo.algorithms.advantages.reinforce_plus_plus before the scan (the specification), unchanged."""
    dtype = compute_dtype(token_level_rewards)
    rewards = token_level_rewards.to(dtype)
    mask = as_bool_mask(response_mask)
    returns = torch.zeros_like(rewards)
    running = torch.zeros(rewards.shape[0], dtype=dtype, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = torch.where(mask[:, t], running, 0.0)
    returns = torch.where(mask, returns, 0.0)
    return masked_whiten(returns, mask), returns


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within 1e-5 (float32) or 1e-12 (float64) of the float64 reference, relative to its largest entry."""
    tol = 1e-12 if actual.dtype == F64 else 1e-5
    scale = expected.abs().max().item() if expected.numel() else 1.0
    torch.testing.assert_close(actual.to(F64), expected.to(F64), rtol=tol, atol=tol * max(scale, 1e-30))


def _mask(kind: str, b: int, t: int, gen: torch.Generator) -> torch.Tensor:
    """0/1 float mask [b, t]; every kind but "full" also has an all-masked row 0 (when b > 1)."""
    lengths = torch.randint(0, t + 1, (b,), generator=gen)
    pos = torch.arange(t)[None, :]
    if kind == "full":
        return torch.ones(b, t)
    if kind == "right_padded":
        m = pos < lengths[:, None]
    elif kind == "left_padded":
        m = pos >= t - lengths[:, None]
    elif kind == "holes":  # right-padded with holes in the middle of rows (multi-turn observations)
        m = (pos < lengths[:, None]) & (torch.rand(b, t, generator=gen) > 0.3)
    else:  # "sparse": few scattered tokens, both ends padded
        m = torch.rand(b, t, generator=gen) > 0.8
    m = m.float()
    if b > 1:
        m[0] = 0
    return m


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(
    ("b", "t", "chunk"),
    [(3, 0, 64), (3, 1, 64), (4, 64, 64), (5, 200, 64), (2, 130, 8), (3, 77, 2), (2, 50, 3)],
)
@pytest.mark.parametrize("coef", [0.0, 1.0, 0.95, -0.5, 1.05, "per_position"])
def test_scan_matches_loop(device: str, dtype: torch.dtype, b: int, t: int, chunk: int, coef) -> None:
    gen = torch.Generator().manual_seed(b * 1000 + t)
    x = torch.randn(b, t, generator=gen, dtype=F64)
    if coef == "per_position":  # values in [0, 1] with exact zeros and ones (cuts and pass-throughs)
        coef = torch.rand(b, t, generator=gen, dtype=F64)
        coef = torch.where(coef < 0.2, 0.0, torch.where(coef > 0.8, 1.0, coef)).to(device, dtype)
    y = reverse_linear_scan(x.to(device, dtype), coef, chunk=chunk)
    assert y.shape == x.shape and y.dtype == dtype and y.device.type == device
    _close(y, _loop_scan(x.to(device, dtype), coef))


def test_scan_leading_dims_and_bad_chunk() -> None:
    x = torch.randn(2, 3, 100, dtype=F64)
    coef = torch.rand(3, 100, dtype=F64)  # broadcast over the leading dim
    _close(reverse_linear_scan(x, coef, chunk=16), _loop_scan(x, coef))
    _close(reverse_linear_scan(x, 0.9, chunk=16), _loop_scan(x, 0.9))
    with pytest.raises(ValueError, match="chunk"):
        reverse_linear_scan(x, 0.9, chunk=1)


CASES = [(1, 1), (7, 9), (16, 64), (16, 200), (8, 257)]
MASKS = ["full", "right_padded", "left_padded", "holes", "sparse"]


def _inputs(b: int, t: int, kind: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    m = _mask(kind, b, t, gen)
    r = torch.randn(b, t, generator=gen, dtype=F64)
    v = torch.randn(b, t, generator=gen, dtype=F64)
    return r, v, m


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(("b", "t"), CASES)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.0, 0.5)])
def test_gae_matches_old_loop(device, dtype, b, t, kind, gamma, lam) -> None:
    r, v, m = _inputs(b, t, kind, seed=b * 100 + t)
    adv, ret = gae(r.to(device, dtype), v.to(device, dtype), m.to(device), gamma=gamma, lam=lam)
    adv_ref, ret_ref = _loop_gae(r.to(dtype).to(F64), v.to(dtype).to(F64), m, gamma, lam)
    assert adv.dtype == dtype and ret.dtype == dtype
    _close(ret, ret_ref)
    _close(adv, adv_ref)
    assert (adv[m.to(device) == 0] == 0).all() and (ret[m.to(device) == 0] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize(("b", "t"), CASES)
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("gamma", [1.0, 0.95, 0.0])
def test_reinforce_plus_plus_matches_old_loop(device, dtype, b, t, kind, gamma) -> None:
    r, _, m = _inputs(b, t, kind, seed=b * 100 + t + 1)
    adv, ret = reinforce_plus_plus(r.to(device, dtype), m.to(device), gamma=gamma)
    adv_ref, ret_ref = _loop_reinforce_plus_plus(r.to(dtype).to(F64), m, gamma)
    assert adv.dtype == dtype and ret.dtype == dtype
    _close(ret, ret_ref)
    _close(adv, adv_ref)


@pytest.mark.parametrize("kind", ["holes", "left_padded"])
def test_long_rows_two_levels_of_blocks(kind: str) -> None:
    # T > 64·64: the blocks' first values are themselves scanned in blocks
    r, v, m = _inputs(3, 4200, kind, seed=7)
    for got, want in zip(gae(r, v, m, gamma=0.999, lam=0.99), _loop_gae(r, v, m, 0.999, 0.99)):
        _close(got, want)
    for got, want in zip(reinforce_plus_plus(r, m, gamma=0.999), _loop_reinforce_plus_plus(r, m, 0.999)):
        _close(got, want)


def test_garbage_at_masked_positions_never_reaches_a_result() -> None:
    r, v, m = _inputs(6, 70, "holes", seed=3)
    dirty_r = torch.where(m.bool(), r, torch.nan)
    dirty_v = torch.where(m.bool(), v, torch.inf)
    for got, want in zip(gae(dirty_r, dirty_v, m, 0.99, 0.95), gae(r, v, m, 0.99, 0.95)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for got, want in zip(reinforce_plus_plus(dirty_r, m, 0.99), reinforce_plus_plus(r, m, 0.99)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_empty_response_length() -> None:
    r = torch.zeros(4, 0)
    for adv, ret in (gae(r, r, r, 0.99, 0.95), reinforce_plus_plus(r, r, 0.99)):
        assert adv.shape == ret.shape == (4, 0)
