import math

import pytest
import torch

from klppo.algorithms.kl import KL_KINDS, apply_kl_penalty, kl_penalty, kl_penalty_full
from klppo.algorithms.kl_control import FixedKLController

from . import reference as ref

BASE_KINDS = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]


def _log_probs(gen: torch.Generator, shape=(4, 9)) -> tuple[torch.Tensor, torch.Tensor]:
    lp = -torch.rand(shape, generator=gen, dtype=torch.float64) * 5
    rp = -torch.rand(shape, generator=gen, dtype=torch.float64) * 5
    # extreme log-ratios: ±50 and beyond the k3 clamp
    lp[0, 0], rp[0, 0] = 0.0, -50.0
    lp[0, 1], rp[0, 1] = -50.0, 0.0
    lp[1, 2], rp[1, 2] = -1.0, -23.0
    return lp, rp


@pytest.mark.parametrize("kind", BASE_KINDS + [k + "+" for k in BASE_KINDS])
def test_kl_penalty_values_and_plus_gradients(kind: str) -> None:
    gen = torch.Generator().manual_seed(0)
    lp, rp = _log_probs(gen)
    lp.requires_grad_(True)
    rp.requires_grad_(True)
    out = kl_penalty(lp, rp, kind)
    base = kind.rstrip("+")
    expected = [
        [ref.kl_estimate(a, b, base) for a, b in zip(ra, rb)] for ra, rb in zip(ref.rows(lp), ref.rows(rp))
    ]
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    weights = torch.rand(lp.shape, generator=gen, dtype=torch.float64)
    g_lp, g_rp = torch.autograd.grad((out * weights).sum(), (lp, rp))
    diff = (lp - rp).detach()
    if kind.endswith("+") or base in ("mse", "k2"):
        # straight-through: k2's gradient, ∂/∂lp ½(lp − rp)² = lp − rp
        torch.testing.assert_close(g_lp, weights * diff)
        torch.testing.assert_close(g_rp, -weights * diff)
    elif base in ("kl", "k1"):
        torch.testing.assert_close(g_lp, weights)
    assert torch.isfinite(g_lp).all() and torch.isfinite(g_rp).all()


def test_k3_gradient_inside_clamp() -> None:
    lp = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64, requires_grad=True)
    rp = torch.tensor([-1.5, -1.0, -3.0], dtype=torch.float64)
    (g,) = torch.autograd.grad(kl_penalty(lp, rp, "k3").sum(), lp)
    # d/dlp [e^{rp−lp} − (rp − lp) − 1] = 1 − e^{rp−lp}
    torch.testing.assert_close(g, 1 - torch.exp(rp - lp.detach()))


