"""Balance a batch across data-parallel ranks by token count (``trainer.balance_batch``).

Rank ``r`` takes the ``r``-th consecutive chunk of the batch; reordering the batch first with
:func:`balance_permutation` makes every chunk hold about the same number of real tokens, so no rank waits
for a rank that drew all the long responses. The reorder changes nothing in the results: every per-sample
output is computed for the same sample, and the trainer restores or ignores the order (losses aggregate
over the whole mini-batch).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def balance_across_ranks(
    seq_lens: Sequence[int], world_size: int, *, equal_size: bool = True
) -> list[list[int]]:
    """Assign sequences to ``world_size`` ranks so that token sums are as equal as greedy gets them.

    Longest first, each sequence goes to the rank with the smallest token sum so far; with
    ``equal_size`` a rank that already holds ``n / world_size`` sequences takes no more (``n`` must then
    be divisible by ``world_size``, as a data-parallel split requires).

    Returns:
        ``world_size`` lists of indices (ascending inside each list).
    """
    if world_size <= 0:
        raise ValueError(f"world_size must be positive, got {world_size}")
    lens = [int(x) for x in seq_lens]
    n = len(lens)
    if equal_size and n % world_size:
        raise ValueError(f"cannot split {n} sequences into {world_size} equal shares")
    capacity = n // world_size if equal_size else n
    parts: list[list[int]] = [[] for _ in range(world_size)]
    heap = [(0, r) for r in range(world_size)]
    for index in sorted(range(n), key=lambda i: (-lens[i], i)):
        total, r = heapq.heappop(heap)
        while len(parts[r]) >= capacity:  # a full rank takes no more: it leaves the heap for good
            total, r = heapq.heappop(heap)
        parts[r].append(index)
        heapq.heappush(heap, (total + lens[index], r))
    return [sorted(p) for p in parts]


def balance_permutation(seq_lens: Sequence[int], world_size: int, *, equal_size: bool = True) -> list[int]:
    """The reorder of the batch such that rank ``r``'s consecutive chunk is its balanced share.

    ``batch.select(perm).chunk(world_size)[r]`` holds the rows of ``balance_across_ranks(...)[r]``
    (``equal_size=True``). Undo with ``inverse_permutation(perm)``.
    """
    return [i for part in balance_across_ranks(seq_lens, world_size, equal_size=equal_size) for i in part]


def inverse_permutation(perm: Sequence[int]) -> list[int]:
    """``inv`` with ``inv[perm[k]] = k``: ``x.select(perm).select(inv) == x``."""
    inv = [0] * len(perm)
    for k, i in enumerate(perm):
        inv[i] = k
    return inv


def token_imbalance(seq_lens: Sequence[int], parts: Sequence[Sequence[int]]) -> float:
    """max / mean of the per-part token sums (1.0 = perfect balance), a metric worth logging."""
    sums = [sum(int(seq_lens[i]) for i in p) for p in parts]
    mean = sum(sums) / len(sums) if sums else 0.0
    return max(sums) / mean if mean > 0 else 1.0
