"""bench/trace_phases.py on a hand-built Chrome trace: per-phase wall, kernel-busy union, kernels placed by
the launch's correlation id, sync time, self time of nested CPU operators, and zeros for a CPU-only trace."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.trace_phases import main, summarize

ROOT = Path(__file__).resolve().parents[2]
CPU, MAIN, AUTOGRAD = 100, 1, 2  # host pid and threads
GPU, STREAM_A, STREAM_B = 0, 7, 8
GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off"
EW = "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>"


def x(name, cat, ts, dur, pid=CPU, tid=MAIN, corr=None):
    args = {} if corr is None else {"correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid, "ts": ts, "dur": dur, "args": args}


def op(name, ts, dur, tid=MAIN):
    return x(name, "cpu_op", ts, dur, tid=tid)


def rt(name, ts, dur, corr, tid=MAIN, cat="cuda_runtime"):
    return x(name, cat, ts, dur, tid=tid, corr=corr)


def kernel(name, ts, dur, corr=None, stream=STREAM_A, cat="kernel"):
    return x(name, cat, ts, dur, pid=GPU, tid=stream, corr=corr)


def gpu_trace() -> list[dict]:
    """Times in µs. step [0, 1000] holds gen [10, 310], adv [320, 350] and [910, 940], update_actor
    [400, 900]; one operator before the step, one kernel after it."""
    return [
        {"ph": "M", "name": "process_name", "pid": CPU, "tid": 0, "ts": -500, "args": {"name": "python"}},
        {"ph": "s", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": CPU, "tid": MAIN, "ts": 100},
        op("aten::empty", -100, 10),  # outside every phase
        x("phase/step", "user_annotation", 0, 1000),
        # gen: linear(t, addmm(copy_)) and copy_ with a memcpy + stream sync; 3 launches
        x("phase/gen", "user_annotation", 10, 300),
        op("aten::linear", 20, 100),
        x("inner", "user_annotation", 22, 96),  # not an operator: no effect on nesting
        op("aten::t", 25, 10),
        op("aten::addmm", 40, 70),
        op("aten::copy_", 50, 10),
        rt("cudaLaunchKernel", 100, 5, corr=1),
        rt("cudaLaunchKernel", 112, 3, corr=2),
        op("aten::copy_", 200, 30),
        rt("cudaMemcpyAsync", 205, 5, corr=3),
        rt("cudaStreamSynchronize", 211, 18, corr=4),
        rt("cudaLaunchKernel", 290, 5, corr=5),
        kernel(GEMM, 130, 70, corr=1),
        kernel(EW, 180, 80, corr=2, stream=STREAM_B),  # overlaps the gemm: union [130, 260]
        kernel("Memcpy DtoH (Device -> Pinned)", 262, 8, corr=3, cat="gpu_memcpy"),
        kernel(EW, 420, 20, corr=5),  # launched in gen, runs inside update_actor's ranges
        # adv, first occurrence: a kernel with no launch in the trace, placed by its start (CPU range)
        x("phase/adv", "user_annotation", 320, 30),
        op("aten::sub", 322, 4),
        kernel("uncorrelated_adv", 325, 5),
        # update_actor: backward on the autograd thread, a graph launch of two kernels, a driver launch,
        # a device sync; one kernel without correlation inside the phase's GPU range
        x("phase/update_actor", "user_annotation", 400, 500),
        x("phase/update_actor", "gpu_user_annotation", 410, 470, pid=GPU, tid=STREAM_A),
        op("autograd::engine::evaluate_function: MmBackward0", 450, 100, tid=AUTOGRAD),
        op("aten::mm", 460, 80, tid=AUTOGRAD),
        op("aten::zeros", 455, 90),  # main thread, overlapping: not a parent of aten::mm
        rt("cudaGraphLaunch", 470, 10, corr=6, tid=AUTOGRAD),
        rt("cuLaunchKernel", 500, 5, corr=7, tid=AUTOGRAD, cat="cuda_driver"),
        rt("cudaMemcpyAsync", 560, 30, corr=11),  # into pageable memory (.item(), .tolist()): it waits
        kernel("Memcpy DtoH (Device -> Pageable)", 705, 4, corr=11, cat="gpu_memcpy"),
        op("aten::_foreach_add_", 840, 9),
        rt("cudaDeviceSynchronize", 850, 40, corr=8),
        kernel("graph_a", 600, 50, corr=6),
        kernel("graph_b", 640, 60, corr=6, stream=STREAM_B),  # union with graph_a [600, 700]
        kernel("driver_k", 800, 20, corr=7),
        kernel("uncorrelated_upd", 860, 10),
        # adv, second occurrence: a launch whose kernel outlasts the phase, a blocking memcpy
        x("phase/adv", "user_annotation", 910, 30),
        op("aten::add", 912, 8),
        rt("cudaLaunchKernel", 915, 3, corr=9),
        rt("cudaMemcpy", 925, 10, corr=10),
        kernel("late_add", 950, 80, corr=9),
        kernel("Memcpy HtoD (Pageable -> Device)", 936, 2, corr=10, cat="gpu_memcpy"),
        kernel("after_everything", 1040, 10),  # span ends at 1050
    ]


def _write(tmp_path: Path, events: list[dict]) -> Path:
    path = tmp_path / "step_60_rank_0.trace.json.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        json.dump({"schemaVersion": 1, "traceEvents": events}, f)
    return path


def _near(v):
    return pytest.approx(v, rel=1e-12, abs=1e-15)


def test_phases_of_a_gpu_trace(tmp_path, capsys):
    s = summarize(gpu_trace(), top=8)
    rows = {r["phase"]: r for r in s["phases"]}
    assert [r["phase"] for r in s["phases"]] == ["step", "gen", "adv", "update_actor"]  # by first start
    us = 1e-6
    gen = rows["gen"]
    assert (gen["count"], gen["n_kernels"], gen["n_memcpy"], gen["n_launches"], gen["n_cpu_ops"]) == (
        1,
        3,
        1,
        3,
        5,
    )
    assert gen["wall_s"] == _near(300 * us)
    assert gen["kernel_busy_s"] == _near((130 + 20) * us)  # [130, 260] ∪ [420, 440]
    assert gen["busy_share"] == _near(150 / 300)
    assert gen["memcpy_s"] == _near(8 * us) and gen["sync_s"] == _near(
        18 * us
    )  # an async copy to pinned memory
    # does not wait
    assert [(k["name"], k["count"]) for k in gen["top_kernels"]] == [(EW[:70], 2), (GEMM[:70], 1)]
    assert gen["top_kernels"][0]["total_s"] == _near(100 * us) and len(GEMM) > 70
    # self times: linear 100-10-70, addmm 70-10, copy_ 10+30, t 10
    by_self = {o["name"]: (o["total_s"], o["count"]) for o in gen["top_ops_by_self"]}
    assert by_self == {
        "aten::addmm": _near((60 * us, 1)),
        "aten::copy_": _near((40 * us, 2)),
        "aten::linear": _near((20 * us, 1)),
        "aten::t": _near((10 * us, 1)),
    }
    assert [o["name"] for o in gen["top_ops_by_self"]] == [
        "aten::addmm",
        "aten::copy_",
        "aten::linear",
        "aten::t",
    ]
    assert [o["name"] for o in gen["top_ops_by_count"]][0] == "aten::copy_"

    upd = rows["update_actor"]
    assert (upd["n_kernels"], upd["n_launches"], upd["n_cpu_ops"]) == (4, 2, 4)  # EW at 420 stays in gen
    assert upd["kernel_busy_s"] == _near((100 + 20 + 10) * us) and upd["sync_s"] == _near((40 + 30) * us)
    assert upd["memcpy_s"] == _near(4 * us)
    by_self = {o["name"]: o["total_s"] for o in upd["top_ops_by_self"]}
    assert by_self == {
        "aten::zeros": _near(90 * us),
        "aten::mm": _near(80 * us),
        "autograd::engine::evaluate_function: MmBackward0": _near(20 * us),
        "aten::_foreach_add_": _near(9 * us),
    }

    adv = rows["adv"]  # two occurrences summed
    assert (adv["count"], adv["n_kernels"], adv["n_memcpy"], adv["n_launches"], adv["n_cpu_ops"]) == (
        2,
        2,
        1,
        1,
        2,
    )
    assert adv["wall_s"] == _near(60 * us) and adv["kernel_busy_s"] == _near((5 + 80) * us)
    assert adv["memcpy_s"] == _near(2 * us) and adv["sync_s"] == _near(10 * us)  # blocking cudaMemcpy

    step = rows["step"]
    assert (step["n_kernels"], step["n_launches"], step["n_cpu_ops"]) == (9, 6, 11)
    assert step["kernel_busy_s"] == _near(365 * us) and step["memcpy_s"] == _near(14 * us)
    assert step["sync_s"] == _near(98 * us)

    w = s["whole"]
    assert w["span_s"] == _near(1150 * us) and w["kernel_busy_s"] == _near(375 * us)
    assert (
        w["outside_phases_s"] == _near(150 * us) and w["n_kernels"] == 10 and w["memcpy_s"] == _near(14 * us)
    )

    # the CLI: table on stdout, the same numbers as JSON
    path, out = _write(tmp_path, gpu_trace()), tmp_path / "phases.json"
    assert main([str(path), "--top", "2", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "update_actor" in text and "outside any phase 0.15 ms" in text
    data = json.loads(out.read_text())
    assert data["whole"] == s["whole"]
    assert [len(r["top_ops_by_self"]) for r in data["phases"]] == [2, 2, 2, 2]
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "trace_phases.py"), str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "gen" in run.stdout and "50%" in run.stdout  # gen's busy share


def test_cpu_only_trace_gives_zero_kernel_fields(tmp_path, capsys):
    events = [
        x("phase/step", "user_annotation", 0, 100),
        x("phase/update_actor", "user_annotation", 10, 80),
        op("aten::mm", 20, 30),
        op("aten::add", 25, 5),
    ]
    s = summarize(events)
    for r in s["phases"]:
        assert (r["kernel_busy_s"], r["memcpy_s"], r["busy_share"], r["sync_s"]) == (0.0, 0.0, 0.0, 0.0)
        assert (r["n_kernels"], r["n_launches"], r["top_kernels"]) == (0, 0, [])
        assert r["n_cpu_ops"] == 2
    upd = s["phases"][1]
    assert {o["name"]: o["total_s"] for o in upd["top_ops_by_self"]} == {
        "aten::mm": _near(25e-6),
        "aten::add": _near(5e-6),
    }
    assert s["whole"]["kernel_busy_s"] == 0.0 and s["whole"]["n_kernels"] == 0
    assert s["whole"]["span_s"] == _near(100e-6) and s["whole"]["outside_phases_s"] == 0.0
    assert main([str(_write(tmp_path, events))]) == 0
    assert "update_actor" in capsys.readouterr().out
