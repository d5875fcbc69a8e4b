"""A mistyped flag of any subcommand is named with the closest known one (`klppo train --dryrun` → did you
mean --dry-run?), and `load_config(..., skipped=...)` keeps every bad key or value instead of stopping at
the first, so that `klppo train` can name them all."""

from __future__ import annotations

import pytest

from klppo.cli import main as klppo_main
from klppo.config import ConfigError, load_config
from klppo.config.flags import FlagParser, unknown_flag_message, unknown_flags


def test_unknown_flags_and_their_closest_names():
    known = ["--dry-run", "--quickstart", "--help"]
    assert unknown_flags(["--dry-run", "--quickstart=cpu", "a=--dryrun", "--", "--anything"], known) == []
    assert unknown_flags(["--dryrun", "x.yaml", "--quickstrat", "cpu"], known) == ["--dryrun", "--quickstrat"]
    assert unknown_flags(["--quick=cpu"], known) == ["--quick"]  # read by hand: whole flags only
    assert unknown_flags(["--quick=cpu"], known, prefixes=True) == []  # argparse reads a unique prefix
    assert unknown_flags(["--d"], ["--dry-run", "--dtype"], prefixes=True) == ["--d"]  # a prefix of two
    assert unknown_flag_message("--dryrun", known) == "unknown flag --dryrun; did you mean --dry-run?"
    assert (
        unknown_flag_message("--zzz", known) == "unknown flag --zzz (flags: --dry-run, --help, --quickstart)"
    )


def test_argparse_commands_suggest_before_other_errors(capsys):
    parser = FlagParser(prog="klppo data")
    sub = parser.add_subparsers(dest="dataset", required=True)
    sub.add_parser("arithmetic").add_argument("--output", required=True)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["arithmetic", "--outptu", "dir"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert (
        "unknown flag --outptu; did you mean --output?; the following arguments are required: --output" in err
    )


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["train", "--dryrun"], "klppo: unknown flag --dryrun; did you mean --dry-run?"),
        (
            ["config", "--config-nam=x"],
            "klppo config: error: unknown flag --config-nam; did you mean --config-name?",
        ),
        (["export", "a", "b", "--overwite"], "unknown flag --overwite; did you mean --overwrite?"),
        (["report", "--dpii", "3"], "unknown flag --dpii; did you mean --dpi?"),
        (["data", "arithmetic", "--num-trian", "3"], "unknown flag --num-trian; did you mean --num-train?"),
        (["tune", "--dryrun"], "unknown flag --dryrun; did you mean --dry-run?"),
    ],
)
def test_every_subcommand_suggests_the_flag(argv, hint, capsys):
    try:
        code = klppo_main(argv)
    except SystemExit as exc:  # argparse's exit
        code = exc.code
    assert code == 2
    assert hint in capsys.readouterr().err


def test_load_config_collects_the_bad_keys_and_values():
    argv = ["data.train_batch_sise=4", "actor_rollout_ref.rollout.n=two", "data.train_batch_size=512", "=x"]
    skipped: list[ConfigError] = []
    cfg = load_config(argv, skipped=skipped, notify=lambda _m: None)
    assert cfg.data.train_batch_size == 512  # the good override is applied
    messages = [str(e) for e in skipped]
    assert len(messages) == 3
    assert messages[0].startswith("'=x'")  # read first, then applied: each problem once
    assert messages[1].startswith("unknown key 'data.train_batch_sise'")
    assert messages[2].startswith("actor_rollout_ref.rollout.n='two'")
    with pytest.raises(ConfigError, match="=x"):  # without the list: the first one raises
        load_config(argv, notify=lambda _m: None)
