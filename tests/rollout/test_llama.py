"""``llama.prefill`` continuing a slot (``offsets``) against one prefill of the whole sequence (CPU, fp32)."""

from __future__ import annotations

import torch

from klppo.models.llama_weights import LlamaWeights
from klppo.rollout.llama import logits_of, prefill

SEQUENCES = [[1, 10, 20, 30, 40, 50, 60], [1, 7, 8, 9, 11], [5, 6, 7, 8, 9, 10, 11, 12, 13]]
SPLITS = [3, 4, 1]  # sequence i: the first SPLITS[i] tokens cached, the rest appended


def cache(w: LlamaWeights, num_slots: int, max_len: int = 16) -> torch.Tensor:
    return torch.zeros(len(w.layers), 2, num_slots, max_len, w.num_kv_heads, w.head_dim)


def test_an_offset_prefill_equals_one_prefill_of_the_concatenation(tiny_qwen2) -> None:
    w = LlamaWeights.read(tiny_qwen2)
    slots = torch.tensor([2, 0, 1])  # not in sequence order: slots are indexed, not assumed
    full_kv = cache(w, 3)
    full = prefill(w, full_kv, torch.tensor(sum(SEQUENCES, [])), slots, [len(s) for s in SEQUENCES])

    kv = cache(w, 3)
    heads = [s[:k] for s, k in zip(SEQUENCES, SPLITS)]
    tails = [s[k:] for s, k in zip(SEQUENCES, SPLITS)]
    prefill(w, kv, torch.tensor(sum(heads, [])), slots, [len(h) for h in heads])
    kv[:, :, :, 12:] = 7.0  # stale entries past the cached prefix must be overwritten or masked
    hidden = prefill(w, kv, torch.tensor(sum(tails, [])), slots, [len(t) for t in tails], SPLITS)

    torch.testing.assert_close(hidden, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits_of(w, hidden), logits_of(w, full), atol=1e-5, rtol=1e-5)
    for slot, seq in zip(slots.tolist(), SEQUENCES):
        torch.testing.assert_close(kv[:, :, slot, : len(seq)], full_kv[:, :, slot, : len(seq)])


def test_an_offset_prefill_matches_the_model_forward(tiny_qwen2) -> None:
    """Against transformers' own forward: the continued slot's next-token logits."""
    w = LlamaWeights.read(tiny_qwen2)
    seq, k = SEQUENCES[0], 2
    kv = cache(w, 1)
    slot = torch.tensor([0])
    prefill(w, kv, torch.tensor(seq[:k]), slot, [k])
    hidden = prefill(w, kv, torch.tensor(seq[k:]), slot, [len(seq) - k], [k])
    with torch.no_grad():
        ref = tiny_qwen2(input_ids=torch.tensor([seq])).logits[0, -1]
    torch.testing.assert_close(logits_of(w, hidden)[0], ref, atol=1e-5, rtol=1e-5)
