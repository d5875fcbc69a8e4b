"""Boxed-answer math scorer: extraction and normalisation against hand-derived expectations."""

from __future__ import annotations

import pytest

from klppo.rewards.math import compute_score, last_boxed_content


def test_last_boxed_with_nested_braces():
    text = r"first \boxed{1} then $\boxed{\frac{1}{2}}$."
    assert last_boxed_content(text) == r"\frac{1}{2}"
    assert last_boxed_content(r"\boxed 7$") == "7"
    assert last_boxed_content(r"\boxed{\frac{1}{2}") is None  # truncated
    assert last_boxed_content("no box") is None


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        (r"so \boxed{42}", "42", 1.0),
        (r"\boxed{41} no wait \boxed{42}", "42", 1.0),
        (r"\boxed{42} no wait \boxed{41}", "42", 0.0),
        (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),
        (r"\boxed{0.5}", r"\frac12", 1.0),
        (r"\boxed{1/2}", "0.50", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{50\%}", "50", 1.0),
        (r"\boxed{ \left( 1, 2 \right) }", "(1,2)", 1.0),
        (r"\boxed{\text{east}}", "east", 1.0),
        (r"\boxed{x+1}", "1+x", 0.0),  # no symbolic equivalence
        ("42", "42", 0.0),  # no box, no score
        (r"\boxed{42}", r"\boxed{42}", 1.0),  # boxed ground truth unwrapped
    ],
)
def test_scores(response, truth, expected):
    assert compute_score(response, truth) == expected
