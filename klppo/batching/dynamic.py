"""Token-budget micro-batches (``use_dynamic_bsz``) and the loss weights that make them exact.

Knows nothing about models or PPO: it partitions a list of sequence lengths and says how to weight each
micro-batch's aggregated loss so that gradient accumulation reproduces the mini-batch gradient.

Contract of :func:`partition_by_token_budget`
  * every index ``0..n-1`` appears in exactly one micro-batch;
  * each micro-batch's token sum is ``<= max_tokens``, except a micro-batch made of one single sequence
    longer than the budget (such a sequence is never truncated, never refused: it runs alone, with a
    warning);
  * the number of micro-batches is the smallest ``k`` (a multiple of ``num_partitions_multiple``) for
    which longest-first greedy finds a packing within budget, starting from the lower bound
    ``ceil(total / max_tokens)``; among those ``k`` bins the greedy balances token sums.

Contract of :func:`micro_batch_loss_weight`: for a mini-batch split into micro-batches ``m``,
``Σ_m weight_m · agg_loss(loss[m], mask[m], mode) == agg_loss(loss, mask, mode)`` for every mode
(verl's ``core_algos.agg_loss`` definitions, with ``M`` = mask, ``L`` = per-token loss):

=========================  ==================================================  ============================
mode                       agg_loss                                            weight of micro-batch m
=========================  ==================================================  ============================
token-mean                 Σ_it L·M / Σ_it M                                   tokens_m / tokens_mini
seq-mean-token-sum         mean over all rows i of (Σ_t L·M)                   rows_m / rows_mini
seq-mean-token-mean        mean over rows with tokens of (Σ_t L·M / Σ_t M)     seqs_m / seqs_mini
seq-mean-token-sum-norm    Σ_it L·M / horizon   (horizon = mask.shape[-1])     horizon_m / horizon_mini
=========================  ==================================================  ============================

``rows`` counts all rows, ``seqs`` the rows with at least one unmasked token (as
``klppo.algorithms.losses.agg_loss``: a fully masked row is a zero term of ``seq-mean-token-sum`` and
no term of ``seq-mean-token-mean``); both counts agree when no response is empty, the normal case.
Global-token variant (data parallel): pass the
token / sequence counts summed over all ranks as ``mini_num_tokens`` / ``mini_num_seqs`` and *sum* the
gradients over ranks (or multiply the weight by ``world_size`` when the all-reduce averages); the
accumulated gradient then equals the gradient of the loss aggregated over the global mini-batch.
"""

from __future__ import annotations

import heapq
import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _greedy_bins(items: Sequence[tuple[int, int]], num_bins: int) -> list[list[int]]:
    """Longest-processing-time greedy: largest length first into the bin with the smallest sum.

    ``items`` are ``(length, index)``; ties broken by bin id, so the result is deterministic.
    """
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    heap = [(0, b) for b in range(num_bins)]
    for length, index in sorted(items, key=lambda x: (-x[0], x[1])):
        total, b = heapq.heappop(heap)
        bins[b].append(index)
        heapq.heappush(heap, (total + length, b))
    return bins


def partition_by_token_budget(
    seq_lens: Sequence[int], max_tokens: int, *, num_partitions_multiple: int = 1
) -> list[list[int]]:
    """Split sequences into balanced micro-batches of at most ``max_tokens`` tokens each.

    Args:
        seq_lens: real (unpadded) token count of each sequence, prompt + response.
        max_tokens: token budget per micro-batch (``ppo_max_token_len_per_gpu`` …).
        num_partitions_multiple: the number of micro-batches is rounded up to a multiple of this
            (e.g. so that every data-parallel rank runs the same number of micro-batches).

    Returns:
        Lists of indices into ``seq_lens`` (ascending inside each micro-batch); micro-batches are ordered
        by decreasing token sum (the largest first, so an out-of-memory shows at once).
    """
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    if num_partitions_multiple <= 0:
        raise ValueError(f"num_partitions_multiple must be positive, got {num_partitions_multiple}")
    lens = [int(x) for x in seq_lens]
    if not lens:
        return []
    overlong = [i for i, n in enumerate(lens) if n > max_tokens]
    if overlong:
        warnings.warn(
            f"{len(overlong)} sequence(s) longer than the token budget {max_tokens} (longest "
            f"{max(lens[i] for i in overlong)} tokens) each run in a micro-batch of their own; "
            "raise the *_max_token_len_per_gpu budget to avoid the memory spike",
            stacklevel=2,
        )
    rest = [(n, i) for i, n in enumerate(lens) if n <= max_tokens]
    num_bins = math.ceil(sum(n for n, _ in rest) / max_tokens) if rest else 0
    while True:
        total_bins = len(overlong) + num_bins
        total_bins = math.ceil(total_bins / num_partitions_multiple) * num_partitions_multiple
        total_bins = max(total_bins, num_partitions_multiple)
        bins = _greedy_bins(rest, total_bins - len(overlong)) if total_bins > len(overlong) else []
        if all(sum(lens[i] for i in b) <= max_tokens for b in bins):
            break
        num_bins += 1
    parts = [[i] for i in overlong] + bins
    parts = [sorted(p) for p in parts]
    # Empty parts exist only when rounding to a multiple asks for more bins than there are sequences.
    parts.sort(key=lambda p: (-sum(lens[i] for i in p), p[0] if p else len(lens)))
    return parts


