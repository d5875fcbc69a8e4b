"""2 gloo processes forming one Ulysses group (``ulysses_sequence_parallel_size=2`` for the actor, the
reference and the critic, data-parallel size 1) give the step metrics of 1 process without sequence
parallelism. Token-budget micro-batches: a group's budget is its ranks' summed (80 per GPU × 2), so the
1-process run with a budget of 160 forms the same micro-batches. Settings and tolerances as in
test_distributed.py (greedy, one mini-batch per step), with a reward that varies between responses so
that advantages and gradients are not zero."""

from __future__ import annotations

import os

import pytest

from tests.trainer.test_distributed import COMPARED, ZERO_BY_CONSTRUCTION
from tests.trainer.test_distributed import _overrides as distributed_overrides
from tests.trainer.utils import read_metrics, run_training, train_two_ranks

SP = [
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size=2",
    "critic.ulysses_sequence_parallel_size=2",
]


REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (sum(map(ord, solution_str)) % 7) / 6.0
"""


def _overrides(model_dir, data, run_dir, budget: int):
    reward = run_dir.parent / "reward.py"
    reward.write_text(REWARD)
    return distributed_overrides(model_dir, data, run_dir) + [
        f"custom_reward_function.path={reward}",
        "actor_rollout_ref.model.use_remove_padding=True",
        "critic.model.use_remove_padding=True",
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={budget}",
        "critic.use_dynamic_bsz=True",
        f"critic.ppo_max_token_len_per_gpu={budget}",
        f"critic.forward_max_token_len_per_gpu={budget}",
        "trainer.total_training_steps=2",
    ]


def by_step(run_dir) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "actor/pg_loss" in r}


@pytest.mark.slow
@pytest.mark.xdist_group("rank_pool")
def test_sequence_parallel_matches_one_process(tiny_model_dir, arithmetic_data, tmp_path, rank_pool):
    two = tmp_path / "sp2"
    argv = _overrides(tiny_model_dir, arithmetic_data, two, 80) + SP + ["trainer.n_gpus_per_node=2"]
    assert train_two_ranks(rank_pool, argv) == 0
    one = tmp_path / "one"
    run_training(_overrides(tiny_model_dir, arithmetic_data, one, 160))

    rows_two, rows_one = by_step(two), by_step(one)
    assert set(rows_two) == set(rows_one) == {1, 2}
    assert rows_two[1]["perf/world_size"] == 2
    assert (
        rows_one[2]["actor/grad_norm"] > 0.1 and rows_one[1]["critic/grad_norm"] > 0.1
    )  # not a test of zeros
    for step in (1, 2):
        for key in COMPARED:
            expected = pytest.approx(rows_one[step][key], rel=1e-4, abs=ZERO_BY_CONSTRUCTION.get(key, 1e-6))
            assert rows_two[step][key] == expected, (step, key)


@pytest.mark.slow
@pytest.mark.skipif(
    (os.cpu_count() or 1) < 4 and not os.environ.get("KLPPO_TEST_4_RANKS"),
    reason="4 processes on fewer than 4 cores take minutes (KLPPO_TEST_4_RANKS=1 runs it)",
)
def test_sp2_dp2_matches_dp2(tiny_model_dir, arithmetic_data, tmp_path):
    """4 processes as 2 Ulysses groups of 2 (SP=2 × DP=2) = 2 processes data-parallel (DP=2): each group's
    token budget (80 per GPU × 2) is a DP=2 rank's 160, so both form the same micro-batches."""
    from klppo.commands.train import main

    four, two = tmp_path / "sp2dp2", tmp_path / "dp2"
    assert (
        main(_overrides(tiny_model_dir, arithmetic_data, four, 80) + SP + ["trainer.n_gpus_per_node=4"]) == 0
    )
    assert main(_overrides(tiny_model_dir, arithmetic_data, two, 160) + ["trainer.n_gpus_per_node=2"]) == 0

    rows_four, rows_two = by_step(four), by_step(two)
    assert set(rows_four) == set(rows_two) == {1, 2}
    assert rows_four[1]["perf/world_size"] == 4 and rows_two[1]["perf/world_size"] == 2
    assert rows_two[2]["actor/grad_norm"] > 0.1  # not a test of zeros
    for step in (1, 2):
        for key in COMPARED:
            expected = pytest.approx(rows_two[step][key], rel=1e-4, abs=ZERO_BY_CONSTRUCTION.get(key, 1e-6))
            assert rows_four[step][key] == expected, (step, key)
