"""The tiny shape's facts as a fixture for the memory-model tests (tests/tune/tiny_shape.py)."""

from __future__ import annotations

import pytest

from klppo.tune.shapes import config_from_shape
from klppo.tune.units import ModelFacts
from tests.tune.tiny_shape import TINY


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return ModelFacts.from_config(config_from_shape(TINY))
