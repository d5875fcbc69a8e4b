"""A functional forward pass of Llama-family decoders over a slot-indexed KV cache.

It runs on :class:`klppo.models.llama_weights.LlamaWeights`, views read from the Hugging Face module at call
time: no copy, no state-dict round trip, so under FSDP2 the caller gathers the shards, calls the engine, and
releases them.

Cache layout: one tensor ``kv`` [L, 2, num_slots, S, H_kv, D]; sequence ``s`` lives in slot
``slot(s)`` and its token at position ``p`` in ``kv[:, :, slot, p]``.

Decode attention: on CUDA in bf16/fp16 the split-KV kernels of :mod:`klppo.rollout.triton_attention`
(fused with the cache write), which on the full model also apply RoPE, on split layers
(:func:`decode_rope_in_attention`); elsewhere (CPU, fp32, the reference) SDPA over the whole length ``S``
with a mask (:func:`sdpa_attention`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import klppo.rollout.triton_attention as triton_attention
from klppo.models.llama_layers import attn_in, attn_out_mlp, embed_tokens, layer_back, rms_norm, rope_cos_sin
from klppo.models.llama_weights import LlamaWeights
from klppo.models.lm_head import lm_head_logits


def prefill(
    w: LlamaWeights,
    kv: torch.Tensor,
    tokens: torch.Tensor,
    slots: torch.Tensor,
    lengths: list[int],
    offsets: list[int] | None = None,
) -> torch.Tensor:
    """Run N packed prompts ``tokens`` [T] of ``lengths``, write their K/V into ``slots`` [N]; return the
    last-token hidden states [N, hidden]. Only attention pads (per prompt, causal, to the longest).
    ``offsets`` [N] (default 0): prompt i continues a slot that holds K/V ``[0, offsets[i])``: its tokens sit
    at positions ``offsets[i] ..`` and attend to that cached prefix and causally to themselves."""
    device = tokens.device
    num_seqs, max_len = len(lengths), max(lengths)
    offsets = offsets or [0] * num_seqs
    lengths_t, offsets_t = torch.tensor(lengths, device=device), torch.tensor(offsets, device=device)
    starts = torch.cumsum(lengths_t, 0) - lengths_t
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=device), lengths_t)
    local = torch.arange(tokens.shape[0], device=device) - starts[seq_of_token]
    positions = local + offsets_t[seq_of_token]
    slot_of_token = slots[seq_of_token]
    x = embed_tokens(w, tokens)
    back = layer_back(w)
    cos, sin = rope_cos_sin(w, positions, x.dtype)
    num_keys = max(o + n for o, n in zip(offsets, lengths))
    key_pos = torch.arange(num_keys, device=device)[None, None, :]
    query_pos = (torch.arange(max_len, device=device)[None, :] + offsets_t[:, None])[:, :, None]
    mask = ((key_pos <= query_pos) & (key_pos < (offsets_t + lengths_t)[:, None, None]))[:, None]
    group = w.num_heads // w.num_kv_heads
    spec = (w.num_heads, w.num_kv_heads, w.head_dim, w.eps)
    for i, lw in enumerate(w.layers):
        q, kv_new = attn_in(x, lw, cos, sin, spec)
        kv[i][:, slot_of_token, positions] = kv_new
        q_pad = q.new_zeros(num_seqs, max_len, w.num_heads, w.head_dim)
        q_pad[seq_of_token, local] = q
        k_pad = kv[i, 0, slots, :num_keys].transpose(1, 2).repeat_interleave(group, dim=1)
        v_pad = kv[i, 1, slots, :num_keys].transpose(1, 2).repeat_interleave(group, dim=1)
        attn = F.scaled_dot_product_attention(q_pad.transpose(1, 2), k_pad, v_pad, attn_mask=mask)
        attn = attn.transpose(1, 2)[seq_of_token, local].reshape(tokens.shape[0], -1)
        x = back(x, attn, lw, w.eps)
    last = starts + lengths_t - 1
    return rms_norm(x[last], w.final_norm, w.eps)


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
