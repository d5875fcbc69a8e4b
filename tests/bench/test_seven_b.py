"""bench/seven_b.py on CPU: the --tiny workload through the trainer with the recipe's settings (the optimizer
step on the CPU, the reference offloaded), 2 steps, a checkpoint written at the last one (``--save``) and one
more step resumed from it, ending in one JSON line with phases, memory and the checkpoint's predicted and
written sizes; and the per-phase peaks it reads on CUDA, with the allocator's counters played by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_seven_b_tiny_runs_two_steps_saves_and_resumes(tmp_path):
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "bench/seven_b.py", "--device", "cpu", "--tiny", "--steps", "2", "--out", str(out)]
    cmd += ["--save", str(tmp_path / "save")]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=180, capture_output=True)
    result = json.loads(out.read_text())
    assert result["workload"] == "grpo_k3" and result["steps"] == 2
    assert result["tokens_per_s"] > 0 and result["timing_s/update_actor"] > 0
    assert result["predicted_gib/host"] > 0 and result["measured_gib/host_rss"] > 0
    assert result["checkpoint"].endswith("global_step_2") and result["timing_s/save_checkpoint"] > 0
    assert result["predicted_gib/checkpoint"] == pytest.approx(result["checkpoint_gib/written"], rel=0.05)
    assert result["resume/step"] == 3 and result["resume/load_s"] > 0 and result["resume/step_s"] > 0


def test_phase_peaks_nest_and_map_to_the_memory_model(monkeypatch):
    sys.path.insert(0, str(ROOT))
    from bench import seven_b
    from klppo.trainer import ppo_trainer

    allocated = {"peak": 0.0}
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: allocated["peak"] * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: allocated.update(peak=0.0))
    original = ppo_trainer.PhaseTimer
    with seven_b.phase_peaks(True) as peaks:
        timer = ppo_trainer.PhaseTimer(torch.device("cpu"))
        with timer.phase("step"):
            with timer.phase("gen"):
                allocated["peak"] = 40.0
            with timer.phase("old_log_prob"):
                allocated["peak"] = 20.0
            with timer.phase("ref"):
                allocated["peak"] = 22.0
            allocated["peak"] = 5.0  # between phases: the step's own
            with timer.phase("update_actor"):
                allocated["peak"] = 57.0
    assert ppo_trainer.PhaseTimer is original  # put back after the block
    assert peaks == {"gen": 40.0, "old_log_prob": 20.0, "ref": 22.0, "update_actor": 57.0, "step": 57.0}
    measured = seven_b.measured_phases(peaks)
    assert (measured["measured_gib/rollout"], measured["measured_gib/log_prob"]) == (40.0, 22.0)
    assert measured["measured_gib/update"] == 57.0 and measured["measured_gib/phase/step"] == 57.0


def test_the_critic_setting_is_predicted_to_fit_one_h200(tmp_path):
    """``--critic``'s settings at full size (config files only): a 1.5B-shaped critic beside the 7B recipe's
    actor is predicted to fit one H200 (140 GiB) and a 128 GiB host, its own phases in the forecast."""
    sys.path.insert(0, str(ROOT))
    from types import SimpleNamespace

    from bench import seven_b
    from klppo.assembly.memory_check import forecast
    from klppo.config import load_config

    w = seven_b.workload(SimpleNamespace(critic=True, lora=0, tiny=False))
    dirs = {}
    for name, shape in (
        ("actor", w.shape),
        ("critic", {**seven_b.QWEN25_15B, "vocab_size": w.shape["vocab_size"]}),
    ):
        dirs[name] = tmp_path / name
        dirs[name].mkdir()
        config = {"model_type": w.arch, "architectures": ["Qwen2ForCausalLM"], **shape}
        (dirs[name] / "config.json").write_text(json.dumps(config))
    paths = [f"actor_rollout_ref.model.path={dirs['actor']}", f"critic.model.path={dirs['critic']}"]
    sizes = ["data.train_batch_size=64", "data.max_prompt_length=512", "data.max_response_length=512"]
    cfg = load_config(w.overrides + paths + sizes + ["actor_rollout_ref.rollout.n=8"])
    found = forecast(cfg, str(dirs["actor"]), world_size=1, device_gib=140.0, host_bytes=128 * 2**30)
    assert found.refusal is None and "update_critic" in found.device_bytes
    assert max(found.device_bytes.values()) < 0.95 * 140 * 2**30 and found.host.total < 120 * 2**30
