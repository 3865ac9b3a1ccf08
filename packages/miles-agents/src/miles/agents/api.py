"""Rollout function `agent`: a user's agent (a plugin) runs each episode against an
OpenAI-compatible base URL, and the run trains on the exact tokens of every call it made.

    rollout:
      function: {name: agent, agent: calculator}

Per sample, the agent gets an `AgentSession` (its own base URL, the dataset row, the model name)
and returns its reward (or an `AgentOutcome`; `None` leaves scoring to `reward:`). The gateway
(`miles.agents.gateway`) serves the base URL from the rollout process and records each call; the
sample is the first call's prompt, then every later token: generated tokens with their logprobs
and weight versions (loss mask 1), everything the agent added (loss mask 0). Nothing the model
generated is re-tokenized. The agent's reward lands in `metadata["env_reward"]`, which reward
`env` reads.

An agent is a plain function or a coroutine function. A plain one runs in a thread of its own
(it may use the `openai` client or any HTTP library); a coroutine must use an async HTTP client,
since it runs on the rollout's event loop.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from miles.core.config import ComponentRef
from miles.core.config.tools import ConfigError, build
from miles.core.contracts.components import Kind
from miles.core.registry.plugins import get_plugin_manager


@dataclass(frozen=True)
class AgentSession:
    """What an agent gets for one episode."""

    base_url: str  # OpenAI-compatible: {base_url}/chat/completions, /completions, /models
    model: str  # the name to send as `model` (any name is accepted)
    row: dict[str, Any]  # the dataset row of the prompt
    group_id: int
    sample_id: int
    api_key: str = "miles"  # OpenAI clients insist on one; the gateway takes any


@dataclass
class AgentOutcome:
    reward: float | None = None  # None: the run's `reward:` scores the sample
    metadata: dict[str, Any] = field(default_factory=dict)  # kept on the sample


Agent = Callable[[AgentSession], "float | AgentOutcome | Awaitable[Any] | None"]


@dataclass
class AgentRolloutConfig:
    agent: ComponentRef | str = "calculator"  # an agent component and its options
    # Threads for plain-function agents: episodes that run at once (each waits on its calls).
    max_concurrent: int = 256
    # Seconds one episode may take before it is failed.
    episode_timeout_s: float = 600.0
    # Where the gateway listens: 127.0.0.1 unless agents run elsewhere (sandboxes, other hosts).
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {self.max_concurrent}")
        if isinstance(self.agent, str):
            self.agent = ComponentRef(self.agent)
        try:
            spec = get_plugin_manager().get(Kind.AGENT, self.agent.name).spec
            if spec.config is not None:
                build(spec.config, self.agent.options, "agent")
        except (LookupError, ConfigError) as exc:
            raise ValueError(f"agent: {exc}") from None
