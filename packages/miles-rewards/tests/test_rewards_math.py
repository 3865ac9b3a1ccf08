"""`math` (real math-verify), `gsm8k` and `countdown`."""

import asyncio
import pickle
from fractions import Fraction

import pytest

from miles.core.contracts.types import Sample
from miles.rewards.configs import CountdownConfig, GSM8KConfig, MathConfig
from miles.rewards.countdown import Countdown, UnsafeExpression, evaluate
from miles.rewards.gsm8k import GSM8K, extract_answer
from miles.rewards.math import MathVerify, last_boxed


def score(reward, response: str, **row) -> float:
    return asyncio.run(reward(response, Sample(prompt_ids=[1], metadata=row)))


# ── math ─────────────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("response", "reference", "expected"),
    [
        (r"So the answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
        (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
        (r"\boxed{\frac{2}{4}}", "1/2", 1.0),
        (r"The final answer is $\sqrt{2}$", r"\sqrt{2}", 1.0),
        (r"\boxed{(1, 2)}", "(1,2)", 1.0),
        (r"\boxed{\frac{1}{3}}", "0.5", 0.0),
        ("I don't know", "0.5", 0.0),
        (r"\boxed{72}", 72, 1.0),  # non-string references (JSON numbers) are fine
    ],
)
def test_math_verify(response: str, reference: object, expected: float) -> None:
    reward = MathVerify(MathConfig(workers=0))
    assert score(reward, response, answer=reference) == expected


def test_math_boxed_only_ignores_unboxed_answers() -> None:
    lenient = MathVerify(MathConfig(workers=0))
    strict = MathVerify(MathConfig(workers=0, boxed_only=True))
    response = "Thus the result is $\\frac{1}{2}$."
    assert score(lenient, response, answer="0.5") == 1.0
    assert score(strict, response, answer="0.5") == 0.0
    # The last box counts, with nested braces intact.
    boxed = r"first \boxed{3}, then \boxed{\frac{1}{2}}"
    assert last_boxed(boxed) == r"\frac{1}{2}"
    assert score(strict, boxed, answer="0.5") == 1.0
    assert last_boxed(r"cut off \boxed{\frac{1}{") is None


def test_math_bad_reference_and_missing_field_raise() -> None:
    reward = MathVerify(MathConfig(workers=0, answer_key="solution"))
    with pytest.raises(KeyError, match=r"reward\.answer_key"):
        score(reward, r"\boxed{1}", answer="1")
    with pytest.raises(ValueError, match="cannot parse the reference"):
        score(MathVerify(MathConfig(workers=0)), r"\boxed{1}", answer="")


def test_math_in_worker_processes() -> None:
    reward = MathVerify(MathConfig(workers=1))
    try:

        async def both() -> list[float]:
            rows = [(r"\boxed{\frac{1}{2}}", "0.5"), (r"\boxed{3}", "0.5")]
            return list(
                await asyncio.gather(
                    *(reward(r, Sample(prompt_ids=[1], metadata={"answer": a})) for r, a in rows)
                )
            )

        assert asyncio.run(both()) == [1.0, 0.0]
        # Picklable after use (Ray ships rewards to actors); the copy starts its own workers.
        copy = pickle.loads(pickle.dumps(reward))
        try:
            assert score(copy, r"\boxed{0.5}", answer=r"\frac{1}{2}") == 1.0
        finally:
            copy.close()
    finally:
        reward.close()


# ── gsm8k ────────────────────────────────────────────────────────────────────────────────────────

SOLUTION = "Natalia sold 48/2 = 24 clips in May.\nAltogether she sold 48+24 = 72 clips.\n#### 72"


def test_gsm8k_strict_needs_the_marker() -> None:
    reward = GSM8K(GSM8KConfig(mode="strict"))
    assert score(reward, "48 + 24 = 72\n#### 72", answer=SOLUTION) == 1.0
    assert score(reward, "so #### $1,000.", answer="1000") == 1.0
    assert score(reward, "The answer is 72.", answer=SOLUTION) == 0.0
    assert score(reward, "#### 71", answer=SOLUTION) == 0.0


def test_gsm8k_flexible_takes_the_last_number() -> None:
    reward = GSM8K(GSM8KConfig(mode="flexible"))
    assert score(reward, "24 in May, so 72 in all.", answer=SOLUTION) == 1.0
    assert score(reward, "72 in all? No: 73.", answer=SOLUTION) == 0.0
    assert score(reward, "It costs $1,000.00", answer="1000") == 1.0
    assert score(reward, "-3 degrees", answer="-3") == 1.0
    assert score(reward, "no numbers", answer="3") == 0.0


def test_gsm8k_extract_and_errors() -> None:
    assert extract_answer("#### 1,234", "strict") == "1234"
    assert extract_answer("1, 2 and 3.", "flexible") == "3"
    with pytest.raises(ValueError, match="no number in the reference"):
        score(GSM8K(GSM8KConfig()), "#### 1", answer="none")
    with pytest.raises(KeyError, match="answer_key"):
        score(GSM8K(GSM8KConfig()), "#### 1", label="1")


# ── countdown ────────────────────────────────────────────────────────────────────────────────────

ROW = {"target": 24, "numbers": [4, 6, 1]}


def test_countdown_valid_equations() -> None:
    reward = Countdown(CountdownConfig())
    assert score(reward, "<think>...</think><answer>4 * 6 * 1</answer>", **ROW) == 1.0
    # The last answer counts.
    assert score(reward, "<answer>4 + 6 + 1</answer> no: <answer>4 * 6 * 1</answer>", **ROW) == 1.0
    assert score(reward, "<answer>4 * 6 * 1</answer> no: <answer>4 + 6 + 1</answer>", **ROW) == 0.0
    assert score(reward, "reasoning\n(6 / 1) * 4\n", **ROW) == 1.0  # last line, no tags
    assert score(reward, "<answer>4 * 6 / 1 = 24</answer>", **ROW) == 1.0
    # Exact fractions: 8 / (3 - 8/3) = 24.
    assert score(reward, "<answer>8 / (3 - 8 / 3)</answer>", target=24, numbers=[8, 3, 8, 3]) == 1.0


def test_countdown_invalid_equations() -> None:
    reward = Countdown(CountdownConfig(format_score=0.1))
    assert score(reward, "<answer>4 * 6</answer>", **ROW) == 0.1  # 1 unused
    assert score(reward, "<answer>4 * 6 * 1 * 1</answer>", **ROW) == 0.1  # 1 used twice
    assert score(reward, "<answer>4 + 6 + 1</answer>", **ROW) == 0.1  # wrong value
    assert score(reward, "<answer>4 * 6 * 1 = 25</answer>", target=25, numbers=[4, 6, 1]) == 0.1
    assert score(reward, "<answer>4 * 6 / (1 - 1)</answer>", target=24, numbers=[4, 6, 1, 1]) == 0.0
    assert score(reward, "<answer>-4 * -6 * 1</answer>", **ROW) == 0.0  # unary minus
    assert score(reward, "<answer>4 ** 2 + 6 + 1 + 1</answer>", **ROW) == 0.0
    assert score(reward, "<answer>24.0</answer>", target=24, numbers=[24]) == 0.0  # floats
    assert score(reward, "I give up", **ROW) == 0.0
    strict = Countdown(CountdownConfig(require_tag=True))
    assert score(strict, "4 * 6 * 1", **ROW) == 0.0


@pytest.mark.parametrize(
    "attack",
    [
        "__import__('os').system('touch /tmp/pwned')",
        "(lambda: 24)()",
        "[4, 6, 1].__len__() * 8",
        "True * 24",
        "open('/etc/passwd')",
        "(" * 400 + "1" + ")" * 400,
        "9" * 600,
    ],
)
def test_countdown_never_runs_code(attack: str) -> None:
    reward = Countdown(CountdownConfig())
    assert score(reward, f"<answer>{attack}</answer>", **ROW) == 0.0
    with pytest.raises((UnsafeExpression, SyntaxError, RecursionError, MemoryError)):
        evaluate(attack)


def test_countdown_evaluate_is_exact() -> None:
    assert evaluate("(1 + 2) / 3 * 4") == (Fraction(4), [1, 2, 3, 4])
    assert evaluate("1 / 3 + 1 / 3 + 1 / 3") == (Fraction(1), [1, 3, 1, 3, 1, 3])
