"""GSM8K rule scorer, bit-for-bit compatible with verl's ``verl.utils.reward_score.gsm8k``.

Contract (same arguments → same return value as verl, so accuracy figures are comparable):

- Only the last ``SOLUTION_CLIP_CHARS`` (300) characters of the response are searched.
- ``method="strict"``: every match of ``#### <num>`` (``<num>`` = ``-?[0-9.,]+``); the *last* one is the
  answer, with ``,`` and ``$`` removed.
- ``method="flexible"``: every ``-?[0-9.,]+`` run; the answer is the last one that is not ``""`` or ``"."``
  (if all are ``"."``, verl's loop leaves the first one, which we reproduce). verl does **not** strip commas
  here, so ``"1,000"`` does not equal a ground truth ``"1000"`` in flexible mode; we keep that quirk.
- No answer → ``0``; answer ``==`` ground_truth (plain string comparison) → ``score``; else ``format_score``.

Deliberately left out: numeric equivalence (``"72.0"`` vs ``"72"`` is wrong, as in verl).
"""

from __future__ import annotations

import re

SOLUTION_CLIP_CHARS = 300
_STRICT_RE = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER_RE = re.compile(r"-?[0-9.,]+")
_INVALID_FLEXIBLE = ("", ".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The answer string verl would extract from ``solution_str`` (``None`` when there is none)."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k scoring method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-SOLUTION_CLIP_CHARS:] if len(solution_str) > SOLUTION_CLIP_CHARS else solution_str
    if method == "strict":
        found = _STRICT_RE.findall(tail)
        if not found:
            return None
        return found[-1].replace(",", "").replace("$", "")
    numbers = _NUMBER_RE.findall(tail)
    if not numbers:
        return None
    valid = [n for n in numbers if n not in _INVALID_FLEXIBLE]
    return valid[-1] if valid else numbers[0]


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals ``ground_truth``, ``format_score`` if an answer was found
    but differs, ``0`` if no answer was found (verl returns the int ``0`` there; so do we)."""
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0
    if isinstance(ground_truth, float) and ground_truth.is_integer():
        ground_truth = int(ground_truth)  # a number column: 25.0 is "25", as the math scorer reads it
    return score if answer == str(ground_truth) else format_score
