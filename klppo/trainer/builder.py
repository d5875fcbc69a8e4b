"""Builds the run's parts from the resolved configuration: the one place that maps verl's keys onto
the settings objects of the roles, rollout, data and parallel layers."""

from __future__ import annotations

from typing import Any

import torch

from klppo.roles.forward import MicroBatching
from klppo.roles.optim import OptimSettings

DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
}


def to_dtype(name: str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if name is None:
        return default
    try:
        return DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}: expected one of {sorted(DTYPES)}") from None


def optim_settings(optim_cfg: Any, total_steps: int) -> OptimSettings:
    schedule = getattr(optim_cfg, "lr_scheduler_type", None) or getattr(optim_cfg, "warmup_style", None)
    min_lr_ratio = getattr(optim_cfg, "min_lr_ratio", 0.0)
    betas = tuple(getattr(optim_cfg, "betas", (0.9, 0.999)))
    return OptimSettings(
        lr=float(optim_cfg.lr),
        weight_decay=float(getattr(optim_cfg, "weight_decay", 0.01)),
        betas=(float(betas[0]), float(betas[1])),
        warmup_steps=int(getattr(optim_cfg, "lr_warmup_steps", -1) or -1),
        warmup_steps_ratio=float(getattr(optim_cfg, "lr_warmup_steps_ratio", 0.0) or 0.0),
        schedule=str(schedule or "constant"),
        min_lr_ratio=float(min_lr_ratio or 0.0),
        num_cycles=float(getattr(optim_cfg, "num_cycles", 0.5)),
        total_steps=max(1, total_steps),
        optimizer=str(optim_cfg.optimizer),
        optimizer_impl=str(optim_cfg.optimizer_impl),
        extra=tuple(sorted(dict(optim_cfg.override_optimizer_config or {}).items())),
    )


def fsdp_settings(fsdp_cfg: Any, *, device: torch.device):
    """FSDP2 settings of one role; mixed precision (bf16 compute) only on GPU."""
    from klppo.parallel.fsdp import FSDPSettings

    mp = getattr(fsdp_cfg, "mixed_precision", None)
    on_gpu = device.type == "cuda"
    layer_cls = getattr(fsdp_cfg.wrap_policy, "transformer_layer_cls_to_wrap", None)
    return FSDPSettings(
        min_num_params=int(fsdp_cfg.wrap_policy.min_num_params or 0),
        transformer_layer_cls_to_wrap=list(layer_cls) if layer_cls else None,
        param_offload=bool(getattr(fsdp_cfg, "param_offload", False)),
        optimizer_offload=bool(getattr(fsdp_cfg, "optimizer_offload", False)),
        offload_policy=bool(getattr(fsdp_cfg, "offload_policy", False)),
        reshard_after_forward=bool(getattr(fsdp_cfg, "reshard_after_forward", True)),
        fsdp_size=int(getattr(fsdp_cfg, "fsdp_size", -1)),
        forward_prefetch=bool(getattr(fsdp_cfg, "forward_prefetch", False)),
        backward_prefetch=bool(getattr(fsdp_cfg, "backward_prefetch", True)),
        param_dtype=to_dtype(getattr(mp, "param_dtype", "bf16")) if (on_gpu and mp is not None) else None,
        reduce_dtype=to_dtype(getattr(mp, "reduce_dtype", "fp32")) if mp is not None else torch.float32,
    )


def micro(size: int, *, dynamic: bool, max_tokens: int) -> MicroBatching:
    # with use_dynamic_bsz the size is unset (None): micro-batches come from the token budget alone
    return MicroBatching(
        micro_batch_size=max(1, int(size or 1)), use_dynamic_bsz=bool(dynamic), max_token_len=int(max_tokens)
    )
