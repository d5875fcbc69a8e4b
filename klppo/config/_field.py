"""Field helper for the schema: a default plus a one-line meaning, kept on the dataclass field.

`F(default, "meaning", see="guide.md#section")` returns a `dataclasses.field` whose metadata holds the help
text that `docs/configuration.md` is generated from (one sentence, at most `HELP_MAX_CHARS` characters) and,
in `see`, the section of a hand-written guide under `docs/` that explains the key at length. Mutable
defaults (lists, dicts, nested dataclasses) get a `default_factory` so that frozen dataclasses stay valid.
`II(path)` writes an OmegaConf interpolation (`${path}`): the key follows another key unless the user sets it.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

HELP_MAX_CHARS = 200
"""Longest help text: one sentence; the explanation belongs in the guide section that `see` names."""


def F(
    default: Any,
    help: str = "",  # noqa: A002
    *,
    see: str = "",
    factory: Callable[[], Any] | None = None,
) -> Any:
    """A schema field with a default, a one-line meaning (`metadata["help"]`) and, optionally, the guide
    section that explains it (`metadata["see"]`, a path under `docs/` with its anchor: `sharding.md#...`).

    `factory` builds the default instead (a nested group whose defaults differ per role).
    """
    meta = {"help": help, "see": see}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    if dataclasses.is_dataclass(default) and isinstance(default, type):
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def II(path: str) -> str:
    """OmegaConf interpolation string `${path}` (resolved when the config is loaded)."""
    return "${" + path + "}"


def SEL(path: str, fallback: str) -> str:
    """`${oc.select:path,fallback}`: follow `path`, or `fallback` when it is absent (verl's form)."""
    return "${oc.select:" + path + "," + fallback + "}"
