"""Float32 logits from a bf16/fp16 LM head, without a float32 copy of the weight.

A bf16 ``nn.Linear`` rounds every logit to bf16: at |logit| 16–32 one bf16 step is 0.125, so a token's
log-prob can move by up to 0.06 from rounding alone, and the rollout (which computes it once) and the
actor (which recomputes it) round differently. :func:`fp32_lm_head` makes the model's output projection
return float32 logits computed from the same bf16 operands: on CUDA one GEMM with a float32 output
(``torch.mm(..., out_dtype=torch.float32)``: bf16 inputs, float32 accumulation *and* result), elsewhere
an upcast matmul. The backward pass is the ordinary bf16 one (the float32 output gradient is rounded to
the weight dtype, as a bf16 layer's would be). Float32 models are untouched. The rollout engine's
``fp32_logits`` computes its logits the same way, so the two log-probs agree more closely
(``bench/logprob_precision.py``).

Fused token statistics (``model.use_fused_kernels``): inside :func:`token_stats_head` the same head returns,
instead of logits, the log-prob of a given label and the entropy of each row, ``[..., 2]`` float32,
computed chunk by chunk of rows (:func:`token_log_probs_entropy`): the float32 [rows, vocabulary] logits
exist for one chunk at a time, in the forward and again (recomputed) in the backward, never for all rows.
The head still runs inside the model's forward, so FSDP2 sees its weight gathered as usual.

Compiled statistics (``actor.use_torch_compile``, verl's key for its compiled log-prob/entropy helpers; on
CUDA): the per-chunk softmax statistics and their gradient as ``torch.compile``-d pure functions
(:func:`chunk_stats`, :func:`chunk_grad`) instead of eager in-place operations. Eagerly, each operation is
a pass over the float32 [rows, V] chunk (logsumexp, subtract, gather, exp, multiply, sum: ≈ 8 reads and
writes of 4 bytes per logit; the backward ≈ 10); compiled, the forward reads the chunk in one or two fused
reductions and the backward is one pointwise kernel that reads it and writes the bf16 gradient. The same
function serves the unfused head's no-grad passes (:func:`klppo.batching.packing.log_probs_from_logits`),
whose [rows, V] logits exist anyway. Same formulas; results equal to float32 rounding (tests).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_ELEMENTS = 2**28
"""Logit elements per chunk of the fused statistics: 1 GiB of float32 (≈ 1,770 rows at V = 151,936)."""


def _fp32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with a float32 result: one GEMM with a float32 output on CUDA, an upcast matmul elsewhere."""
    if a.is_cuda and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, fp32: bool) -> torch.Tensor:
    """``hidden @ weight.T`` ([..., hidden] × [V, hidden]) without autograd (the rollout engine's LM head);
    with ``fp32`` a float32 result from the same operands (module docstring), else the model's dtype."""
    if not fp32 or hidden.dtype == torch.float32:
        out = F.linear(hidden, weight)
        return out.float() if fp32 else out
    if hidden.is_cuda:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return torch.mm(flat, weight.t(), out_dtype=torch.float32).view(*hidden.shape[:-1], weight.shape[0])
    return F.linear(hidden.float(), weight.float())


