"""Values that used to pass the config and fail later (or never): each a one-line ConfigError naming the
key."""

from __future__ import annotations

import pytest

from klppo.config import load_config
from klppo.config.errors import ConfigError


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("algorithm.gamma=nan", "algorithm.gamma=nan: must be in [0, 1]"),  # every step skipped, exit 0
        (
            "actor_rollout_ref.actor.optim.lr=inf",
            "actor_rollout_ref.actor.optim.lr=inf: must be a finite number",
        ),
        ("critic.optim.lr=nan", "critic.optim.lr=nan"),
        ("trainer.seed=-1", "trainer.seed=-1: must be ≥ 0"),  # a traceback at the first batch
        ("data.seed=-3", "data.seed=-3: must be ≥ 0"),
        ("data.val_batch_size=-2", "data.val_batch_size=-2: must be ≥ 1"),
        ("data.train_files=5", "data.train_files=5: must be a Parquet path or a list of paths"),
        ("trainer.logger=[console,jsonl", "cannot parse the value (while parsing a flow sequence"),
        ("reward_model.reward_kwargs={method: flexible", "cannot parse the value"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        load_config([override])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_nan_anywhere_in_the_tree_is_refused():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.rollout.temperature=nan: must be"):
        load_config(["actor_rollout_ref.rollout.temperature=nan"])


def test_val_only_needs_validation_files():
    with pytest.raises(ConfigError, match="trainer.val_only=True validates data.val_files, which is null"):
        load_config(["trainer.val_only=True", "data.val_files=null"])
    load_config(["trainer.val_only=True"])  # the default val_files
