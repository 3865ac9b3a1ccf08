"""Conformance checks for reward components: what `miles plugins check` runs.

A reward is built with its config dataclass and scores with ``async def __call__(self, response:
str, sample: Sample) -> float``. It may declare, as class attributes,

* ``reward_range: tuple[float, float]``: every score must lie in it (undeclared: scores need only
  be finite);
* ``deterministic: bool``: when true, the same inputs must give the same scores on every call;

and it may provide ``async def score_group(responses, samples) -> list[float]``.

The checks run the reward on ordinary inputs, on empty and garbage responses (a policy early in
training produces those), pickle it the way Ray ships objects to actors, and hold it to what it
declares. Each yields a :class:`CheckResult` whose ``detail`` says what is wrong when it fails.

    suite    check_reward / acheck_reward: every check, in order
    cases    the inputs: ordinary responses and garbage
    scoring  one call of the reward, with a time limit and readable errors
    checks   the checks that hold a built reward to its declarations
    results  CheckResult, and the table `miles plugins check` prints
"""

from miles.plugin_kit.conformance.cases import Case, default_sample, garbage_cases, sample_cases
from miles.plugin_kit.conformance.results import CHECKS, CheckResult, Status, format_results
from miles.plugin_kit.conformance.suite import (
    DEFAULT_TIMEOUT_S,
    RewardTarget,
    acheck_reward,
    check_reward,
)

__all__ = [
    "CHECKS",
    "DEFAULT_TIMEOUT_S",
    "Case",
    "CheckResult",
    "RewardTarget",
    "Status",
    "acheck_reward",
    "check_reward",
    "default_sample",
    "format_results",
    "garbage_cases",
    "sample_cases",
]
