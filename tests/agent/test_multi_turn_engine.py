"""Conversations on the klppo engine: keeping each conversation's KV cache across turns gives what re-sending
it in full gives (CPU, fp32, a tiny Llama): greedy tokens, masks and layout identical, log-probs within 1e-5.

The tiny random model ends its turns on its own: its LM-head row of the end-of-turn token is scaled up, so
greedy turns end after a few to a few dozen tokens. A scripted interaction appends messages of different
lengths per conversation and turn (to the engine a tool's answer and a user's message are the same thing:
appended tokens).
"""

from __future__ import annotations

import pytest
import torch

from klppo.agent.multi_turn import MultiTurnRollout, MultiTurnSettings
from klppo.models.tiny import build_tiny_model, build_tiny_tokenizer
from klppo.rollout import EngineSettings, SamplingParams, make_rollout
from klppo.tools.base import BaseInteraction
from tests.rollout.conftest import left_padded, reference_log_probs

TOK = build_tiny_tokenizer()
EOS = TOK.convert_tokens_to_ids("<|im_end|>")
TEXTS = ["What is 12 plus 7?", "Natalia sold clips", "How many apples", "Weng earns $12", "The answer is 42."]
TEXTS += ["She has 3 apples."]
REPLIES = [  # per conversation, the message after each of its turns; past the last, the interaction ends it
    ["0 1 2", "3"],
    ["How many apples does she have left?", "5 6 7 8 9 10"],
    ["x"],
    ["#### 3", "1000 + 5", "ok"],
    ["?", "!"],
    [],  # ends after its first turn
]


class Scripted(BaseInteraction):
    async def generate_response(self, instance_id, messages, replies=(), **kwargs):
        turn = sum(m["role"] == "assistant" for m in messages) - 1
        return (True, "", 0.0, {}) if turn >= len(replies) else (False, replies[turn], 0.0, {})


class Resend:
    """The engine without ``open``: the loop re-sends every conversation in full each turn."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, *args):
        return self.engine.generate(*args)

    def release(self) -> None:
        self.engine.release()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    m = build_tiny_model(arch="llama", vocab_size=len(TOK), tie_word_embeddings=False).eval()
    m.lm_head.weight.data[EOS] *= 2.0
    return m


def conversations(model, engine, params: SamplingParams, num: int = len(TEXTS)):
    messages = [[{"role": "user", "content": t}] for t in TEXTS[:num]]
    rows = [
        TOK(TOK.apply_chat_template(m, add_generation_prompt=True, tokenize=False))["input_ids"]
        for m in messages
    ]
    prompts, mask = left_padded(rows, pad_id=EOS)
    loop = MultiTurnRollout(
        engine,
        tokenizer=TOK,
        settings=MultiTurnSettings(),
        eos_token_ids=(EOS,),
        interactions={"script": Scripted({})},
    )
    info = [{"interaction_kwargs": {"name": "script", "replies": r}} for r in REPLIES[:num]]
    return loop.generate(model, prompts, mask, params, extra_info=info, raw_prompt=messages), prompts, mask


def klppo(**kwargs):
    return make_rollout(
        "klppo", EngineSettings(eos_token_ids=(EOS,), pad_token_id=EOS, eos_check_every=3, **kwargs)
    )


def test_kv_reuse_equals_re_prefill_across_turns(model) -> None:
    params = SamplingParams(max_new_tokens=48, do_sample=False)
    fast, prompts, mask = conversations(model, klppo(), params)
    slow, _, _ = conversations(model, Resend(klppo()), params)
    assert fast.stats["multi_turn/kv_reuse"] == 1.0 and slow.stats["multi_turn/kv_reuse"] == 0.0
    assert torch.equal(fast.responses, slow.responses)
    assert torch.equal(fast.response_mask, slow.response_mask)
    assert torch.equal(fast.response_attention_mask, slow.response_attention_mask)
    torch.testing.assert_close(fast.log_probs, slow.log_probs, atol=1e-5, rtol=0)
    assert [e["num_turns"] for e in fast.extras] == [e["num_turns"] for e in slow.extras]
    # the case list holds: three model turns, one conversation ended by the interaction after one turn, one
    # cut by the budget in the middle of a turn (no end-of-turn token)
    turns = [int((m[1:] > m[:-1]).sum()) + int(m[0]) for m in fast.response_mask]
    assert max(turns) == 3 and turns[5] == 1
    length = fast.response_attention_mask.sum(dim=1)
    cut = [i for i in range(len(TEXTS)) if length[i] == 48]
    assert cut and all(fast.responses[i, 47] != EOS and fast.response_mask[i, 47] == 1 for i in cut)
    # after the prompts, only the appended tokens are prefilled; re-sending prefills whole conversations
    appended = int((fast.response_attention_mask - fast.response_mask).sum())
    assert fast.stats["multi_turn/prefill_tokens"] == int(mask.sum()) + appended
    assert slow.stats["multi_turn/prefill_tokens"] > fast.stats["multi_turn/prefill_tokens"] + appended


def test_kv_reuse_log_probs_equal_a_full_forward(model) -> None:
    """Every model token's log-prob against one float64 forward of prompt + whole response."""
    out, prompts, mask = conversations(model, klppo(), SamplingParams(max_new_tokens=48, do_sample=False))
    ref = reference_log_probs(model, prompts, mask, out.responses, out.response_attention_mask, 1.0, 1)
    model_tokens = out.response_mask.bool()
    torch.testing.assert_close(out.log_probs[model_tokens].double(), ref[model_tokens], atol=1e-5, rtol=0)


