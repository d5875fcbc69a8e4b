"""Scoring in a worker process while the step goes on (verl's ``reward_model.launch_reward_fn_async``).

The reward function (a built-in scorer or the user's ``custom_reward_function``) and the decoding of the
responses run in spawned processes: ``reward_model.num_workers`` per rank (default 1), each given a
contiguous slice of the rank's rows (a batched ``compute_score``, ``reward_manager=batch``, is allowed one
process only, so that it sees the whole batch as in the step: ``klppo train`` refuses more). The trainer
hands it a batch's response token ids right after
generation and collects the scores at its reward phase, so the scoring overlaps the old-log-prob,
reference and value passes. A process, not a thread: a Python reward function would hold the GIL against the
trainer's own host work, and functions that time themselves out with ``signal.alarm`` (common in math
verifiers) work only in a process's main thread.

The worker builds its own :class:`~klppo.rewards.RewardManager` from the same arguments (a user's function
loaded from its file cannot be pickled across), and receives the tokenizer once, at start. Spawned, not
forked: the trainer has CUDA state a fork would copy.

Lifetime: the workers live as long as the trainer process, whatever signals arrive. SIGINT and SIGTERM do
nothing to them (a Ctrl-C or a scheduler's SIGTERM to the whole process group must not take them down in the
middle of the step the trainer is finishing before it saves): a Python handler that does nothing, not
``SIG_IGN``, which a process the reward function starts (a sandbox, a verifier) would inherit through
``exec`` and then could not be stopped with ``terminate()``; the kernel kills them when the trainer process
ends (``PR_SET_PDEATHSIG`` on Linux, whatever the worker is doing; elsewhere a thread polls the parent, which
a
function holding the GIL can delay), and :meth:`ScoringWorker.close` kills them at the end of ``fit`` —
without waiting for a batch still being scored after a failed or interrupted step. If a worker dies (killed,
out of memory, a crash in the function's native code), the step scores in the trainer and so does every
later step (:meth:`ScoringWorker.mark_broken`, one warning): the run goes on.

Scorers added with :func:`~klppo.rewards.registry.register_scorer` in the trainer's process are sent to the
workers at start (by reference: functions defined at a module's top level; one that does not load there —
defined under ``if __name__ == "__main__":`` — makes the first batch score in the step, with a warning
naming the error). Each batch's slices are scored with the torch, ``random`` and NumPy generators seeded
from the step's sampling seed and the slice (:func:`slice_seed`), so a reward function that draws random
numbers scores the same in a repeated or resumed run (not the same draws as in the step, whose generators
are the trainer's). Processes the function starts get the default SIGINT/SIGTERM (``terminate()`` stops
them; in the step a forked child would inherit the trainer's own stop handler instead).

What the function raises reaches the trainer's reward phase as
:class:`klppo.rewards.registry.RewardFunctionError`, one line naming the function, the batch row and the
exception (raised in the scoring process by :meth:`RewardManager.score`); anything else that fails there
reaches it as itself when it pickles, else as this module's :class:`RewardFunctionError` carrying its type,
message and traceback text.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import random
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import torch

from klppo.rewards import RewardManager, registry
from klppo.rewards.registry import BUILTIN_SCORERS, SCORERS
from klppo.roles.decoding import decode_batch

KEY = "reward_model.launch_reward_fn_async"
log = logging.getLogger("klppo")

_manager: RewardManager | None = None  # the worker process's own, set by _start_worker
_tokenizer: Any = None
_start_error: str | None = None  # why _start_worker could not set the process up
_progress: Any = None  # shared with the trainer: the row each slice is scoring (ScoringWorker.row_of)


class RewardFunctionError(registry.RewardFunctionError):
    """What failed in a scoring process, when that exception itself does not pickle (a
    :class:`klppo.rewards.registry.RewardFunctionError`: the trainer ends the run on it with one line)."""


def _start_worker(
    manager_kwargs: dict[str, Any],
    tokenizer: Any,
    parent: int,
    scorers: bytes | None = None,
    progress: Any = None,
) -> None:
    global _manager, _tokenizer, _start_error, _progress
    _progress = progress
    for sig in (signal.SIGINT, signal.SIGTERM):  # not SIG_IGN: exec'd children would inherit it
        signal.signal(sig, _ignore_signal)
    os.register_at_fork(after_in_child=_default_signals)  # and forked ones the handler
    if not _die_with_parent():
        threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent ended before the line above took effect
        os._exit(0)
    try:  # what fails here is said at the first batch (WorkerStartError), not lost with the process
        SCORERS.update(pickle.loads(scorers) if scorers else {})  # before the manager, which checks kwargs
        _manager, _tokenizer = RewardManager(**manager_kwargs), tokenizer
    except Exception as exc:
        _start_error = f"{type(exc).__qualname__}: {exc}"


def _ignore_signal(signum: int, frame: Any) -> None:
    """SIGINT/SIGTERM in a scoring process: nothing (module docstring, "Lifetime")."""


def _default_signals() -> None:
    """In a process the reward function forks: SIGINT/SIGTERM act as usual again."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


