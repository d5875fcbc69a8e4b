"""Reading the model's tool calls from its text, and cutting long tool answers.

Format ``hermes`` (verl's default, Qwen's and Hermes' chat templates): each call is
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. Parsing never raises: a call whose JSON is
malformed, whose ``name`` is missing or whose ``arguments`` is not an object (or a JSON string of one)
becomes a
:class:`ToolCall` with ``error`` set, answered to the model as the tool's response; an opening tag without its
closing tag is such a call too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

FORMATS = ("hermes",)
TRUNCATE_SIDES = ("left", "middle", "right")
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
OPEN, CLOSE = "<tool_call>", "</tool_call>"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call: a tool ``name`` and its ``arguments``, or the ``error`` that made it unreadable."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


def parse_hermes(text: str) -> list[ToolCall]:
    """The calls in ``text``, in order (module docstring for malformed ones)."""
    calls = [_one_call(body) for body in _HERMES.findall(text)]
    rest = _HERMES.sub("", text)
    if OPEN in rest:
        calls.append(ToolCall("", {}, error="a <tool_call> without its closing </tool_call>"))
    return calls


def _one_call(body: str) -> ToolCall:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError as e:
        return ToolCall("", {}, error=f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", {}, error='the tool call needs a JSON object with a string "name"')
    args = obj.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return ToolCall(obj["name"], {}, error='"arguments" is a string that is not a JSON object')
    if not isinstance(args, dict):
        return ToolCall(obj["name"], {}, error='"arguments" must be a JSON object')
    return ToolCall(obj["name"], args)


def truncate(text: str, max_chars: int, side: str) -> str:
    """``text`` cut to ``max_chars`` characters with a marker, as verl does: ``left`` keeps the beginning,
    ``right`` the end, ``middle`` half of each."""
    if len(text) <= max_chars:
        return text
    if side == "left":
        return text[:max_chars] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_chars:]
    half = max_chars // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half :]
