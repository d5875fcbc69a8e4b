"""Flags of klppo's subcommands: a mistyped flag is named with the closest known ones
(``klppo train --dryrun`` → ``unknown flag --dryrun; did you mean --dry-run?``).

``FlagParser`` is argparse's parser with that message (its subparsers too); ``unknown_flags`` and
``unknown_flag_message`` serve the commands that read their arguments by hand (`klppo train`, `klppo config`).
Only ``--long`` flags are judged; for argparse a unique prefix of a known flag counts as known, as it reads
one."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Iterable, Sequence


def unknown_flags(argv: Sequence[str], known: Iterable[str], *, prefixes: bool = False) -> list[str]:
    """The ``--flag`` words of ``argv`` (before a bare ``--``) that are not a known flag (nor, with
    ``prefixes``, a unique prefix of one); ``--flag=value`` is judged by its flag."""
    known = set(known)
    found = []
    for arg in argv:
        if arg == "--":
            break
        if not arg.startswith("--"):
            continue
        flag = arg.split("=", 1)[0]
        if flag in known or (prefixes and len([k for k in known if k.startswith(flag)]) == 1):
            continue
        found.append(flag)
    return found


def unknown_flag_message(flag: str, known: Iterable[str]) -> str:
    """``unknown flag F; did you mean G?`` (the closest), or the known flags when none is close."""
    known = sorted(set(known))
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
    if close:
        return f"unknown flag {flag}; did you mean {close[0]}?"
    return f"unknown flag {flag} (flags: {', '.join(known)})"


class FlagParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose error names each mistyped flag with the closest known ones first
    (also when argparse would first complain of a missing argument)."""

    _argv: list[str] = []

    def parse_known_args(self, args=None, namespace=None):  # noqa: ANN001, ANN201  argparse's signature
        self._argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def known_flags(self) -> set[str]:
        """This parser's ``--`` option strings and those of its subcommands."""
        flags = {s for s in self._option_string_actions if s.startswith("--")}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    flags |= sub.known_flags() if isinstance(sub, FlagParser) else set()
        return flags

    def error(self, message: str):  # noqa: ANN201  argparse's signature (NoReturn)
        known = self.known_flags()
        hints = [
            unknown_flag_message(flag, known) for flag in unknown_flags(self._argv, known, prefixes=True)
        ]
        if hints and not message.startswith("unrecognized arguments"):
            hints.append(message)
        super().error("; ".join(hints) if hints else message)
