"""``global_profiler``: traces of the listed steps only, gzipped Chrome-trace JSON under save_path, with the
trainer's phases as ranges and the communication shares in the profiled step's metrics. The GPU case (CUDA
kernel events, NVML utilisation) runs with ``python -m pytest -m gpu tests/trainer/test_profiler.py``."""

from __future__ import annotations

import pytest
import torch

from bench.check_traces import check
from tests.trainer.utils import base_overrides, read_metrics, run_training


def test_torch_profiler_traces_step_2_only(tiny_model_dir, arithmetic_data, tmp_path):
    run, prof = tmp_path / "run", tmp_path / "prof"
    run_training(
        base_overrides(tiny_model_dir, arithmetic_data, run)
        + [
            "trainer.total_training_steps=3",
            "global_profiler.tool=torch",
            "global_profiler.steps=[2]",
            f"global_profiler.save_path={prof}",
        ]
    )
    assert sorted(p.name for p in (prof / "torch").iterdir()) == ["step_2_rank_0.trace.json.gz"]
    reports, problems = check(prof / "torch", [2], cuda=False, max_mib=16)
    assert problems == []
    assert {"phase/gen", "phase/old_log_prob", "phase/update_actor", "phase/update_critic"} <= set(
        reports[0]["phases"]
    )
    rows = {r["step"]: r for r in read_metrics(run)}
    assert rows[2]["perf/exposed_comm_share"] == 0.0  # one process: no collective to expose
    assert "perf/comm_share" not in rows[1] and "perf/comm_share" not in rows[3]


def test_continuous_steps_share_one_trace(tiny_model_dir, arithmetic_data, tmp_path):
    prof = tmp_path / "prof"
    run_training(
        base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run")
        + [
            "trainer.total_training_steps=2",
            "global_profiler.tool=torch",
            "global_profiler.steps=[1,2]",
            "global_profiler.profile_continuous_steps=True",
            f"global_profiler.save_path={prof}",
        ]
    )
    assert [p.name for p in (prof / "torch").iterdir()] == ["step_1-2_rank_0.trace.json.gz"]
    assert check(prof / "torch", [1, 2], cuda=False, max_mib=16)[1] == []


