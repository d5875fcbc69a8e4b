"""The conversation loop on a scripted engine whose turns are known: token layout, masks, log-prob positions,
bad tools, turn limits and the interaction's retry; and the loss counting only the model's tokens."""

from __future__ import annotations

import asyncio
import json

import torch

from klppo.agent.multi_turn import MultiTurnRollout, MultiTurnSettings
from klppo.algorithms.losses import policy_loss
from klppo.models.tiny import build_tiny_tokenizer
from klppo.rollout.base import RolloutOutput, SamplingParams
from klppo.tools.base import BaseTool, ToolResponse
from klppo.tools.calculator import CalculatorTool
from klppo.tools.gsm8k import Gsm8kInteraction
from tests.rollout.conftest import left_padded

TOK = build_tiny_tokenizer()
EOS = TOK.convert_tokens_to_ids("<|im_end|>")


def call(name: str, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


class ScriptedEngine:
    """Answers turn t of every row with ``script[t]`` (+ EOS unless ``no_eos``); log-prob -(t+1)/10 per
    token."""

    def __init__(self, script: list[str], no_eos: bool = False) -> None:
        self.script, self.no_eos, self.calls = script, no_eos, 0

    def generate(self, model, prompts, prompt_mask, params: SamplingParams) -> RolloutOutput:
        self.calls += 1
        rows = []
        for ids, m in zip(prompts.repeat_interleave(params.n, 0), prompt_mask.repeat_interleave(params.n, 0)):
            turn = TOK.decode(ids[m.bool()].tolist()).count("<|im_start|>assistant") - 1
            rows.append(
                (
                    TOK(self.script[min(turn, len(self.script) - 1)])["input_ids"]
                    + ([] if self.no_eos else [EOS]),
                    turn,
                )
            )
        width = params.max_new_tokens
        out = torch.full((len(rows), width), EOS, dtype=torch.long)
        mask, lps = torch.zeros_like(out), torch.zeros(out.shape)
        for i, (toks, turn) in enumerate(rows):
            k = min(len(toks), width)
            out[i, :k], mask[i, :k], lps[i, :k] = torch.tensor(toks[:k]), 1, -(turn + 1) / 10
        return RolloutOutput(out, mask, lps, {"rollout/time_s": 0.0})

    def release(self) -> None:
        pass


def rollout(engine, tools=None, interactions=None, **limits) -> MultiTurnRollout:
    return MultiTurnRollout(
        engine,
        tokenizer=TOK,
        settings=MultiTurnSettings(**limits),
        eos_token_ids=(EOS,),
        tools=tools,
        interactions=interactions,
    )


def prompt(text: str = "What is 12 plus 7?"):
    messages = [{"role": "user", "content": text}]
    ids = TOK(TOK.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))["input_ids"]
    return (*left_padded([ids], pad_id=EOS), [messages])


def test_three_turns_layout_masks_and_log_probs():
    script = [call("calculator", expression="12+7"), call("calculator", expression="19*2"), "#### 19"]
    ids, mask, messages = prompt()
    out = rollout(ScriptedEngine(script), tools={"calculator": CalculatorTool()}).generate(
        None, ids, mask, SamplingParams(max_new_tokens=200, n=2), raw_prompt=messages
    )
    convo = messages[0] + [
        {"role": "assistant", "content": script[0]},
        {"role": "tool", "content": "19"},
        {"role": "assistant", "content": script[1]},
        {"role": "tool", "content": "38"},
        {"role": "assistant", "content": script[2]},
    ]
    expected = TOK.apply_chat_template(convo, tokenize=False)
    for row in range(2):
        k = int(out.response_attention_mask[row].sum())
        assert TOK.decode(ids[0].tolist() + out.responses[row, :k].tolist()) == expected.removesuffix("\n")
        turns = [TOK(s)["input_ids"] + [EOS] for s in script]
        model_pos = out.response_mask[row].nonzero().squeeze(1).tolist()
        assert out.responses[row, model_pos].tolist() == sum(turns, [])  # trained tokens = sampled tokens
        expected_lp = sum(([-(t + 1) / 10] * len(toks) for t, toks in enumerate(turns)), [])
        assert torch.allclose(out.log_probs[row, model_pos], torch.tensor(expected_lp))
        assert out.log_probs[row][out.response_mask[row] == 0].abs().sum() == 0
        assert out.extras[row]["num_turns"] == 5
    assert out.stats["multi_turn/tool_calls"] == 4 and out.stats["multi_turn/engine_calls"] == 3


