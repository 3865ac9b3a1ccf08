"""miles-agents' plugin module: rollout function `agent` (agents over the OpenAI API), the
example agent `calculator`, and recipe `quickstart-agent`."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from miles.agents.api import AgentRolloutConfig
from miles.agents.calculator import CalculatorAgent, CalculatorAgentConfig, quickstart_agent
from miles.core import hookimpl
from miles.core.contracts.components import ComponentSpec, Kind


def make_agent_rollout(config: AgentRolloutConfig) -> Any:
    from miles.agents.rollout import AgentRollout

    return AgentRollout(config)


@hookimpl
def miles_register_rollout_functions() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.ROLLOUT_FUNCTION,
            "agent",
            make_agent_rollout,
            "an agent (rollout.function.agent) over an OpenAI base URL; trains on its exact tokens",
            AgentRolloutConfig,
        )
    ]


@hookimpl
def miles_register_agents() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.AGENT,
            "calculator",
            CalculatorAgent,
            "example: calls a `max` calculator tool over the chat API, then answers",
            CalculatorAgentConfig,
        )
    ]


@hookimpl
def miles_register_recipes() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.RECIPE,
            "quickstart-agent",
            quickstart_agent,
            "the quickstart task as a tool-using agent over the OpenAI chat API, on a CPU",
        )
    ]
