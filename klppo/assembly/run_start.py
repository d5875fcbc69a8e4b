"""The start of a run in its directory, before any weights load: the start recorded, the resume point
chosen, a fresh start over an earlier run refused or cleared (``klppo.ops.run_records``), and a resume
compared with what its checkpoint was saved from (``klppo.ops.resume_check``), a LoRA checkpoint's base
model first. Rank 0 reads and writes; every rank gets the same answer, or raises the same error."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from klppo.config import KLPPOConfig, config_to_yaml
from klppo.ops.checkpoint import load_trainer_state, read_base_record, resolve_resume
from klppo.ops.resume_check import check_base, check_resume, run_identity
from klppo.ops.run_records import prepare_fresh_start, record_start
from klppo.parallel.collectives import all_gather_objects, rank

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class RunStart:
    resume_path: Path | None
    """The checkpoint this start continues (None: a fresh run)."""
    identity: dict[str, Any] | None
    """What this run trains (``resume_check.run_identity``), saved with each checkpoint; rank 0 only."""


def on_rank0(fn: Callable[[], T]) -> T | None:
    """``fn()`` on rank 0; what it raises is raised on every rank (its result stays on rank 0)."""
    outcome: tuple[T | None, BaseException | None] = (None, None)
    if rank() == 0:
        try:
            outcome = (fn(), None)
        except Exception as exc:  # handed to every rank, raised there
            outcome = (None, exc)
    error = all_gather_objects(outcome[1])[0]
    if error is not None:
        raise error
    return outcome[0]


def begin_run(
    cfg: KLPPOConfig, argv: list[str], *, model_path: str, tokenizer_path: str, trained: list[str]
) -> RunStart:
    """Record the start, choose the resume point and check it, before any weights load (module docstring)."""
    t = cfg.trainer
    run_dir = Path(t.default_local_dir).expanduser()
    on_rank0(lambda: record_start(run_dir, config_yaml=config_to_yaml(cfg), argv=argv))
    resume_path = resolve_resume(t.resume_mode, run_dir, t.resume_from_path, roles=trained)

    def check() -> dict[str, Any]:
        now = run_identity(
            model_path=model_path, tokenizer_path=tokenizer_path, config=dataclasses.asdict(cfg)
        )
        if resume_path is None:
            prepare_fresh_start(run_dir, policy=t.run_dir_exists, resume_mode=t.resume_mode)
        else:
            base = read_base_record(resume_path / "actor")
            if base is not None:  # adapters only: the base they apply to comes from the model path
                check_base(base, now["model"], checkpoint=resume_path)
            saved = load_trainer_state(resume_path).get("identity")
            check_resume(saved, now, checkpoint=resume_path, allow=t.allow_resume_changes)
        return now

    return RunStart(resume_path=resume_path, identity=on_rank0(check))
