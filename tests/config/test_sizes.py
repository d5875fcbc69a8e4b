"""derive_sizes and the cross-field rules: numbers and units (prompts vs samples) in every message."""

from __future__ import annotations

import itertools

import pytest

from klppo.config import ConfigError, derive_sizes, load_config

Q = {"notify": lambda _m: None}


def _cfg(**kv) -> object:
    return load_config([f"{k}={v}" for k, v in kv.items()], **Q)


def _args(tb, mini, n, micro, ctr_micro=None):
    a = {
        "data.train_batch_size": tb,
        "actor_rollout_ref.actor.ppo_mini_batch_size": mini,
        "actor_rollout_ref.rollout.n": n,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": micro,
    }
    if ctr_micro:
        a["critic.ppo_micro_batch_size_per_gpu"] = ctr_micro
    return a


def test_sizes_match_hand_computation_over_a_grid():
    checked = refused = 0
    for tb, mini, n, micro in itertools.product((8, 12), (2, 4), (1, 3), (1, 2)):
        cfg = _cfg(**_args(tb, mini, n, micro))
        for world in (1, 2, 4):
            ok = tb % world == 0 and (mini * n) % world == 0 and ((mini * n) // world) % micro == 0
            if not ok:
                with pytest.raises(ConfigError):
                    derive_sizes(cfg, world)
                refused += 1
                continue
            s = derive_sizes(cfg, world)
            checked += 1
            assert s.samples_per_step == tb * n
            assert s.prompts_per_rank * world == tb
            assert s.samples_per_rank * world == tb * n
            assert s.actor_mini_batch_samples_per_rank * world == mini * n
            assert s.actor_micro_batch_size_per_gpu == micro
            assert s.actor_grad_accum_steps * micro * world == mini * n
            assert s.num_actor_updates_per_step == tb // mini
            assert s.log_prob_micro_batch_size_per_gpu == micro  # falls back to the actor's
            assert s.uses_critic  # gae by default; critic micro unset → one pass over its share
            assert (
                s.critic_micro_batch_size_per_gpu
                == s.critic_mini_batch_samples_per_rank
                == (mini * n) // world
            )
    assert checked > 15 and refused > 5


def test_ulysses_divides_data_parallel_size(issue_list):
    cfg = load_config(issue_list, **Q)
    s = derive_sizes(cfg, 8)
    # 128 prompts × 4 = 512 samples per update over 8 ranks / ulysses 2 = 4 dp groups → 128 per GPU
    assert (s.actor_dp_size, s.actor_mini_batch_samples_per_rank) == (4, 128)
    assert (s.samples_per_step, s.prompts_per_rank, s.samples_per_rank) == (2048, 64, 256)
    assert s.actor_micro_batch_size_per_gpu is None  # dynamic batch size: token budget instead
    cfg = load_config([*issue_list, "data.train_batch_size=384"], **Q)
    with pytest.raises(ConfigError, match="ulysses_sequence_parallel_size=2 does not divide the 3 ranks"):
        derive_sizes(cfg, 3)


def test_messages_show_numbers_and_units():
    with pytest.raises(ConfigError) as e:
        derive_sizes(_cfg(**_args(64, 16, 4, 6)), 2)
    msg = str(e.value)
    for part in (
        "ppo_mini_batch_size=16 prompts",
        "rollout.n=4",
        "64 samples",
        "2 data-parallel",
        "32 samples per GPU",
        "ppo_micro_batch_size_per_gpu=6 samples",
    ):
        assert part in msg, (part, msg)
    with pytest.raises(ConfigError, match=r"train_batch_size=30 prompts is not divisible by the 4 ranks"):
        derive_sizes(_cfg(**_args(30, 10, 2, 1)), 4)
    with pytest.raises(
        ConfigError, match=r"ppo_mini_batch_size=64 prompts is larger than data.train_batch_size=32"
    ):
        _cfg(**_args(32, 64, 2, 1))
    with pytest.raises(ConfigError, match=r"train_batch_size=24 prompts is not a multiple of .*=16 prompts"):
        _cfg(**_args(24, 16, 2, 1))
    with pytest.raises(ConfigError, match=r"= 12 samples per update is not divisible by 8 data-parallel"):
        derive_sizes(_cfg(**_args(24, 4, 3, 1)), 8)


def test_deprecated_global_micro_batch_and_exclusivity():
    a = _args(16, 8, 2, 1)
    del a["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]
    a["actor_rollout_ref.actor.ppo_micro_batch_size"] = 8
    s = derive_sizes(_cfg(**a), 2)
    assert s.actor_micro_batch_size_per_gpu == 4
    a["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"] = 2
    with pytest.raises(ConfigError, match="set only the _per_gpu one"):
        derive_sizes(_cfg(**a), 2)


def test_unset_micro_batch_means_one_pass_and_log_prob_sizes():
    cfg = _cfg(
        **{
            "data.train_batch_size": 16,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 8,
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": 3,
            "algorithm.adv_estimator": "grpo",
            "actor_rollout_ref.rollout.n": 2,
        }
    )
    s = derive_sizes(cfg, 2)
    assert s.actor_micro_batch_size_per_gpu == 8 and s.actor_grad_accum_steps == 1
    assert s.log_prob_micro_batch_size_per_gpu == 3 and s.ref_log_prob_micro_batch_size_per_gpu == 3
    assert not s.uses_critic and s.critic_mini_batch_samples_per_rank is None


def test_token_budget_must_hold_one_sequence():
    with pytest.raises(ConfigError, match=r"ppo_max_token_len_per_gpu=500 tokens .* = 768 tokens"):
        _cfg(
            **{
                "actor_rollout_ref.actor.use_dynamic_bsz": True,
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 500,
                "data.max_prompt_length": 512,
                "data.max_response_length": 256,
            }
        )


def test_group_estimator_with_one_sample_warns():
    notes: list[str] = []
    load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=1"], notify=notes.append)
    assert any("rollout.n=1" in m and "grpo" in m for m in notes)
    notes.clear()
    load_config(["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2"], notify=notes.append)
    assert notes == []


def test_critic_enable_follows_the_estimator_and_is_said_when_it_does_nothing():
    """One rule for 'the run has a critic' (config.uses_critic): the estimator reads values.
    critic.enable=True with GRPO builds nothing, so load says that the key has no effect, by name; with GAE
    (or unset) no note;
    critic.enable=False with GAE is refused. The rule's estimator list is the advantage registry's."""
    from klppo.algorithms.advantages import ADVANTAGE_ESTIMATORS, needs_critic
    from klppo.config import uses_critic
    from klppo.config.sizes import CRITIC_ESTIMATORS

    assert list(CRITIC_ESTIMATORS) == [n for n in ADVANTAGE_ESTIMATORS if needs_critic(n)]
    notes: list[str] = []
    cfg = load_config(["algorithm.adv_estimator=grpo", "critic.enable=True"], notify=notes.append)
    assert not uses_critic(cfg)
    assert [m for m in notes if "critic.enable=True has no effect with algorithm.adv_estimator=grpo" in m]
    for over in (["algorithm.adv_estimator=gae", "critic.enable=True"], ["algorithm.adv_estimator=gae"]):
        notes.clear()
        assert uses_critic(load_config(over, notify=notes.append))
        assert not [m for m in notes if "critic.enable" in m]
    with pytest.raises(ConfigError, match="critic.enable=False"):
        load_config(["algorithm.adv_estimator=gae", "critic.enable=False"])


def test_kl_in_reward_with_std_normalised_groups_warns():
    """GRPO divides by the group std: with the KL in the reward, equal task scores leave only the KL penalty,
    scaled to unit size (tests/algorithms/test_outcome.py shows the effect); the note says what to set."""
    notes: list[str] = []
    kl_in_reward = ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=True"]
    load_config(kl_in_reward, notify=notes.append)
    assert any("norm_adv_by_std_in_grpo=True" in m and "use_kl_loss=True" in m for m in notes)
    for fixed in (
        kl_in_reward + ["algorithm.norm_adv_by_std_in_grpo=False"],
        ["algorithm.adv_estimator=rloo", "algorithm.use_kl_in_reward=True"],
    ):
        notes.clear()
        load_config(fixed, notify=notes.append)
        assert not any("norm_adv_by_std_in_grpo" in m for m in notes)


def test_pi_controller_floor_far_below_its_start_is_noted():
    """ln(kl_coef/min_coef)/ki steps to climb back: 0.01/0.001 at ki 0.05 is 46 steps (a run that
    could not recover its β in time) → a note naming the keys; the defaults (ln 10 / 0.2 = 12 steps) →
    none."""
    notes: list[str] = []
    reward_pi = [
        "algorithm.use_kl_in_reward=True",
        "algorithm.adv_estimator=gae",
        "algorithm.kl_ctrl.type=pi",
    ]
    slow = ["algorithm.kl_ctrl.kl_coef=0.01", "algorithm.kl_ctrl.min_coef=0.001", "algorithm.kl_ctrl.ki=0.05"]
    load_config(reward_pi + slow, notify=notes.append)
    (note,) = [m for m in notes if "climb back" in m]
    assert note.startswith("algorithm.kl_ctrl: with min_coef=0.001 and ki=0.05") and "≥ 46 steps" in note
    notes.clear()
    load_config(reward_pi, notify=notes.append)
    assert not any("climb back" in m for m in notes)
    notes.clear()
    loss_pi = [
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_ctrl.type=pi",
        "actor_rollout_ref.actor.kl_loss_coef=0.04",
        "actor_rollout_ref.actor.kl_loss_ctrl.min_coef=0.0001",
        "actor_rollout_ref.actor.kl_loss_ctrl.ki=0.05",
    ]
    load_config(loss_pi, notify=notes.append)
    assert any(m.startswith("actor_rollout_ref.actor.kl_loss_ctrl: with min_coef=0.0001") for m in notes)


def test_a_constant_kl_loss_target_under_pi_control_is_noted_with_the_ramp():
    """The KL-loss PI controller with a constant target: a note naming the ramp's keys (its first steps
    overshoot the target, a ramp does not); with target_kl_start set, the fixed
    controller, or no KL loss: none."""
    pi = [
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_ctrl.type=pi",
        "actor_rollout_ref.actor.kl_loss_coef=0.04",
        "actor_rollout_ref.actor.kl_loss_ctrl.min_coef=0.03",
    ]
    for over, noted in (
        (pi, True),
        (pi + ["actor_rollout_ref.actor.kl_loss_ctrl.target_kl_start=0.02"], False),
        (pi[:1], False),
        (pi[2:3], False),
    ):
        notes: list[str] = []
        load_config(over, notify=notes.append)
        ramp = [m for m in notes if "target_kl_start=0.02" in m]
        assert len(ramp) == int(noted), (over, notes)
        if noted:
            assert ramp[0].startswith("actor_rollout_ref.actor.kl_loss_ctrl: a constant target")


def test_rollout_tp_must_divide_the_ranks():
    cfg = load_config(
        [
            "actor_rollout_ref.rollout.tensor_model_parallel_size=3",
            "data.train_batch_size=24",
            "actor_rollout_ref.actor.ppo_mini_batch_size=24",
        ]
    )
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=3 does not divide the 8 ranks"):
        derive_sizes(cfg, 8)
    derive_sizes(cfg, 6)  # 3 divides 6


def test_rollout_tp_without_its_engine_is_noted_at_load():
    """LoRA or the hf backend: the rollout runs data-parallel on gathered weights; said when the config
    loads (so `klppo train --dry-run` shows it), not only once training starts."""
    tp2 = ["actor_rollout_ref.rollout.tensor_model_parallel_size=2"]
    for extra, why in (
        (["actor_rollout_ref.model.lora_rank=8"], "LoRA"),
        (["actor_rollout_ref.rollout.name=hf"], "rollout.name=hf"),
    ):
        notes: list[str] = []
        load_config(tp2 + extra, notify=notes.append)
        assert any("tensor_model_parallel_size=2 is not built with " + why in m for m in notes), notes
    notes = []
    load_config(tp2, notify=notes.append)
    assert not any("tensor_model_parallel_size" in m for m in notes)


@pytest.mark.parametrize(
    "copy,source,value",
    [
        ("actor_rollout_ref.actor.rollout_n", "actor_rollout_ref.rollout.n", 4),
        ("critic.rollout_n", "actor_rollout_ref.rollout.n", 4),
        ("actor_rollout_ref.ref.rollout_n", "actor_rollout_ref.rollout.n", 4),
        ("actor_rollout_ref.rollout.prompt_length", "data.max_prompt_length", 77),
        ("actor_rollout_ref.rollout.response_length", "data.max_response_length", 77),
    ],
)
def test_read_only_copies_must_agree_with_their_source(copy, source, value):
    """verl derives these keys from another; klppo reads the source only, so a copy set apart from it would
    be silently ignored: refused, naming both. Set together (as verl scripts sometimes spell both), fine."""
    with pytest.raises(ConfigError, match=rf"{copy}={value} differs from {source}="):
        load_config([f"{copy}={value}"])
    cfg = load_config([f"{copy}={value}", f"{source}={value}"])
    assert _value(cfg, copy) == _value(cfg, source) == value


def _value(cfg, key):
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def test_background_scoring_is_acted_on_and_said_to_do_nothing_beside_a_reward_model():
    """reward_model.launch_reward_fn_async is built (no 'no effect yet' warning); with a reward model, which
    scores on the device in the step, load says by name that the key does nothing there."""
    from klppo.config import warn_unimplemented

    notes: list[str] = []
    cfg = load_config(["reward_model.launch_reward_fn_async=True"], notify=notes.append)
    assert warn_unimplemented(cfg, notify=lambda _m: None) == []
    assert not [m for m in notes if "launch_reward_fn_async" in m]
    load_config(
        [
            "reward_model.launch_reward_fn_async=True",
            "reward_model.enable=True",
            "reward_model.model.path=/rm",
        ],
        notify=notes.append,
    )
    assert [
        m for m in notes if "launch_reward_fn_async=True has no effect with reward_model.enable=True" in m
    ]


@pytest.mark.parametrize(
    ("share", "tb", "logged"),
    [(1.0, 4, 4), (0.0, 4, 0), (0.5, 4, 2), (0.25, 4, 1), (0.625, 4, 3), (0.125, 4, 1), (0.3, 10, 3)],
)
def test_logged_share_splits_the_step_in_whole_groups(share, tb, logged):
    """round(share × train_batch_size) prompt groups from the logs (halves up), the rest generated."""
    cfg = _cfg(
        **{
            "data.logged_files": "logs.parquet",
            "data.logged_share": share,
            "data.train_batch_size": tb,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 1,
        }
    )
    assert derive_sizes(cfg, 1).logged_prompts_per_step == logged
    assert derive_sizes(_cfg(**{"data.logged_share": 0}), 1).logged_prompts_per_step == 0


LOGGED_SHARE_REFUSED = {  # name: (keys, what the one line says)
    "no logs": ({"data.logged_share": 0.5}, "data.logged_share=0.5 reads part of each step from data.logged"),
    "none logged": (
        {"data.logged_files": "l.parquet", "data.logged_share": 0.1},
        "data.logged_share=0.1 leaves the logs none of the data.train_batch_size=4 prompt groups",
    ),
    "none generated": (
        {"data.logged_files": "l.parquet", "data.logged_share": 0.9},
        "data.logged_share=0.9 leaves generation none of the data.train_batch_size=4 prompt groups",
    ),
    "out of range": ({"data.logged_files": "l.parquet", "data.logged_share": 1.5}, "data.logged_share=1.5"),
}


@pytest.mark.parametrize("case", sorted(LOGGED_SHARE_REFUSED))
def test_logged_share_refused_in_one_line(case):
    keys, expected = LOGGED_SHARE_REFUSED[case]
    args = {"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 1, **keys}
    with pytest.raises(ConfigError) as err:
        _cfg(**args)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_logged_share_divides_among_ranks():
    """Each rank takes an equal share of the logged groups (and so of the generated prompts)."""
    keys = {
        "data.logged_files": "l.parquet",
        "data.train_batch_size": 8,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
    }
    assert derive_sizes(_cfg(**keys, **{"data.logged_share": 0.5}), 2).logged_prompts_per_step == 4
    with pytest.raises(ConfigError, match="reads 3 of the 8 prompt groups of a step from the logs, not div"):
        derive_sizes(_cfg(**keys, **{"data.logged_share": 0.375}), 2)