class Raises(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        raise RuntimeError("boom")


class Hangs(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(60)


class Huge(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(text="x" * 10_000), 0.0, {}


class Image(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        return ToolResponse(image=[object()]), 0.0, {}


def tool_answers(first_turn: str, tools: dict, **limits) -> list[str]:
    ids, mask, messages = prompt()
    out = rollout(ScriptedEngine([first_turn, "done"]), tools=tools, **limits).generate(
        None, ids, mask, SamplingParams(max_new_tokens=2000), raw_prompt=messages
    )
    k = int(out.response_attention_mask[0].sum())
    text = TOK.decode(out.responses[0, :k].tolist())
    return [part.split("<|im_end|>")[0] for part in text.split("<|im_start|>tool\n")[1:]]


def test_bad_tools_answer_errors_and_the_run_goes_on():
    from klppo.tools.base import FunctionSpec, ToolSchema

    tools = {
        n: c({}, ToolSchema(FunctionSpec(n)))
        for n, c in [("raises", Raises), ("hangs", Hangs), ("huge", Huge), ("image", Image)]
    }
    turn = (
        call("raises")
        + call("hangs")
        + call("huge")
        + call("image")
        + call("nope")
        + "<tool_call>{bad</tool_call>"
    )
    answers = tool_answers(turn, tools, max_parallel_calls=6, tool_timeout_s=0.3, max_tool_response_length=50)
    assert answers[0] == "error: RuntimeError: boom"
    assert answers[1] == "error: the tool hangs did not answer within 0.3 s"
    assert answers[2] == "x" * 25 + "...(truncated)..." + "x" * 25
    assert answers[3].startswith("error: ValueError: the to") and answers[4].startswith(
        "error: no tool named 'nope'"
    )
    assert answers[5].startswith("error: the tool call is not valid JSON")
    assert len(tool_answers(turn, tools, max_parallel_calls=2, tool_timeout_s=0.3)) == 2


def test_turn_limits_and_a_model_that_never_ends_its_turn():
    ids, mask, messages = prompt()
    tools = {"calculator": CalculatorTool()}
    engine = ScriptedEngine([call("calculator", expression="1+1")])
    out = rollout(engine, tools=tools, max_assistant_turns=3).generate(
        None, ids, mask, SamplingParams(max_new_tokens=400)
    )
    assert out.stats["multi_turn/assistant_turns"] == 3 and engine.calls == 3
    out = rollout(engine, tools=tools, max_user_turns=1).generate(
        None, ids, mask, SamplingParams(max_new_tokens=400)
    )
    assert out.stats["multi_turn/user_turns"] == 1
    endless = ScriptedEngine([call("calculator", expression="1+1") + " and on"], no_eos=True)
    out = rollout(endless, tools=tools).generate(None, ids, mask, SamplingParams(max_new_tokens=400))
    assert endless.calls == 1 and out.stats["multi_turn/tool_calls"] == 0
    turn = len(TOK(call("calculator", expression="1+1"))["input_ids"]) + 1
    out = rollout(engine, tools=tools).generate(None, ids, mask, SamplingParams(max_new_tokens=turn + 5))
    # the tool's message would leave no room for the model: not appended (data.max_response_length counts it),
    # nor counted as a turn
    assert int(out.response_attention_mask.sum()) == turn and out.stats["multi_turn/user_turns"] == 0


def test_interaction_feedback_and_retry():
    ids, mask, messages = prompt()
    out = rollout(
        ScriptedEngine(["#### 5", "#### 19", "#### 19"]), interactions={"gsm8k": Gsm8kInteraction({})}
    ).generate(
        None,
        ids,
        mask,
        SamplingParams(max_new_tokens=200),
        extra_info=[{"interaction_kwargs": {"name": "gsm8k", "ground_truth": "19"}}],
        raw_prompt=messages,
    )
    k = int(out.response_attention_mask[0].sum())
    text = TOK.decode(out.responses[0, :k].tolist())
    assert text.count("try again") == 1 and text.count("#### 19<|im_end|>") == 1
    # the interaction's last message is appended (verl's agent loop does), with no assistant header after it
    assert text.endswith("#### 19<|im_end|>\n<|im_start|>user\nYour response is correct!<|im_end|>\n")
    assert out.extras[0]["turn_scores"] == [0.0, 1.0] and out.extras[0]["num_turns"] == 4


def retry(budget: int, right: str = "Your response is correct!", first: str = "#### 5"):
    """One conversation with the GSM8K interaction (ground truth 19) whose last message is ``right``."""

    class Says(Gsm8kInteraction):
        async def generate_response(self, instance_id, messages, **kwargs):
            done, text, score, extra = await super().generate_response(instance_id, messages, **kwargs)
            return done, (right if done else text), score, extra

    ids, mask, messages = prompt()
    return rollout(ScriptedEngine([first, "#### 19"]), interactions={"gsm8k": Says({})}).generate(
        None,
        ids,
        mask,
        SamplingParams(max_new_tokens=budget),
        extra_info=[{"interaction_kwargs": {"name": "gsm8k", "ground_truth": "19"}}],
        raw_prompt=messages,
    )


def test_the_interactions_last_message_is_appended_where_it_fits():
    full = retry(400)
    length = int(full.response_attention_mask.sum())
    model = full.response_mask[0].nonzero().squeeze(1).tolist()
    last = TOK.decode(full.responses[0, model[-1] + 1 : length].tolist())
    assert last == "\n<|im_start|>user\nYour response is correct!<|im_end|>\n"  # after the model's EOS
    after = slice(model[-1] + 1, None)
    assert full.log_probs[0, after].abs().sum() == 0 and full.response_mask[0, after].sum() == 0
    assert full.stats["multi_turn/user_turns"] == 2
    # exactly the budget: appended (nothing has to follow a last message)
    exact = retry(length)
    assert torch.equal(exact.responses[0], full.responses[0, :length])
    assert exact.stats["multi_turn/user_turns"] == 2
    # one token short: left out whole (never cut), not counted as a turn; the answers stay as they were
    short = retry(length - 1)
    assert int(short.response_attention_mask.sum()) == model[-1] + 1
    assert torch.equal(short.responses[0, : model[-1] + 1], full.responses[0, : model[-1] + 1])
    assert short.stats["multi_turn/user_turns"] == 1 and short.extras[0]["turn_scores"] == [0.0, 1.0]
    # an empty last message: nothing appended
    empty = retry(400, right="")
    assert int(empty.response_attention_mask.sum()) == model[-1] + 1
    assert empty.extras[0]["num_turns"] == 3


def test_a_message_the_model_answers_leaves_it_a_token():
    """The "try again" message is appended only with room for one model token after it."""
    first = len(TOK("#### 5")["input_ids"]) + 1
    full = retry(400)
    model = full.response_mask[0].nonzero().squeeze(1).tolist()
    second_start = next(i for i in model if i >= first)
    fits = retry(second_start + 1)  # the message, then one model token
    assert fits.stats["multi_turn/user_turns"] == 1 and int(fits.response_mask.sum()) == first + 1
    no_room = retry(second_start)  # the message would fill the budget: not appended
    assert no_room.stats["multi_turn/user_turns"] == 0 and int(no_room.response_attention_mask.sum()) == first


def test_appended_tokens_do_not_change_the_loss():
    """A tool token's log-prob (new or old) is masked out of the policy loss."""
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0]])
    old = torch.tensor([[-1.0, -2.0, -3.0, -4.0, -1.5]])
    new = old + torch.tensor([[0.1, -0.1, 0.0, 0.0, 0.05]])
    adv = torch.ones_like(old)
    base, _ = policy_loss(old, new, adv, mask)
    changed = new.clone()
    changed[0, 2:4] = torch.tensor([5.0, -30.0])
    assert torch.equal(policy_loss(old, changed, adv, mask)[0], base)
