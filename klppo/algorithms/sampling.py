"""The laws a rollout samples from, as torch functions of the logits: the untruncated (tempered or greedy)
draw, the top-k / top-p truncated one, and a token's log-prob under each. On the device, without a host
synchronisation (capturable in a CUDA graph); randomness from the current default generator.

For logits [B, V] (any float dtype; computed in float32), ``x = logits / T`` and ``p = softmax(x)``:

- greedy: ``argmax(logits)``, log-prob under T = 1;
- untruncated: the Gumbel-max race ``argmax(x + G)``, ``G = -log(-log U)`` — a categorical draw without
  ``multinomial``'s sync or a [B, V] probability tensor; log-prob ``log p = x[token] − logsumexp(x)``;
- top-k keeps token ``i`` iff ``x_i`` ≥ the k-th largest ``x`` (ties at the k-th value kept; ``top_k <= 0``
  or ≥ V: off); top-p then keeps token ``i`` iff the mass of the kept tokens with a larger ``x``, under the
  top-k set's renormalised distribution, is below ``p``: the smallest prefix of the sorted distribution
  whose mass reaches ``p``, at least one token (``top_p >= 1``: off) — Hugging Face's warpers, in order;
- truncated, the token is drawn from ``q = p / K`` on the kept set, ``K = Σ_kept p_i`` (the kept mass), by
  the exponential race ``argmax(q_i / E_i)``, ``E_i ~ Exp(1)``; its log-prob under the law sampled from is
  ``log q = log p − log K = x[token] − logsumexp(x over the kept set)`` (untruncated ``K = 1``, ``q = p``).

``q`` is the behaviour policy that rollout correction weighs against (docs/algorithms.md); the trainer's
forward gives ``p``. The reference of the rollout's samplers (:mod:`klppo.rollout.sampling`, the Triton
kernels of :mod:`klppo.rollout.triton_sampling`).
"""

from __future__ import annotations

import torch


def sample_untruncated(
    logits: torch.Tensor, temperature: float, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] int64 and log-probs ``log p`` [B] float32 of greedy or plain tempered sampling (module
    docstring); elementwise [B, V] work, fusable into two reductions."""
    torch._check(logits.shape[0] > 0)  # the batch dim is symbolic (rollout/compiled.py): logsumexp asks
    x = logits.float()
    if not greedy and temperature != 1.0:
        x = x / temperature
    lse = torch.logsumexp(x, dim=-1)
    if greedy:
        tokens = torch.argmax(x, dim=-1)
    else:
        # U = 0 gives E = inf, G = -inf (never picked); the clamp keeps G finite if U rounds to 1
        exp_noise = (-torch.log(torch.rand_like(x))).clamp_(min=1e-30)
        tokens = torch.argmax(x - torch.log(exp_noise), dim=-1)
    return tokens, x.gather(-1, tokens[:, None]).squeeze(-1) - lse


def sample_truncated(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokens [B] int64, ``log p`` [B] and ``log q`` [B] (float32) of top-k / top-p sampling (module
    docstring)."""
    x = logits.float() / temperature
    kept = truncate_logits(x, top_k, top_p)
    q = torch.softmax(kept, dim=-1)
    tokens = torch.argmax(q / torch.empty_like(q).exponential_(1.0), dim=-1)
    log_p = x.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(x, dim=-1)
    return tokens, log_p, truncated_log_probs(x, kept, tokens)


def truncate_logits(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``x`` [B, V] with the tokens outside the top-k / top-p set at -inf (module docstring)."""
    if top_k > 0 and top_k < x.shape[-1]:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p  # the first token always has mass_before 0 and stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def truncated_log_probs(x: torch.Tensor, kept: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``log q(tokens)`` [B] = ``x[token] − logsumexp(kept)``, ``kept = truncate_logits(x, …)`` (module
    docstring). ``x[token]`` is read from the untruncated ``x``: a token just outside ``kept`` (a sampler
    whose float sums put a top-p boundary elsewhere) gets a finite value, never -inf."""
    return x.gather(-1, tokens[:, None]).squeeze(-1) - torch.logsumexp(kept, dim=-1)
