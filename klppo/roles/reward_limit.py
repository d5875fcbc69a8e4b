"""The time limit of a batch's scoring (``reward_model.timeout_s``), on every rank.

Scoring in a background process (``launch_reward_fn_async``) is stopped by killing the process
(:mod:`klppo.roles.reward_worker`). Scoring in the step runs in the trainer's main thread, where
:func:`deadline` stops it: past the limit, a watchdog thread sends the main thread ``SIGUSR2``, whose
handler raises :class:`RewardTimeoutError` inside the reward function (a ``time.sleep``, a socket wait or a
Python loop is left at once). A function stuck in native code that holds the interpreter lock runs no
handler; for it, ``faulthandler`` (a thread that needs no lock) writes every thread's stack to stderr and
ends the process ``GRACE_S`` seconds later.

The message names the rank, the batch row being scored, its data source and data row, and the key.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from klppo.rewards.registry import RewardFunctionError

KEY = "reward_model.timeout_s"
GRACE_S = 10.0


class RewardTimeoutError(RewardFunctionError):
    """A batch's scoring ran past ``reward_model.timeout_s``."""


def timeout_message(*, rank: int, timeout_s: float, what: str, where: str) -> str:
    """One line: which function, on which rank, at which sample, past which limit."""
    return (
        f"rank {rank}: {what} did not return within {KEY}={timeout_s:g} s, scoring {where}; scoring stopped. "
        f"Fix or speed up the function, or raise {KEY}"
    )


def sample_where(row: int, data_sources: list, uids: list | None) -> str:
    """``"batch row 3 (data_source 'gsm8k', file 0 row 17)"`` for a row of the batch being scored."""
    source = data_sources[row] if 0 <= row < len(data_sources) else "?"
    uid = str(uids[row]) if uids and 0 <= row < len(uids) else ""
    data = f", file {uid.replace(':', ' row ', 1)}" if ":" in uid else ""
    return f"batch row {row} (data_source {source!r}{data})"


@contextlib.contextmanager
def deadline(timeout_s: float, message: Callable[[], str]) -> Iterator[None]:
    """Raise :class:`RewardTimeoutError` (``message()``) in this thread once ``timeout_s`` have passed inside
    the block (module docstring). No limit for ``timeout_s`` ≤ 0 or outside the main thread."""
    if timeout_s <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return
    done, expired = threading.Event(), threading.Event()
    main = threading.main_thread().ident

    def on_signal(signum, frame) -> None:
        if expired.is_set() and not done.is_set():
            raise RewardTimeoutError(message())

    def watch() -> None:
        if not done.wait(timeout_s):
            expired.set()
            signal.pthread_kill(main, signal.SIGUSR2)

    previous = signal.signal(signal.SIGUSR2, on_signal)
    hard_stop = _arm_hard_stop(timeout_s + GRACE_S)
    watcher = threading.Thread(target=watch, name="klppo-reward-deadline", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        if hard_stop:
            faulthandler.cancel_dump_traceback_later()
        watcher.join()
        signal.signal(signal.SIGUSR2, previous)


def _arm_hard_stop(after_s: float) -> bool:
    """faulthandler's stacks-and-exit after ``after_s``, to stderr (the process's own where stderr is
    replaced by an object without a file descriptor); False when neither has one."""
    for stream in (sys.stderr, sys.__stderr__):
        try:
            faulthandler.dump_traceback_later(after_s, exit=True, file=stream)
            return True
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            continue
    return False
