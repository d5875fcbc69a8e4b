"""Typing of user values: YAML/override values converted to a schema field's type, or a clear error.

Rules: `${...}` interpolations pass unchanged (typed after resolution); int fields take integral floats
and numeric strings (`1e8` → 100000000); float fields take ints; bool fields take true/false (any case)
only; string fields take numbers (written back as text); list fields take a single element as a
one-element list; null only where the field is optional.
"""

from __future__ import annotations

import types
import typing
from typing import Any, Union

from klppo.config._walk import NoneType, is_group, type_name
from klppo.config.errors import ConfigError

_TRUE = {"true", "yes", "on"}
_FALSE = {"false", "no", "off"}


class _Mismatch(Exception):
    pass


def is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def coerce(value: Any, tp: Any, key: str) -> Any:
    """`value` converted to annotation `tp` for `key`; raises ConfigError naming key, value and type."""
    try:
        return _coerce(value, tp)
    except _Mismatch:
        shown = "null" if value is None else repr(value)
        raise ConfigError(f"{key}={shown}: expected {type_name(tp)}, got {_kind(value)}") from None


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return type(value).__name__ if not isinstance(value, str) else "text"


def _coerce(value: Any, tp: Any) -> Any:
    if is_interpolation(value) or tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None:
            if NoneType in args:
                return None
            raise _Mismatch
        for a in args:
            if a is NoneType:
                continue
            try:
                return _coerce(value, a)
            except _Mismatch:
                pass
        raise _Mismatch
    if value is None:
        raise _Mismatch
    if tp is bool:
        return _to_bool(value)
    if tp is int:
        return _to_int(value)
    if tp is float:
        return _to_float(value)
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise _Mismatch
    if origin is list:
        elem = args[0] if args else Any
        items = value if isinstance(value, list) else [value]
        if isinstance(value, dict):
            raise _Mismatch
        return [_coerce(v, elem) for v in items]
    if origin is dict:
        if isinstance(value, dict):
            return value
        raise _Mismatch
    if is_group(tp):
        raise _Mismatch
    raise _Mismatch


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    raise _Mismatch


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        text = value.strip().replace("_", "")
        try:
            return int(text)
        except ValueError:
            try:
                value = float(text)
            except ValueError:
                raise _Mismatch from None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    raise _Mismatch


def _to_float(value: Any) -> float:
    if isinstance(value, bool):
        raise _Mismatch
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip().replace("_", ""))
        except ValueError:
            raise _Mismatch from None
    raise _Mismatch
