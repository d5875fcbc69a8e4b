"""Token sampling on the device, without a host synchronisation (capturable in a CUDA graph).

Given logits [B, V] (any float dtype; computed in float32):

- ``log_probs = log_softmax(logits / T)`` (T = 1 when greedy) — reported for the sampled token, before
  any truncation;
- greedy: ``argmax(logits)``;
- untruncated sampling (no top-k, top-p = 1): the Gumbel-max race ``argmax(logits / T + G)``,
  ``G = -log(-log U)`` — a categorical draw without ``multinomial``'s sync or a [B, V] probability tensor;
- otherwise the tempered distribution is truncated (top-k: keep the k largest; top-p: keep the smallest
  prefix of the sorted distribution whose mass reaches p, always at least one token), renormalised, and
  sampled by the exponential race ``argmax(p_i / E_i)``, ``E_i ~ Exp(1)``.

Tensor parallel (``vocab_parallel_sampler``, logits of the rank's vocabulary rows [B, V/TP]): untruncated,
each rank races its shard (own Gumbel noise) and one all-gather of [B, 4] figures (race value, id, ``x``,
shard log-normaliser) gives every rank the best race's token (first rank on ties: the lowest id) and
``x[token] − logsumexp`` of the shards' normalisers — the same law. Truncated: the full logits are gathered
and the group's first rank's draw is taken.

Randomness comes from the current default generator. This module is the reference of the Triton kernels
(:mod:`klppo.rollout.triton_sampling`) the engine uses on CUDA where they apply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from klppo.parallel.collectives import group_all_gather
from klppo.parallel.mesh import TensorParallel
from klppo.parallel.reshard import even_split
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


def is_untruncated(params: SamplingParams) -> bool:
    """True when ``sample_untruncated`` applies (greedy, or no top-k and top-p = 1)."""
    return params.greedy or (params.top_k <= 0 and params.top_p >= 1.0)


def sample_untruncated(
    logits: torch.Tensor, temperature: float, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [B] int64 and log-probs [B] float32 of greedy or plain tempered sampling (module docstring):
    ``x[token] - logsumexp(x)``, ``x = logits / T``; elementwise [B, V] work, fusable into two reductions."""
    torch._check(logits.shape[0] > 0)  # the batch dim is symbolic (compiled.py): logsumexp asks
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


def sample(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled tokens [B] int64 and their log-probs [B] float32 (see the module docstring)."""
    if is_untruncated(params):
        return sample_untruncated(logits, params.temperature, params.greedy)
    scaled = logits.float() / params.temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(truncate_logits(scaled, params.top_k, params.top_p), dim=-1)
    tokens = torch.argmax(probs / torch.empty_like(probs).exponential_(1.0), dim=-1)
    return tokens, log_probs.gather(-1, tokens[:, None]).squeeze(-1)


def vocab_parallel_sampler(params: SamplingParams, tp: TensorParallel, vocab_size: int):
    """``logits [B, V_local] -> (tokens [B], log_probs [B])``, the same on every rank of ``tp``'s group, for
    this rank's ids ``even_split(vocab_size, tp.size, tp.rank)`` (module docstring); no host sync."""
    bounds = [even_split(vocab_size, tp.size, r) for r in range(tp.size)]
    vocab_start, widest = bounds[tp.rank][0], max(b - a for a, b in bounds)
    temperature = 1.0 if params.greedy else float(params.temperature)

    def untruncated(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = logits.float()
        if temperature != 1.0:
            x = x / temperature
        lse = torch.logsumexp(x, dim=-1)
        race = x
        if not params.greedy:
            race = x - torch.log((-torch.log(torch.rand_like(x))).clamp_(min=1e-30))
        idx = torch.argmax(race, dim=-1, keepdim=True)
        mine = torch.cat(
            [race.gather(-1, idx), (idx + vocab_start).to(x.dtype), x.gather(-1, idx), lse[:, None]], -1
        )
        figures = group_all_gather(mine.double(), tp.group)  # [TP, B, 4]
        winner = torch.argmax(figures[:, :, 0], dim=0)  # first rank with the best race value
        best = figures.gather(0, winner[None, :, None].expand(1, -1, 4))[0]
        log_norm = torch.logsumexp(figures[:, :, 3], dim=0)
        return best[:, 1].long(), (best[:, 2] - log_norm).float()

    def truncated(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        padded = F.pad(logits.float(), (0, widest - logits.shape[-1]), value=float("-inf"))
        shards = group_all_gather(padded, tp.group)
        full = torch.cat([shards[r, :, : b - a] for r, (a, b) in enumerate(bounds)], dim=-1)
        tokens, log_probs = sample(full, params)
        first = group_all_gather(torch.stack([tokens.double(), log_probs.double()], -1), tp.group)[0]
        return first[:, 0].long(), first[:, 1].float()

    return untruncated if is_untruncated(params) else truncated
