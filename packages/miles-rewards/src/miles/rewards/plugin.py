"""miles-rewards' plugin module: the components it registers."""

from __future__ import annotations

from collections.abc import Iterable

from miles.core import Capability, ComponentSpec, Kind, hookimpl
from miles.rewards.code import Code, CodeConfig
from miles.rewards.configs import (
    CountdownConfig,
    FormatConfig,
    GSM8KConfig,
    LLMJudgeConfig,
    MathConfig,
    OverlongConfig,
    RemoteRMConfig,
)
from miles.rewards.countdown import Countdown
from miles.rewards.env_reward import EnvReward, EnvRewardConfig
from miles.rewards.exact_match import ExactMatch, ExactMatchConfig
from miles.rewards.filters import (
    DropFailed,
    DropFailedConfig,
    DynamicSampling,
    DynamicSamplingConfig,
    Length,
    LengthConfig,
)
from miles.rewards.format import Format
from miles.rewards.gsm8k import GSM8K
from miles.rewards.llm_judge import LLMJudge
from miles.rewards.math import MathVerify
from miles.rewards.overlong import Overlong
from miles.rewards.remote_rm import RemoteRM


@hookimpl
def miles_register_rewards() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.REWARD,
            "exact_match",
            ExactMatch,
            "1.0 when the response equals the row's reference answer",
            ExactMatchConfig,
        ),
        ComponentSpec(
            Kind.REWARD,
            "math",
            MathVerify,
            "1.0 when math-verify finds the answer (\\boxed{} too) equal to the reference",
            MathConfig,
        ),
        ComponentSpec(
            Kind.REWARD,
            "gsm8k",
            GSM8K,
            "1.0 when the final number (#### or last) equals the reference",
            GSM8KConfig,
        ),
        ComponentSpec(
            Kind.REWARD,
            "countdown",
            Countdown,
            "1.0 when the equation uses each number once and hits the target",
            CountdownConfig,
        ),
        ComponentSpec(
            Kind.REWARD,
            "format",
            Format,
            "1.0 when the response is <think>...</think><answer>...</answer>",
            FormatConfig,
        ),
        ComponentSpec(
            Kind.REWARD,
            "overlong",
            Overlong,
            "DAPO's soft overlong penalty in [-1, 0]",
            OverlongConfig,
        ),
        ComponentSpec(
            Kind.REWARD,
            "remote_rm",
            RemoteRM,
            "a reward model over HTTP (OpenRLHF remote-RM protocol), batched per group",
            RemoteRMConfig,
            capabilities=frozenset({Capability.SCORES_GROUPS}),
        ),
        ComponentSpec(
            Kind.REWARD,
            "llm_judge",
            LLMJudge,
            "an LLM grades via any OpenAI-compatible chat endpoint",
            LLMJudgeConfig,
            capabilities=frozenset({Capability.SCORES_GROUPS}),
        ),
        ComponentSpec(
            Kind.REWARD,
            "code",
            Code,
            "fraction of the row's test cases the response's program passes, in the sandbox",
            CodeConfig,
        ),
        ComponentSpec(
            Kind.REWARD,
            "env",
            EnvReward,
            "the reward a multi-turn environment gave over the episode",
            EnvRewardConfig,
        ),
    ]


@hookimpl
def miles_register_filters() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.FILTER,
            "drop_failed",
            DropFailed,
            "drop samples whose generation or reward failed",
            DropFailedConfig,
        ),
        ComponentSpec(
            Kind.FILTER,
            "dynamic_sampling",
            DynamicSampling,
            "DAPO: drop zero-variance groups and over-sample until the batch is full",
            DynamicSamplingConfig,
            capabilities=frozenset({Capability.OVERSAMPLES}),
        ),
        ComponentSpec(
            Kind.FILTER,
            "length",
            Length,
            "keep responses within a token-length range; optionally drop truncated ones",
            LengthConfig,
        ),
    ]
