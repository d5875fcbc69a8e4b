"""The kept reference log-probs (klppo/trainer/ref_cache.py): a sample is found whatever its padding, its
values come back where its response is; past the memory bound, or when not finite, nothing is kept."""

from __future__ import annotations

import torch

from klppo.batch import Batch
from klppo.trainer.ref_cache import RefLogProbCache


def _batch(pad_left: int, pad_right: int, ref: list[float] | None) -> Batch:
    """One sample: prompt [5, 6, 7] after ``pad_left`` pads, response [8, 9] before ``pad_right`` pads."""
    prompts = torch.tensor([[0] * pad_left + [5, 6, 7]])
    responses = torch.tensor([[8, 9] + [0] * pad_right])
    mask = torch.tensor([[1.0, 1.0] + [0.0] * pad_right])
    values = None if ref is None else torch.tensor([ref + [0.0] * pad_right])
    return Batch(
        prompts=prompts,
        prompt_mask=(prompts > 0).long(),
        responses=responses,
        response_mask=mask,
        ref_log_probs=values,
    )


def test_found_whatever_the_padding() -> None:
    cache = RefLogProbCache()
    assert cache.lookup(_batch(0, 0, None)) is None
    cache.keep(_batch(0, 0, [-1.5, -2.5]))
    got = cache.lookup(_batch(3, 4, None))
    assert got is not None and got.tolist() == [[-1.5, -2.5, 0.0, 0.0, 0.0, 0.0]]
    other = _batch(0, 0, None)
    other.responses[0, 1] = 10  # another response to the same prompt
    assert cache.lookup(other) is None


def test_nothing_kept_past_the_bound() -> None:
    cache = RefLogProbCache(max_bytes=4)  # one token's float32
    cache.keep(_batch(0, 0, [-1.0, -2.0]))
    assert len(cache) == 0 and cache.lookup(_batch(0, 0, None)) is None


def test_non_finite_values_are_not_kept() -> None:
    cache = RefLogProbCache()
    cache.keep(_batch(0, 0, [-1.0, float("nan")]))
    assert len(cache) == 0 and cache.lookup(_batch(0, 0, None)) is None
