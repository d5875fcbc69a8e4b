"""``global_profiler``: profiles of chosen steps, and per-step GPU utilisation.

``StepProfiler.step(step)`` wraps one training step. With ``global_profiler.tool``:

* ``torch``: a torch.profiler trace (CPU ops; CUDA kernels on GPU) of each step in ``steps``, written as
  ``<save_path>/torch/step_<s>_rank_<r>.trace.json.gz`` (Chrome-trace JSON, gzipped); with
  ``profile_continuous_steps`` consecutive listed steps share one trace ``step_<a>-<b>_rank_<r>…``. The
  step's metrics get ``perf/comm_share`` (collective time / step time) and ``perf/exposed_comm_share``
  (collective time not overlapped by compute / step time; GPU: kernels, CPU: gloo against matmuls).
* ``torch_memory`` (CUDA): allocator history over the listed steps, dumped as
  ``<save_path>/torch_memory/step_<s>_rank_<r>.pickle`` (open in https://pytorch.org/memory_viz).
* ``nsys``: ``cudaProfilerStart/Stop`` around the listed steps (run under
  ``nsys profile --capture-range=cudaProfilerApi``); NVTX ranges name every phase on GPU whatever the tool
  (`klppo.trainer.timer.PhaseTimer`).

On GPU, every step gets ``perf/gpu_util`` (mean NVML utilisation in percent over the step's samples) when
``nvidia-ml-py`` is installed (``pip install nvidia-ml-py``; optional, no metric without it).
``global_tool_config`` (verl's): ``torch.contents`` ⊆ [cpu, cuda, memory, shapes, stack] (default
[cpu, cuda]; memory/shapes/stack make traces much larger), ``torch_memory.trace_alloc_max_entries``
(default 100000), ``torch_memory.context`` (null | alloc | state | all) and ``torch_memory.stacks`` (python |
all), both default all, as torch's allocator history takes them; the other entries are not acted on and
``klppo train`` names each one set away from verl's default
(:func:`klppo.config.unimplemented.profiler_option_lines`). ``npu`` is refused.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from klppo.config.schema import GlobalProfilerConfig
from klppo.tune.intervals import exposed_time
from klppo.tune.measure import _COLLECTIVE_WORDS, _CPU_COMPUTE

log = logging.getLogger("klppo")
TOOLS = (None, "torch", "torch_memory", "nsys")
TORCH_CONTENTS = ("cpu", "cuda", "memory", "shapes", "stack")


class StepProfiler:
    def __init__(self, cfg: GlobalProfilerConfig, *, device: torch.device, rank: int) -> None:
        if cfg.tool not in TOOLS:
            raise ValueError(
                f"global_profiler.tool={cfg.tool!r}: expected one of torch, torch_memory, nsys or null"
            )
        self.tool = cfg.tool
        self.steps = sorted({int(s) for s in (cfg.steps or [])})
        self.continuous = cfg.profile_continuous_steps
        self.save_path = Path(cfg.save_path).expanduser()
        self.device, self.rank = device, rank
        self.nvml = NvmlUtilization.open(device) if device.type == "cuda" else None
        self._prof: Any = None
        self._first = 0
        options = dict(cfg.global_tool_config or {})
        self.contents = set(dict(options.get("torch") or {}).get("contents") or ["cpu", "cuda"])
        if not self.contents <= set(TORCH_CONTENTS):
            raise ValueError(
                f"global_profiler.global_tool_config.torch.contents={sorted(self.contents)}: expected a "
                f"subset of {list(TORCH_CONTENTS)}"
            )
        memory = dict(options.get("torch_memory") or {})
        self.max_entries = int(memory.get("trace_alloc_max_entries", 100_000))
        self.memory_context = memory.get("context", "all")
        self.memory_stacks = memory.get("stacks", "all")
        for key, value, valid in (
            ("context", self.memory_context, (None, "alloc", "state", "all")),
            ("stacks", self.memory_stacks, ("python", "all")),
        ):
            if value not in valid:
                raise ValueError(
                    f"global_profiler.global_tool_config.torch_memory.{key}={value!r}: expected one of "
                    f"{valid}"
                )
        if self.tool == "torch_memory" and device.type != "cuda":
            log.warning(
                "global_profiler.tool=torch_memory records the CUDA allocator: nothing to record on %s",
                device.type,
            )
        if self.tool == "nsys" and device.type != "cuda":
            log.warning("global_profiler.tool=nsys needs a CUDA device: no capture range on %s", device.type)

    @contextlib.contextmanager
    def step(self, step: int, metrics: dict[str, float]):
        """Profile ``step`` when listed; adds this step's profiler/utilisation metrics to ``metrics``."""
        listed = self.tool is not None and step in self.steps
        start_s = time.perf_counter()
        if self.nvml is not None:
            self.nvml.start()
        if listed:
            self._start(step)
        yield
        if listed:
            metrics.update(self._stop(step, time.perf_counter() - start_s))
        if self.nvml is not None:
            util = self.nvml.mean_since_start()
            if util is not None:
                metrics["perf/gpu_util"] = util

    # ------------------------------------------------------------------ tools
    def _start(self, step: int) -> None:
        if self.tool == "torch" and self._prof is None:
            c = self.contents
            activities = [ProfilerActivity.CPU] if "cpu" in c else []
            if self.device.type == "cuda" and "cuda" in c:
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(
                activities=activities,
                record_shapes="shapes" in c,
                profile_memory="memory" in c,
                with_stack="stack" in c,
            )
            self._prof.__enter__()
            self._first = step
        elif self.tool == "torch_memory" and self.device.type == "cuda":
            torch.cuda.memory._record_memory_history(
                context=self.memory_context, stacks=self.memory_stacks, max_entries=self.max_entries
            )
        elif self.tool == "nsys" and self.device.type == "cuda":
            torch.cuda.profiler.start()

    def _stop(self, step: int, step_s: float) -> dict[str, float]:
        if self.tool == "torch":
            if self.continuous and step + 1 in self.steps:
                return {}  # the trace goes on into the next listed step
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            name = f"step_{step}" if self._first == step else f"step_{self._first}-{step}"
            path = self.save_path / "torch" / f"{name}_rank_{self.rank}.trace.json.gz"
            events = self._write_trace(prof, path)
            log.info("profile of step %s written: %s", name[5:], path)
            return comm_shares(events, self.device.type, step_s * (step - self._first + 1))
        if self.tool == "torch_memory" and self.device.type == "cuda":
            out = self.save_path / "torch_memory" / f"step_{step}_rank_{self.rank}.pickle"
            out.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(out))
            torch.cuda.memory._record_memory_history(enabled=None)
            log.info("memory snapshot of step %d written: %s", step, out)
        elif self.tool == "nsys" and self.device.type == "cuda":
            torch.cuda.profiler.stop()
        return {}

    @staticmethod
    def _write_trace(prof: Any, path: Path) -> list[dict]:
        """Export the Chrome trace gzipped to ``path``; returns its events."""
        path.parent.mkdir(parents=True, exist_ok=True)
        raw = path.with_name(f".{path.name[:-3]}.tmp-{os.getpid()}")
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)
        with open(raw, encoding="utf-8") as f:
            events = json.load(f).get("traceEvents", [])
        raw.unlink()
        return events


