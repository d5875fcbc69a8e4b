"""The start-of-training memory check: predicted peaks for the configured settings, and a warning
naming `klppo tune` when a phase does not fit."""

from __future__ import annotations

import logging

import pytest

from klppo.config import load_config
from klppo.tune.preflight import check_memory, predicted_peaks_gib
from klppo.tune.shapes import load_model_config


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_peaks_grow_with_the_micro_batch_and_warn_past_the_device():
    model = load_model_config("Qwen2.5-7B")
    small = load_config(
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "data.max_prompt_length=512",
            "data.max_response_length=512",
        ]
    )
    large = load_config(
        [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "data.max_prompt_length=512",
            "data.max_response_length=512",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16",
            "data.train_batch_size=16",
        ]
    )
    p_small = predicted_peaks_gib(small, model, world_size=8, device_gib=80)
    p_large = predicted_peaks_gib(large, model, world_size=8, device_gib=80)
    assert set(p_small) == {"rollout", "log_prob", "update"}
    assert p_large["update"] > p_small["update"] > 0
    logger, records = logging.getLogger("klppo"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        check_memory(large, model, world_size=1, device_gib=24)  # a 7B model does not fit one 24 GiB GPU
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    text = "\n".join(records.lines)
    assert "predicted peak memory per GPU" in text
    assert "klppo tune" in text and "may run out of memory" in text


def test_ulysses_splits_a_fixed_micro_batch_over_the_group():
    """16 sequences of 1,024 tokens per micro-batch with SP=2: each rank runs 8,192 tokens, as 8 sequences
    without SP, plus the all-to-all buffers T·c·(2h + 2kvd) (7B: h 3,584, 4 KV heads of 128)."""
    model = load_model_config("Qwen2.5-7B")
    common = ["data.max_prompt_length=512", "data.max_response_length=512", "data.train_batch_size=32",
              "actor_rollout_ref.actor.ppo_mini_batch_size=32"]  # fmt: skip
    sp2 = load_config(common + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
                                "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2"])  # fmt: skip
    half = load_config(common + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    p_sp2 = predicted_peaks_gib(sp2, model, world_size=8, device_gib=80)
    p_half = predicted_peaks_gib(half, model, world_size=8, device_gib=80)
    buffers = 8192 * 2 * (2 * 3584 + 2 * 512) / 2**30
    assert p_sp2["update"] == pytest.approx(p_half["update"] + buffers, rel=1e-9)