def test_kl_penalty_errors() -> None:
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="kl_penalty_full"):
        kl_penalty(x, x, "full")
    with pytest.raises(ValueError, match="low_var_kl"):
        kl_penalty(x, x, "k4")
    assert "full" in KL_KINDS and "k3+" in KL_KINDS


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kl_penalty_low_precision(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    lp, rp = _log_probs(gen)
    lp_lo, rp_lo = lp.to(dtype), rp.to(dtype)
    for kind in ("k1", "k2", "k3", "abs", "k3+"):
        out = kl_penalty(lp_lo, rp_lo, kind)
        assert out.dtype == torch.float32
        expected = [
            [ref.kl_estimate(a, b, kind.rstrip("+")) for a, b in zip(ra, rb)]
            for ra, rb in zip(ref.rows(lp_lo), ref.rows(rp_lo))
        ]
        torch.testing.assert_close(
            out.double(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5, atol=1e-5
        )


def _full_kl_reference(z: torch.Tensor, w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(z.shape[:2], dtype=torch.float64)
    for i in range(z.shape[0]):
        for t in range(z.shape[1]):
            if m[i, t]:
                p = ref.softmax_row(z[i, t].double().tolist())
                q = ref.softmax_row(w[i, t].double().tolist())
                out[i, t] = sum(a * (math.log(a) - math.log(b)) for a, b in zip(p, q))
    return out


def test_kl_penalty_full_values_chunks_and_gradients() -> None:
    gen = torch.Generator().manual_seed(2)
    z = torch.randn(3, 4, 11, generator=gen, dtype=torch.float64) * 3
    w = torch.randn(3, 4, 11, generator=gen, dtype=torch.float64) * 3
    m = ref.make_mask(3, 4, gen)
    expected = _full_kl_reference(z, w, m)
    for chunk in (None, 1, 5, 100):
        torch.testing.assert_close(
            kl_penalty_full(z, w, m, chunk_rows=chunk), expected, rtol=1e-10, atol=1e-12
        )
    # gradients: analytic chunked backward vs finite differences, both inputs
    zz = z[:2, :3, :5].clone().requires_grad_(True)
    ww = w[:2, :3, :5].clone().requires_grad_(True)
    mm = torch.ones(2, 3)
    assert torch.autograd.gradcheck(lambda a, b: kl_penalty_full(a, b, mm, chunk_rows=2), (zz, ww))
    # bf16 logits: float32 result, gradient in the input dtype
    zb = z.to(torch.bfloat16).requires_grad_(True)
    out = kl_penalty_full(zb, w.to(torch.bfloat16), m)
    assert out.dtype == torch.float32
    ref_b = _full_kl_reference(zb.detach(), w.to(torch.bfloat16), m)
    torch.testing.assert_close(out.double(), ref_b, rtol=1e-4, atol=1e-5)
    out.sum().backward()
    assert zb.grad.dtype == torch.bfloat16 and torch.isfinite(zb.grad.float()).all()
    with pytest.raises(ValueError, match="response_mask"):
        kl_penalty_full(z, w, m[:, :2])


def test_apply_kl_penalty_matches_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    b, t = 6, 7
    lp, rp = _log_probs(gen, (b, t))
    m = ref.make_mask(b, t, gen)
    scores = torch.zeros(b, t, dtype=torch.float64)
    scores[:, 3] = torch.randn(b, generator=gen, dtype=torch.float64)
    beta = 0.05
    for kind in ("k1", "low_var_kl", "k3+"):
        rewards, stats = apply_kl_penalty(scores, lp, rp, m, FixedKLController(beta), kind)
        per_row = []
        for i in range(b):
            kls = [ref.kl_estimate(lp[i, j].item(), rp[i, j].item(), kind.rstrip("+")) for j in range(t)]
            for j in range(t):
                exp = scores[i, j].item() - (beta * kls[j] if m[i, j] else 0.0)
                assert rewards[i, j].item() == pytest.approx(exp, rel=1e-12, abs=1e-12)
            valid = [k for k, mk in zip(kls, m[i].tolist()) if mk]
            per_row.append(ref.mean(valid))
        assert stats["kl"].dim() == 0 and stats["kl"].item() == pytest.approx(ref.mean(per_row), rel=1e-12)
        assert stats["kl_coef"].item() == pytest.approx(beta)
    # a plain float works as β; rewards carry no autograd graph
    rewards, _ = apply_kl_penalty(scores, lp.requires_grad_(True), rp, m, 0.1, "k2")
    assert not rewards.requires_grad


def test_sampled_estimator_names():
    from klppo.algorithms.kl import sampled_estimator

    assert [sampled_estimator(k) for k in ("low_var_kl", "k3+", "kl", "mse+", "full", "full+")] == [
        "low_var_kl",
        "k3",
        "kl",
        "mse",
        "low_var_kl",
        "low_var_kl",
    ]


def _expected_sampled_gradient(kind: str, z: torch.Tensor, q_log: torch.Tensor) -> torch.Tensor:
    """E_{y∼π}[∇_z estimator(log π(y), log π_ref(y))]: the gradient a KL loss on sampled tokens follows on
    average, computed exactly by weighting every token y with π(y) held fixed (on-policy samples)."""
    log_p = torch.log_softmax(z, dim=-1)
    per_token = kl_penalty(log_p, q_log, kind)
    weights = log_p.detach().exp()
    (grad,) = torch.autograd.grad((weights * per_token).sum(), z)
    return grad


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_which_kl_the_loss_gradient_follows(seed: int) -> None:
    """On-policy, a k2 (`mse`) KL loss follows ∇KL(π‖π_ref) (reverse KL, the one every KL metric estimates),
    a k3 (`low_var_kl`) loss follows ∇KL(π_ref‖π) (forward KL: mass-covering), a k1 loss has zero expected
    gradient; the `+` kinds follow k2. docs/algorithms.md states this; float64 against exact gradients."""
    gen = torch.Generator().manual_seed(seed)
    # moderate log-ratios: k3's clamp at 10 (π_ref/π > ~12) would cut the forward-KL gradient of a token
    z = torch.randn(7, generator=gen, dtype=torch.float64).requires_grad_(True)
    q_log = torch.log_softmax(torch.randn(7, generator=gen, dtype=torch.float64), dim=-1)
    assert kl_penalty(torch.log_softmax(z, -1), q_log, "low_var_kl").max() < 10

    def exact(direction: str) -> torch.Tensor:
        log_p = torch.log_softmax(z, dim=-1)
        if direction == "reverse":
            kl = (log_p.exp() * (log_p - q_log)).sum()
        else:
            kl = (q_log.exp() * (q_log - log_p)).sum()
        (g,) = torch.autograd.grad(kl, z)
        return g

    reverse, forward = exact("reverse"), exact("forward")
    assert (reverse - forward).abs().max() > 1e-3  # the two directions differ on this example
    for kind in ("mse", "k2", "low_var_kl+", "kl+"):
        torch.testing.assert_close(
            _expected_sampled_gradient(kind, z, q_log), reverse, rtol=1e-10, atol=1e-12
        )
    k3 = _expected_sampled_gradient("low_var_kl", z, q_log)
    torch.testing.assert_close(k3, forward, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        _expected_sampled_gradient("kl", z, q_log), torch.zeros_like(z), rtol=0, atol=1e-12
    )


def test_k3_on_tokens_the_reference_sampled_is_chi2_minus_reverse_kl() -> None:
    """docs/data.md, "KL to the reference": the k3 estimate's expectation over tokens sampled by π_ref (a log
    of the reference) is χ²(π_ref‖π_θ) − KL(π_ref‖π_θ), and over tokens the policy samples KL(π_θ‖π_ref)."""
    gen = torch.Generator().manual_seed(3)
    ref_lp = torch.log_softmax(torch.randn(40, generator=gen, dtype=torch.float64), 0)
    pol_lp = torch.log_softmax(0.8 * torch.randn(40, generator=gen, dtype=torch.float64), 0)
    k3 = kl_penalty(pol_lp, ref_lp, "low_var_kl")  # every token of the vocabulary, weighted exactly below
    assert float(k3.max()) < 10  # inside the per-token clamp
    p_ref, p_pol = ref_lp.exp(), pol_lp.exp()
    chi2 = float((p_ref**2 / p_pol).sum()) - 1.0
    kl_ref_pol = float((p_ref * (ref_lp - pol_lp)).sum())
    kl_pol_ref = float((p_pol * (pol_lp - ref_lp)).sum())
    assert float((p_ref * k3).sum()) == pytest.approx(chi2 - kl_ref_pol, rel=1e-12)
    assert float((p_pol * k3).sum()) == pytest.approx(kl_pol_ref, rel=1e-12)
    assert chi2 - kl_ref_pol > 2 * kl_pol_ref  # the logged-token figure runs far ahead of the policy's
