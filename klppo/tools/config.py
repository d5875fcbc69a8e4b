"""verl's tool and interaction config files, loaded into instances of klppo's classes.

Tool config (``multi_turn.tool_config_path``)::

    tools:
      - class_name: klppo.tools.calculator.CalculatorTool   # or a verl name in VERL_CLASSES
        config: {type: native}                                       # handed to the class
        tool_schema: {type: function, function: {name: ..., description: ..., parameters: {...}}}

Interaction config (``multi_turn.interaction_config_path``)::

    interaction:
      - name: gsm8k                                   # matched by extra_info.interaction_kwargs.name
        class_name: klppo.tools.gsm8k.Gsm8kInteraction
        config: {}

A class path is imported as written, except verl's own classes: those klppo ships an equivalent of are mapped
to it (``VERL_CLASSES``), the others are refused by name (``VERL_REFUSED``). Every error is a ``ValueError``
naming the file and the entry, raised before any weights load.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import yaml

from klppo.tools.base import BaseInteraction, BaseTool, ToolSchema

VERL_CLASSES = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "klppo.tools.gsm8k.Gsm8kTool",
    "verl.tools.base_tool.BaseTool": "klppo.tools.base.BaseTool",
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": "klppo.tools.gsm8k.Gsm8kInteraction",
    "verl.interactions.base.BaseInteraction": "klppo.tools.base.BaseInteraction",
}
VERL_REFUSED = {
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": (
        "a remote SandboxFusion service (klppo.tools.python_exec.PythonTool runs Python locally)"
    ),
    "verl.tools.search_tool.SearchTool": "a retrieval service",
    "verl.tools.mcp_search_tool.MCPSearchTool": "an MCP server",
    "verl.tools.mcp_base_tool.MCPBaseTool": "an MCP server",
    "verl.tools.geo3k_tool.Geo3kTool": "vision-language data (geo3k)",
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": "images in tool answers",
    "verl.interactions.collabllm_interation.CollabLLMInteraction": "a user played by a hosted LLM",
    "verl.interactions.weather_interaction.WeatherInteraction": (
        "verl's weather demo, which scores every answer 1.0 (write a klppo.tools.base.BaseInteraction)"
    ),
}


def resolve_class(class_name: str, base: type) -> type:
    """The class at ``class_name`` (verl names mapped or refused); it must subclass ``base``'s lifecycle.
    Every refusal of a verl class says "not supported" and names what the class needs."""
    if class_name in VERL_REFUSED:
        raise ValueError(f"{class_name} is not supported: it needs {VERL_REFUSED[class_name]}")
    if class_name.startswith("verl.") and class_name not in VERL_CLASSES:
        raise ValueError(
            f"{class_name} is not supported: klppo has no equivalent of it (it maps "
            f"{', '.join(sorted(VERL_CLASSES))})"
        )
    path = VERL_CLASSES.get(class_name, class_name)
    module_name, _, attr = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"cannot import {class_name}: {e}") from e
    missing = [
        m for m in vars(base) if not m.startswith("_") and callable(getattr(base, m)) and not hasattr(cls, m)
    ]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"{class_name} is not a {base.__name__} (missing {missing or 'a class'})")
    return cls


def _resolve(class_name: str, base: type, where: str) -> type:
    """:func:`resolve_class`, its error prefixed with ``where`` (its message names the class)."""
    try:
        return resolve_class(class_name, base)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from e


def _entries(path: str, key: str) -> list[dict[str, Any]]:
    """The entries under ``key`` (``tools`` / ``interaction``) of the YAML file at ``path``; a relative
    path is read from the working directory, as verl reads it."""
    p, label = Path(path).expanduser(), key.removesuffix("s")
    if not p.is_file():
        where = "" if p.is_absolute() else f" (relative to {Path.cwd()})"
        raise ValueError(f"{label} config {path} not found{where}")
    try:
        doc = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ValueError(f"{label} config {path}: not YAML ({e})") from e
    entries = doc.get(key) if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) and e.get("class_name") for e in entries):
        raise ValueError(
            f"{label} config {path}: expected `{key}:` with a list of entries that have class_name"
        )
    return entries


def load_tools(path: str) -> dict[str, BaseTool]:
    """The tools of a tool config file, by the function name the model calls."""
    tools: dict[str, BaseTool] = {}
    for entry in _entries(path, "tools"):
        where = f"tool config {path}, {entry['class_name']}"
        cls = _resolve(entry["class_name"], BaseTool, f"tool config {path}")
        config = dict(entry.get("config") or {})
        if config.get("type", "native") != "native":
            raise ValueError(f"{where}: config.type={config['type']!r} is not supported (native only)")
        try:
            schema = ToolSchema.from_dict(entry["tool_schema"]) if entry.get("tool_schema") else None
            tool = cls(config, schema)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{where}: {e}") from e
        if tool.name in tools:
            raise ValueError(f"{where}: two tools named {tool.name!r}")
        tools[tool.name] = tool
    return tools


def load_interactions(path: str) -> dict[str, BaseInteraction]:
    """The interactions of an interaction config file, by name (``name``, else the class name without a
    trailing ``Interaction``, lower-cased, as verl derives it)."""
    out: dict[str, BaseInteraction] = {}
    for entry in _entries(path, "interaction"):
        cls_name = entry["class_name"]
        name = entry.get("name") or cls_name.rpartition(".")[2].removesuffix("Interaction").lower()
        cls = _resolve(cls_name, BaseInteraction, f"interaction config {path}")
        try:
            interaction = cls({"name": name, **(entry.get("config") or {})})
        except (ValueError, TypeError) as e:
            raise ValueError(f"interaction config {path}, {cls_name}: {e}") from e
        if name in out:
            raise ValueError(f"interaction config {path}: two interactions named {name!r}")
        out[name] = interaction
    return out
