"""One full PPO step per advantage estimator and KL variant, on a tiny model, in one process."""

from __future__ import annotations

import math
from unittest import mock

import pytest

from tests.trainer.utils import base_overrides, read_metrics, run_training

REQUIRED = [
    "critic/score/mean",
    "critic/score/max",
    "critic/score/min",
    "critic/rewards/mean",
    "critic/advantages/mean",
    "critic/returns/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "actor/grad_norm",
    "actor/entropy",
    "actor/lr",
    "response_length/mean",
    "response_length/max",
    "response_length/clip_ratio",
    "prompt_length/mean",
    "timing_s/gen",
    "timing_s/old_log_prob",
    "timing_s/adv",
    "timing_s/update_weights",
    "rollout/time_s",
    "timing_s/update_actor",
    "timing_s/step",
    "perf/throughput",
    "perf/total_num_tokens",
]

CASES = {
    "gae_everything_offloaded": [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=True",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True",
        "critic.model.fsdp_config.param_offload=True",
        "critic.model.fsdp_config.optimizer_offload=True",
        "trainer.save_freq=1",
    ],
    "dapo_reward_manager": [
        "algorithm.adv_estimator=grpo",
        "reward_model.reward_manager=dapo",
        "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "+reward_model.reward_kwargs.overlong_buffer_cfg={enable: True, len: 4, penalty_factor: 1.0}",
        "+reward_model.reward_kwargs.max_resp_len=8",
    ],
    "gae_kl_in_reward": [
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.target_kl=0.01",
    ],
    "grpo_kl_loss_k3": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
    ],
    "rloo_kl_loss_full": [
        "algorithm.adv_estimator=rloo",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=full",
    ],
    "reinforce_pp_k2plus": [
        "algorithm.adv_estimator=reinforce_plus_plus",
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_penalty=mse",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_type=k1+",
    ],
    "remax_no_kl": ["algorithm.adv_estimator=remax"],
    "grpo_fused_kernels_kl_loss": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
    ],
    "gae_dynamic_bsz_klppo_engine": [
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.rollout.name=klppo",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=80",
        "critic.use_dynamic_bsz=True",
        "critic.ppo_max_token_len_per_gpu=80",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=True",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=80",
    ],
    "grpo_padded_seq_mean": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    ],
    "reinforce_pp_baseline": ["algorithm.adv_estimator=reinforce_plus_plus_baseline"],
    "opo": ["algorithm.adv_estimator=opo"],
    "grpo_passk": ["algorithm.adv_estimator=grpo_passk", "algorithm.norm_adv_by_std_in_grpo=False"],
    "gpg_estimator_gpg_loss": [
        "algorithm.adv_estimator=gpg",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gpg",
    ],
    "gspo_loss": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
        "actor_rollout_ref.actor.clip_ratio_low=0.0003",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004",
    ],
    "clip_cov_loss": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov",
        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.2",
        "actor_rollout_ref.actor.policy_loss.clip_cov_lb=0.0",
    ],
    "kl_cov_loss_kl_loss": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov",
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0.1",
        "actor_rollout_ref.actor.use_kl_loss=True",
    ],
    "geo_mean_loss_entropy": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.policy_loss.loss_mode=geo_mean",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
    ],
    "loss_scale_factor_sum_norm": [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
        "actor_rollout_ref.actor.loss_scale_factor=64",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
    ],
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_step(name, tiny_model_dir, arithmetic_data, tmp_path):
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path) + CASES[name]
    state, built = run_training(overrides)
    assert state.global_step == 1
    (row,) = read_metrics(tmp_path)
    assert row["step"] == 1
    for key in REQUIRED:
        assert key in row, key
        assert math.isfinite(row[key]), (key, row[key])
    assert 0.0 <= row["batch/equal_score_groups"] <= 1.0  # rollout.n=2: every prompt is a group
    if "gae" in name:
        for key in (
            "critic/vf_loss",
            "critic/values/mean",
            "critic/vf_explained_var",
            "timing_s/update_critic",
        ):
            assert key in row, key
        assert built.roles.critic is not None
    else:
        assert built.roles.critic is None
    needs_ref = any("kl" in o and "True" in o for o in CASES[name])
    assert (built.roles.reference is not None) == needs_ref
    if "use_kl_in_reward=True" in " ".join(CASES[name]):
        assert "actor/reward_kl_penalty" in row and "actor/reward_kl_penalty_coeff" in row
    if "use_kl_loss=True" in " ".join(CASES[name]):
        assert "actor/kl_loss" in row and row["actor/kl_coef"] > 0


