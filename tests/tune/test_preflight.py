"""The start-of-training memory check: predicted peaks for the configured settings, and a warning
naming `klppo tune` when a phase does not fit."""

from __future__ import annotations

import logging

import pytest

from klppo.assembly.settings import fsdp_settings, tune_workload
from klppo.config import KLPPOConfig, load_config
from klppo.tune.memory import TuneWorkload
from klppo.tune.preflight import check_memory, predicted_peaks_gib
from klppo.tune.shapes import load_model_config


def workload(cfg: KLPPOConfig, *, world_size: int, device_gib: float) -> TuneWorkload:
    """What `klppo train` gives the pre-flight: the actor's FSDP settings the trainer shards with."""
    fsdp = fsdp_settings(cfg.actor_rollout_ref.actor.fsdp_config, device_type="cuda", world_size=world_size)
    return tune_workload(cfg, fsdp, world_size=world_size, device_gib=device_gib)


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
    p_small = predicted_peaks_gib(workload(small, world_size=8, device_gib=80), model)
    p_large = predicted_peaks_gib(workload(large, world_size=8, device_gib=80), model)
    # verl's default estimator is GAE: the critic's two phases too (on the actor's backbone)
    assert set(p_small) == {"rollout", "log_prob", "update", "values", "update_critic"}
    assert p_large["update"] > p_small["update"] > 0
    logger, records = logging.getLogger("klppo"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        check_memory(
            workload(large, world_size=1, device_gib=24), model
        )  # a 7B model does not fit one 24 GiB GPU
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    text = "\n".join(records.lines)
    assert "predicted peak memory per GPU" in text
    assert "klppo tune" in text and "may run out of memory" in text


def test_the_preflight_sees_the_settings_the_trainer_shards_with():
    """min_num_params, offload and prefetch reach the memory model through the trainer's FSDPSettings."""
    cfg = load_config(
        [
            "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params=123456",
            "actor_rollout_ref.actor.fsdp_config.param_offload=True",
            "actor_rollout_ref.actor.fsdp_config.forward_prefetch=True",
            "actor_rollout_ref.actor.use_dynamic_bsz=True",
            "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
        ]
    )
    fsdp = fsdp_settings(cfg.actor_rollout_ref.actor.fsdp_config, device_type="cuda", world_size=4)
    w = tune_workload(cfg, fsdp, world_size=4, device_gib=80)
    assert fsdp.min_num_params == w.point.min_num_params == 123456
    assert (w.point.offload, w.point.forward_prefetch, w.update_point.micro_tokens) == ("idle", True, 4096)
    fixed = load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    w = workload(fixed, world_size=1, device_gib=80)
    assert w.update_micro_tokens == 2 * w.seq_len and w.point.micro_tokens != w.update_micro_tokens


def test_ulysses_splits_a_fixed_micro_batch_over_the_group():
    """16 sequences of 1,024 tokens per micro-batch with SP=2: each rank runs 8,192 tokens, as 8 sequences
    without SP, plus the all-to-all buffers T·c·(2h + 2kvd) (7B: h 3,584, 4 KV heads of 128)."""
    model = load_model_config("Qwen2.5-7B")
    common = [
        "data.max_prompt_length=512",
        "data.max_response_length=512",
        "data.train_batch_size=32",
        "actor_rollout_ref.actor.ppo_mini_batch_size=32",
    ]
    sp2 = load_config(
        common
        + [
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
            "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        ]
    )
    half = load_config(common + ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    p_sp2 = predicted_peaks_gib(workload(sp2, world_size=8, device_gib=80), model)
    p_half = predicted_peaks_gib(workload(half, world_size=8, device_gib=80), model)
    buffers = 8192 * 2 * (2 * 3584 + 2 * 512) / 2**30
    assert p_sp2["update"] == pytest.approx(p_half["update"] + buffers, rel=1e-9)


def _advice_lines(tw: TuneWorkload, model, mini_batch_tokens: int) -> list[str]:
    logger, records = logging.getLogger("klppo"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        check_memory(tw, model, mini_batch_tokens=mini_batch_tokens)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    return [line for line in records.lines if line.startswith("advice:")]


def test_a_larger_token_budget_is_advised_when_it_fits_and_only_then():
    """The grpo135m bench's case (SmolLM2-135M, 256 samples of 64 + 96 tokens, 16,384-token micro-batches,
    one H200): the mini-batch is 40,960 tokens in up to 3 micro-batches and the whole of it in one is
    predicted to fit well inside the device — advised, both keys named, the update/log-prob prediction
    under 60% of the device. Not advised: fixed micro-batches, a budget already holding the mini-batch, or no
    room (a 7B model on a 24 GiB device)."""
    from klppo.tune.preflight import ADVICE_SHARE, micro_batch_advice

    small = load_model_config("SmolLM2-135M")
    dynamic = [
        "actor_rollout_ref.actor.use_dynamic_bsz=True",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384",
        "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=16384",
        "data.max_prompt_length=64",
        "data.max_response_length=96",
    ]
    tw = workload(load_config(dynamic), world_size=1, device_gib=141)
    [line] = _advice_lines(tw, small, 256 * 160)
    assert "ppo_max_token_len_per_gpu=40960" in line and "log_prob_max_token_len_per_gpu=40960" in line
    assert "up to 3 micro-batches" in line and "(1 micro-batch(es))" in line
    predicted = float(line.split("predicted to need ")[1].split(" GiB")[0])
    assert 0 < predicted < ADVICE_SHARE * 141
    # the prediction it quotes is the memory model's at that budget (both phases' budgets raised)
    larger = workload(
        load_config(
            dynamic[:1]
            + [
                "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=40960",
                "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=40960",
            ]
            + dynamic[3:]
        ),
        world_size=1,
        device_gib=141,
    )
    peaks = predicted_peaks_gib(larger, small)
    assert abs(max(peaks["update"], peaks["log_prob"]) - predicted) < 0.06
    assert _advice_lines(tw, small, 16384) == []  # one micro-batch already
    fixed = workload(
        load_config(["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4"]), world_size=1, device_gib=141
    )
    assert micro_batch_advice(fixed, small, 10**6) is None
    big = workload(
        load_config(dynamic[:3] + ["data.max_prompt_length=512", "data.max_response_length=512"]),
        world_size=1,
        device_gib=24,
    )
    assert micro_batch_advice(big, load_model_config("Qwen2.5-7B"), 10**6) is None


def test_keeping_the_rollout_workspace_is_advised_when_it_fits_and_only_then():
    """The learning runs' case (SmolLM2-135M, 2,048 sequences of 128 + 100 tokens, one H200): the kept KV
    cache (positions rounded up to 256), the decode buffers (32 bytes per vocabulary entry and slot) and a
    bf16 copy of the weights, beside the training passes, fit — advised with their size. Not advised when
    the training passes fit but the kept workspace tips the total over 60% of the device; the head size
    is the config's own (``head_dim``), not hidden ÷ heads."""
    from klppo.tune.preflight import ADVICE_SHARE, workspace_advice
    from klppo.tune.units import ModelFacts

    small = load_model_config("SmolLM2-135M")
    over = ["data.max_prompt_length=128", "data.max_response_length=100"]
    tw = workload(load_config(over), world_size=1, device_gib=141)
    line = workspace_advice(tw, small, 2048)
    assert line is not None and "free_cache_engine=False" in line
    weights = ModelFacts.from_config(small).num_params * 2

    def kept_gib(head: int, seqs: int = 2048) -> float:
        return (seqs * 256 * 30 * 2 * 3 * head * 2 + seqs * 49152 * 32 + weights) / 2**30

    assert f"for {kept_gib(64):.1f} GiB held" in line and "2048 sequences × 256 positions" in line
    peaks = predicted_peaks_gib(tw, small)  # verl's default estimator, GAE: the critic's phases too
    training = max(gib for name, gib in peaks.items() if name != "rollout")
    assert f"predicted at {training + kept_gib(64):.1f} GiB of 141" in line
    logger, records = logging.getLogger("klppo"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        check_memory(tw, small, rollout_seqs=2048)
        check_memory(tw, small)  # a rollout that cannot keep its workspace (or keeps it already): nothing
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert [r for r in records.lines if r.startswith("advice:")] == [f"advice: {line}"]
    # the training passes alone fit; the kept workspace is what tips the total over the share
    room = ADVICE_SHARE * 141 - training
    seqs = int(2048 * room / kept_gib(64)) + 512
    assert training < ADVICE_SHARE * 141 < training + kept_gib(64, seqs)
    assert workspace_advice(tw, small, seqs) is None
    # an explicit head_dim (as Qwen3 configs set it) sizes the cache, not hidden // heads = 64
    wide = load_model_config("SmolLM2-135M")
    wide.head_dim = 128
    line = workspace_advice(workload(load_config(over), world_size=1, device_gib=141), wide, 2048)
    weights = ModelFacts.from_config(wide).num_params * 2
    assert line is not None and f"for {kept_gib(128):.1f} GiB held" in line


def test_the_workspace_advice_only_where_a_workspace_could_be_kept():
    """``setup.could_keep_workspace``: the klppo engine on CUDA graphs, freeing after each step, no tensor
    parallelism, an architecture the engine runs, and one rollout shape per step (not ReMax's greedy call)."""
    from klppo.assembly.setup import could_keep_workspace

    small = load_model_config("SmolLM2-135M")
    R = "actor_rollout_ref.rollout"
    assert could_keep_workspace(load_config([]), small)
    for over in (
        [f"{R}.free_cache_engine=False"],
        [f"{R}.enforce_eager=True"],
        [f"{R}.name=hf"],
        [f"{R}.tensor_model_parallel_size=2"],
        ["algorithm.adv_estimator=remax"],
    ):
        assert not could_keep_workspace(load_config(over), small), over
    other = load_model_config("SmolLM2-135M")
    other.model_type = "gpt2"
    assert not could_keep_workspace(load_config([]), other)


def test_the_gpu_preflight_runs_end_to_end_and_logs_its_advice(monkeypatch, tmp_path):
    """``setup._before_weights`` — what `klppo train` runs on a GPU before loading weights — from a model
    directory's config.json, with the device's size faked on the CPU: the predicted peaks, then the advice
    lines (the larger token budget, keeping the workspace, the compiled layers) for the learning runs'
    settings (SmolLM2-135M, 256 prompts × 8, 16,384-token micro-batches, verl's free_cache_engine=True)."""
    import types

    import torch

    from klppo.assembly import setup
    from klppo.config import derive_sizes

    load_model_config("SmolLM2-135M").save_pretrained(tmp_path)
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d: types.SimpleNamespace(total_memory=141 * 2**30)
    )
    A = "actor_rollout_ref.actor"
    cfg = load_config(
        [
            "data.max_prompt_length=128",
            "data.max_response_length=128",
            "data.train_batch_size=256",
            f"{A}.ppo_mini_batch_size=256",
            "actor_rollout_ref.rollout.n=8",
            f"{A}.use_dynamic_bsz=True",
            f"{A}.ppo_max_token_len_per_gpu=16384",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        ]
    )
    fsdp = fsdp_settings(cfg.actor_rollout_ref.actor.fsdp_config, device_type="cuda", world_size=1)
    logger, records = logging.getLogger("klppo"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        setup._before_weights(cfg, fsdp, str(tmp_path), torch.device("cuda"), None, derive_sizes(cfg, 1))
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert any(line.startswith("predicted peak memory per GPU") for line in records.lines)
    advice = [line for line in records.lines if line.startswith("advice:")]
    assert len(advice) == 4, advice
    assert "ppo_max_token_len_per_gpu=" in advice[0] and "2048 sequences × 256 positions" in advice[1]
    assert advice[2].startswith("advice: actor_rollout_ref.model.compile_packed_layers=True")
    assert advice[3].startswith("advice: reward_model.launch_reward_fn_async=True")  # verl's default: off


def test_a_rollout_over_the_device_is_told_to_lower_its_cache_share():
    """The rollout's predicted peak is mostly its KV-cache share of the device (gpu_memory_utilization × D):
    the advice names that key and its value, not the update's settings `klppo tune` varies."""
    model = load_model_config("Qwen2.5-0.5B")
    cfg = load_config(["actor_rollout_ref.rollout.gpu_memory_utilization=0.97"])
    logger, records = logging.getLogger("klppo"), _Records()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        check_memory(workload(cfg, world_size=1, device_gib=141), model)
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    (line,) = [t for t in records.lines if "may run out of memory" in t]
    assert line.startswith("the rollout phase")
    assert (
        "Lower actor_rollout_ref.rollout.gpu_memory_utilization (now 0.97)" in line
        and "min_num_params" not in line
    )


def test_a_rollout_over_the_device_by_its_weights_is_not_told_to_lower_its_cache_share():
    from types import SimpleNamespace

    from klppo.tune.preflight import _over_budget_advice

    w = SimpleNamespace(workload=SimpleNamespace(gpu_memory_utilization=0.2, device_bytes=80 * 2**30))
    weights = _over_budget_advice("rollout", 169.3, w)  # resident + gathered weights: util × D is 16 GiB
    assert "tensor_model_parallel_size" in weights and "gpu_memory_utilization" not in weights
    assert "gpu_memory_utilization (now 0.2)" in _over_budget_advice("rollout", 16.0, w)
    assert "klppo tune" in _over_budget_advice("update", 90.0, w)
