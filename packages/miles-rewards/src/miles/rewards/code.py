"""`code`: the fraction of the row's test cases that the response's Python program passes.

The program runs in `miles.rewards.sandbox`. Test cases, in the data-row field `test_key`:

- a list of `{"input": str, "output": str}`: the program reads `input` on stdin and passes when its
  stdout equals `output` (trailing whitespace of each line and trailing blank lines ignored);
- `{"inputs": [...], "outputs": [...]}` (the APPS / TACO layout), the same cases column-wise;
- a string of Python: each top-level `assert` is one case, run after the program together with the
  string's other statements (imports, helpers). A JSON string of one of the layouts above is parsed.

A case whose run fails in any way (error, timeout, memory, ...) scores 0; only a failure of the
sandbox itself raises.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from miles.core.contracts.types import Sample
from miles.rewards import plain_values
from miles.rewards.sandbox import Sandbox, SandboxLimits

_FENCE_TAG = re.compile(r"[A-Za-z0-9_+.-]*")
_PYTHON_TAGS = {"python", "py", "python3"}


@dataclass
class SandboxConfig:
    # Run programs even where strong isolation (namespaces, a private root, a uid of its own: root
    # is needed) cannot be set up, with what remains (see docs/sandbox.md). Off: such runs raise.
    allow_weak: bool = False


@dataclass
class CodeConfig:
    test_key: str = "tests"  # the data-row field holding the test cases
    # Wall-clock limit of each case's run (`timeout_s` is another key: the run's limit per call).
    case_timeout_s: float = 5.0
    memory_mb: int = 256  # memory limit of each case's run
    extract: Literal["last_block", "full"] = "last_block"  # see `extract_code`
    max_concurrency: int = 0  # sandbox runs at a time; 0: the number of CPUs
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def extract_code(response: str, mode: str = "last_block") -> str:
    """The program in a response.

    "last_block": the last ```python fenced block; else the last fenced block of any language;
    else the whole response. "full": the whole response, as is.
    """
    if mode == "full":
        return response
    if mode != "last_block":
        raise ValueError(f"code: unknown extract mode {mode!r}; use 'last_block' or 'full'")
    blocks = [(tag.lower(), body) for tag, body in fenced_blocks(response)]
    python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python:
        return str(python[-1])
    return str(blocks[-1][1]) if blocks else response


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced block as (tag, body), in one pass over `text` (linear in its length, whatever
    it holds: a regex with a lazy body took seconds on many unclosed fences). A fence is ``` then
    the rest of its line, whose leading [A-Za-z0-9_+.-] characters are the tag; the body runs to
    the next ``` or to the end of the text."""
    blocks: list[tuple[str, str]] = []
    pos = 0
    while (start := text.find("```", pos)) >= 0:
        line_end = text.find("\n", start + 3)
        if line_end < 0:
            break  # no line after this fence, nor after any later one
        tag = _FENCE_TAG.match(text, start + 3, line_end)
        close = text.find("```", line_end + 1)
        end = len(text) if close < 0 else close
        blocks.append((tag.group() if tag else "", text[line_end + 1 : end]))
        if close < 0:
            break
        pos = close + 3
    return blocks


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


@dataclass(frozen=True)
class _IOCase:
    stdin: str
    expected: str


@dataclass(frozen=True)
class _AssertCase:
    """One `assert` of a test string. The program's process only computes the operands (see
    `plain_values`); the verdict is reached here: `assert L == R` compares L's value with R's
    (R a literal: never shown to the program), any other `assert T` takes T's value's truth."""

    setup: str  # the test string's non-assert statements
    check: str  # the assert statement, as written
    operands: tuple[str, ...] = ()  # (L, R) of an ==, else (T,); () if it does not parse
    expected: tuple[Any, ...] = ()  # (R's value,) when R is a literal


def parse_tests(tests: Any) -> list[_IOCase] | list[_AssertCase]:
    """The cases of one row's `tests` field (see the module docstring for the layouts)."""
    if isinstance(tests, str):
        try:
            decoded = json.loads(tests)
        except ValueError:
            return _assert_cases(tests)
        if isinstance(decoded, dict | list):
            return parse_tests(decoded)
        return _assert_cases(tests)
    if isinstance(tests, dict) and {"inputs", "outputs"} <= tests.keys():
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError("code: tests 'inputs' and 'outputs' differ in length")
        return [
            _IOCase(str(i), str(o)) for i, o in zip(tests["inputs"], tests["outputs"], strict=True)
        ]
    if isinstance(tests, list) and all(isinstance(t, dict) and "input" in t for t in tests):
        return [_IOCase(str(t["input"]), str(t["output"])) for t in tests]
    raise ValueError(
        "code: tests must be a list of {'input', 'output'}, {'inputs': [...], 'outputs': [...]} "
        f"or a string of assert statements; got {type(tests).__name__}"
    )


