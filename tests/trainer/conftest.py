"""Fixtures for end-to-end trainer tests: a tiny model directory and a small GSM8K-format prompt set."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from klppo.models.tiny import save_tiny_model_dir

    return save_tiny_model_dir(tmp_path_factory.mktemp("tiny_model"), num_layers=2, hidden_size=64)


@pytest.fixture(scope="session")
def arithmetic_data(tmp_path_factory) -> tuple[Path, Path]:
    from klppo.data.arithmetic import write_arithmetic_parquet

    return write_arithmetic_parquet(tmp_path_factory.mktemp("data"), num_train=64, num_test=8, seed=0)
