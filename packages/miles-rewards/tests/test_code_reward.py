"""The `code` reward: extraction, test-case layouts and scoring (programs run in the sandbox)."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from miles.core.types import Sample
from miles.rewards.code import Code, CodeConfig, SandboxConfig, extract_code, parse_tests

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
IO_TESTS = [
    {"input": "1 2\n", "output": "3\n"},
    {"input": "10 -4\n", "output": "6"},
    {"input": "0 0\n", "output": "0\n"},
]


# Root (here and in CI) gets full isolation; an unprivileged developer's run can only be weak.
WEAK_OK = SandboxConfig(allow_weak=os.geteuid() != 0)


def score(response: str, tests, **config) -> float:
    reward = Code(CodeConfig(**{"case_timeout_s": 3.0, "sandbox": WEAK_OK, **config}))
    return asyncio.run(reward(response, Sample(prompt_ids=[1], metadata={"tests": tests})))


def test_extract_code() -> None:
    text = "Idea.\n```python\nprint(1)\n```\nBetter:\n```py\nprint(2)\n```\n```text\nout\n```"
    assert extract_code(text) == "print(2)\n"  # the last *python* block
    assert extract_code("```\nprint(3)\n```") == "print(3)\n"  # untagged block
    assert extract_code("print(4)") == "print(4)"  # no block: the whole response
    assert extract_code("```python\nprint(5)\n") == "print(5)\n"  # unterminated (truncated)
    assert extract_code(text, "full") == text
    with pytest.raises(ValueError):
        extract_code(text, "first")


def test_parse_tests_layouts() -> None:
    assert len(parse_tests(IO_TESTS)) == 3
    columns = {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]}
    assert [c.expected for c in parse_tests(columns)] == ["3\n", "7\n"]
    assert parse_tests(json.dumps(columns)) == parse_tests(columns)
    cases = parse_tests("from math import fsum\nassert f(1) == 2\nassert f(2) == 3\n")
    assert [c.check for c in cases] == ["assert f(1) == 2", "assert f(2) == 3"]
    assert all(c.setup == "from math import fsum" for c in cases)
    with pytest.raises(ValueError):
        parse_tests(42)


def test_stdin_stdout_cases() -> None:
    assert score(f"Here:\n```python\n{ADD}```", IO_TESTS) == 1.0
    # Right on two of three cases.
    wrong_on_zero = ADD.replace("print(a + b)", "print(a + b if a else 1)")
    assert score(f"```python\n{wrong_on_zero}```", IO_TESTS) == pytest.approx(2 / 3)
    assert score("I don't know.", IO_TESTS) == 0.0


def test_assert_cases_score_each_assert() -> None:
    tests = "assert add(1, 2) == 3\nassert add(2, 2) == 4\nassert add(0, 0) == 1\n"
    assert score("```python\ndef add(a, b):\n    return a + b\n```", tests) == pytest.approx(2 / 3)


def test_exiting_early_does_not_pass_asserts() -> None:
    tests = "assert add(1, 2) == 3\n"
    assert score("import sys\ndef add(a, b):\n    return 0\nsys.exit(0)", tests) == 0.0
    assert score("import os\nos._exit(0)", tests) == 0.0


def test_sandbox_failures_score_zero() -> None:
    tests = [{"input": "", "output": "done\n"}]
    assert score("while True:\n    pass", tests, case_timeout_s=0.5) == 0.0
    assert score("x = bytearray(1 << 40)\nprint('done')", tests) == 0.0
    assert score("import os\nwhile True:\n    os.fork()", tests, case_timeout_s=0.5) == 0.0
    assert score("print('done'", tests) == 0.0  # syntax error
    assert score("print('done')", tests) == 1.0


def test_missing_field_names_the_fix() -> None:
    reward = Code(CodeConfig(test_key="cases"))
    with pytest.raises(KeyError, match=r"reward\.test_key"):
        asyncio.run(reward("print(1)", Sample(prompt_ids=[1], metadata={"tests": IO_TESTS})))


def test_reward_is_reusable_across_event_loops() -> None:
    reward = Code(CodeConfig(case_timeout_s=3.0, max_concurrency=1, sandbox=WEAK_OK))
    sample = Sample(prompt_ids=[1], metadata={"tests": IO_TESTS})
    assert asyncio.run(reward(ADD, sample)) == 1.0
    assert asyncio.run(reward(ADD, sample)) == 1.0


def test_sandbox_allow_weak_reaches_the_sandbox() -> None:
    async def sandbox_of(config: CodeConfig):
        return Code(config)._sandbox()

    assert asyncio.run(sandbox_of(CodeConfig())).allow_weak is False  # refuses weak isolation
    weak = CodeConfig(sandbox=SandboxConfig(allow_weak=True))
    assert asyncio.run(sandbox_of(weak)).allow_weak is True
