"""`load_config(argv)`: schema defaults + optional user YAML + dotted overrides → frozen `KLPPOConfig`.

Order: (1) the schema's defaults (the packaged `ppo_trainer.yaml` is their generated documentation, not
read here); (2) the user's YAML file (first argument, when it ends in .yaml/.yml, or hydra's
`--config-path/--config-name`; verl's packaged names are read as in `hydra.py`); (3) overrides left to
right, with hydra's `+`, `++` and `~` (see `hydra.py`). Megatron keys are translated to their FSDP2
counterparts as they are read, with one notice (`megatron.py`). Every key is checked against the schema
(unknown → the closest valid keys), every value typed
(see `_coerce`), key aliases rewritten, value aliases normalized (`aliases.py`), then `${...}`
interpolations are resolved and the result validated (`checks.validate`). The result is frozen dataclasses.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from klppo.config import hydra
from klppo.config._coerce import coerce
from klppo.config._walk import all_keys, hints, is_group, lookup
from klppo.config.aliases import KEY_ALIASES, get, normalize, put
from klppo.config.checks import validate
from klppo.config.errors import ConfigError, notice
from klppo.config.megatron import CONFIG_NAMES as MEGATRON_CONFIG_NAMES
from klppo.config.megatron import Translator, is_megatron_key
from klppo.config.schema import KLPPOConfig

Notify = Callable[[str], None]
_META_KEYS = {"_target_"}  # verl's instantiation hints, meaningless here
_IGNORED_TOP = {"defaults", "hydra"}  # hydra's own sections
CONFIG_FLAGS = ("--config-path", "--config-name", "--config-dir")  # hydra's, read by `split_argv`


def load_config(
    argv: list[str], *, notify: Notify | None = None, skipped: list[ConfigError] | None = None
) -> KLPPOConfig:
    """Parse `[file.yaml] key=value ...` exactly as given on the command line.

    Raises ConfigError for unknown keys, wrong types, refused values and inconsistent sizes; aliases and
    other notes go through `notify` (default: one line on stderr, rank 0 only). With ``skipped``, a bad key
    or value of the file or the command line is appended there and left out instead of raised, so that the
    rest loads and a caller can name every such problem at once (`klppo train`); what is wrong across keys
    still raises.
    """
    notify = notify or notice
    path, texts = split_argv(argv)
    overrides = [o for o in (_skipping(skipped, hydra.parse_override, t) for t in texts) if o is not None]
    megatron = Translator()
    items = _read_config_file(path, notify, megatron) if path is not None else []
    megatron.scan([(k, v) for k, v, _ in items] + [(o.key, o.value) for o in overrides])
    tree = copy.deepcopy(_default_tree())
    for item in megatron.items(items):
        _skipping(skipped, _apply, tree, [item], notify)
    for o in overrides:
        if o.op == "delete" and is_megatron_key(o.key):
            megatron.deleted(o.key)
        elif o.op != "delete" and megatron.touches(o.key, o.value):
            _skipping(skipped, _apply, tree, megatron.items([(o.key, o.value, "command line")]), notify)
        else:
            _skipping(skipped, _apply_override, tree, o, notify)
    megatron.finish(notify)
    normalize(tree, notify)
    cfg = _resolve(tree)
    validate(cfg, notify)
    return cfg


def _skipping(skipped: list[ConfigError] | None, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; with ``skipped``, a ConfigError goes there (None returned) instead of up."""
    if skipped is None:
        return fn(*args)
    try:
        return fn(*args)
    except ConfigError as exc:
        skipped.append(exc)
        return None


@functools.cache
def _default_tree() -> dict[str, Any]:
    """The schema's defaults (plain, unresolved; cached). The packaged ppo_trainer.yaml is documentation
    generated from the schema (a test keeps it current); it is not read here."""
    return dataclasses.asdict(KLPPOConfig())


def default_value(key: str) -> Any:
    """The schema default of dotted `key` (unresolved: interpolations as written)."""
    return copy.deepcopy(get(_default_tree(), key))


