"""Example tool environments for `multi_turn`."""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass
from typing import Any

from miles.core.contracts.protocols import EnvStep

_CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def safe_arithmetic(expression: str) -> float:
    """Evaluates + - * / and parentheses over numbers; anything else raises ValueError."""

    def walk(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        value = node.value if isinstance(node, ast.Constant) else None
        if isinstance(value, int | float) and not isinstance(value, bool):  # not True, 1j...
            return float(value)
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](walk(node.left), walk(node.right)))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return float(_OPS[type(node.op)](walk(node.operand)))
        raise ValueError(f"not allowed in an arithmetic expression: {type(node).__name__}")

    if len(expression) > 200:
        raise ValueError("expression too long")
    try:
        return walk(ast.parse(expression.strip(), mode="eval"))
    except (SyntaxError, ZeroDivisionError) as exc:
        raise ValueError(str(exc)) from None


@dataclass
class CalculatorConfig:
    answer_key: str = "answer"


class Calculator:
    """A calculator tool. `<calc>2*(3+4)</calc>` returns the value as the next observation;
    `<answer>14</answer>` ends the episode with reward 1 if it equals the row's answer, else 0.
    A turn with neither ends the episode with reward 0."""

    def __init__(self, config: CalculatorConfig) -> None:
        self.config = config
        self._answer = ""

    async def reset(self, row: dict[str, Any]) -> EnvStep:
        self._answer = str(row.get(self.config.answer_key, "")).strip()
        return EnvStep(observation="")

    async def step(self, action: str) -> EnvStep:
        if answer := _ANSWER.search(action):
            return EnvStep("", reward=float(answer.group(1).strip() == self._answer), done=True)
        if call := _CALL.search(action):
            try:
                value = safe_arithmetic(call.group(1))
                shown = str(int(value)) if value.is_integer() else f"{value:.6g}"
            except ValueError as exc:
                shown = f"error: {exc}"
            return EnvStep(observation=shown)
        return EnvStep("", done=True)
