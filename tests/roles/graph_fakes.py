"""A CPU stand-in for CUDA-graph capture (klppo.roles.graphed): "capturing" runs the step once on the static
inputs and keeps its output and gradient tensors; "replaying" runs it again on the static inputs and
writes the results into those same tensors — the memory behaviour of a replay (the same tensors every
time, the caller's inputs read only through the static copies), so the plumbing around it is what a test
checks. What it cannot check: that the step is capturable (no host synchronisation) — the GPU tests do."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class FakeGraph:
    def __init__(self, step, static, params, outputs, grads) -> None:
        self.step, self.static, self.params = step, static, list(params)
        self.outputs, self.grads = outputs, grads
        self.replays = 0

    def replay(self) -> None:
        for p in self.params:
            p.grad = None
        new = list(self.step(self.static))
        with torch.no_grad():
            for out, value in zip(self.outputs, new, strict=True):
                out.copy_(value)
            for g, p in zip(self.grads, self.params, strict=True):
                if g is not None:
                    g.copy_(p.grad)
        for p in self.params:
            p.grad = None
        self.replays += 1

    def pool(self) -> str:
        return "fake-pool"


class FakeCapture:
    """``capture=`` for :class:`klppo.roles.graphed.MicroGraphs`; records the graphs it made."""

    def __init__(self) -> None:
        self.graphs: list[FakeGraph] = []
        self.pools: list[object] = []

    def __call__(self, step, static: list[torch.Tensor], params: Sequence[torch.nn.Parameter], *, pool=None):
        self.pools.append(pool)
        outputs = [t.detach().clone() for t in step(static)]  # a capture computes nothing the caller reads
        grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
        for p in params:  # as the capture leaves them: the gradient tensors the graph writes
            p.grad = None
        graph = FakeGraph(step, static, params, outputs, grads)
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        self.graphs.append(graph)
        return graph, outputs
