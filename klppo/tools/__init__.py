"""Tools and interactions of multi-turn rollouts (:mod:`klppo.agent.multi_turn`), with verl's lifecycle.

:mod:`~klppo.tools.base` holds the base classes a user subclasses, :mod:`~klppo.tools.config`
loads verl's tool and interaction YAML files, :mod:`~klppo.tools.parsing` reads the model's tool
calls. Shipped: a calculator, a GSM8K answer checker (tool and interaction) and a local Python executor.
"""

from klppo.tools.base import BaseInteraction, BaseTool, FunctionSpec, ToolResponse, ToolSchema

__all__ = ["BaseInteraction", "BaseTool", "FunctionSpec", "ToolResponse", "ToolSchema"]
