"""Weighted running means of per-micro-batch statistics, reduced once per phase."""

from __future__ import annotations

from collections import defaultdict

import torch


class MetricAccumulator:
    """Accumulates ``{name: value}`` with a weight per add; ``means()`` gives weighted means.

    Values are Python floats or one-element tensors. Tensors stay on their device: ``value × weight`` is
    summed there in float64 (the same arithmetic, in the same order, as Python floats: the means are
    bit-identical), and ``means()`` brings all the sums to the host at once — one device sync per phase
    instead of one per statistic and micro-batch. Weights are Python floats (known on the host).
    """

    def __init__(self) -> None:
        self._sum: dict[str, float | torch.Tensor] = defaultdict(float)
        self._weight: dict[str, float] = defaultdict(float)

    def add(self, stats: dict[str, float | torch.Tensor], *, weight: float = 1.0) -> None:
        for name, value in stats.items():
            if isinstance(value, torch.Tensor):
                term = value.detach().reshape(()).double() * weight
            else:
                term = float(value) * weight
            self._sum[name] = self._sum[name] + term
            self._weight[name] += weight

    def merge(self, other: MetricAccumulator) -> None:
        """Add ``other``'s sums and weights (a retried pass's statistics, once it succeeded)."""
        for name, total in other._sum.items():
            self._sum[name] = self._sum[name] + total
            self._weight[name] += other._weight[name]

    def means(self) -> dict[str, float]:
        sums = _to_host(self._sum)
        return {k: sums[k] / self._weight[k] for k in sums if self._weight[k] > 0}


def _to_host(values: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """Python floats of ``values``: the tensors of each device copied in one transfer."""
    out = {k: v for k, v in values.items() if not isinstance(v, torch.Tensor)}
    by_device: dict[torch.device, list[str]] = defaultdict(list)
    for name, v in values.items():
        if isinstance(v, torch.Tensor):
            by_device[v.device].append(name)
    for names in by_device.values():
        out.update(zip(names, torch.stack([values[n] for n in names]).tolist(), strict=True))
    return {k: out[k] for k in values}
