"""2 gloo processes (started by `klppo train`, through torchrun) give the same step metrics as 1
process, their checkpoint resumes in 1 process, and greedy rollout does not depend on the rank count. The
2-process run scores in the background (``reward_model.launch_reward_fn_async``: a spawned scorer per rank).

One mini-batch per step and greedy rollouts: then every quantity is independent of how samples are laid
out over ranks, and the remaining differences are float summation order (tolerance 1e-4 relative).
"""

from __future__ import annotations

import pytest

from tests.trainer.utils import base_overrides, read_metrics, run_training

# whitened GAE advantages have mean 0 and so has the on-policy PPO loss: these are pure float noise
# (|x| ≲ 1e-5), compared with an absolute tolerance only
ZERO_BY_CONSTRUCTION = {"actor/pg_loss": 1e-4, "critic/advantages/mean": 1e-4}
COMPARED = [
    "critic/score/mean",
    "actor/pg_loss",
    "actor/ppo_kl",
    "actor/pg_clipfrac",
    "critic/vf_loss",
    "actor/kl_loss",
    "actor/reward_kl_penalty",
    "actor/grad_norm",
    "critic/grad_norm",
    "critic/advantages/mean",
    "critic/values/mean",
    "response_length/mean",
]


# the built-in GSM8K scorer, and the name of the process that ran it (a background scorer is a SpawnProcess)
LOGGED_GSM8K = """
import multiprocessing
from klppo.rewards.gsm8k import compute_score as gsm8k
def compute_score(data_source, solution_str, ground_truth, extra_info=None, log=None, **kwargs):
    with open(log, "a") as f:
        f.write(f"{multiprocessing.current_process().name} {extra_info['split']}\\n")
    return gsm8k(solution_str, ground_truth, **kwargs)
"""


def _overrides(model_dir, data, run_dir):
    fn = run_dir.parent / "logged_gsm8k.py"
    fn.write_text(LOGGED_GSM8K)
    return base_overrides(model_dir, data, run_dir) + [
        f"custom_reward_function.path={fn}",
        f"reward_model.reward_kwargs={{method: flexible, log: {run_dir}.log}}",
        "algorithm.adv_estimator=gae",
        "algorithm.use_kl_in_reward=True",
        "algorithm.kl_ctrl.type=adaptive",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.rollout.do_sample=False",
        "actor_rollout_ref.rollout.n=1",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "critic.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2",
        "critic.ppo_micro_batch_size_per_gpu=1",
        "critic.forward_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.val_kwargs.do_sample=False",
        "trainer.val_before_train=True",
        "actor_rollout_ref.rollout.name=klppo",  # the default engine, on FSDP2-gathered weights
    ]


@pytest.mark.slow
def test_two_processes_match_one(tiny_model_dir, arithmetic_data, tmp_path):
    from klppo.commands.train import main

    two = tmp_path / "two"
    argv = _overrides(tiny_model_dir, arithmetic_data, two) + [
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
        "trainer.save_freq=2",
        "trainer.test_freq=2",
        # each rank scores its samples in its own background process; the 1-process run scores in the step
        "reward_model.launch_reward_fn_async=True",
    ]
    assert main(argv) == 0
    rows_two = read_metrics(two)
    where = [line.split() for line in (tmp_path / "two.log").read_text().splitlines()]
    train_where = {name for name, split in where if split == "train"}
    assert train_where and all(n.startswith("SpawnProcess") for n in train_where)  # scored in the background
    assert {name for name, split in where if split != "train"} == {"MainProcess"}  # validation: in the step
    assert all(r["perf/world_size"] == 2 for r in rows_two if "perf/world_size" in r)
    assert any("perf/world_size" in r for r in rows_two)

    one = tmp_path / "one"
    run_training(
        _overrides(tiny_model_dir, arithmetic_data, one)
        + [
            "trainer.total_training_steps=3",
            "trainer.test_freq=2",
        ]
    )
    rows_one = read_metrics(one)

    def by_step(rows, val):
        return {r["step"]: r for r in rows if any(k.startswith("val-core") for k in r) == val}

    train_two, train_one = by_step(rows_two, False), by_step(rows_one, False)
    for step in (1, 2):
        for key in COMPARED:
            expected = pytest.approx(train_one[step][key], rel=1e-4, abs=ZERO_BY_CONSTRUCTION.get(key, 1e-6))
            assert train_two[step][key] == expected, (step, key)
    # greedy validation (before training and after step 2) is identical with 1 and 2 ranks
    val_two, val_one = by_step(rows_two, True), by_step(rows_one, True)
    assert val_two.keys() == {0, 2} and set(val_one) >= {0, 2}
    for step in (0, 2):
        assert val_two[step] == pytest.approx(val_one[step], rel=1e-6)

    # the 2-rank checkpoint resumes in 1 process and continues exactly like the 1-process run
    run_training(
        _overrides(tiny_model_dir, arithmetic_data, two)
        + [
            "trainer.total_training_steps=3",
            "trainer.test_freq=-1",
            "trainer.val_before_train=False",
        ]
    )
    step3 = by_step(read_metrics(two), False)[3]
    mismatched = {
        key: (step3[key], train_one[3][key])
        for key in COMPARED
        if step3[key] != pytest.approx(train_one[3][key], rel=1e-4, abs=ZERO_BY_CONSTRUCTION.get(key, 1e-6))
    }
    assert not mismatched
