"""Checks `klppo train` runs before any weight loads (its `--dry-run` runs the same ones), each failure a
`ConfigError` of one line naming the key, file or phase:

- `check_loggers`: every `trainer.logger` backend is built and its package importable (a missing `wandb`
  would otherwise stop the run after the models load, when the tracker starts);
- `check_text_only`: no image or video column (`data.image_key`, `data.video_key`) and no `<image>` /
  `<video>` placeholder in a prompt — klppo trains text-only models, so a vision data set is refused
  rather than trained on its text;
- `check_tool_config`, `check_interaction_config`: the multi-turn tool and interaction configs load
  (`klppo.tools.config`: the file, each entry, each class — verl's mapped or refused by name), as the
  rollout will load them;
- `check_run_dir`: `trainer.default_local_dir` is (or can be created) writable, and one checkpoint
  (weights, optimizer state and files of each trained role, predicted from the model config by
  `klppo.tune.disk`) fits in the free space when `trainer.save_freq` > 0, else the refusal names the smaller
  settings that fit (bf16 state, LoRA). It returns the prediction as a line for the dry run's plan, with a
  warning when the free space holds fewer checkpoints than the run keeps at once.

The model's heads against each Ulysses size and, on a Megatron launch, the memory of the translated layout
are checked by `klppo.assembly.layout_checks` (`check_layout`). The prompt data itself (missing/empty
files, columns, rows for one batch after filtering) is checked by `klppo.assembly.data_check`. Knows nothing
of the loop; reads Parquet schemas, prompt columns and model
configs, never weights.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
from transformers import AutoConfig

from klppo.agent.multi_turn import interaction_name, row_agent
from klppo.assembly.layout_checks import check_layout
from klppo.config import ConfigError, KLPPOConfig, total_training_steps, uses_critic
from klppo.models.loading import model_dir
from klppo.ops.checkpoint import (
    CheckpointError,
    checkpoint_step,
    latest_checkpoint,
    precheck_resume,
    validate_checkpoint,
)
from klppo.tools.config import load_interactions, load_tools
from klppo.tracking.tracker import BACKENDS, PACKAGES
from klppo.tune import disk
from klppo.tune.disk import RoleState

_PLACEHOLDERS = ("<image>", "<video>")
log = logging.getLogger("klppo")


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


def check_tool_config(cfg: KLPPOConfig) -> None:
    """ValueError, one line naming the file and entry, when ``multi_turn.tool_config_path`` does not load
    (missing file, bad entry, a class klppo does not ship or cannot import); the tools are built as the
    rollout builds them, so a constructor's check runs too."""
    path = cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path
    if path:
        load_tools(path)


def check_interaction_config(cfg: KLPPOConfig) -> None:
    """:func:`check_tool_config` for ``multi_turn.interaction_config_path``; with multi-turn on, also each
    train and val row's ``agent_name`` and ``extra_info.interaction_kwargs.name`` against what exists
    (:func:`_check_conversation_rows`), so a wrong name stops the start, not the first rollout."""
    mt = cfg.actor_rollout_ref.rollout.multi_turn
    names = sorted(load_interactions(mt.interaction_config_path)) if mt.interaction_config_path else []
    if mt.enable:
        for path in _files(cfg.data.train_files) + _files(cfg.data.val_files):
            _check_conversation_rows(path, names)


def _check_conversation_rows(path: str, interactions: list[str]) -> None:
    """ConfigError naming the file and row whose ``agent_name`` is not one klppo runs, or whose
    ``interaction_kwargs.name`` is not in the interaction config (the conversation loop's own rules:
    :func:`row_agent`, :func:`interaction_name`). Missing or unreadable files are left to the data check."""
    full = os.path.expanduser(path)
    try:
        pf = pq.ParquetFile(full)
    except (OSError, ValueError):
        return
    columns = [c for c in ("extra_info", "agent_name") if c in pf.schema_arrow.names]
    row = 0
    for batch in pf.iter_batches(columns=columns, batch_size=65536) if columns else ():
        table = batch.to_pydict()
        infos = table.get("extra_info") or [None] * batch.num_rows
        agents = table.get("agent_name") or [None] * batch.num_rows
        for i, (info, agent) in enumerate(zip(infos, agents, strict=True)):
            info = info or {}
            try:
                row_agent(agent or info.get("agent_name"))
                interaction_name(info.get("interaction_kwargs") or {}, interactions)
            except ValueError as exc:
                raise ConfigError(f"{path} row {row + i}: {exc}") from None
        row += batch.num_rows


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


