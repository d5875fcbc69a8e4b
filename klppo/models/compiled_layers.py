"""Compiled decoder layers for the packed training forwards (``*.model.compile_packed_layers``, a klppo
extension of verl's configuration).

:func:`compile_packed_layers` gives every decoder layer of a Hugging Face model (the modules that
transformers checkpoints: ``GradientCheckpointingLayer``) a forward that runs ``torch.compile``-d code when
it is called on a packed row (the call carries ``cu_seq_lens_q``, :mod:`klppo.batching.packing`), and the
original eager code otherwise (generation with a KV cache, padded batches). What is compiled is the layer's
forward only: FSDP2's hooks and gradient checkpointing stay around it, eager. One compiled function per
layer class serves all layers of the model (and the reference's copy): the layers differ only by their
parameters, which are inputs of the graph.

By default the token and sequence dims are dynamic: a packed micro-batch runs unpadded, its token dim
(hidden states, positions, rotary cos/sin) and ``cu_seq_lens`` marked dynamic (``maybe_mark_dynamic``, as
the rollout engine marks its batch dim), so one graph per grad mode serves every micro-batch after the
first two shapes (the second turns the changed sizes symbolic). Unpadded micro-batches do less work than
the padded buckets below where token counts vary, cost the same where micro-batches are of fixed size (which
the buckets never pad), and compile no more in a run's first steps.

``KLPPO_COMPILE_DYNAMIC_TOKENS=0`` (or ``compile_packed_layers(model, dynamic_tokens=False)``) selects the
static buckets instead: a packed micro-batch of ``T`` real tokens is padded up by :func:`pad_packed_call` to
a bucket of :func:`token_bucket` (``T`` rounded up to its 3 leading bits: 4, 5, 6 or 7 × 2^k, at most 25%
padding, four sizes per octave), ``cu_seq_lens`` to a power-of-two number of sequences, and the
longest-sequence bound to a power of two; each bucket is compiled once (forward and backward, exact sizes
for inductor's kernel choice), each new bucket one more compilation.

The padding is one extra sequence after the real ones (token id 0, positions from 0) plus zero-length
sequences: attention is block-diagonal over ``cu_seq_lens``, every other op of a layer is per token, so
real tokens never see it, and no log-prob or value is read at a padding position — outputs and gradients
are those of the unpadded row (``tests/models/test_compiled_layers.py``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers.modeling_layers import GradientCheckpointingLayer

MIN_TOKEN_BUCKET = 64
RECOMPILE_LIMIT = 64  # distinct (tokens, sequences, max length, grad mode) shapes per layer class
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def dynamic_tokens_from_env(environ: Any = os.environ) -> bool:
    """``KLPPO_COMPILE_DYNAMIC_TOKENS``: unset or empty → dynamic token dims (the default);
    ``0/false/no/off`` → the static buckets; ``1/true/yes/on`` → dynamic; anything else is an
    error naming the variable."""
    raw = environ.get("KLPPO_COMPILE_DYNAMIC_TOKENS")
    value = (raw or "").strip().lower()
    if not value or value in _TRUE:  # unset or empty: the default
        return True
    if value in _FALSE:
        return False
    raise ValueError(
        f"KLPPO_COMPILE_DYNAMIC_TOKENS={raw!r}: expected 1/true/yes/on (dynamic token dims, the default) or "
        "0/false/no/off (the static token buckets)"
    )


# compile_packed_layers' default for dynamic_tokens (None: read KLPPO_COMPILE_DYNAMIC_TOKENS when a model is
# compiled), which bench/ppo_step.py's dynamic_tokens variants set
DYNAMIC_TOKENS: bool | None = None
_COMPILED: dict[tuple[type, bool], Any] = {}
_SUBCLASSES: dict[type, type] = {}


def token_bucket(tokens: int) -> int:
    """Smallest ``m · 2^k ≥ tokens`` with ``m ∈ {4, 5, 6, 7}`` (and at least :data:`MIN_TOKEN_BUCKET`)."""
    n = max(int(tokens), MIN_TOKEN_BUCKET)
    step = 1 << max(0, n.bit_length() - 3)
    return -(-n // step) * step


def _pow2_ceil(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def pad_packed_call(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of a packed forward call, padded to the buckets when ``model``'s layers are
    compiled (:func:`compile_packed_layers`); unchanged otherwise. Needs no device sync: the sizes are
    shapes, the new entries are written on the device."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None or not getattr(model, "klppo_packed_buckets", False):
        return kwargs
    ids, pos = kwargs["input_ids"], kwargs["position_ids"]
    tokens = ids.shape[1]
    bucket = token_bucket(tokens)
    pad = bucket - tokens
    entries = _pow2_ceil(cu.numel()) + 1  # the real sequences and the padding one, bucketed, + 1
    cu = torch.cat([cu, cu.new_full((entries - cu.numel(),), bucket)])
    max_len = min(_pow2_ceil(max(int(kwargs["max_length_q"]), pad, 1)), bucket)
    return {
        **kwargs,
        "input_ids": torch.cat([ids, ids.new_zeros((1, pad))], dim=1),
        "position_ids": torch.cat([pos, torch.arange(pad, device=pos.device, dtype=pos.dtype)[None]], dim=1),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's transformer blocks (transformers' ``GradientCheckpointingLayer`` modules)."""
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def compile_packed_layers(model: torch.nn.Module, dynamic_tokens: bool | None = None) -> int:
    """Compile ``model``'s decoder layers for packed calls (module docstring); returns how many. Raises
    ValueError when the model has none (the key names it). ``dynamic_tokens`` (default: :data:`DYNAMIC_TOKENS`,
    else the environment, :func:`dynamic_tokens_from_env`): unpadded calls with dynamic token and sequence
    dims; False: the static token buckets."""
    if dynamic_tokens is None:
        dynamic_tokens = DYNAMIC_TOKENS if DYNAMIC_TOKENS is not None else dynamic_tokens_from_env()
    dynamic = bool(dynamic_tokens)  # a stored attribute and a compile-cache key: exactly True or False
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
        layer.klppo_dynamic_tokens = dynamic
    model.klppo_packed_buckets = not dynamic
    return len(layers)


def _compiled(cls: type, dynamic: bool) -> Any:
    """The compiled ``cls.forward``: static shapes (the buckets), or dynamic where the dims are marked."""
    key = (cls, dynamic)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(cls.forward, dynamic=None if dynamic else False)
    return _COMPILED[key]


def _mark_token_dims(args: tuple, kwargs: dict[str, Any]) -> None:
    """Mark the packed row's token dim (hidden states, rotary cos/sin, position ids: dim 1) and the
    sequence-boundary vectors (dim 0) dynamic for the unpadded calls."""
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
            dynamic = self.klppo_dynamic_tokens
            if dynamic:
                _mark_token_dims(args, kwargs)
            return _compiled(cls, dynamic)(self, *args, **kwargs)

        # same name as ``cls``: lookups by class name (FSDP units from _no_split_modules) still find it
        namespace = {"forward": forward, "klppo_compiled": True, "__qualname__": cls.__qualname__}
        _SUBCLASSES[cls] = type(cls.__name__, (cls,), namespace)
    return _SUBCLASSES[cls]
