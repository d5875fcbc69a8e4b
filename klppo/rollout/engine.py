"""The ``klppo`` rollout engine: continuous batching over a preallocated KV cache, on the model's own weights.

One ``generate`` call:

1. reads the weights from the module (``LlamaWeights.read``: views, no copy; never kept across calls);
2. allocates the workspace (:mod:`klppo.rollout.workspace`): the KV cache in one piece,
   ``[L, 2, num_slots, S, H_kv, D]`` with ``S = longest prompt + max_new_tokens``, ``num_slots`` sized so
   that everything allocated plus the cache and a prefill workspace stays within
   ``gpu_memory_utilization × total device memory`` (CPU: one slot per sequence, or ``max_num_seqs``);
   with ``fuse_projections`` the per-layer ``[q; k; v]`` and ``[gate; up]`` concatenations are made first
   (a temporary copy of those matrices, counted in the budget, dropped with the cache);
3. fills the slots with the first sequences (``B × n``, row ``i·n + j`` = prompt i, sample j) through one
   packed prefill (only real prompt tokens are projected; each prompt attends causally to itself);
   which sequence goes into which slot, and which prompts run or are copied, is the pure-Python
   bookkeeping of :mod:`klppo.rollout.scheduler` (``SlotScheduler`` → one ``PrefillPlan`` per chunk);
   the tensor work of the call — a prefill chunk, a decode step, slot moves, the output rows — is in
   :mod:`klppo.rollout.steps`, which this module drives with its choices (sampler, layer functions,
   attention, graphs or eager);
4. runs decode steps on the first ``bucket`` slots (``bucket`` = smallest power of two from 1, or the slot
   count, covering every busy slot), each step captured once as a CUDA graph per bucket on GPU
   (:mod:`klppo.rollout.graphs`), eager on CPU. Attention reads each slot's occupied prefix only (flash
   varlen, GQA query heads packed per KV head; ``decode_attention``; "auto" on CUDA with triton: the
   split-KV kernels of :mod:`klppo.rollout.triton_attention`, fused with the cache write, measured 15–22%
   faster per step). The per-layer blocks and the sampler are the compiled functions of the engine's
   :class:`~klppo.rollout.compiled.CompiledFunctions` (``compiled``: handed in by the trainer, which
   starts pre-compiling them in the background before the weights load; else the engine's own) — except
   on the split layers of the Triton attention, whose elementwise work runs on two Triton kernels
   (:mod:`klppo.rollout.triton_layers`, ``layer_kernels``; no ``torch.compile``, no Inductor start-up). A step samples on the device (untruncated sampling: one
   compiled fused kernel pair, no [B, V] tensors written; logits in float32 with ``fp32_logits``; with
   ``sampler="triton"`` the one-pass kernels of :mod:`klppo.rollout.triton_sampling`) and
   records tokens/log-probs into the output buffers without any host synchronisation;
5. every ``eos_check_every`` steps reads the finished flags once; the scheduler frees the finished
   slots and gives them to the next waiting sequences (prefilled the same way) — continuous batching —
   until none is left. With ``compact_slots``, once nothing waits, the busy slots are moved down into the
   smallest bucket that holds them (their K/V and decode state copied; ``SlotScheduler.compact``, not
   below ``compact_min_bucket``), so the step follows the live sequence count.

The cache, buffers and graphs are dropped at the end of ``generate`` when ``free_cache_engine`` is True;
otherwise they are kept, with a resident copy of the weights, and reused by every later call of the same
shape whatever its seed and weights (``_keeps_workspace``).
Models the engine cannot run fall back to the ``hf`` backend with a warning that names the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import warnings
from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from klppo.rollout import triton_attention, triton_layers
from klppo.rollout.base import RolloutOutput, SamplingParams
from klppo.rollout.compiled import SPLIT_LAYER_NAMES, CompiledFunctions, decodes_split
from klppo.rollout.hf import HFRollout
from klppo.rollout.llama import (
    SPLIT_LAYER_FNS,
    LlamaWeights,
    attn_in,
    attn_out_mlp,
    layer_back,
    unsupported_reason,
)
from klppo.rollout.sampling import is_untruncated, sample, sample_untruncated, vocab_parallel_sampler
from klppo.rollout.scheduler import SlotScheduler
from klppo.rollout.steps import Call, assemble_output, decode_step, move_slots, prefill_chunk
from klppo.rollout.triton_sampling import available as triton_available
from klppo.rollout.triton_sampling import sample_triton
from klppo.rollout.triton_sampling import supports as triton_supports
from klppo.rollout.workspace import CacheBudget, Workspace, num_slots

DECODE_ATTENTION = ("auto", "flash", "flash-plain", "sdpa", "triton")
SAMPLERS = ("torch", "triton", "auto")
LAYER_KERNELS = ("auto", "triton", "compile")


class KLPPORollout:
    """Our engine (see the module docstring). Each output's ``stats`` reports that call's figures.

    ``rope_in_attention`` (class attribute, a bench switch): with the Triton attention and no tensor
    parallelism, decode on split layers whose attention kernel applies RoPE
    (:func:`klppo.rollout.llama.decode_rope_in_attention`); False: the rotations in the compiled front and
    the unsplit back (the engine before session 22)."""

    rope_in_attention = True
    sampler_four_per_philox = True
    """Bench switch: the Triton sampler's untruncated kernel draws four uniforms per Philox call
    (:func:`klppo.rollout.triton_sampling.sample_triton`); False: one (before session 22)."""
    sampler_noise_of_bits = True
    """Bench switch: the Triton sampler's Gumbel noise from Philox's words with fast logarithms
    (:func:`klppo.rollout.triton_sampling._gumbel_of_bits`); False: from float uniforms with precise ones
    (before session 23)."""
    sampler_launch: Mapping[str, int] = MappingProxyType({})
    """Bench switch: the Triton sampler's launch (``block``, ``num_warps``, ``splits`` of
    :func:`klppo.rollout.triton_sampling.sample_triton`; ``block`` and ``num_warps`` reach the truncated kernel
    too); empty: its defaults. Read-only: set a new mapping on an engine, never change the class's in place."""

    def __init__(
        self,
        *,
        eos_token_ids: list[int],
        pad_token_id: int,
        gpu_memory_utilization: float = 0.5,
        free_cache_engine: bool = True,
        max_num_seqs: int | None = None,
        eos_check_every: int = 16,
        max_prefill_tokens: int = 32768,
        use_cuda_graph: bool = True,
        compile_decode: bool | None = None,
        fuse_projections: bool = True,
        decode_attention: str = "auto",
        fp32_logits: bool = True,
        compiled: CompiledFunctions | None = None,
        sampler: str = "torch",
        compact_slots: bool = False,
        compact_min_bucket: int = 16,
        layer_kernels: str = "auto",
    ) -> None:
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if layer_kernels not in LAYER_KERNELS:
            raise ValueError(f"layer_kernels must be one of {LAYER_KERNELS}, got {layer_kernels!r}")
        self.eos_token_ids = list(eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.free_cache_engine = free_cache_engine
        self.max_num_seqs = max_num_seqs
        self.eos_check_every = eos_check_every
        self.max_prefill_tokens = max_prefill_tokens
        self.use_cuda_graph = use_cuda_graph
        self.compile_decode = compile_decode
        self.fuse_projections = fuse_projections
        self.decode_attention = decode_attention
        self.fp32_logits = fp32_logits
        self.sampler = sampler
        self.compact_slots = compact_slots
        self.compact_min_bucket = compact_min_bucket
        self.layer_kernels = layer_kernels
        self.compiled = compiled if compiled is not None else CompiledFunctions()
        self._fallback = HFRollout(eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        self._fallback_said = False
        self._ws: Workspace | None = None

    # ---- public ---------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
    ) -> RolloutOutput:
        """See :mod:`klppo.rollout.base` for the contract."""
        self.compiled.wait()  # a background pre-compile (trainer start-up) must finish before we compile
        lengths = prompt_mask.sum(dim=1).tolist()
        reason = unsupported_reason(model, max(lengths) + params.max_new_tokens)
        if reason is not None:
            if not self._fallback_said:  # once: a reason that names the step's length would repeat every step
                self._fallback_said = True
                warnings.warn(f"klppo rollout cannot run this model ({reason}): using hf for such steps "
                              "(said once; actor_rollout_ref.rollout.name=hf chooses it for every step)",
                              stacklevel=2)  # fmt: skip
            out = self._fallback.generate(model, prompts, prompt_mask, params)
            return dataclasses.replace(out, stats={**out.stats, "rollout/fallback_hf": 1.0})
        return self.generate_from(LlamaWeights.read(model), prompts, prompt_mask, params)

    @torch.no_grad()
    def generate_from(
        self,
        w: LlamaWeights,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        reset_peak: bool = True,
    ) -> RolloutOutput:
        """``generate`` on weights already read (``LlamaWeights``: full, or tensor-parallel slices whose
        group calls this together on the same prompts). ``reset_peak``: the reported peak memory starts
        here (False: the caller reset it, e.g. before resharding)."""
        device = prompts.device
        lengths = prompt_mask.sum(dim=1).tolist()
        rng = contextlib.nullcontext()
        if params.seed is not None:
            rng = torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
        with rng:
            if params.seed is not None:
                torch.manual_seed(params.seed)
            try:
                return self._generate(w, prompts, prompt_mask, lengths, params, reset_peak)
            finally:
                if self.free_cache_engine:
                    self.release()

    def release(self) -> None:
        """Drop the KV cache, output buffers and captured graphs."""
        self._ws = None

    # ---- internals ------------------------------------------------------------------------------
    def _generate(self, w, prompts, prompt_mask, lengths, params, reset_peak) -> RolloutOutput:
        device = prompts.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            if reset_peak:
                torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        _require_gathered(w)
        call = self._call(w, prompts, prompt_mask, lengths, params)
        sched = SlotScheduler(prompt_lengths=lengths, n=params.n, num_slots=call.ws.kv.shape[2],
                              max_prefill_tokens=self.max_prefill_tokens)  # fmt: skip
        timings = self._run(call, sched)
        return assemble_output(
            call, sched, self.pad_token_id, start, timings, call.cuda and self.use_cuda_graph
        )

    def _call(self, w, prompts, prompt_mask, lengths, params) -> Call:
        """The call's workspace (cache, buffers) and fixed inputs."""
        device = prompts.device
        packed = prompts[prompt_mask.bool()]
        max_len = -(-(max(lengths) + params.max_new_tokens) // 16) * 16
        ws = self._workspace(w, device, len(lengths) * params.n, params.max_new_tokens, max_len, params)
        if ws.weights is not None:
            w = ws.weights
        return Call(
            w=w,
            ws=ws,
            params=params,
            packed=packed,
            starts=[0, *itertools.accumulate(lengths)],
            prompt_hidden=torch.empty(len(lengths), w.embed.shape[1], dtype=w.embed.dtype, device=device),
            eos=ws.eos,
            check_eos=not params.ignore_eos and bool(self.eos_token_ids),
            cuda=device.type == "cuda",
        )

    def _run(self, call: Call, sched: SlotScheduler) -> dict[str, float]:
        """Prefill the first sequences, then decode in blocks of ``eos_check_every`` steps, refilling the
        slots that finished, until no sequence is left. Returns the call's timings."""
        t0 = time.perf_counter()
        self._admit(call, sched, sched.start())
        prefill_s = time.perf_counter() - t0
        num_steps = capture_s = moved = 0.0
        while (bucket := sched.bucket()) is not None:
            t0 = time.perf_counter()
            step = self._step_fn(call, bucket)
            capture_s += time.perf_counter() - t0
            for _ in range(self.eos_check_every):
                step()
            num_steps += self.eos_check_every
            finished = call.ws.finished[: sched.num_slots].tolist()  # the one host sync per block
            refill = sched.finish(finished)
            if refill:
                t0 = time.perf_counter()
                self._admit(call, sched, refill)
                prefill_s += time.perf_counter() - t0
            elif self.compact_slots:
                moved += move_slots(call.ws, sched.compact(self.compact_min_bucket))
        return {"prefill_s": prefill_s, "graph_capture_s": capture_s, "decode_steps": float(num_steps),
                "slot_moves": moved}  # fmt: skip

    def _admit(self, call: Call, sched: SlotScheduler, pairs: list[tuple[int, int]]) -> None:
        """Prefill (sequence, slot) ``pairs``, in chunks of at most ``max_prefill_tokens`` tokens."""
        for chunk in sched.chunks(pairs):
            prefill_chunk(
                call, sched.plan(chunk), self._sampler(call.params, call.cuda, call.w), self.fp32_logits
            )

    def _workspace(self, w, device, num_seqs, width, max_len, params) -> Workspace:
        fuse = self.fuse_projections and w.layers[0].qkv is None  # not when given fused (tensor parallel)
        keep = self._keeps_workspace(w, fuse)
        if keep:  # kept across calls (_keeps_workspace): the weights are copied into the graphs' own
            key = (num_seqs, width, w.embed.dtype, w.layout(), dataclasses.replace(params, seed=None))
            if self._ws is not None and self._ws.key == key and self._ws.kv.shape[3] >= max_len:
                w.resident(into=self._ws.weights)
                return self._ws
            max_len = -(-max_len // 64) * 64  # room for a little longer prompts next time
        else:
            key = (num_seqs, width, max_len, w.embed.dtype, w.signature(), params, fuse)
            if self._ws is not None and self._ws.key == key:
                if fuse:  # the model's weights may have changed in place: refresh the copies, same addresses
                    w.fuse(into=self._ws.weights)
                return self._ws
        self._ws = None  # free the old cache (and weight copies) before allocating the new ones
        copies = w.resident() if keep else w.fuse() if fuse else None
        budget = CacheBudget(self.gpu_memory_utilization, self.max_num_seqs, self.max_prefill_tokens)
        slots = num_slots(w, device, num_seqs, max_len, budget)
        self._ws = Workspace.allocate(w, key=key, fused=copies, num_slots=slots, num_seqs=num_seqs, width=width,
                                      max_len=max_len, device=device, eos=self.eos_token_ids,
                                      resident=keep)  # fmt: skip
        return self._ws

    def _keeps_workspace(self, w: LlamaWeights, fuse: bool) -> bool:
        """With ``free_cache_engine=False`` (and fused projections, no tensor parallelism) the workspace —
        cache, buffers, graphs and a resident copy of the weights (:meth:`LlamaWeights.resident`) — serves
        every later call with the same sequence count, width, sampling parameters other than the seed, and
        a prompt that fits its positions: a training run's rollouts then capture their graphs once, not
        every step, whatever addresses the re-gathered weights get. The cost: one more copy of the weights
        while the workspace lives, and positions rounded up to a multiple of 64."""
        return not self.free_cache_engine and fuse and w.tp is None

    def _step_fn(self, call: Call, bucket: int) -> Callable[[], None]:
        """A callable running one decode step on slots [0, bucket): a graph replay on GPU."""
        ws = call.ws
        step = self._decode_step(call, bucket)
        if not (call.cuda and self.use_cuda_graph):
            return step
        replay = ws.graphs.replay(bucket)
        if replay is not None:
            return replay
        state = [ws.last_token, ws.position, ws.gen_len, ws.finished, ws.out_len]
        # NCCL collectives inside the graph are untested on every stack: a failed capture runs eager
        replay = ws.graphs.capture(bucket, step, state, fallible=call.w.tp is not None)
        if replay is None:
            warnings.warn(f"tensor-parallel decode runs without CUDA graphs (capture failed: {ws.graphs.error})",
                          stacklevel=2)  # fmt: skip
            self.use_cuda_graph = False
            return step
        return replay

    def _decode_step(self, call: Call, bucket: int) -> Callable[[], None]:
        """One eager decode step on slots [0, bucket) (:func:`~klppo.rollout.steps.decode_step`) with this
        engine's layer functions, attention and sampler."""
        flash = self._use_flash(call.ws.kv)
        if flash == "triton" and call.w.tp is None and self.rope_in_attention:
            flash = "triton-rope"
        names = SPLIT_LAYER_NAMES if flash == "triton-rope" else ("attn_in", "attn_out_mlp")
        layer_fns = SPLIT_LAYER_FNS if flash == "triton-rope" else (attn_in, attn_out_mlp)
        if self._compiles(call.cuda):
            if self._triton_layers(flash == "triton-rope", call.cuda):
                layer_fns = triton_layers.SPLIT_LAYER_FNS
            else:
                layer_fns = tuple(self.compiled.get(name) for name in names)
        if call.w.tp is not None:  # the row-parallel all-reduces run eagerly (captured in the graph on CUDA)
            layer_fns = (layer_fns[0], layer_back(call.w))
        sampler = self._sampler(call.params, call.cuda, call.w)
        return decode_step(call, bucket, layer_fns, flash, sampler, self.fp32_logits)

    @classmethod
    def decodes_split(
        cls, decode_attention: str, device: torch.device, dtype: torch.dtype, tensor_parallel: bool
    ) -> bool:
        """Whether an engine with ``decode_attention`` decodes a ``dtype`` cache on ``device`` on the split
        layers (``flash="triton-rope"`` in :meth:`_decode_step`): what the background pre-compile makes
        (:func:`klppo.rollout.compiled.decodes_split` with this class's ``rope_in_attention``)."""
        return decodes_split(
            decode_attention,
            device,
            dtype,
            tensor_parallel=tensor_parallel,
            rope_in_attention=cls.rope_in_attention,
        )

    def _use_flash(self, kv: torch.Tensor) -> str | None:
        """The ``flash`` argument of ``decode``: "packed", "plain", "triton" or None (masked SDPA)."""
        if self.decode_attention == "sdpa":
            return None
        ok = kv.device.type == "cuda" and kv.dtype in (torch.bfloat16, torch.float16)
        if self.decode_attention == "triton" and not (ok and triton_attention.available(kv.device)):
            raise ValueError(
                "actor_rollout_ref.rollout.decode_attention=triton (engine decode_attention='triton') needs a "
                f"CUDA bf16/fp16 cache and the triton package, got {kv.device} {kv.dtype}"
            )
        if self.decode_attention != "auto" and not ok:
            raise ValueError(
                f"decode_attention={self.decode_attention!r} needs a CUDA bf16/fp16 cache, got {kv.device} {kv.dtype}"
            )
        if not ok:
            return None
        # auto: split-KV measured faster than flash at every shape and batch (bench/RESULTS.md, s8)
        if triton_attention.chosen(self.decode_attention, kv.device, kv.dtype):
            return "triton"
        return (
            "plain" if self.decode_attention == "flash-plain" else "packed"
        )  # flash, or auto without triton

    def _sampler(self, params: SamplingParams, cuda: bool, w: LlamaWeights):
        """``logits -> (tokens, log_probs)`` for ``params``: compiled and fused on GPU when untruncated;
        over the vocabulary shards of a tensor-parallel group when ``w.tp``."""
        if w.tp is not None:
            return vocab_parallel_sampler(params, w.tp, w.vocab_size)
        if self._uses_triton(cuda, params):
            # the torch path past the kernels' int32 offsets (batch × vocab ≥ 2**31), decided per shape
            four, bits, launch = (
                self.sampler_four_per_philox,
                self.sampler_noise_of_bits,
                dict(self.sampler_launch),
            )
            return lambda x: (
                sample_triton(x, params, four_per_philox=four, noise_of_bits=bits, **launch)
                if triton_supports(params, *x.shape)
                else sample(x, params)
            )
        if not is_untruncated(params):
            return lambda logits: sample(logits, params)
        # greedy (validation) stays eager: logsumexp + argmax are two plain reductions, and one graph fewer
        # to compile at start-up
        fn = self.compiled.get("sample") if self._compiles(cuda) and not params.greedy else sample_untruncated
        temperature = 1.0 if params.greedy else float(params.temperature)
        # one compiled graph for every batch size from 2 and one for a batch of 1 (compiled._batch_dynamic)
        return lambda logits: fn(logits, temperature, params.greedy)

    def _uses_triton(self, cuda: bool, params: SamplingParams) -> bool:
        """Whether to sample with the Triton kernels (:func:`samples_on_triton`)."""
        return samples_on_triton(self.sampler, cuda, params)

    def _triton_layers(self, split: bool, cuda: bool) -> bool:
        """Whether the split decode layers run on :mod:`klppo.rollout.triton_layers` (:func:`runs_triton_layers`)."""
        return runs_triton_layers(self.layer_kernels, split, cuda)

    def _compiles(self, cuda: bool) -> bool:
        """Whether decode runs the compiled functions: ``compile_decode`` None = on GPU only."""
        return cuda if self.compile_decode is None else bool(self.compile_decode)


def samples_on_triton(sampler: str, cuda: bool, params: SamplingParams) -> bool:
    """Whether an engine with ``sampler`` samples ``params`` with the Triton kernels
    (:mod:`klppo.rollout.triton_sampling`): "triton" (CUDA with triton, else an error) or "auto" (when
    available), for the parameters they take (not top-k with top-p: the torch path)."""
    if sampler == "torch":
        return False
    ok = cuda and triton_available(torch.device("cuda"))
    if sampler == "triton" and not ok:
        raise ValueError("rollout sampler='triton' needs a CUDA device and the triton package")
    return ok and triton_supports(params, 1, 1)


def runs_triton_layers(layer_kernels: str, split: bool, cuda: bool) -> bool:
    """Whether an engine with ``layer_kernels`` runs its split decode layers (``split``: it decodes on them)
    on :mod:`klppo.rollout.triton_layers` instead of their compiled versions: "auto" (where the kernels
    run) or "triton" (an error where they cannot: they are the split layers' — a CUDA bf16/fp16 cache with
    the Triton attention, no tensor parallelism); "compile": never."""
    if layer_kernels == "compile":
        return False
    ok = split and cuda and triton_layers.available(torch.device("cuda"))
    if layer_kernels == "triton" and not ok:
        raise ValueError(
            "actor_rollout_ref.rollout.layer_kernels=triton (engine layer_kernels='triton') needs the split decode "
            "layers: a CUDA bf16/fp16 cache, decode_attention auto or triton, no tensor parallelism, triton installed"
        )
    return ok


def _require_gathered(w: LlamaWeights) -> None:
    """The engine reads gathered weights (full, or a tensor-parallel group's slices), never FSDP2 shards."""
    if type(w.embed) is not torch.Tensor and type(w.embed).__name__ == "DTensor":
        raise ValueError("klppo rollout needs full (gathered) weights, got DTensor shards")
