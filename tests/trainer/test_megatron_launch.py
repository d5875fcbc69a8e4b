"""A Megatron-style launch (verl's `ppo_megatron_trainer` with tensor, pipeline and context parallel sizes and
offload set) trains on 2 gloo processes exactly as the FSDP launch written by hand with the counterparts the
translation names (Ulysses of the context-parallel size, the offload keys, the rollout's own tensor
parallelism): the same step metrics in fp32 (CPU), and one notice listing each translated key. Settings as in
test_ulysses.py (greedy, one mini-batch per step, token-budget micro-batches, a reward that varies)."""

from __future__ import annotations

import pytest

from tests.trainer.test_distributed import COMPARED
from tests.trainer.test_ulysses import _overrides, by_step
from tests.trainer.utils import train_two_ranks

A = "actor_rollout_ref.actor"
MEGATRON = {  # key → the counterpart the notice names
    f"{A}.megatron.tensor_model_parallel_size=2": "nothing",
    f"{A}.megatron.pipeline_model_parallel_size=2": "nothing",
    f"{A}.megatron.context_parallel_size=2": f"{A}.ulysses_sequence_parallel_size=2",
    f"{A}.megatron.param_offload=True": f"{A}.fsdp_config.param_offload=True",
    f"{A}.megatron.optimizer_offload=True": f"{A}.fsdp_config.optimizer_offload=True",
    "critic.megatron.tensor_model_parallel_size=2": "nothing",
    "critic.megatron.context_parallel_size=2": "critic.ulysses_sequence_parallel_size=2",
    "critic.megatron.param_offload=True": "critic.model.fsdp_config.param_offload=True",
}
FSDP = [
    f"{A}.ulysses_sequence_parallel_size=2",
    f"{A}.fsdp_config.param_offload=True",
    f"{A}.fsdp_config.optimizer_offload=True",
    "critic.ulysses_sequence_parallel_size=2",
    "critic.model.fsdp_config.param_offload=True",
]
BOTH = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]


@pytest.mark.slow
@pytest.mark.xdist_group("rank_pool")
def test_megatron_launch_trains_as_the_hand_written_fsdp_launch(
    tiny_model_dir, arithmetic_data, tmp_path, rank_pool
):
    from klppo.config import load_config

    megatron, fsdp = tmp_path / "megatron", tmp_path / "fsdp"
    mg_argv = [
        "--config-name=ppo_megatron_trainer",
        *_overrides(tiny_model_dir, arithmetic_data, megatron, 80),
        *MEGATRON,
        *BOTH,
    ]
    notes: list[str] = []
    cfg = load_config(mg_argv, notify=notes.append)
    assert cfg.actor_rollout_ref.actor.strategy == "megatron"
    [notice] = [n for n in notes if n.startswith("Megatron launch read on FSDP2")]
    lines = [line.strip() for line in notice.splitlines()[1:]]
    for key, counterpart in MEGATRON.items():
        assert any(line.startswith(f"{key} → {counterpart}") for line in lines), key

    fsdp_argv = [*_overrides(tiny_model_dir, arithmetic_data, fsdp, 80), *FSDP, *BOTH]
    assert train_two_ranks(rank_pool, mg_argv) == 0
    assert train_two_ranks(rank_pool, fsdp_argv) == 0
    rows_mg, rows_fsdp = by_step(megatron), by_step(fsdp)
    assert set(rows_mg) == set(rows_fsdp) == {1, 2}
    assert rows_fsdp[2]["actor/grad_norm"] > 0.1 and rows_fsdp[1]["critic/grad_norm"] > 0.1  # not zeros
    for step in (1, 2):
        for key in COMPARED:
            assert rows_mg[step][key] == pytest.approx(rows_fsdp[step][key], rel=1e-5, abs=1e-7), (step, key)
