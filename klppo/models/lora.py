"""LoRA for the actor (verl's ``actor_rollout_ref.model.lora_rank/lora_alpha/target_modules/
exclude_modules``), through the `peft` library.

- The base weights are frozen; only the adapters train (and are what the optimizer holds).
- The reference policy is the same model with its adapters switched off (no second model in memory).
- Rollout runs on merged weights: inside the gathered-weights context the adapters are merged into the
  base weights, the engine reads the plain base model, and the base weights are then restored exactly
  from a copy (not by subtracting, which would drift by rounding).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a wrapper (a LoRA ``PeftModel`` with merged adapters), else ``model``."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _peft():
    try:
        import peft  # noqa: PLC0415  optional extra (klppo[lora])
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "actor_rollout_ref.model.lora_rank > 0 needs the `peft` package: pip install 'klppo[lora]'"
        ) from exc
    return peft


def apply_lora(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: float,
    target_modules: Any,
    exclude_modules: Any = None,
    adapter_path: str | None = None,
    task_type: str = "CAUSAL_LM",
    modules_to_save: list[str] | None = None,
):
    """Wrap ``model`` with LoRA adapters (B = 0 at start, so the wrapped model computes what it did), or
    with the trainable adapter saved at ``adapter_path`` (verl's ``lora_adapter_path``).
    ``modules_to_save``: whole modules trained alongside (the critic's value head)."""
    peft = _peft()
    if adapter_path:
        return peft.PeftModel.from_pretrained(model, adapter_path, is_trainable=True)

    def names(value: Any) -> Any:
        return value if value is None or isinstance(value, str) else list(value)

    config = peft.LoraConfig(
        r=int(rank),
        lora_alpha=float(alpha),
        target_modules=names(target_modules),
        exclude_modules=names(exclude_modules),
        lora_dropout=0.0,
        bias="none",
        task_type=task_type,
        modules_to_save=modules_to_save,
    )
    return peft.get_peft_model(model, config)


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """The base model's behaviour (the reference policy) for the duration of the block.

    The adapters keep ``requires_grad``: peft's ``disable_adapter`` clears it on every adapter weight as a
    side effect, and FSDP2 reads ``requires_grad`` when a unit is first run or gathered to fix the dtype
    its gradients are reduced in and returned as (``_init_mp_dtypes``: the dtype of the trainable
    parameters). A unit first reached here would see no trainable parameter and keep its gradients in the
    bf16 compute dtype: the first backward then fails assigning bf16 gradients to the fp32 adapters
    ("attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype Float"). The block
    runs without gradients (the reference), so the flag changes nothing inside it."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    with model.disable_adapter():
        for p in trainable:
            p.requires_grad_(True)
        yield


@contextmanager
def merged_for_rollout(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Yield ``model`` with the adapters merged into its (gathered) base weights — merged layers skip the
    adapter path, so a forward computes the merged model; the engine reads the base weights through
    ``get_base_model()``. The base weights are restored from a copy afterwards."""
    from peft.tuners.lora import LoraLayer  # noqa: PLC0415  optional extra (klppo[lora])

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    saved = [layer.get_base_layer().weight.detach().clone() for layer in layers]
    try:
        with torch.no_grad():
            for layer in layers:
                layer.merge()
        yield model
    finally:
        with torch.no_grad():
            for layer, weight in zip(layers, saved):
                layer.get_base_layer().weight.copy_(weight)
                layer.merged_adapters = []  # the copy above undid the merge


def merge_into_base(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model with the adapters folded into the weights (for export)."""
    return model.merge_and_unload()
