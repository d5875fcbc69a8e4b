"""The engine's compiled decode functions, and their compilation in the background during start-up.

The functions compiled (``torch.compile``, batch dimension dynamic: one graph serves every batch size
from 2, and batch 1 has its own): the unsplit layer blocks ``attn_in`` and ``attn_out_mlp`` of the torch
and tensor-parallel backends (:mod:`klppo.rollout.backends`; the split layers of the fast path run on the
Triton kernels of :mod:`klppo.rollout.triton_layers` instead, with no ``torch.compile``). They live on a
:class:`CompiledFunctions` object, no module state: the trainer's set-up creates one and hands it to the
engine; an engine given none makes its own. With the default backend, dynamo's cache (keyed on the
functions' code) serves every object of the process, so a compilation done once serves all engines.

Compiling them from empty caches takes several seconds (most of the engine's first call); loading or
compiling the Triton kernels takes some too. The trainer therefore calls
:meth:`CompiledFunctions.start_precompile` as soon as it knows the model's config, before it loads any
weights: a background thread builds one decoder layer of that config with uninitialised weights and runs
what the chosen backend will run on it (compiled functions, or the Triton layer, attention and sampler
kernels) with the shapes, dtypes and flags the real rollout will use, so all is ready (and the guards hold)
by the first ``generate``; that call waits
for the thread (:meth:`CompiledFunctions.wait`). The layer's structure comes from a meta-device model
built in the calling thread; the thread itself only allocates tensors and compiles (no process-wide
state changes), one function at a time under ``klppo.models.loading.DEFAULT_DTYPE_LOCK`` (process-wide,
as the default dtype it guards), which model loading takes while transformers switches the default
dtype (dynamo guards on it). A failed or mismatched pre-compile costs nothing but its time: the first
call then compiles as it would have.

Persistent compile cache (:func:`use_persistent_cache`, called by a ``CompiledFunctions`` with the default
backend): TorchInductor's and Triton's on-disk caches go under klppo's cache directory,
``$KLPPO_CACHE/compile/{inductor,triton}`` (``$KLPPO_CACHE`` defaults to ``$XDG_CACHE_HOME/klppo``, else
``~/.cache/klppo``), instead of torch's default under the temporary directory, and inductor's FX graph
cache and the AOTAutograd cache are turned on where the torch version has them: a later process (a resumed
run, the next job) loads the compiled kernels instead of compiling them again. The user's settings win:
a ``TORCHINDUCTOR_CACHE_DIR`` or ``TRITON_CACHE_DIR`` already set is kept (except a
``TORCHINDUCTOR_CACHE_DIR`` equal to torch's own default, which importing dynamo writes there itself), as are
``TORCHINDUCTOR_FX_GRAPH_CACHE`` / ``TORCHINDUCTOR_AUTOGRAD_CACHE``; ``KLPPO_COMPILE_CACHE=0`` leaves
torch's defaults untouched. Set these before the process's first compilation (inductor fixes its cache
directory on first use).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import klppo.rollout.triton_attention as triton_attention
import klppo.rollout.triton_layers as triton_layers
import klppo.rollout.triton_sampling as triton_sampling
from klppo.models.flops import attention_dims
from klppo.models.gguf import klppo_cache_dir
from klppo.models.loading import DEFAULT_DTYPE_LOCK
from klppo.rollout.backends import SplitBackend, backend_class, samples_on_triton
from klppo.rollout.base import SamplingParams
from klppo.rollout.llama import LayerWeights, attn_in, attn_out_mlp, split_attention, unsupported_reason
from klppo.rollout.settings import EngineSettings
from klppo.rollout.triton_sampling import sample_triton

logger = logging.getLogger(__name__)

FUNCTIONS: dict[str, Callable] = {"attn_in": attn_in, "attn_out_mlp": attn_out_mlp}


class CompiledFunctions:
    """The compiled versions of ``FUNCTIONS`` (batch dim dynamic, batch 1 its own graph) and their background pre-compile.

    ``backend``: the ``torch.compile`` backend (tests pass a counting one); ``mode``: its ``mode`` (None:
    inductor's default; e.g. ``"max-autotune-no-cudagraphs"``: Triton GEMM templates tuned per shape — the
    engine captures its own CUDA graphs, so never a mode that adds them). Engines given the same object
    share its wrappers; with the default backend and mode, dynamo's own cache also serves a second object's
    calls without compiling again.
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
        """Prepare what an engine with ``settings`` runs for a model of Hugging Face ``config`` (module
        docstring), without tensor parallelism: the backend of :func:`~klppo.rollout.backends.backend_class`.

        The torch backend: its compiled layers (``settings.compiles``), for a batch of 4 (every batch from
        2) and of 1. The split
        backend: the Triton layer kernels once, and the split-KV attention kernels once per compiled variant
        (one split, and one split count per combine width: the split count is a runtime argument, the
        combine's width a constexpr). On CUDA also the Triton sampler for each of ``sampling`` (the sampling
        settings the rollout will run) that it samples, once per variant its default launch can need at some
        batch size (``triton_sampling.warm_splits``). On empty caches their compilation then overlaps the
        weight loading instead of the first call's prefill and graph capture.
        Returns the thread (None when the engine cannot run this config: nothing to compile).
        """
        self.wait()
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # the thread must target this thread's device
            device = torch.device("cuda", torch.cuda.current_device())
        # The model structure is made here, on the meta device: building a Hugging Face model sets the
        # process-wide default dtype for a while, which must not happen beside the caller's own model loading.
        layer = _meta_layer(config, dtype)
        if layer is None:
            return None
        cuda = device.type == "cuda"
        split = backend_class(settings, device, dtype, tensor_parallel=False) is SplitBackend
        on_triton = tuple(p for p in sampling if samples_on_triton(settings, cuda, p))
        plan = _Plan(split=split, compiles=settings.compiles(cuda), fp32_logits=settings.fp32_logits,
                     sampling=on_triton)  # fmt: skip
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
                    logger.warning("rollout kernel warm-up skipped (%s: %s); the first rollout compiles the "
                                   "attention and sampler kernels", type(err).__name__, err)  # fmt: skip
            self.last_precompile_s = time.perf_counter() - start
            logger.info("rollout decode functions pre-compiled in %.1f s", self.last_precompile_s)
        except Exception as err:  # the first generate compiles instead; say why this did not
            logger.warning(
                "rollout pre-compile skipped (%s: %s); the first rollout compiles", type(err).__name__, err
            )


