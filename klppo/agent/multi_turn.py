"""Multi-turn rollouts: conversations in which the model calls tools or answers a simulated user.

:class:`MultiTurnRollout` wraps any engine (:class:`klppo.rollout.base.RolloutEngine`) and keeps its contract,
with response rows that hold a whole conversation after the prompt. Per turn, every live conversation:

1. generates until its end-of-turn token (the engine's EOS) or the response budget: the first turn is one
   engine call on the prompts (``n`` samples each), later turns one call on the live conversations. On an
   engine that continues conversations (:class:`ContinuingEngine`: the ``klppo`` engine's
   :meth:`~klppo.rollout.engine.KLPPORollout.open`) each keeps its KV cache across turns and only the appended
   tokens are prefilled; elsewhere (``hf``, tensor parallel), or when the engine's slots cannot hold every
   conversation of the call at once, each later turn re-sends the conversation in full (prompt + every
   earlier turn) through ``generate``. Greedy tokens are the same either way; sampled ones are drawn with
   other noise;
2. if the turn holds tool calls (``format: hermes``, :mod:`klppo.tools.parsing`), runs the first
   ``max_parallel_calls`` of them — the calls of all conversations concurrently, at most
   ``max_concurrent_calls`` at a time, each bounded by ``tool_timeout_s`` — and appends one ``tool`` message
   per call, its text cut to ``max_tool_response_length`` characters; otherwise, with an interaction, appends
   its ``user`` message — when the interaction ends the conversation (``generate_response``'s
   ``should_terminate``), its message too, if not empty, as verl's agent loop does, and the conversation
   ends after it; otherwise ends;
3. ends at ``max_assistant_turns`` assistant turns or ``max_user_turns`` tool/user turns, when the model's
   turn is cut by the budget, or when appending the next message would leave no room for another model
   token (a last message only has to fit): such a message is left out whole, never cut.

A last message is rendered without the next assistant header (no model turn follows it); verl renders it
with one and cuts the response at the budget, which can cut into the message. Here the response ends on the
message's own end-of-turn, and the reward's scorer, which reads the whole response, never reads a message
cut short.

Appended messages are tokenized with the tokenizer's chat template: the text the template puts between the
model's end-of-turn token and the next assistant header. The model's tokens are kept exactly as sampled, never
re-tokenized from text. ``data.max_response_length`` counts every response token, the model's and the appended
ones (verl's rule). Output rows (shapes as in :mod:`klppo.rollout.base`):

- ``response_mask`` 1 on the tokens the model produced (the trained ones), 0 on appended tokens and padding;
- ``response_attention_mask`` 1 on every response token, model's or appended (what the model attends to);
- ``log_probs`` the engine's log-prob on model tokens, 0 elsewhere; ``truncated_log_probs`` (top-k / top-p)
  likewise, under the truncated law sampled from;
- ``extras`` per row: ``num_turns``, ``turn_scores`` (interaction), ``tool_rewards`` (each tool's
  ``calc_reward`` at the end).

A tool that raises, times out, returns no text or is unknown answers ``error: …`` to the model; a malformed
call gets its parse error back. A tool must not block the event loop (``async`` methods that await their
work, as the shipped ones do): a blocking call cannot be interrupted by the timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Collection
from typing import Any, Protocol, runtime_checkable

import torch

from klppo.rollout.base import RolloutEngine, RolloutOutput, SamplingParams
from klppo.rollout.sampling import returns_law_log_probs
from klppo.tools.base import BaseInteraction, BaseTool, ToolResponse
from klppo.tools.parsing import FORMATS, TRUNCATE_SIDES, ToolCall, parse_hermes, truncate

AGENTS = ("tool_agent", "single_turn_agent")


def row_agent(agent_name: str | None) -> str:
    """A row's ``agent_name`` (None: ``tool_agent``); ValueError for one klppo does not run."""
    agent = agent_name or "tool_agent"
    if agent not in AGENTS:
        raise ValueError(f"agent_name {agent!r} is not one klppo runs {AGENTS}")
    return agent


def interaction_name(kwargs: dict[str, Any], interactions: Collection[str]) -> str | None:
    """The interaction a row's ``interaction_kwargs`` names (no name: the only interaction there is); None
    without interactions; ValueError for a name that is not among them."""
    if not interactions:
        return None
    name = kwargs.get("name") or (next(iter(interactions)) if len(interactions) == 1 else None)
    if name not in interactions:
        raise ValueError(
            f"extra_info.interaction_kwargs.name={name!r} is not in the interaction config "
            f"(multi_turn.interaction_config_path): {', '.join(sorted(interactions))}"
        )
    return name


