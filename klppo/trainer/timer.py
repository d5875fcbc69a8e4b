"""Phase timing for ``timing_s/<phase>`` metrics (synchronizes the device at phase edges)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str):
        from klppo.parallel.dist import phase as dist_phase

        self._sync()
        start = time.perf_counter()
        with dist_phase(name):
            yield
        self._sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"timing_s/{k}": v for k, v in self.seconds.items()}
