"""`klppo train` and `python -m klppo.trainer.main_ppo` (verl's entry-point name): the same arguments as
verl — an optional YAML file and dotted overrides. With no arguments at all, the embedded quickstart."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from klppo.commands import quickstart
from klppo.config import ConfigError, KLPPOConfig, load_config, warn_unimplemented
from klppo.config.flags import unknown_flag_message, unknown_flags
from klppo.config.loader import CONFIG_FLAGS
from klppo.ops.failures import report_failure
from klppo.ops.run_lock import HELD_ENV, RunLock, RunLockError, register_rank, should_lock
from klppo.parallel import dist
from klppo.parallel.launch import maybe_relaunch, record_errors

if TYPE_CHECKING:
    from klppo.commands.startup import Startup

log = logging.getLogger("klppo")


def _setup_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level, format="%(asctime)s klppo %(levelname)s: %(message)s", datefmt="%H:%M:%S"
    )


USAGE = """usage: klppo train [--dry-run] [config.yaml] [key=value ...]
       klppo train [--dry-run] --quickstart {cpu,gpu} [key=value ...]
       python -m klppo.trainer.main_ppo [config.yaml] [key=value ...]

--dry-run: check everything, print the plan (processes, per-rank sizes, roles, predicted
  memory), train nothing.
--quickstart: the embedded quickstart's recipe, chosen explicitly (overrides apply on top of it).

KL-regularized PPO with verl's configuration keys (dotted overrides, e.g. data.train_batch_size=512
actor_rollout_ref.rollout.n=4). With no arguments: the embedded quickstart (SmolLM2-135M-Instruct on a
built-in arithmetic set): on a GPU the learning recipe, on a CPU a short demo. `klppo config ...`
prints the resolved configuration without training.
Every key: docs/configuration.md; the run directory, checkpoints and failures: docs/training.md."""


STARTUP_CHECKED_ENV = "KLPPO_STARTUP_CHECKED"  # set for the ranks a checked `klppo train` starts
FLAGS = ("--dry-run", "--quickstart", "--help", *CONFIG_FLAGS)


def report_problems(problems: list[str]) -> None:
    """One problem: ``klppo: <it>``; several: a count, then one numbered line each (stderr)."""
    if len(problems) == 1:
        print(f"klppo: {problems[0]}", file=sys.stderr)
        return
    lines = [f"klppo: {len(problems)} problems, nothing started:"]
    lines += [f"  {i}. {problem}" for i, problem in enumerate(problems, start=1)]
    print("\n".join(lines), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if bad := unknown_flags(argv, FLAGS):
        report_problems([unknown_flag_message(flag, FLAGS) for flag in bad])
        return 2
    dry = "--dry-run" in argv
    argv = [a for a in argv if a != "--dry-run"]
    _setup_logging()
    recipe = None
    try:
        name, argv = _pop_option(argv, "--quickstart")
        if name is not None or not argv:
            recipe = quickstart.choose(name)
            print(recipe.about, flush=True)
            argv = quickstart.quickstart_argv(recipe) + argv
    except ValueError as exc:
        report_problems([str(exc)])
        return 2
    rank_of_checked_run = os.environ.get(STARTUP_CHECKED_ENV) == "1"  # its launcher checked and said all
    notify = (lambda _note: None) if rank_of_checked_run else None
    skipped: list[ConfigError] = []
    try:  # every bad key or value kept, the rest loaded
        cfg = load_config(argv, notify=notify, skipped=skipped)
    except ConfigError as exc:
        report_problems([*map(str, skipped), str(exc)])
        return 2
    from klppo.commands import plan, startup  # noqa: PLC0415  heavy (transformers, pyarrow, tune): not for a bad file

    found = startup.check_startup(
        cfg, problems=[*map(str, skipped)], check_files=not rank_of_checked_run, notify=notify
    )
    if found.problems:
        report_problems(found.problems)
        return 2
    if dry:
        warn_unimplemented(cfg)
        return plan.dry_run(found)
    code = _train(found, argv=argv)
    if recipe is not None and recipe.name == "cpu" and code == 0:
        print("\n".join(quickstart.next_steps(cfg)))
    return code


def _train(found: Startup, *, argv: list[str]) -> int:
    """Once every start-up check passed: say what they found, lock the run directory, train (this process
    or the ranks it starts). A run with nothing left to train says so instead, before any weight loads."""
    cfg = found.cfg
    if found.finished is not None:
        print(f"klppo: {found.finished}")
        return 0
    for split, loader in found.loaders.items():
        log.info("%s prompts: %s", split, loader.summary())
    lock = None
    if should_lock(cfg.trainer.nnodes):
        try:
            lock = RunLock(Path(cfg.trainer.default_local_dir).expanduser()).acquire()
        except RunLockError as exc:
            report_problems([str(exc)])
            return 2
    try:
        return _launch_or_run(cfg, device=found.device, nproc=found.nproc, argv=argv)
    finally:
        if lock is not None:
            lock.release()


@contextlib.contextmanager
def _environment(**values: str):
    """``os.environ`` with ``values`` set while inside (for the processes started there)."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _launch_or_run(cfg: KLPPOConfig, *, device: torch.device, nproc: int, argv: list[str]) -> int:
    """Start the ranks under torchrun (they inherit: data checked, run directory locked), or train here."""

    with _environment(**{STARTUP_CHECKED_ENV: "1", HELD_ENV: "1"}):
        code = maybe_relaunch(
            argv,
            nproc_per_node=nproc,
            nnodes=cfg.trainer.nnodes,
            module="klppo.commands.train",
            use_gpus=device.type == "cuda",
            stop_grace_s=float(cfg.trainer.stop_grace_s),
        )
    if code is not None:
        return code
    return record_errors(run)(cfg, device=device, argv=argv)


