"""The relaunch pattern of the multi-GPU benches: ``main`` started by hand relaunches itself under torchrun
with K ranks (its arguments passed in an environment variable as JSON, so torchrun never parses them); each
rank then runs ``ranks(args)``. With one rank (or no launcher needed) ``ranks`` runs in this process."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from klppo.parallel.launch import maybe_relaunch

ROOT = Path(__file__).resolve().parents[1]


def relaunch_main(
    module: str,
    env: str,
    parse: Callable[[list[str]], Any],
    ranks: Callable[[Any], None],
    argv: list[str],
) -> int:
    """Run ``module``'s ``ranks`` on ``args.gpus`` ranks (``args.device`` cuda: one GPU each; cpu: gloo)."""
    if env in os.environ:  # a rank started by torchrun
        ranks(parse(json.loads(os.environ[env])))
        return 0
    args = parse(argv)
    os.environ[env] = json.dumps(argv)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    try:
        code = maybe_relaunch(
            [], nproc_per_node=args.gpus, nnodes=1, module=module, use_gpus=args.device == "cuda"
        )
        if code is None:
            ranks(args)
            code = 0
    finally:
        os.environ.pop(env, None)
    return code
