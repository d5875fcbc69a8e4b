"""Named model shapes (Qwen2.5, Llama-3) as transformers configs, and weight-free ``meta`` models.

The tuner needs only a model's *shape*: hidden size, layers, heads, MLP width, vocabulary, tied
embeddings. A shape becomes a transformers config (or a local directory's ``config.json`` is read), and
:func:`meta_model` builds the module tree on the ``meta`` device, so units and parameter counts of a
72B model are known without a byte of memory. Knows nothing about sharding or memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, Qwen2Config

from klppo.models.flops import attention_dims


@dataclass(frozen=True)
class ModelShape:
    """The numbers that decide a dense decoder's size (published ``config.json`` values)."""

    name: str
    arch: str
    """"qwen2" (q/k/v biases) or "llama"."""
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    """Input embedding and LM head share one matrix."""
    rope_theta: float = 1_000_000.0
    max_position: int = 32768


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in [
        ModelShape("Qwen2.5-0.5B", "qwen2", 896, 24, 14, 2, 4864, 151936, True),
        ModelShape("Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 8960, 151936, True),
        ModelShape("Qwen2.5-3B", "qwen2", 2048, 36, 16, 2, 11008, 151936, True),
        ModelShape("Qwen2.5-7B", "qwen2", 3584, 28, 28, 4, 18944, 152064, False),
        ModelShape("Qwen2.5-14B", "qwen2", 5120, 48, 40, 8, 13824, 152064, False),
        ModelShape("Qwen2.5-32B", "qwen2", 5120, 64, 40, 8, 27648, 152064, False),
        ModelShape("Qwen2.5-72B", "qwen2", 8192, 80, 64, 8, 29568, 152064, False),
        ModelShape("Llama-3-8B", "llama", 4096, 32, 32, 8, 14336, 128256, False, 500_000.0, 8192),
        ModelShape("Llama-3-70B", "llama", 8192, 80, 64, 8, 28672, 128256, False, 500_000.0, 8192),
        ModelShape("SmolLM2-135M", "llama", 576, 30, 9, 3, 1536, 49152, True, 100_000.0, 8192),
    ]
}


def shape_names() -> list[str]:
    return list(SHAPES)


def _lookup(name: str) -> ModelShape:
    folded = {k.lower(): v for k, v in SHAPES.items()}
    key = name.lower().removeprefix("qwen/").removeprefix("meta-llama/")
    if key not in folded:
        raise ValueError(f"unknown model shape {name!r}; known: {', '.join(SHAPES)}")
    return folded[key]


def config_kwargs(shape: ModelShape | str) -> dict:
    """The transformers config fields of ``shape`` (a :class:`ModelShape` or its name), as keywords."""
    s = _lookup(shape) if isinstance(shape, str) else shape
    return dict(
        hidden_size=s.hidden,
        num_hidden_layers=s.layers,
        num_attention_heads=s.heads,
        num_key_value_heads=s.kv_heads,
        intermediate_size=s.intermediate,
        vocab_size=s.vocab,
        tie_word_embeddings=s.tied,
        max_position_embeddings=s.max_position,
        rope_theta=s.rope_theta,
        rms_norm_eps=1e-6 if s.arch == "qwen2" else 1e-5,
    )


def config_from_shape(shape: ModelShape | str):
    """A transformers ``Qwen2Config`` / ``LlamaConfig`` of ``shape`` (a :class:`ModelShape` or its name)."""
    s = _lookup(shape) if isinstance(shape, str) else shape
    cls = Qwen2Config if s.arch == "qwen2" else LlamaConfig
    return cls(**config_kwargs(s))


def load_model_config(name_or_path: str):
    """A config from a named shape (``Qwen2.5-7B``) or a local model directory (its ``config.json``)."""
    if Path(name_or_path).expanduser().is_dir():
        return AutoConfig.from_pretrained(str(Path(name_or_path).expanduser()))
    return config_from_shape(name_or_path)


def meta_model(config) -> nn.Module:
    """A causal LM of ``config`` on the ``meta`` device: full module tree, parameters without storage."""

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def shape_of(config) -> ModelShape:
    """The :class:`ModelShape` numbers of a transformers config (for configs read from a directory)."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    heads = config.num_attention_heads
    return ModelShape(
        name=getattr(config, "name_or_path", "") or config.model_type,
        arch="qwen2" if config.model_type.startswith("qwen2") else "llama",
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        intermediate=config.intermediate_size,
        vocab=config.vocab_size,
        tied=bool(getattr(config, "tie_word_embeddings", False)),
    )


def head_dim(config) -> int:
    return attention_dims(config)[2]
