"""Generic math scorer: the content of the last ``\\boxed{...}`` against the ground truth.

``compute_score(solution_str, ground_truth) -> 1.0 | 0.0``. Both sides are normalised for simple
formatting before a string comparison: surrounding ``$``, spaces, ``\\left``/``\\right``, ``\\!``,
``\\dfrac``/``\\tfrac`` → ``\\frac``, ``^\\circ``, ``\\%``/``%``, ``\\text{...}`` wrappers, a trailing period,
thousands separators in plain numbers, and plain numbers compared by value (``0.50`` = ``.5`` = ``1/2``).
A ground truth that is itself ``\\boxed{...}`` is unwrapped. Deliberately left out: symbolic equivalence
(``x+1`` vs ``1+x``) — use a custom reward function (e.g. math-verify) for that.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")
_NUMBER_RE = re.compile(r"^-?(\d+(\.\d*)?|\.\d+)$")
_FRACTION_RE = re.compile(r"^(-?)\\frac\{?(\d+)\}?\{?(\d+)\}?$|^(-?\d+)/(\d+)$")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (balanced braces) or ``\\boxed x`` in ``text``; None if absent."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start:]
    cmd = next(c for c in _BOX_COMMANDS if rest.startswith(c))
    rest = rest[len(cmd) :]
    if rest.startswith(" "):  # "\boxed 5" form: up to the next "$" or whitespace
        return rest.strip().split("$")[0].split()[0] if rest.strip() else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced (truncated response)


def normalize_answer(answer: str) -> str:
    """Canonical string for simple formatting differences (see module docstring)."""
    s = answer.strip()
    boxed = last_boxed_content(s)
    if boxed is not None:
        s = boxed
    s = _TEXT_RE.sub(r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", "")):
        s = s.replace(old, new)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\%", "").replace("%", "")
    s = s.replace("$", "").replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return _canonical_number(s) or s


def _canonical_number(s: str) -> str | None:
    """Exact rational value of a plain number or simple fraction as ``p/q`` (None if not numeric)."""
    try:
        if _NUMBER_RE.match(s):
            value = Fraction(s)
        else:
            m = _FRACTION_RE.match(s)
            if m is None:
                return None
            if m.group(2) is not None:
                value = Fraction(int(m.group(2)), int(m.group(3))) * (-1 if m.group(1) else 1)
            else:
                value = Fraction(int(m.group(4)), int(m.group(5)))
    except (ValueError, ZeroDivisionError):
        return None
    return f"{value.numerator}/{value.denominator}"


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the last boxed answer of ``solution_str`` matches ``ground_truth`` after normalisation."""
    predicted = last_boxed_content(solution_str)
    if predicted is None:
        return 0.0
    return 1.0 if normalize_answer(predicted) == normalize_answer(str(ground_truth)) else 0.0
