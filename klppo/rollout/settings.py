"""The ``klppo`` engine's settings: one frozen object, read once from the rollout config (or a test)."""

from __future__ import annotations

import dataclasses

DECODE_ATTENTION = ("auto", "sdpa")
SAMPLERS = ("auto", "torch")


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """How an engine generates (:class:`klppo.rollout.engine.KLPPORollout`, and ``hf`` for the token ids)."""

    eos_token_ids: tuple[int, ...] = ()
    """Ids that end a sequence (none: every sequence runs to ``max_new_tokens``)."""
    pad_token_id: int = 0
    """Id written after a sequence's end in ``responses``."""
    gpu_memory_utilization: float = 0.5
    """Fraction of the device's memory the rollout phase may fill (everything allocated + the KV cache)."""
    free_cache_engine: bool = True
    """Free cache, buffers and graphs after each call; False keeps them
    (:meth:`KLPPORollout._keeps_workspace`)."""
    max_num_seqs: int | None = None
    """At most this many KV-cache slots (None: as many as fit)."""
    eos_check_every: int = 16
    """Decode steps between two reads of the finished flags (the one host synchronisation of a block)."""
    max_prefill_tokens: int = 32768
    """Prompt tokens per prefill chunk (also sizes the prefill workspace in the memory budget)."""
    cuda_graphs: bool = True
    """Replay each decode bucket's step as a CUDA graph (CUDA only)."""
    compile_decode: bool | None = None
    """Compiled unsplit layers and the split layers' Triton kernels; False: eager torch; None: on CUDA."""
    decode_attention: str = "auto"
    """auto: the backend for the device (:func:`klppo.rollout.backends.backend_class`); sdpa: the torch
    reference backend (masked SDPA) on every device."""
    sampler: str = "auto"
    """auto: the Triton sampling kernels where they apply, else torch; torch:
    :mod:`klppo.rollout.sampling`."""
    fp32_logits: bool = True
    """LM-head products kept in float32 (:func:`klppo.rollout.llama.logits_of`)."""
    compact_slots: bool = False
    """Move busy slots into the smallest bucket that holds them once nothing waits."""
    compact_min_bucket: int = 16
    """Compaction stops at this bucket."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "eos_token_ids", tuple(int(t) for t in self.eos_token_ids))
        object.__setattr__(self, "pad_token_id", int(self.pad_token_id))
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"decode_attention must be one of {DECODE_ATTENTION}, got {self.decode_attention!r}"
            )
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")

    def compiles(self, cuda: bool) -> bool:
        """Whether decode runs compiled layers / layer kernels (``compile_decode``; None: on CUDA)."""
        return cuda if self.compile_decode is None else bool(self.compile_decode)
