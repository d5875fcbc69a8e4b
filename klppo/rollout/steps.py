"""The tensor work of one ``generate`` call on its workspace: prefill chunks, decode steps, slot moves,
output.

The engine (:mod:`klppo.rollout.engine`) decides what runs and when; the call's backend
(:mod:`klppo.rollout.backends`) does the model's arithmetic; these functions do the work on the
:class:`Call`'s workspace: :func:`prefill_chunk` (one :class:`~klppo.rollout.scheduler.PrefillPlan`, then
each sequence's first token), :func:`extend_slots` (a session's appended tokens), :func:`decode_step` (one
step on slots ``[0, bucket)``, no host synchronisation: capturable as a CUDA graph; a finished slot writes
into the output's sink row), :func:`move_slots` (compaction), :func:`assemble_output` (right-padded rows).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from klppo.models.llama_weights import LlamaWeights
from klppo.rollout.backends import Backend, Sampler
from klppo.rollout.base import RolloutOutput, SamplingParams
from klppo.rollout.sampling import Draw
from klppo.rollout.scheduler import PrefillPlan, SlotScheduler
from klppo.rollout.workspace import Workspace


@dataclasses.dataclass
class Call:
    """One ``generate`` call's fixed inputs, shared by its prefills and decode steps."""

    w: LlamaWeights  # the weights decode reads (the fused copies)
    ws: Workspace
    params: SamplingParams
    packed: torch.Tensor  # [sum of prompt lengths] the prompts' real tokens, back to back
    starts: list[int]  # prompt p is packed[starts[p] : starts[p + 1]]
    prompt_hidden: torch.Tensor  # [num_prompts, hidden] each prompt's last hidden state, once it has run
    eos: torch.Tensor  # [E] the ids that end a sequence ([-1] when none)
    check_eos: bool  # False: sequences end at max_new_tokens only
    cuda: bool
    pad: int  # the id written after a sequence's end
    backend: Backend  # the arithmetic (chosen for this call's weights)
    sample: Sampler  # the backend's sampler for ``params``


def prefill_chunk(call: Call, plan: PrefillPlan) -> None:
    """Run ``plan`` (its prompts write K/V and ``call.prompt_hidden``; the other sequences copy a prefix)
    and sample each sequence's first token from its prompt's hidden state (noise per sequence)."""
    w, ws, device = call.w, call.ws, call.packed.device
    if plan.run_prompts:
        starts = call.starts
        index = torch.cat([torch.arange(starts[p], starts[p + 1]) for p in plan.run_prompts]).to(device)
        run_slots = torch.tensor(plan.run_slots, device=device)
        hidden = call.backend.prefill(w, ws.kv, call.packed[index], run_slots, plan.run_lengths)
        call.prompt_hidden[torch.tensor(plan.run_prompts, device=device)] = hidden
    if plan.copy_dst:  # positions past a prompt's length are copied too: masked until overwritten
        dst = torch.tensor(plan.copy_dst, device=device)
        src = torch.tensor(plan.copy_src, device=device)
        ws.kv[:, :, dst, : plan.copy_width] = ws.kv[:, :, src, : plan.copy_width]
    unique = torch.tensor(plan.unique_prompts, device=device)
    logits = call.backend.logits(w, call.prompt_hidden[unique])
    start_sequences(call, plan, call.sample(logits[torch.tensor(plan.logit_rows, device=device)]))


def extend_slots(call: Call, slots: list[int], tokens: list[list[int]], starts: list[int]) -> None:
    """Append ``tokens[i]`` to a session's slot ``slots[i]`` (sequence ``s`` in slot ``s``), whose cache holds
    ``[0, starts[i])`` and whose last sampled token is not cached yet: prefill that token and ``tokens[i]``
    but its last at positions ``starts[i] ..``; the next decode step feeds the last and samples the turn's
    first token into the response column after the appended ones."""
    ws, device = call.ws, call.packed.device
    slots_t = torch.tensor(slots, device=device)
    counts = torch.tensor([len(t) for t in tokens], device=device)
    lasts = ws.out_tokens[slots_t, ws.out_len[slots_t] - 1].tolist()  # a finished slot's last_token drifts
    packed = [t for last, more in zip(lasts, tokens) for t in (last, *more[:-1])]
    call.backend.prefill(call.w, ws.kv, torch.tensor(packed, device=device), slots_t, counts.tolist(), starts)
    ws.last_token[slots_t] = torch.tensor([t[-1] for t in tokens], device=device)
    ws.position[slots_t] = torch.tensor(starts, device=device) + counts
    ws.gen_len[slots_t] = ws.out_len[slots_t] + counts
    ws.finished[slots_t] = False


def start_sequences(call: Call, plan: PrefillPlan, draw: Draw) -> None:
    """Record the first tokens of ``plan``'s sequences (``call.sample``'s ``draw``) and set their slots'
    decode state."""
    (tokens, log_probs, truncated), ws, device = draw, call.ws, call.packed.device
    slots = torch.tensor(plan.slots, device=device)
    seq_t = torch.tensor(plan.seqs, device=device)
    ws.out_tokens[seq_t, 0] = tokens
    ws.out_log_probs[seq_t, 0] = log_probs
    if truncated is not None:
        ws.out_truncated[seq_t, 0] = truncated
    ws.out_len[seq_t] = 1
    ws.last_token[slots] = tokens
    ws.position[slots] = torch.tensor(plan.positions, device=device)
    ws.seq_id[slots] = seq_t
    ws.gen_len[slots] = 1
    done = torch.full_like(tokens, call.params.max_new_tokens <= 1, dtype=torch.bool)
    if call.check_eos:
        done |= ends(tokens, call.eos)
    ws.finished[slots] = done


