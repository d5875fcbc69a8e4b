"""Views of a Llama-family decoder's weights, read from its Hugging Face module at call time.

:class:`LlamaWeights` holds detached views (no copy) of a model's embedding, per-layer projections and norms,
final norm and LM head, plus the shapes the functional forward needs; :func:`unsupported_reason` says which
models those views describe: Llama 2/3, Qwen2/2.5, Qwen3 (per-head q/k RMSNorm), Mistral, SmolLM2 — tied
embeddings, GQA, q/k/v biases, and any RoPE whose frequencies do not depend on the sequence length (the
inverse frequencies are read from the model's own rotary module, so they match Hugging Face exactly).
Left out: sliding-window attention shorter than the sequence, dynamic RoPE, MoE, cross-attention.

Fused projections (:meth:`LlamaWeights.fuse`): ``[q; k; v]`` and ``[gate; up]`` concatenated into temporary
tensors (one matmul instead of three / two); :meth:`LlamaWeights.resident` makes copies a CUDA graph can
keep. The rollout engine (:mod:`klppo.rollout`) runs its forward on these views.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

from klppo.models.flops import attention_dims
from klppo.models.lora import base_model

if TYPE_CHECKING:
    from klppo.parallel.mesh import TensorParallel

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def unsupported_reason(model: torch.nn.Module, max_len: int) -> str | None:
    """Why the engine cannot run ``model`` for sequences of ``max_len`` tokens; None if it can."""
    model = base_model(model)
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not in {SUPPORTED_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type {rope_type!r} (supported: {STATIC_ROPE_TYPES})"
    window = getattr(config, "sliding_window", None)
    use_window = getattr(config, "use_sliding_window", model_type == "mistral")
    if use_window and window is not None and window < max_len:
        return f"sliding_window {window} shorter than the rollout length {max_len}"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "module layout is not model.model.layers / model.lm_head"
    if not hasattr(inner, "rotary_emb") or not hasattr(inner.rotary_emb, "inv_freq"):
        return "no rotary_emb.inv_freq on the model"
    return None


_LAYER_PATHS = {  # LayerWeights field → attribute path in a Hugging Face decoder layer (absent: None)
    "input_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
    "o": "self_attn.o_proj.weight",
    "o_bias": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "gate_bias": "mlp.gate_proj.bias",
    "up_bias": "mlp.up_proj.bias",
    "down_bias": "mlp.down_proj.bias",
}


@dataclasses.dataclass
class LayerWeights:
    input_norm: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    q_bias: torch.Tensor | None
    k_bias: torch.Tensor | None
    v_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_bias: torch.Tensor | None
    up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    qkv: torch.Tensor | None = None  # [q; k; v] rows: a temporary concatenation (LlamaWeights.fuse)
    qkv_bias: torch.Tensor | None = None
    gate_up: torch.Tensor | None = None  # [gate; up] rows, likewise
    gate_up_bias: torch.Tensor | None = None

    @staticmethod
    def read(layer: torch.nn.Module) -> LayerWeights:
        """Detached views of one Hugging Face decoder layer's weights (plain tensors, no grad: the same
        kind whether the model is trained, frozen or LoRA-merged, so compiled graphs' guards agree)."""

        def get(path: str) -> torch.Tensor | None:
            obj = layer
            for name in path.split("."):
                obj = getattr(obj, name, None)
            return None if obj is None else obj.detach()

        return LayerWeights(**{field: get(path) for field, path in _LAYER_PATHS.items()})

    def allocated_like(self, device: torch.device) -> LayerWeights:
        """Uninitialised tensors of these shapes and dtypes on ``device`` (e.g. from a meta-device layer)."""
        return dataclasses.replace(
            self,
            **{
                f.name: torch.empty_like(t, device=device)
                for f in dataclasses.fields(self)
                if (t := getattr(self, f.name)) is not None
            },
        )

    def fused(self, into: LayerWeights | None = None) -> LayerWeights:
        """This layer plus ``qkv`` = cat(q, k, v) and ``gate_up`` = cat(gate, up) (see
        ``LlamaWeights.fuse``)."""
        return dataclasses.replace(
            self,
            qkv=_cat([self.q, self.k, self.v], None if into is None else into.qkv),
            qkv_bias=_cat_bias(
                [self.q, self.k, self.v],
                [self.q_bias, self.k_bias, self.v_bias],
                None if into is None else into.qkv_bias,
            ),
            gate_up=_cat([self.gate, self.up], None if into is None else into.gate_up),
            gate_up_bias=_cat_bias(
                [self.gate, self.up],
                [self.gate_bias, self.up_bias],
                None if into is None else into.gate_up_bias,
            ),
        )


