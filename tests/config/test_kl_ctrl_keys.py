"""The KL controllers' keys are checked by name before anything loads."""

from __future__ import annotations

import pytest

from klppo.config import load_config
from klppo.config.errors import ConfigError
from klppo.config.unimplemented import check_trainable


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor_rollout_ref.actor.kl_loss_ctrl.type=pi"], "use_kl_loss=False"),
        (["actor_rollout_ref.actor.kl_loss_ctrl.type=pid"], "kl_loss_ctrl.type"),
        (
            [
                "actor_rollout_ref.actor.use_kl_loss=True",
                "actor_rollout_ref.actor.kl_loss_ctrl.type=pi",
                "actor_rollout_ref.actor.kl_loss_ctrl.target_kl=0",
            ],
            "kl_loss_ctrl.target_kl=0",
        ),
        (
            [
                "actor_rollout_ref.actor.use_kl_loss=True",
                "actor_rollout_ref.actor.kl_loss_ctrl.type=pi",
                "actor_rollout_ref.actor.kl_loss_coef=0.5",
                "actor_rollout_ref.actor.kl_loss_ctrl.max_coef=0.1",
            ],
            "kl_loss_ctrl.min_coef",
        ),
        (["algorithm.kl_ctrl.type=pi", "algorithm.kl_ctrl.ki=0"], "algorithm.kl_ctrl.kp"),
        (["algorithm.kl_ctrl.target_kl_start=0.2"], "algorithm.kl_ctrl.target_kl_start=0.2"),
        (["algorithm.kl_ctrl.type=pi", "algorithm.kl_ctrl.anneal_steps=10"], "target_kl_start is null"),
        (["algorithm.kl_ctrl.type=pi", "algorithm.kl_ctrl.target_kl_start=-1"], "kl_ctrl.target_kl_start=-1"),
        (
            [
                "algorithm.kl_ctrl.type=adaptive",
                "algorithm.kl_ctrl.target_kl_start=0.2",
                "algorithm.kl_ctrl.anneal_begin=-1",
            ],
            "algorithm.kl_ctrl.anneal_begin=-1",
        ),
    ],
)
def test_kl_controller_keys_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        check_trainable(load_config(overrides))


def test_pi_kl_loss_controller_accepted():
    cfg = load_config(
        ["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_ctrl.type=pi"]
    )
    check_trainable(cfg)
    assert cfg.actor_rollout_ref.actor.kl_loss_ctrl.target_kl == 0.05
