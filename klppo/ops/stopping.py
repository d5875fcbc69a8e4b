"""Stopping on request, agreed by every rank: SIGTERM/SIGINT to a rank, or the launcher's stop file
(``KLPPO_STOP_FILE``, created by `klppo train` when it is signalled; see ``klppo.parallel.launch``).

A rank only *asks*: :meth:`StopRequest.agreed`, called once at the end of every step by every rank, is one
all-reduce (max) of the ranks' flags, so all ranks decide to stop after the same step and save the same
checkpoint together, even when the signal reached them in different steps (or only one of them). A second
signal to a rank aborts it at once (``KeyboardInterrupt``).
"""

from __future__ import annotations

import logging
import os
import signal

from klppo.parallel.collectives import all_reduce_max_values, world_size
from klppo.parallel.launch import STOP_FILE_ENV

log = logging.getLogger("klppo")


class StopRequest:
    """This rank's stop flag, its signal handlers, and the per-step agreement."""

    def __init__(self) -> None:
        self.requested = False
        self.stop_file = os.environ.get(STOP_FILE_ENV)
        self._previous: dict = {}

    def _on_signal(self, signum, _frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        log.warning(
            "received %s: finishing the current step, then saving a checkpoint and exiting "
            "(send again to abort now)",
            signal.Signals(signum).name,
        )

    def install(self) -> None:
        """SIGTERM/SIGINT set the flag (main thread only; elsewhere, e.g. a test runner thread, nothing)."""
        try:
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._on_signal)
        except ValueError:
            pass

    def restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def local(self) -> bool:
        """This rank's wish: a signal received, or the launcher's stop file present."""
        if not self.requested and self.stop_file and os.path.exists(self.stop_file):
            self.requested = True
            log.warning("the launcher was asked to stop: finishing this step, then saving a checkpoint")
        return self.requested

    def agreed(self) -> bool:
        """Collective (every rank, once per step): True on every rank when any rank wants to stop."""
        wish = self.local()
        if world_size() == 1:
            return wish
        agreed = all_reduce_max_values([1.0 if wish else 0.0])[0] > 0
        self.requested = self.requested or agreed
        return agreed