@dataclasses.dataclass
class LlamaWeights:
    """Views of a model's weights for one ``generate`` call (never kept across calls)."""

    embed: torch.Tensor
    layers: list[LayerWeights]
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    inv_freq: torch.Tensor
    attention_scaling: float
    eps: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tp: TensorParallel | None = None
    """Tensor-parallel slices (:mod:`klppo.rollout.tp`): heads, KV heads, MLP rows and vocabulary are this
    rank's; ``num_heads``/``num_kv_heads`` count local heads; None: the full model."""
    vocab_start: int = 0
    """First vocabulary id of this rank's ``embed``/``lm_head`` rows (tensor parallel)."""
    vocab_size: int = 0
    """The full vocabulary (tensor parallel; the rows are ``even_split(vocab_size, tp.size, tp.rank)``)."""

    @staticmethod
    def read(model: torch.nn.Module) -> LlamaWeights:
        model = base_model(model)
        config = model.config
        inner = model.model
        layers = [LayerWeights.read(layer) for layer in inner.layers]
        num_heads, num_kv_heads, head_dim = attention_dims(config)
        return LlamaWeights(
            embed=inner.embed_tokens.weight.detach(),
            layers=layers,
            final_norm=inner.norm.weight.detach(),
            lm_head=model.lm_head.weight.detach(),
            inv_freq=inner.rotary_emb.inv_freq,
            attention_scaling=float(getattr(inner.rotary_emb, "attention_scaling", 1.0)),
            eps=float(config.rms_norm_eps),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )

    def fuse(self, into: LlamaWeights | None = None) -> LlamaWeights:
        """These weights plus per-layer ``qkv`` = cat(q, k, v) and ``gate_up`` = cat(gate, up) (rows): new
        tensors (the caller frees them with the result), or written into ``into``'s (graphs stay valid)."""
        layers = [lw.fused(None if into is None else into.layers[i]) for i, lw in enumerate(self.layers)]
        return dataclasses.replace(self, layers=layers)

    def resident(self, into: LlamaWeights | None = None) -> LlamaWeights:
        """Fused weights (``fuse``) that the result owns entirely (every tensor a copy, the unfused
        projections views of the fused rows, tied tensors still tied), or written into ``into``'s: graphs
        captured on them outlive the model's addresses (FSDP2 re-gathers every step). One weight copy."""
        fused = self.fuse(into)
        copies: dict[tuple, torch.Tensor] = {}

        def own(t: torch.Tensor | None, dst: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))  # a tied tensor: copied once
            if key not in copies:
                copies[key] = t.clone() if dst is None else dst.copy_(t)
            return copies[key]

        def owned(obj, dst, names) -> dict:
            return {
                name: own(getattr(obj, name), None if dst is None else getattr(dst, name)) for name in names
            }

        layers = []
        for i, lw in enumerate(fused.layers):
            names = [f.name for f in dataclasses.fields(lw) if f.name not in _FUSED_SOURCES + _FUSED]
            mine = owned(lw, None if into is None else into.layers[i], names)
            mine.update({name: getattr(lw, name) for name in _FUSED})  # made by fuse (into `into`'s if given)
            layers.append(dataclasses.replace(lw, **mine, **_row_views(lw, mine)))
        return dataclasses.replace(fused, layers=layers, **owned(self, into, _MODEL_TENSORS))

    def tensors(self) -> list[torch.Tensor | None]:
        """Every weight tensor (None where absent): the model-level ones, then each layer's fields."""
        return [getattr(self, name) for name in _MODEL_TENSORS] + [
            getattr(lw, f.name) for lw in self.layers for f in dataclasses.fields(lw)
        ]

    def layout(self) -> tuple:
        """Shapes and dtypes of every weight: what graphs on :meth:`resident` copies depend on."""
        return tuple(None if t is None else (tuple(t.shape), t.dtype) for t in self.tensors())

    def signature(self) -> tuple[int, ...]:
        """Addresses of every weight: graphs captured on these stay valid while it is unchanged."""
        ptrs = [self.embed.data_ptr(), self.final_norm.data_ptr(), self.lm_head.data_ptr()]
        for layer in self.layers:
            for f in dataclasses.fields(layer):
                t = getattr(layer, f.name)
                ptrs.append(0 if t is None else t.data_ptr())
        return tuple(ptrs)


_MODEL_TENSORS = ("embed", "final_norm", "lm_head", "inv_freq")
_FUSED = ("qkv", "qkv_bias", "gate_up", "gate_up_bias")
_FUSED_SOURCES = ("q", "k", "v", "q_bias", "k_bias", "v_bias", "gate", "up", "gate_bias", "up_bias")


def _row_views(lw: LayerWeights, owned: dict) -> dict:
    """``q``/``k``/``v`` and ``gate``/``up`` (and biases) as views of the fused rows in ``owned``."""
    views = {}
    for fused, parts in (("qkv", ("q", "k", "v")), ("gate_up", ("gate", "up"))):
        start = 0
        for name in parts:
            rows = getattr(lw, name).shape[0]
            views[name] = owned[fused][start : start + rows]
            bias = owned[f"{fused}_bias"]
            if getattr(lw, f"{name}_bias") is not None:
                views[f"{name}_bias"] = bias[start : start + rows]
            start += rows
    return views


def _cat(parts: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    return torch.cat(parts, dim=0) if out is None else torch.cat(parts, dim=0, out=out)


def _cat_bias(weights: list[torch.Tensor], biases: list, out: torch.Tensor | None) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    parts = [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)]
    return _cat(parts, out)


def meta_layer(config: Any, dtype: torch.dtype) -> LayerWeights:
    """The first decoder layer of a model of Hugging Face ``config`` on the meta device (its structure, no
    memory); ``ValueError`` naming the reason where the engine cannot run such a model."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415  transformers off the light import path

    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1]
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reason = unsupported_reason(model, 0)
    if reason is not None:
        raise ValueError(reason)
    return LayerWeights.read(model.model.layers[0])


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one storage counted once; None skipped)."""
    storages = [t.untyped_storage() for t in tensors if t is not None]
    return sum({s.data_ptr(): s.nbytes() for s in storages}.values())
