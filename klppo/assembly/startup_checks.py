"""Checks `klppo train` runs before any weight loads (its `--dry-run` runs the same ones), each failure a
`ConfigError` of one line naming the key, file or phase:

- `check_loggers`: every `trainer.logger` backend is built and its package importable (a missing `wandb`
  would otherwise stop the run after the models load, when the tracker starts);
- `check_text_only`: no image or video column (`data.image_key`, `data.video_key`) and no `<image>` /
  `<video>` placeholder in a prompt — klppo trains text-only models, so a vision data set is refused
  rather than trained on its text;
- `check_run_dir`: `trainer.default_local_dir` is (or can be created) writable, and one checkpoint's size
  (weights + optimizer state of each trained role, estimated from the model config: parameters ×
  model_dtype bytes × (1 + 2 AdamW moments; LoRA trains adapters only, so 1)) fits in the free space when
  `trainer.save_freq` > 0. It returns the estimate as a line for the dry run's plan.

The model's heads against each Ulysses size and, on a Megatron launch, the memory of the translated layout
are checked by `klppo.assembly.layout_checks` (`check_layout`). The prompt data itself (missing/empty
files, columns, rows for one batch after filtering) is checked by `klppo.assembly.data_check`. Knows nothing
of the loop; reads Parquet schemas, prompt columns and model
configs, never weights.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from transformers import AutoConfig

from klppo.assembly.layout_checks import check_layout
from klppo.config import ConfigError, KLPPOConfig, total_training_steps, uses_critic
from klppo.models.flops import num_params
from klppo.models.loading import model_dir
from klppo.ops.checkpoint import (
    CheckpointError,
    checkpoint_step,
    latest_checkpoint,
    precheck_resume,
    validate_checkpoint,
)
from klppo.tracking.tracker import BACKENDS, PACKAGES
from klppo.tune.shapes import meta_model

_PLACEHOLDERS = ("<image>", "<video>")
_DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def check_loggers(cfg: KLPPOConfig) -> None:
    """ConfigError naming `trainer.logger` for a backend klppo lacks or whose package is not installed."""
    for name in cfg.trainer.logger:
        if name not in BACKENDS:
            raise ConfigError(
                f"trainer.logger includes {name!r}, which klppo does not build (built: {', '.join(BACKENDS)})"
            )
        module, pip_name = PACKAGES.get(name, (None, None))
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"trainer.logger includes {name!r} but the `{module}` package is not installed: run `pip "
                f"install {pip_name}`, or remove {name!r} from trainer.logger"
            )


def _files(value: object) -> list[str]:
    if value is None:
        return []
    return [str(value)] if isinstance(value, str) else [str(v) for v in value]  # type: ignore[union-attr]


def check_text_only(cfg: KLPPOConfig) -> None:
    """ConfigError for an image/video column or an `<image>`/`<video>` prompt in the train or val files.

    Files that are missing or not Parquet are skipped here (the data check names them)."""
    d = cfg.data
    for path in _files(d.train_files) + _files(d.val_files):
        full = os.path.expanduser(path)
        if not os.path.isfile(full):
            continue
        try:
            pf = pq.ParquetFile(full)
        except (OSError, ValueError):
            continue
        names = pf.schema_arrow.names
        for key, column in (("data.image_key", d.image_key), ("data.video_key", d.video_key)):
            if column in names:
                raise ConfigError(
                    f"{path} has a {column!r} column ({key}): image and video inputs are not built (klppo "
                    "trains text-only models); use a text data set"
                )
        if d.prompt_key in names:
            _check_prompt_placeholders(pf, path, d.prompt_key)


def _check_prompt_placeholders(pf: pq.ParquetFile, path: str, prompt_key: str) -> None:
    row = 0
    for batch in pf.iter_batches(columns=[prompt_key], batch_size=65536):
        for i, value in enumerate(batch.column(0).to_pylist()):
            text = _prompt_text(value)
            for tag in _PLACEHOLDERS:
                if tag in text:
                    raise ConfigError(
                        f"{path} row {row + i}: the prompt ({prompt_key}) holds a {tag} placeholder: image "
                        "and video inputs are not built (klppo trains text-only models)"
                    )
        row += batch.num_rows


def _prompt_text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(str(m.get("content", "")) if isinstance(m, dict) else str(m) for m in value)
    return ""


def checkpoint_bytes(cfg: KLPPOConfig, actor_config: object, critic_config: object | None) -> int:
    """Estimated bytes of one checkpoint: per trained role, parameters × model_dtype bytes × (1 + 2 AdamW
    moments), the moments over the trained parameters only (none counted with LoRA: adapters are tiny)."""
    arr = cfg.actor_rollout_ref
    total = _role_bytes(actor_config, arr.actor.fsdp_config.model_dtype, lora=arr.model.lora_rank > 0)
    if critic_config is not None:
        crit = cfg.critic
        total += _role_bytes(critic_config, crit.model.fsdp_config.model_dtype, lora=crit.model.lora_rank > 0)
    return total


def _role_bytes(model_config: object, dtype: str, *, lora: bool) -> int:
    params = num_params(meta_model(model_config))
    return params * _DTYPE_BYTES.get(dtype, 4) * (1 if lora else 3)


def check_run_dir(cfg: KLPPOConfig, actor_config: object, critic_config: object | None) -> str:
    """ConfigError naming `trainer.default_local_dir` when it cannot be written or one checkpoint would
    not fit (with `trainer.save_freq` > 0); otherwise the plan's line (estimate and free space)."""
    run_dir = Path(cfg.trainer.default_local_dir).expanduser()
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"trainer.default_local_dir={cfg.trainer.default_local_dir}: {existing} is not a writable "
            "directory"
        )
    need = checkpoint_bytes(cfg, actor_config, critic_config if uses_critic(cfg) else None)
    free = shutil.disk_usage(existing).free
    gib = 2**30
    line = f"checkpoint: about {need / gib:.2f} GiB each; {free / gib:.1f} GiB free under {existing}"
    if cfg.trainer.save_freq > 0 and free < need:
        raise ConfigError(
            f"trainer.default_local_dir={cfg.trainer.default_local_dir}: one checkpoint needs about "
            f"{need / gib:.2f} GiB but {free / gib:.2f} GiB are free under {existing} "
            f"(trainer.save_freq={cfg.trainer.save_freq}); free space or choose another directory"
        )
    return line


