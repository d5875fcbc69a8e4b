"""The klppo engine's sessions (CPU, fp32): a conversation continued in its slot gives the tokens and
log-probs of one ``generate`` on the whole conversation so far."""

from __future__ import annotations

import pytest
import torch

from klppo.models.tiny import build_tiny_model
from klppo.rollout import EngineSettings, SamplingParams, make_rollout
from tests.rollout.conftest import left_padded

PROMPTS = [[1, 10, 20, 30, 40, 50], [1, 7, 8], [1, 99, 100, 101, 102]]
APPENDED = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15]]  # one message per row, of different lengths
BUDGET = 40


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """A tiny Llama whose greedy rows do not repeat one token (the tiny Qwen2's do)."""
    return build_tiny_model(arch="llama", tie_word_embeddings=False).eval()


def engine(eos: tuple[int, ...] = (), **kwargs):
    settings = EngineSettings(eos_token_ids=eos, pad_token_id=0, eos_check_every=3, **kwargs)
    return make_rollout("klppo", settings)


def continued_against_whole(model, device: str, log_prob_atol: float) -> tuple[int, int]:
    """Three conversations: a first turn ended by an EOS, one appended message each, a continued turn; each
    continued turn against one ``generate`` on the whole conversation so far. Returns (tokens that agree,
    tokens compared); the first token of each turn and the turn ends must agree, log-probs within
    ``log_prob_atol`` where the tokens agree."""
    prompts, mask = (t.to(device) for t in left_padded(PROMPTS))
    params = SamplingParams(max_new_tokens=BUDGET, do_sample=False)
    free = engine().generate(model, prompts, mask, params)  # no EOS: 40 greedy tokens a row
    eos = tuple({int(free.responses[i, k]) for i, k in enumerate([5, 8, 3])})  # turns end near there
    ended = engine(eos)
    session = ended.open(model, prompts, mask, params)
    first = session.generate([0, 1, 2])
    turns = [first.responses[i, : int(first.response_mask[i].sum())].tolist() for i in range(3)]
    rows = [i for i, t in enumerate(turns) if t[-1] in eos][::-1]  # a subset, in any order
    assert len(rows) == 3 and len({len(t) for t in turns}) == 3  # turns of different lengths
    session.extend(rows, [APPENDED[i] for i in rows])
    second = session.generate(rows)
    session.close()
    agree = total = 0
    for out_row, row in enumerate(rows):
        ids, whole_mask = (t.to(device) for t in left_padded([PROMPTS[row] + turns[row] + APPENDED[row]]))
        room = BUDGET - len(turns[row]) - len(APPENDED[row])
        ref = ended.generate(model, ids, whole_mask, SamplingParams(max_new_tokens=room, do_sample=False))
        k = int(ref.response_mask.sum())
        got, want = second.responses[out_row, :k], ref.responses[0, :k]
        assert int(got[0]) == int(want[0])
        same = got == want
        diff = (second.log_probs[out_row, :k] - ref.log_probs[0, :k]).abs()[same]
        assert float(diff.max()) <= log_prob_atol, float(diff.max())
        if bool(same.all()):  # the same tokens: the same turn end too
            assert int(second.response_mask[out_row].sum()) == k
        agree, total = agree + int(same.sum()), total + k
    assert second.stats["rollout/prefill_tokens"] == sum(len(APPENDED[i]) for i in rows)
    return agree, total


def test_a_continued_turn_equals_generate_on_the_whole_conversation(model) -> None:
    agree, total = continued_against_whole(model, "cpu", 1e-5)
    assert agree == total  # fp32: every token


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_continued_turn_on_the_gpu_fast_path_matches_generate_on_the_whole_conversation() -> None:
    """bf16 on CUDA (the split backend: the Triton decode reads K/V that the offset prefill wrote): the
    same, within bf16 rounding (log-probs 0.05; greedy near-ties may part later tokens)."""
    tiny = build_tiny_model(arch="llama", tie_word_embeddings=False, hidden_size=256, intermediate_size=512)
    agree, total = continued_against_whole(tiny.to("cuda", torch.bfloat16).eval(), "cuda", 0.05)
    assert agree >= 0.8 * total, (agree, total)


def test_extend_refuses_what_leaves_no_room_and_too_few_slots_open_nothing(model) -> None:
    prompts, mask = left_padded(PROMPTS)
    params = SamplingParams(max_new_tokens=12, do_sample=False)
    assert engine(max_num_seqs=2).open(model, prompts, mask, params) is None
    session = engine().open(model, prompts, mask, params)
    session.generate([0, 1, 2])  # no EOS: every row fills its 12 tokens
    with pytest.raises(ValueError, match="leave no room in 12"):
        session.extend([1], [[5]])
    session.close()
