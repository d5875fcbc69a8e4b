"""Parameter counts and FLOPs per token, for ``perf/mfu`` and the memory model.

Training FLOPs per token of a dense decoder (Kaplan et al. 2020; the convention verl's flops counter
uses for Llama/Qwen2):

    flops/token = 6·N_matmul + 12·L·H·d_head·S

- N_matmul: weights that take part in a matmul per token: per layer the q, k, v, o projections
  (h·d_head·(2·H + 2·H_kv)) and the gated MLP (3·h·I), plus the LM head (V·h). The embedding lookup is a
  gather, not a matmul, so it is not counted (verl counts it; our MFU is lower by 2·V·h/(2·N_matmul)).
- 6 = 2 (multiply-add) × 3 (forward + backward for activations + backward for weights).
- 12·L·H·d_head·S: the attention scores QKᵀ and the weighted sum AV against S keys, forward and backward,
  with S the sequence length (full S, not the causal S/2: verl's convention, kept for comparability).

A forward-only pass (log-probs, values, generation) is a third of this: ``2·N_matmul + 4·L·H·d_head·S``.
"""

from __future__ import annotations

from typing import Any

import torch


def num_params(model: torch.nn.Module, *, exclude_embeddings: bool = False) -> int:
    """Number of distinct parameters (tied weights counted once); optionally without input embeddings."""
    total = sum(p.numel() for p in model.parameters())
    if exclude_embeddings:
        get_input = getattr(model, "get_input_embeddings", None)
        embeddings = get_input() if get_input is not None else None
        if embeddings is not None:
            total -= embeddings.weight.numel()
    return total


def _get(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    raise ValueError(f"config {type(config).__name__} has none of {names}: cannot count FLOPs")


def attention_dims(config: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of a Llama-family config (``head_dim`` when it says so)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = _get(config, "num_attention_heads")
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or _get(config, "hidden_size") // heads
    return heads, kv_heads, head_dim


def matmul_params_per_token(config: Any) -> int:
    """N_matmul of the module docstring, from a Llama-family config (dense MLP; MoE not supported)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    if getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None):
        raise ValueError("FLOPs of mixture-of-experts models are not modelled")
    hidden = _get(config, "hidden_size")
    layers = _get(config, "num_hidden_layers")
    heads, kv_heads, head_dim = attention_dims(config)
    intermediate = _get(config, "intermediate_size")
    vocab = _get(config, "vocab_size")
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    mlp = 3 * hidden * intermediate
    return layers * (attention + mlp) + vocab * hidden


def model_flops_per_token(config: Any, *, seq_len: int = 0, training: bool = True) -> float:
    """FLOPs per token (module docstring formula); ``training=False`` gives the forward-only third."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads, _, head_dim = attention_dims(config)
    layers = _get(config, "num_hidden_layers")
    flops = 6.0 * matmul_params_per_token(config) + 12.0 * layers * heads * head_dim * seq_len
    return flops if training else flops / 3.0


# dense bf16 tensor-core peaks from the vendors' datasheets (FLOP/s), by a substring of the device name
_PEAK_BF16 = (
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("4090", 165e12),
)


def device_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak of a GPU named ``device_name`` (``torch.cuda.get_device_name``), None if unknown."""
    for key, peak in _PEAK_BF16:
        if key in device_name:
            return peak
    return None