def checkpoint_roles(
    cfg: KLPPOConfig,
    actor_config: object,
    critic_config: object | None,
    *,
    files_bytes: tuple[int, int] = (0, 0),
) -> list[RoleState]:
    """The trained roles' settings that size a checkpoint (``klppo.tune.disk``): the actor's, and the
    critic's when ``critic_config`` is given; ``files_bytes``: their Hugging Face files."""
    arr = cfg.actor_rollout_ref
    roles = [
        RoleState(
            "actor",
            actor_config,
            model_dtype=arr.actor.fsdp_config.model_dtype,
            lora_rank=_lora_rank(arr.model.lora_rank, arr.model.lora_adapter_path),
            lora_alpha=arr.model.lora_alpha,
            target_modules=arr.model.target_modules,
            exclude_modules=arr.model.exclude_modules,
            optimizer=arr.actor.optim.optimizer,
            files_bytes=files_bytes[0],
        )
    ]
    if critic_config is not None:
        crit = cfg.critic
        roles.append(
            RoleState(
                "critic",
                critic_config,
                model_dtype=crit.model.fsdp_config.model_dtype,
                lora_rank=crit.model.lora_rank,
                lora_alpha=crit.model.lora_alpha,
                target_modules=crit.model.target_modules,
                optimizer=crit.optim.optimizer,
                files_bytes=files_bytes[1],
            )
        )
    return roles


def _lora_rank(rank: int, adapter_path: str | None) -> int:
    """The actor's adapter rank: ``lora_rank``, or the rank of the adapter it starts from."""
    if rank > 0 or not adapter_path:
        return rank
    try:
        return int(json.loads((Path(adapter_path).expanduser() / "adapter_config.json").read_text())["r"])
    except (OSError, ValueError, KeyError, TypeError):
        return 8  # peft's default rank: the adapter is checked when it loads


def _existing(run_dir: str) -> Path:
    """``run_dir``, or its nearest folder that exists (the run directory is made when the run starts)."""
    existing = Path(run_dir).expanduser()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return existing


def free_space(run_dir: str) -> tuple[Path, int]:
    """(the folder of ``run_dir`` that exists, its free bytes; 0 where it is not a folder)."""
    existing = _existing(run_dir)
    return existing, shutil.disk_usage(existing).free if existing.is_dir() else 0


