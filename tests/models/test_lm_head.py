"""Float32 logits from a bf16 LM head: values, gradients, and the model surgery."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from klppo.models.lm_head import FP32LogitsLinear, fp32_lm_head, fp32_logits_linear
from klppo.models.tiny import build_tiny_model

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_values_and_gradients_against_float64(device) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=g) * 2).to(device, torch.bfloat16).requires_grad_()
    w = torch.randn(97, 64, generator=g).to(device, torch.bfloat16).requires_grad_()
    out = fp32_logits_linear(x, w)
    exact = x.detach().double() @ w.detach().double().t()
    assert out.dtype == torch.float32 and out.shape == (3, 5, 97)
    # float32 result of the bf16 operands: relative error ~1e-6, where a bf16 result is ~4e-3
    assert ((out.double() - exact).abs() / exact.abs().clamp(min=1)).max() < 1e-5
    bf16 = F.linear(x.detach(), w.detach()).double()
    assert ((bf16 - exact).abs() / exact.abs().clamp(min=1)).max() > 1e-4  # the rounding it removes
    upstream = torch.randn(3, 5, 97, generator=g).to(device)
    out.backward(upstream)
    g64 = upstream.double()
    ref_x = g64 @ w.detach().double()
    ref_w = g64.reshape(-1, 97).t() @ x.detach().double().reshape(-1, 64)
    assert x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad.double(), ref_x, atol=0.05, rtol=0.02)
    torch.testing.assert_close(w.grad.double(), ref_w, atol=0.05, rtol=0.02)


def test_model_surgery_keeps_parameters_and_improves_log_probs() -> None:
    model = build_tiny_model(arch="qwen2").eval()  # tied embeddings
    plain = build_tiny_model(arch="qwen2").eval()
    plain.load_state_dict(model.state_dict())
    for m in (model, plain):
        m.to(torch.bfloat16)
    keys = list(model.state_dict())
    assert fp32_lm_head(model)
    assert isinstance(model.lm_head, FP32LogitsLinear) and list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tying kept
    exact = build_tiny_model(arch="qwen2").eval()
    exact.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    exact.double()
    ids = torch.randint(3, 200, (4, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(input_ids=ids).logits
        base = plain(input_ids=ids).logits
        truth = torch.log_softmax(exact(input_ids=ids).logits, -1)
    assert ours.dtype == torch.float32 and base.dtype == torch.bfloat16
    err_ours = (torch.log_softmax(ours.double(), -1) - truth).abs().mean()
    err_base = (torch.log_softmax(base.double(), -1) - truth).abs().mean()
    assert err_ours < err_base
    # float32 models and heads with a bias are left alone
    fp32 = build_tiny_model(arch="llama").eval()
    assert fp32_lm_head(fp32) and fp32(input_ids=ids).logits.dtype == torch.float32
    biased = torch.nn.Module()
    biased.get_output_embeddings = lambda: torch.nn.Linear(4, 4)
    assert not fp32_lm_head(biased)


def _stats64(x, w, labels, temperature):
    z = (x.double() @ w.double().t()) / temperature
    logp = torch.log_softmax(z, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_rows", [None, 3])  # one chunk; several with a partial last one
def test_fused_token_stats_against_float64_and_unfused(temperature, chunk_rows) -> None:
    """Chunked log-prob/entropy (fp32) = the float64 truth and the unfused [N, V] computation within 1e-6
    (absolute + relative); gradients (x and W, both outputs weighted) equal the unfused ones and are as
    close to the float64 ones."""
    from klppo.batching.packing import log_probs_from_logits
    from klppo.models.lm_head import token_log_probs_entropy

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 7, 32, generator=g).requires_grad_()
    w = (0.3 * torch.randn(97, 32, generator=g)).requires_grad_()
    labels = torch.randint(0, 97, (2, 7), generator=g)
    up_lp, up_h = torch.randn(2, 7, generator=g), torch.randn(2, 7, generator=g)

    stats = token_log_probs_entropy(x, w, labels, temperature=temperature, chunk_rows=chunk_rows)
    assert stats.shape == (2, 7, 2) and stats.dtype == torch.float32
    (stats[..., 0] * up_lp + stats[..., 1] * up_h).sum().backward()
    fused = (stats.detach(), x.grad.clone(), w.grad.clone())
    x.grad = w.grad = None

    lp, h = log_probs_from_logits(fp32_logits_linear(x, w), labels, temperature, calculate_entropy=True)
    (lp * up_lp + h * up_h).sum().backward()
    unfused = (torch.stack([lp, h], -1).detach(), x.grad.clone(), w.grad.clone())

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp64, h64 = _stats64(x64, w64, labels, temperature)
    (lp64 * up_lp.double() + h64 * up_h.double()).sum().backward()
    truth = (torch.stack([lp64, h64], -1).detach(), x64.grad, w64.grad)
    # values: within 1e-6 of the float64 truth and of the unfused computation
    torch.testing.assert_close(fused[0].double(), truth[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused[0], unfused[0], rtol=1e-6, atol=1e-6)
    # gradients (sums over rows and vocabulary in float32): as close to the truth as the unfused ones
    for ours, plain, exact in zip(fused[1:], unfused[1:], truth[1:]):
        torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6)
        err, err_plain = (ours.double() - exact).abs().max(), (plain.double() - exact).abs().max()
        assert err <= 2 * err_plain + 1e-6 and err < 1e-5 * exact.abs().max() + 1e-6, (err, err_plain)


def test_fused_token_stats_bf16_and_without_entropy() -> None:
    """bf16 operands: float32 results as the unfused fp32-logits head gives them; without entropy the
    entropy column is 0 and the log-prob gradient is unchanged."""
    from klppo.batching.packing import log_probs_from_logits
    from klppo.models.lm_head import token_log_probs_entropy

    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 64, generator=g).to(torch.bfloat16).requires_grad_()
    w = (0.2 * torch.randn(150, 64, generator=g)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, 150, (9,), generator=g)
    stats = token_log_probs_entropy(x, w, labels, with_entropy=False, chunk_rows=4)
    assert (stats[:, 1] == 0).all()
    stats[:, 0].sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    lp, _ = log_probs_from_logits(fp32_logits_linear(x, w), labels)
    lp.sum().backward()
    torch.testing.assert_close(stats[:, 0].detach(), lp.detach(), rtol=0, atol=1e-5)
    assert gx.dtype == gw.dtype == torch.bfloat16
    torch.testing.assert_close(gx.float(), x.grad.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(gw.float(), w.grad.float(), rtol=0.02, atol=0.02)
    with pytest.raises(ValueError, match="labels"):
        token_log_probs_entropy(x, w, labels[:3])


@pytest.mark.parametrize("packed", [True, False])
def test_fused_forward_log_probs_equal_unfused(packed) -> None:
    """The model path: forward_log_probs with the fused head = without, values and every parameter's
    gradient (fp32, tied head), packed and padded; the head is back to logits afterwards."""
    from klppo.batching.attention import enable_packed_attention
    from klppo.batching.packing import forward_log_probs

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    B, P, R = 3, 5, 6
    ids = torch.randint(3, 300, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    mask[0, :2] = 0
    mask[1, P + 3 :] = 0
    up = torch.randn(B, R, 2, generator=g)
    results = []
    for fused in (False, True):
        model = build_tiny_model(arch="qwen2", seed=0)
        enable_packed_attention(model)
        assert fp32_lm_head(model)
        lp, h = forward_log_probs(
            model,
            ids,
            mask,
            None,
            response_length=R,
            temperature=0.8,
            use_remove_padding=packed,
            calculate_entropy=True,
            fused=fused,
        )
        (lp * up[..., 0] + h * up[..., 1]).sum().backward()
        results.append((lp.detach(), h.detach(), [p.grad.clone() for p in model.parameters()]))
        assert model.lm_head.token_stats is None and model(input_ids=ids[:, :4]).logits.shape[-1] > 2
    (lp0, h0, g0), (lp1, h1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(h1, h0, rtol=1e-6, atol=1e-6)  # H ≈ log V ≈ 6
    assert (lp1[1, 3:] == 0).all() and (h1[1, 3:] == 0).all()
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _eager_and_compiled(x, w, labels, up, **kwargs) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``token_log_probs_entropy(x, w, labels, **kwargs)`` eager then compiled: each run's statistics and the
    gradients of x and W of ``(stats * up).sum()``."""
    from klppo.models.lm_head import token_log_probs_entropy

    runs = []
    for fast in (False, True):
        stats = token_log_probs_entropy(x, w, labels, compile_stats=fast, **kwargs)
        (stats * up).sum().backward()
        runs.append((stats.detach(), x.grad.clone(), w.grad.clone()))
        x.grad = w.grad = None
    return runs


