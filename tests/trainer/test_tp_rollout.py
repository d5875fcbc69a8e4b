"""2 gloo processes forming one rollout tensor-parallel group (``rollout.tensor_model_parallel_size=2``:
each rank generates on its slices resharded from the FSDP2 shards, the group shares its prompts) give the
step metrics and the greedy validation of 1 process generating on gathered weights. Settings and
tolerances as in test_distributed.py (greedy, one mini-batch per step), with a reward that varies between
responses so that advantages and gradients are not zero."""

from __future__ import annotations

import pytest

from tests.trainer.test_distributed import COMPARED, ZERO_BY_CONSTRUCTION
from tests.trainer.test_distributed import _overrides as distributed_overrides
from tests.trainer.test_ulysses import REWARD
from tests.trainer.utils import read_metrics, run_training, train_two_ranks


@pytest.fixture(scope="module")
def sharp_model_dir(tmp_path_factory):
    """The tiny model with its matrices ×8 and its LM head untied: greedy responses then differ by prompt (at
    the initial scale they repeat the prompt's last token, the same for every chat-templated prompt)."""
    import torch
    from transformers import AutoModelForCausalLM

    from klppo.models.tiny import save_tiny_model_dir

    path = save_tiny_model_dir(
        tmp_path_factory.mktemp("sharp_model"), num_layers=2, hidden_size=64, tie_word_embeddings=False
    )
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    model.save_pretrained(path)
    return path


def _overrides(model_dir, data, run_dir):
    reward = run_dir.parent / "reward.py"
    reward.write_text(REWARD)
    return distributed_overrides(model_dir, data, run_dir) + [
        f"custom_reward_function.path={reward}",
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
    ]


@pytest.mark.slow
@pytest.mark.xdist_group("rank_pool")
def test_tensor_parallel_rollout_matches_one_process(sharp_model_dir, arithmetic_data, tmp_path, rank_pool):
    two = tmp_path / "tp2"
    argv = _overrides(sharp_model_dir, arithmetic_data, two) + [
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    ]
    assert train_two_ranks(rank_pool, argv) == 0
    one = tmp_path / "one"
    run_training(_overrides(sharp_model_dir, arithmetic_data, one))

    def by_step(run_dir, val: bool):
        rows = read_metrics(run_dir)
        return {r["step"]: r for r in rows if any(k.startswith("val-core") for k in r) == val}

    train_two, train_one = by_step(two, False), by_step(one, False)
    assert set(train_two) == set(train_one) == {1, 2}
    assert train_two[1]["perf/world_size"] == 2
    assert train_two[1]["rollout/reshard_s"] > 0 and "rollout/reshard_s" not in train_one[1]
    assert train_one[2]["actor/grad_norm"] > 0.1 and train_one[1]["critic/grad_norm"] > 0.1  # not zeros
    for step in (1, 2):
        for key in COMPARED:
            expected = pytest.approx(train_one[step][key], rel=1e-4, abs=ZERO_BY_CONSTRUCTION.get(key, 1e-6))
            assert train_two[step][key] == expected, (step, key)
    # the same response for every prompt (rank 0 dumps the global batch), and responses differ by prompt
    for step in (1, 2):
        rows_two, rows_one = (_dump(run / "rollouts" / f"{step}.jsonl") for run in (two, one))
        assert rows_two == rows_one
        assert len({out for _inp, out in rows_one}) > 1
    val_two, val_one = by_step(two, True), by_step(one, True)
    assert val_two.keys() == val_one.keys() == {0, 2}
    for step in (0, 2):
        core = {k: v for k, v in val_one[step].items() if k.startswith("val-core")}
        assert core and {k: val_two[step][k] for k in core} == pytest.approx(core, rel=1e-6)


def _dump(path) -> list[tuple[str, str]]:
    import json

    return [(r["input"], r["output"]) for r in map(json.loads, path.read_text().splitlines())]
