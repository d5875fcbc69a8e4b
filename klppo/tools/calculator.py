"""A calculator tool: evaluates one arithmetic expression (``+ - * / // % **``, parentheses, numbers).

The expression is parsed with :mod:`ast` and only number literals and those operators are evaluated (no names,
calls or attributes), with exponents up to 64 and results up to 1e100 in magnitude, so a model cannot make it
run long or allocate much.
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from klppo.tools.base import BaseTool, FunctionSpec, ToolResponse, ToolSchema

SCHEMA = ToolSchema(
    FunctionSpec(
        name="calculator",
        description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The expression, e.g. (3+4)*12"}},
            "required": ["expression"],
        },
    )
)
MAX_EXPONENT = 64
MAX_MAGNITUDE = 1e100
_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def evaluate(expression: str) -> int | float:
    """The value of ``expression``; ValueError for anything but numbers, the operators and parentheses."""
    if len(expression) > 1000:
        raise ValueError("expression longer than 1000 characters")
    return _eval(ast.parse(expression.strip(), mode="eval").body)


def _eval(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent above {MAX_EXPONENT}")
        value = _BINARY[type(node.op)](left, right)
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value
    raise ValueError(f"unsupported element {type(node).__name__}")


def format_number(value: int | float) -> str:
    """Integers as integers, floats with at most 10 significant digits (``7.0`` → ``7``)."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.10g}"


class CalculatorTool(BaseTool):
    """``calculator(expression)`` → the value as text, or ``error: …``. No state, no reward."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: ToolSchema | None = None) -> None:
        super().__init__(config or {}, tool_schema or SCHEMA)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        expression = parameters.get("expression")
        if not isinstance(expression, str):
            return ToolResponse(text="error: expected a string argument 'expression'"), 0.0, {"error": 1}
        try:
            return ToolResponse(text=format_number(evaluate(expression))), 0.0, {}
        except (ValueError, SyntaxError, ZeroDivisionError, OverflowError, TypeError) as e:
            return ToolResponse(text=f"error: {type(e).__name__}: {e}"), 0.0, {"error": 1}
