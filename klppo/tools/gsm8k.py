"""GSM8K answer checking as a tool and as an interaction, scored by :mod:`klppo.rewards.gsm8k`.

- :class:`Gsm8kTool` (``calc_gsm8k_reward(answer)``): the model submits an answer; the tool says whether it
  is right (flexible extraction). Its step reward is 0 for an improved answer and -0.05 otherwise;
  ``calc_reward`` is the score of the last submission. Ground truth: ``create_kwargs.ground_truth``.
- :class:`Gsm8kInteraction`: after each assistant turn the user checks the answer and either ends the
  conversation ("correct") or asks to try again. Ground truth: ``interaction_kwargs.ground_truth``. The
  answer rule is the config's ``method``: ``strict`` (``#### <n>``, verl's interaction, the default) or
  ``flexible`` (the last number), the rules of :mod:`klppo.rewards.gsm8k` — set it to the reward's
  ``reward_kwargs.method`` so that the user's verdict and the reward agree (any task with a numeric ground
  truth, e.g. ``klppo data arithmetic --interaction``).
"""

from __future__ import annotations

import uuid
from typing import Any

from klppo.rewards import gsm8k
from klppo.tools.base import (
    BaseInteraction,
    BaseTool,
    FunctionSpec,
    ToolResponse,
    ToolSchema,
    last_assistant_text,
)

SCHEMA = ToolSchema(
    FunctionSpec(
        name="calc_gsm8k_reward",
        description="Check an answer to the GSM8K problem (1.0 if it is correct, else 0.0).",
        parameters={
            "type": "object",
            "properties": {"answer": {"type": "string", "description": "The answer, digits only"}},
            "required": ["answer"],
        },
    )
)
WRONG = "Your response is incorrect! You need to reflect on your answer and try again."
RIGHT = "Your response is correct!"
METHODS = ("strict", "flexible")


def _score(response: str, ground_truth: Any, method: str) -> float:
    if ground_truth is None:
        return 0.0
    return float(gsm8k.compute_score(response, str(ground_truth), method=method, format_score=0.0, score=1.0))


class Gsm8kTool(BaseTool):
    """See the module docstring."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | None = None) -> None:
        super().__init__(config or {}, tool_schema or SCHEMA)
        self._state: dict[str, dict[str, Any]] = {}

    async def create(
        self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any
    ) -> tuple[str, ToolResponse]:
        instance_id = instance_id or uuid.uuid4().hex
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._state[instance_id] = {"response": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        answer = str(parameters.get("answer", ""))
        state = self._state[instance_id]
        state["response"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step_reward = 0.0 if reward > state["reward"] else -0.05
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward}"), step_reward, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._state[instance_id]
        return _score(state["response"], state["ground_truth"], "flexible")

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._state.pop(instance_id, None)


class Gsm8kInteraction(BaseInteraction):
    """See the module docstring."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config or {})
        self.method = str(self.config.get("method", "strict"))
        if self.method not in METHODS:
            raise ValueError(f"config.method={self.method!r}; known: {', '.join(METHODS)}")
        self._state: dict[str, dict[str, Any]] = {}

    async def start_interaction(
        self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any
    ) -> str:
        instance_id = instance_id or uuid.uuid4().hex
        self._state[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        self._state[instance_id]["response"] = last_assistant_text(messages)
        score = await self.calculate_score(instance_id)
        return (True, RIGHT, score, {}) if score == 1.0 else (False, WRONG, score, {})

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._state[instance_id]
        return _score(state["response"], state["ground_truth"], self.method)

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._state.pop(instance_id, None)
