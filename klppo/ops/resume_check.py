"""What a resume continues: the run's identity, saved in every checkpoint and compared before weights load.

A checkpoint's ``trainer_state.pt`` holds ``identity`` (:func:`run_identity`), built once when the run
first started and carried unchanged through every resume:

- ``model``: the base model's path, its architecture (``config.json``: model type, architectures, layer
  count and widths, vocabulary size, tied embeddings) and a digest of its weights (:func:`weights_digest`);
  the reference policy is these weights, so other weights under the same shapes change the run;
- ``tokenizer``: a SHA-256 of the tokenizer's files;
- ``config``: the resolved configuration, flattened to ``dotted.key: value``.

:func:`check_resume` compares the current start against it. A change of architecture, weights, tokenizer,
or of a key in :data:`REFUSED_KEYS` (the algorithm and the batch geometry) is refused with one line naming
each change and ``trainer.allow_resume_changes``; other changed keys (more steps, a new learning rate) are
accepted with one note naming them. A changed model *path* with the same weights is a note too (the files
moved). A checkpoint saved without an identity gets the check skipped, with a note.

A checkpoint of LoRA adapters without their base weights records the base (:func:`base_record`);
:func:`check_base` refuses another base whatever ``trainer.allow_resume_changes`` says: the adapters were
trained on those weights, and the checkpoint cannot supply them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

log = logging.getLogger("klppo")
OVERRIDE_KEY = "trainer.allow_resume_changes"
ARCHITECTURE_FIELDS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "attention_bias",
)
REFUSED_KEYS = (
    "algorithm.adv_estimator",
    "algorithm.use_kl_in_reward",
    "algorithm.kl_penalty",
    "actor_rollout_ref.actor.use_kl_loss",
    "actor_rollout_ref.actor.kl_loss_type",
    "actor_rollout_ref.model.lora_rank",
    "data.train_batch_size",
    "data.max_prompt_length",
    "data.max_response_length",
    "data.logged_share",
    "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.ppo_mini_batch_size",
    "critic.ppo_mini_batch_size",
)
"""Keys whose change makes a resumed run another run: the algorithm and the batch geometry."""
_IGNORED_PREFIXES = ("trainer.resume_", "trainer.allow_resume_changes", "trainer.run_dir_exists")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
)
_BLOCK = 64 * 1024
_NUM_BLOCKS = 16


class ResumeMismatchError(ValueError):
    """The checkpoint to resume was saved by a run that differs in what a resume may not change."""


def weights_digest(model_path: str | Path) -> str:
    """``sha256:<hex>`` over each weight file of ``model_path`` (``*.safetensors``, ``*.bin``, ``*.pt``,
    ``*.pth``, ``*.gguf``, sorted by name): its name, its size, its first 64 KiB (a safetensors header:
    every tensor's name, dtype, shape and offsets) and 16 blocks of 64 KiB at evenly spaced offsets. About
    1 MiB read per file, so a 7B model's digest takes milliseconds; other weights under the same shapes
    differ in the sampled blocks."""
    root = Path(model_path)
    files = sorted(p for p in root.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    h = hashlib.sha256()
    for path in files:
        size = path.stat().st_size
        h.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as f:
            h.update(f.read(_BLOCK))
            for i in range(_NUM_BLOCKS):
                f.seek(size * i // _NUM_BLOCKS)
                h.update(f.read(_BLOCK))
    return "sha256:" + h.hexdigest()


def tokenizer_digest(tokenizer_path: str | Path) -> str:
    """``sha256:<hex>`` over the tokenizer files present in ``tokenizer_path`` (names and contents)."""
    h = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = Path(tokenizer_path) / name
        if path.is_file():
            h.update(name.encode() + b"\0" + path.read_bytes())
    return "sha256:" + h.hexdigest()


def architecture(model_path: str | Path) -> dict[str, Any]:
    """The fields of ``config.json`` that fix the weights' shapes (absent ones left out)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in ARCHITECTURE_FIELDS if k in config}


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested mapping as ``{"a.b.c": leaf}`` (lists, scalars and empty mappings are leaves)."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def base_record(model_path: str | Path) -> dict[str, Any]:
    """The model at ``model_path`` as a run identity and a base record name it: its absolute path, its
    architecture (:func:`architecture`) and its weights' digest (:func:`weights_digest`)."""
    return {
        "path": os.path.abspath(model_path),
        "architecture": architecture(model_path),
        "weights_digest": weights_digest(model_path),
    }


def base_mismatch(record: dict[str, Any], now: dict[str, Any]) -> str | None:
    """None when the model of base record ``now`` is the base ``record`` names (same architecture and
    weights' digest; the path may differ), else a phrase saying what differs."""
    if record.get("architecture") != now["architecture"]:
        return f"another architecture than the base {record.get('path')}"
    if record.get("weights_digest") != now["weights_digest"]:
        return f"other weights than the base {record.get('path')}"
    return None


def check_base(record: dict[str, Any], now: dict[str, Any], *, checkpoint: Path) -> None:
    """Refuse (:class:`ResumeMismatchError`, one line) a resume of ``checkpoint`` on a base model (``now``:
    its :func:`base_record`) other than the one its adapters were trained on, whatever
    ``trainer.allow_resume_changes`` says: the checkpoint does not hold the base weights."""
    problem = base_mismatch(record, now)
    if problem is not None:
        raise ResumeMismatchError(
            f"{checkpoint} holds LoRA adapters without their base weights, and "
            f"actor_rollout_ref.model.path={now['path']} has {problem}; resume with that base model"
        )


def run_identity(*, model_path: str, tokenizer_path: str, config: dict[str, Any]) -> dict[str, Any]:
    """What this start trains (module docstring); ``config`` is the resolved configuration as a mapping."""
    return {
        "model": base_record(model_path),
        "tokenizer": {"path": os.path.abspath(tokenizer_path), "digest": tokenizer_digest(tokenizer_path)},
        "config": {k: _plain(v) for k, v in flatten(config).items()},
    }


def _plain(value: Any) -> Any:
    """``value`` as JSON reads it back (tuples as lists; what JSON cannot hold as its text)."""
    return json.loads(json.dumps(value, default=str))


def _changes(saved: dict[str, Any], now: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused changes, accepted changes), each a phrase naming what changed and how."""
    refused, accepted = [], []
    was_model, is_model = saved.get("model", {}), now["model"]
    if was_model.get("architecture") != is_model["architecture"]:
        diff = {
            k
            for k in set(was_model.get("architecture", {})) | set(is_model["architecture"])
            if was_model.get("architecture", {}).get(k) != is_model["architecture"].get(k)
        }
        refused.append(
            f"the model architecture ({', '.join(sorted(diff))}: checkpoint saved from "
            f"{was_model.get('path')}, now {is_model['path']})"
        )
    elif was_model.get("weights_digest") != is_model["weights_digest"]:
        refused.append(
            f"the model weights (the reference; checkpoint saved from {was_model.get('path')}, "
            f"now {is_model['path']}: other weights)"
        )
    elif was_model.get("path") != is_model["path"]:
        accepted.append(
            f"actor_rollout_ref.model.path {was_model.get('path')} → {is_model['path']} (same weights)"
        )
    if saved.get("tokenizer", {}).get("digest") != now["tokenizer"]["digest"]:
        refused.append(
            f"the tokenizer ({saved.get('tokenizer', {}).get('path')} → {now['tokenizer']['path']})"
        )
    was, is_ = saved.get("config", {}), now["config"]
    for key in sorted(set(was) | set(is_)):
        if key.startswith(_IGNORED_PREFIXES) or was.get(key) == is_.get(key):
            continue
        phrase = f"{key} {was.get(key)!r} → {is_.get(key)!r}"
        (refused if key in REFUSED_KEYS else accepted).append(phrase)
    return refused, accepted


def check_resume(saved: dict[str, Any] | None, now: dict[str, Any], *, checkpoint: Path, allow: bool) -> None:
    """Refuse (:class:`ResumeMismatchError`, one line) a resume of ``checkpoint`` that changes what the
    run is, unless ``allow``; log one note naming the accepted changes (module docstring)."""
    if saved is None:
        log.info(
            "resuming %s: saved without a run identity; the model, tokenizer and settings are not compared",
            checkpoint,
        )
        return
    refused, accepted = _changes(saved, now)
    if refused and not allow:
        raise ResumeMismatchError(
            f"resuming {checkpoint} would change {'; '.join(refused)}. Resume with the settings it was "
            f"saved with, start a new run in another trainer.default_local_dir, or set {OVERRIDE_KEY}=True "
            "to continue anyway"
        )
    changed = refused + accepted
    if changed:
        log.warning("resuming %s with changes: %s", checkpoint, "; ".join(changed))
