"""An update's micro-batches replayed as CUDA graphs (``*.cuda_graph_update``, a klppo extension of verl's
configuration; docs/sharding.md, "The update as CUDA graphs").

On one GPU the update's forward, loss and backward are host-bound: thousands of small kernels, each launched
by Python while the GPU waits. Captured once as a CUDA graph, a micro-batch's kernels are one launch, and
the update takes the kernels' own time (``bench/ppo_step.py``'s ``+graphs`` setting times both).

:class:`MicroGraphs` keys each micro-batch by its *signature* — the shapes and dtypes of every tensor the
step reads, and the Python values the step's code branches on — and

1. the first time a signature is met, runs the step eagerly (compilation, allocator growth, lazy set-up);
2. the second time, warms it up once more on a side stream, captures it into a CUDA graph (inputs copied
   into static tensors the graph owns, gradients allocated inside the graph's memory pool) and replays it;
3. every later time, copies the micro-batch into the static inputs and replays.

A replay writes the same output tensors and the same gradient tensors every time: the caller reads the
outputs before the next step (the update accumulates them at once), and the parameters' ``.grad`` are set
to the graph's gradient tensors after each replay (the plain path then adds them into the master gradients
and drops the attribute; the tensors stay alive here). The role's graphs write one set of gradient tensors:
the first capture allocates it, later captures zero it at their start and accumulate into it in place. The
step therefore has to start from no gradients
(``.grad`` None), as the plain path's micro-batches do, and its parameters must keep their storage between
steps (updated in place — the plain path's copy from the masters — never re-gathered or offloaded).

What a step may not do inside: synchronise with the host (``.item()``, ``.tolist()``, a device tensor's
truth value), copy from host memory, or branch on device values — the graph keeps one branch. Everything a
step reads that changes between micro-batches must be one of its input tensors (the loss weights and the KL
coefficient included, as 0-dim tensors), everything else part of its signature. Graphs share one memory
pool per role; at most ``max_graphs`` signatures are captured (each holds one micro-batch's activations
for the run's duration), later ones run eagerly. A capture that fails (an operation a graph cannot hold)
is logged once with the key and the update goes on eagerly; out of memory during a capture propagates to
the role's out-of-memory recovery.

The no-grad forward passes (the actor's old log-probs, the reference's log-probs, the critic's values) run
through a :class:`MicroGraphs` of their own, built with no parameters (``params=()``): a step without
gradients, so nothing here reads or sets a ``.grad``. The old-log-prob and values graphs share the memory
pool of their role's update graphs (``shares_pool_with``): the passes never overlap, and every replay's
outputs are read (copied) before the next replay of any graph of the pool, so one pool holds the larger of
the two working sets rather than both (the reference, with no update, has a pool of its own).

Knows nothing about PPO or roles: it takes the parameters, a key, the input tensors and the step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch

logger = logging.getLogger(__name__)
T = TypeVar("T")

Step = Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor]]
"""A micro-batch's forward, loss and backward on its input tensors; returns the tensors the caller reads."""


class Graph(Protocol):
    """What :class:`MicroGraphs` needs of a captured graph (``torch.cuda.CUDAGraph``'s methods)."""

    def replay(self) -> None: ...


@dataclass
class MicroParts:
    """A micro-batch's loss split for capture (the roles build it; :class:`klppo.roles.trained.TrainedRole`
    runs it): the device tensors it reads, what else its code depends on (hashable), the aggregation mode of
    each loss term (their weights are computed on the host, then passed in as tensors), and the loss as a
    function of the tensors: ``loss(tensors) -> (terms, statistics)``, terms as (tensor, mode) pairs in
    ``modes``' order, every statistic a tensor (one the host knows goes to ``host_stats``)."""

    tensors: list[torch.Tensor]
    key: Any
    modes: list[str]
    loss: Callable[[Sequence[torch.Tensor]], tuple[list[tuple[torch.Tensor, str]], dict[str, torch.Tensor]]]
    host_stats: dict[str, float] = field(default_factory=dict)
    """Statistics known on the host (not outputs of the step), reported as they are."""


def signature(tensors: Sequence[torch.Tensor], extra: Any = ()) -> tuple:
    """The key of a step: shape, dtype and device of each input, then ``extra`` (hashable)."""
    return (tuple((tuple(t.shape), t.dtype, t.device) for t in tensors), extra)


@dataclass
class _Captured:
    graph: Graph
    inputs: list[torch.Tensor]  # the graph's static inputs
    outputs: list[torch.Tensor]  # its static outputs
    grads: list[torch.Tensor | None]  # the gradient it writes, per parameter (None: the step gives it none)


