"""The engine's torch samplers, on the device without a host synchronisation (capturable in a CUDA graph).

A sampler takes logits [B, V] and returns a :data:`Draw`: the tokens [B] int64, their log-probs ``log
softmax(logits / T)[token]`` [B] float32 (T = 1 when greedy; the trainer's recomputation gives the same
quantity) and, where top-k / top-p truncated the distribution and ``SamplingParams.law_log_probs`` asks,
``log q(token)`` [B] float32 under the truncated, renormalised distribution sampled from, else None. The
laws and their torch reference: :mod:`klppo.algorithms.sampling`; :func:`sample` applies them to
:class:`SamplingParams`.

Tensor parallel (``vocab_parallel_sampler``, logits of the rank's vocabulary rows [B, V/TP]): untruncated,
each rank races its shard (own Gumbel noise) and one all-gather of [B, 4] figures (race value, id, ``x``,
shard log-normaliser) gives every rank the best race's token (first rank on ties: the lowest id) and
``x[token] − logsumexp`` of the shards' normalisers — the same law. Truncated: the full logits are gathered
and the group's first rank's draw is taken.

This module is the reference of the Triton kernels (:mod:`klppo.rollout.triton_sampling`) the engine uses
on CUDA where they apply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from klppo.algorithms.sampling import sample_truncated, sample_untruncated
from klppo.parallel.collectives import group_all_gather
from klppo.parallel.mesh import TensorParallel
from klppo.parallel.reshard import even_split
from klppo.rollout.base import SamplingParams

Draw = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
"""A sampler's (tokens [B] int64, log-probs [B] float32, truncated log-probs [B] float32 or None)."""


def is_untruncated(params: SamplingParams) -> bool:
    """True when nothing is cut: greedy, or no top-k and top-p = 1 (``sample_untruncated`` applies)."""
    return params.greedy or (params.top_k <= 0 and params.top_p >= 1.0)


def returns_law_log_probs(params: SamplingParams) -> bool:
    """Whether a draw of ``params`` returns truncated log-probs (a cut law, and ``law_log_probs``)."""
    return params.law_log_probs and not is_untruncated(params)


def sample(logits: torch.Tensor, params: SamplingParams) -> Draw:
    """The :data:`Draw` of ``params`` from ``logits`` [B, V] (module docstring)."""
    if is_untruncated(params):
        return *sample_untruncated(logits, params.temperature, params.greedy), None
    tokens, log_probs, law = sample_truncated(logits, params.temperature, params.top_k, params.top_p)
    return tokens, log_probs, law if params.law_log_probs else None


def vocab_parallel_sampler(params: SamplingParams, tp: TensorParallel, vocab_size: int):
    """``logits [B, V_local] -> Draw``, the same on every rank of ``tp``'s group, for this rank's ids
    ``even_split(vocab_size, tp.size, tp.rank)`` (module docstring); no host sync."""
    bounds = [even_split(vocab_size, tp.size, r) for r in range(tp.size)]
    vocab_start, widest = bounds[tp.rank][0], max(b - a for a, b in bounds)
    temperature = 1.0 if params.greedy else float(params.temperature)

    def untruncated(logits: torch.Tensor) -> Draw:
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
        return best[:, 1].long(), (best[:, 2] - log_norm).float(), None

    def truncated(logits: torch.Tensor) -> Draw:
        padded = F.pad(logits.float(), (0, widest - logits.shape[-1]), value=float("-inf"))
        shards = group_all_gather(padded, tp.group)
        full = torch.cat([shards[r, :, : b - a] for r, (a, b) in enumerate(bounds)], dim=-1)
        draw = [t.double() for t in sample(full, params) if t is not None]
        first = group_all_gather(torch.stack(draw, -1), tp.group)[0]
        return first[:, 0].long(), first[:, 1].float(), first[:, 2].float() if len(draw) == 3 else None

    return untruncated if is_untruncated(params) else truncated
