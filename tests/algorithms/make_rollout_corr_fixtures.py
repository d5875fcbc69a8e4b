"""Write ``rollout_corr_verl091.json``: verl 0.9.1's rollout-correction functions run on fixed inputs, the
oracle ``test_rollout_correction.py`` holds ``klppo.algorithms.rollout_correction`` against.

verl is not a klppo dependency (its import pulls Ray); this script runs where verl 0.9.1 is importable, e.g.::

    pip download verl==0.9.1 --no-deps -d /tmp/verl091 && unzip -q /tmp/verl091/verl-0.9.1-*.whl -d
    /tmp/verl091/src pip install --no-deps --target /tmp/verl_deps tensordict ray msgpack jsonschema attrs
    referencing \\
        rpds-py jsonschema-specifications pyvers cloudpickle codetiming orjson
    PYTHONPATH=/tmp/verl091/src:/tmp/verl_deps python tests/algorithms/make_rollout_corr_fixtures.py

It calls ``compute_rollout_correction_and_rejection_mask`` (IS weights, rejection mask, every
``rollout_corr/*`` metric) and ``compute_policy_loss_reinforce`` (bypass mode's REINFORCE loss) in float64.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch

VERL_VERSION = "0.9.1"
OUT = Path(__file__).with_name("rollout_corr_verl091.json")

IS_CASES = [
    {"rollout_is": level, "rollout_is_threshold": threshold, "rollout_is_batch_normalize": norm}
    for level in ("token", "sequence")
    for threshold in (2.0, "0.5_2.0", "1.5")
    for norm in (False, True)
]
RS_CASES = [
    {"rollout_rs": "token_k1", "rollout_rs_threshold": "0.6_1.5"},
    {"rollout_rs": "token_k1", "rollout_rs_threshold": 1.5},
    {"rollout_rs": "token_k2", "rollout_rs_threshold": 0.1},
    {"rollout_rs": "token_k3", "rollout_rs_threshold": 0.1},
    {"rollout_rs": "seq_sum_k1", "rollout_rs_threshold": "0.5_2.0"},
    {"rollout_rs": "seq_sum_k2", "rollout_rs_threshold": 0.3},
    {"rollout_rs": "seq_sum_k3", "rollout_rs_threshold": 0.3},
    {"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.9_1.2"},
    {"rollout_rs": "seq_mean_k2", "rollout_rs_threshold": 0.05},
    {"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.05},
    {"rollout_rs": "seq_max_k2", "rollout_rs_threshold": 0.2},
    {"rollout_rs": "seq_max_k3", "rollout_rs_threshold": 0.2},
    {"rollout_rs": "token_k1,seq_mean_k3", "rollout_rs_threshold": "0.5_2.0,0.05"},
    {"rollout_rs": "seq_max_k2,token_k2,seq_max_k2", "rollout_rs_threshold": 0.2},
]
COMBINED = [
    {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_rs": "seq_mean_k3",
        "rollout_rs_threshold": 0.05,
    },
    {
        "rollout_is": "sequence",
        "rollout_is_threshold": 3.0,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": "0.5_2.0",
    },
]


def inputs() -> dict[str, torch.Tensor]:
    """6 rows × 7 tokens: lengths 7, 5, 3, 1, 0 (an empty row) and 6; log-ratios of spread 0.5 with one
    large outlier, so every bound binds somewhere."""
    gen = torch.Generator().manual_seed(52)
    lengths = [7, 5, 3, 1, 0, 6]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(7)] for n in lengths], dtype=torch.float64)
    rollout = -torch.rand(6, 7, generator=gen, dtype=torch.float64) * 3.0
    delta = torch.randn(6, 7, generator=gen, dtype=torch.float64) * 0.5
    delta[0, 2] = 3.0
    old = rollout + delta
    advantages = torch.randn(6, 7, generator=gen, dtype=torch.float64)
    return {"old_log_prob": old, "rollout_log_prob": rollout, "response_mask": mask, "advantages": advantages}


def main() -> None:
    from verl.trainer.ppo import core_algos  # noqa: PLC0415  only where verl is installed
    from verl.trainer.ppo.rollout_corr_helper import (  # noqa: PLC0415
        compute_rollout_correction_and_rejection_mask,
    )

    x = inputs()
    cases = []
    for setting in IS_CASES + RS_CASES + COMBINED + [{}]:
        proto, mask, metrics = compute_rollout_correction_and_rejection_mask(
            old_log_prob=x["old_log_prob"],
            rollout_log_prob=x["rollout_log_prob"],
            response_mask=x["response_mask"],
            **setting,
        )
        weights = None if proto is None else proto.batch["rollout_is_weights"].tolist()
        cases.append(
            {"setting": setting, "weights": weights, "response_mask": mask.tolist(), "metrics": metrics}
        )
    reinforce = []
    for agg in ("token-mean", "seq-mean-token-sum"):
        cfg = SimpleNamespace(global_batch_info={})
        weights = cases[0]["weights"]
        loss, stats = core_algos.compute_policy_loss_reinforce(
            rollout_log_prob=x["rollout_log_prob"],
            log_prob=x["old_log_prob"],
            advantages=x["advantages"],
            response_mask=x["response_mask"],
            loss_agg_mode=agg,
            config=cfg,
            rollout_is_weights=torch.tensor(weights, dtype=torch.float64),
        )
        reinforce.append({"loss_agg_mode": agg, "setting": cases[0]["setting"], "loss": float(loss), **stats})
    payload = {
        "verl_version": VERL_VERSION,
        "made_by": "tests/algorithms/make_rollout_corr_fixtures.py",
        "inputs": {k: v.tolist() for k, v in x.items()},
        "cases": cases,
        "reinforce": reinforce,
    }
    OUT.write_text(json.dumps(payload, indent=None, separators=(",", ":")) + "\n")
    print(f"wrote {OUT} ({len(cases)} cases, verl {VERL_VERSION})")


if __name__ == "__main__":
    main()
