"""The engine's slot bookkeeping, without tensors: hand-computed admissions, refills, plans and buckets."""

from __future__ import annotations

import random

from klppo.rollout.scheduler import SlotScheduler, buckets


def test_refills_finishes_and_prefill_plans_match_a_hand_computed_run() -> None:
    # prompts of lengths 4, 2, 3, two samples each: sequences 0..5 (prompt s // 2), 3 slots, budget 5
    sched = SlotScheduler(prompt_lengths=[4, 2, 3], n=2, num_slots=3, max_prefill_tokens=5)
    first = sched.start()
    assert first == [(0, 0), (1, 1), (2, 2)] and sched.slot_seq == [0, 1, 2]
    # 4 + 4 > 5 and 4 + 2 > 5: three chunks of one sequence
    chunks = sched.chunks(first)
    assert chunks == [[(0, 0)], [(1, 1)], [(2, 2)]]
    a = sched.plan(chunks[0])  # prompt 0 runs in slot 0
    assert (a.run_prompts, a.run_slots, a.run_lengths, a.copy_dst, a.reused) == ([0], [0], [4], [], 0)
    assert (a.positions, a.unique_prompts, a.logit_rows) == ([4], [0], [0])
    b = sched.plan(chunks[1])  # sample 1 of prompt 0: prefix copied from busy slot 0
    assert (b.run_prompts, b.copy_dst, b.copy_src, b.copy_width, b.reused) == ([], [1], [0], 4, 1)
    c = sched.plan(chunks[2])  # prompt 1 runs in slot 2
    assert (c.run_prompts, c.run_slots, c.run_lengths, c.positions) == ([1], [2], [2], [2])
    assert (sched.prefill_tokens, sched.prefix_reused) == (6, 1)
    assert buckets(3) == [1, 2, 3] and sched.bucket() == 3

    # slots 0 and 2 finish: sequences 3 and 4 take them (lowest id into the lowest slot)
    refill = sched.finish([True, False, True])
    assert refill == [(3, 0), (4, 2)] and sched.slot_seq == [3, 1, 4]
    assert sched.chunks(refill) == [refill]  # 2 + 3 = 5 tokens: one chunk
    d = sched.plan(
        refill
    )  # prompt 1's only holder (slot 2) left: it runs again, and prompt 2 for the first time
    assert (d.run_prompts, d.run_slots, d.run_lengths, d.copy_dst, d.reused) == (
        [1, 2],
        [0, 2],
        [2, 3],
        [],
        0,
    )
    assert (d.positions, d.unique_prompts, d.logit_rows) == ([2, 3], [1, 2], [0, 1])
    assert sched.bucket() == 3

    # slot 1 finishes: sequence 5 (prompt 2) copies its prefix from slot 2, still decoding
    refill = sched.finish([False, True, False])
    assert refill == [(5, 1)] and sched.slot_seq == [3, 5, 4]
    e = sched.plan(refill)
    assert (e.run_prompts, e.copy_dst, e.copy_src, e.copy_width, e.reused) == ([], [1], [2], 3, 1)
    assert (sched.prefill_tokens, sched.prefix_reused) == (11, 2)

    # nothing waits any more: finished slots stay free; the bucket still covers the highest busy slot
    assert sched.finish([True, True, False]) == [] and sched.slot_seq == [-1, -1, 4]
    assert sched.bucket() == 3
    assert sched.finish([False, False, True]) == [] and sched.bucket() is None


def test_samples_of_one_prompt_in_one_chunk_run_it_once() -> None:
    sched = SlotScheduler(prompt_lengths=[3, 5], n=3, num_slots=6, max_prefill_tokens=100)
    pairs = sched.start()
    assert sched.chunks(pairs) == [pairs]
    plan = sched.plan(pairs)
    assert plan.run_prompts == [0, 1] and plan.run_slots == [0, 3] and plan.run_lengths == [3, 5]
    assert plan.copy_dst == [1, 2, 4, 5] and plan.copy_src == [0, 0, 3, 3] and plan.copy_width == 5
    assert plan.logit_rows == [0, 0, 0, 1, 1, 1] and plan.reused == 0
    assert sched.prefill_tokens == 8


