"""`countdown`: the Countdown numbers game (as in TinyZero): combine the row's `numbers`, each
exactly once, with + - * / and parentheses to reach its `target`.

The equation is read from the last <answer>...</answer> (or the last non-empty line), and evaluated
by walking its Python AST with exact fractions: only integer literals, the four binary operators
and parentheses are accepted. Nothing is ever passed to `eval`, so a response like
`__import__('os').system(...)` is just an equation that does not parse. If the equation has an
`=`, its left side is evaluated (the right side, whatever it claims, is ignored).
"""

from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any, ClassVar

from miles.core.contracts.types import Sample
from miles.rewards.configs import CountdownConfig

_MAX_CHARS = 512  # longer than any sane equation over a handful of numbers; bounds parse cost
_OPS: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


class UnsafeExpression(ValueError):
    """The equation has something other than integers, + - * / and parentheses."""


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integers it uses, in order. Raises
    UnsafeExpression (anything else), ZeroDivisionError, or SyntaxError."""
    if len(expression) > _MAX_CHARS:
        raise UnsafeExpression(f"expression longer than {_MAX_CHARS} characters")
    tree = ast.parse(expression.strip(), mode="eval")
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](walk(node.left), walk(node.right))
        # bool is an int subclass: `True` must not pass as 1.
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise UnsafeExpression(f"not allowed in an equation: {ast.dump(node)[:80]}")

    return walk(tree), used


def extract_equation(response: str, tag: str, require_tag: bool) -> str | None:
    found: list[str] = re.findall(rf"<{tag}>(.*?)</{tag}>", response, flags=re.DOTALL)
    if found:
        return found[-1].strip()
    if require_tag:
        return None
    lines = [line.strip() for line in response.splitlines() if line.strip()]
    return lines[-1] if lines else None


class Countdown:
    reward_range: tuple[float, float] = (0.0, 1.0)
    deterministic: bool = True
    # The data row `miles plugins check` scores against (see miles.plugin_kit.conformance).
    conformance_example: ClassVar[dict[str, Any]] = {"row": {"target": 42, "numbers": [6, 7]}}

    def __init__(self, config: CountdownConfig) -> None:
        self.config = config

    async def __call__(self, response: str, sample: Sample) -> float:
        cfg = self.config
        for key in (cfg.target_key, cfg.numbers_key):
            if key not in sample.metadata:
                raise KeyError(
                    f"countdown: the data row has no {key!r} field "
                    f"(fields: {sorted(sample.metadata)}); set reward.target_key / numbers_key"
                )
        target = Fraction(sample.metadata[cfg.target_key])
        numbers = [int(n) for n in sample.metadata[cfg.numbers_key]]

        equation = extract_equation(response, cfg.answer_tag, cfg.require_tag)
        if equation is None:
            return 0.0
        try:
            value, used = evaluate(equation.split("=")[0])
        except (SyntaxError, ValueError, ZeroDivisionError, RecursionError, MemoryError):
            # Not an equation at all (UnsafeExpression is a ValueError): no format credit.
            return 0.0
        if Counter(used) == Counter(numbers) and value == target:
            return 1.0
        return cfg.format_score
