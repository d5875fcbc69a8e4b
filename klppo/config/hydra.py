"""verl's command-line conventions (hydra's), read the way verl reads them; no hydra import.

- Overrides (`parse_override`): `key=v` sets a schema key (an unknown key is an error, with the closest
  keys); `+key=v` / `++key=v` set it too, and for a key the schema lacks they are accepted with one warning
  naming the key (hydra appends new keys; klppo has nothing to give them to); `~key` / `~key=v` put the key
  back to its default. `???` (hydra's "missing" marker, e.g. verl's `rollout.name: ???`) leaves the default.
- verl's packaged config names (`--config-path=config --config-name=ppo_trainer`, which hydra resolves
  inside verl's package): `ppo_trainer` and `_generated_ppo_trainer` are klppo's own defaults (same key
  tree); the Megatron ones are klppo's defaults plus the translation of `megatron.py`. A file at the
  given path is read first.
- Booleans in frequency keys (`trainer.test_freq=False`): false is -1 (never), true is 1 (every step), as
  verl's `freq > 0 and step % freq == 0` reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from klppo.config.errors import ConfigError

MISSING = "???"
FREQUENCY_KEYS = ("trainer.test_freq", "trainer.save_freq")
# verl's packaged PPO configs (verl/trainer/config/<name>.yaml) that klppo's defaults stand for
PACKAGED_DEFAULTS = ("ppo_trainer", "_generated_ppo_trainer")
_NOT_PPO = ("sft_trainer", "sft_trainer_engine", "generation", "evaluation")


@dataclass(frozen=True)
class Override:
    """One command-line override: `op` is set (`k=v`), add (`+k=v`), force (`++k=v`) or delete (`~k`)."""

    op: str
    key: str
    value: Any
    text: str


def parse_override(text: str) -> Override:
    """`[+|++|~]key[=value]` → Override; the value is typed by YAML rules (OmegaConf's dotlist parser)."""
    op = "set"
    body = text
    if body.startswith("~"):
        op, body = "delete", body[1:]
    elif body.startswith("++"):
        op, body = "force", body[2:]
    elif body.startswith("+"):
        op, body = "add", body[1:]
    key, eq, raw = body.partition("=")
    key = key.strip()
    if not key or (op != "delete" and not eq):
        raise ConfigError(f"{text!r}: expected key=value")
    if op == "delete":
        return Override(op, key, None, text)
    try:
        value = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={raw}"]), resolve=False)["v"]
    except (OmegaConfBaseException, yaml.YAMLError) as e:  # an unclosed [ or { is YAML's error
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise ConfigError(
            f"{text!r}: cannot parse the value ({first}; quote it, or close its brackets)"
        ) from None
    return Override(op, key, value, text)


def config_name(name: str) -> str:
    """`ppo_trainer.yaml` → `ppo_trainer` (the stem hydra's --config-name takes)."""
    base = os.path.basename(name)
    return base.rsplit(".", 1)[0] if base.endswith((".yaml", ".yml")) else base


def packaged_config(path: str) -> bool:
    """True when `path` (absent on disk) names verl's packaged PPO defaults, which klppo's defaults
    stand for; raises ConfigError for a packaged non-PPO config; False otherwise."""
    name = config_name(path)
    if name in _NOT_PPO:
        raise ConfigError(
            f"--config-name={name} is verl's {name} config; klppo trains PPO only (ppo_trainer)"
        )
    return name in PACKAGED_DEFAULTS


def defaults_entries(defaults: Any) -> list[str]:
    """A YAML's hydra `defaults:` list as texts (`- ppo_megatron_trainer`, `actor: megatron_actor`)."""
    if defaults is None:
        return []
    entries = defaults if isinstance(defaults, list) else [defaults]
    return [" ".join(f"{v}" for v in e.values()) if isinstance(e, dict) else str(e) for e in entries]


def frequency_value(key: str, value: Any) -> tuple[Any, str | None]:
    """(value, note): a boolean frequency read as verl's code reads it (false → -1, true → 1)."""
    if key in FREQUENCY_KEYS and isinstance(value, bool):
        new = 1 if value else -1
        return new, f"{key}={value} is read as {key}={new} ({'every step' if value else 'never'})"
    return value, None
