"""CUDA-graph capture and replay of the engine's decode step, one graph per batch bucket.

:class:`DecodeGraphs` holds the captured graphs of one workspace (they point at its tensors, so they are
dropped with it) and the memory pool they share. Capturing a step: one warm-up run on a side stream
(lazy initialisations, cuBLAS workspaces) outside the capture, the state tensors and the random-number
generators the warm-up advanced restored, then the capture itself (which draws no random numbers: a
replay takes the generator's state at its start, so a call that captures and a call that replays a kept
graph sample the same noise for the same seed). Knows nothing of what the step computes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class DecodeGraphs:
    """The captured decode graphs of one workspace, by bucket, sharing one memory pool."""

    def __init__(self) -> None:
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool: object = None
        self.error: RuntimeError | None = None  # why the last fallible capture failed

    def replay(self, bucket: int) -> Callable[[], None] | None:
        """The replay of ``bucket``'s graph (None when not captured yet)."""
        graph = self.graphs.get(bucket)
        return None if graph is None else graph.replay

    def capture(
        self, bucket: int, step: Callable[[], None], state: list[torch.Tensor], *, fallible: bool
    ) -> Callable[[], None] | None:
        """Capture ``step`` as ``bucket``'s graph and return its replay. ``state``: the tensors ``step``
        updates in place (restored after the warm-up). ``fallible``: a capture's ``RuntimeError`` returns
        None (kept in ``self.error``) instead of propagating."""
        saved = [t.clone() for t in state]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # warm-up outside the capture, its random draws undone (module docstring)
        with torch.random.fork_rng(devices=[torch.cuda.current_device()]), torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip(state, saved):
            t.copy_(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        if not fallible:
            with torch.cuda.graph(graph, pool=self.pool):
                step()
        else:
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    step()
            except RuntimeError as err:
                self.error = err
                return None
        self.graphs[bucket] = graph
        return graph.replay
