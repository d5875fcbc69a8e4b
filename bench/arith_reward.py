"""Reward functions of ``bench/learning.py`` (loaded with ``custom_reward_function.path``), and the answer
extraction its evaluation uses, so that the reward a run trains on and the accuracy it is judged by agree.

- flexible: the last number in the last 300 characters, with ``,`` and ``$`` removed and a trailing ``.``
  removed ("The answer is 42." → "42"; verl's flexible keeps the ``.`` and would score it 0).
- strict: the last ``#### N`` (verl's strict GSM8K rule, ``,`` and ``$`` removed).

``compute_score(..., method=...)``:
- ``flexible``: 1 if the flexible answer equals the ground truth, else 0.
- ``strict``: 1 if the strict answer equals the ground truth, else 0 (verl's default GSM8K reward).
- ``strict_shaped``: strict, plus ``format_bonus`` (default 0.1) when a ``#### N`` line is present but
  wrong, plus ``flexible_bonus`` (default 0.2) when the strict answer is missing but the flexible one is
  right — shaping that gives a model which never writes ``####`` a gradient toward the format.
"""

from __future__ import annotations

import re

CLIP_CHARS = 300
_NUMBER = re.compile(r"-?[0-9][0-9.,$]*|-?\$[0-9][0-9.,]*")
_STRICT = re.compile(r"#### *(-?[0-9.,$]+)")


def _clean(text: str) -> str:
    text = text.replace(",", "").replace("$", "")
    return text[:-1] if text.endswith(".") else text


def flexible_answer(response: str) -> str | None:
    """The last number of the last 300 characters (commas, ``$`` and a trailing ``.`` removed)."""
    found = _NUMBER.findall(response[-CLIP_CHARS:])
    return _clean(found[-1]) if found else None


def strict_answer(response: str) -> str | None:
    """The number of the last ``#### N`` in the last 300 characters (commas, ``$``, trailing ``.``
    removed)."""
    found = _STRICT.findall(response[-CLIP_CHARS:])
    return _clean(found[-1]) if found else None


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: str,
    extra_info: dict | None = None,
    method: str = "flexible",
    format_bonus: float = 0.1,
    flexible_bonus: float = 0.2,
    **_: object,
) -> float:
    truth = str(ground_truth)
    if method == "flexible":
        return float(flexible_answer(solution_str) == truth)
    strict = strict_answer(solution_str)
    if method == "strict":
        return float(strict == truth)
    if method == "strict_shaped":
        if strict is not None:
            return 1.0 if strict == truth else format_bonus
        return flexible_bonus if flexible_answer(solution_str) == truth else 0.0
    raise ValueError(f"bench reward method must be flexible, strict or strict_shaped, got {method!r}")
