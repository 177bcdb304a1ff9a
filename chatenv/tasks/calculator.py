"""Arithmetic with a calculator tool: :class:`CalculatorArithmeticTask` and the safe :func:`calculator`."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

import numpy as np

from chatenv.tasks.tool_task import ANSWER_FORMAT, ToolTask

__all__ = ["CalculatorArithmeticTask", "calculator"]

_BINARY: dict[type, Callable[[Any, Any], Any]] = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_BINARY |= {ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION = 500
_MAX_EXPONENT = 1000
_MAX_DIGITS = 100  # results of more than 100 digits (or floats over 1e100) are refused


def _checked(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("the result is not a finite number")
    if abs(value) >= 10**_MAX_DIGITS:
        raise ValueError(f"the result has more than {_MAX_DIGITS} digits; the calculator refuses numbers that large")
    return value


def _power(base: Any, exp: Any) -> Any:
    if abs(exp) > _MAX_EXPONENT:
        raise ValueError(f"exponent {exp} is too large (at most {_MAX_EXPONENT} in absolute value)")
    if base != 0 and abs(base) != 1 and exp > 0 and exp * math.log10(abs(base)) > _MAX_DIGITS:
        raise ValueError(f"{base} ** {exp} has more than {_MAX_DIGITS} digits; the calculator refuses such numbers")
    if base == 0 and exp < 0:
        raise ValueError("zero cannot be raised to a negative power")
    result = base**exp
    if isinstance(result, complex):
        raise ValueError("a negative number to a fractional power is not a real number")
    return result


def _evaluate(node: ast.AST) -> Any:
    """The value of an arithmetic expression tree: numbers, + - * / // % **, unary + and -; nothing else."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _checked(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _checked(_power(left, right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError("division by zero")
        return _checked(_BINARY[type(node.op)](left, right))
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        raise ValueError("'^' is not a power here; write powers with '**' (e.g. 2 ** 10)")
    what = type(node.op).__name__ if isinstance(node, (ast.BinOp, ast.UnaryOp)) else type(node).__name__
    allowed = "only numbers, parentheses and + - * / // % ** are allowed (no names, calls, commas or strings)"
    raise ValueError(f"unsupported element {what!r}: {allowed}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return the result.

    Supports numbers, parentheses and the operators + - * / // % ** (e.g. "(1234 + 56) * 789 // 7").

    Args:
        expression: The arithmetic expression to evaluate, e.g. "4821 * 7390 - 15".
    """
    if not isinstance(expression, str):
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip().replace("×", "*").replace("÷", "/")
    if not text:
        raise ValueError("the expression is empty")
    if len(text) > _MAX_EXPRESSION:
        raise ValueError(f"the expression is {len(text)} characters long; at most {_MAX_EXPRESSION} are allowed")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"cannot read {text!r} as an arithmetic expression ({getattr(e, 'msg', e)})") from None
    try:
        value = _evaluate(tree.body)
    except RecursionError:
        raise ValueError("the expression is nested too deeply") from None
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


_CALC_FORMS: tuple[str, ...] = ("{a} * {b}", "{a} * {b} - {c} * {d}", "({a} + {b}) * ({hi} - {lo})", "{a} * {b} * {k}")
_CALC_FORMS += ("{qk} / {k} + {a} * {b}",)


def _calc_problem(rng: np.random.Generator) -> tuple[str, int]:
    a, b, c, d = (int(x) for x in rng.integers(100, 10_000, size=4))
    k, q = int(rng.integers(12, 100)), int(rng.integers(1_000, 100_000))
    form = _CALC_FORMS[int(rng.integers(len(_CALC_FORMS)))]
    expr = form.format(a=a, b=b, c=c, d=d, hi=max(c, d), lo=min(c, d), k=k, qk=q * k)
    return expr, int(calculator(expr))


class CalculatorArithmeticTask(ToolTask):
    """Arithmetic too long to do reliably in one's head (3-4 digit products, multi-step expressions).

    Tool: :func:`calculator`. The exact integer answer is expected in ``<answer></answer>`` (``correct`` is 1
    only for the exact value).
    """

    description = "Multi-digit arithmetic with a calculator tool; exact answer in <answer> tags."
    tools = (calculator,)
    default_max_turns = 4
    system_prompt = (
        "You are a careful assistant with a calculator tool. Do not compute in your head: call the calculator "
        "with the whole expression, read its result, then reply with the exact number. " + ANSWER_FORMAT
    )

    def problem(self, rng: np.random.Generator) -> tuple[str, Any, dict[str, Any]]:  # noqa: D102
        expr, answer = _calc_problem(rng)
        return f"Compute {expr}. {ANSWER_FORMAT}", answer, {"expression": expr}
