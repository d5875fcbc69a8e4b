"""Introspection of the schema dataclasses: what a dotted key is, the list of all keys, type names.

Kinds of a dotted path: `group` (a nested dataclass), `leaf` (a typed value; dict-typed fields are leaves
holding a whole mapping) and `inside` (a sub-key of a dict- or Any-typed leaf, e.g.
`reward_model.reward_kwargs.method`, which the schema does not constrain).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, Union

NoneType = type(None)


@functools.cache
def hints(cls: type) -> dict[str, Any]:
    """Resolved type annotations of a schema dataclass."""
    return typing.get_type_hints(cls)


def is_group(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def lookup(root: type, parts: list[str]) -> tuple[str, Any, int]:
    """Walk `parts` from `root`: returns (kind, type, depth reached).

    kind is `group`, `leaf`, `inside` or `unknown`; for `unknown`, depth is the number of parts that
    were valid (the group where the walk stopped is `parts[:depth]`).
    """
    tp: Any = root
    for i, name in enumerate(parts):
        if is_group(tp):
            h = hints(tp)
            if name not in h:
                return "unknown", tp, i
            tp = h[name]
            continue
        if _is_open(tp):
            return "inside", Any, i
        return "unknown", tp, i
    return ("group" if is_group(tp) else "leaf"), tp, len(parts)


def _is_open(tp: Any) -> bool:
    """A leaf that can hold arbitrary sub-keys (dict-typed, or Any)."""
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin is dict:
        return True
    if origin in (Union, types.UnionType):
        return any(_is_open(a) for a in typing.get_args(tp) if a is not NoneType)
    return False


@functools.cache
def all_keys(root: type) -> tuple[str, ...]:
    """Every dotted key of the schema, groups included, in declaration order."""
    out: list[str] = []

    def walk(cls: type, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            out.append(key)
            tp = hints(cls)[f.name]
            if is_group(tp):
                walk(tp, key + ".")

    walk(root, "")
    return tuple(out)


def type_name(tp: Any) -> str:
    """Human name of an annotation: `int`, `float`, `bool (true/false)`, `list of int`, `int or null`."""
    if tp is Any:
        return "any value"
    if tp is bool:
        return "bool (true/false)"
    if tp in (int, float):
        return tp.__name__
    if tp is str:
        return "string"
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    if origin in (Union, types.UnionType):
        names = [type_name(a) for a in args if a is not NoneType]
        if NoneType in args:
            names.append("null")
        return " or ".join(names)
    if is_group(tp):
        return "group of keys"
    return getattr(tp, "__name__", str(tp))
