"""miles-sglang's plugin module: `miles serve` on the command line, rollout backend `sglang`
(attached to running SGLang or `miles serve` servers), rollout function `agent` (agents over the
OpenAI API) with the example agent `calculator`, and recipe `quickstart-agent`."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

import click

from miles.core import hookimpl
from miles.core.contracts.backends import RolloutSetup
from miles.core.contracts.components import Capability, ComponentSpec, Kind
from miles.core.config import RunConfig
from miles.sglang.agents import AgentRolloutConfig
from miles.sglang.calculator_agent import CalculatorAgent, CalculatorAgentConfig, quickstart_agent
from miles.sglang.command import serve
from miles.sglang.config import MIN_SGLANG, SGLangConfig


def make_engine(config: SGLangConfig, setup: RolloutSetup) -> Any:
    from miles.sglang.engine import SGLangEngine

    return SGLangEngine(config, setup)


def make_agent_rollout(config: AgentRolloutConfig) -> Any:
    from miles.sglang.agent_rollout import AgentRollout

    return AgentRollout(config)


def sglang_run_checks(run: RunConfig, config: SGLangConfig) -> list[str]:
    """Problems found before launch: where the servers are, or what launches them."""
    if not config.urls:
        if config.server == "sglang" and importlib.util.find_spec("sglang") is None:
            return [
                "rollout.backend sglang launches an SGLang server per engine, and the sglang "
                "package is not installed here: pip install 'miles-sglang[server]' (SGLang >= "
                f"{MIN_SGLANG}); or launch `miles serve` servers instead (--set "
                "rollout.server=miles); or attach to running servers, one per engine (--set "
                "'rollout.urls=[http://127.0.0.1:30000]' after `miles serve MODEL --port 30000`)"
            ]
        return []
    if len(config.urls) != run.rollout.engines:
        return [
            f"rollout.urls lists {len(config.urls)} server(s) for rollout.engines="
            f"{run.rollout.engines}: one server per engine (set rollout.engines={len(config.urls)})"
        ]
    from miles.sglang.engine import server_problems

    replay = run.moe.routing_replay != "off"
    return [p for url in config.urls for p in server_problems(url, config.api_key, replay)]


@hookimpl
def miles_register_rollout_backends() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.ROLLOUT_BACKEND,
            "sglang",
            make_engine,
            "SGLang's HTTP protocol: attached SGLang or `miles serve` servers (rollout.urls)",
            SGLangConfig,
            capabilities=frozenset(
                {Capability.PARTIAL_ROLLOUT, Capability.ROUTING_RECORD, Capability.COLOCATE}
            ),
            check=sglang_run_checks,
        )
    ]


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


@hookimpl
def miles_register_commands(cli: click.Group) -> None:
    cli.add_command(serve)
