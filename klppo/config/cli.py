"""`klppo config [file.yaml] [key=value ...]`: print the resolved configuration as YAML.

The configuration is judged alone: types, choices, aliases, and batch sizes for the world size it names
(`trainer.n_gpus_per_node × trainer.nnodes` when n_gpus_per_node is a number, else 1). Notes (aliases,
keys accepted without effect) go to stderr, the YAML to stdout; exit 0 when valid, 2 with a one-paragraph
message when not."""

from __future__ import annotations

import sys

from klppo.config.dump import config_to_yaml
from klppo.config.errors import ConfigError
from klppo.config.flags import unknown_flag_message, unknown_flags
from klppo.config.loader import CONFIG_FLAGS, load_config
from klppo.config.sizes import config_world_size, derive_sizes
from klppo.config.unimplemented import warn_unimplemented

USAGE = """usage: klppo config [config.yaml] [key=value ...]

Print the resolved configuration (verl's ppo_trainer.yaml keys) as YAML.
Overrides use verl's dotted names, e.g. data.train_batch_size=512 actor_rollout_ref.rollout.n=4
Every key, its default and meaning: docs/configuration.md"""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    flags = (*CONFIG_FLAGS, "--help")
    if bad := unknown_flags(argv, flags):
        print(
            f"klppo config: error: {'; '.join(unknown_flag_message(f, flags) for f in bad)}", file=sys.stderr
        )
        return 2
    try:
        cfg = load_config(argv)
        derive_sizes(cfg, config_world_size(cfg))
        warn_unimplemented(cfg)
    except ConfigError as e:
        print(f"klppo config: error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(config_to_yaml(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