class MicroGraphs:
    """The captured steps of one role (module docstring). ``capture``: how a step is captured — by default
    :func:`capture_cuda`; the CPU tests pass one that records the step and re-runs it on its static
    tensors."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        max_graphs: int = 4,
        capture: Callable[..., tuple[Graph, list[torch.Tensor]]] | None = None,
        key_name: str = "cuda_graph_update",
        what: str = "an update step",
        shares_pool_with: MicroGraphs | None = None,
    ) -> None:
        """``what`` names the step in the log (``"an update step"``, ``"a no-grad forward"``);
        ``shares_pool_with``: another role's graphs whose memory pool these capture into (module docstring);
        :meth:`clear` on either drops the pool for both — clear the other too."""
        self.params = [p for p in params if p.requires_grad]
        self.key_name = key_name  # the config key, for the message when a capture fails
        self.what = what
        self.failed: str | None = None  # why a capture failed: no more captures, eager from then on
        self.max_graphs = max_graphs
        self._capture = capture or capture_cuda
        self._seen: set[tuple] = set()
        self._graphs: dict[tuple, _Captured] = {}
        # the memory pool the role's graphs share (set by the first capture), in a box other graphs may share
        self._pool_box: list[Any] = [None] if shares_pool_with is None else shares_pool_with._pool_box
        self._shared_grads: list[torch.Tensor | None] | None = None  # the gradients the graphs write
        self.num_replays = 0
        self.num_eager = 0

    @property
    def pool(self) -> Any:
        return self._pool_box[0]

    @pool.setter
    def pool(self, value: Any) -> None:
        self._pool_box[0] = value

    def clear(self) -> None:
        """Drop every graph and what they hold (their gradients, outputs and memory pool), and forget the
        signatures seen: after an out-of-memory retry halved the micro-batch, the old shapes recur no more."""
        self._seen.clear()
        self._graphs.clear()
        self.pool = None
        self._shared_grads = None

    def run(self, key: tuple, inputs: Sequence[torch.Tensor], step: Step) -> Sequence[torch.Tensor]:
        """``step(inputs)`` for this micro-batch, eagerly or by replaying its graph (module docstring). The
        outputs of a replay are the graph's own tensors: read them before the next call."""
        captured = self._graphs.get(key)
        if captured is None:
            if key not in self._seen or len(self._graphs) >= self.max_graphs or self.failed:
                self._seen.add(key)
                self.num_eager += 1
                return step(inputs)
            if any(p.grad is not None for p in self.params):  # the caller's contract, not a capture failure
                raise RuntimeError("a captured update step must start from no gradients (.grad None)")
            try:
                captured = self._new_graph(key, inputs, step)
            except torch.OutOfMemoryError:
                raise  # the role's out-of-memory recovery halves the micro-batch (a smaller shape)
            except Exception as e:  # a step that cannot be captured runs eagerly; the run goes on
                self._capture_failed(e)
                self.num_eager += 1
                return step(inputs)
        with torch.no_grad():
            torch._foreach_copy_(captured.inputs, list(inputs))
        captured.graph.replay()
        for p, g in zip(self.params, captured.grads, strict=True):
            p.grad = g
        self.num_replays += 1
        return captured.outputs

    def _capture_failed(self, error: Exception) -> None:
        self.failed = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        for p in self.params:  # what the warm-up or the aborted capture left
            p.grad = None
        logger.warning(
            "%s: capturing %s failed (%s); its pass runs eagerly from here, the graphs captured so far still "
            "replay — set it to false to skip the attempt",
            self.key_name,
            self.what,
            self.failed,
        )

    def _new_graph(self, key: tuple, inputs: Sequence[torch.Tensor], step: Step) -> _Captured:
        static = [t.detach().clone() for t in inputs]
        shared = self._shared_grads
        reached: set[int] = set()  # the parameters the captured backward gives a gradient

        def attached(ts: Sequence[torch.Tensor]) -> Sequence[torch.Tensor]:
            """The first graph allocates the gradients; a later one writes into the same tensors (zeroed at
            its start, then accumulated in place by the backward), so the graphs hold one set between them."""
            reached.clear()  # the warm-up's run, then the capture's
            if shared is not None:
                for p, g in zip(self.params, shared, strict=True):
                    p.grad = g
                written = [g for g in shared if g is not None]
                if written:  # a forward-only step (no parameters) has none
                    torch._foreach_zero_(written)
            return step(ts)

        # a parameter this step does not reach keeps the attached (zeroed) tensor: no gradient, as eagerly
        hooks = [
            p.register_post_accumulate_grad_hook(lambda _, i=i: reached.add(i))
            for i, p in enumerate(self.params)
        ]
        try:
            graph, outputs = self._capture(attached, static, self.params, pool=self.pool)
        finally:
            for h in hooks:
                h.remove()
        if self.pool is None:
            self.pool = getattr(graph, "pool", lambda: None)()
        grads = [p.grad if i in reached else None for i, p in enumerate(self.params)]
        if shared is None:
            self._shared_grads = grads
        for p in self.params:
            p.grad = None
        captured = _Captured(graph, static, list(outputs), grads)
        self._graphs[key] = captured
        logger.info(
            "%s captured as CUDA graph %d of at most %d", self.what, len(self._graphs), self.max_graphs
        )
        return captured


def cleared_on_retry(attempt: Callable[[Any], T], *graphs: MicroGraphs | None) -> Callable[[Any], T]:
    """``attempt`` for :meth:`klppo.roles.oom.OOMRecovery.run` with ``graphs`` cleared before every call but
    the first: a retry after out of memory runs halved micro-batches, whose shapes are new, and the graphs of
    the
    old ones would hold their pool (and their slots of ``max_graphs``) for the run."""
    calls = 0

    def run(micro: Any) -> T:
        nonlocal calls
        if calls:
            for g in graphs:
                if g is not None:
                    g.clear()
        calls += 1
        return attempt(micro)

    return run


def capture_cuda(
    step: Step, static: list[torch.Tensor], params: Sequence[torch.nn.Parameter], *, pool: Any = None
) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """One warm-up of ``step`` on a side stream (its gradients dropped), then its capture into a CUDA graph
    that shares ``pool`` (None: a new pool); returns the graph and its static outputs. Nothing is computed
    by the capture itself: the caller replays it."""
    device = static[0].device
    current = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(current)
    with torch.cuda.stream(side):
        step(static)
    current.wait_stream(side)
    for p in params:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = list(step(static))
    return graph, outputs