def split_argv(argv: list[str]) -> tuple[str | None, list[str]]:
    """(yaml path or None, overrides) from a command line; raises ConfigError for stray arguments."""
    args = list(argv)
    path: str | None = None
    cfg_dir = cfg_name = None
    rest: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        if not a.strip():  # an empty word left by a shell line continuation
            i += 1
            continue
        for flag in CONFIG_FLAGS:
            if a == flag or a.startswith(flag + "="):
                if a == flag:
                    if i + 1 >= len(args):
                        raise ConfigError(f"{flag} needs a value")
                    i += 1
                    val = args[i]
                else:
                    val = a.split("=", 1)[1]
                if flag == "--config-name":
                    cfg_name = val
                else:
                    cfg_dir = val
                break
        else:
            if i == 0 and "=" not in a and a.endswith((".yaml", ".yml")):
                path = a
            elif "=" not in a and not a.startswith("~"):
                raise ConfigError(
                    f"unexpected argument {a!r}: expected [config.yaml] followed by key=value overrides"
                )
            else:
                rest.append(a)
        i += 1
    if cfg_name is not None:
        name = cfg_name if cfg_name.endswith((".yaml", ".yml")) else cfg_name + ".yaml"
        path = os.path.join(cfg_dir or ".", name)
    return path, rest


def _read_config_file(path: str, notify: Notify, megatron: Translator) -> list[tuple[str, Any, str]]:
    """(key, value, source) of the user's YAML, hydra sections dropped; none when the path is absent and
    names verl's packaged PPO defaults (klppo's defaults stand for them; the Megatron ones add each role's
    `strategy: megatron`, see `megatron.py`).

    A file with a hydra `defaults:` list is composed the way hydra composes it: its keys are added to the
    defaults, so a key klppo's schema lacks is ignored with one note naming it (as `+key=v`); in a plain
    file an unknown key is an error (most often a typo)."""
    name = hydra.config_name(path)
    if not os.path.isfile(os.path.expanduser(path)) and name in MEGATRON_CONFIG_NAMES:
        return megatron.config_name(name, f"--config-name={name}")
    if not os.path.isfile(os.path.expanduser(path)) and hydra.packaged_config(path):
        notify(f"{path}: verl's packaged {name} config: klppo's defaults stand for it")
        return []
    data = _read_yaml(path)
    composed = "defaults" in data
    base: list[tuple[str, Any, str]] = []
    for entry in hydra.defaults_entries(data.get("defaults")):
        if "megatron" in entry:  # the packaged Megatron config or one of its groups (megatron_actor, ...)
            base = megatron.config_name(hydra.config_name(entry), f"defaults entry {entry} in {path}")
    for key in _IGNORED_TOP & set(data):
        notify(f"{path}: hydra section '{key}' ignored (klppo starts from its own verl-compatible defaults)")
        del data[key]
    items = _flatten(data, source=path)
    if composed:
        unknown = [i for i in items if _unknown(i[0]) and not megatron.touches(i[0], i[1])]
        for key, _, _ in unknown:
            notify(f"{path}: klppo has no key {key!r}; ignored (the file adds it to verl's defaults)")
        items = [i for i in items if i not in unknown]
    return base + items


def _unknown(key: str) -> bool:
    return lookup(KLPPOConfig, key.split("."))[0] == "unknown"


