"""Predicted size of one checkpoint on disk (bytes), term by term, from the model's config and the run's
settings — no weights: each trained role's model is built on the ``meta`` device
(:func:`klppo.tune.shapes.meta_model`; LoRA adapters put on it by ``peft``, as the trainer does).

What one checkpoint holds (:mod:`klppo.ops.checkpoint`'s layout; a role's state written by
:mod:`klppo.parallel.checkpoint` through torch.distributed.checkpoint), per trained role — the actor, and the
critic when the estimator needs values:

- weights: every entry of the role's state dict in ``fsdp_config.model_dtype`` (``m`` bytes: the master
  weights, fp32 by default), a tied matrix once per name (the embedding and the tied LM head are written
  each): ``P_sd·m + P_a·4`` with LoRA adapters ``P_a`` — a LoRA critic holds its base model beside its
  adapters (on the plain path in the compute dtype, bf16 on a GPU: ``m`` is an upper bound there). A LoRA
  actor leaves its frozen base out (:attr:`RoleState.adapters_only`): its weights are the trained ones and
  the buffers, ``P_t·m + P_a·4``, and a record of the base (:data:`BASE_RECORD_BYTES`);
- optimizer state: for each trained parameter the optimizer's moments in the masters' dtype (Adam/AdamW:
  two; :data:`MOMENTS`) and a step count: ``k·(P_t·m + P_a·4) + 4·n_t`` (``n_t`` trained tensors). A full
  fine-tune with fp32 masters writes 12 bytes per parameter, with ``model_dtype=bf16`` 6; LoRA trains its
  adapters only (``P_a``: ``r·(in + out)`` per adapted linear layer, in fp32 whatever ``model_dtype``:
  :data:`ADAPTER_BYTES`) and the critic's value head;
- per tensor and rank, torch.distributed.checkpoint's record in the shard file and its entry in
  ``.metadata`` (:data:`ITEM_BYTES`), and the optimizer's hyperparameters (:data:`GROUP_BYTES`);
- the role's Hugging Face files: model config, generation config and tokenizer (``files_bytes``: the sizes of
  the model directory's own files, :func:`hf_files_bytes`; 0 for a named shape), LoRA's adapter config;
- once per checkpoint: the trainer state, each rank's RNG file and the manifest (:data:`RUN_FILES_BYTES`,
  :data:`RNG_BYTES`).

Not counted: ``checkpoint.save_contents`` (every checkpoint holds the model and the optimizer).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from klppo.models.lora import apply_lora
from klppo.tune.memory import PhasePeak
from klppo.tune.shapes import meta_model

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}
"""Bytes per element of a ``model_dtype`` value."""

MOMENTS = {"AdamW": 2, "Adam": 2, "SGD": 1}
"""State tensors the size of its parameter that an optimizer keeps (others: counted as Adam's two)."""

ITEM_BYTES = 1_870
"""One tensor's overhead on disk per writing rank: torch.save's record around it in the ``.distcp`` file
(~1.6 KB) and its entry in ``.metadata`` (~0.3 KB)."""

GROUP_BYTES = 12 * ITEM_BYTES
"""The optimizer's hyperparameters (lr, betas, eps, …: one record each), plus :data:`NAME_BYTES` per
trained tensor for its name in the group's list."""

NAME_BYTES = 48

ADAPTER_CONFIG_BYTES = 1_600
"""LoRA's ``adapter_config.json``."""

RUN_FILES_BYTES = 48_000
"""``trainer_state.pt`` (step, loader position, controllers, the run's identity), ``MANIFEST.json`` and
``COMPLETE``."""

RNG_BYTES = 16_000
"""One rank's ``rng/rank_<r>.pt``."""

BASE_RECORD_BYTES = 600
"""A LoRA actor's ``base_model.json``: the base model's path, architecture and weights' digest."""

_HF_SUFFIXES = (".json", ".jinja", ".txt", ".model", ".tiktoken")


@dataclass(frozen=True)
class RoleState:
    """What sizes one trained role's share of a checkpoint."""

    name: str
    """"actor" or "critic": the role's folder and the model built (a causal LM, or a value model)."""
    model_config: Any
    """The transformers config of the role's model."""
    model_dtype: str = "fp32"
    """``fsdp_config.model_dtype``: the masters' dtype, and the optimizer state's."""
    lora_rank: int = 0
    lora_alpha: float = 16
    target_modules: Any = "all-linear"
    exclude_modules: Any = None
    optimizer: str = "AdamW"
    files_bytes: int = 0
    """The role's Hugging Face files (:func:`hf_files_bytes`)."""

    @property
    def adapters_only(self) -> bool:
        """The checkpoint leaves the frozen base weights out (a LoRA actor: ``klppo.ops.checkpoint``)."""
        return self.name == "actor" and self.lora_rank > 0


def hf_files_bytes(model_path: str | Path | None) -> int:
    """Bytes of a model directory's configuration and tokenizer files (what a checkpoint's ``huggingface/``
    folder holds); 0 for None or a path that is not a directory."""
    if model_path is None or not Path(model_path).expanduser().is_dir():
        return 0
    return sum(
        f.stat().st_size
        for f in Path(model_path).expanduser().iterdir()
        if f.is_file() and f.suffix in _HF_SUFFIXES and not f.name.endswith(".index.json")
    )


def role_model(role: RoleState) -> nn.Module:
    """``role``'s model on the ``meta`` device as the trainer builds it: a causal LM (actor) or a value model
    (critic: token classification with one label), with LoRA adapters when ``lora_rank`` > 0."""
    if role.name == "critic":
        from transformers import AutoModelForTokenClassification  # noqa: PLC0415  heavy, as meta_model

        config = copy.deepcopy(role.model_config)
        config.num_labels, config.classifier_dropout = 1, 0.0
        with torch.device("meta"):
            model = AutoModelForTokenClassification.from_config(config)
    else:
        model = meta_model(role.model_config)
    if role.lora_rank <= 0:
        return model
    return apply_lora(
        model,
        rank=role.lora_rank,
        alpha=role.lora_alpha,
        target_modules=role.target_modules,
        exclude_modules=role.exclude_modules,
        **({"task_type": "TOKEN_CLS", "modules_to_save": ["score"]} if role.name == "critic" else {}),
    )


@dataclass(frozen=True)
class _Counts:
    """What a role's state dict holds, whatever the dtype: elements of the parameters per entry (a tied matrix
    once per name) apart from LoRA's adapters, the adapters' (``lora_`` in their names), buffer bytes, the
    trained parameters apart from the adapters."""

    num_entries: int
    num_buffers: int
    param_numel: int
    adapter_numel: int
    buffer_bytes: int
    trained_numel: int
    num_trained: int


_COUNTS: dict[tuple, _Counts] = {}


def _counts(role: RoleState) -> _Counts:
    """:class:`_Counts` of ``role``'s model (:func:`role_model`), kept per model and adapters: the settings
    that change only dtypes reuse them."""
    key = (
        role.name,
        role.model_config.to_json_string(),
        role.lora_rank,
        repr(role.target_modules),
        repr(role.exclude_modules),
    )
    if key not in _COUNTS:
        model = role_model(role)
        params = {id(p): name for name, p in model.named_parameters()}
        entries = model.state_dict(keep_vars=True)
        numel = {"param": 0, "adapter": 0, "trained": 0}
        for name, t in entries.items():
            if id(t) in params:
                numel["adapter" if "lora_" in name else "param"] += t.numel()
        trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        _COUNTS[key] = _Counts(
            num_entries=len(entries),
            num_buffers=sum(1 for t in entries.values() if id(t) not in params),
            param_numel=numel["param"],
            adapter_numel=numel["adapter"],
            buffer_bytes=sum(t.numel() * t.element_size() for t in entries.values() if id(t) not in params),
            trained_numel=sum(p.numel() for n, p in trained if "lora_" not in n),
            num_trained=len(trained),
        )
    return _COUNTS[key]


ADAPTER_BYTES = 4
"""LoRA's adapters are fp32 whatever ``model_dtype`` (``peft`` casts bf16/fp16 adapters up), and so is
their optimizer state."""


def add_role(size: PhasePeak, role: RoleState, *, ranks: int = 1) -> None:
    """``role``'s terms of one checkpoint (module docstring) added to ``size``."""
    n = _counts(role)
    m, k, a = DTYPE_BYTES[role.model_dtype], MOMENTS.get(role.optimizer, 2), ADAPTER_BYTES
    num_entries = n.num_buffers + n.num_trained if role.adapters_only else n.num_entries
    if role.adapters_only:
        weights, formula = n.trained_numel * m + n.adapter_numel * a, "P_t·m + P_a·{a}, the base left out"
    else:
        weights, formula = n.param_numel * m + n.adapter_numel * a, "P_sd·m + P_a·{a}"
    size.add(
        f"{role.name} weights",
        weights + n.buffer_bytes,
        f"{formula.format(a=a)} ({num_entries} tensors, m={m})",
    )
    lora = f"; LoRA rank {role.lora_rank}: P_a={n.adapter_numel:,}" if role.lora_rank > 0 else ""
    size.add(
        f"{role.name} optimizer state",
        k * (n.trained_numel * m + n.adapter_numel * a) + 4 * n.num_trained,
        f"{k}·(P_t·m + P_a·{a}) + 4·n_t (P_t={n.trained_numel:,}{lora})",
    )
    records = ranks * ITEM_BYTES * (num_entries + (k + 1) * n.num_trained) + GROUP_BYTES
    size.add(f"{role.name} tensor records", records + NAME_BYTES * n.num_trained, "per tensor and rank")
    adapter_config = ADAPTER_CONFIG_BYTES if role.lora_rank > 0 else 0
    base = BASE_RECORD_BYTES if role.adapters_only else 0
    size.add(f"{role.name} Hugging Face files", role.files_bytes + adapter_config + base, "config, tokenizer")


def checkpoint_size(roles: list[RoleState], *, ranks: int = 1) -> PhasePeak:
    """One checkpoint's predicted bytes, term by term (``.total``: the sum), for ``roles`` trained by
    ``ranks`` processes."""
    size = PhasePeak("checkpoint")
    for role in roles:
        add_role(size, role, ranks=ranks)
    size.add("trainer state, RNG, manifest", RUN_FILES_BYTES + ranks * RNG_BYTES, "per checkpoint")
    return size


def size_text(n: float) -> str:
    """``n`` bytes as GiB (two decimals), or MiB below one GiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def role_bytes(size: PhasePeak, role: str) -> float:
    """The bytes of ``role``'s terms in ``size``."""
    return sum(t.bytes for t in size.terms if t.name.startswith(f"{role} "))


LORA_RANK = 64
"""The adapter rank of the LoRA setting offered when the actor trains in full."""

_KEYS = {
    "actor": ("actor_rollout_ref.actor.fsdp_config.model_dtype", "actor_rollout_ref.model.lora_rank"),
    "critic": ("critic.model.fsdp_config.model_dtype", "critic.model.lora_rank"),
}
"""Each role's keys of the settings :func:`settings` varies."""


def settings(roles: list[RoleState], *, ranks: int = 1) -> list[tuple[str, PhasePeak]]:
    """One checkpoint at the configured settings ("as configured") and at each smaller setting of the first
    role (the actor), the others as configured: bf16 masters and optimizer state (``model_dtype=bf16``), LoRA
    adapters of rank :data:`LORA_RANK` (the actor's base weights left out, a critic's written; offered where
    ``peft`` is installed), and both; each named by the keys that select it, in that order."""
    first, rest = roles[0], roles[1:]
    dtype_key, lora_key = _KEYS[first.name]
    dtypes = [first.model_dtype] + (["bf16"] if DTYPE_BYTES[first.model_dtype] > 2 else [])
    offer_lora = first.lora_rank <= 0 and importlib.util.find_spec("peft") is not None
    lora_ranks = [first.lora_rank] + ([LORA_RANK] if offer_lora else [])
    out = []
    for lora_rank in lora_ranks:
        for dtype in dtypes:
            keys = [f"{dtype_key}={dtype}"] if dtype != first.model_dtype else []
            keys += [f"{lora_key}={lora_rank}"] if lora_rank != first.lora_rank else []
            role = dataclasses.replace(first, model_dtype=dtype, lora_rank=lora_rank)
            out.append((", ".join(keys) or "as configured", checkpoint_size([role, *rest], ranks=ranks)))
    return out