def check_resume(cfg: KLPPOConfig) -> None:
    """ConfigError when the checkpoint to resume from is of another kind or set-up (no checksums read)."""
    t = cfg.trainer
    roles = ["actor"] + (["critic"] if uses_critic(cfg) else [])
    try:
        precheck_resume(t.resume_mode, t.default_local_dir, t.resume_from_path, roles=roles)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None  # one line at start-up, as the other checks here


def check_disk(cfg: KLPPOConfig, model_path: str) -> str:
    """:func:`check_run_dir` with the actor's (and critic's) model config read from its path."""
    actor_config = AutoConfig.from_pretrained(model_path)
    critic_config = None
    if uses_critic(cfg):
        critic_path = model_dir(cfg.critic.model.path, key="critic.model.path")
        critic_config = actor_config if critic_path == model_path else AutoConfig.from_pretrained(critic_path)
    return check_run_dir(cfg, actor_config, critic_config)


def check_before_weights(cfg: KLPPOConfig, model_path: str) -> list[str]:
    """Every check above, in order, the first problem raised; returns the plan lines (the checkpoint
    estimate). `klppo train` runs them one by one to name every problem (``klppo.commands.startup``)."""
    check_loggers(cfg)
    check_text_only(cfg)
    check_resume(cfg)
    check_layout(cfg, model_path)
    return [check_disk(cfg, model_path)]


def nothing_left_to_train(cfg: KLPPOConfig, batches_per_epoch: int) -> str | None:
    """When the checkpoint this run would resume from already reached the run's last step, the sentence
    that says so (and what to change); None otherwise. Read before any weight loads: the step from the
    checkpoint's name, its files checked only when it would end the run."""
    t = cfg.trainer
    if t.resume_mode == "resume_path" and t.resume_from_path:
        path: Path | None = Path(t.resume_from_path).expanduser()
    elif t.resume_mode == "auto":
        path = latest_checkpoint(Path(t.default_local_dir).expanduser())
    else:
        return None
    total = total_training_steps(t, batches_per_epoch)
    try:
        step = checkpoint_step(path) if path is not None else 0
    except CheckpointError:
        return None  # not a global_step_N folder: the resume check names it
    roles = ["actor"] + (["critic"] if uses_critic(cfg) else [])
    if step < total or validate_checkpoint(path, roles=roles) is not None:
        return None  # steps left, or a damaged checkpoint: the run falls back to an older one or says why
    what = "trainer.total_training_steps" if t.total_training_steps else "trainer.total_epochs"
    return (
        f"{path} is at step {step}, and this run ends at step {total} ({what}): nothing left to train. Raise "
        "trainer.total_training_steps or total_epochs to continue, or start over with "
        "trainer.resume_mode=disable or another trainer.default_local_dir"
    )
