"""Slot bookkeeping of the engine's continuous batching, in plain Python (no tensors, no device).

Which sequence sits in which KV-cache slot, which wait, which busy slot holds each prompt's K/V prefix,
how admissions split into prefill chunks, which decode bucket covers the busy slots. The engine turns each
:class:`PrefillPlan` into tensor work and hands back the finished flags. Sequence ``s`` (of ``num_prompts ×
n``) is sample ``s % n`` of prompt ``s // n`` and writes output row ``s``. Rules:

- waiting sequences are admitted lowest id first, into the lowest free slots;
- an admission is prefilled in chunks of at most ``max_prefill_tokens`` prompt tokens (a longer sequence
  is a chunk of its own);
- within a chunk a prompt runs at most once, in its first sequence, unless a busy slot already holds its
  prefix; its other sequences copy the prefix from the slot that holds or computes it;
- the decode bucket is the smallest of :func:`buckets` greater than the highest busy slot;
- a session (:class:`~klppo.rollout.engine.Session`) keeps sequence ``s`` in slot ``s`` across turns;
- compaction (:meth:`SlotScheduler.compact`): once nothing waits, when the busy slots would fit a smaller
  bucket, those at or above it move, lowest first, into its free slots, lowest first — the step then
  follows the live sequence count.
"""

from __future__ import annotations

import dataclasses


def buckets(num_slots: int) -> list[int]:
    """Powers of two from 1 below ``num_slots``, then ``num_slots`` (bucket 1: the compiled batch-1
    graphs)."""
    out, b = [], 1
    while b < num_slots:
        out.append(b)
        b *= 2
    return out + [num_slots]


@dataclasses.dataclass(frozen=True)
class PrefillPlan:
    """What one prefill chunk does, as indices (lists in the order of the chunk's sequences)."""

    seqs: list[
        int
    ]  # each admitted sequence, its slot, its prompt, its prompt length (first token's position)
    slots: list[int]
    prompts: list[int]
    positions: list[int]
    run_prompts: list[int]  # the prompts run here (first-seen order), the slot each writes, their lengths
    run_slots: list[int]
    run_lengths: list[int]
    copy_dst: list[int]  # slots that get a prefix copied, from which slot, the longest of those prefixes
    copy_src: list[int]
    copy_width: int
    unique_prompts: list[int]  # the chunk's prompts, first-seen order: one logits row each
    logit_rows: list[int]  # each sequence's row in those logits
    reused: int  # sequences whose prompt was resident in a busy slot before this chunk


