"""What `klppo train` checks before it starts a process or loads a weight. Every check runs and every problem
is kept, so that one invocation (its ``--dry-run`` too) names them all; the caller then exits 2.

1. the configuration: the caller loads it keeping each bad key or value of the YAML file and of the
   command line (``load_config(..., skipped=...)``: the rest loads without it) and hands those problems
   in; here, what train cannot honour (``check_trainable``);
2. the machine (device, processes per node) and the per-rank sizes for that many processes;
3. the model path, the logger backends, text-only data, the multi-turn tool and interaction configs, the
   checkpoint to resume from;
4. the model's heads against each Ulysses size and a Megatron launch's memory per GPU, on a GPU the memory
   model's forecast of the GPU and the host, the run directory and one checkpoint's disk space (they read
   the model's config);
5. the prompt data (it reads the model's tokenizer) and the run directory's files.

A check that needs what a failed one would give (the data check needs the model path's tokenizer) is left
out, to be judged on the next run. A configuration that does not load at all (an unreadable file, a rule
across keys broken) ends the checks before this module: every check here reads it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from klppo.assembly.data_check import check_data_at_startup
from klppo.assembly.layout_checks import check_layout
from klppo.assembly.memory_check import check_memory_fit
from klppo.assembly.startup_checks import (
    check_disk,
    check_interaction_config,
    check_loggers,
    check_resume,
    check_text_only,
    check_tool_config,
    nothing_left_to_train,
)
from klppo.config import ConfigError, KLPPOConfig, check_trainable, derive_sizes
from klppo.models.loading import model_dir
from klppo.tracking.run_dir import claim_run_files

PROBLEMS = (ValueError, FileNotFoundError, ImportError)
"""What a check raises for a problem of the user's (ConfigError, DataError, ModelLoadError and RunDirError
are ValueErrors); anything else is a bug, and keeps its traceback."""


@dataclasses.dataclass
class Startup:
    """What the checks found: the configuration and machine, the plan's lines, the prompt loaders by split,
    the problems (one line each), and ``finished`` (the sentence when the run has nothing left to train)."""

    cfg: KLPPOConfig
    device: torch.device | None = None
    nproc: int = 1
    model_path: str | None = None
    plan: list[str] = dataclasses.field(default_factory=list)
    loaders: dict[str, Any] = dataclasses.field(default_factory=dict)
    problems: list[str] = dataclasses.field(default_factory=list)
    finished: str | None = None

    def check(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(...)``, or None with its problem kept (once: the data check meets a bad tool config again)."""
        try:
            return fn(*args, **kwargs)
        except PROBLEMS as exc:
            if str(exc) not in self.problems:
                self.problems.append(str(exc))
            return None


def resolve_machine(cfg: KLPPOConfig) -> tuple[torch.device, int]:
    """(device type to use, processes per node); checks what this machine has, before any model loads."""
    want = cfg.trainer.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    if want == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device=cuda but no CUDA device is visible; use trainer.device=cpu or auto")
    nproc = cfg.trainer.n_gpus_per_node
    if nproc in (None, "auto"):
        nproc = torch.cuda.device_count() if want == "cuda" else 1
    nproc = int(nproc)
    if want == "cuda" and nproc > torch.cuda.device_count():
        raise ConfigError(
            f"trainer.n_gpus_per_node={nproc} but this machine has {torch.cuda.device_count()} visible GPU(s)"
        )
    return torch.device(want), nproc


def check_startup(
    cfg: KLPPOConfig, *, problems: list[str], check_files: bool = True, notify: Any = None
) -> Startup:
    """Every check above on a loaded configuration, after the ``problems`` its loading found.
    ``check_files``: the prompt data, the run directory's files and whether anything is left to train
    (off for the ranks a checked `klppo train` starts); ``notify``: where configuration notes go."""
    found = Startup(cfg=cfg, problems=list(problems))
    found.check(check_trainable, cfg, notify)
    machine = found.check(resolve_machine, cfg)
    if machine is not None:
        found.device, found.nproc = machine
        found.check(derive_sizes, cfg, found.nproc * cfg.trainer.nnodes)
    # a .gguf file → its cached Hugging Face directory (converted once), before any process starts
    found.model_path = found.check(
        model_dir, cfg.actor_rollout_ref.model.path, key="actor_rollout_ref.model.path"
    )
    found.check(check_loggers, cfg)
    found.check(check_text_only, cfg)
    found.check(check_tool_config, cfg)
    found.check(check_interaction_config, cfg)
    found.check(check_resume, cfg)
    if found.model_path is not None:
        found.check(check_layout, cfg, found.model_path)  # Ulysses heads; a Megatron layout's memory
        if check_files and found.device is not None and found.device.type == "cuda":
            found.check(check_memory_fit, cfg, found.model_path, nproc=found.nproc)
        ranks = found.nproc * cfg.trainer.nnodes
        found.plan += filter(None, [found.check(check_disk, cfg, found.model_path, ranks=ranks)])
    if check_files:
        if found.model_path is not None:
            found.loaders = found.check(check_data_at_startup, cfg, found.model_path) or {}
        found.check(claim_run_files, Path(cfg.trainer.default_local_dir).expanduser(), record=False)
        if "train" in found.loaders and not found.problems:
            found.finished = nothing_left_to_train(cfg, len(found.loaders["train"]))
    return found
