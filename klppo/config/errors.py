"""`ConfigError` (what the user wrote cannot run) and `notice` (a one-line note on stderr, rank 0 only)."""

from __future__ import annotations

import os
import sys


class ConfigError(ValueError):
    """A configuration the user must fix; the message names the key, the value and what was expected.

    The CLI prints it (without a traceback) and exits with status 2.
    """


def notice(message: str) -> None:
    """Print `klppo: note: <message>` on stderr, once per process, only on rank 0 (or outside torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"klppo: note: {message}", file=sys.stderr)
