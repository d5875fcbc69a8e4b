"""Compiled decoder layers for the packed training forwards (``*.model.compile_packed_layers``, a klppo
extension of verl's configuration).

:func:`compile_packed_layers` gives every decoder layer of a Hugging Face model (the modules that
transformers checkpoints: ``GradientCheckpointingLayer``) a forward that runs ``torch.compile``-d code when
it is called on a packed row (the call carries ``cu_seq_lens_q``, :mod:`klppo.batching.packing`), and the
original eager code otherwise (generation with a KV cache, padded batches). What is compiled is the layer's
forward only: FSDP2's hooks and gradient checkpointing stay around it, eager. One compiled function per
layer class serves all layers of the model (and the reference's copy): the layers differ only by their
parameters, which are inputs of the graph.

A packed micro-batch runs unpadded, its token dim (hidden states, positions, rotary cos/sin) and
``cu_seq_lens`` marked dynamic (``maybe_mark_dynamic``, as the rollout engine marks its batch dim), so one
graph per grad mode serves every micro-batch after the first two shapes (the second turns the changed sizes
symbolic).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

RECOMPILE_LIMIT = 64  # distinct (tokens, sequences, max length, grad mode) shapes per layer class
_COMPILED: dict[type, Any] = {}
_SUBCLASSES: dict[type, type] = {}


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks (transformers' ``GradientCheckpointingLayer`` modules)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_packed_layers(model: torch.nn.Module) -> int:
    """Compile ``model``'s decoder layers for packed calls (module docstring); returns how many. Raises
    ValueError when the model has none (the key names it)."""
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(
            f"model.compile_packed_layers: {type(model).__name__} has no transformers decoder layers "
            "(GradientCheckpointingLayer) to compile; set it to False"
        )
    limit = getattr(torch._dynamo.config, "recompile_limit", None)
    if limit is not None and limit < RECOMPILE_LIMIT:
        torch._dynamo.config.recompile_limit = RECOMPILE_LIMIT
    for layer in layers:
        layer.__class__ = _packed_subclass(type(layer))
    return len(layers)


def _compiled(cls: type) -> Any:
    """The compiled ``cls.forward``, dynamic where the dims are marked (:func:`_mark_token_dims`)."""
    if cls not in _COMPILED:
        _COMPILED[cls] = torch.compile(cls.forward, dynamic=None)
    return _COMPILED[cls]


def _mark_token_dims(args: tuple, kwargs: dict[str, Any]) -> None:
    """Mark the packed row's token dim (hidden states, rotary cos/sin, position ids: dim 1) and the
    sequence-boundary vectors (dim 0) dynamic."""
    hidden = args[0] if args else kwargs.get("hidden_states")
    tokens = [hidden, kwargs.get("position_ids"), *(kwargs.get("position_embeddings") or ())]
    for t in tokens:
        if isinstance(t, torch.Tensor) and t.dim() > 1:
            torch._dynamo.maybe_mark_dynamic(t, 1)
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        if isinstance(kwargs.get(name), torch.Tensor):
            torch._dynamo.maybe_mark_dynamic(kwargs[name], 0)


def _packed_subclass(cls: type) -> type:
    """``cls`` with a forward that runs the compiled ``cls.forward`` on packed calls."""
    if cls in _SUBCLASSES.values():
        return cls
    if cls not in _SUBCLASSES:

        def forward(self, *args, **kwargs):
            if kwargs.get("cu_seq_lens_q") is None:
                return cls.forward(self, *args, **kwargs)
            _mark_token_dims(args, kwargs)
            return _compiled(cls)(self, *args, **kwargs)

        # same name as ``cls``: lookups by class name (FSDP units from _no_split_modules) still find it
        namespace = {"forward": forward, "klppo_compiled": True, "__qualname__": cls.__qualname__}
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return _SUBCLASSES[cls]
