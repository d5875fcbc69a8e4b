"""Token sampling on the device, without a host synchronisation (capturable in a CUDA graph).

Given float32 logits [B, V]:

- ``log_probs = log_softmax(logits / T)`` (T = 1 when greedy) — reported for the sampled token, before
  any truncation;
- greedy: ``argmax(logits)``;
- otherwise the tempered distribution is truncated (top-k: keep the k largest; top-p: keep the smallest
  prefix of the sorted distribution whose mass reaches p, always at least one token), renormalised, and
  sampled by the exponential race ``argmax(p_i / E_i)``, ``E_i ~ Exp(1)`` (same law as a categorical
  draw, no ``multinomial`` sync), drawing from the current default generator.
"""

from __future__ import annotations

import torch

from klppo.rollout.base import SamplingParams


def truncate_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set logits outside the top-k / top-p set to -inf. ``top_k <= 0`` and ``top_p >= 1`` are off."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before >= top_p  # the first token always has mass_before 0 and stays
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled tokens [B] int64 and their log-probs [B] float32 (see the module docstring)."""
    temperature = 1.0 if params.greedy else params.temperature
    scaled = logits / temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
    elif params.top_k <= 0 and params.top_p >= 1.0:
        # argmax(p / E) = argmax(log p - log E): reuse the log-probs, one noise tensor
        tokens = torch.argmax(log_probs - torch.empty_like(log_probs).exponential_(1.0).log_(), dim=-1)
    else:
        probs = torch.softmax(truncate_logits(scaled, params.top_k, params.top_p), dim=-1)
        tokens = torch.argmax(probs / torch.empty_like(probs).exponential_(1.0), dim=-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)