class WorkerStartError(RuntimeError):
    """The scoring process could not set itself up (a registered scorer that does not load there, …)."""


def slice_seed(seed: int, index: int) -> int:
    """Slice ``index``'s seed from a batch's ``seed``: hashed, so that no slice of one rank or step meets
    another's (``seed + index`` would: the sampling seeds of neighbouring ranks differ by 1)."""
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def registered_scorers(*, required: bool = True) -> bytes:
    """The scorers the trainer's process registered beyond the built-in table, pickled for the workers
    (loaded inside :func:`_start_worker`, where a failure is caught); ValueError naming the data source and
    the key when one cannot be pickled (a lambda, a local function) and ``required`` (no user function
    replaces the table), else that one is left out with a note."""
    added = {k: fn for k, fn in SCORERS.items() if BUILTIN_SCORERS.get(k) is not fn}
    for source, fn in list(added.items()):
        try:
            pickle.dumps(fn)
        except Exception as why:
            if not required:  # a user's function that calls get_scorer() would miss it in the worker
                log.info(
                    "%s=True: the scorer registered for data_source %r is not sent to the scoring "
                    "process (%s)",
                    KEY,
                    source,
                    why,
                )
                del added[source]
                continue
            raise ValueError(
                f"{KEY}=True: the scorer registered for data_source {source!r} ({fn!r}) cannot be sent to "
                "the "
                f"scoring process ({why}); register a function defined at a module's top level, or set "
                f"{KEY}=False"
            ) from None
    return pickle.dumps(added)


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy  # noqa: PLC0415  optional here: seeded where installed

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass


