"""The tensor-parallel layout of a Llama-family decoder (Megatron's): which slice of each weight rank ``t`` of
a group of ``TP`` ranks takes.

- ``q_proj`` (weight rows, bias): heads ``[t·H/TP, (t+1)·H/TP)``; ``k_proj``/``v_proj``: KV heads
  ``[t·H_kv/TP, …)``, or when ``H_kv < TP`` the one KV head ``t·H_kv/TP`` its query heads share (KV heads
  replicated);
- ``o_proj``: the columns of its heads (row-parallel: partial sums, one all-reduce; bias replicated);
- ``gate_proj``/``up_proj``: rows ``[t·I/TP, …)``; ``down_proj``: those columns (row-parallel, all-reduce);
- ``embed_tokens`` and ``lm_head`` (tied or not): vocabulary rows ``even_split(V, TP, t)``
  (vocabulary-parallel embedding: one all-reduce; LM head: logits of its ids only);
- norms (and Qwen3's q/k norms): whole.

The rollout reshards the FSDP2 shards into these slices (:mod:`klppo.rollout.tp`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from klppo.models.flops import attention_dims
from klppo.parallel.reshard import WHOLE, Region, even_split

KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """Which region of each weight a tensor-parallel rank takes (module docstring)."""

    size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @staticmethod
    def of(config: Any, size: int) -> TPLayout:
        """The layout of a Hugging Face ``config`` over ``size`` ranks; ValueError when it cannot split."""
        num_heads, num_kv_heads, head_dim = attention_dims(config)
        inter = int(config.intermediate_size)
        if num_heads % size:
            raise ValueError(f"{KEY}={size} must divide num_attention_heads={num_heads}")
        if num_kv_heads % size and size % num_kv_heads:
            raise ValueError(
                f"{KEY}={size} and num_key_value_heads={num_kv_heads}: one must divide the other"
            )
        if inter % size:
            raise ValueError(f"{KEY}={size} must divide intermediate_size={inter}")
        return TPLayout(size, num_heads, num_kv_heads, head_dim)

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.size

    @property
    def local_kv_heads(self) -> int:
        return max(self.num_kv_heads // self.size, 1)

    def region(self, name: str, shape: torch.Size, t: int) -> Region:
        """Rank ``t``'s region of parameter ``name`` (its Hugging Face name) of full ``shape``."""
        d = self.head_dim
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return Region(0, *even_split(int(shape[0]), self.size, t))
        if ".self_attn.q_proj." in name or name.endswith("self_attn.o_proj.weight"):
            h = self.local_heads
            return Region(0 if ".q_proj." in name else 1, t * h * d, (t + 1) * h * d)
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            first = t * self.num_kv_heads // self.size
            return Region(0, first * d, (first + self.local_kv_heads) * d)
        if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
            return Region(0, *even_split(int(shape[0]), self.size, t))
        if name.endswith("mlp.down_proj.weight"):
            return Region(1, *even_split(int(shape[1]), self.size, t))
        return WHOLE