def comm_shares(events: list[dict], device_type: str, step_s: float) -> dict[str, float]:
    """``perf/comm_share`` and ``perf/exposed_comm_share`` from a Chrome trace's complete events: on GPU,
    kernels (collectives: names with "nccl") against all other kernels; on CPU, gloo/c10d collective ops
    against matmul-like aten ops (the rules of `klppo.tune.measure.split_profile`)."""

    comm, compute = [], []
    for e in events:
        if e.get("ph") != "X":
            continue
        name, cat = str(e.get("name", "")).lower(), e.get("cat")
        span = (e["ts"] / 1e6, (e["ts"] + e.get("dur", 0)) / 1e6)
        is_comm = any(w in name for w in _COLLECTIVE_WORDS)
        if device_type == "cuda":
            if cat == "kernel":
                (comm if is_comm else compute).append(span)
        elif cat == "cpu_op":
            if is_comm:
                comm.append(span)
            elif any(name.startswith(w) for w in _CPU_COMPUTE):
                compute.append(span)
    total, exposed = exposed_time(comm, compute)
    step_s = max(step_s, 1e-9)
    return {"perf/comm_share": total / step_s, "perf/exposed_comm_share": exposed / step_s}


class NvmlUtilization:
    """GPU utilisation samples of this process's device through NVML (``nvidia-ml-py``)."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle
        self._since_us = 0

    @classmethod
    def open(cls, device: torch.device) -> NvmlUtilization | None:
        try:
            import pynvml  # noqa: PLC0415  optional: NVIDIA management library, GPU utilisation only
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            props = torch.cuda.get_device_properties(device)
            bus_id = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus_id)
        except Exception as exc:  # no driver access in a container, an old pynvml, …
            log.warning("GPU utilisation through NVML unavailable (%s): no perf/gpu_util", exc)
            return None
        return cls(pynvml, handle)

    def start(self) -> None:
        self._since_us = int(time.time() * 1e6)

    def mean_since_start(self) -> float | None:
        """Mean utilisation (percent) of the samples NVML took since ``start``; the current reading when
        the driver keeps none."""
        n = self.nvml
        try:
            _, samples = n.nvmlDeviceGetSamples(self.handle, n.NVML_GPU_UTILIZATION_SAMPLES, self._since_us)
            values = [s.sampleValue.uiVal for s in samples if s.timeStamp >= self._since_us]
            if values:
                return float(sum(values)) / len(values)
        except n.NVMLError:
            pass
        try:
            return float(n.nvmlDeviceGetUtilizationRates(self.handle).gpu)
        except n.NVMLError:
            return None
