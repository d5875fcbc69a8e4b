"""The engine's compiled decode functions, and their compilation in the background during start-up.

Compiled (``torch.compile``, batch dimension dynamic: one graph for every batch from 2, and batch 1 its own):
the unsplit layer blocks ``attn_in`` and ``attn_out_mlp`` of the torch and tensor-parallel backends
(:mod:`klppo.rollout.backends`; the fast path's split layers run the Triton kernels of
:mod:`klppo.rollout.triton_layers` instead). They live on a :class:`CompiledFunctions` object, no module
state: the trainer's set-up hands one to the engine; an engine given none makes its own. With the default
backend, dynamo's cache (keyed on the functions' code) serves every object of the process.

Compiling from empty caches takes several seconds, the Triton kernels some too. The trainer therefore calls
:meth:`CompiledFunctions.start_precompile` as soon as it knows the model's config, before it loads any
weights: a background thread runs what the chosen backend will run (compiled functions, or the Triton
layer, attention and sampler kernels) on one decoder layer of that config with uninitialised weights, with
the rollout's shapes, dtypes and flags, so all is ready (and the guards hold) by the first ``generate``,
which waits for it (:meth:`CompiledFunctions.wait`). The layer's structure comes from a meta-device model
built in the calling thread; the thread only allocates tensors and compiles, one function at a time under
``klppo.models.loading.DEFAULT_DTYPE_LOCK``, which model loading takes while transformers switches the
default dtype (dynamo guards on it). A failed or mismatched pre-compile costs only its time: the first call
then compiles. The on-disk caches: :mod:`klppo.models.compile_cache`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

import klppo.rollout.triton_attention as triton_attention
import klppo.rollout.triton_layers as triton_layers
import klppo.rollout.triton_sampling as triton_sampling
from klppo.models.compile_cache import use_persistent_cache
from klppo.models.flops import attention_dims
from klppo.models.llama_layers import attn_in, attn_out_mlp
from klppo.models.llama_weights import LayerWeights, meta_layer
from klppo.models.loading import DEFAULT_DTYPE_LOCK
from klppo.rollout.backends import SplitBackend, backend_class, samples_on_triton
from klppo.rollout.base import SamplingParams
from klppo.rollout.llama import split_attention
from klppo.rollout.settings import EngineSettings
from klppo.rollout.triton_sampling import sample_triton

logger = logging.getLogger(__name__)

FUNCTIONS: dict[str, Callable] = {"attn_in": attn_in, "attn_out_mlp": attn_out_mlp}


class CompiledFunctions:
    """The compiled versions of ``FUNCTIONS`` and their background pre-compile (module docstring).

    ``backend``: the ``torch.compile`` backend (tests pass a counting one); ``mode``: its ``mode`` (None:
    inductor's default; never one that adds CUDA graphs: the engine captures its own).
    """

    def __init__(self, *, backend: Any = "inductor", mode: str | None = None) -> None:
        if mode in ("reduce-overhead", "max-autotune"):  # the modes that capture CUDA graphs themselves
            raise ValueError(
                f"compile mode {mode!r} adds CUDA graphs inside the engine's own: use a no-cudagraphs mode"
            )
        self.backend, self.mode = backend, mode
        if backend == "inductor":
            use_persistent_cache()
        self.last_precompile_s: float | None = None  # how long the last background pre-compile took
        self._fns: dict[str, Callable] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def get(self, name: str) -> Callable:
        """The compiled version of ``FUNCTIONS[name]`` (made on first use)."""
        with self._lock:
            if name not in self._fns:
                compiled = torch.compile(FUNCTIONS[name], backend=self.backend, mode=self.mode)
                self._fns[name] = _batch_dynamic(compiled)
            return self._fns[name]

    def start_precompile(
        self,
        config: Any,
        settings: EngineSettings,
        *,
        dtype: torch.dtype,
        device: torch.device,
        sampling: Iterable[SamplingParams] = (),
    ) -> threading.Thread | None:
        """Prepare, in a background thread, what the backend of
        :func:`~klppo.rollout.backends.backend_class` runs for Hugging Face ``config`` without tensor
        parallelism (module docstring): the torch backend's compiled layers for batches 4 and 1; the split
        backend's Triton layer and split-KV attention kernels (:func:`_run_once`, :func:`_warm_kernels`); on
        CUDA the Triton sampler for each of ``sampling`` it samples. Returns the thread (None when the engine
        cannot run this config).
        """
        self.wait()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the thread must target this thread's device
            device = torch.device("cuda", torch.cuda.current_device())
        try:  # in this thread: building a Hugging Face model switches the process-wide default dtype a while
            layer = meta_layer(config, dtype)
        except Exception as err:  # ValueError: a model the engine does not run (it falls back to hf)
            log = logger.info if isinstance(err, ValueError) else logger.warning
            log("rollout pre-compile skipped (%s: %s)", type(err).__name__, err)
            return None
        cuda = device.type == "cuda"
        split = backend_class(settings, device, dtype, tensor_parallel=False) is SplitBackend
        on_triton = tuple(p for p in sampling if samples_on_triton(settings, cuda, p))
        plan = _Plan(
            split=split,
            compiles=settings.compiles(cuda),
            fp32_logits=settings.fp32_logits,
            sampling=on_triton,
        )
        self._thread = threading.Thread(
            target=self._precompile, args=(config, layer, device, plan), name="klppo-precompile", daemon=True
        )
        self._thread.start()
        return self._thread

    def wait(self) -> None:
        """Block until a running background pre-compile has finished (no-op when none is running)."""
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None

    def _precompile(self, config, layer, device, plan: _Plan) -> None:
        start = time.perf_counter()
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            with torch.no_grad():
                _run_once(self, config, layer, device, plan)
                try:
                    _warm_kernels(config, layer.input_norm.dtype, device, plan)
                except Exception as err:  # the compiled functions are ready: only the kernels load later
                    logger.warning(
                        "rollout kernel warm-up skipped (%s: %s); the first rollout compiles the "
                        "attention and sampler kernels",
                        type(err).__name__,
                        err,
                    )
            self.last_precompile_s = time.perf_counter() - start
            logger.info("rollout decode functions pre-compiled in %.1f s", self.last_precompile_s)
        except Exception as err:  # the first generate compiles instead; say why this did not
            logger.warning(
                "rollout pre-compile skipped (%s: %s); the first rollout compiles", type(err).__name__, err
            )


def _batch_dynamic(fn: Callable) -> Callable:
    """Call ``fn`` with dim 0 (the batch) of every tensor argument marked dynamic, nothing else.

    Not ``dynamic=True``, which unifies equal sizes (batch 64 = head_dim 64 gives a graph valid only while
    B == D). Batch 1 is specialised (a backed dynamic dim always is): its own graph. An unbacked dim would
    give inductor no size hint to tune with: slower decode steps.
    """

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return fn(*args)

    return call


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a pre-compile runs (:meth:`CompiledFunctions.start_precompile`)."""

    split: bool
    compiles: bool
    fp32_logits: bool
    sampling: tuple[SamplingParams, ...]


def _run_once(fns: CompiledFunctions, config, layer: LayerWeights, device, plan: _Plan) -> None:
    """Run the Triton layer kernels (split backend) or the compiled layers once on the rollout's shapes."""
    lw = layer.allocated_like(device).fused()
    dtype = lw.input_norm.dtype
    num_heads, num_kv_heads, head_dim = attention_dims(config)
    eps = float(config.rms_norm_eps)
    spec = (num_heads, num_kv_heads, head_dim, eps)
    for batch in (4, 1):  # 4: the graph of every batch from 2 (dynamic batch dim); 1: its own graph
        x = torch.zeros(batch, config.hidden_size, dtype=dtype, device=device)
        attn = torch.zeros(batch, num_heads * head_dim, dtype=dtype, device=device)
        if plan.split:  # Triton's kernels: no dynamo, no default-dtype guard
            front, back, final = triton_layers.SPLIT_LAYER_FNS
            m = torch.zeros_like(x)
            front(x, None, lw, spec), front(x, m, lw, spec), back(x, attn, lw, eps)
            final(x, m, (lw.input_norm, eps))
            continue
        if not plan.compiles:
            break
        cos, sin = (torch.zeros(batch, head_dim, dtype=dtype, device=device) for _ in range(2))  # not aliased
        for name, args in (("attn_in", (x, lw, cos, sin, spec)), ("attn_out_mlp", (x, attn, lw, eps))):
            # one function at a time: model loading may not switch the default dtype meanwhile (module
            # docstring)
            with DEFAULT_DTYPE_LOCK:
                fns.get(name)(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_kernels(config, dtype: torch.dtype, device: torch.device, plan: _Plan) -> None:
    """Run the split-KV attention (split backend) and the sampler for each of ``plan.sampling`` once per
    compiled variant (their modules' ``warm_splits``), on the rollout's dtypes and layouts."""
    batch = 4
    if plan.split:
        dims = attention_dims(config)
        num_heads, num_kv_heads, head_dim = dims
        max_len = 2 * triton_attention.BLOCK_N
        qkv = torch.zeros(batch, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, device=device)
        cache = torch.zeros(2, batch, max_len, num_kv_heads, head_dim, dtype=dtype, device=device)
        positions = torch.full((batch,), max_len - 1, dtype=torch.long, device=device)
        rope = tuple(torch.zeros(batch, head_dim, dtype=dtype, device=device) for _ in range(2))
        for splits in triton_attention.warm_splits():
            split_attention(qkv, cache, positions, splits, rope, dims)
    sampling = plan.sampling
    logits_dtype = torch.float32 if plan.fp32_logits else dtype
    logits = torch.zeros(batch, config.vocab_size, dtype=logits_dtype, device=device) if sampling else None
    generator = torch.Generator(device=device) if sampling else None  # the run's generator stays untouched
    sms = triton_sampling.device_sms(device)
    for params in sampling:
        for splits in triton_sampling.warm_splits(sms, config.vocab_size, params):
            sample_triton(logits, params, splits=splits, generator=generator)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