def check_run_dir(cfg: KLPPOConfig, roles: list[RoleState], *, ranks: int = 1) -> str:
    """ConfigError naming `trainer.default_local_dir` when it cannot be written, or when one checkpoint of
    ``roles`` (``klppo.tune.disk.checkpoint_size``) would not fit in its free space with `trainer.save_freq`
    > 0 — naming the smaller settings that would; otherwise the plan's line: the size by role, the free space
    and how many checkpoints it holds. With room for fewer than the run keeps on disk while it writes one
    more (`trainer.max_actor_ckpt_to_keep` + 1), the line says so and a warning is logged."""
    t = cfg.trainer
    existing = _existing(t.default_local_dir)
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(
            f"trainer.default_local_dir={t.default_local_dir}: {existing} is not a writable directory"
        )
    size = disk.checkpoint_size(roles, ranks=ranks)
    need, free = size.total, shutil.disk_usage(existing).free
    by_role = ", ".join(f"{r.name} {disk.size_text(disk.role_bytes(size, r.name))}" for r in roles)
    line = (
        f"checkpoint: about {disk.size_text(need)} each ({by_role}; `klppo tune --dry-run` shows the "
        f"terms); {disk.size_text(free)} free under {existing}"
    )
    if t.save_freq > 0 and free < need:
        options = disk.settings(roles, ranks=ranks)[1:]
        fits = [f"{keys}: {disk.size_text(other.total)}" for keys, other in options if other.total <= free]
        raise ConfigError(
            f"trainer.default_local_dir={t.default_local_dir}: one checkpoint needs about "
            f"{disk.size_text(need)} ({by_role}) but {disk.size_text(free)} are free under {existing} "
            f"(trainer.save_freq={t.save_freq}); "
            + ("predicted to fit: " + "; ".join(fits) if fits else "free space or choose another directory")
        )
    held = _held_at_once(t.save_freq, t.total_training_steps, t.max_actor_ckpt_to_keep)
    room = int(free // max(need, 1))
    if t.save_freq > 0 and (held is None or held > room):
        advice = f"trainer.max_actor_ckpt_to_keep={room - 1}" if room > 1 else "a smaller setting"
        note = (
            f"room for {room} checkpoint(s), and the run holds {held or 'every one it saves'} at once "
            f"(trainer.max_actor_ckpt_to_keep={t.max_actor_ckpt_to_keep}; one more while it writes): a "
            f"later save may run out of space; set {advice}"
        )
        log.warning("%s", note)
        line += f"; {note}"
    return line


def check_resume(cfg: KLPPOConfig) -> None:
    """ConfigError when the checkpoint to resume from is of another kind or set-up (no checksums read)."""
    t = cfg.trainer
    roles = ["actor"] + (["critic"] if uses_critic(cfg) else [])
    try:
        precheck_resume(t.resume_mode, t.default_local_dir, t.resume_from_path, roles=roles)
    except CheckpointError as exc:
        raise ConfigError(str(exc)) from None  # one line at start-up, as the other checks here


def _held_at_once(save_freq: int, total_steps: int | None, keep: int | None) -> int | None:
    """Checkpoints on disk at once at most, the one being written included: the saves of the run
    (``total_steps`` / ``save_freq``, the last step's too) or ``keep`` + 1, the smaller; None when neither
    bounds it (every checkpoint kept, the run's length not set)."""
    saves = -(-total_steps // save_freq) if total_steps and save_freq > 0 else None
    bounds = [b for b in (saves, keep + 1 if keep and keep > 0 else None) if b is not None]
    return min(bounds) if bounds else None


def disk_roles(cfg: KLPPOConfig, model_path: str) -> list[RoleState]:
    """:func:`checkpoint_roles` with the actor's (and critic's) model config and Hugging Face files read
    from its path."""
    actor_config = AutoConfig.from_pretrained(model_path)
    critic_config, critic_path = None, model_path
    if uses_critic(cfg):
        critic_path = model_dir(cfg.critic.model.path, key="critic.model.path")
        critic_config = actor_config if critic_path == model_path else AutoConfig.from_pretrained(critic_path)
    files = (disk.hf_files_bytes(model_path), disk.hf_files_bytes(critic_path))
    return checkpoint_roles(cfg, actor_config, critic_config, files_bytes=files)


def check_disk(cfg: KLPPOConfig, model_path: str, *, ranks: int = 1) -> str:
    """:func:`check_run_dir` for the roles of :func:`disk_roles`, written by ``ranks`` processes."""
    return check_run_dir(cfg, disk_roles(cfg, model_path), ranks=ranks)


def check_before_weights(cfg: KLPPOConfig, model_path: str) -> list[str]:
    """Every check above, in order, the first problem raised; returns the plan lines (the checkpoint
    estimate). `klppo train` runs them one by one to name every problem (``klppo.commands.startup``)."""
    check_loggers(cfg)
    check_text_only(cfg)
    check_tool_config(cfg)
    check_interaction_config(cfg)
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
