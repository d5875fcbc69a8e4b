"""The base classes of tools and interactions: verl's async lifecycle, without pydantic or Ray.

A tool serves many conversations at once; each conversation that calls it gets an instance id:

- ``create(instance_id=None, **kwargs) -> (instance_id, ToolResponse)``: once per conversation, at its first
  call of the tool, with ``create_kwargs=`` the row's ``extra_info.tools_kwargs[<tool name>].create_kwargs``;
- ``execute(instance_id, parameters) -> (ToolResponse, step_reward, metrics)``: once per call;
- ``calc_reward(instance_id) -> float``: once when the conversation ends (recorded as its ``tool_rewards``);
- ``release(instance_id)``: last, always (also after an error).

An interaction plays the user: ``start_interaction(instance_id, **interaction_kwargs)`` when a conversation
starts, ``generate_response(instance_id, messages) -> (done, text, turn_score, extra)`` after every assistant
turn without a tool call, ``calculate_score(instance_id)`` and ``finalize_interaction(instance_id)`` at the
end."""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any


@dataclasses.dataclass(frozen=True)
class FunctionSpec:
    """An OpenAI-style function: its name, what it does and the JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"type": "object", "properties": {}, "required": []}
    )


@dataclasses.dataclass(frozen=True)
class ToolSchema:
    """A tool's schema as the chat template reads it (``tools=[schema.to_dict()]``); ``function.name`` is the
    name the model calls."""

    function: FunctionSpec
    type: str = "function"

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ToolSchema:
        if (
            not isinstance(d, dict)
            or not isinstance(d.get("function"), dict)
            or not d["function"].get("name")
        ):
            raise ValueError(f"a tool_schema needs function.name, got {d!r}")
        f = d["function"]
        params = f.get("parameters") or {"type": "object", "properties": {}, "required": []}
        spec = FunctionSpec(name=str(f["name"]), description=str(f.get("description", "")), parameters=params)
        return ToolSchema(function=spec, type=str(d.get("type", "function")))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ToolResponse:
    """What a tool answers. Only text reaches the model: a tool that returns images or video is an error."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


class BaseTool:
    """A tool (module docstring for the lifecycle). ``config``: the YAML entry's ``config`` mapping."""

    def __init__(self, config: dict[str, Any], tool_schema: ToolSchema | None) -> None:
        self.config = dict(config or {})
        schema = tool_schema or self.get_openai_tool_schema()
        if schema is None:
            raise ValueError(f"{type(self).__name__} has no tool_schema")
        self.tool_schema = schema
        self.name = schema.function.name

    def get_openai_tool_schema(self) -> ToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return instance_id or uuid.uuid4().hex, ToolResponse()

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        return ToolResponse(text="ok"), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        return None


class BaseInteraction:
    """A simulated user (module docstring for the lifecycle). ``config``: the YAML entry's ``config``."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.config = dict(config or {})
        self.name: str = self.config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        return instance_id or uuid.uuid4().hex

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        return True, "", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        return None


def last_assistant_text(messages: list[dict[str, Any]]) -> str:
    """The content of the last assistant message ("" if none)."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return str(m.get("content") or "")
    return ""
