"""Scoring in a worker process while the step goes on (verl's ``reward_model.launch_reward_fn_async``).

The reward function (a built-in scorer or the user's ``custom_reward_function``) and the decoding of the
responses run in one spawned process per rank. The trainer hands it a batch's response token ids right after
generation and collects the scores at its reward phase, so the scoring overlaps the old-log-prob,
reference and value passes. A process, not a thread: a Python reward function would hold the GIL against the
trainer's own host work, and functions that time themselves out with ``signal.alarm`` (common in math
verifiers) work only in a process's main thread.

The worker builds its own :class:`~klppo.rewards.RewardManager` from the same arguments (a user's function
loaded from its file cannot be pickled across), and receives the tokenizer once, at start. Spawned, not
forked: the trainer has CUDA state a fork would copy.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from klppo.rewards import RewardManager
from klppo.roles.decoding import decode_batch

KEY = "reward_model.launch_reward_fn_async"

_manager: RewardManager | None = None  # the worker process's own, set by _start_worker
_tokenizer: Any = None


def _start_worker(manager_kwargs: dict[str, Any], tokenizer: Any) -> None:
    global _manager, _tokenizer
    _manager, _tokenizer = RewardManager(**manager_kwargs), tokenizer


def _ready() -> bool:
    return _manager is not None


def _score(
    rows: list[list[int]], data_sources: list, ground_truths: list, extra_infos: list, lengths: list[int]
) -> tuple[list[float], list[str]]:
    """In the worker: decode ``rows`` (response token ids, padding cut) and score them."""
    texts = decode_batch(_tokenizer, rows)
    return _manager.score(texts, data_sources, ground_truths, extra_infos, lengths), texts


class ScoringWorker:
    """One spawned process that decodes and scores batches in the background; started at once (its imports
    and the user's module load overlap the trainer's set-up), shut down by :meth:`close`."""

    def __init__(self, tokenizer: Any, manager_kwargs: dict[str, Any]) -> None:
        self._pool = ProcessPoolExecutor(
            max_workers=1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_start_worker,
            initargs=(manager_kwargs, tokenizer),
        )
        self._started = self._pool.submit(_ready)

    def submit(
        self,
        rows: list[list[int]],
        data_sources: list,
        ground_truths: list,
        extra_infos: list,
        lengths: list[int],
    ) -> Future:
        """Score in the background; the future gives ``(scores, texts)`` or raises what the function raised."""
        try:
            return self._pool.submit(_score, rows, data_sources, ground_truths, extra_infos, lengths)
        except BrokenProcessPool as exc:
            raise RuntimeError(broken_message(exc)) from exc

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def broken_message(exc: BaseException) -> str:
    return (
        f"{KEY}=True: the scoring process stopped ({exc}); the reward function may have crashed the "
        f"interpreter or run out of memory — set {KEY}=False to score in the step and see its error"
    )
