"""The `code` reward: extraction, test-case layouts and scoring (programs run in the sandbox)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import re
import time

import pytest

from miles.core.contracts.types import Sample
from miles.rewards.code import (
    Code,
    CodeConfig,
    SandboxConfig,
    extract_code,
    fenced_blocks,
    parse_tests,
)

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


ALWAYS_EQUAL = """
class Yes:
    def __eq__(self, other):
        return True
    def __ne__(self, other):
        return False
    def __bool__(self):
        return True

def add(a, b):
    return Yes()
"""


def test_a_returned_object_cannot_vote_for_itself() -> None:
    """The audit's exploit: an object whose __eq__ is always true passed every assert (1.0).
    Operands now come out as plain values, judged outside the program."""
    literal = "assert add(1, 2) == 3\nassert add(2, 2) == 4\n"
    assert score(ALWAYS_EQUAL, literal) == 0.0
    expected_in_setup = "want = [3, 4]\nassert [add(1, 2), add(2, 2)] == want\n"
    assert score(ALWAYS_EQUAL, expected_in_setup) == 0.0
    assert score(ALWAYS_EQUAL, "assert add(1, 2)\n") == 0.0  # truthy, but not plain data
    int_subclass = "class I(int):\n    def __eq__(self, o):\n        return True\n"
    assert score(int_subclass + "def add(a, b):\n    return I(0)\n", literal) == 0.0
    honest = "def add(a, b):\n    return a + b\n"
    assert score(honest, literal) == 1.0
    assert score(honest, expected_in_setup) == 1.0
    assert score(honest, "assert add(1, 1) == 2 and add(0, 0) == 0\nassert add(1, 2) > 2\n") == 1.0


def test_plain_values_compare_as_python_does() -> None:
    program = (
        "import math\n"
        "def f():\n"
        "    return {'a': [1, 2.5, (None, True)], 'b': {1, 2}, 'c': b'x', 'n': math.nan}\n"
    )
    want = "{'a': [1, 2.5, (None, True)], 'b': {2, 1}, 'c': b'x', 'n': float('nan')}"
    assert score(program, f"import math\nassert f() == {want}\n") == 1.0
    assert score(program, "assert f()['a'] == [1, 2.5, [None, True]]\n") == 0.0  # tuple != list
    assert score("def g():\n    return 2\n", "assert g() == 2.0\n") == 1.0  # 2 == 2.0


def test_a_literal_expected_value_is_not_shown_to_the_program() -> None:
    """The program can read its own source; a literal right-hand side is compared outside and
    is not in it (the old harness put the whole assert there, and this program passed)."""
    leak = (
        "import re\n"
        "def answer():\n"
        "    found = re.findall(r'98765[0-9]', open(__file__).read())\n"
        "    return int(found[-1]) if found else 0\n"
    )
    assert score(leak, "assert answer() == 987654\n") == 0.0


_OLD_FENCE = re.compile(r"```([A-Za-z0-9_+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)


def test_fences_are_parsed_as_before_in_linear_time() -> None:
    """Same blocks as the old regex on random fence soup; and the audit's inputs, which took
    the regex 0.55 s (32k fences) and 10.7 s (128k characters), parse in a small fraction."""
    rng = random.Random(0)
    pieces = ["```", "`", "\n", "python", "py", " ", "a", "x=1", "-", "``"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert fenced_blocks(text) == _OLD_FENCE.findall(text), repr(text)
    for text in ("```a" * 32000, "```a" * 128000, "```a\n" * 32000):
        start = time.perf_counter()
        extract_code(text)
        assert time.perf_counter() - start < 2.0