def fixed_micro_batches(n: int, size: int) -> list[list[int]]:
    """Consecutive micro-batches of ``size`` rows (the last may be shorter): the fixed-count baseline."""
    if size <= 0:
        raise ValueError(f"micro-batch size must be positive, got {size}")
    return [list(range(i, min(i + size, n))) for i in range(0, n, size)]


def restore_order(chunks: Sequence[torch.Tensor], partitions: Sequence[Sequence[int]]) -> torch.Tensor:
    """Concatenate per-micro-batch outputs (dim 0) and put rows back in the original order.

    ``chunks[k]`` holds the rows ``partitions[k]`` in that order; the result's row ``i`` is the output of
    sequence ``i``. Empty partitions may have empty (or missing-row) chunks.
    """
    order = [i for p in partitions for i in p]
    if len(order) != len(set(order)):
        raise ValueError("partitions repeat an index")
    stacked = torch.cat(list(chunks), dim=0)
    if stacked.shape[0] != len(order):
        raise ValueError(f"chunks hold {stacked.shape[0]} rows but partitions name {len(order)}")
    inverse = torch.empty(len(order), dtype=torch.long)
    inverse[torch.as_tensor(order, dtype=torch.long)] = torch.arange(len(order))
    return stacked[inverse.to(stacked.device, non_blocking=True)]


def micro_batch_loss_weight(
    mode: str,
    micro_mask: torch.Tensor | np.ndarray,
    mini_num_tokens: int | float | torch.Tensor,
    mini_num_seqs: int | float | torch.Tensor,
    horizon: int,
    *,
    mini_num_rows: int | float | torch.Tensor | None = None,
) -> float:
    """Weight of one micro-batch's ``agg_loss`` in the accumulated loss (table in the module docstring).

    Args:
        mode: one of :data:`LOSS_AGG_MODES`.
        micro_mask: [b, R'] loss mask of the micro-batch's rows (a tensor, or a numpy array: read on the
            host without a device sync).
        mini_num_tokens: Σ mask over the whole mini-batch (or over all ranks: global variant).
        mini_num_seqs: number of rows of the mini-batch with at least one unmasked token.
        horizon: the mini-batch mask's last dimension (``seq-mean-token-sum-norm`` divides by it).
        mini_num_rows: number of rows of the mini-batch (``seq-mean-token-sum``); ``None`` takes
            ``mini_num_seqs``, exact when no row of the mini-batch is fully masked.

    Returns:
        A Python float (one host sync for the micro-batch's counts). A micro-batch with no unmasked token
        gets weight 0.
    """
    if mode == "token-mean":
        num = float(micro_mask.sum())
        return num / float(mini_num_tokens) if num > 0 else 0.0
    if mode == "seq-mean-token-sum":
        rows = mini_num_seqs if mini_num_rows is None else mini_num_rows
        num = (
            float(micro_mask.shape[0]) if mini_num_rows is not None else float((micro_mask.sum(-1) > 0).sum())
        )
        return num / float(rows) if num > 0 else 0.0
    if mode == "seq-mean-token-mean":
        num = float((micro_mask.sum(-1) > 0).sum())
        return num / float(mini_num_seqs) if num > 0 else 0.0
    if mode == "seq-mean-token-sum-norm":
        return float(micro_mask.shape[-1]) / float(horizon)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {LOSS_AGG_MODES}")
