"""Two spawned processes kept for the test session (the ``rank_pool`` fixture of tests/conftest.py): the
multi-process checks run their rank programs in them instead of starting new processes each time, which
on a 2-core machine spend most of a gloo test importing torch, transformers and klppo again.

A task is ``fn(rank, *args)`` run on ranks 0..nprocs-1 (a module-level function, imported by name in the
ranks); each task starts and tears down its own process group, as a freshly spawned rank would, and runs
with the environment it started with (what the task set is undone). Any rank raising, dying or running past
the timeout fails the test with every rank's traceback, and the processes are replaced (a rank left waiting
in a collective is not reused)."""

from __future__ import annotations

import importlib
import os
import queue
import sys
import time
import traceback
from pathlib import Path

import torch.multiprocessing as mp


def _serve(rank: int, tasks, results) -> None:
    while True:
        task = tasks.get()
        if task is None:
            return
        root, module, name, args = task
        if root not in sys.path:
            sys.path.insert(0, root)
        saved = dict(os.environ)
        try:
            fn = getattr(importlib.import_module(module), name)
            results.put((rank, True, fn(rank, *args)))
        except BaseException:  # noqa: B036  reported to the test, the rank stays for the next task
            results.put((rank, False, traceback.format_exc()))
        finally:
            os.environ.clear()
            os.environ.update(saved)


class RankPool:
    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.procs: list = []

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        self.tasks = [ctx.Queue() for _ in range(self.size)]
        self.results = ctx.Queue()
        # not daemonic: a rank may start processes of its own (background reward scorers)
        self.procs = [
            ctx.Process(target=_serve, args=(r, self.tasks[r], self.results)) for r in range(self.size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, *args, nprocs: int | None = None, timeout: float = 300.0) -> list:
        """``fn(rank, *args)`` on ranks 0..nprocs-1 (all by default); their return values in rank order."""
        nprocs = self.size if nprocs is None else nprocs
        if not self.procs:
            self._start()
        module = fn.__module__
        root = str(Path(sys.modules[module].__file__).resolve().parents[module.count(".")])
        for r in range(nprocs):
            self.tasks[r].put((root, module, fn.__name__, args))
        got: dict[int, tuple[bool, object]] = {}
        deadline, why = time.monotonic() + timeout, ""
        while len(got) < nprocs and not why:
            try:
                rank, ok, value = self.results.get(timeout=1.0)
                got[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            dead = [r for r in range(nprocs) if r not in got and not self.procs[r].is_alive()]
            if dead:
                why = f"ranks {dead} died"
            elif any(not ok for ok, _ in got.values()):
                why = "a rank failed, the others did not finish"
            elif time.monotonic() > deadline:
                why = f"no result in {timeout:g} s"
        failures = "\n".join(f"--- rank {r}:\n{v}" for r, (ok, v) in sorted(got.items()) if not ok)
        if why or failures:
            self.close()  # a rank may be left inside a collective: not reused
            raise AssertionError(f"{module}.{fn.__name__}: {why or 'failed'}\n{failures}")
        return [got[r][1] for r in range(nprocs)]

    def close(self) -> None:
        for p, q in zip(self.procs, self.tasks):
            if p.is_alive():
                q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []
