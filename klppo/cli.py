"""`klppo` command line: dispatches to the subcommand modules (each owns its own argument parsing)."""

from __future__ import annotations

import importlib
import sys

from klppo import __version__

SUBCOMMANDS = {
    "train": ("klppo.commands.train", "Run KL-PPO training (no arguments: the embedded quickstart)."),
    "config": ("klppo.config.cli", "Print the resolved configuration as YAML."),
    "data": ("klppo.data.cli", "Prepare datasets (e.g. `klppo data gsm8k --input DIR --output DIR`)."),
    "export": ("klppo.commands.export", "Export a checkpoint to a Hugging Face directory."),
    "tune": ("klppo.commands.tune", "Choose sharding / offload / overlap settings by model and measurement."),
    "report": (
        "klppo.report.cli",
        "Draw runs' metrics into an HTML page with plots (`klppo report RUN_DIR ...`).",
    ),
}
DATA_LOG = "klppo.commands.log_data"
"""`klppo data log` (listed by `klppo data --help`)."""


def _usage() -> str:
    lines = ["usage: klppo <command> [args...]", "", "commands:"]
    lines += [f"  {name:<8} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(__version__)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"klppo: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name = SUBCOMMANDS[name][0]
    if name == "data" and rest[:1] == ["log"]:  # it loads a model and an engine: above klppo.data's layer
        module_name, rest = DATA_LOG, rest[1:]
    module = importlib.import_module(module_name)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
