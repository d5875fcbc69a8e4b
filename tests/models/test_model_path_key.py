"""A model path that does not resolve names the config key that gave it (a critic's or a tokenizer's path
said only "model path ... does not exist")."""

from __future__ import annotations

import pytest

from klppo.models.loading import ModelLoadError, model_dir


def test_the_key_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match=r"^critic.model.path: model path '.*nope' does not exist"):
        model_dir(str(tmp_path / "nope"), key="critic.model.path")
    with pytest.raises(ModelLoadError, match=r"^model path"):
        model_dir(str(tmp_path / "nope"))