class SlotScheduler:
    """Continuous-batching state of one ``generate`` call (see the module docstring)."""

    def __init__(self, *, prompt_lengths: list[int], n: int, num_slots: int, max_prefill_tokens: int) -> None:
        self.prompt_lengths = list(prompt_lengths)
        self.n = n
        self.num_slots = num_slots
        self.max_prefill_tokens = max_prefill_tokens
        self.num_seqs = len(self.prompt_lengths) * n
        self.slot_seq = [-1] * num_slots  # sequence in each slot, -1 = free
        self._waiting = list(range(self.num_seqs))[::-1]  # pop() takes the lowest sequence id
        self._holders: dict[int, set[int]] = {}  # prompt -> busy slots holding its K/V prefix
        self._buckets = buckets(num_slots)
        self.prefill_tokens = 0  # prompt tokens run, over the call
        self.prefix_reused = 0  # sequences served from a busy sibling's prefix, over the call

    def seq_length(self, s: int) -> int:
        """Prompt length of sequence ``s``."""
        return self.prompt_lengths[s // self.n]

    def start(self) -> list[tuple[int, int]]:
        """The first admission: (sequence, slot) pairs filling the slots."""
        return self._place(list(range(min(self.num_slots, self.num_seqs))))

    def busy(self) -> list[int]:
        """Busy slots, ascending."""
        return [slot for slot, s in enumerate(self.slot_seq) if s >= 0]

    def bucket(self) -> int | None:
        """The decode bucket covering every busy slot (None: nothing left to decode)."""
        busy = self.busy()
        if not busy:
            return None
        return next(b for b in self._buckets if b > busy[-1])

    def finish(self, finished: list[bool]) -> list[tuple[int, int]]:
        """Free the busy slots whose ``finished[slot]`` is true; return the refill (sequence, slot) pairs."""
        freed = [slot for slot in self.busy() if finished[slot]]
        for slot in freed:
            self._holders[self.slot_seq[slot] // self.n].discard(slot)
            self.slot_seq[slot] = -1
        return self._place(freed[: len(self._waiting)])

    def compact(self, min_bucket: int = 2) -> list[tuple[int, int]]:
        """The (from, to) slot moves of a compaction (module docstring), applied to the bookkeeping; none
        while sequences wait, or when the smaller bucket would be below ``min_bucket``."""
        busy = self.busy()
        if self._waiting or not busy:
            return []
        target = next(b for b in self._buckets if b >= len(busy))
        if target >= self.bucket() or target < min_bucket:
            return []
        free = [slot for slot in range(target) if self.slot_seq[slot] < 0]
        moves = list(zip([slot for slot in busy if slot >= target], free))
        for src, dst in moves:
            self.slot_seq[dst], self.slot_seq[src] = self.slot_seq[src], -1
            held = self._holders[self.slot_seq[dst] // self.n]
            held.discard(src)
            held.add(dst)
        return moves

    def chunks(self, pairs: list, sizes: list[int] | None = None) -> list[list]:
        """``pairs`` split in order into prefill chunks of at most ``max_prefill_tokens`` tokens (``sizes``:
        each pair's, default its sequence's prompt length; a larger one is a chunk of its own)."""
        out: list[list] = []
        budget = 0
        for pair, size in zip(pairs, sizes or [self.seq_length(s) for s, _ in pairs]):
            if not out or budget + size > self.max_prefill_tokens:
                out.append([])
                budget = 0
            out[-1].append(pair)
            budget += size
        return out

    def resume(self, seqs: list[int]) -> None:
        """Make a session's ``seqs`` busy again in the slots they keep (sequence ``s`` in slot ``s``)."""
        for s in seqs:
            self.slot_seq[s] = s

    def plan(self, chunk: list[tuple[int, int]]) -> PrefillPlan:
        """The prefill of ``chunk`` given the prefixes resident now; records the chunk's slots as holders
        of their prompts' prefixes (call once per chunk, in order)."""
        seqs = [s for s, _ in chunk]
        slots = [slot for _, slot in chunk]
        prompts = [s // self.n for s in seqs]
        resident = {p: next(iter(held)) for p, held in self._holders.items() if held}
        leader: dict[int, int] = {}  # prompt run here -> index in the chunk of the sequence it runs in
        for j, p in enumerate(prompts):
            if p not in resident:
                leader.setdefault(p, j)
        source = {**resident, **{p: slots[j] for p, j in leader.items()}}
        copies = [j for j, p in enumerate(prompts) if leader.get(p) != j]
        unique = list(dict.fromkeys(prompts))
        row_of = {p: row for row, p in enumerate(unique)}
        plan = PrefillPlan(
            seqs=seqs,
            slots=slots,
            prompts=prompts,
            positions=[self.seq_length(s) for s in seqs],
            run_prompts=list(leader),
            run_slots=[slots[j] for j in leader.values()],
            run_lengths=[self.prompt_lengths[p] for p in leader],
            copy_dst=[slots[j] for j in copies],
            copy_src=[source[prompts[j]] for j in copies],
            copy_width=max((self.seq_length(seqs[j]) for j in copies), default=0),
            unique_prompts=unique,
            logit_rows=[row_of[p] for p in prompts],
            reused=sum(p in resident for p in prompts),
        )
        self.prefill_tokens += sum(plan.run_lengths)
        self.prefix_reused += plan.reused
        for s, slot in chunk:
            self._holders.setdefault(s // self.n, set()).add(slot)
        return plan

    def _place(self, free_slots: list[int]) -> list[tuple[int, int]]:
        """Give ``free_slots`` (in order) to the lowest waiting sequences."""
        pairs = [(self._waiting.pop(), slot) for slot in free_slots]
        for s, slot in pairs:
            self.slot_seq[slot] = s
        return pairs
