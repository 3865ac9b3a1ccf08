"""The native torch rollout engine: `engine.TorchRolloutEngine`, configured by `config.TorchEngineConfig`.

Nothing is imported here, so reading the config section does not pull in torch or transformers.
"""
