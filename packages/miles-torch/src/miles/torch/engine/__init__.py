"""The native torch rollout engine (`TorchRolloutEngine`)."""

from miles.torch.engine.engine import TorchRolloutEngine

__all__ = ["TorchRolloutEngine"]