class _FP32Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        out = _fp32_mm(x.reshape(-1, x.shape[-1]), weight.t())
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(weight.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = g.t() @ x.reshape(-1, x.shape[-1])
        return grad_x, grad_w


def fp32_logits_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as float32 from bf16/fp16 operands (see the module docstring); differentiable."""
    return _FP32Logits.apply(x, weight)


def chunk_stats(
    z: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For logits ``z`` [..., V] (any float dtype, computed in float32) and ``labels`` [...]: per row
    logsumexp(z/T), log softmax(z/T)[label] and the entropy −Σ p log p (zeros unless ``with_entropy``).
    Pure, for ``torch.compile`` (:func:`compiled`); the eager :class:`_TokenStats` computes the same."""
    z = z.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    log_prob = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return lse, log_prob, torch.zeros_like(lse)
    logp = z - lse.unsqueeze(-1)
    return lse, log_prob, -(logp.exp() * logp).sum(dim=-1)  # a sum of non-negative terms


def chunk_grad(
    z: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    g_lp: torch.Tensor,
    g_h: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """∂(g_lp·log p_label + g_h·H)/∂z for float32 logits ``z`` [r, V] (the formula of
    :meth:`_TokenStats.backward`), in ``dtype``. Pure, for ``torch.compile``."""
    if temperature != 1.0:
        z = z / temperature
    logp = z - lse.unsqueeze(-1)
    if with_entropy:
        coef = (logp + entropy.unsqueeze(-1)) * g_h.unsqueeze(-1) + g_lp.unsqueeze(-1)
    else:
        coef = g_lp.unsqueeze(-1)
    dz = -(logp.exp() * coef)
    vocab = torch.arange(z.shape[-1], device=z.device)
    dz = dz + torch.where(vocab == labels.unsqueeze(-1), g_lp.unsqueeze(-1), 0.0)
    if temperature != 1.0:
        dz = dz / temperature
    return dz.to(dtype)


def compiles_on(t: torch.Tensor) -> bool:
    """Whether a tensor's device runs the compiled statistics: CUDA (on CPU, Inductor's C++ compilation
    would cost more than it saves in a test-sized run)."""
    return t.is_cuda


@functools.cache
def compiled(fn: Callable) -> Callable:
    """``torch.compile(fn)`` for ``fn(z, *args)`` with ``z`` [..., V] first: every row dim symbolic (chunks
    and micro-batches of any row count share one compilation), the vocabulary static (the kernels index
    [rows, V] with a constant V: no division by a runtime size per element); created once per function."""
    inner = torch.compile(fn)

    def call(z: torch.Tensor, *args: Any) -> Any:
        _rows_dynamic(z, z.dim() - 1)
        for a in args:
            if isinstance(a, torch.Tensor):
                _rows_dynamic(a, a.dim())
        return inner(z, *args)

    return call


def _rows_dynamic(t: torch.Tensor, num_dims: int) -> None:
    """Mark ``t``'s first ``num_dims`` dims symbolic for ``torch.compile`` (a size-1 dim stays
    specialised)."""
    for dim in range(num_dims):
        torch._dynamo.maybe_mark_dynamic(t, dim)


class _TokenStats(torch.autograd.Function):
    """(log softmax(x Wᵀ / T)[label], entropy) per row, chunk by chunk; backward recomputes each chunk.

    With z = x Wᵀ / T, log p = z − logsumexp(z), H = −Σ p log p:
    ∂ log p_label / ∂z = onehot(label) − p and ∂H/∂z = −p ⊙ (log p + H).
    """

    @staticmethod
    def forward(ctx, x, weight, labels, temperature: float, chunk_rows: int, with_entropy: bool, fast: bool):
        flat = x.reshape(-1, x.shape[-1])
        lab = labels.reshape(-1)
        n = flat.shape[0]
        log_probs = torch.empty(n, dtype=torch.float32, device=x.device)
        entropy = torch.zeros(n, dtype=torch.float32, device=x.device)
        lse = torch.empty(n, dtype=torch.float32, device=x.device)
        for start in range(0, n, chunk_rows):
            rows = slice(start, start + chunk_rows)
            z = _fp32_mm(flat[rows], weight.t())
            if fast:
                lse[rows], log_probs[rows], entropy[rows] = compiled(chunk_stats)(
                    z, lab[rows], temperature, with_entropy
                )
                continue
            if temperature != 1.0:
                z.div_(temperature)
            lse[rows] = torch.logsumexp(z, dim=-1)
            logp = z.sub_(lse[rows].unsqueeze(-1))
            log_probs[rows] = logp.gather(-1, lab[rows].unsqueeze(-1)).squeeze(-1)
            if with_entropy:  # −Σ p log p: a sum of non-negative terms (no cancellation in float32)
                entropy[rows] = -(logp.exp() * logp).sum(dim=-1)
        ctx.save_for_backward(x, weight, lab, lse, entropy)
        ctx.temperature, ctx.chunk_rows, ctx.with_entropy, ctx.fast = (
            temperature,
            chunk_rows,
            with_entropy,
            fast,
        )
        ctx.weight_dtype = weight.dtype
        return torch.stack([log_probs, entropy], dim=-1).view(*x.shape[:-1], 2)

    @staticmethod
    def backward(ctx, grad):
        x, weight, lab, lse, entropy = ctx.saved_tensors
        temperature, chunk_rows = ctx.temperature, ctx.chunk_rows
        flat = x.reshape(-1, x.shape[-1])
        g = grad.reshape(-1, 2).float()
        g_lp, g_h = g[:, 0], g[:, 1]
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_x = torch.empty_like(flat) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, flat.shape[0], chunk_rows):
            rows = slice(start, start + chunk_rows)
            z = _fp32_mm(flat[rows], weight.t())
            if ctx.fast:
                dz = compiled(chunk_grad)(
                    z,
                    lse[rows],
                    entropy[rows],
                    g_lp[rows],
                    g_h[rows],
                    lab[rows],
                    temperature,
                    ctx.with_entropy,
                    weight.dtype,
                )
            else:
                dz = _eager_chunk_grad(z, lse[rows], entropy[rows], g_lp[rows], g_h[rows], lab[rows], ctx)
            if need_x:
                grad_x[rows] = (dz @ weight).to(grad_x.dtype)
            if need_w:
                grad_w += _fp32_mm(dz.t(), flat[rows])  # accumulated over chunks in float32
        return (
            None if grad_x is None else grad_x.view(x.shape),
            None if grad_w is None else grad_w.to(weight.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def _eager_chunk_grad(z, lse, entropy, g_lp, g_h, lab, ctx) -> torch.Tensor:
    """:func:`chunk_grad`, eager and in place on the chunk ``z`` (no second [r, V] float32 tensor)."""
    if ctx.temperature != 1.0:
        z.div_(ctx.temperature)
    logp = z.sub_(lse.unsqueeze(-1))
    p = logp.exp()
    # ∂/∂z = g_lp·(onehot − p) − g_h·p·(log p + H) = −p·(g_lp + g_h·(log p + H)) + g_lp·onehot
    coef = logp
    if ctx.with_entropy:
        coef.add_(entropy.unsqueeze(-1)).mul_(g_h.unsqueeze(-1))
        coef.add_(g_lp.unsqueeze(-1))
    else:
        coef.copy_(g_lp.unsqueeze(-1).expand_as(coef))
    dz = p.mul_(coef).neg_()
    dz.scatter_add_(-1, lab.unsqueeze(-1), g_lp.unsqueeze(-1))
    if ctx.temperature != 1.0:
        dz.div_(ctx.temperature)
    return dz.to(ctx.weight_dtype)  # as a bf16 layer's backward: the output gradient in the weight dtype


def token_log_probs_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_rows: int | None = None,
    compile_stats: bool = False,
) -> torch.Tensor:
    """``[..., 2]`` float32: log softmax(x Wᵀ / T)[label] and the entropy of softmax(x Wᵀ / T) (0 unless
    ``with_entropy``), for hidden states ``x`` [..., H], ``weight`` [V, H], ``labels`` [...] int64.
    Logits as :func:`fp32_logits_linear` computes them; ``chunk_rows`` rows at a time (default
    ``CHUNK_ELEMENTS // V``); ``compile_stats``: each chunk's statistics and gradient by the compiled
    :func:`chunk_stats` / :func:`chunk_grad`. Differentiable in ``x`` and ``weight``."""
    rows = chunk_rows or max(1, CHUNK_ELEMENTS // weight.shape[0])
    if labels.shape != x.shape[:-1]:
        raise ValueError(f"fused LM head: labels {tuple(labels.shape)} for hidden states {tuple(x.shape)}")
    return _TokenStats.apply(
        x, weight, labels, float(temperature), int(rows), bool(with_entropy), bool(compile_stats)
    )


@dataclass(frozen=True)
class TokenStatsRequest:
    labels: torch.Tensor  # the shape of the head's input without its last dim
    temperature: float
    with_entropy: bool
    chunk_rows: int | None = None


class FP32LogitsLinear(nn.Linear):
    """An ``nn.Linear`` (no bias) whose output is float32 when its input and weight are bf16/fp16, or,
    inside :func:`token_stats_head`, the fused token statistics ``[..., 2]``."""

    token_stats: TokenStatsRequest | None = None
    compile_stats: bool = False  # on CUDA, the softmax statistics compiled (set by compile_token_stats)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.token_stats is not None:
            r = self.token_stats
            return token_log_probs_entropy(
                x,
                self.weight,
                r.labels,
                temperature=r.temperature,
                with_entropy=r.with_entropy,
                chunk_rows=r.chunk_rows,
                compile_stats=self.compile_stats and compiles_on(x),
            )
        if self.bias is None and x.dtype in (torch.bfloat16, torch.float16) and self.weight.dtype == x.dtype:
            return fp32_logits_linear(x, self.weight)
        return super().forward(x)


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """``model.get_output_embeddings()``, None for a model without that method."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def fp32_lm_head(model: nn.Module) -> bool:
    """Make ``model``'s output embeddings return float32 logits (in place: same parameters, same state
    dict, tying kept). False when the head is not a bias-free ``nn.Linear`` (left as it is)."""
    head = _output_embeddings(model)
    if type(head) is not nn.Linear or head.bias is not None:
        return False
    head.__class__ = FP32LogitsLinear
    return True


def compile_token_stats(model: nn.Module, on: bool) -> bool:
    """Whether ``model``'s log-prob/entropy statistics run compiled on CUDA (``use_torch_compile``), for the
    fused head and the unfused head's no-grad passes; False (nothing set) when the head is not a
    :class:`FP32LogitsLinear`."""
    head = _output_embeddings(model)
    if not isinstance(head, FP32LogitsLinear):
        return False
    head.compile_stats = bool(on)
    return True


def stats_compiled(model: nn.Module) -> bool:
    """``model``'s head was set to compiled statistics by :func:`compile_token_stats`."""
    head = _output_embeddings(model)
    return bool(getattr(head, "compile_stats", False))


def fused_head(model: nn.Module) -> FP32LogitsLinear | None:
    """The model's output embeddings when :func:`token_stats_head` can use them: an
    :class:`FP32LogitsLinear` whose output the model returns as it is (no final-logit soft-capping)."""
    head = _output_embeddings(model)
    config = getattr(model, "config", None)
    if not isinstance(head, FP32LogitsLinear) or getattr(config, "final_logit_softcapping", None):
        return None
    return head


@contextlib.contextmanager
def token_stats_head(
    model: nn.Module,
    labels: torch.Tensor,
    *,
    temperature: float,
    with_entropy: bool,
    chunk_rows: int | None = None,
) -> Iterator[None]:
    """Inside, ``model(...).logits`` is ``[..., 2]`` (log-prob of ``labels``, entropy) instead of logits;
    ``labels`` has the shape of the logits without the vocabulary dim (after ``logits_to_keep``)."""
    head = fused_head(model)
    if head is None:
        raise ValueError("use_fused_kernels: the model's LM head is not a bias-free linear layer")
    head.token_stats = TokenStatsRequest(labels, temperature, with_entropy, chunk_rows)
    try:
        yield
    finally:
        head.token_stats = None