def _assert_cases(source: str) -> list[_AssertCase]:
    try:
        module = ast.parse(source)
    except SyntaxError:
        return [_AssertCase("", source)]  # one case; it fails to compile like the program would
    setup = "\n".join(
        ast.get_source_segment(source, s) or ""
        for s in module.body
        if not isinstance(s, ast.Assert)
    )
    cases = [_assert_case(source, setup, s) for s in module.body if isinstance(s, ast.Assert)]
    return cases or [_AssertCase("", source)]


def _assert_case(source: str, setup: str, statement: ast.Assert) -> _AssertCase:
    def text(node: ast.AST) -> str:
        return ast.get_source_segment(source, node) or ""

    check, test = text(statement), statement.test
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
        left, right = text(test.left), text(test.comparators[0])
        try:
            return _AssertCase(setup, check, (left,), (ast.literal_eval(right),))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return _AssertCase(setup, check, (left, right))
    return _AssertCase(setup, check, (text(test),))


class Code:
    reward_range: tuple[float, float] = (0.0, 1.0)
    deterministic: bool = True
    # A data row `miles plugins check` scores against (see miles.plugin_kit.conformance).
    conformance_example: ClassVar[dict[str, Any]] = {
        "row": {"tests": [{"input": "", "output": "42"}]}
    }

    def __init__(self, config: CodeConfig) -> None:
        if config.extract not in ("last_block", "full"):
            raise ValueError(f"code: unknown extract mode {config.extract!r}")
        self.config = config
        self.limits = SandboxLimits(wall_s=config.case_timeout_s, memory_mb=config.memory_mb)
        self._sandboxes: dict[asyncio.AbstractEventLoop, Sandbox] = {}

    def __getstate__(self) -> dict[str, Any]:
        # Sandboxes hold event-loop objects; a copy (Ray ships rewards to actors) makes its own.
        return {**self.__dict__, "_sandboxes": {}}

    def _sandbox(self) -> Sandbox:
        # A sandbox's semaphore belongs to one event loop; keep one per loop.
        loop = asyncio.get_running_loop()
        if loop not in self._sandboxes:
            self._sandboxes = {lp: s for lp, s in self._sandboxes.items() if not lp.is_closed()}
            self._sandboxes[loop] = Sandbox(
                self.config.max_concurrency or None, allow_weak=self.config.sandbox.allow_weak
            )
        return self._sandboxes[loop]

    async def __call__(self, response: str, sample: Sample) -> float:
        if self.config.test_key not in sample.metadata:
            raise KeyError(
                f"code: the data row has no {self.config.test_key!r} field "
                f"(fields: {sorted(sample.metadata)}); set reward.test_key"
            )
        cases = parse_tests(sample.metadata[self.config.test_key])
        if not cases:
            raise ValueError("code: the row has no test cases")
        # Off the event loop: the parse is linear, but a completion can be long.
        program = await asyncio.to_thread(extract_code, response, self.config.extract)
        passed = await asyncio.gather(*(self._passes(program, case) for case in cases))
        return sum(passed) / len(cases)

    async def _passes(self, program: str, case: _IOCase | _AssertCase) -> bool:
        sandbox = self._sandbox()
        if isinstance(case, _IOCase):
            result = await sandbox.run(program, stdin=case.stdin, limits=self.limits)
            return result.ok and _normalize(result.stdout) == _normalize(case.expected)
        # The operands' values come back after a marker (a program that exits early prints
        # none), through a serializer defined before the program runs, under a name of this
        # run; they are judged here, never by the program's own objects.
        token = secrets.token_hex(8)
        marker, dump = f"miles-code-value-{token}:", f"_miles_dump_{token}"
        prints = "".join(
            f"print({marker!r} + {dump}((\n{operand}\n)), flush=True)\n"
            for operand in case.operands
        )
        source = f"{plain_values.dump_source(dump)}\n{program}\n\n{case.setup}\n{prints}"
        result = await sandbox.run(source, limits=self.limits)
        if not result.ok or not case.operands:
            return False
        lines = [line.split(marker, 1)[1] for line in result.stdout.splitlines() if marker in line]
        if len(lines) < len(case.operands):
            return False
        try:
            values = [plain_values.load(line) for line in lines[-len(case.operands) :]]
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return False
        if len(case.operands) == 1 and not case.expected:
            return bool(values[0])  # `assert T`: the truth of T's plain value
        expected = case.expected[0] if case.expected else values[1]
        return plain_values.same(values[0], expected)
