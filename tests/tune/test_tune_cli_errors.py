"""`klppo tune` with ordinary mistakes: one line on stderr and exit 2, naming the key or option."""

from __future__ import annotations

import pytest

from klppo.commands.tune import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--dry-run", "actor_rollout_ref.model.path=/nonexistent/model"],
            "actor_rollout_ref.model.path: not a model directory (config.json) nor a known shape",
        ),
        (["--dry-run", "data.foo=1"], "unknown key 'data.foo'"),
        (
            ["--dry-run", "--thresholds", "abc", "actor_rollout_ref.model.path=Qwen2.5-0.5B"],
            "--thresholds 'abc': expected comma-separated numbers",
        ),
    ],
)
def test_a_mistake_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("klppo tune: ") and message in err and "\n" not in err


def test_an_infinite_threshold_is_one_line(capsys):
    assert main(["--dry-run", "--thresholds", "inf", "actor_rollout_ref.model.path=Qwen2.5-0.5B"]) == 2
    assert capsys.readouterr().err == "klppo tune: --thresholds 'inf': expected comma-separated numbers\n"


def test_bad_grid_options_are_one_line(capsys):
    for option in ("--offload=bogus", "--thresholds=-5"):
        assert main(["--dry-run", "actor_rollout_ref.model.path=Qwen2.5-0.5B", option]) == 2
        err = capsys.readouterr().err
        assert err.startswith("klppo tune: --thresholds/--offload/--micro-tokens: ") and err.count("\n") == 1
