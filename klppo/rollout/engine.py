"""The ``klppo`` rollout engine: continuous batching over a preallocated KV cache, on the model's own weights.

One ``generate`` call:

1. reads the weights from the module (``LlamaWeights.read``: views, no copy; never kept across calls);
2. allocates the KV cache in one piece, ``[L, 2, num_slots, S, H_kv, D]`` with ``S = longest prompt +
   max_new_tokens``, ``num_slots`` sized so that everything allocated plus the cache and a prefill
   workspace stays within ``gpu_memory_utilization × total device memory`` (CPU: one slot per sequence,
   or ``max_num_seqs``); with ``fuse_projections`` the per-layer ``[q; k; v]`` and ``[gate; up]``
   concatenations are made first (a temporary copy of those matrices, counted in the budget, dropped
   with the cache);
3. fills the slots with the first sequences (``B × n``, row ``i·n + j`` = prompt i, sample j) through one
   packed prefill (only real prompt tokens are projected; each prompt attends causally to itself);
4. runs decode steps on the first ``bucket`` slots (``bucket`` = smallest power of two from 2, or the slot
   count, covering every busy slot), each step captured once as a CUDA graph per bucket on GPU, eager on
   CPU. Attention reads each slot's occupied prefix only (flash varlen, GQA query heads packed per KV
   head; ``decode_attention``). The per-layer blocks and the sampler are the process-wide compiled
   functions of :mod:`klppo.rollout.compiled` (pre-compiled in the background by the trainer). A step
   samples on the device (untruncated sampling: one compiled fused kernel pair, no [B, V] tensors
   written; logits in float32 with ``fp32_logits``) and records tokens/log-probs into the output buffers
   without any host synchronisation;
5. every ``eos_check_every`` steps reads the finished flags once; finished slots take the next waiting
   sequences (prefilled the same way) — continuous batching — until none is left.

The cache, buffers and graphs are dropped at the end of ``generate`` when ``free_cache_engine`` is True;
otherwise they are kept and reused by the next call of the same shape on the same weight addresses.
Models the engine cannot run fall back to the ``hf`` backend with a warning that names the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import time
import warnings

import torch

from klppo.parallel.collectives import all_reduce_min
from klppo.rollout.base import RolloutOutput, SamplingParams
from klppo.rollout.compiled import compiled, wait_precompile
from klppo.rollout.hf import HFRollout
from klppo.rollout.llama import (
    LlamaWeights,
    attn_in,
    attn_out_mlp,
    decode,
    layer_back,
    logits_of,
    prefill,
    unsupported_reason,
)
from klppo.rollout.sampling import is_untruncated, sample, sample_untruncated, vocab_parallel_sampler

DECODE_ATTENTION = ("auto", "flash", "flash-plain", "sdpa")


@dataclasses.dataclass
class _Workspace:
    """Everything the decode graphs point at. State tensors are indexed by slot, outputs by sequence."""

    key: tuple
    kv: torch.Tensor  # [L, 2, slots, S, H_kv, D]
    weights: LlamaWeights | None  # the fused concatenations (fuse_projections), else None
    last_token: torch.Tensor  # [slots] token to feed next
    position: torch.Tensor  # [slots] cache position it is written at
    seq_id: torch.Tensor  # [slots] sequence in the slot (num_seqs = none)
    gen_len: torch.Tensor  # [slots] tokens generated so far
    finished: torch.Tensor  # [slots] bool; a free slot counts as finished
    out_tokens: torch.Tensor  # [num_seqs + 1, R] (last row: sink for idle slots)
    out_log_probs: torch.Tensor  # [num_seqs + 1, R]
    out_len: torch.Tensor  # [num_seqs + 1]
    graphs: dict = dataclasses.field(default_factory=dict)
    pool: object = None


class KLPPORollout:
    """Our engine (see the module docstring). Each output's ``stats`` reports that call's figures."""

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
    ) -> None:
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
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
        self._fallback = HFRollout(eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
        self._ws: _Workspace | None = None

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
        wait_precompile()  # a background pre-compile (trainer start-up) must finish before we compile
        lengths = prompt_mask.sum(dim=1).tolist()
        reason = unsupported_reason(model, max(lengths) + params.max_new_tokens)
        if reason is not None:
            warnings.warn(f"klppo rollout cannot run this model ({reason}): using hf", stacklevel=2)
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
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
            if reset_peak:
                torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        _require_gathered(w)
        n, width = params.n, params.max_new_tokens
        num_seqs = len(lengths) * n
        seq_lengths = [lengths[s // n] for s in range(num_seqs)]
        packed = prompts[prompt_mask.bool()]
        starts = [0, *itertools.accumulate(lengths)]
        max_len = -(-(max(lengths) + width) // 16) * 16
        ws = self._workspace(w, device, num_seqs, width, max_len, params)
        if ws.weights is not None:
            w = ws.weights
        num_slots = ws.kv.shape[2]
        eos = torch.tensor(self.eos_token_ids or [-1], device=device)
        check_eos = not params.ignore_eos and bool(self.eos_token_ids)

        # prefix sharing: each prompt's last hidden state, and the busy slots holding its K/V prefix
        prompt_hidden = torch.empty(len(lengths), w.embed.shape[1], dtype=w.embed.dtype, device=device)
        holders: dict[int, set[int]] = {}

        def admit(pairs: list[tuple[int, int]]) -> None:
            """Prefill sequences into slots, in chunks of at most max_prefill_tokens tokens."""
            chunks: list[list[tuple[int, int]]] = [[]]
            budget = 0
            for s, slot in pairs:
                if chunks[-1] and budget + seq_lengths[s] > self.max_prefill_tokens:
                    chunks.append([])
                    budget = 0
                chunks[-1].append((s, slot))
                budget += seq_lengths[s]
            for chunk in chunks:
                resident = {p: next(iter(held)) for p, held in holders.items() if held}
                self._prefill(w, ws, packed, starts, seq_lengths, chunk, params, eos, check_eos, n, resident,
                              prompt_hidden)  # fmt: skip
                for s, slot in chunk:
                    holders.setdefault(s // n, set()).add(slot)

        self._prefill_tokens = self._prefix_reused = 0
        slot_seq = [-1] * num_slots
        waiting = list(range(num_seqs))[::-1]  # pop() takes the lowest sequence id
        prefill_start = time.perf_counter()
        first = [(waiting.pop(), slot) for slot in range(min(num_slots, num_seqs))]
        for s, slot in first:
            slot_seq[slot] = s
        admit(first)
        prefill_s = time.perf_counter() - prefill_start
        buckets = _buckets(num_slots)
        num_steps = capture_s = 0.0
        while True:
            busy = [slot for slot, s in enumerate(slot_seq) if s >= 0]
            if not busy:
                break
            bucket = next(b for b in buckets if b > busy[-1])
            t0 = time.perf_counter()
            step = self._step_fn(w, ws, bucket, params, eos, check_eos, cuda)
            capture_s += time.perf_counter() - t0
            for _ in range(self.eos_check_every):
                step()
            num_steps += self.eos_check_every
            finished = ws.finished[:num_slots].tolist()  # the one host sync per eos_check_every steps
            freed = [slot for slot in busy if finished[slot]]
            for slot in freed:
                holders[slot_seq[slot] // n].discard(slot)
                slot_seq[slot] = -1
            refill = [(waiting.pop(), slot) for slot in freed[: len(waiting)]]
            for s, slot in refill:
                slot_seq[slot] = s
            if refill:
                t0 = time.perf_counter()
                admit(refill)
                prefill_s += time.perf_counter() - t0

        timings = {"prefill_s": prefill_s, "graph_capture_s": capture_s, "decode_steps": float(num_steps)}
        return self._output(ws, num_seqs, width, device, start, timings)

    def _output(
        self, ws: _Workspace, num_seqs: int, width: int, device: torch.device, start: float, timings: dict
    ) -> RolloutOutput:
        """The finished sequences as right-padded rows, with the call's figures."""
        cuda = device.type == "cuda"
        out_len = ws.out_len[:num_seqs]
        mask = (torch.arange(width, device=device)[None, :] < out_len[:, None]).long()
        responses = torch.where(mask.bool(), ws.out_tokens[:num_seqs], self.pad_token_id)
        log_probs = ws.out_log_probs[:num_seqs] * mask
        if cuda:
            torch.cuda.synchronize(device)
        tokens = float(out_len.sum().item())
        elapsed = time.perf_counter() - start
        stats = {
            "rollout/time_s": elapsed,
            "rollout/prefill_s": timings["prefill_s"],
            "rollout/prefill_tokens": float(self._prefill_tokens),
            "rollout/prefix_reused": float(self._prefix_reused),
            "rollout/graph_capture_s": timings["graph_capture_s"],
            "rollout/cuda_graphs": float(cuda and self.use_cuda_graph),  # 0: eager decode (or capture failed)
            "rollout/tokens_generated": tokens,
            "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
            "rollout/num_slots": float(ws.kv.shape[2]),
            "rollout/decode_steps": timings["decode_steps"],
            "rollout/kv_cache_gb": ws.kv.numel() * ws.kv.element_size() / 2**30,
            "rollout/fused_weights_gb": _fused_bytes(ws.weights) / 2**30,
            "perf/rollout_peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0,
        }
        return RolloutOutput(
            responses=responses.clone(), response_mask=mask, log_probs=log_probs.clone(), stats=stats
        )

    def _num_slots(self, w: LlamaWeights, device: torch.device, num_seqs: int, max_len: int) -> int:
        """Slots that fit the budget, given everything allocated now (fused weights included)."""
        cap = min(num_seqs, self.max_num_seqs or num_seqs)
        if device.type != "cuda":
            return cap
        elt = w.embed.element_size()
        hidden, vocab = w.embed.shape[1], w.lm_head.shape[0]
        inter = w.layers[0].gate.shape[0]
        per_slot = len(w.layers) * 2 * w.num_kv_heads * max_len * w.head_dim * elt + vocab * 4 * 8
        workspace = self.max_prefill_tokens * (3 * inter + 8 * hidden + 4 * w.num_heads * w.head_dim) * elt
        total = torch.cuda.get_device_properties(device).total_memory
        budget = self.gpu_memory_utilization * total - torch.cuda.memory_allocated(device) - workspace
        slots = int(budget // per_slot)
        if w.tp is not None:  # the ranks of a tensor-parallel group run the same slots in lockstep
            slots = int(all_reduce_min(slots, w.tp.group))
        if slots < 1:
            raise ValueError(
                f"gpu_memory_utilization={self.gpu_memory_utilization} leaves no room for a KV cache "
                f"({torch.cuda.memory_allocated(device) / 2**30:.1f} GiB already allocated)"
            )
        return min(cap, slots)

    def _workspace(self, w, device, num_seqs, width, max_len, params) -> _Workspace:
        fuse = self.fuse_projections and w.layers[0].qkv is None  # not when given fused (tensor parallel)
        key = (num_seqs, width, max_len, w.embed.dtype, w.signature(), params, fuse)
        if self._ws is not None and self._ws.key == key:
            if fuse:  # the model's weights may have changed in place: refresh the copies, same addresses
                w.fuse(into=self._ws.weights)
            return self._ws
        self._ws = None  # free the old cache (and fused copies) before allocating the new ones
        fused = w.fuse() if fuse else None
        num_slots = self._num_slots(w, device, num_seqs, max_len)
        kv = torch.zeros(  # zeros: masked-out cache entries must be finite (0 × NaN = NaN)
            (len(w.layers), 2, num_slots, max_len, w.num_kv_heads, w.head_dim),
            dtype=w.embed.dtype,
            device=device,
        )

        def zeros(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        self._ws = _Workspace(
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
            out_len=zeros(num_seqs + 1),
        )
        return self._ws

    def _prefill(
        self, w, ws, packed, starts, seq_lengths, pairs, params, eos, check_eos, n, resident, prompt_hidden
    ) -> None:
        """Prefill ``pairs`` (sequence, slot) and sample each sequence's first token.

        A prompt runs at most once while any of its samples holds a slot: its first sequence here runs it
        unless ``resident`` (prompt → a busy slot already holding its K/V prefix) names one; every other
        sample gets the prefix copied into its slot, and its first-token logits from the prompt's stored
        last hidden state (``prompt_hidden``, written when the prompt runs). The sampling noise differs.
        """
        device = packed.device
        seqs = [s for s, _ in pairs]
        slot_list = [slot for _, slot in pairs]
        prompt_of = [s // n for s in seqs]
        leader: dict[int, int] = {}  # prompt run here -> position in pairs of the sequence it runs in
        for j, p in enumerate(prompt_of):
            if p not in resident:
                leader.setdefault(p, j)
        if leader:
            lead = list(leader.values())
            index = torch.cat([torch.arange(starts[p], starts[p + 1]) for p in leader]).to(device)
            lead_slots = torch.tensor([slot_list[j] for j in lead], device=device)
            hidden = prefill(w, ws.kv, packed[index], lead_slots, [seq_lengths[seqs[j]] for j in lead])
            prompt_hidden[torch.tensor(list(leader), device=device)] = hidden
            self._prefill_tokens += int(index.numel())
        source = {**resident, **{p: slot_list[j] for p, j in leader.items()}}
        copies = [j for j, p in enumerate(prompt_of) if leader.get(p) != j]
        self._prefix_reused += sum(p in resident for p in prompt_of)
        if copies:  # positions past a prompt's length are copied too: masked until overwritten
            width = max(seq_lengths[seqs[j]] for j in copies)
            dst = torch.tensor([slot_list[j] for j in copies], device=device)
            src = torch.tensor([source[prompt_of[j]] for j in copies], device=device)
            ws.kv[:, :, dst, :width] = ws.kv[:, :, src, :width]
        unique = list(dict.fromkeys(prompt_of))
        row_of = {p: row for row, p in enumerate(unique)}
        logits = logits_of(w, prompt_hidden[torch.tensor(unique, device=device)], self.fp32_logits)
        logits = logits[torch.tensor([row_of[p] for p in prompt_of], device=device)]
        slots = torch.tensor(slot_list, device=device)
        seq_t = torch.tensor(seqs, device=device)
        tokens, log_probs = self._sampler(params, device.type == "cuda", w)(logits)
        ws.out_tokens[seq_t, 0] = tokens
        ws.out_log_probs[seq_t, 0] = log_probs
        ws.out_len[seq_t] = 1
        ws.last_token[slots] = tokens
        ws.position[slots] = torch.tensor([seq_lengths[s] for s in seqs], device=device)
        ws.seq_id[slots] = seq_t
        ws.gen_len[slots] = 1
        done = torch.full_like(tokens, params.max_new_tokens <= 1, dtype=torch.bool)
        if check_eos:
            done |= torch.isin(tokens, eos)
        ws.finished[slots] = done

    def _step_fn(self, w, ws, bucket, params, eos, check_eos, cuda):
        """A callable running one decode step on slots [0, bucket): a graph replay on GPU."""
        width, sink, max_len = params.max_new_tokens, ws.out_len.shape[0] - 1, ws.kv.shape[3]

        layer_fns = (attn_in, attn_out_mlp)
        if self._compiles(cuda):
            layer_fns = (compiled("attn_in"), compiled("attn_out_mlp"))
        if w.tp is not None:  # the row-parallel all-reduces run eagerly (captured in the graph on CUDA)
            layer_fns = (layer_fns[0], layer_back(w))
        flash = self._use_flash(ws.kv)
        sampler = self._sampler(params, cuda, w)

        def step() -> None:
            logits = decode(
                w, ws.kv, ws.last_token[:bucket], ws.position[:bucket], layer_fns, flash, self.fp32_logits
            )
            tokens, log_probs = sampler(logits)
            alive = ~ws.finished[:bucket]
            row = torch.where(alive, ws.seq_id[:bucket], sink)
            col = ws.gen_len[:bucket].clamp(max=width - 1)
            ws.out_tokens[row, col] = tokens
            ws.out_log_probs[row, col] = log_probs
            ws.gen_len[:bucket] += alive.long()
            ws.out_len[row] = ws.gen_len[:bucket]
            done = ws.gen_len[:bucket] >= width
            if check_eos:
                done |= torch.isin(tokens, eos)
            ws.finished[:bucket] |= alive & done
            ws.last_token[:bucket] = tokens
            ws.position[:bucket] = (ws.position[:bucket] + 1).clamp(max=max_len - 1)

        if not (cuda and self.use_cuda_graph):
            return step
        if bucket in ws.graphs:
            return ws.graphs[bucket].replay
        state = [ws.last_token, ws.position, ws.gen_len, ws.finished, ws.out_len]
        saved = [t.clone() for t in state]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up (lazy inits, cuBLAS workspaces) outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        for t, s in zip(state, saved):
            t.copy_(s)
        if ws.pool is None:
            ws.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        if w.tp is None:
            with torch.cuda.graph(graph, pool=ws.pool):
                step()
        else:  # NCCL collectives inside the graph: untested on every stack, so a failed capture runs eager
            try:
                with torch.cuda.graph(graph, pool=ws.pool):
                    step()
            except RuntimeError as err:
                warnings.warn(f"tensor-parallel decode runs without CUDA graphs (capture failed: {err})",
                              stacklevel=2)  # fmt: skip
                self.use_cuda_graph = False
                return step
        ws.graphs[bucket] = graph
        return graph.replay

    def _use_flash(self, kv: torch.Tensor) -> str | None:
        """The ``flash`` argument of ``decode``: "packed", "plain" or None (masked SDPA)."""
        if self.decode_attention == "sdpa":
            return None
        ok = kv.device.type == "cuda" and kv.dtype in (torch.bfloat16, torch.float16)
        if self.decode_attention != "auto" and not ok:
            raise ValueError(
                f"decode_attention={self.decode_attention!r} needs a CUDA bf16/fp16 cache, got {kv.device} {kv.dtype}"
            )
        if not ok:
            return None
        return "plain" if self.decode_attention == "flash-plain" else "packed"

    def _sampler(self, params: SamplingParams, cuda: bool, w: LlamaWeights):
        """``logits -> (tokens, log_probs)`` for ``params``: compiled and fused on GPU when untruncated;
        over the vocabulary shards of a tensor-parallel group when ``w.tp``."""
        if w.tp is not None:
            return vocab_parallel_sampler(params, w.tp, w.vocab_size)
        if not is_untruncated(params):
            return lambda logits: sample(logits, params)
        # greedy (validation) stays eager: logsumexp + argmax are two plain reductions, and one graph fewer
        # to compile at start-up
        fn = compiled("sample") if self._compiles(cuda) and not params.greedy else sample_untruncated
        temperature = 1.0 if params.greedy else float(params.temperature)

        def run(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            if logits.shape[0] == 1:  # a prefill of one sequence: 2 rows keep the compiled graph's batch dim
                tokens, log_probs = fn(logits.repeat(2, 1), temperature, params.greedy)
                return tokens[:1], log_probs[:1]
            return fn(logits, temperature, params.greedy)

        return run

    def _compiles(self, cuda: bool) -> bool:
        """Whether decode runs the compiled functions: ``compile_decode`` None = on GPU only."""
        return cuda if self.compile_decode is None else bool(self.compile_decode)


def _require_gathered(w: LlamaWeights) -> None:
    """The engine reads gathered weights (full, or a tensor-parallel group's slices), never FSDP2 shards."""
    if type(w.embed) is not torch.Tensor and type(w.embed).__name__ == "DTensor":
        raise ValueError("klppo rollout needs full (gathered) weights, got DTensor shards")


def _fused_bytes(w: LlamaWeights | None) -> int:
    if w is None:
        return 0
    tensors = [
        t for lw in w.layers for t in (lw.qkv, lw.qkv_bias, lw.gate_up, lw.gate_up_bias) if t is not None
    ]
    return sum(t.numel() * t.element_size() for t in tensors)


def _buckets(num_slots: int) -> list[int]:
    """Powers of two from 2 below ``num_slots``, then ``num_slots``.

    No bucket of 1 (unless there is one slot): a batch of one would be a separate compiled graph (size-1
    dims are specialised), compiled mid-rollout; a spare idle slot costs nothing.
    """
    out, b = [], 2
    while b < num_slots:
        out.append(b)
        b *= 2
    return out + [num_slots]
