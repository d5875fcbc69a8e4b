"""The batch's rollout log-probs: the full softmax's from the law sampled from and its log kept mass, and a
part without a kept mass (untruncated or logged samples) joined to parts with one."""

from __future__ import annotations

import pytest
import torch

from klppo.batch import Batch, rollout_softmax_log_probs


def _part(rows: int, kept: float | None) -> Batch:
    log_q = torch.full((rows, 3), -1.0)
    return Batch(
        prompts=torch.ones(rows, 2, dtype=torch.long),
        prompt_mask=torch.ones(rows, 2, dtype=torch.long),
        responses=torch.ones(rows, 3, dtype=torch.long),
        response_mask=torch.ones(rows, 3),
        rollout_log_probs=log_q,
        rollout_log_kept_mass=None if kept is None else torch.full((rows, 3), kept),
    )


def test_softmax_log_probs_add_the_log_kept_mass() -> None:
    assert torch.equal(rollout_softmax_log_probs(_part(2, -0.5)), torch.full((2, 3), -1.5))  # log q + log K
    assert torch.equal(rollout_softmax_log_probs(_part(2, None)), torch.full((2, 3), -1.0))
    assert rollout_softmax_log_probs(_part(2, None).replace(rollout_log_probs=None)) is None


def test_concat_fills_a_missing_kept_mass_with_zeros() -> None:
    joined = Batch.concat([_part(2, -0.5), _part(1, None)])
    assert joined.rollout_log_kept_mass.tolist() == [[-0.5] * 3, [-0.5] * 3, [0.0] * 3]
    assert Batch.concat([_part(1, None), _part(1, None)]).rollout_log_kept_mass is None
    with pytest.raises(ValueError, match="rollout_log_probs is set in some batches only"):
        Batch.concat([_part(1, None), _part(1, None).replace(rollout_log_probs=None)])
