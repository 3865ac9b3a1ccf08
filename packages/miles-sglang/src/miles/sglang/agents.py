"""Deprecated: the agent API moved to `miles.agents` (the miles-agents distribution); this path goes
in miles-sglang 0.2."""

import warnings

try:
    from miles.agents.api import AgentOutcome, AgentRolloutConfig, AgentSession
except ModuleNotFoundError as exc:  # pragma: no cover - only without miles-agents
    raise ModuleNotFoundError(
        "miles.sglang.agents moved to miles.agents, in the miles-agents distribution: "
        "pip install miles-agents",
        name=__name__,
    ) from exc

warnings.warn(
    "miles.sglang.agents is deprecated: import miles.agents instead (the old path goes in "
    "miles-sglang 0.2)",
    DeprecationWarning,
    stacklevel=2,
)

__all__ = ["AgentOutcome", "AgentRolloutConfig", "AgentSession"]
