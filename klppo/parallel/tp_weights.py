"""A tensor-parallel rollout's weights: this rank's slices of the actor, resharded straight from the FSDP2
shards (:func:`reshard_for_rollout`, one all-to-all per FSDP unit, no rank holds a full weight) into the
engine's fused destinations (:func:`fused_destinations`), and viewed as
:class:`klppo.models.llama_weights.LlamaWeights` of local heads and vocabulary rows (:func:`tp_weights`).
Which slice of each weight a rank takes: :class:`klppo.parallel.tp_layout.TPLayout`.
"""

from __future__ import annotations

import torch

from klppo.models.llama_weights import _LAYER_PATHS, LayerWeights, LlamaWeights
from klppo.models.lora import base_model
from klppo.parallel.mesh import TensorParallel
from klppo.parallel.reshard import even_split, reshard
from klppo.parallel.tp_layout import TPLayout

_FUSED = {  # LayerWeights fused field -> the parameters it concatenates (rows), as in LayerWeights.fused
    "qkv": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "qkv_bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "gate_up": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "gate_up_bias": ("mlp.gate_proj.bias", "mlp.up_proj.bias"),
}


def fused_destinations(
    model: torch.nn.Module, layout: TPLayout, t: int, *, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """The engine's fused ``[q; k; v]`` and ``[gate; up]`` (and biases when every part has one) allocated up
    front, keyed ``model.layers.{i}.<fused field>``, with their parts as views keyed by parameter name: the
    reshard writes each slice straight into its rows (no second copy)."""
    hf = base_model(model)
    named = dict(hf.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for i in range(len(hf.model.layers)):
        for field, paths in _FUSED.items():
            names = [f"model.layers.{i}.{path}" for path in paths]
            if not all(n in named for n in names):
                continue  # no biases (or only some: the engine adds zeros for the others itself)
            shapes = [layout.region(n, named[n].shape, t).shape(named[n].shape) for n in names]
            whole = torch.empty((sum(s[0] for s in shapes), *shapes[0][1:]), dtype=dtype, device=device)
            out[f"model.layers.{i}.{field}"] = whole
            for n, part in zip(names, whole.split([s[0] for s in shapes])):
                out[n] = part
    return out


def tp_weights(
    model: torch.nn.Module, tensors: dict[str, torch.Tensor], layout: TPLayout, tp: TensorParallel
) -> LlamaWeights:
    """``LlamaWeights`` of this rank's slices ``tensors`` (by name; fused ones from
    :func:`fused_destinations`)."""
    hf = base_model(model)
    layers = []
    for i in range(len(hf.model.layers)):
        prefix = f"model.layers.{i}."
        fields = {f: tensors.get(prefix + path) for f, path in _LAYER_PATHS.items()}
        layers.append(LayerWeights(**fields, **{f: tensors.get(prefix + f) for f in _FUSED}))
    embed = tensors["model.embed_tokens.weight"]
    vocab_size = int(hf.model.embed_tokens.weight.shape[0])
    return LlamaWeights(
        embed=embed,
        layers=layers,
        final_norm=tensors["model.norm.weight"],
        lm_head=tensors.get("lm_head.weight", embed),  # tied: one parameter, one slice
        inv_freq=hf.model.rotary_emb.inv_freq,
        attention_scaling=float(getattr(hf.model.rotary_emb, "attention_scaling", 1.0)),
        eps=float(hf.config.rms_norm_eps),
        num_heads=layout.local_heads,
        num_kv_heads=layout.local_kv_heads,
        head_dim=layout.head_dim,
        tp=tp,
        vocab_start=even_split(vocab_size, tp.size, tp.rank)[0],
        vocab_size=vocab_size,
    )


def reshard_for_rollout(
    model: torch.nn.Module,
    tp: TensorParallel,
    *,
    device: torch.device,
    into: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's slices of the FSDP2-sharded ``model``, by parameter name (a collective of all ranks)."""
    layout = TPLayout.of(base_model(model).config, tp.size)
    return reshard(
        model, lambda name, shape, d: layout.region(name, shape, d % tp.size), device=device, into=into
    )
