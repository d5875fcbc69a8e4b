"""The ``klppo`` rollout engine: continuous batching over a preallocated KV cache, on the model's own weights.

One ``generate`` call:

1. reads the weights from the module (``LlamaWeights.read``: views, never kept across calls);
2. allocates the workspace (:mod:`klppo.rollout.workspace`): the fused ``[q; k; v]`` / ``[gate; up]``
   copies, then the KV cache ``[L, 2, num_slots, S, H_kv, D]`` (``S`` = longest prompt + ``max_new_tokens``)
   with as many slots as fit ``gpu_memory_utilization`` (CPU: one per sequence, or ``max_num_seqs``);
3. chooses the call's backend (:mod:`klppo.rollout.backends`: prefill, decode step, sampler);
4. fills the slots with the first sequences (``B × n``, row ``i·n + j`` = prompt i, sample j) through
   packed prefills: the slot bookkeeping is :mod:`klppo.rollout.scheduler`'s, the tensor work
   :mod:`klppo.rollout.steps`';
5. runs decode steps on the first ``bucket`` slots (the smallest bucket covering every busy slot), each
   captured once per bucket as a CUDA graph on GPU (:mod:`klppo.rollout.graphs`), with no host sync;
6. every ``eos_check_every`` steps reads the finished flags once and refills the freed slots with waiting
   sequences (continuous batching) until none is left; with ``compact_slots``, once nothing waits, moves
   the busy slots down into the smallest bucket that holds them (not below ``compact_min_bucket``).

The cache, buffers and graphs are dropped at the end of ``generate`` when ``free_cache_engine`` is True;
otherwise they are kept, with a resident copy of the weights, and reused by every later call of the same
shape whatever its seed and weights (``_keeps_workspace``). Models the engine cannot run fall back to the
``hf`` backend with a warning that names the reason. A :class:`Session` (:meth:`KLPPORollout.open`) keeps
conversations in their slots across turns: only the tokens appended to them are prefilled.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import warnings
from collections.abc import Callable

import torch

from klppo.models.llama_weights import LlamaWeights, unsupported_reason
from klppo.rollout.backends import make_backend
from klppo.rollout.base import RolloutOutput, SamplingParams, seeded
from klppo.rollout.compiled import CompiledFunctions
from klppo.rollout.hf import HFRollout
from klppo.rollout.sampling import returns_law_log_probs
from klppo.rollout.scheduler import SlotScheduler
from klppo.rollout.settings import EngineSettings
from klppo.rollout.steps import Call, assemble_output, decode_step, extend_slots, move_slots, prefill_chunk
from klppo.rollout.workspace import Workspace, num_slots


class KLPPORollout:
    """Our engine (module docstring). ``compiled``: the compiled decode functions (the trainer's,
    pre-compiling in the background; None: the engine's own)."""

    def __init__(self, settings: EngineSettings, *, compiled: CompiledFunctions | None = None) -> None:
        self.settings = settings
        self.compiled = compiled if compiled is not None else CompiledFunctions()
        self._fallback = HFRollout(
            eos_token_ids=list(settings.eos_token_ids), pad_token_id=settings.pad_token_id
        )
        self._fallback_said = False
        self._cuda_graphs = settings.cuda_graphs  # off once a tensor-parallel capture fails
        self._ws: Workspace | None = None

    # ---- public ---------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, model: torch.nn.Module, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> RolloutOutput:
        """See :mod:`klppo.rollout.base` for the contract."""
        self.compiled.wait()  # a background pre-compile (trainer start-up) must finish before we compile
        lengths = prompt_mask.sum(dim=1).tolist()
        reason = unsupported_reason(model, max(lengths) + params.max_new_tokens)
        if reason is not None:
            if not self._fallback_said:  # once: a reason that names the step's length would repeat every step
                self._fallback_said = True
                warnings.warn(
                    f"klppo rollout cannot run this model ({reason}): using hf for such steps "
                    "(said once; actor_rollout_ref.rollout.name=hf chooses it for every step)",
                    stacklevel=2,
                )
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
        """``generate`` on weights already read (full, or a tensor-parallel group's slices, called together).
        ``reset_peak``: the reported peak memory starts here (False: the caller reset it)."""
        lengths = prompt_mask.sum(dim=1).tolist()
        with seeded(params.seed, prompts.device):
            try:
                return self._generate(w, prompts, prompt_mask, lengths, params, reset_peak)
            finally:
                self._close()

    @torch.no_grad()
    def open(
        self, model: torch.nn.Module, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> Session | None:
        """A :class:`Session` of the ``B × n`` conversations of ``prompts`` (rows as ``generate``'s); None
        where the slots cannot hold them all at once or the model runs on ``hf`` (the caller re-sends)."""
        self.compiled.wait()
        lengths = prompt_mask.sum(dim=1).tolist()
        if unsupported_reason(model, max(lengths) + params.max_new_tokens) is None:
            call = self._call(LlamaWeights.read(model), prompts, prompt_mask, lengths, params)
            if call.ws.kv.shape[2] >= len(lengths) * params.n:
                return Session(self, call, lengths)
            self._close()
        return None

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
        call = self._call(w, prompts, prompt_mask, lengths, params)
        sched = self._scheduler(call, lengths)
        timings = self._run(call, sched, sched.start())
        return assemble_output(call, sched, start, timings, call.cuda and self._cuda_graphs)

    def _call(self, w, prompts, prompt_mask, lengths, params) -> Call:
        """The call's workspace (cache, buffers), backend and fixed inputs."""
        _require_gathered(w)
        device = prompts.device
        packed = prompts[prompt_mask.bool()]
        max_len = -(-(max(lengths) + params.max_new_tokens) // 16) * 16
        ws = self._workspace(w, device, len(lengths) * params.n, params.max_new_tokens, max_len, params)
        if ws.weights is not None:
            w = ws.weights
        backend = make_backend(self.settings, self.compiled, w)
        return Call(
            w=w,
            ws=ws,
            params=params,
            packed=packed,
            starts=[0, *itertools.accumulate(lengths)],
            prompt_hidden=torch.empty(len(lengths), w.embed.shape[1], dtype=w.embed.dtype, device=device),
            eos=ws.eos,
            check_eos=not params.ignore_eos and bool(self.settings.eos_token_ids),
            cuda=device.type == "cuda",
            pad=self.settings.pad_token_id,
            backend=backend,
            sample=backend.sampler(params),
        )

    def _scheduler(self, call: Call, lengths: list[int]) -> SlotScheduler:
        n, slots, limit = call.params.n, call.ws.kv.shape[2], self.settings.max_prefill_tokens
        return SlotScheduler(prompt_lengths=lengths, n=n, num_slots=slots, max_prefill_tokens=limit)

    def _close(self) -> None:
        if self.settings.free_cache_engine:
            self.release()

    def _run(self, call: Call, sched: SlotScheduler, pairs: list, compact: bool = True) -> dict[str, float]:
        """Prefill (sequence, slot) ``pairs``, then decode in blocks of ``eos_check_every`` steps, refilling
        the slots that finished, until no sequence is left. Returns the call's timings."""
        every = self.settings.eos_check_every
        t0 = time.perf_counter()
        self._admit(call, sched, pairs)
        prefill_s = time.perf_counter() - t0
        num_steps = capture_s = moved = 0.0
        while (bucket := sched.bucket()) is not None:
            t0 = time.perf_counter()
            step = self._step_fn(call, bucket)
            capture_s += time.perf_counter() - t0
            for _ in range(every):
                step()
            num_steps += every
            finished = call.ws.finished[: sched.num_slots].tolist()  # the one host sync per block
            refill = sched.finish(finished)
            if refill:
                t0 = time.perf_counter()
                self._admit(call, sched, refill)
                prefill_s += time.perf_counter() - t0
            elif compact and self.settings.compact_slots:
                moved += move_slots(call.ws, sched.compact(self.settings.compact_min_bucket))
        return {
            "prefill_s": prefill_s,
            "graph_capture_s": capture_s,
            "decode_steps": float(num_steps),
            "slot_moves": moved,
        }

    def _admit(self, call: Call, sched: SlotScheduler, pairs: list[tuple[int, int]]) -> None:
        """Prefill (sequence, slot) ``pairs``, in chunks of at most ``max_prefill_tokens`` tokens."""
        for chunk in sched.chunks(pairs):
            prefill_chunk(call, sched.plan(chunk))

    def _workspace(self, w, device, num_seqs, width, max_len, params) -> Workspace:
        fuse = w.layers[0].qkv is None  # not when given fused (tensor parallel)
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
        slots = num_slots(w, device, num_seqs, max_len, self.settings)
        self._ws = Workspace.allocate(
            w,
            key=key,
            fused=copies,
            num_slots=slots,
            num_seqs=num_seqs,
            width=width,
            max_len=max_len,
            device=device,
            eos=self.settings.eos_token_ids,
            resident=keep,
            truncated=returns_law_log_probs(params),
        )
        return self._ws

    def _keeps_workspace(self, w: LlamaWeights, fuse: bool) -> bool:
        """With ``free_cache_engine=False`` (no tensor parallelism) the workspace, with a resident weight copy
        (:meth:`LlamaWeights.resident`), serves every later call of the same sequence count, width and
        sampling parameters but the seed whose prompts fit: the graphs are captured once per run. The cost:
        one more weight copy, and positions rounded up to a multiple of 64."""
        return not self.settings.free_cache_engine and fuse and w.tp is None

    def _step_fn(self, call: Call, bucket: int) -> Callable[[], None]:
        """A callable running one decode step on slots [0, bucket): a graph replay on GPU."""
        ws = call.ws
        step = decode_step(call, bucket)
        if not (call.cuda and self._cuda_graphs):
            return step
        replay = ws.graphs.replay(bucket)
        if replay is not None:
            return replay
        state = [ws.last_token, ws.position, ws.gen_len, ws.finished, ws.out_len]
        # NCCL collectives inside the graph are untested on every stack: a failed capture runs eager
        replay = ws.graphs.capture(bucket, step, state, fallible=call.w.tp is not None)
        if replay is None:
            warnings.warn(
                f"tensor-parallel decode runs without CUDA graphs (capture failed: {ws.graphs.error})",
                stacklevel=2,
            )
            self._cuda_graphs = False
            return step
        return replay


class Session:
    """Conversations that keep their KV-cache slots across turns (:meth:`KLPPORollout.open`; row ``s`` in
    slot ``s``). :meth:`generate` decodes rows to the end of their turn: an EOS, or the response budget
    ``max_new_tokens``, which counts appended tokens too (verl's rule); :meth:`extend` appends tokens to rows
    whose turn ended with an EOS, prefilled after their cached prefix. Decode steps are the engine's own."""

    def __init__(self, engine: KLPPORollout, call: Call, lengths: list[int]) -> None:
        self.engine, self.call, self.sched = engine, call, engine._scheduler(call, lengths)
        self.cols, self.turns = [0] * self.sched.num_seqs, 0  # each row's first column of its current turn

    @torch.no_grad()
    def generate(self, rows: list[int]) -> RolloutOutput:
        """Decode ``rows`` (first call: every row, from its prompt; then rows just extended) to the end of
        their turn; its tokens as right-padded rows in the order of ``rows``. Seed: ``seed + 7919 × turn``."""
        call, sched, seed, start = self.call, self.sched, self.call.params.seed, time.perf_counter()
        with seeded(None if seed is None else seed + 7919 * self.turns, call.packed.device):
            sched.resume(rows if self.turns else [])
            timings = self.engine._run(call, sched, [] if self.turns else sched.start(), compact=False)
        self.turns += 1
        graphs, turn = call.cuda and self.engine._cuda_graphs, (rows, [self.cols[r] for r in rows])
        out = assemble_output(call, sched, start, timings, graphs, turn)
        sched.prefill_tokens = 0  # each turn's figures count its own prefill
        return out

    @torch.no_grad()
    def extend(self, rows: list[int], tokens: list[list[int]]) -> None:
        """Append ``tokens[i]`` to row ``rows[i]``, leaving room in the response for one more model token;
        only they are prefilled (:func:`~klppo.rollout.steps.extend_slots`, in prefill chunks)."""
        ws, budget = self.call.ws, self.call.params.max_new_tokens
        out_len = ws.out_len[torch.tensor(rows, device=ws.kv.device)].tolist()
        starts = [self.sched.seq_length(r) + k - 1 for r, k in zip(rows, out_len)]  # last sampled token's
        for r, k, more in zip(rows, out_len, tokens):
            if not more or k + len(more) >= budget:
                raise ValueError(f"row {r}: {len(more)} tokens after {k} leave no room in {budget}")
            self.cols[r] = k + len(more)
        jobs = list(zip(rows, tokens, starts))
        for run in self.sched.chunks(jobs, [s + len(t) for s, t in zip(starts, tokens)]):
            extend_slots(self.call, *map(list, zip(*run)))
        self.sched.prefill_tokens += sum(len(t) for t in tokens)

    def close(self) -> None:
        """Free the workspace (with ``free_cache_engine``, as after ``generate``)."""
        self.engine._close()


def _require_gathered(w: LlamaWeights) -> None:
    """The engine reads gathered weights (full, or a tensor-parallel group's slices), never FSDP2 shards."""
    if type(w.embed) is not torch.Tensor and type(w.embed).__name__ == "DTensor":
        raise ValueError("klppo rollout needs full (gathered) weights, got DTensor shards")
