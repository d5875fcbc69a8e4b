"""The tensor work of one ``generate`` call on its workspace: prefill chunks, decode steps, slot moves,
output.

The engine (:mod:`klppo.rollout.engine`) decides what runs and when; the call's backend
(:mod:`klppo.rollout.backends`) does the model's arithmetic; these functions do the work on the
:class:`Call`'s workspace: :func:`prefill_chunk` (one :class:`~klppo.rollout.scheduler.PrefillPlan`, then
each sequence's first token), :func:`decode_step` (one step on slots ``[0, bucket)``, no host
synchronisation: capturable as a CUDA graph; a finished slot writes into the output's sink row),
:func:`move_slots` (compaction) and :func:`assemble_output` (right-padded rows and the call's figures).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import torch

from klppo.models.llama_weights import LlamaWeights
from klppo.rollout.backends import Backend, Sampler
from klppo.rollout.base import RolloutOutput, SamplingParams
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
    tokens, log_probs = call.sample(logits[torch.tensor(plan.logit_rows, device=device)])
    start_sequences(call, plan, tokens, log_probs)


def start_sequences(call: Call, plan: PrefillPlan, tokens: torch.Tensor, log_probs: torch.Tensor) -> None:
    """Record the first tokens of ``plan``'s sequences and set their slots' decode state."""
    ws, device = call.ws, call.packed.device
    slots = torch.tensor(plan.slots, device=device)
    seq_t = torch.tensor(plan.seqs, device=device)
    ws.out_tokens[seq_t, 0] = tokens
    ws.out_log_probs[seq_t, 0] = log_probs
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
        tokens, log_probs = sampler(logits)
        alive = ~ws.finished[:bucket]
        row = torch.where(alive, ws.seq_id[:bucket], sink)
        col = ws.gen_len[:bucket].clamp(max=width - 1)
        ws.out_tokens[row, col] = tokens
        ws.out_log_probs[row, col] = log_probs
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
    call: Call, sched: SlotScheduler, pad_token_id: int, start: float, timings: dict, cuda_graphs: bool
) -> RolloutOutput:
    """The finished sequences as right-padded rows, with the call's figures (``start``: its
    ``perf_counter``)."""
    ws, device, width = call.ws, call.packed.device, call.params.max_new_tokens
    num_seqs = sched.num_seqs
    out_len = ws.out_len[:num_seqs]
    mask = (torch.arange(width, device=device)[None, :] < out_len[:, None]).long()
    responses = torch.where(mask.bool(), ws.out_tokens[:num_seqs], pad_token_id)
    log_probs = ws.out_log_probs[:num_seqs] * mask
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
        "rollout/cuda_graphs": float(cuda_graphs),  # 0: eager decode (or capture failed)
        "rollout/tokens_generated": tokens,
        "rollout/tokens_per_s": tokens / max(elapsed, 1e-9),
        "rollout/num_slots": float(ws.kv.shape[2]),
        "rollout/decode_steps": timings["decode_steps"],
        "rollout/slot_moves": timings["slot_moves"],
        "rollout/kv_cache_gb": ws.kv.numel() * ws.kv.element_size() / 2**30,
        "rollout/fused_weights_gb": ws.fused_bytes() / 2**30,
        "perf/rollout_peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if call.cuda else 0.0,
    }
    return RolloutOutput(
        responses=responses.clone(), response_mask=mask, log_probs=log_probs.clone(), stats=stats
    )
