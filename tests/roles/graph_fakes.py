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


class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten call of a step with its arguments as they were (Python numbers included)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            raise RuntimeError("a host synchronisation (.item()) inside a captured step")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class RecordedGraph:
    """A replay of the recorded aten calls on the tensors of the capture (static inputs, parameters and
    the capture's own intermediates): what a CUDA graph does — Python values read by the step's code at
    capture are baked in, only the tensors' contents change."""

    def __init__(self, ops: list[tuple]) -> None:
        self.ops = ops
        self.replays = 0

    def replay(self) -> None:
        with torch.no_grad():
            for func, args, kwargs, out in self.ops:
                new = func(*args, **kwargs)
                olds = out if isinstance(out, (list, tuple)) else [out]
                news = new if isinstance(new, (list, tuple)) else [new]
                for o, n in zip(olds, news, strict=True):
                    if isinstance(o, torch.Tensor) and o is not n:
                        o.copy_(n)
        self.replays += 1

    def pool(self) -> str:
        return "recorded-pool"


class RecordingCapture:
    """``capture=`` for :class:`klppo.roles.graphed.MicroGraphs` closer to CUDA than :class:`FakeCapture`: the
    step runs once under a recorder and a replay re-executes the recorded aten calls (not the step's Python
    code), so a Python number the step read at capture stays what it was then, as in a CUDA graph."""

    def __init__(self) -> None:
        self.graphs: list[RecordedGraph] = []
        self.pools: list[object] = []

    def __call__(self, step, static: list[torch.Tensor], params: Sequence[torch.nn.Parameter], *, pool=None):
        self.pools.append(pool)
        for p in params:
            p.grad = None
        recorder = _Recorder()
        with recorder:
            outputs = list(step(static))
        graph = RecordedGraph(recorder.ops)
        self.graphs.append(graph)
        return graph, outputs


class WarmupRecordingCapture(RecordingCapture):
    """:class:`RecordingCapture` preceded by one unrecorded run of the step on the static inputs (its
    gradients dropped), as :func:`klppo.roles.graphed.capture_cuda` warms up before capturing; during the
    recorded run packed attention is told that a capture is under way (``attention._capturing``), as on
    CUDA."""

    def __call__(self, step, static: list[torch.Tensor], params: Sequence[torch.nn.Parameter], *, pool=None):
        from klppo.batching import attention

        step(static)
        for p in params:
            p.grad = None
        real = getattr(attention, "_capturing", None)
        attention._capturing = lambda: True
        try:
            return super().__call__(step, static, params, pool=pool)
        finally:
            if real is None:
                del attention._capturing
            else:
                attention._capturing = real
