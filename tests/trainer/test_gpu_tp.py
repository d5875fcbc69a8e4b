"""GPU smoke of the tensor-parallel rollout in the trainer (NCCL, bf16, the decode step captured as CUDA
graphs with its all-reduces inside): 2 steps at TP=2 on 2 GPUs. Skipped with fewer than 2 CUDA devices;
run on the device with `python -m pytest -m gpu tests/trainer/test_gpu_tp.py`."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.test_tp_rollout import _dump, sharp_model_dir  # noqa: F401 (fixture)
from tests.trainer.utils import base_overrides, read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


def _run(model_dir, data, run_dir, tp: int) -> dict[int, dict]:
    from klppo.commands.train import main

    argv = [
        o.replace("trainer.device=cpu", "trainer.device=cuda")
        for o in base_overrides(model_dir, data, run_dir)
    ]
    argv += [
        "actor_rollout_ref.rollout.name=klppo",
        "actor_rollout_ref.rollout.do_sample=False",
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=2",
        f"actor_rollout_ref.rollout.tensor_model_parallel_size={tp}",
        f"trainer.rollout_data_dir={run_dir / 'rollouts'}",
    ]
    assert main(argv) == 0
    return {r["step"]: r for r in read_metrics(run_dir) if "actor/pg_loss" in r}


def test_tp2_steps_on_two_gpus(sharp_model_dir, arithmetic_data, tmp_path):  # noqa: F811
    two = _run(sharp_model_dir, arithmetic_data, tmp_path / "tp2", 2)
    one = _run(sharp_model_dir, arithmetic_data, tmp_path / "tp1", 1)
    assert set(two) == set(one) == {1, 2}
    # greedy in bf16: partial sums in another order may part a few near-ties, not most responses
    first_two, first_one = (_dump(d / "rollouts" / "1.jsonl") for d in (tmp_path / "tp2", tmp_path / "tp1"))
    same = sum(a == b for a, b in zip(first_two, first_one))
    checks = {  # every check evaluated and named, so that one failure line says which and by how much
        f"step {step}: {name}": (value, ok)
        for step, row in two.items()
        for name, value, ok in (
            ("rollout/reshard_s > 0", row["rollout/reshard_s"], row["rollout/reshard_s"] > 0),
            ("rollout/cuda_graphs == 1", row["rollout/cuda_graphs"], row["rollout/cuda_graphs"] == 1.0),
            # the engine's sampled log-probs against the actor's recomputation: bf16 noise only
            (
                "rollout/log_prob_diff < 0.05",
                row["rollout/log_prob_diff"],
                row["rollout/log_prob_diff"] < 0.05,
            ),
            (
                "perf/rollout_peak_memory_gb > 0",
                row["perf/rollout_peak_memory_gb"],
                row["perf/rollout_peak_memory_gb"] > 0,
            ),
        )
    }
    checks["identical greedy rows >= 50%"] = (f"{same}/{len(first_one)}", same >= 0.5 * len(first_one))
    failed = {k: v for k, (v, ok) in checks.items() if not ok}
    assert not failed, f"failed: {failed}; all: { {k: v for k, (v, _) in checks.items()} }"
