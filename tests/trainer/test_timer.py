"""The phase timer (klppo/trainer/timer.py): the host's clock off CUDA; on CUDA the device's timeline from
events, with no synchronisation at the edges (the GPU test: a phase's queued device work is timed, and the
host leaves the phase at once)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from klppo.trainer import timer as timer_module
from klppo.trainer.timer import PhaseOutOfMemory, PhaseTimer


def test_host_clock_off_cuda_sums_repeated_phases():
    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("step"):
        with timer.phase("reward"):
            time.sleep(0.02)
        with timer.phase("reward"):
            time.sleep(0.01)
    first = timer.metrics()
    assert first["timing_s/reward"] >= 0.03
    assert first["timing_s/step"] >= first["timing_s/reward"]
    assert timer.metrics() == first  # read twice (the trainer does): the same figures


class _Event:
    """The part of a CUDA event the timer uses; ``ms``: its time on the device's timeline."""

    def __init__(self, ms: float, synced: list) -> None:
        self.ms, self.synced = ms, synced

    def synchronize(self) -> None:
        self.synced.append(self.ms)

    def elapsed_time(self, end: _Event) -> float:
        return end.ms - self.ms


def test_cuda_events_summed_once_without_a_gpu(monkeypatch):
    """The CUDA path's bookkeeping on any machine (events faked, one per edge 1 ms apart; a synchronisation
    at an edge would raise without CUDA): repeated phases summed, nesting, and a second ``metrics()`` (the
    trainer reads it twice) the same figures, not the events counted again."""
    ticks, synced = iter(range(100)), []
    monkeypatch.setattr(PhaseTimer, "_event", lambda self: _Event(float(next(ticks)), synced))
    monkeypatch.setattr(timer_module, "_ranges", lambda name, device: contextlib.nullcontext())
    timer = PhaseTimer(torch.device("cuda"))
    with timer.phase("step"):  # events 0 and 5
        with timer.phase("reward"):  # 1, 2
            pass
        with timer.phase("reward"):  # 3, 4
            pass
    assert not synced  # nothing waited for the device at the edges
    first = timer.metrics()
    assert first == pytest.approx({"timing_s/reward": 0.002, "timing_s/step": 0.005})
    assert timer.metrics() == first


def test_out_of_memory_names_the_phase():
    timer = PhaseTimer(torch.device("cpu"))
    with pytest.raises(PhaseOutOfMemory, match="update_actor"), timer.phase("update_actor"):
        raise torch.OutOfMemoryError("CUDA out of memory")


SLEEP_CYCLES = 100_000_000  # torch.cuda._sleep spins this many GPU clock cycles: ≈ 50 ms at 2 GHz


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_phases_on_the_device_timeline():
    device = torch.device("cuda")
    torch.cuda.synchronize()
    elapsed = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    elapsed[0].record()
    torch.cuda._sleep(SLEEP_CYCLES)
    elapsed[1].record()
    torch.cuda.synchronize()
    kernel_s = elapsed[0].elapsed_time(elapsed[1]) / 1e3
    assert kernel_s > 0.02, kernel_s  # the sleep kernel takes long enough to tell the cases apart

    timer = PhaseTimer(device)
    start = time.perf_counter()
    with timer.phase("step"):
        with timer.phase("values"):
            torch.cuda._sleep(SLEEP_CYCLES)
        host_in_values = time.perf_counter() - start
        with timer.phase("reward"):  # host work while the device still runs the values' kernel
            time.sleep(0.005)
    m = timer.metrics()
    assert m["timing_s/values"] == pytest.approx(kernel_s, rel=0.2)
    # the host left the phase before the device finished it; reward kept the device waiting ~never
    assert host_in_values < 0.5 * kernel_s
    assert m["timing_s/reward"] < 0.003
    assert m["timing_s/step"] >= m["timing_s/values"] + m["timing_s/reward"] - 1e-4