def _read_yaml(path: str) -> dict[str, Any]:
    p = os.path.expanduser(path)
    if not os.path.isfile(p):
        raise ConfigError(f"config file {path!r} not found")
    try:
        data = _to_plain(OmegaConf.load(p))
    except (OmegaConfBaseException, OSError, ValueError, yaml.YAMLError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        mark = getattr(e, "problem_mark", None)
        if isinstance(e, yaml.MarkedYAMLError) and mark is not None:  # yaml counts from 0
            first = f"line {mark.line + 1}, column {mark.column + 1}: {e.problem or e.context or first}"
        raise ConfigError(f"{path}: not a readable YAML mapping ({first})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of keys at the top level, got {type(data).__name__}")
    return data


def _to_plain(node: Any) -> Any:
    return OmegaConf.to_container(node, resolve=False)


def _flatten(data: dict[str, Any], *, source: str, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) for every leaf of a user mapping, descending through schema groups."""
    out: list[tuple[str, Any, str]] = []
    for k, v in data.items():
        if k in _META_KEYS:
            continue
        key = f"{prefix}{k}"
        kind, _, _ = lookup(KLPPOConfig, key.split("."))
        if kind in ("group", "unknown") and isinstance(v, dict):
            out += _flatten(v, source=source, prefix=key + ".")
        else:
            out.append((key, v, source))
    return out


def _apply_override(tree: dict[str, Any], o: hydra.Override, notify: Notify) -> None:
    kind, _, _ = lookup(KLPPOConfig, o.key.split("."))
    if kind == "unknown" and o.op in ("add", "force") and o.key not in KEY_ALIASES:
        notify(f"{o.text}: klppo has no key {o.key!r}; ignored")
        return
    if o.op == "delete":
        if kind == "inside":
            raise ConfigError(f"{o.text}: only whole keys can be deleted (set {o.key}=... instead)")
        if kind == "unknown":
            raise ConfigError(unknown_key_message(o.key, lookup(KLPPOConfig, o.key.split("."))[2]))
        notify(f"{o.text}: {o.key} is back to its default")
        put(tree, o.key, default_value(o.key))
        return
    _apply(tree, [(o.key, o.value, "command line")], notify)


def _apply(tree: dict[str, Any], items: list[tuple[str, Any, str]], notify: Notify) -> None:
    for key, value, source in items:
        if value == hydra.MISSING:
            continue  # hydra's "no value yet": the default stays
        value, note = hydra.frequency_value(key, value)
        if note:
            notify(note)
        for target in _expand_alias(key, value, notify):
            _set(tree, target, value, source)


def _expand_alias(key: str, value: Any, notify: Notify) -> Iterator[str]:
    if key in KEY_ALIASES:
        if lookup(KLPPOConfig, key.split("."))[0] == "leaf" and value == default_value(key):
            return  # the alias key's own default (e.g. verl's `${oc.select:...}` text): nothing to set
        targets = KEY_ALIASES[key]
        notify(f"{key} is read as {' and '.join(targets)}")
        yield from targets
    else:
        yield key


def _set(tree: dict[str, Any], key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    kind, tp, depth = lookup(KLPPOConfig, parts)
    if kind == "unknown":
        raise ConfigError(unknown_key_message(key, depth, source))
    if kind == "group":
        if isinstance(value, dict):
            for k, v in value.items():
                if k not in _META_KEYS:
                    _set(tree, f"{key}.{k}", v, source)
            return
        raise ConfigError(f"{key} is a group of keys (set {key}.<name>=...), not a value: got {value!r}")
    if kind in ("leaf", "inside"):
        value = _strip_meta(value)
    if kind == "leaf":
        value = coerce(value, tp, key)
    node = tree
    for name in parts[:-1]:
        if not isinstance(node.get(name), dict):
            node[name] = {}
        node = node[name]
    node[parts[-1]] = value


def _strip_meta(value: Any) -> Any:
    """A mapping value without verl's `_target_` instantiation hints, at any depth."""
    if isinstance(value, dict):
        return {k: _strip_meta(v) for k, v in value.items() if k not in _META_KEYS}
    if isinstance(value, list):
        return [_strip_meta(v) for v in value]
    return value


def unknown_key_message(key: str, depth: int, source: str = "command line") -> str:
    """`unknown key X (from SRC); did you mean: A, B?` with the closest schema keys (difflib)."""
    keys = all_keys(KLPPOConfig)
    parts = key.split(".")
    parent = ".".join(parts[:depth])
    leaf = parts[min(depth, len(parts) - 1)]
    siblings = [k.rsplit(".", 1)[-1] for k in keys if (k.rsplit(".", 1)[0] if "." in k else "") == parent]
    local = [
        f"{parent}.{n}" if parent else n for n in difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)
    ]
    near = difflib.get_close_matches(key, keys, n=3, cutoff=0.75)
    same_name = [k for k in keys if difflib.SequenceMatcher(None, k.rsplit(".", 1)[-1], leaf).ratio() >= 0.85]
    suggestions = list(dict.fromkeys(local + near + same_name[:3]))[:4]
    msg = f"unknown key {key!r}" + (f" (from {source})" if source else "")
    if suggestions:
        msg += "; did you mean: " + ", ".join(suggestions) + "?"
    elif siblings:
        msg += f"; valid keys under {parent or 'the top level'}: " + ", ".join(siblings)
    return msg + " (docs/configuration.md lists every key)"


def _resolve(tree: dict[str, Any]) -> KLPPOConfig:
    """Resolve `${...}` interpolations (OmegaConf) and build the frozen dataclass tree, typing every leaf."""
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"{key}: cannot resolve interpolation: {str(e).splitlines()[0]}") from None
    return _build(KLPPOConfig, resolved, "")


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    kwargs = {}
    for f in dataclasses.fields(cls):
        tp, key = hints(cls)[f.name], prefix + f.name
        value = data[f.name]
        kwargs[f.name] = _build(tp, value, key + ".") if is_group(tp) else coerce(value, tp, key)
    return cls(**kwargs)