def test_validation_metrics_and_generation_log(tiny_model_dir, arithmetic_data, tmp_path):
    import json

    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path) + [
        "algorithm.adv_estimator=grpo",
        "trainer.val_before_train=True",
        "trainer.test_freq=2",
        "trainer.total_training_steps=2",
        "trainer.log_val_generations=3",
        "actor_rollout_ref.rollout.val_kwargs.n=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=True",
        "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
        f"trainer.rollout_data_dir={tmp_path / 'rollouts'}",
        f"trainer.validation_data_dir={tmp_path / 'val_dumps'}",
    ]
    run_training(overrides)
    # verl's dumps: one JSONL per step, every sample (4 prompts × n=2 in training; 8 × 2 in validation)
    rollout_rows = [json.loads(x) for x in (tmp_path / "rollouts" / "2.jsonl").read_text().splitlines()]
    assert len(rollout_rows) == 8 and {"input", "output", "score", "reward", "step"} <= set(rollout_rows[0])
    val_rows = [json.loads(x) for x in (tmp_path / "val_dumps" / "0.jsonl").read_text().splitlines()]
    assert len(val_rows) == 16 and "What is" in val_rows[0]["input"]
    rows = read_metrics(tmp_path)
    val = [r for r in rows if "val-core/arithmetic/reward/mean@2" in r]
    assert [r["step"] for r in val] == [0, 2]  # before training, then after the last step
    assert all(0.0 <= r["val-core/arithmetic/reward/mean@2"] <= 1.0 for r in val)
    for r in val:  # best of 2 ≥ mean ≥ worst of 2
        best, worst = (
            r["val-core/arithmetic/reward/best@2/mean"],
            r["val-core/arithmetic/reward/worst@2/mean"],
        )
        assert best >= r["val-core/arithmetic/reward/mean@2"] >= worst
    logged = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    assert len(logged) >= 2 and all("response" in json.dumps(entry) for entry in logged)


