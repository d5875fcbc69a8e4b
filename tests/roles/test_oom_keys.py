"""The out-of-memory retry's message names the key that starts a new run at the halved micro-batch."""

from klppo.config.checks import value_at
from klppo.config.schema import KLPPOConfig
from klppo.roles.oom import OOM_KEYS, config_key


def test_every_pass_names_a_key_of_the_schema():
    cfg = KLPPOConfig()
    for role, phase in OOM_KEYS:
        for field in ("micro_batch_size", "max_token_len"):
            value_at(cfg, config_key(role, phase, field))  # raises on a key the schema lacks
    assert config_key("critic", "values", "max_token_len") == "critic.forward_max_token_len_per_gpu"
    assert (
        config_key("actor", "update", "micro_batch_size")
        == "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    )
    assert config_key("reward", "score", "micro_batch_size") is None


def test_the_named_token_budget_is_the_config_value_under_sequence_parallelism():
    """A Ulysses group's budget is the key's value × the group's size: 16384 → 8192 in the run is
    ppo_max_token_len_per_gpu=4096 with a group of 2."""
    from klppo.roles.oom import OOMRecovery

    assert OOMRecovery("actor", sp_size=2)._config_value("max_token_len", 8192) == 4096
    assert OOMRecovery("actor", sp_size=2)._config_value("micro_batch_size", 4) == 4
    assert OOMRecovery("actor")._config_value("max_token_len", 8192) == 8192


def test_the_named_update_micro_batch_divides_the_mini_batch():
    """5 samples per GPU halved to 2 in the run: a new run must start at a divisor of 5 (1), else the size
    check refuses the value the message suggested."""
    from klppo.roles.oom import OOMRecovery

    assert OOMRecovery("actor", update_rows=5)._config_value("micro_batch_size", 2, "update") == 1
    assert OOMRecovery("actor", update_rows=8)._config_value("micro_batch_size", 4, "update") == 4
    assert OOMRecovery("actor", update_rows=12)._config_value("micro_batch_size", 5, "update") == 4
    assert OOMRecovery("actor", update_rows=5)._config_value("micro_batch_size", 2, "log_prob") == 2
