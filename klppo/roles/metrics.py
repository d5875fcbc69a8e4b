"""Weighted running means of per-micro-batch statistics, reduced once per phase."""

from __future__ import annotations

from collections import defaultdict


class MetricAccumulator:
    """Accumulates ``{name: value}`` with a weight per add; ``means()`` gives weighted means.

    Values are Python floats: the roles convert once per micro-batch, after the backward pass has queued.
    """

    def __init__(self) -> None:
        self._sum: dict[str, float] = defaultdict(float)
        self._weight: dict[str, float] = defaultdict(float)

    def add(self, stats: dict[str, float], *, weight: float = 1.0) -> None:
        for name, value in stats.items():
            self._sum[name] += float(value) * weight
            self._weight[name] += weight

    def merge(self, other: MetricAccumulator) -> None:
        """Add ``other``'s sums and weights (a retried pass's statistics, once it succeeded)."""
        for name, total in other._sum.items():
            self._sum[name] += total
            self._weight[name] += other._weight[name]

    def means(self) -> dict[str, float]:
        return {k: self._sum[k] / self._weight[k] for k in self._sum if self._weight[k] > 0}