def ends(tokens: torch.Tensor, eos: torch.Tensor) -> torch.Tensor:
    """Which ``tokens`` [B] are one of the ``eos`` ids [E], by a [B, E] compare: ``torch.isin`` calls
    ``unique`` from about 10 ids on, a host sync that breaks a CUDA-graph capture."""
    return (tokens[:, None] == eos[None, :]).any(dim=1)


def decode_step(call: Call, bucket: int) -> Callable[[], None]:
    """One eager decode step on slots [0, bucket): decode, sample, record, advance (no host sync)."""
    w, ws, decode, sampler = call.w, call.ws, call.backend.decode, call.sample
    width, sink, max_len = call.params.max_new_tokens, ws.out_len.shape[0] - 1, ws.kv.shape[3]

    def step() -> None:
        logits = decode(w, ws.kv, ws.last_token[:bucket], ws.position[:bucket])
        tokens, log_probs, truncated = sampler(logits)
        alive = ~ws.finished[:bucket]
        row = torch.where(alive, ws.seq_id[:bucket], sink)
        col = ws.gen_len[:bucket].clamp(max=width - 1)
        ws.out_tokens[row, col] = tokens
        ws.out_log_probs[row, col] = log_probs
        if truncated is not None:
            ws.out_truncated[row, col] = truncated
        ws.gen_len[:bucket] += alive.long()
        ws.out_len[row] = ws.gen_len[:bucket]
        done = ws.gen_len[:bucket] >= width
        if call.check_eos:
            done |= ends(tokens, call.eos)
        ws.finished[:bucket] |= alive & done
        ws.last_token[:bucket] = tokens
        ws.position[:bucket] = (ws.position[:bucket] + 1).clamp(max=max_len - 1)

    return step


def move_slots(ws: Workspace, moves: list[tuple[int, int]]) -> int:
    """Move each (from, to) slot's K/V and decode state; the emptied slots idle as finished. Returns the
    count."""
    if moves:
        src = torch.tensor([a for a, _ in moves], device=ws.kv.device)
        dst = torch.tensor([b for _, b in moves], device=ws.kv.device)
        ws.kv[:, :, dst] = ws.kv[:, :, src]
        for state in (ws.last_token, ws.position, ws.seq_id, ws.gen_len, ws.finished):
            state[dst] = state[src]
        ws.finished[src] = True
    return len(moves)


def assemble_output(
    call: Call, sched: SlotScheduler, start: float, timings: dict, graphs: bool, turn: tuple | None = None
) -> RolloutOutput:
    """The finished sequences as right-padded rows, with the call's figures (``start``: its ``perf_counter``;
    ``graphs``: decode replayed CUDA graphs); ``turn`` = (sequences, first columns): a session's turn."""
    ws, device, width = call.ws, call.packed.device, call.params.max_new_tokens
    seqs, cols = turn or (list(range(sched.num_seqs)), [0] * sched.num_seqs)
    seqs, first = torch.tensor(seqs, device=device), torch.tensor(cols, device=device)[:, None]
    columns = torch.arange(width, device=device)[None, :]
    out_len = ws.out_len[seqs] - first[:, 0]
    mask = (columns < out_len[:, None]).long()
    index = (first + columns).clamp(max=width - 1)
    responses = torch.where(mask.bool(), ws.out_tokens[seqs].gather(1, index), call.pad)
    log_probs = ws.out_log_probs[seqs].gather(1, index) * mask
    truncated = None if ws.out_truncated is None else ws.out_truncated[seqs].gather(1, index) * mask
    if call.cuda:
        torch.cuda.synchronize(device)
    tokens = float(out_len.sum().item())
    elapsed = time.perf_counter() - start
    stats = {
        "rollout/time_s": elapsed,
        "rollout/prefill_s": timings["prefill_s"],
        "rollout/prefill_tokens": float(sched.prefill_tokens),
        "rollout/prefix_reused": float(sched.prefix_reused),
        "rollout/graph_capture_s": timings["graph_capture_s"],
        "rollout/cuda_graphs": float(graphs),  # 0: eager decode (or capture failed)
        "rollout/tokens_generated": tokens,
        "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
        "rollout/num_slots": float(ws.kv.shape[2]),
        "rollout/decode_steps": timings["decode_steps"],
        "rollout/slot_moves": timings["slot_moves"],
        "rollout/kv_cache_gb": ws.kv.numel() * ws.kv.element_size() / 2**30,
        "rollout/fused_weights_gb": ws.fused_bytes() / 2**30,
        "perf/rollout_peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if call.cuda else 0.0,
    }
    return RolloutOutput(responses, mask, log_probs, stats, truncated_log_probs=truncated)