def test_too_few_slots_re_send_and_other_engines_never_open(model) -> None:
    params = SamplingParams(max_new_tokens=40, do_sample=False)
    few, _, _ = conversations(model, klppo(max_num_seqs=2), params, num=4)
    whole, _, _ = conversations(model, klppo(), params, num=4)
    assert few.stats["multi_turn/kv_reuse"] == 0.0 and whole.stats["multi_turn/kv_reuse"] == 1.0
    assert torch.equal(few.responses, whole.responses)
    hf = make_rollout("hf", EngineSettings(eos_token_ids=(EOS,), pad_token_id=EOS))
    assert not MultiTurnRollout(
        hf, tokenizer=TOK, settings=MultiTurnSettings(), eos_token_ids=(EOS,)
    ).continues


def test_sampled_conversations_are_seeded_and_keep_the_layout(model) -> None:
    """Under sampling the two paths draw other noise (not compared); the fast path repeats itself for a
    seed, and its masks and log-probs keep the contract."""
    params = SamplingParams(max_new_tokens=40, n=2, seed=3)
    a, prompts, mask = conversations(model, klppo(), params, num=3)
    b, _, _ = conversations(model, klppo(), params, num=3)
    assert torch.equal(a.responses, b.responses) and a.stats["multi_turn/kv_reuse"] == 1.0
    assert (a.response_mask <= a.response_attention_mask).all()
    assert (a.log_probs[a.response_mask == 0] == 0).all()
    ref = reference_log_probs(model, prompts, mask, a.responses, a.response_attention_mask, 1.0, 2)
    model_tokens = a.response_mask.bool()
    torch.testing.assert_close(a.log_probs[model_tokens].double(), ref[model_tokens], atol=1e-5, rtol=0)


def test_truncated_conversations_carry_the_truncated_law(model) -> None:
    """With top-k, every model token's log-prob under the truncated law it was drawn from, across turns kept
    in the KV cache, against one float64 forward; 0 on appended tokens."""
    params = SamplingParams(max_new_tokens=40, n=2, seed=3, temperature=0.9, top_k=20)
    out, prompts, mask = conversations(model, klppo(), params, num=3)
    assert out.stats["multi_turn/kv_reuse"] == 1.0
    args = (model, prompts, mask, out.responses, out.response_attention_mask, 0.9, 2)
    ref = reference_log_probs(*args, top_k=20)
    model_tokens = out.response_mask.bool()
    assert (out.response_attention_mask > out.response_mask).any()  # some tokens were appended
    torch.testing.assert_close(
        out.truncated_log_probs[model_tokens].double(), ref[model_tokens], atol=1e-5, rtol=0
    )
    assert (out.truncated_log_probs[~model_tokens] == 0).all()
    assert (out.truncated_log_probs[model_tokens] > out.log_probs[model_tokens]).all()