def test_a_prompt_over_the_budget_is_a_chunk_of_its_own() -> None:
    sched = SlotScheduler(prompt_lengths=[2, 9, 2, 2], n=1, num_slots=4, max_prefill_tokens=4)
    assert sched.chunks(sched.start()) == [[(0, 0)], [(1, 1)], [(2, 2), (3, 3)]]


def test_bucket_shrinks_with_the_highest_busy_slot() -> None:
    sched = SlotScheduler(prompt_lengths=[1] * 5, n=1, num_slots=5, max_prefill_tokens=10)
    for chunk in sched.chunks(sched.start()):
        sched.plan(chunk)
    assert buckets(5) == [1, 2, 4, 5] and sched.bucket() == 5
    sched.finish([False, False, False, False, True])
    assert sched.bucket() == 4
    sched.finish([False, False, True, True, False])
    assert sched.bucket() == 2
    sched.finish([False, True, False, False, False])
    assert sched.bucket() == 1  # only slot 0 busy: a batch of one (no padding row)
    assert buckets(1) == [1]


def test_random_finishes_admit_every_sequence_once() -> None:
    rng = random.Random(0)
    for _ in range(50):
        n, num_prompts, num_slots = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 7)
        lengths = [rng.randint(1, 8) for _ in range(num_prompts)]
        sched = SlotScheduler(prompt_lengths=lengths, n=n, num_slots=num_slots, max_prefill_tokens=8)
        admitted = []
        pairs = sched.start()
        while True:
            for chunk in sched.chunks(pairs):
                assert sum(sched.seq_length(s) for s, _ in chunk) <= 8 or len(chunk) == 1
                plan = sched.plan(chunk)
                assert sorted(plan.run_slots + plan.copy_dst) == sorted(plan.slots)
                admitted += plan.seqs
            if sched.bucket() is None:
                break
            assert sched.bucket() > max(sched.busy())
            pairs = sched.finish([rng.random() < 0.4 for _ in range(num_slots)])
        assert admitted == list(range(num_prompts * n))  # each once, in id order
        assert sched.prefill_tokens >= sum(lengths)


def test_compaction_moves_the_high_busy_slots_into_the_smaller_bucket() -> None:
    # 2 prompts × 4 samples in 8 slots (buckets 1, 2, 4, 8): nothing waits once they are all in
    sched = SlotScheduler(prompt_lengths=[3, 2], n=4, num_slots=8, max_prefill_tokens=100)
    sched.plan(sched.start())
    assert sched.compact() == []  # 8 busy: already the smallest bucket that holds them
    sched.finish([True, False, True, True, False, False, True, False])  # busy: 1, 4, 5, 7 → bucket 8
    assert sched.bucket() == 8
    assert sched.compact(min_bucket=8) == []  # the bucket of 4 is below min_bucket
    moves = sched.compact()
    assert moves == [(4, 0), (5, 2), (7, 3)]  # the busy slots ≥ 4 into the free slots < 4, lowest first
    assert sched.slot_seq == [4, 1, 5, 7, -1, -1, -1, -1] and sched.bucket() == 4
    assert sched._holders == {0: {1}, 1: {0, 2, 3}}  # sequences 4, 5, 7 are samples of prompt 1
    assert sched.compact() == []
    sched.finish([False, True, True, False, False, False, False, False])  # busy: 0, 3 → bucket 4
    assert sched.compact() == [(3, 1)] and sched.slot_seq[:4] == [4, 7, -1, -1] and sched.bucket() == 2


def test_compaction_after_the_last_refill() -> None:
    sched = SlotScheduler(prompt_lengths=[2] * 10, n=1, num_slots=8, max_prefill_tokens=100)
    sched.plan(sched.start())
    refill = sched.finish([True] * 7 + [False])  # sequences 8 and 9 take slots 0 and 1; none waits
    sched.plan(refill)
    assert sched.slot_seq == [8, 9, -1, -1, -1, -1, -1, 7] and sched.bucket() == 8
    assert sched.compact() == [(7, 2)] and sched.bucket() == 4
    waiting = SlotScheduler(prompt_lengths=[2] * 20, n=1, num_slots=8, max_prefill_tokens=100)
    waiting.plan(waiting.start())
    waiting.plan(waiting.finish([True] * 7 + [False]))  # 5 still wait
    assert waiting.compact() == []
