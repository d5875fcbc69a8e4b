"""Ulysses sequence parallelism over packed (padding-free) rows.

The ``S`` ranks of a :class:`~klppo.parallel.mesh.SequenceParallel` group hold the same micro-batch. It is
packed into one row of ``T`` tokens (:func:`klppo.batching.packing.pack`), padded to ``T' = S·⌈T/S⌉``
with a dummy sequence of its own at the end, and rank ``s`` runs the model on tokens
``[s·T'/S, (s+1)·T'/S)`` only: embeddings, MLPs, norms and the LM head see ``T'/S`` tokens. Attention
needs every token of a sequence, so around it an all-to-all switches from sequence to head sharding
(``q, k, v`` [1, H, T'/S, D] → [1, H/S, T', D]), the packed varlen attention runs on ``H/S`` heads of the
whole row, and a second all-to-all switches back. GQA models with fewer KV heads than ``S`` replicate
each KV head ``S / H_kv`` times first (``H_q`` must be a multiple of ``S``, ``H_kv`` a multiple or a
divisor of it). Per-token results (log-probs, entropy, values) are all-gathered back to the full row.

Gradients: the all-to-all's backward is the inverse all-to-all. Every rank of a group computes the same
loss on the gathered results, so the gather's backward keeps this rank's slice of the (identical) output
gradient; FSDP then averages over all ``dp × sp`` ranks, which the roles' loss weight (× world size, token
counts over the ``dp`` groups) turns into the data-parallel mean. The attention implementation
``"klppo_ulysses"`` is ``"klppo_packed"`` unless the forward carries ``ulysses_group`` (padded passes and
generation are unchanged).
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from klppo.batch import Batch
from klppo.batching.attention import _packed_mask, packed_attention_forward
from klppo.batching.packing import (
    _head,
    _packed_sources,
    _response_columns,
    _scatter_response,
    pack,
)
from klppo.parallel.collectives import group_all_gather
from klppo.parallel.mesh import SequenceParallel

ULYSSES_ATTENTION = "klppo_ulysses"


# ---- collectives with autograd ---------------------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Chunk ``i`` of dim 0 goes to rank ``i``; chunk ``i`` of the result came from rank ``i``."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[1, H, T/S, D] (this rank's tokens, all heads) → [1, H/S, T, D] (all tokens, this rank's heads)."""
    size = dist.get_world_size(group)
    _, h, t, d = x.shape
    out = _all_to_all(x.reshape(size, h // size, t, d), group)  # [S(source = token chunk), H/S, T/S, D]
    return out.transpose(0, 1).reshape(1, h // size, size * t, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Inverse of :func:`_seq_to_heads`: [1, H/S, T, D] → [1, H, T/S, D]."""
    size = dist.get_world_size(group)
    _, h, t, d = x.shape
    send = x.reshape(h, size, t // size, d).transpose(0, 1)  # [S(dest = token chunk), H/S, T/S, D]
    out = _all_to_all(send, group)  # [S(source = head chunk), H/S, T/S, D]
    return out.reshape(1, h * size, t // size, d)


class SeqToHeads(torch.autograd.Function):
    """:func:`_seq_to_heads` with the inverse all-to-all as its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_seq(grad, ctx.group), None


class HeadsToSeq(torch.autograd.Function):
    """:func:`_heads_to_seq` with the inverse all-to-all as its backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _seq_to_heads(grad, ctx.group), None


class GatherTokens(torch.autograd.Function):
    """[n, ...] per rank → [S·n, ...] in rank order; the backward keeps this rank's slice of the gradient
    (every rank of the group computes the same loss from the gathered tensor, see the module docstring)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        ctx.n = x.shape[0]
        return group_all_gather(x, group).flatten(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        r = dist.get_rank(ctx.group)
        return grad[r * ctx.n : (r + 1) * ctx.n].contiguous(), None


def seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return HeadsToSeq.apply(x, group)


# ---- attention -----------------------------------------------------------------------------------------
def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """ValueError unless ``num_heads`` splits over ``size`` ranks and KV heads split or replicate evenly."""
    if num_heads % size or (num_kv_heads % size and size % num_kv_heads):
        raise ValueError(
            f"ulysses_sequence_parallel_size={size} needs num_attention_heads ({num_heads}) divisible by it "
            f"and num_key_value_heads ({num_kv_heads}) a multiple or a divisor of it"
        )


def ulysses_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface; with ``ulysses_group`` in the kwargs, q [1, Hq, T/S, D] and k/v
    [1, Hkv, T/S, D] of this rank's tokens → [1, T/S, Hq, D] (attention over the whole packed row)."""
    group = kwargs.pop("ulysses_group", None)
    if group is None:
        return packed_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    size = dist.get_world_size(group)
    check_heads(query.shape[1], key.shape[1], size)
    if key.shape[1] < size:  # replicate KV heads: new head j is old head j // (S / Hkv)
        repeat = size // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (seq_to_heads(x, group) for x in (query, key, value))
    out, _ = packed_attention_forward(module, q, k, v, None, dropout, scaling, **kwargs)  # [1, T, Hq/S, D]
    out = heads_to_seq(out.transpose(1, 2), group)  # [1, Hq, T/S, D]
    return out.transpose(1, 2), None


@functools.cache
def register_ulysses_attention() -> str:
    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention_forward)
    AttentionMaskInterface.register(ULYSSES_ATTENTION, _packed_mask)
    return ULYSSES_ATTENTION


def enable_ulysses_attention(model: torch.nn.Module, size: int) -> None:
    """Switch ``model`` to ``klppo_ulysses`` (``klppo_packed`` plus the all-to-alls); ValueError when its
    heads do not split over ``size`` ranks."""
    config = model.config
    check_heads(
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        size,
    )
    name = register_ulysses_attention()
    model.set_attn_implementation(name)
    if getattr(model.config, "_attn_implementation", None) != name:
        raise RuntimeError(f"{type(model).__name__} refused attention implementation {name!r}")


def _require_ulysses_attention(model: torch.nn.Module) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != ULYSSES_ATTENTION:
        raise ValueError(
            f"a sequence-parallel forward needs attn_implementation={ULYSSES_ATTENTION!r} (got {impl!r}): "
            "call klppo.parallel.ulysses.enable_ulysses_attention(model, size) once"
        )


# ---- forward passes ------------------------------------------------------------------------------------
class _Slice:
    """A packed micro-batch padded to a multiple of ``S`` tokens and this rank's contiguous share of it."""

    def __init__(self, input_ids, attention_mask, position_ids, sp: SequenceParallel) -> None:
        self.packed = pack(input_ids, attention_mask, position_ids)
        total = self.packed.input_ids.shape[1]
        pad = (-total) % sp.size
        self.chunk = (total + pad) // sp.size
        self.start = sp.rank * self.chunk
        cu = self.packed.cu_seqlens
        if pad:  # the padding is a sequence of its own: no real token attends to it
            cu = torch.cat([cu, cu[-1:] + pad])
        end = self.start + self.chunk
        self.input_ids = F.pad(self.packed.input_ids, (0, pad))[:, self.start : end]
        self.position_ids = F.pad(self.packed.position_ids, (0, pad))[:, self.start : end]
        self.kwargs = {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max(self.packed.max_seqlen, pad),
            "max_length_k": max(self.packed.max_seqlen, pad),
            "ulysses_group": sp.group,
        }

    def local(self, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(which of the packed indices ``src`` are on this rank, their local indices)."""
        mine = (src >= self.start) & (src < self.start + self.chunk)
        return mine, src[mine] - self.start

    def gather(self, values: torch.Tensor, at: torch.Tensor, sp: SequenceParallel) -> torch.Tensor:
        """values [n] at local positions ``at`` → [T'] over the whole padded row (zeros elsewhere)."""
        full = values.new_zeros(self.chunk).index_put((at,), values)
        return GatherTokens.apply(full, sp.group)


def forward_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    *,
    response_length: int,
    temperature: float,
    calculate_entropy: bool,
    sp: SequenceParallel,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`klppo.batching.packing.forward_log_probs` (packed; ``fused``: from the LM head in chunks) with
    this rank running ``T'/S`` tokens; the same [B, R] float32 log-probs (and entropy) on every rank of the
    group."""
    _require_ulysses_attention(model)
    target = _response_columns(attention_mask, response_length)
    labels = input_ids[:, input_ids.shape[1] - response_length :][target]
    part = _Slice(input_ids, attention_mask, position_ids, sp)
    src = _packed_sources(part.packed, target)
    mine, at = part.local(src)
    with _head(model, labels[mine].unsqueeze(0), temperature, calculate_entropy, fused) as head_out:
        out = model(
            input_ids=part.input_ids,
            position_ids=part.position_ids,
            attention_mask=None,
            logits_to_keep=at,
            use_cache=False,
            **part.kwargs,
        )
    log_probs, entropy = head_out(out.logits[0], labels[mine])
    log_probs = _scatter_response(part.gather(log_probs, at, sp)[src], target)
    if entropy is not None:
        entropy = _scatter_response(part.gather(entropy, at, sp)[src], target)
    return log_probs, entropy


def forward_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor | None,
    *,
    response_length: int,
    sp: SequenceParallel,
) -> torch.Tensor:
    """:func:`klppo.batching.packing.forward_values` (packed) with this rank running ``T'/S`` tokens."""
    _require_ulysses_attention(model)
    target = _response_columns(attention_mask, response_length)
    part = _Slice(input_ids, attention_mask, position_ids, sp)
    src = _packed_sources(part.packed, target)
    out = model(
        input_ids=part.input_ids,
        position_ids=part.position_ids,
        attention_mask=None,
        use_cache=False,
        **part.kwargs,
    )
    values = GatherTokens.apply(out.logits[0, :, 0].float().contiguous(), sp.group)
    return _scatter_response(values[src], target)


def gather_group_rows(batch: Batch, sp: SequenceParallel) -> Batch:
    """The rows of every rank of the group (rank order), for a forward pass the group runs together; only
    the fields a forward reads (prompts, responses and their masks). Every rank must hold as many rows of
    the same widths (each rank's share of a step)."""

    def cat(t: torch.Tensor) -> torch.Tensor:
        return group_all_gather(t, sp.group).flatten(0, 1)

    return Batch(
        prompts=cat(batch.prompts),
        prompt_mask=cat(batch.prompt_mask),
        responses=cat(batch.responses),
        response_mask=cat(batch.response_mask),
    )