@runtime_checkable
class ContinuingEngine(Protocol):
    """An engine that continues conversations on their KV cache: ``open`` gives a session
    (``generate(rows)``, ``extend(rows, tokens)``, ``close()``: :class:`klppo.rollout.engine.Session`), or
    None for a call it cannot hold."""

    def open(self, model: Any, prompts: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams): ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiTurnSettings:
    """The conversation loop's limits (verl's ``rollout.multi_turn`` keys; module docstring)."""

    max_assistant_turns: int | None = None
    """Assistant turns per conversation (None: until the response budget)."""
    max_user_turns: int | None = None
    """Tool / user turns per conversation (None: until the response budget)."""
    max_parallel_calls: int = 1
    """Tool calls run per assistant turn (later ones in the turn are ignored)."""
    max_tool_response_length: int = 256
    """Characters of a tool's answer kept."""
    tool_response_truncate_side: str = "middle"
    """left keeps the beginning, right the end, middle both halves."""
    format: str = "hermes"
    """The model's tool-call format."""
    tool_timeout_s: float = 60.0
    """Wall-clock seconds one tool method may take."""
    max_concurrent_calls: int = 64
    """Tool calls of the whole batch in flight at once."""

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"multi_turn.format={self.format!r} is not supported; known: {FORMATS}")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            raise ValueError(f"multi_turn.tool_response_truncate_side must be one of {TRUNCATE_SIDES}")
        if self.max_parallel_calls < 1 or self.max_tool_response_length < 1:
            raise ValueError("multi_turn.max_parallel_calls and max_tool_response_length must be >= 1")


@dataclasses.dataclass
class Conversation:
    """One sample's state: its prompt, the response so far (tokens, model mask, log-probs) and the chat."""

    row: int  # the output row (prompt i's sample j: i·n + j)
    prompt: list[int]
    messages: list[dict[str, Any]]
    tools_kwargs: dict[str, Any]
    interaction: BaseInteraction | None = None
    interaction_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    interaction_id: str = ""
    max_assistant_turns: int | None = None
    tokens: list[int] = dataclasses.field(default_factory=list)
    appended: list[int] = dataclasses.field(default_factory=list)  # the tokens after the last model turn
    model_mask: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    truncated_log_probs: list[float] = dataclasses.field(default_factory=list)  # log_probs' when untruncated
    calls: list[ToolCall] = dataclasses.field(default_factory=list)
    instances: dict[str, str] = dataclasses.field(default_factory=dict)
    assistant_turns: int = 0
    user_turns: int = 0
    done: bool = False
    turn_scores: list[float] = dataclasses.field(default_factory=list)
    tool_rewards: list[float] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Counters:
    """Figures of one ``generate`` call (``multi_turn/*`` metrics)."""

    engine_calls: int = 0
    prefill_tokens: float = 0.0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_time_s: float = 0.0
    interaction_errors: int = 0


