"""The GSM8K agent's calculator tool: a safe arithmetic evaluator over Python's `ast` (never eval).

Accepted: int and float literals, `+ - * / // % **`, unary `+ -`, parentheses; thousands commas
inside numbers ("1,200") and `$` signs are removed first. Everything else (names, calls,
attributes, strings, `^`, comparisons) is refused. Bounds keep a hostile expression cheap: at most
`MAX_EXPRESSION_CHARS` characters, exponents of magnitude <= `MAX_EXPONENT`, and intermediate
values of magnitude <= `MAX_MAGNITUDE`.

Invariant: `evaluate` either returns a finite float or raises `CalculatorError` with a message fit
to send back to the model; `run_tool` never raises (errors become "error: ..." text).
"""

from __future__ import annotations

import ast
import json
import math
import operator
import re
from typing import Any, Callable

MAX_EXPRESSION_CHARS = 200  # longer inputs are refused before parsing
MAX_EXPONENT = 64  # |b| in a ** b; 10**64 already exceeds any GSM8K quantity
MAX_MAGNITUDE = 1e30  # |value| bound on every intermediate result

TOOL_NAME = "calculator"
TOOL_SPEC: dict[str, Any] = {  # the OpenAI `tools` entry
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "e.g. (48 / 2) + 48"}},
            "required": ["expression"],
        },
    },
}

_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or its value is undefined or out of bounds."""


def _check(value: Any) -> float | int:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculatorError("result out of range")
    return value


def _eval(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check(_UNARY[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent {right} is larger than {MAX_EXPONENT}")
        try:
            return _check(_BINOPS[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result out of range") from None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise CalculatorError("'^' is not a power here; write ** instead")
    raise CalculatorError(f"unsupported syntax: {type(node).__name__}")


def evaluate(expression: str) -> float:
    """The value of an arithmetic `expression`, e.g. "(48 / 2) + 48" -> 72.0.

    Raises CalculatorError for non-arithmetic input, division by zero, or out-of-bound values.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise CalculatorError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    text = _THOUSANDS.sub("", expression.replace("$", "")).strip()
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from None
    return float(_eval(tree.body))


def format_number(value: float) -> str:
    """"72" for integral values, else up to 10 significant digits ("0.3333333333")."""
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.10g}"


def run_tool(arguments: str) -> str:
    """Run the calculator on a tool call's JSON `arguments` ('{"expression": "2 + 3"}') and return
    the text for the role=tool message: the value ("5") or "error: <why>". Never raises."""
    try:
        args = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        return "error: arguments must be a JSON object like {\"expression\": \"2 + 3\"}"
    if not isinstance(args, dict) or not isinstance(args.get("expression"), str):
        return "error: arguments must be a JSON object like {\"expression\": \"2 + 3\"}"
    try:
        return format_number(evaluate(args["expression"]))
    except CalculatorError as exc:
        return f"error: {exc}"
