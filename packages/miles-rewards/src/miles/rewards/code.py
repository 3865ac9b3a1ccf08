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

from miles.core.types import Sample
from miles.rewards.sandbox import Sandbox, SandboxLimits

_FENCE = re.compile(r"```([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
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
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(response)]
    python = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    if python:
        return str(python[-1])
    return str(blocks[-1][1]) if blocks else response


def _normalize(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).rstrip()


@dataclass(frozen=True)
class _IOCase:
    stdin: str
    expected: str


@dataclass(frozen=True)
class _AssertCase:
    setup: str  # the test string's non-assert statements
    check: str  # one assert statement


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
    checks = [
        ast.get_source_segment(source, s) or "" for s in module.body if isinstance(s, ast.Assert)
    ]
    setup = "\n".join(
        ast.get_source_segment(source, s) or ""
        for s in module.body
        if not isinstance(s, ast.Assert)
    )
    return [_AssertCase(setup, check) for check in checks] or [_AssertCase("", source)]


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
        program = extract_code(response, self.config.extract)
        passed = await asyncio.gather(*(self._passes(program, case) for case in cases))
        return sum(passed) / len(cases)

    async def _passes(self, program: str, case: _IOCase | _AssertCase) -> bool:
        sandbox = self._sandbox()
        if isinstance(case, _IOCase):
            result = await sandbox.run(program, stdin=case.stdin, limits=self.limits)
            return result.ok and _normalize(result.stdout) == _normalize(case.expected)
        # The marker, printed after the assert, tells "passed" from "the program exited early"
        # (a `sys.exit(0)` before the tests would otherwise pass every case).
        marker = f"miles-code-passed-{secrets.token_hex(8)}"
        source = f"{program}\n\n{case.setup}\n{case.check}\nprint({marker!r})\n"
        result = await sandbox.run(source, limits=self.limits)
        return result.ok and result.stdout.rstrip().endswith(marker)
