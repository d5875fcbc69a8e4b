"""A CompiledFunctions whose backend records what it is asked to compile (shared by the pre-compile and
batch-of-one tests)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from klppo.rollout.compiled import CompiledFunctions


def recording_functions(
    record: Callable | None = None, compile: Callable | None = None
) -> tuple[CompiledFunctions, list]:
    """(functions, graphs): each graph handed to the backend appends ``record(gm)`` (default: its code) to
    ``graphs`` and then runs eagerly, or through ``compile(gm, example_inputs)``. Dynamo's caches are reset
    first, so every graph the test causes is seen."""
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(record(gm) if record else gm.code)
        return compile(gm, example_inputs) if compile else gm.forward

    torch._dynamo.reset()
    return CompiledFunctions(backend=backend), graphs
