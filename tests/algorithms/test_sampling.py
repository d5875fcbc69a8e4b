"""The truncated law's kept set, kept mass and log-probs (klppo.algorithms.sampling) against float64 cases
worked by hand; the untruncated and truncated draws' log-probs at the tokens they draw."""

from __future__ import annotations

import math

import pytest
import torch

from klppo.algorithms.sampling import (
    sample_truncated,
    sample_untruncated,
    truncate_logits,
    truncated_log_probs,
)

P5 = [0.05, 0.10, 0.15, 0.30, 0.40]
# (probabilities at T = 1, temperature, top_k, top_p, {kept token: q by hand}, kept mass K by hand)
CASES = [
    # top-k 2: the two largest, K = 0.3 + 0.4
    (P5, 1.0, 2, 1.0, {3: 3 / 7, 4: 4 / 7}, 0.70),
    # top-p 0.75: mass above 0.40 is 0 (kept), above 0.30 is 0.4 (kept), above 0.15 is 0.7 (kept), above 0.10
    # is 0.85 (dropped)
    (P5, 1.0, -1, 0.75, {2: 3 / 17, 3: 6 / 17, 4: 8 / 17}, 0.85),
    # top-k 3 gives (3, 6, 8) / 17; top-p 0.5 on it: above 6/17 lies 8/17 < 0.5 (kept), above 3/17 lies 14/17
    (P5, 1.0, 3, 0.5, {3: 3 / 7, 4: 4 / 7}, 0.70),
    # T = 0.5 squares the probabilities: (1, 4, 9, 16) / 30; top-k 2 keeps 25/30
    ([0.1, 0.2, 0.3, 0.4], 0.5, 2, 1.0, {2: 9 / 25, 3: 16 / 25}, 25 / 30),
    # ties at the k-th value are kept: logits (0, 1, 1, −1), top-k 1 keeps both 1s
    (None, 1.0, 1, 1.0, {1: 0.5, 2: 0.5}, 2 * math.e / (1 + 2 * math.e + math.exp(-1))),
]


def _logits(probs: list[float] | None) -> torch.Tensor:
    if probs is None:
        return torch.tensor([[0.0, 1.0, 1.0, -1.0]], dtype=torch.float64)
    return torch.tensor([probs], dtype=torch.float64).log()


@pytest.mark.parametrize(("probs", "temperature", "top_k", "top_p", "q", "kept_mass"), CASES)
def test_kept_mass_and_truncated_log_probs_by_hand(probs, temperature, top_k, top_p, q, kept_mass) -> None:
    x = _logits(probs) / temperature
    kept = truncate_logits(x, top_k, top_p)
    assert sorted(torch.nonzero(kept[0].isfinite()).flatten().tolist()) == sorted(q)
    log_kept_mass = torch.logsumexp(kept, -1) - torch.logsumexp(x, -1)
    assert float(log_kept_mass) == pytest.approx(math.log(kept_mass), abs=1e-12)
    for token, q_token in q.items():
        log_q = truncated_log_probs(x, kept, torch.tensor([token]))
        assert float(log_q) == pytest.approx(math.log(q_token), abs=1e-12)
        # log q = log p − log K
        log_p = torch.log_softmax(x, -1)[0, token]
        assert float(log_q) == pytest.approx(float(log_p) - math.log(kept_mass), abs=1e-12)


@pytest.mark.parametrize(("probs", "temperature", "top_k", "top_p", "q", "kept_mass"), CASES)
def test_truncated_draws_carry_the_hand_computed_log_probs(
    probs, temperature, top_k, top_p, q, kept_mass
) -> None:
    """Every draw lies in the kept set, with ``log p`` of the full tempered softmax and ``log q`` of the law
    sampled from (float32: to its rounding)."""
    torch.manual_seed(0)
    logits = _logits(probs).expand(2000, -1)
    tokens, log_p, log_q = sample_truncated(logits, temperature, top_k, top_p)
    assert set(tokens.tolist()) == set(q)  # 2,000 draws reach every kept token
    full = torch.log_softmax(logits[0] / temperature, -1)
    hand = torch.tensor([math.log(q.get(t, 1.0)) for t in range(logits.shape[1])], dtype=torch.float64)
    torch.testing.assert_close(log_q.double(), hand[tokens], atol=1e-6, rtol=0)
    torch.testing.assert_close(log_p.double(), full[tokens], atol=1e-6, rtol=0)
    torch.testing.assert_close((log_p - log_q).double(), torch.full_like(log_p, math.log(kept_mass)).double())


def test_untruncated_cuts_nothing() -> None:
    """top-k off (or of the whole vocabulary) and top-p 1 keep every token: K = 1, log q = log p."""
    x = torch.randn(3, 7, dtype=torch.float64)
    tokens = torch.tensor([0, 3, 6])
    for top_k in (-1, 0, 7, 9):
        kept = truncate_logits(x, top_k, 1.0)
        assert torch.equal(kept, x)
        torch.testing.assert_close(
            truncated_log_probs(x, kept, tokens), torch.log_softmax(x, -1).gather(1, tokens[:, None])[:, 0]
        )
    torch.manual_seed(0)
    drawn, log_p = sample_untruncated(x.float(), 0.8, greedy=False)
    torch.testing.assert_close(log_p, torch.log_softmax(x.float() / 0.8, -1).gather(1, drawn[:, None])[:, 0])
