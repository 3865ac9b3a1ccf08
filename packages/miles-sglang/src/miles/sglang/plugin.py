"""miles-sglang's plugin module: rollout backend `sglang` (attached to running SGLang or `miles
serve` servers, or launching its own)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from typing import Any

from miles.core import hookimpl
from miles.core.config import RunConfig
from miles.core.contracts.backends import RolloutSetup
from miles.core.contracts.components import Capability, ComponentSpec, Kind
from miles.sglang.config import MIN_SGLANG, SGLangConfig


def make_engine(config: SGLangConfig, setup: RolloutSetup) -> Any:
    from miles.sglang.engine import SGLangEngine

    return SGLangEngine(config, setup)


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
        if config.server == "miles" and importlib.util.find_spec("miles.serve") is None:
            return [
                "rollout.server: miles launches a `miles serve` server per engine, and miles-serve "
                "is not installed here: pip install miles-serve (or pip install 'miles-sglang[miles]')"
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
