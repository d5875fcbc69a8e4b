"""The model arithmetic of one ``generate`` call, as backends: prefill, a decode step's logits, sampling.

The engine (:mod:`klppo.rollout.engine`) runs the loop — slots, workspace, CUDA graphs, output — and
calls a :class:`Backend` for the arithmetic. Each call's backend is chosen once, before any prefill, from the
settings and the model (device, cache dtype, tensor parallelism) by :func:`backend_class`; the decode
steps then call its methods, no setting is read in the loop. The backends, side by side:

- :class:`SplitBackend` — the fast path (CUDA, bf16/fp16 cache, triton, no tensor parallelism): split
  layers whose elementwise work runs on :mod:`klppo.rollout.triton_layers` (no ``torch.compile``, so also
  with ``compile_decode=False``), the split-KV attention applying RoPE and writing the cache
  (:func:`klppo.rollout.llama.decode_rope_in_attention`), the Triton sampler;
- :class:`TorchBackend` — the reference, and the path on CPU, in float32 and with
  ``decode_attention="sdpa"``: unsplit layers (compiled on CUDA), masked SDPA, the torch sampler unless the
  Triton one is chosen (``sampler``);
- :class:`TensorParallelBackend` — a tensor-parallel group's slices: unsplit front (compiled on CUDA),
  row-parallel back with its all-reduces, the split-KV attention without RoPE on CUDA bf16/fp16 (SDPA
  elsewhere), the vocabulary-parallel sampler.

All share the prefill (:func:`klppo.rollout.llama.prefill`, which also continues a slot after its cached
prefix: a :class:`~klppo.rollout.engine.Session`'s appended tokens) and the LM head (``fp32_logits``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

import klppo.models.llama_layers as llama_layers
import klppo.rollout.llama as llama
import klppo.rollout.triton_attention as triton_attention
import klppo.rollout.triton_layers as triton_layers
from klppo.models.llama_weights import LlamaWeights
from klppo.rollout.base import SamplingParams
from klppo.rollout.sampling import Draw, sample, vocab_parallel_sampler
from klppo.rollout.settings import EngineSettings
from klppo.rollout.triton_sampling import available as triton_sampling_available
from klppo.rollout.triton_sampling import sample_triton
from klppo.rollout.triton_sampling import supports as triton_supports

if TYPE_CHECKING:
    from klppo.rollout.compiled import CompiledFunctions

Sampler = Callable[[torch.Tensor], Draw]
"""``logits [B, V] -> Draw`` (:mod:`klppo.rollout.sampling`) on the device, no host synchronisation."""


class Backend(Protocol):
    """The arithmetic the engine calls (module docstring). Every method runs on the device without a host
    synchronisation, so a decode step can be captured in a CUDA graph."""

    def prefill(
        self,
        w: LlamaWeights,
        kv: torch.Tensor,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        lengths: list[int],
        offsets: list[int] | None = None,
    ) -> torch.Tensor:
        """Packed prompts ``tokens`` [T] (``lengths``, each after ``offsets`` cached positions or none) write
        their K/V into ``slots``; returns the last hidden states [N, hidden]."""
        ...

    def logits(self, w: LlamaWeights, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed states [N, hidden] → logits [N, V]."""
        ...

    def decode(
        self, w: LlamaWeights, kv: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        """One token per slot: writes K/V at ``positions`` [B], attends to ``<= positions``; logits [B, V]."""
        ...

    def sampler(self, params: SamplingParams) -> Sampler:
        """How this call samples ``params``."""
        ...


class _Shared:
    """Prefill, LM head and sampling common to the backends."""

    def __init__(self, settings: EngineSettings, cuda: bool) -> None:
        self.settings = settings
        self.cuda = cuda

    prefill = staticmethod(llama.prefill)

    def logits(self, w: LlamaWeights, hidden: torch.Tensor) -> torch.Tensor:
        return llama.logits_of(w, hidden, self.settings.fp32_logits)

    def sampler(self, params: SamplingParams) -> Sampler:
        """The Triton kernels where :func:`samples_on_triton` says so (the torch path past their int32
        offsets, decided per shape), else :func:`klppo.rollout.sampling.sample`."""
        if samples_on_triton(self.settings, self.cuda, params):
            return lambda x: (
                sample_triton(x, params) if triton_supports(params, *x.shape) else sample(x, params)
            )
        return lambda logits: sample(logits, params)


class SplitBackend(_Shared):
    """The fast path (module docstring)."""

    def __init__(self, settings: EngineSettings, cuda: bool) -> None:
        super().__init__(settings, cuda)
        self.layer_fns = triton_layers.SPLIT_LAYER_FNS

    def decode(
        self, w: LlamaWeights, kv: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        return llama.decode_rope_in_attention(
            w, kv, tokens, positions, self.layer_fns, self.settings.fp32_logits
        )


class TorchBackend(_Shared):
    """The reference (module docstring); ``compiled`` supplies the compiled layers."""

    def __init__(self, settings: EngineSettings, cuda: bool, compiled: CompiledFunctions) -> None:
        super().__init__(settings, cuda)
        compiles = settings.compiles(cuda)
        self.layer_fns = (
            (compiled.get("attn_in"), compiled.get("attn_out_mlp"))
            if compiles
            else (llama_layers.attn_in, llama_layers.attn_out_mlp)
        )

    def decode(
        self, w: LlamaWeights, kv: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        return llama.decode(
            w, kv, tokens, positions, self.layer_fns, llama.sdpa_attention, self.settings.fp32_logits
        )


class TensorParallelBackend(_Shared):
    """A tensor-parallel group's slices (module docstring); ``w``: this call's weights (``w.tp`` set)."""

    def __init__(
        self, settings: EngineSettings, cuda: bool, compiled: CompiledFunctions, w: LlamaWeights
    ) -> None:
        super().__init__(settings, cuda)
        front = compiled.get("attn_in") if settings.compiles(cuda) else llama_layers.attn_in
        back = llama_layers.layer_back(w)  # the all-reduces run eagerly (captured in the graph)
        self.layer_fns = (front, back)
        split_kv = settings.decode_attention == "auto" and triton_attention.runs(
            w.embed.device, w.embed.dtype
        )
        self.attention = llama.triton_attention_of if split_kv else llama.sdpa_attention
        self.tp, self.vocab_size = w.tp, w.vocab_size

    def decode(
        self, w: LlamaWeights, kv: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor
    ) -> torch.Tensor:
        return llama.decode(
            w, kv, tokens, positions, self.layer_fns, self.attention, self.settings.fp32_logits
        )

    def sampler(self, params: SamplingParams) -> Sampler:
        return vocab_parallel_sampler(params, self.tp, self.vocab_size)


def backend_class(
    settings: EngineSettings, device: torch.device, dtype: torch.dtype, *, tensor_parallel: bool
) -> type[SplitBackend | TorchBackend | TensorParallelBackend]:
    """Which backend runs a ``dtype`` cache on ``device``: tensor-parallel slices →
    :class:`TensorParallelBackend`; ``decode_attention="auto"`` where the split-KV kernels run (CUDA,
    bf16/fp16, triton) → :class:`SplitBackend`; else :class:`TorchBackend`. The background pre-compile
    asks the same (:mod:`klppo.rollout.compiled`)."""
    if tensor_parallel:
        return TensorParallelBackend
    if settings.decode_attention == "auto" and triton_attention.runs(device, dtype):
        return SplitBackend
    return TorchBackend


def make_backend(settings: EngineSettings, compiled: CompiledFunctions, w: LlamaWeights) -> Backend:
    """The backend of a call on weights ``w`` (:func:`backend_class`)."""
    device = w.embed.device
    cuda = device.type == "cuda"
    cls = backend_class(settings, device, w.embed.dtype, tensor_parallel=w.tp is not None)
    if cls is SplitBackend:
        return SplitBackend(settings, cuda)
    if cls is TorchBackend:
        return TorchBackend(settings, cuda, compiled)
    return TensorParallelBackend(settings, cuda, compiled, w)


def samples_on_triton(settings: EngineSettings, cuda: bool, params: SamplingParams) -> bool:
    """Whether ``params`` are sampled with the Triton kernels (:mod:`klppo.rollout.triton_sampling`):
    ``sampler="auto"`` on CUDA with triton, for the settings they take (not top-k with top-p)."""
    ok = settings.sampler == "auto" and cuda and triton_sampling_available(torch.device("cuda"))
    return ok and triton_supports(params, 1, 1)