def test_check_traces_flags_wrong_steps_and_missing_kernels(tiny_model_dir, arithmetic_data, tmp_path):
    prof = tmp_path / "prof"
    run_training(
        base_overrides(tiny_model_dir, arithmetic_data, tmp_path / "run")
        + [
            "global_profiler.tool=torch",
            "global_profiler.steps=[1]",
            f"global_profiler.save_path={prof}",
        ]
    )
    _, problems = check(prof / "torch", [1, 3], cuda=True, max_mib=16)
    assert any("no CUDA kernel events" in p for p in problems)
    assert any("expected exactly [1, 3]" in p for p in problems)
    assert any("MiB gzipped" in p for p in check(prof / "torch", [1], cuda=False, max_mib=1e-6)[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_traces_of_steps_1_and_3(tiny_model_dir, arithmetic_data, tmp_path):
    run, prof = tmp_path / "run", tmp_path / "prof"
    overrides = [
        o.replace("trainer.device=cpu", "trainer.device=cuda")
        for o in base_overrides(tiny_model_dir, arithmetic_data, run)
    ]
    run_gpu(
        overrides
        + [
            "trainer.total_training_steps=3",
            "actor_rollout_ref.rollout.name=klppo",
            "global_profiler.tool=torch",
            "global_profiler.steps=[1,3]",
            f"global_profiler.save_path={prof}",
        ]
    )
    reports, problems = check(prof / "torch", [1, 3], cuda=True, max_mib=16)
    assert problems == [], problems
    rows = {r["step"]: r for r in read_metrics(run)}
    assert 0.0 <= rows[3]["perf/exposed_comm_share"] <= rows[3]["perf/comm_share"] + 1e-9
    try:
        import pynvml  # noqa: F401
    except ImportError:
        return
    assert all(0.0 <= rows[s]["perf/gpu_util"] <= 100.0 for s in (1, 2, 3))


def run_gpu(argv: list[str]) -> None:
    from klppo.assembly.setup import build_run
    from klppo.config import load_config
    from klppo.parallel import dist
    from klppo.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(argv)
    info = dist.init_distributed("cuda", 120.0)
    try:
        PPOTrainer(build_run(cfg, device=info.device, argv=argv)).fit()
    finally:
        dist.destroy()


def test_comm_shares_by_hand():
    from klppo.ops.profiler import comm_shares

    # GPU: an NCCL kernel over [0, 10] µs, compute kernels over [5, 20] µs → 10 µs of communication, 5 exposed
    events = [
        {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 0.0, "dur": 10.0},
        {"ph": "X", "cat": "kernel", "name": "ampere_sgemm_128x64", "ts": 5.0, "dur": 15.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 100.0},  # not a kernel: ignored
    ]
    shares = comm_shares(events, "cuda", step_s=100e-6)
    assert shares["perf/comm_share"] == pytest.approx(0.10) and shares[
        "perf/exposed_comm_share"
    ] == pytest.approx(0.05)
    # CPU: a gloo all-gather half covered by a matmul
    events = [
        {"ph": "X", "cat": "cpu_op", "name": "gloo:all_gather", "ts": 0.0, "dur": 20.0},
        {"ph": "X", "cat": "cpu_op", "name": "aten::addmm", "ts": 10.0, "dur": 30.0},
    ]
    shares = comm_shares(events, "cpu", step_s=200e-6)
    assert shares["perf/comm_share"] == pytest.approx(0.10) and shares[
        "perf/exposed_comm_share"
    ] == pytest.approx(0.05)


def test_global_tool_config_entries_are_read_or_named():
    """global_tool_config is a free-form dict (verl's): the entries klppo reads act, the others are named
    when set away from verl's defaults (a verl YAML's defaults say nothing)."""
    from klppo.config import load_config, warn_unimplemented
    from klppo.config.schema import GlobalProfilerConfig
    from klppo.config.unimplemented import profiler_option_lines
    from klppo.ops.profiler import StepProfiler

    nsight = {"trace": "cuda,nvtx,cublas,ucx", "cuda-memory-usage": "true", "cuda-graph-trace": "graph"}
    verl = {
        "nsys": {
            "_target_": "verl.utils.profiler.config.NsightToolConfig",
            "discrete": False,
            "controller_nsight_options": nsight,
            "worker_nsight_options": {
                **nsight,
                "capture-range": "cudaProfilerApi",
                "capture-range-end": None,
                "kill": "none",
            },
        },
        "torch_memory": {
            "trace_alloc_max_entries": 100_000,
            "stack_depth": 32,
            "context": "all",
            "stacks": "all",
            "kw_args": {},
        },
    }
    assert profiler_option_lines(verl) == []
    changed = {
        "nsys": {**verl["nsys"], "discrete": True, "worker_nsight_options": {"trace": "cuda"}},
        "torch_memory": {**verl["torch_memory"], "stack_depth": 8, "context": "alloc"},
    }
    lines = profiler_option_lines(changed)
    assert len(lines) == 3
    assert lines[0].startswith(
        "global_profiler.global_tool_config.nsys.discrete=True is accepted but has no effect"
    )
    assert "nsys.worker_nsight_options" in lines[1] and "--capture-range=cudaProfilerApi" in lines[1]
    assert lines[2].startswith("global_profiler.global_tool_config.torch_memory.stack_depth=8")
    cfg = load_config(["+global_profiler.global_tool_config.nsys.discrete=True"])
    assert any("nsys.discrete=True" in line for line in warn_unimplemented(cfg, notify=lambda _m: None))
    # the read entries: context and stacks reach torch's allocator history, checked at start
    prof = StepProfiler(GlobalProfilerConfig(global_tool_config=changed), device=torch.device("cpu"), rank=0)
    assert (prof.memory_context, prof.memory_stacks, prof.max_entries) == ("alloc", "all", 100_000)
    for bad in ("java", "cpp"):  # torch's allocator history takes python or all
        with pytest.raises(ValueError, match=rf"torch_memory.stacks='{bad}': expected one of"):
            StepProfiler(
                GlobalProfilerConfig(global_tool_config={"torch_memory": {"stacks": bad}}),
                device=torch.device("cpu"),
                rank=0,
            )
    quiet = StepProfiler(
        GlobalProfilerConfig(global_tool_config={"torch_memory": {"context": None}}),
        device=torch.device("cpu"),
        rank=0,
    )
    assert quiet.memory_context is None  # no tracebacks recorded
