"""The engine's device memory for one ``generate`` shape: the KV cache, the per-slot decode state, the
output buffers, the fused weight copies and the decode graphs that point at them.

Sizing (:func:`num_slots`): on CUDA, as many slots as fit ``gpu_memory_utilization × total device
memory`` once everything already allocated (fused copies included) and a prefill workspace for
``max_prefill_tokens`` tokens are counted, capped at the sequence count and ``max_num_seqs``; the ranks
of a tensor-parallel group agree on the minimum. On CPU: the sequence count, or ``max_num_seqs``.
"""

from __future__ import annotations

import dataclasses

import torch

from klppo.models.llama_weights import LlamaWeights, storage_bytes
from klppo.parallel.collectives import all_reduce_min
from klppo.rollout.graphs import DecodeGraphs
from klppo.rollout.settings import EngineSettings


def slot_bytes(*, layers: int, kv_heads: int, head_dim: int, max_len: int, vocab: int, elt: int) -> int:
    """Device bytes one decode slot takes: its K and V at ``max_len`` positions (``elt`` bytes per
    element), and 32 bytes per vocabulary entry of decode temporaries (float32 logits, sampler buffers)."""
    return layers * 2 * kv_heads * max_len * head_dim * elt + vocab * 4 * 8


def num_slots(
    w: LlamaWeights, device: torch.device, num_seqs: int, max_len: int, settings: EngineSettings
) -> int:
    """Slots that fit ``settings``' memory budget, given everything allocated now (module docstring)."""
    cap = min(num_seqs, settings.max_num_seqs or num_seqs)
    if device.type != "cuda":
        return cap
    elt = w.embed.element_size()
    hidden, vocab = w.embed.shape[1], w.lm_head.shape[0]
    inter = w.layers[0].gate.shape[0]
    per_slot = slot_bytes(
        layers=len(w.layers),
        kv_heads=w.num_kv_heads,
        head_dim=w.head_dim,
        max_len=max_len,
        vocab=vocab,
        elt=elt,
    )
    workspace = settings.max_prefill_tokens * (3 * inter + 8 * hidden + 4 * w.num_heads * w.head_dim) * elt
    total = torch.cuda.get_device_properties(device).total_memory
    free = settings.gpu_memory_utilization * total - torch.cuda.memory_allocated(device) - workspace
    slots = int(free // per_slot)
    if w.tp is not None:  # the ranks of a tensor-parallel group run the same slots in lockstep
        slots = int(all_reduce_min(slots, w.tp.group))
    if slots < 1:
        raise ValueError(
            f"gpu_memory_utilization={settings.gpu_memory_utilization} leaves no room for a KV cache "
            f"({torch.cuda.memory_allocated(device) / 2**30:.1f} GiB already allocated)"
        )
    return min(cap, slots)


@dataclasses.dataclass
class Workspace:
    """Everything the decode graphs point at. State tensors are indexed by slot, outputs by sequence."""

    key: tuple  # the call shape it was made for (reused by a later call with the same key)
    kv: torch.Tensor  # [L, 2, slots, S, H_kv, D]
    weights: LlamaWeights | None  # the fused concatenations, else None (given fused: tensor parallel)
    last_token: torch.Tensor  # [slots] token to feed next
    position: torch.Tensor  # [slots] cache position it is written at
    seq_id: torch.Tensor  # [slots] sequence in the slot (num_seqs = none)
    gen_len: torch.Tensor  # [slots] tokens generated so far
    finished: torch.Tensor  # [slots] bool; a free slot counts as finished
    out_tokens: torch.Tensor  # [num_seqs + 1, R] (last row: sink for idle slots)
    out_log_probs: torch.Tensor  # [num_seqs + 1, R]
    out_truncated: torch.Tensor | None  # [num_seqs + 1, R] the truncated law's log-probs (None: untruncated)
    out_len: torch.Tensor  # [num_seqs + 1]
    eos: torch.Tensor  # [E] ids that end a sequence ([-1]: none); read inside the graphs, so owned here
    resident: bool  # weights is a resident copy of every weight (a kept workspace)
    graphs: DecodeGraphs = dataclasses.field(default_factory=DecodeGraphs)

    @staticmethod
    def allocate(
        w: LlamaWeights,
        *,
        key: tuple,
        fused: LlamaWeights | None,
        num_slots: int,
        num_seqs: int,
        width: int,
        max_len: int,
        device: torch.device,
        eos: list[int] = (),
        resident: bool = False,
        truncated: bool = False,
    ) -> Workspace:
        """A fresh workspace: ``num_seqs`` sequences of ``width`` new tokens at most, ``num_slots`` slots of
        ``max_len`` positions (cache dtype and heads from ``w``); ``truncated``: with ``out_truncated``."""
        kv = torch.zeros(  # zeros: masked-out cache entries must be finite (0 × NaN = NaN)
            (len(w.layers), 2, num_slots, max_len, w.num_kv_heads, w.head_dim),
            dtype=w.embed.dtype,
            device=device,
        )

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        return Workspace(
            key=key,
            kv=kv,
            weights=fused,
            last_token=zeros(num_slots),
            position=zeros(num_slots),
            seq_id=torch.full((num_slots,), num_seqs, dtype=torch.long, device=device),
            gen_len=zeros(num_slots),
            finished=torch.ones(num_slots, dtype=torch.bool, device=device),
            out_tokens=zeros(num_seqs + 1, width),
            out_log_probs=zeros(num_seqs + 1, width, dtype=torch.float32),
            out_truncated=zeros(num_seqs + 1, width, dtype=torch.float32) if truncated else None,
            out_len=zeros(num_seqs + 1),
            eos=torch.tensor(list(eos) or [-1], device=device),
            resident=resident,
        )

    def fused_bytes(self) -> int:
        """Bytes of the weight copies held: the fused matrices, or every weight of a resident copy."""
        if self.weights is None:
            return 0
        w = self.weights
        if self.resident:
            return storage_bytes(w.tensors())
        return storage_bytes(t for lw in w.layers for t in (lw.qkv, lw.qkv_bias, lw.gate_up, lw.gate_up_bias))
