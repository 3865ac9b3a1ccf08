"""miles-torch's plugin module: the embedded default backends."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from miles.core import ComponentSpec, Kind, hookimpl
from miles.torch.engine.config import TorchEngineConfig
from miles.torch.train.config import FSDPConfig


def make_engine(config: TorchEngineConfig, model_path: str, *, device: str, seed: int) -> Any:
    from miles.torch.engine.engine import TorchRolloutEngine

    return TorchRolloutEngine(
        model_path,
        device=device,
        dtype=config.dtype,
        max_batch_size=config.max_batch_size,
        seed=seed,
        record_routing=config.record_routing,
    )


def make_trainer(config: FSDPConfig, model_path: str, **kwargs: Any) -> Any:
    from miles.torch.train.fsdp import FSDPTrainer

    return FSDPTrainer(config, model_path, **kwargs)


@hookimpl
def miles_register_rollout_backends() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.ROLLOUT_BACKEND,
            "torch",
            make_engine,
            "native PyTorch engine: batched generation with a KV cache over HF models",
            TorchEngineConfig,
        )
    ]


@hookimpl
def miles_register_train_backends() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.TRAIN_BACKEND,
            "fsdp",
            make_trainer,
            "FSDP2 (fully_shard) over N ranks: gloo on CPU, NCCL on GPU",
            FSDPConfig,
        )
    ]