class MultiTurnRollout:
    """Conversations on ``engine`` (module docstring). ``tools`` by the name the model calls,
    ``interactions`` by name; ``tokenizer``: the model's (its chat template and decoding)."""

    def __init__(
        self,
        engine: RolloutEngine,
        *,
        tokenizer: Any,
        settings: MultiTurnSettings,
        eos_token_ids: tuple[int, ...],
        tools: dict[str, BaseTool] | None = None,
        interactions: dict[str, BaseInteraction] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("multi-turn rollouts need an end-of-turn token (the tokenizer's EOS)")
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.continues = isinstance(engine, ContinuingEngine)  # keeps the KV cache across turns
        self.eos = frozenset(int(t) for t in eos_token_ids)
        self.tools, self.interactions = dict(tools or {}), dict(interactions or {})
        self.template_kwargs = dict(chat_template_kwargs or {})
        self._after_eos, self._prefix = self._template_gap()

    def release(self) -> None:
        self.engine.release()

    @torch.no_grad()
    def generate(
        self,
        model: torch.nn.Module,
        prompts: torch.Tensor,
        prompt_mask: torch.Tensor,
        params: SamplingParams,
        *,
        extra_info: list[dict[str, Any]] | None = None,
        raw_prompt: list[list[dict[str, Any]]] | None = None,
    ) -> RolloutOutput:
        """``B × n`` conversations for the prompts; ``extra_info`` / ``raw_prompt``: one per prompt (the
        dataset's ``tools_kwargs``, ``interaction_kwargs``, ``agent_name``; the chat messages)."""
        start, counters = time.perf_counter(), Counters()
        num_prompts, budget = prompts.shape[0], params.max_new_tokens
        rows = [prompts[i][prompt_mask[i].bool()].tolist() for i in range(num_prompts)]
        convs = [
            self._conversation(
                i * params.n + j,
                rows[i],
                (extra_info or [{}] * num_prompts)[i] or {},
                (raw_prompt or [[]] * num_prompts)[i] or [],
            )
            for i in range(num_prompts)
            for j in range(params.n)
        ]
        session = self.engine.open(model, prompts, prompt_mask, params) if self.continues else None
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(_all(self._start(c) for c in convs))
            if session is not None:
                out = session.generate(list(range(len(convs))))
            else:
                out = self.engine.generate(model, prompts, prompt_mask, params)
            first_stats = dict(out.stats)
            self._record(convs, out, budget, counters)
            while live := [c for c in convs if not c.done]:
                loop.run_until_complete(self._respond(live, counters, budget))
                live = [c for c in live if not c.done]
                if not live:
                    break
                out = self._continue(model, session, live, params, counters.engine_calls, prompts.device)
                self._record(live, out, budget, counters)
        finally:
            try:
                loop.run_until_complete(_all(self._finish(c) for c in convs))
            finally:
                loop.close()
                if session is not None:
                    session.close()
        stats = {
            **first_stats,
            **self._stats(convs, counters, start),
            "multi_turn/kv_reuse": float(session is not None),
        }
        return self._output(convs, budget, prompts.device, stats, truncated=returns_law_log_probs(params))

    # ---- turns ----------------------------------------------------------------------------------
    def _conversation(
        self, row: int, prompt: list[int], info: dict[str, Any], messages: list[dict]
    ) -> Conversation:
        agent = row_agent(info.get("agent_name"))
        kwargs = dict(info.get("interaction_kwargs") or {})
        name = interaction_name(kwargs, self.interactions)
        interaction = None if name is None else self.interactions[name]
        return Conversation(
            row=row,
            prompt=prompt,
            messages=[dict(m) for m in messages],
            tools_kwargs=dict(info.get("tools_kwargs") or {}),
            interaction=interaction,
            interaction_kwargs=kwargs,
            max_assistant_turns=1 if agent == "single_turn_agent" else self.settings.max_assistant_turns,
        )

    def _continue(self, model, session, live: list[Conversation], params: SamplingParams, turn: int, device):
        """One engine call on the live conversations: their appended tokens prefilled after their cached
        prefix (``session``), or each conversation re-sent in full."""
        if session is not None:
            session.extend([c.row for c in live], [c.appended for c in live])
            return session.generate([c.row for c in live])
        seqs = [c.prompt + c.tokens for c in live]
        width = max(len(s) for s in seqs)
        ids = torch.zeros((len(seqs), width), dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
        seed = None if params.seed is None else params.seed + 7919 * turn
        room = max(params.max_new_tokens - len(c.tokens) for c in live)
        turn_params = dataclasses.replace(params, n=1, max_new_tokens=room, seed=seed)
        return self.engine.generate(model, ids.to(device), mask.to(device), turn_params)

    def _record(self, convs: list[Conversation], out: RolloutOutput, budget: int, counters: Counters) -> None:
        """Append each row's model tokens (cut to the conversation's budget) and decide what comes next."""
        counters.engine_calls += 1
        counters.prefill_tokens += out.stats.get("rollout/prefill_tokens", 0.0)
        lengths = out.response_mask.sum(dim=1).tolist()
        tokens, log_probs = out.responses.tolist(), out.log_probs.float().tolist()
        cut = out.log_probs if out.truncated_log_probs is None else out.truncated_log_probs
        s = self.settings
        for c, n_tok, toks, lps, cuts in zip(convs, lengths, tokens, log_probs, cut.float().tolist()):
            k = min(int(n_tok), budget - len(c.tokens))
            toks, lps = toks[:k], lps[:k]
            c.tokens += toks
            c.model_mask += [1] * k
            c.log_probs += lps
            c.truncated_log_probs += cuts[:k]
            c.assistant_turns += 1
            text = self.tokenizer.decode(toks, skip_special_tokens=False)
            c.messages.append(
                {"role": "assistant", "content": self.tokenizer.decode(toks, skip_special_tokens=True)}
            )
            ended = bool(toks) and toks[-1] in self.eos
            c.calls = parse_hermes(text) if self.tools else []
            c.done = (
                not ended
                or len(c.tokens) >= budget
                or (c.max_assistant_turns is not None and c.assistant_turns >= c.max_assistant_turns)
                or (s.max_user_turns is not None and c.user_turns >= s.max_user_turns)
                or (not c.calls and c.interaction is None)
            )

    async def _respond(self, live: list[Conversation], counters: Counters, budget: int) -> None:
        """Tool answers or the interaction's message for every live conversation, appended whole when they
        fit the budget: a message the model answers leaves it one token at least, a last message (the
        interaction ended the conversation) only has to fit. A message that does not fit ends the
        conversation unappended, and is not counted as a turn."""
        sem = asyncio.Semaphore(self.settings.max_concurrent_calls)
        replies = await asyncio.gather(*(self._reply(c, sem, counters) for c in live))
        for c, (messages, last) in zip(live, replies):
            c.done = last
            if not messages:
                continue
            toks = self.message_tokens(messages, generation_prompt=not last)
            if len(c.tokens) + len(toks) > budget - (0 if last else 1):
                c.done = True
                continue
            c.user_turns += 1
            c.tokens += toks
            c.appended = toks
            c.model_mask += [0] * len(toks)
            c.log_probs += [0.0] * len(toks)
            c.truncated_log_probs += [0.0] * len(toks)
            c.messages += messages

    async def _reply(
        self, c: Conversation, sem: asyncio.Semaphore, counters: Counters
    ) -> tuple[list[dict[str, Any]], bool]:
        """(the messages to append, whether they are the conversation's last): the tool answers, or the
        interaction's message — its last when it ends the conversation (verl's ``should_terminate``), none
        when that message is empty or the interaction failed."""
        if c.calls:
            calls = c.calls[: self.settings.max_parallel_calls]
            texts = await asyncio.gather(*(self._call_tool(c, call, sem, counters) for call in calls))
            return [{"role": "tool", "content": t} for t in texts], False
        try:
            done, text, score, _ = await asyncio.wait_for(
                c.interaction.generate_response(c.interaction_id, c.messages, **c.interaction_kwargs),
                timeout=self.settings.tool_timeout_s,
            )
        except Exception:  # noqa: BLE001  a user's interaction failing ends its conversation, not the run
            counters.interaction_errors += 1
            return [], True
        c.turn_scores.append(float(score))
        text = "" if text is None else str(text)
        return ([{"role": "user", "content": text}] if text or not done else []), bool(done)

    async def _call_tool(
        self, c: Conversation, call: ToolCall, sem: asyncio.Semaphore, counters: Counters
    ) -> str:
        """The text answered to ``call`` (``error: …`` for any failure; module docstring)."""
        counters.tool_calls += 1
        tool = self.tools.get(call.name)
        if call.error is not None or tool is None:
            counters.tool_errors += 1
            return f"error: {call.error or f'no tool named {call.name!r}; tools: {sorted(self.tools)}'}"
        timeout = self.settings.tool_timeout_s
        async with sem:
            t0 = time.perf_counter()
            try:
                if call.name not in c.instances:
                    create_kwargs = (c.tools_kwargs.get(call.name) or {}).get("create_kwargs") or {}
                    instance, _ = await asyncio.wait_for(tool.create(create_kwargs=create_kwargs), timeout)
                    c.instances[call.name] = instance
                response, _, _ = await asyncio.wait_for(
                    tool.execute(c.instances[call.name], call.arguments), timeout
                )
                text = response.text if isinstance(response, ToolResponse) else None
                if not isinstance(text, str) or response.image or response.video:
                    raise ValueError("the tool returned no text (only text reaches the model)")
            except asyncio.TimeoutError:
                text = f"error: the tool {call.name} did not answer within {timeout:g} s"
            except Exception as e:  # noqa: BLE001  the model reads the failure; the run goes on
                text = f"error: {type(e).__name__}: {e}"
            finally:
                counters.tool_time_s += time.perf_counter() - t0
        if text.startswith("error: "):
            counters.tool_errors += 1
        return truncate(
            text, self.settings.max_tool_response_length, self.settings.tool_response_truncate_side
        )

    async def _start(self, c: Conversation) -> None:
        if c.interaction is not None:
            c.interaction_id = await c.interaction.start_interaction(None, **c.interaction_kwargs)

    async def _finish(self, c: Conversation) -> None:
        """Each tool's reward, then release; the interaction's finalize (failures ignored: cleanup)."""
        for name, instance in c.instances.items():
            tool = self.tools[name]
            try:
                c.tool_rewards.append(
                    float(await asyncio.wait_for(tool.calc_reward(instance), self.settings.tool_timeout_s))
                )
            except Exception:  # noqa: BLE001, S110
                pass
            try:
                await asyncio.wait_for(tool.release(instance), self.settings.tool_timeout_s)
            except Exception:  # noqa: BLE001, S110
                pass
        if c.interaction is not None:
            try:
                await asyncio.wait_for(
                    c.interaction.finalize_interaction(c.interaction_id), self.settings.tool_timeout_s
                )
            except Exception:  # noqa: BLE001, S110
                pass

    # ---- tokens ---------------------------------------------------------------------------------
    def _template_gap(self) -> tuple[str, str]:
        """(text the template puts right after an assistant turn's end-of-turn token, the rendered reference
        conversation that :meth:`message_tokens` extends)."""
        base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        prefix = self.tokenizer.apply_chat_template(base, tokenize=False, **self.template_kwargs)
        after = prefix[prefix.rindex("A") + 1 :]
        for eos in sorted(self.eos):
            eos_text = self.tokenizer.decode([eos], skip_special_tokens=False)
            if eos_text and after.startswith(eos_text):
                return after[len(eos_text) :], prefix
        return "", prefix

    def message_tokens(self, messages: list[dict[str, Any]], *, generation_prompt: bool = True) -> list[int]:
        """Token ids that follow a model turn's end-of-turn token: ``messages`` as the chat template renders
        them after an assistant turn, then (``generation_prompt``) the next assistant header."""
        base = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
        full = self.tokenizer.apply_chat_template(
            base + messages, tokenize=False, add_generation_prompt=generation_prompt, **self.template_kwargs
        )
        if not full.startswith(self._prefix):
            raise ValueError("the chat template renders earlier turns differently once messages follow them")
        return self.tokenizer(self._after_eos + full[len(self._prefix) :], add_special_tokens=False)[
            "input_ids"
        ]

    # ---- output ---------------------------------------------------------------------------------
    def _output(
        self, convs: list[Conversation], width: int, device: torch.device, stats: dict, *, truncated: bool
    ) -> RolloutOutput:
        pad = getattr(self.tokenizer, "pad_token_id", None) or 0
        responses = torch.full((len(convs), width), int(pad), dtype=torch.long)
        model_mask = torch.zeros((len(convs), width), dtype=torch.long)
        attention = torch.zeros((len(convs), width), dtype=torch.long)
        log_probs = torch.zeros((len(convs), width), dtype=torch.float32)
        cut = torch.zeros((len(convs), width), dtype=torch.float32)  # the truncated law's
        for i, c in enumerate(convs):
            k = len(c.tokens)
            responses[i, :k] = torch.tensor(c.tokens, dtype=torch.long)
            model_mask[i, :k] = torch.tensor(c.model_mask, dtype=torch.long)
            attention[i, :k] = 1
            log_probs[i, :k] = torch.tensor(c.log_probs, dtype=torch.float32)
            cut[i, :k] = torch.tensor(c.truncated_log_probs, dtype=torch.float32)
        extras = [
            {
                "num_turns": c.assistant_turns + c.user_turns,
                "turn_scores": c.turn_scores,
                "tool_rewards": c.tool_rewards,
            }
            for c in convs
        ]
        return RolloutOutput(
            responses=responses.to(device),
            response_mask=model_mask.to(device),
            log_probs=(log_probs * model_mask).to(device),
            stats=stats,
            response_attention_mask=attention.to(device),
            extras=extras,
            truncated_log_probs=(cut * model_mask).to(device) if truncated else None,
        )

    @staticmethod
    def _stats(convs: list[Conversation], counters: Counters, start: float) -> dict[str, float]:
        n = max(len(convs), 1)
        model_tokens = sum(sum(c.model_mask) for c in convs)
        return {
            "rollout/time_s": time.perf_counter() - start,
            "rollout/tokens_generated": float(model_tokens),
            "multi_turn/assistant_turns": sum(c.assistant_turns for c in convs) / n,
            "multi_turn/user_turns": sum(c.user_turns for c in convs) / n,
            "multi_turn/appended_tokens": sum(len(c.tokens) - sum(c.model_mask) for c in convs) / n,
            "multi_turn/engine_calls": float(counters.engine_calls),
            "multi_turn/prefill_tokens": counters.prefill_tokens,
            "multi_turn/tool_calls": float(counters.tool_calls),
            "multi_turn/tool_errors": float(counters.tool_errors),
            "multi_turn/tool_time_s": counters.tool_time_s,
            "multi_turn/interaction_errors": float(counters.interaction_errors),
        }


async def _all(coroutines) -> list:
    """``asyncio.gather`` of ``coroutines`` inside the running loop."""
    return await asyncio.gather(*coroutines)