def _pop_option(argv: list[str], option: str) -> tuple[str | None, list[str]]:
    """(value of ``option VALUE`` or ``option=VALUE``, the other arguments); raises ValueError without a
    value."""
    rest, value, args = [], None, iter(argv)
    for arg in args:
        if arg == option:
            value = next(args, None)
            if value is None:
                raise ValueError(f"{option} needs a value")
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return value, rest


def run(cfg: KLPPOConfig, *, device: torch.device, argv: list[str]) -> int:
    """Train on this rank (already inside the right process layout)."""
    from klppo.assembly.setup import build_run  # noqa: PLC0415  heavy (transformers, models): ranks only
    from klppo.trainer.finish import finish_run  # noqa: PLC0415  heavy (torch.distributed.checkpoint): ranks only
    from klppo.trainer.ppo_trainer import PPOTrainer  # noqa: PLC0415  heavy (models, rollout): ranks only

    info = dist.init_distributed(device.type, float(cfg.trainer.collective_timeout_s))
    if info.rank == 0:
        warn_unimplemented(cfg)
    start = time.perf_counter()
    run_dir = Path(cfg.trainer.default_local_dir).expanduser()
    try:
        register_rank(run_dir, info.rank)  # the run lock proves the run dead only with every rank's process
        built = build_run(cfg, device=info.device, argv=argv)
        PPOTrainer(built).fit()
        # every rank done before any tears its process group down (a rank leaving while a peer still
        # talks to it aborted at exit: "terminate called without an active exception")
        dist.barrier()
        if info.rank == 0:
            history = built.trackers.metrics.history
            finish_run(built.run_dir, history=history, wall_s=time.perf_counter() - start)
        return 0
    except (Exception, KeyboardInterrupt) as exc:  # one line, the traceback in the run directory
        return report_failure(exc, run_dir=run_dir, rank=info.rank, world_size=info.world_size)
    finally:
        dist.destroy()


def _exit_rank(code: int) -> None:
    """End a torchrun rank after its work is done and its files are closed. Static C++ teardown at
    interpreter exit (c10d/gloo background threads) aborted about 1 in 12 finished CPU ranks with
    "terminate called without an active exception", turning a completed run into a failed job; a rank
    under torchrun therefore leaves with ``os._exit`` once everything is flushed."""
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        sys.exit(code)
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    _exit_rank(main())