def test_reward_model_scores_the_responses(tiny_model_dir, arithmetic_data, tmp_path):
    """reward_model.enable: a sequence-classification model (its own directory and tokenizer) gives the
    scores, on each response's last token; a different model gives different scores."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    rm_dir = tmp_path / "rm"
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    torch.manual_seed(1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm_dir)
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "algorithm.adv_estimator=grpo",
        "reward_model.enable=True",
        f"reward_model.model.path={rm_dir}",
    ]
    _, built = run_training(overrides)
    (row,) = read_metrics(tmp_path / "run")
    assert built.roles.reward.reward_model is not None
    # a random head gives real-valued, non-constant scores (the rule reward would be 0/1)
    assert row["critic/score/max"] > row["critic/score/min"]
    assert row["critic/score/max"] not in (0.0, 1.0)

    # micro-batched (right-padded) scoring equals scoring one sequence at a time
    from klppo.batch import Batch

    messages = [[{"role": "user", "content": "What is 1 plus 2?"}]] * 3
    b = Batch(prompts=torch.zeros(3, 1, dtype=torch.long), prompt_mask=torch.ones(3, 1), raw_prompt=messages)
    texts = ["The answer is 3", "3", "I think it is 12 plus 7 which is 19 #### 19"]
    reward = built.roles.reward
    assert (reward.micro_batch_size, reward.max_token_len) == (16, None)  # the keys' defaults
    reward.micro_batch_size = 1
    one_by_one = reward._model_scores(b, texts)
    reward.micro_batch_size = 16
    assert torch.allclose(reward._model_scores(b, texts), one_by_one, atol=1e-5)
    reward.max_token_len = 1  # use_dynamic_bsz: a budget below any one sample's length, one sample each
    assert reward._micro_batches([5, 6, 7]) == [(0, 1), (1, 2), (2, 3)]
    calls = []
    tokenize = type(reward.reward_tokenizer).__call__
    with mock.patch.object(
        type(reward.reward_tokenizer),
        "__call__",
        lambda self, *a, **k: calls.append(a) or tokenize(self, *a, **k),
    ):
        assert torch.allclose(reward._model_scores(b, texts), one_by_one, atol=1e-5)
    assert len(calls) == 1  # tokenized once, whatever the number of micro-batches (three here)


def test_reward_model_micro_batches_follow_the_keys(tiny_model_dir):
    """reward_model.micro_batch_size_per_gpu (samples) and, with use_dynamic_bsz,
    forward_max_token_len_per_gpu (consecutive samples padded to the longest, at least one)."""
    from transformers import AutoTokenizer

    from klppo.roles.reward import Reward, RewardModelPasses

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["a b c d e f", "a", "a b", "a b c d e f g h i j k l", "a b c"]
    lengths = [len(tok(t)["input_ids"]) for t in texts]
    assert Reward(tok, model=RewardModelPasses(micro_batch_size=2))._micro_batches(lengths) == [
        (0, 2),
        (2, 4),
        (4, 5),
    ]
    budget = 2 * max(lengths[:3])
    bounds = Reward(tok, model=RewardModelPasses(max_token_len=budget))._micro_batches(lengths)
    assert [i for b in bounds for i in range(*b)] == list(range(5))  # every sample once, in order
    for lo, hi in bounds:
        assert hi - lo == 1 or (hi - lo) * max(lengths[lo:hi]) <= budget
        if hi < len(texts):  # maximal: the next sample would not have fitted
            assert (hi - lo + 1) * max(lengths[lo : hi + 1]) > budget
    assert len(bounds) < 5  # some grouping happened


def test_reward_model_micro_batch_sizes(tiny_model_dir):
    """reward_model.micro_batch_size_per_gpu, or verl's deprecated global micro_batch_size over the ranks
    (checked with the other sizes, before weights load), or a token budget with use_dynamic_bsz."""
    import torch
    from transformers import AutoTokenizer

    from klppo.assembly.roles_build import build_reward
    from klppo.config import ConfigError, load_config
    from klppo.config.sizes import derive_sizes

    def micro(overrides, ranks=1):
        cfg = load_config(["reward_model.enable=True", *overrides])
        return derive_sizes(cfg, ranks).reward_micro_batch_size_per_gpu

    assert micro([]) == 16
    assert micro(["reward_model.micro_batch_size_per_gpu=3"], 4) == 3
    assert micro(["reward_model.micro_batch_size=8"], 4) == 2
    with pytest.raises(
        ConfigError, match=r"reward_model.micro_batch_size=6 samples over all GPUs is not divisible by 4"
    ):
        micro(["reward_model.micro_batch_size=6"], 4)
    with pytest.raises(
        ConfigError,
        match=r"reward_model.micro_batch_size=8 .*reward_model.micro_batch_size_per_gpu=3 are both set",
    ):
        micro(["reward_model.micro_batch_size=8", "reward_model.micro_batch_size_per_gpu=3"], 4)
    assert micro(["reward_model.use_dynamic_bsz=True"]) is None
    assert derive_sizes(load_config([]), 1).reward_micro_batch_size_per_gpu is None  # no reward model
    for key in ("micro_batch_size_per_gpu", "micro_batch_size", "forward_max_token_len_per_gpu"):
        with pytest.raises(ConfigError, match=rf"reward_model.{key}=0: must be ≥ 1"):
            load_config(
                ["reward_model.enable=True", "reward_model.use_dynamic_bsz=True", f"reward_model.{key}=0"]
            )
        load_config([f"reward_model.{key}=0"])  # no reward model: not read, not checked
    # the budget follows the critic's: a GRPO run's unread critic budget is not blamed on the reward model
    load_config(["critic.ppo_max_token_len_per_gpu=0", "algorithm.adv_estimator=grpo"])
    cfg = load_config(["reward_model.use_dynamic_bsz=True", "reward_model.forward_max_token_len_per_gpu=77"])
    reward = build_reward(
        cfg.reward_model,
        cfg.custom_reward_function,
        AutoTokenizer.from_pretrained(tiny_model_dir),
        torch.device("cpu"),
        micro_batch_size=3,
    )
    assert (reward.micro_batch_size, reward.max_token_len) == (3, 77)


def test_optimizer_choice_reference_path_and_external_lib(
    tiny_model_dir, arithmetic_data, tmp_path, monkeypatch
):
    import sys

    import torch

    from klppo.models.tiny import save_tiny_model_dir

    other_ref = save_tiny_model_dir(tmp_path / "other_ref", seed=7)  # different weights, same tokenizer
    lib = tmp_path / "libdir"
    lib.mkdir()
    (lib / "my_models_lib.py").write_text("IMPORTED = True\n")
    monkeypatch.syspath_prepend(str(lib))
    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.optim.optimizer=SGD",
        "actor_rollout_ref.actor.optim.override_optimizer_config={momentum: 0.9}",
        f"+actor_rollout_ref.ref.model={{path: {other_ref}}}",
        "actor_rollout_ref.model.external_lib=my_models_lib",
        "actor_rollout_ref.ref.use_torch_compile=False",  # the actor's stays true (default)
    ]
    _, built = run_training(overrides)
    from klppo.models.lm_head import stats_compiled

    assert stats_compiled(built.roles.actor.model) and not stats_compiled(built.roles.reference.model)
    (row,) = read_metrics(tmp_path / "run")
    opt = built.roles.actor.optimizer
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups[0]["momentum"] == 0.9
    assert abs(row["actor/ref_kl_k1"]) > 1e-3  # the reference is the other model, not the actor's start
    assert "my_models_lib" in sys.modules


def test_equal_score_groups_by_hand():
    """Groups by uid: {a: 1, 1} equal, {b: 0, 1} mixed, {c: 0, 0, 0} equal, {d: 0.5} a single sample (not a
    group) → 2 of 3 groups, their 5 samples' mean score 2/5; no equal group → no score; no groups at all
    (rollout.n = 1, or no uids) → None."""
    import torch

    from klppo.trainer.step_metrics import equal_score_groups

    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5])
    uids = ["a", "b", "a", "b", "c", "c", "c", "d"]
    share, score = equal_score_groups(scores, uids)
    assert share == 2 / 3 and score == pytest.approx(2 / 5)
    assert equal_score_groups(scores[:4], ["a", "b", "a", "b"]) == (0.5, 1.0)
    assert equal_score_groups(torch.tensor([0.0, 1.0]), ["b", "b"]) == (0.0, None)
    assert equal_score_groups(scores[:2], ["a", "b"]) is None
    assert equal_score_groups(scores, []) is None


def test_validation_metrics_by_hand():
    from klppo.trainer.step_metrics import validation_metrics

    records = [
        {"data_source": "a", "uid": 0, "score": 1.0},
        {"data_source": "a", "uid": 0, "score": 0.0},
        {"data_source": "a", "uid": 1, "score": 0.0},
        {"data_source": "a", "uid": 1, "score": 0.0},
        {"data_source": "b", "uid": 2, "score": 0.5},
        {"data_source": "b", "uid": 2, "score": 1.0},
    ]
    out = validation_metrics(records, 2)
    assert out["val-core/a/reward/mean@2"] == 0.25
    assert out["val-core/a/reward/best@2/mean"] == 0.5 and out["val-core/a/reward/worst@2/mean"] == 0.0
    assert out["val-core/b/reward/best@2/mean"] == 1.0 and out["val-core/b/reward/worst@2/mean"] == 0.5
    assert "val-core/a/reward/best@1/mean" not in validation_metrics(records, 1)


def test_attempt_metrics_of_a_retry_run_by_hand():
    """A multi-turn validation's figures: the first answer's score (the interaction's first turn score, or
    the reward where no turn was judged), and the reward of the samples whose first answer failed."""
    from klppo.trainer.step_metrics import validation_metrics

    records = [
        # right at once: the answer and the user's "correct"
        {"data_source": "a", "uid": 0, "score": 1.0, "turn_scores": [1.0], "num_turns": 2},
        {
            "data_source": "a",
            "uid": 1,
            "score": 1.0,
            "turn_scores": [0.0],
            "num_turns": 3,
        },  # right at the retry
        {"data_source": "a", "uid": 2, "score": 0.0, "turn_scores": [0.0], "num_turns": 3},  # wrong twice
        {"data_source": "a", "uid": 3, "score": 0.0, "turn_scores": [], "num_turns": 1},  # cut by the budget
        {"data_source": "b", "uid": 4, "score": 1.0},  # one-turn rows: no attempts' figures
    ]
    out = validation_metrics(records, 1)
    assert out["val-core/a/reward/mean@1"] == 0.5
    assert out["val-aux/a/first_turn_score/mean@1"] == 0.25
    assert out["val-aux/a/failed_first/share"] == 0.75
    assert out["val-aux/a/reward_after_failed_first/mean@1"] == pytest.approx(1 / 3)
    assert out["val-aux/a/num_turns/mean"] == 2.25
    assert not any(k.startswith("val-aux/b/") for k in out)


def test_dry_run_prints_the_plan_and_trains_nothing(tiny_model_dir, arithmetic_data, tmp_path, capsys):
    from klppo.commands.train import main

    overrides = base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run") + [
        "algorithm.adv_estimator=gae"
    ]
    assert main(["--dry-run", *overrides]) == 0
    out = capsys.readouterr().out
    assert "roles: actor, critic" in out and "actor_mini_batch_samples_per_rank: 4" in out
    assert "predicted peak GiB per GPU" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert main(["--dry-run", *overrides, "data.val_files=/nonexistent.parquet"]) == 2
    assert "not found: /nonexistent.parquet" in capsys.readouterr().err


def test_on_policy_step_skips_the_old_log_prob_pass(tiny_model_dir, arithmetic_data, tmp_path):
    """One mini-batch, one epoch: without the pass (default) the step updates the actor exactly as with it,
    and reports rollout/log_prob_diff and actor/ref_kl_k1 from the update's own log-probs."""
    import torch

    runs = {}
    for skip in (True, False):
        run_dir = tmp_path / f"skip_{skip}"
        overrides = base_overrides(tiny_model_dir, arithmetic_data, run_dir) + [
            "algorithm.adv_estimator=grpo",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # = train_batch_size: on-policy
            "actor_rollout_ref.actor.use_kl_loss=True",
            f"actor_rollout_ref.actor.skip_old_log_prob_on_policy={skip}",
        ]
        _, parts = run_training(overrides)
        (row,) = read_metrics(run_dir)
        runs[skip] = row, [p.detach().clone() for p in parts.roles.actor.model.parameters()]
    (skipped, w_skipped), (kept, w_kept) = runs[True], runs[False]
    assert "timing_s/old_log_prob" not in skipped and "timing_s/old_log_prob" in kept
    for key in (
        "actor/pg_loss",
        "actor/kl_loss",
        "actor/entropy",
        "rollout/log_prob_diff",
        "actor/ref_kl_k1",
    ):
        assert skipped[key] == pytest.approx(kept[key], rel=1e-4, abs=1e-6), key
    assert skipped["rollout/log_prob_diff"] > 0
    for a, b in zip(w_skipped, w_kept):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_old_log_probs_needed_before_the_update_keep_the_pass():
    from klppo.assembly.settings import skips_old_log_prob_pass
    from klppo.config import load_config

    kl_loss = ["actor_rollout_ref.actor.use_kl_loss=True"]
    assert skips_old_log_prob_pass(load_config(kl_loss))  # fixed β: nothing reads π_old before the update
    assert not skips_old_log_prob_pass(load_config(["algorithm.use_kl_in_reward=True"]))
    for ctrl in ("adaptive", "pi"):  # the controller reads this step's KL after the update
        assert skips_old_log_prob_pass(
            load_config([*kl_loss, f"actor_rollout_ref.actor.kl_loss_ctrl.type={ctrl}"])
        )
    off = ["actor_rollout_ref.actor.skip_old_log_prob_on_policy=False"]
    assert not skips_old_log_prob_pass(load_config(off))