CACHE_FLAGS = (  # (config module, flag, the environment variable through which the user sets it)
    ("torch._inductor.config", "fx_graph_cache", "TORCHINDUCTOR_FX_GRAPH_CACHE"),
    ("torch._functorch.config", "enable_autograd_cache", "TORCHINDUCTOR_AUTOGRAD_CACHE"),
)


def use_persistent_cache(root: str | os.PathLike | None = None) -> dict[str, str]:
    """Point the inductor and Triton caches at ``root`` (default ``klppo_cache_dir() / "compile"``) where
    the user has not chosen, and turn the FX graph and AOTAutograd caches on (module docstring).

    Returns the cache directories in force, by variable (empty with ``KLPPO_COMPILE_CACHE=0``).
    """
    if os.environ.get("KLPPO_COMPILE_CACHE", "1").strip().lower() in ("0", "false", "no", "off"):
        return {}
    base = os.fspath(root) if root is not None else os.fspath(klppo_cache_dir() / "compile")
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        if os.environ.get(var, "") in ("", _torch_default(var)):
            os.environ[var] = os.path.join(base, sub)
    for module, flag, var in CACHE_FLAGS:
        config = importlib.import_module(module)
        if hasattr(config, flag) and var not in os.environ:
            setattr(config, flag, True)
    return {var: os.environ[var] for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}


def _torch_default(var: str) -> str | None:
    """Torch's own default for ``var``: importing dynamo writes inductor's default cache directory into
    ``TORCHINDUCTOR_CACHE_DIR``, so that value does not mean the user chose it."""
    if var != "TORCHINDUCTOR_CACHE_DIR":
        return None
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir  # noqa: PLC0415  private, may move
    except ImportError:
        return None
    return os.path.abspath(default_cache_dir())


def _batch_dynamic(fn: Callable) -> Callable:
    """Call ``fn`` with dim 0 (the batch) of every tensor argument marked dynamic, nothing else.

    ``torch.compile(dynamic=True)`` makes every dim symbolic and unifies equal sizes: a first call with
    batch 64 = head_dim 64 (cos/sin are [B, D]) compiles a graph valid only while B == D, so the next
    bucket recompiles. Marking the batch dim alone gives one graph per function for every batch from 2;
    a batch of 1 is specialised (a backed dynamic dim always is), so it gets a second graph, which
    :meth:`CompiledFunctions.start_precompile` makes too. An *unbacked* dim (``mark_unbacked``: one graph
    for batch 1 too) gives inductor no size hint to tune its kernels with: slower decode steps.
    """

    def call(*args):
        for a in args:
            if isinstance(a, torch.Tensor):
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return fn(*args)

    return call


def _meta_layer(config: Any, dtype: torch.dtype) -> LayerWeights | None:
    """One decoder layer of ``config`` on the meta device (None, logged, if the engine cannot run it)."""

    config = copy.deepcopy(config)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1]
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except Exception as err:
        logger.warning("rollout pre-compile skipped (%s: %s)", type(err).__name__, err)
        return None
    reason = unsupported_reason(model, 0)
    if reason is not None:
        logger.info("rollout pre-compile skipped: %s", reason)
        return None
    return LayerWeights.read(model.model.layers[0])


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What a pre-compile runs: the split layers' Triton kernels (``split``), else the torch backend's
    compiled layers (if it ``compiles``), logits in float32 or not, and the sampling settings on Triton."""

    split: bool
    compiles: bool
    fp32_logits: bool
    sampling: tuple[SamplingParams, ...]


def _run_once(fns: CompiledFunctions, config, layer: LayerWeights, device, plan: _Plan) -> None:
    """Call each layer function the backend runs once with the rollout's shapes and dtypes (values
    irrelevant): the Triton layer kernels (split backend) or the compiled layers (torch backend)."""
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
            # one function at a time under the lock: the caller's model loading may not switch the default
            # dtype meanwhile (dynamo guards on it), and waits for one function at most
            with DEFAULT_DTYPE_LOCK:
                fns.get(name)(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _warm_kernels(config, dtype: torch.dtype, device: torch.device, plan: _Plan) -> None:
    """Run the Triton kernels the rollout launches besides the layers' once per compiled variant, on tensors
    of the rollout's dtypes and layouts (values irrelevant): the split-KV attention (split backend) and the
    sampler for each of ``plan.sampling``, each with one split count per variant a batch size can need
    (``warm_splits`` of :mod:`~klppo.rollout.triton_attention` and :mod:`~klppo.rollout.triton_sampling`: the
    split counts are runtime arguments, the combines' widths constexprs), so a batch of 4 stands for every
    bucket."""
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
