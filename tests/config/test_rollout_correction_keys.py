"""`algorithm.rollout_correction.*`: what `klppo train` runs, and each value it cannot honour named by key."""

from __future__ import annotations

import pytest

from klppo.assembly.settings import rollout_correction_settings, skips_old_log_prob_pass
from klppo.config import load_config
from klppo.config.errors import ConfigError
from klppo.config.unimplemented import check_trainable

Q = {"notify": lambda _m: None}
K = "algorithm.rollout_correction"


@pytest.mark.parametrize(
    "args",
    [
        [f"{K}.rollout_is=token"],
        [
            f"{K}.rollout_is=sequence",
            f"{K}.rollout_is_threshold=0.5_5.0",
            f"{K}.rollout_is_batch_normalize=true",
        ],
        [f"{K}.bypass_mode=true"],
        [f"{K}.bypass_mode=true", f"{K}.loss_type=reinforce", f"{K}.rollout_is=token"],
        [f"{K}.rollout_rs=seq_mean_k3", f"{K}.rollout_rs_threshold=0.1"],
        [
            f"{K}.rollout_is=token",
            f"{K}.rollout_rs=token_k1,seq_max_k2",
            f"{K}.rollout_rs_threshold=0.5_2,0.2",
        ],
    ],
)
def test_supported_settings_train(args: list[str]) -> None:
    cfg = load_config(args, **Q)
    check_trainable(cfg, notify=lambda _m: None)
    settings = rollout_correction_settings(cfg)
    assert settings is not None and settings.bypass_mode == cfg.algorithm.rollout_correction.bypass_mode


def test_defaults_change_nothing() -> None:
    cfg = load_config(["actor_rollout_ref.actor.skip_old_log_prob_on_policy=true"], **Q)
    assert rollout_correction_settings(cfg) is None
    assert skips_old_log_prob_pass(cfg)
    decoupled = load_config(
        ["actor_rollout_ref.actor.skip_old_log_prob_on_policy=true", f"{K}.rollout_is=token"], **Q
    )
    assert not skips_old_log_prob_pass(decoupled)  # the weights need π_old from the pass


@pytest.mark.parametrize(
    "args,named",
    [
        ([f"{K}.rollout_is=tokens"], f"{K}.rollout_is="),
        ([f"{K}.rollout_is=token", f"{K}.rollout_is_threshold=2.0_1.0"], f"{K}.rollout_is_threshold"),
        (
            [
                f"{K}.rollout_rs=seq_mean_k3",
                f"{K}.rollout_rs_threshold=0.1",
                f"{K}.bypass_mode=true",
                "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
            ],
            "seq-mean-token-mean",
        ),
        ([f"{K}.rollout_rs=seq_mean_k3"], "rollout_rs_threshold"),
        ([f"{K}.rollout_rs=token_k9", f"{K}.rollout_rs_threshold=0.1"], "token_k9"),
        ([f"{K}.bypass_mode=true", f"{K}.loss_type=pg"], f"{K}.loss_type"),
        ([f"{K}.bypass_mode=true", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], f"{K}.bypass_mode"),
        (
            [f"{K}.bypass_mode=true", f"{K}.rollout_is=token", f"{K}.rollout_is_batch_normalize=true"],
            f"{K}.rollout_is_batch_normalize",
        ),
        ([f"{K}.rollout_is=token", "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean"], "geo_mean"),
        (
            [f"{K}.bypass_mode=true", "algorithm.use_kl_in_reward=true", "data.logged_files=log.parquet"],
            "use_kl_in_reward",
        ),
    ],
)
def test_unsupported_values_are_refused_by_name(args: list[str], named: str) -> None:
    cfg = load_config(args, **Q)  # klppo config accepts them
    with pytest.raises(ConfigError) as e:
        check_trainable(cfg, notify=lambda _m: None)
    assert named in str(e.value)