def test_reward_model_keys_act_or_are_named(tiny_model_dir, tmp_path):
    """The reward model's own tokenizer (not the policy's), trust_remote_code and override_config reach
    its load; its sharding/offload keys, which klppo does not act on (loaded whole), get a notice."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from klppo.assembly import roles_build
    from klppo.config import load_config
    from klppo.models.tiny import build_tiny_tokenizer

    rm_dir = tmp_path / "rm"
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(rm_dir)
    rm_tok = build_tiny_tokenizer()
    rm_tok.save_pretrained(rm_dir)
    cfg = load_config(
        [
            "reward_model.enable=True",
            f"reward_model.model.path={rm_dir}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
            "+reward_model.model.override_config.num_hidden_layers=1",
        ]
    )
    reward = roles_build.build_reward(cfg.reward_model, cfg.custom_reward_function, None, torch.device("cpu"))
    assert reward.reward_tokenizer.name_or_path == str(rm_dir)  # its own, whatever input_tokenizer says
    assert reward.reward_model.config.num_hidden_layers == 1
    inert = [
        "reward_model.model.fsdp_config.param_offload=True",
        "reward_model.model.use_remove_padding=True",
        "reward_model.model.fsdp_config.wrap_policy.min_num_params=0",
    ]  # the last: verl's default
    notes: list[str] = []
    load_config(["reward_model.enable=True", *inert], notify=notes.append)
    assert [n.split(":")[0] for n in notes if n.startswith("reward_model.model.")] == [
        "reward_model.model.fsdp_config.param_offload=True",
        "reward_model.model.use_remove_padding=True",
    ]
    assert "the reward model is loaded whole on each rank" in notes[0]
    notes.clear()
    load_config(inert, notify=notes.append)  # no reward model: nothing to say about its keys
    assert not [n for n in notes if n.startswith("reward_model.model.")]


def test_critic_and_tokenizer_loads_get_trust_remote_code_and_override_config(tiny_model_dir, monkeypatch):
    from types import SimpleNamespace

    from klppo.assembly import roles_build
    from klppo.assembly.data_check import tokenizer_trusts_code
    from klppo.config import load_config

    seen = {}

    def fake_load_critic(path, **kwargs):
        seen.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(roles_build, "load_critic", fake_load_critic)
    cfg = load_config(
        [
            "algorithm.adv_estimator=gae",
            "critic.model.trust_remote_code=True",
            f"critic.model.path={tiny_model_dir}",
            "+critic.model.override_config.attention_dropout=0.1",
        ]
    )
    inputs = SimpleNamespace(cfg=cfg, device=None, model_path=str(tiny_model_dir))
    with pytest.raises(RuntimeError, match="stop here"):
        roles_build.build_critic(inputs)
    assert seen["trust_remote_code"] is True and seen["override_config"] == {"attention_dropout": 0.1}
    assert not tokenizer_trusts_code(load_config([]))
    assert tokenizer_trusts_code(load_config(["data.trust_remote_code=True"]))
    assert tokenizer_trusts_code(load_config(["actor_rollout_ref.model.trust_remote_code=True"]))


def test_a_reward_model_without_tokenizer_files_uses_input_tokenizers_pad(tiny_model_dir, tmp_path):
    """A reward-model directory with weights only: its input is encoded with input_tokenizer's tokenizer,
    and the model reads its score at that tokenizer's pad (so a row scores the same in any batch)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from klppo.assembly import roles_build
    from klppo.batch import Batch
    from klppo.config import load_config

    rm_dir = tmp_path / "rm_weights_only"
    config = AutoConfig.from_pretrained(tiny_model_dir, num_labels=1, pad_token_id=None)
    torch.manual_seed(3)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(rm_dir)
    cfg = load_config(
        [
            "reward_model.enable=True",
            f"reward_model.model.path={rm_dir}",
            f"actor_rollout_ref.model.path={tiny_model_dir}",
        ]
    )
    reward = roles_build.build_reward(cfg.reward_model, cfg.custom_reward_function, None, torch.device("cpu"))
    assert reward.reward_tokenizer.name_or_path == str(tiny_model_dir)
    assert reward.reward_model.config.pad_token_id == reward.reward_tokenizer.pad_token_id is not None
    messages = [[{"role": "user", "content": "What is 1 plus 2?"}]] * 2
    b = Batch(prompts=torch.zeros(2, 1, dtype=torch.long), prompt_mask=torch.ones(2, 1), raw_prompt=messages)
    texts = ["3", "I think it is 12 plus 7 which is 19"]
    together = reward._model_scores(b, texts)
    reward.micro_batch_size = 1
    torch.testing.assert_close(reward._model_scores(b, texts), together, atol=1e-5, rtol=0)
    cfg = load_config(
        [
            "reward_model.enable=True",
            f"reward_model.model.path={rm_dir}",
            "reward_model.model.input_tokenizer=null",
        ]
    )
    with pytest.raises(ValueError, match=r"reward_model.model.path=.*input_tokenizer is null"):
        roles_build.build_reward(cfg.reward_model, cfg.custom_reward_function, None, torch.device("cpu"))


def test_use_torch_compile_on_a_head_that_cannot_take_it_is_said(caplog):
    """``use_torch_compile=true`` on a model whose LM head is not a bias-free linear layer: a warning naming
    the key (the statistics stay eager); a bias-free head takes it silently; false says nothing."""
    import logging

    import torch

    from klppo.assembly.roles_build import _compile_stats
    from klppo.models.lm_head import fp32_lm_head, stats_compiled
    from klppo.models.tiny import build_tiny_model

    biased = torch.nn.Module()
    biased.get_output_embeddings = lambda: torch.nn.Linear(4, 4)
    good = build_tiny_model(arch="qwen2", seed=0)
    assert fp32_lm_head(good)
    key = "actor_rollout_ref.ref.use_torch_compile"
    with caplog.at_level(logging.WARNING, logger="klppo"):
        _compile_stats(good, True, key)
        _compile_stats(biased, False, key)
        assert stats_compiled(good) and not caplog.records
        _compile_stats(biased, True, key)
    assert [r.getMessage().split("=")[0] for r in caplog.records] == [key]
