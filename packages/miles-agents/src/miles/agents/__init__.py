"""Agent rollouts: an agent talks to a per-episode OpenAI base URL (the gateway), and training gets
the exact tokens the engine produced (the trajectory). What an agent author writes against::

    from miles.agents import AgentOutcome, AgentSession
"""

from miles.agents.api import AgentOutcome, AgentRolloutConfig, AgentSession

__all__ = ["AgentOutcome", "AgentRolloutConfig", "AgentSession"]