@pytest.fixture
def aot_eager(monkeypatch):
    """The statistics compiled with the ``aot_eager`` backend: traced, marked and partitioned as Inductor gets
    them, without Inductor's ≈ 30 s cold start on CPU; Inductor's kernels are checked on CUDA
    (:func:`test_compiled_statistics_on_cuda`)."""
    from klppo.models import lm_head

    real, cached = torch.compile, lm_head.compiled  # a test may patch lm_head.compiled in its turn
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, **{"backend": "aot_eager", **kw}))
    cached.cache_clear()
    torch._dynamo.reset()
    yield
    cached.cache_clear()
    torch._dynamo.reset()


def test_compiled_statistics_equal_eager_values_and_gradients(aot_eager) -> None:
    """``use_torch_compile``: the compiled chunk statistics and gradient (``aot_eager`` on CPU) = the eager
    in-place ones within float32 rounding — log-prob and entropy within 1e-6, gradients of x and W as
    close to the float64 truth — over several chunks with a partial last one (one compilation for every
    row count), with a temperature; bf16 operands give bf16 gradients equal to eager's."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 32, generator=g).requires_grad_()
    w = (0.3 * torch.randn(97, 32, generator=g)).requires_grad_()
    labels = torch.randint(0, 97, (2, 7), generator=g)
    up = torch.randn(2, 7, 2, generator=g)
    runs = _eager_and_compiled(x, w, labels, up, temperature=0.7, chunk_rows=3)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    lp64, h64 = _stats64(x64, w64, labels, 0.7)
    (lp64 * up[..., 0].double() + h64 * up[..., 1].double()).sum().backward()
    (eager, fast) = runs
    torch.testing.assert_close(fast[0], eager[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fast[0].double(), torch.stack([lp64, h64], -1), rtol=1e-6, atol=1e-6)
    for ours, plain, exact in zip(fast[1:], eager[1:], (x64.grad, w64.grad)):
        torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6)
        err, err_plain = (ours.double() - exact).abs().max(), (plain.double() - exact).abs().max()
        assert err <= 2 * err_plain + 1e-6, (err, err_plain)

    xb = x.detach()[0].to(torch.bfloat16).requires_grad_()
    wb = w.detach().to(torch.bfloat16).requires_grad_()
    grads = _eager_and_compiled(xb, wb, labels[0], up[0], temperature=0.7, chunk_rows=4)
    assert grads[1][1].dtype == grads[1][2].dtype == torch.bfloat16
    torch.testing.assert_close(grads[1][0], grads[0][0], rtol=1e-6, atol=1e-6)
    for a, b in zip(grads[1][1:], grads[0][1:]):  # one bf16 rounding of dz apart at most
        torch.testing.assert_close(a.float(), b.float(), rtol=0.02, atol=1e-3)


@pytest.mark.parametrize("fused, packed", [(True, True), (False, True), (False, False)])
def test_compiled_statistics_in_the_model_path(monkeypatch, aot_eager, fused, packed) -> None:
    """A head set by ``compile_token_stats`` runs the compiled statistics where ``compiles_on`` says so
    (CUDA in a run; forced on CPU here): the fused head in forward and backward, the unfused head in
    no-grad passes only (with autograd the eager path), packed rows and padded ones (3-D logits, a strided
    slice) — the same log-probs and entropy as without, and the same gradients; not on CPU by default; a
    head that is not FP32LogitsLinear is left alone."""
    from klppo.batching.attention import enable_packed_attention
    from klppo.batching.packing import forward_log_probs
    from klppo.models import lm_head

    calls = []
    real = lm_head.compiled

    def counting(fn):
        calls.append(fn.__name__)
        return real(fn)

    monkeypatch.setattr(lm_head, "compiled", counting)  # the one place both heads call it through
    g = torch.Generator().manual_seed(4)
    B, P, R = 2, 4, 5
    ids = torch.randint(3, 300, (B, P + R), generator=g)
    mask = torch.ones(B, P + R, dtype=torch.long)
    mask[1, P + 3 :] = 0
    model = build_tiny_model(arch="qwen2", seed=0)
    enable_packed_attention(model)
    assert fp32_lm_head(model) and lm_head.compile_token_stats(model, True) and lm_head.stats_compiled(model)

    def run(grad: bool):
        with torch.set_grad_enabled(grad):
            lp, h = forward_log_probs(
                model,
                ids,
                mask,
                None,
                response_length=R,
                temperature=0.9,
                use_remove_padding=packed,
                calculate_entropy=True,
                fused=fused,
            )
        if grad:
            (lp + 0.5 * h).sum().backward()
        out = (
            lp.detach(),
            h.detach(),
            [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        )
        model.zero_grad(set_to_none=True)
        return out

    eager = [run(False), run(True)]
    assert calls == []  # CPU: compiled only where compiles_on says so
    monkeypatch.setattr(lm_head, "compiles_on", lambda t: True)
    fast = [run(False), run(True)]
    expected = ["chunk_stats"] * 2 + ["chunk_grad"] if fused else ["chunk_stats"]
    assert calls == expected, calls
    for a, b in zip(fast, eager):
        torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(a[1], b[1], rtol=1e-6, atol=1e-6)
        for ga, gb in zip(a[2], b[2]):
            assert (ga is None) == (gb is None)
            if ga is not None:
                torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-6)
    plain = torch.nn.Module()
    plain.get_output_embeddings = lambda: torch.nn.Linear(4, 4, bias=False)
    assert not lm_head.compile_token_stats(plain, True) and not lm_head.stats_compiled(plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_statistics_on_cuda(dtype) -> None:
    """On CUDA (the path runs use): the compiled chunk statistics and gradient against the eager ones,
    several chunks with a partial last one, and the unfused no-grad path against eager."""
    from klppo.batching.packing import log_probs_from_logits

    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(3000, 64, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (0.3 * torch.randn(5003, 64, device="cuda", generator=g)).to(dtype).requires_grad_()
    labels = torch.randint(0, 5003, (3000,), device="cuda", generator=g)
    up = torch.randn(3000, 2, device="cuda", generator=g)
    runs = _eager_and_compiled(x, w, labels, up, temperature=0.9, chunk_rows=1024)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(runs[1][1:], runs[0][1:]):
        torch.testing.assert_close(a.float(), b.float(), **tol)
    with torch.no_grad():
        logits = fp32_logits_linear(x, w)
        eager = log_probs_from_logits(logits, labels, 0.9, calculate_entropy=True)
        fast = log_probs_from_logits(logits, labels, 0.9, calculate_entropy=True, compile_stats=True)
    for a, b in zip(fast, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_compiled_statistics_compile_once_for_any_row_count_and_per_vocabulary() -> None:
    """``compiled``: chunks of 3, 4 and 5 rows (and 3-D padded logits of any batch and length) share one
    compilation; another vocabulary size compiles again (V is a constant of the kernels, not a symbol)."""
    from torch._dynamo.testing import CompileCounter

    from klppo.models import lm_head

    counter = CompileCounter()
    real_compile = torch.compile
    torch._dynamo.reset()  # earlier tests' compilations of chunk_stats would otherwise be found
    try:
        torch.compile = lambda fn, **kw: real_compile(fn, backend=counter, **kw)
        lm_head.compiled.cache_clear()
        fast = lm_head.compiled(lm_head.chunk_stats)
        g = torch.Generator().manual_seed(6)
        for rows in (3, 4, 5):
            z = torch.randn(rows, 97, generator=g)
            labels = torch.randint(0, 97, (rows,), generator=g)
            lse, lp, h = fast(z, labels, 1.0, True)
            torch.testing.assert_close(lp, torch.log_softmax(z, -1).gather(-1, labels[:, None])[:, 0])
        assert counter.frame_count == 1
        fast(torch.randn(6, 101, generator=g), torch.randint(0, 101, (6,), generator=g), 1.0, True)
        assert counter.frame_count == 2
        for b, r in ((2, 5), (3, 7)):
            fast(torch.randn(b, r, 97, generator=g), torch.randint(0, 97, (b, r), generator=g), 1.0, True)
        assert counter.frame_count == 3
    finally:
        torch.compile = real_compile
        lm_head.compiled.cache_clear()
