"""A functional forward pass of Llama-family decoders over a slot-indexed KV cache.

It reads the weights from the given Hugging Face module *at call time* (``LlamaWeights.read``): no
copy, no state-dict round trip, so under FSDP2 the caller gathers the shards, calls the engine, and
releases them. Supported: Llama 2/3, Qwen2/2.5, Qwen3 (per-head q/k RMSNorm), Mistral, SmolLM2 — tied
embeddings, GQA, q/k/v biases, and any RoPE variant whose frequencies do not depend on the sequence
length (default, linear, llama3, yarn, longrope-free): the inverse frequencies are read from the
model's own rotary module so they match Hugging Face exactly.

Cache layout: one tensor ``kv`` [L, 2, num_slots, S, H_kv, D]; sequence ``s`` lives in slot
``slot(s)`` and its token at position ``p`` in ``kv[:, :, slot, p]``.

Decode attention: on CUDA in bf16/fp16 the split-KV kernels of :mod:`klppo.rollout.triton_attention`
(fused with the cache write), which on the full model also apply RoPE, on split layers
(:func:`decode_rope_in_attention`); elsewhere (CPU, fp32, the reference) SDPA over the whole length ``S``
with a mask (:func:`sdpa_attention`).

Optional fused projections (``LlamaWeights.fuse``): ``[q; k; v]`` and ``[gate; up]`` concatenated into
temporary tensors (one matmul instead of three / two); the caller owns and frees them.

Deliberately left out: sliding-window attention (refused when the window is shorter than the rollout),
dynamic RoPE, MoE, cross-attention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import klppo.rollout.triton_attention as triton_attention
from klppo.models.flops import attention_dims
from klppo.models.lm_head import lm_head_logits
from klppo.models.lora import base_model
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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``w * (x / sqrt(mean(x²) + eps))`` computed in float32, as Hugging Face does."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rope_cos_sin(w: LlamaWeights, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, D] for integer ``positions`` [T]."""
    freqs = positions[:, None].float() * w.inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * w.attention_scaling).to(dtype), (emb.sin() * w.attention_scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) · up`` for ``gate_up`` = [gate | up] (the last dim's halves)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _mlp(
    lw: LayerWeights, h: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor] = swiglu
) -> torch.Tensor:
    """The SwiGLU MLP of normed states ``h``; ``act``: :func:`swiglu` on the fused projection, or a kernel."""
    if lw.gate_up is not None:
        act_out = act(F.linear(h, lw.gate_up, lw.gate_up_bias))
    else:
        act_out = F.silu(F.linear(h, lw.gate, lw.gate_bias)) * F.linear(h, lw.up, lw.up_bias)
    return F.linear(act_out, lw.down, lw.down_bias)


def prefill(
    w: LlamaWeights,
    kv: torch.Tensor,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    lengths: list[int],
) -> torch.Tensor:
    """Run N packed prompts ``tokens`` [T] of ``lengths``, write their K/V into ``slots`` [N]; return the
    last-token hidden states [N, hidden]. Only attention pads (per prompt, causal, to the longest)."""
    device = tokens.device
    num_seqs, max_len = len(lengths), max(lengths)
    lengths_t = torch.tensor(lengths, device=device)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), lengths_t)
    positions = torch.arange(tokens.shape[0], device=device) - starts[seq_of_token]
    slot_of_token = slots[seq_of_token]
    x = embed_tokens(w, tokens)
    back = layer_back(w)
    cos, sin = rope_cos_sin(w, positions, x.dtype)
    key_pos = torch.arange(max_len, device=device)
    mask = (key_pos[None, :] <= key_pos[:, None])[None, None] & (key_pos < lengths_t[:, None])[:, None, None]
    group = w.num_heads // w.num_kv_heads
    spec = (w.num_heads, w.num_kv_heads, w.head_dim, w.eps)
    for i, lw in enumerate(w.layers):
        q, kv_new = attn_in(x, lw, cos, sin, spec)
        kv[i][:, slot_of_token, positions] = kv_new
        q_pad = q.new_zeros(num_seqs, max_len, w.num_heads, w.head_dim)
        q_pad[seq_of_token, positions] = q
        k_pad = kv[i, 0, slots, :max_len].transpose(1, 2).repeat_interleave(group, dim=1)
        v_pad = kv[i, 1, slots, :max_len].transpose(1, 2).repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k_pad, v_pad, attn_mask=mask)
        attn = attn.transpose(1, 2)[seq_of_token, positions].reshape(tokens.shape[0], -1)
        x = back(x, attn, lw, w.eps)
    last = starts + lengths_t - 1
    return rms_norm(x[last], w.final_norm, w.eps)