def _die_with_parent() -> bool:
    """Linux: the kernel sends this process SIGKILL when its parent ends (``prctl(PR_SET_PDEATHSIG)``;
    strictly, when the parent's thread that started it ends: the trainer's main thread, which submits every
    batch)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, signal.SIGKILL, 0, 0, 0) == 0  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def _exit_with_parent(parent: int, poll_s: float = 0.5) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    os._exit(0)


def _pid() -> int:
    return os.getpid()


def _score(
    rows: list[list[int]],
    data_sources: list,
    ground_truths: list,
    extra_infos: list,
    lengths: list[int],
    seed: int | None = None,
    first_row: int = 0,
    slot: int = 0,
) -> tuple[list[float], list[str]]:
    """In the worker: decode ``rows`` (response token ids, padding cut; the batch's rows from
    ``first_row``) and score them (the generators seeded with ``seed`` first, when given); each row is
    reported in ``_progress[slot]`` before it is scored."""
    if _start_error is not None:
        raise WorkerStartError(f"the scoring process could not start: {_start_error}")
    if _progress is not None:
        _progress[slot] = first_row
        _manager.on_row = lambda row: _progress.__setitem__(slot, row)
    if seed is not None:
        _seed_all(seed)
    texts = decode_batch(_tokenizer, rows)
    try:
        return _manager.score(
            texts, data_sources, ground_truths, extra_infos, lengths, first_row=first_row
        ), texts
    except Exception as exc:
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception as why:
            detail = "".join(traceback.format_exception(exc))
            raise RewardFunctionError(
                f"{type(exc).__qualname__}: {exc}\n(raised as RewardFunctionError: it does not pickle: "
                f"{why!r})\n{detail}"
            ) from None
        raise


def slices(num_rows: int, num_parts: int) -> list[tuple[int, int]]:
    """``num_rows`` rows cut into at most ``num_parts`` contiguous (start, end) slices of sizes differing by
    at most one (none empty; one empty slice for no rows, so that every batch gets a result)."""
    parts = max(1, min(num_parts, num_rows))
    base, extra = divmod(num_rows, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (i < extra))
    return list(zip(bounds[:-1], bounds[1:]))


class ScoringWorker:
    """One spawned process that decodes and scores batches in the background; started at once (its imports
    and the user's module load overlap the trainer's set-up), shut down by :meth:`close`."""

    def __init__(self, tokenizer: Any, manager_kwargs: dict[str, Any], num_workers: int = 1) -> None:
        self.num_workers = num_workers
        context = multiprocessing.get_context("spawn")
        self._progress = context.RawArray("q", num_workers)  # the row each slice is scoring
        self._pool: ProcessPoolExecutor | None = ProcessPoolExecutor(
            max_workers=num_workers,
            mp_context=context,
            initializer=_start_worker,
            # with a user's function the table is read only if that function calls get_scorer()
            initargs=(
                manager_kwargs,
                tokenizer,
                os.getpid(),
                registered_scorers(required=not manager_kwargs.get("custom_fn_path")),
                self._progress,
            ),
        )
        # one task per worker while none is idle yet: all of them start now (a spawn pool starts them on
        # demand), so their imports overlap the set-up, not step 1
        self.pids = [self._pool.submit(_pid) for _ in range(num_workers)]
        # kept here: the pool forgets its processes once it finds one dead (their exit codes are wanted then)
        self._spawned = list((getattr(self._pool, "_processes", None) or {}).values())

    @property
    def alive(self) -> bool:
        return self._pool is not None

    def submit(
        self,
        rows: list[list[int]],
        data_sources: list,
        ground_truths: list,
        extra_infos: list,
        lengths: list[int],
        seed: int | None = None,
    ) -> list[Future] | None:
        """Score in the background: one future of ``(scores, texts)`` (or of what the function raised) per
        contiguous slice of the rows, in row order, slice ``i`` with the generators seeded
        ``slice_seed(seed, i)``; None when the workers are gone (then the caller scores in the step)."""
        if self._pool is None:
            return None
        futures = []
        try:
            for i, (lo, hi) in enumerate(slices(len(rows), self.num_workers)):
                args = (
                    rows[lo:hi],
                    data_sources[lo:hi],
                    ground_truths[lo:hi],
                    extra_infos[lo:hi],
                    lengths[lo:hi],
                    None if seed is None else slice_seed(seed, i),
                    lo,
                    i,
                )
                futures.append(self._pool.submit(_score, *args))
        except BrokenProcessPool as exc:
            self.mark_broken(exc)
            return None
        return futures

    def row_of(self, slot: int) -> int:
        """The batch row that slice ``slot`` is scoring (or last scored)."""
        return int(self._progress[slot])

    def mark_broken(self, exc: BaseException) -> None:
        """The process died or could not start: say so once; from now on every step scores in the trainer."""
        if self._pool is None:
            return
        if isinstance(exc, WorkerStartError):
            log.warning("%s=True: %s; this step and the following ones score in the trainer", KEY, exc)
            self._stop()
            return
        codes = sorted({p.exitcode for p in self._processes() if p.exitcode is not None})
        why = f"exit code {', '.join(map(str, codes))}" if codes else str(exc)
        if -signal.SIGKILL in codes:
            why += ": killed (the out-of-memory killer?)"
        log.warning(
            "%s=True: a scoring process stopped (%s); this step and the following ones score in the "
            "trainer. If the reward function crashed the interpreter, set %s=False to see its error.",
            KEY,
            why,
            KEY,
        )
        self._stop()

    def close(self) -> None:
        """End the workers now: nothing is pending after a finished step, and a batch still being scored
        after a failed or interrupted one (a hung verifier) is not waited for."""
        if self._pool is not None:
            self._stop()

    def _processes(self) -> list:
        """The worker processes: those started with the pool, and any it started since."""
        current = list((getattr(self._pool, "_processes", None) or {}).values())
        return self._spawned + [p for p in current if p not in self._spawned]

    def _stop(self) -> None:
        processes, pool, self._pool = self._processes(), self._pool, None
        pool.shutdown(wait=False, cancel_futures=True)
        for p in processes:
            # the sentinel is readable once the process has exited, whoever reaped it (is_alive() cannot
            # tell where SIGCHLD is ignored, and the pid may then belong to another process)
            if not multiprocessing.connection.wait([p.sentinel], 0):
                p.kill()
        for p in processes:
            p.join(timeout=5)
