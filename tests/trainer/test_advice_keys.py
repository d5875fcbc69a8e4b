"""Every fully qualified config key that a run's advice names exists in the schema (a key that does not
exist sends the user to a ConfigError)."""

from __future__ import annotations

import re

import pytest

from klppo.config.checks import value_at
from klppo.config.schema import KLPPOConfig
from klppo.ops import monitor_rules
from klppo.trainer import timer

KEY = re.compile(
    r"\b((?:actor_rollout_ref|critic|reward_model|data|algorithm|trainer|monitor)(?:\.[a-z_0-9]+)+)"
)


def _keys(text: str) -> list[str]:
    return [k.rstrip(".") for k in KEY.findall(text)]


ADVICE = {
    **{f"oom/{phase}": text for phase, text in timer._OOM_ADVICE.items()},
    **{f"drift/{name}": text for name, text in monitor_rules.DRIFT_ADVICE.items()},
}


@pytest.mark.parametrize("name", sorted(ADVICE))
def test_the_keys_an_advice_names_exist(name):
    keys = _keys(ADVICE[name])
    assert keys, f"{name}: names no key"
    for key in keys:
        value_at(KLPPOConfig(), key)  # AttributeError on a key the schema lacks


def test_the_reward_phase_has_its_own_advice():
    assert "reward_model.micro_batch_size_per_gpu" in timer._OOM_ADVICE["reward"]