def attn_in(
    x: torch.Tensor, lw: LayerWeights, cos: torch.Tensor, sin: torch.Tensor, spec: tuple[int, int, int, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer front: norm, q/k/v (fused if ``lw.qkv``), q/k norm, RoPE. ``spec`` = (H, H_kv, D, eps).

    x [T, hidden] → q [T, H, D], kv_new [2, T, H_kv, D] (roped K stacked with V, ready for one cache write).
    """
    q, k, v = _qkv_heads(rms_norm(x, lw.input_norm, spec[3]), lw, spec)
    return apply_rope(q, cos, sin), torch.stack((apply_rope(k, cos, sin), v))


def _qkv_heads(
    h: torch.Tensor, lw: LayerWeights, spec: tuple[int, int, int, float]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Normed ``h`` [T, hidden] → q [T, H, D], k, v [T, H_kv, D]: projections and Qwen3's q/k norms."""
    num_heads, num_kv_heads, head_dim, eps = spec
    num_tokens = h.shape[0]
    if lw.qkv is not None:
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        q, k, v = F.linear(h, lw.qkv, lw.qkv_bias).split(sizes, dim=-1)
    else:
        q, k, v = F.linear(h, lw.q, lw.q_bias), F.linear(h, lw.k, lw.k_bias), F.linear(h, lw.v, lw.v_bias)
    q = q.reshape(num_tokens, num_heads, head_dim)
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    v = v.reshape(num_tokens, num_kv_heads, head_dim)
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, eps)
    if lw.k_norm is not None:
        k = rms_norm(k, lw.k_norm, eps)
    return q, k, v


def qkv_projection(h: torch.Tensor, lw: LayerWeights, spec: tuple[int, int, int, float]) -> torch.Tensor:
    """Normed ``h`` [T, hidden] → unrotated q/k/v side by side [T, (H + 2·H_kv)·D]: the fused GEMM's output
    itself unless Qwen3's q/k norms apply."""
    if lw.qkv is not None and lw.q_norm is None and lw.k_norm is None:
        return F.linear(h, lw.qkv, lw.qkv_bias)
    return torch.cat([t.flatten(1) for t in _qkv_heads(h, lw, spec)], dim=-1)


def residual_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``x + y`` in float32 rounded once (eager's bf16/fp16 result), so that Inductor fuses it into the
    sum's reader instead of a cuBLAS ``addmm`` that first copies ``x`` into the output."""
    return (x.float() + y.float()).to(x.dtype)


def attn_out_mlp(x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights, eps: float) -> torch.Tensor:
    """Decode-step layer back: output projection, residual (:func:`residual_add`), norm, SwiGLU MLP,
    residual."""
    x = residual_add(x, F.linear(attn, lw.o, lw.o_bias))
    return x + _mlp(lw, rms_norm(x, lw.post_norm, eps))


def attn_out_mlp_tp(
    x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights, eps: float, group: dist.ProcessGroup
) -> torch.Tensor:
    """``attn_out_mlp`` on tensor-parallel slices (:mod:`klppo.rollout.tp`): the row-parallel ``o`` and
    ``down`` partial sums are all-reduced over ``group`` before the replicated biases and residuals."""
    y = F.linear(attn, lw.o)
    dist.all_reduce(y, group=group)
    x = x + y if lw.o_bias is None else x + y + lw.o_bias
    h = rms_norm(x, lw.post_norm, eps)
    if lw.gate_up is not None:
        gate, up = F.linear(h, lw.gate_up, lw.gate_up_bias).chunk(2, dim=-1)
    else:
        gate, up = F.linear(h, lw.gate, lw.gate_bias), F.linear(h, lw.up, lw.up_bias)
    m = F.linear(F.silu(gate) * up, lw.down)
    dist.all_reduce(m, group=group)
    return x + m if lw.down_bias is None else x + m + lw.down_bias


def layer_back(w: LlamaWeights):
    """The eager layer back for ``w``: ``attn_out_mlp``, or its tensor-parallel form."""
    if w.tp is None:
        return attn_out_mlp
    group = w.tp.group
    return lambda x, attn, lw, eps: attn_out_mlp_tp(x, attn, lw, eps, group)


def embed_tokens(w: LlamaWeights, tokens: torch.Tensor) -> torch.Tensor:
    """[T] ids → [T, hidden]; tensor parallel: each rank's vocabulary rows (zeros elsewhere), summed."""
    if w.tp is None:
        return F.embedding(tokens, w.embed)
    local = tokens - w.vocab_start
    inside = (local >= 0) & (local < w.embed.shape[0])
    x = F.embedding(local.clamp(0, w.embed.shape[0] - 1), w.embed) * inside[:, None].to(w.embed.dtype)
    dist.all_reduce(x, group=w.tp.group)
    return x


def triton_attention_of(w: LlamaWeights, kv: torch.Tensor, positions: torch.Tensor) -> Callable:
    """``(layer, q [B, H, D], kv_new [2, B, H_kv, D]) -> attention [B, H, D]`` of one decode step on
    :mod:`klppo.rollout.triton_attention`'s kernels, which also write the cache."""
    splits = triton_attention.device_splits(positions.device, positions.shape[0], w.num_kv_heads, kv.shape[3])
    return lambda i, q, kv_new: triton_attention.decode_attention(q, kv_new, kv[i], positions, splits=splits)


def sdpa_attention(w: LlamaWeights, kv: torch.Tensor, positions: torch.Tensor) -> Callable:
    """As :func:`triton_attention_of`, in torch: the cache write, then masked SDPA over the whole ``S``."""
    num_slots, device = positions.shape[0], positions.device
    max_len = kv.shape[3]
    slot_idx = torch.arange(num_slots, device=device)
    group = w.num_heads // w.num_kv_heads
    mask = (torch.arange(max_len, device=device)[None, :] <= positions[:, None])[:, None, None, :]

    def attend(i: int, q: torch.Tensor, kv_new: torch.Tensor) -> torch.Tensor:
        kv[i][:, slot_idx, positions] = kv_new
        # GQA without expanding K/V: the query heads of one KV head act as a length-`group` query.
        q = q.reshape(num_slots, w.num_kv_heads, group, w.head_dim)
        k, v = kv[i, 0, :num_slots].transpose(1, 2), kv[i, 1, :num_slots].transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    return attend


def decode(
    w: LlamaWeights,
    kv: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    layer_fns: tuple = (attn_in, attn_out_mlp),
    attention: Callable = sdpa_attention,
    fp32_logits: bool = False,
) -> torch.Tensor:
    """One token for each of the first B slots (``tokens``/``positions`` [B]) → logits [B, V]; static
    shapes (CUDA-graph capturable). ``layer_fns``: (front, back), eager, compiled or tensor-parallel;
    ``attention``: :func:`sdpa_attention` or :func:`triton_attention_of`."""
    front, back = layer_fns
    num_slots = tokens.shape[0]
    x = embed_tokens(w, tokens)
    cos, sin = rope_cos_sin(w, positions, x.dtype)
    attend = attention(w, kv, positions)
    spec = (w.num_heads, w.num_kv_heads, w.head_dim, w.eps)
    for i, lw in enumerate(w.layers):
        q, kv_new = front(x, lw, cos, sin, spec)
        attn = attend(i, q, kv_new)
        x = back(x, attn.reshape(num_slots, -1), lw, w.eps)
    return logits_of(w, rms_norm(x, w.final_norm, w.eps), fp32_logits)


def decode_rope_in_attention(
    w: LlamaWeights,
    kv: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    layer_fns: tuple,
    fp32_logits: bool = False,
) -> torch.Tensor:
    """``decode`` on split layers (``layer_fns``: front, back, final of :mod:`klppo.rollout.triton_layers`):
    the attention kernel rotates the unrotated q/k/v and writes the cache, and each layer's MLP output is
    added to the residual by the next front (or the final norm) — two kernels and a copy fewer per layer,
    the same arithmetic as the unsplit layers. Not for tensor-parallel slices."""
    front, back, final = layer_fns
    num_slots = tokens.shape[0]
    heads, kv_heads, head_dim = w.num_heads, w.num_kv_heads, w.head_dim
    x = embed_tokens(w, tokens)
    rope = rope_cos_sin(w, positions, x.dtype)
    splits = triton_attention.device_splits(positions.device, num_slots, kv_heads, kv.shape[3])
    spec = (heads, kv_heads, head_dim, w.eps)
    m = None
    for i, lw in enumerate(w.layers):
        x, qkv = front(x, m, lw, spec)
        attn = split_attention(qkv, kv[i], positions, splits, rope, (heads, kv_heads, head_dim))
        x, m = back(x, attn.reshape(num_slots, -1), lw, w.eps)
    return logits_of(w, final(x, m, (w.final_norm, w.eps)), fp32_logits)


def split_attention(
    qkv: torch.Tensor,
    cache: torch.Tensor,
    positions: torch.Tensor,
    splits: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    dims: tuple[int, int, int],
) -> torch.Tensor:
    """One split layer's attention: q and the new K/V as views of the unrotated ``qkv`` [B, (H + 2·H_kv)·D]
    (``dims`` = (H, H_kv, D)), rotated by ``rope`` and written into ``cache`` by the split-KV kernels."""
    heads, kv_heads, head_dim = dims
    num_slots = qkv.shape[0]
    q = qkv[:, : heads * head_dim].view(num_slots, heads, head_dim)
    kv_new = qkv[:, heads * head_dim :].view(num_slots, 2, kv_heads, head_dim).transpose(0, 1)
    return triton_attention.decode_attention(q, kv_new, cache, positions, splits=splits, rope=rope)


def logits_of(w: LlamaWeights, hidden: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """[N, hidden] final-normed states → [N, V] logits: in the model's dtype, or float32 with ``fp32``
    (:func:`klppo.models.lm_head.lm_head_logits`); prefill and decode use the same setting."""
    return lm_head_logits(hidden, w.lm_head, fp32)
