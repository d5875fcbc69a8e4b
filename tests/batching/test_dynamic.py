"""Token-budget partitions, order restoration and micro-batch loss weights (pure, no model)."""

from __future__ import annotations

import math
import random
import warnings

import pytest
import torch

from klppo.algorithms.losses import agg_loss
from klppo.batching.dynamic import (
    LOSS_AGG_MODES,
    fixed_micro_batches,
    micro_batch_loss_weight,
    partition_by_token_budget,
    restore_order,
)
from tests.batching.reference import agg_loss_reference


def _check_partition(parts, lens, budget):
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(len(lens)))
    for p in parts:
        assert p == sorted(p)
        assert sum(lens[i] for i in p) <= budget or len(p) == 1


@pytest.mark.parametrize("seed", range(6))
def test_partition_respects_budget_and_covers_all(seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 60))]
    budget = rng.choice([300, 512, 1000])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no sequence is over budget: no warning
        parts = partition_by_token_budget(lens, budget)
    _check_partition(parts, lens, budget)
    # Lower bound on the number of micro-batches; greedy gets within one bin of it on such inputs.
    assert math.ceil(sum(lens) / budget) <= len(parts) <= math.ceil(sum(lens) / budget) + 1
    # Balanced: no micro-batch holds more than the mean plus one sequence.
    sums = [sum(lens[i] for i in p) for p in parts]
    assert max(sums) - min(sums) <= max(lens)
    assert sums == sorted(sums, reverse=True)


def test_partition_overlong_sequence_runs_alone_with_warning():
    lens = [50, 700, 40, 30, 1200, 60]
    with pytest.warns(UserWarning, match="longer than the token budget 200"):
        parts = partition_by_token_budget(lens, 200)
    _check_partition(parts, lens, 200)
    assert [4] in parts and [1] in parts
    assert sum(len(p) for p in parts if 1 not in p and 4 not in p) == 4
    assert len(parts) == 3  # the two overlong alone + the other 180 tokens in one micro-batch


def test_partition_multiple_and_exact_small_cases():
    assert partition_by_token_budget([], 10) == []
    assert partition_by_token_budget([3, 3, 3, 3], 6) == [[0, 2], [1, 3]]
    parts = partition_by_token_budget([3, 3, 3, 3], 100, num_partitions_multiple=4)
    assert len(parts) == 4 and sorted(i for p in parts for i in p) == [0, 1, 2, 3]
    parts = partition_by_token_budget([5, 4, 3, 2, 1], 8, num_partitions_multiple=2)
    assert len(parts) % 2 == 0
    _check_partition(parts, [5, 4, 3, 2, 1], 8)
    with pytest.raises(ValueError):
        partition_by_token_budget([1], 0)


def test_fixed_micro_batches():
    assert fixed_micro_batches(7, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert fixed_micro_batches(0, 3) == []


def test_restore_order_roundtrip():
    x = torch.randn(11, 4)
    parts = partition_by_token_budget([random.Random(1).randint(1, 9) for _ in range(11)], 12)
    chunks = [x[torch.tensor(p)] * 1.0 for p in parts]
    torch.testing.assert_close(restore_order(chunks, parts), x, rtol=0, atol=0)
    with pytest.raises(ValueError):
        restore_order([x[:2]], [[0, 0]])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_weights_reassemble_mini_batch_loss(mode):
    gen = torch.Generator().manual_seed(3)
    for trial in range(5):
        n, horizon = 9, 7
        loss = torch.randn(n, horizon, generator=gen, dtype=torch.float64)
        lengths = torch.randint(0, horizon + 1, (n,), generator=gen)
        lengths[0] = horizon
        mask = (torch.arange(horizon)[None, :] < lengths[:, None]).double()
        if trial == 0:
            mask[3] = 0  # a fully masked row
        whole = agg_loss_reference(loss, mask, mode)
        mini_tokens = mask.sum()
        mini_seqs = (mask.sum(-1) > 0).sum()
        library = agg_loss(loss, mask, mode)  # klppo.algorithms: same definitions as the reference
        torch.testing.assert_close(library, whole, rtol=1e-12, atol=1e-12)
        parts = partition_by_token_budget((lengths + 1).tolist(), 12)
        total = torch.zeros((), dtype=torch.float64)
        for p in parts:
            idx = torch.tensor(p)
            w = micro_batch_loss_weight(mode, mask[idx], mini_tokens, mini_seqs, horizon, mini_num_rows=n)
            if w:
                total += w * agg_loss_reference(loss[idx], mask[idx], mode)
        torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError):
        micro_batch_loss_weight("token-sum", mask, 1, 1, horizon)
