"""miles-torch's plugin module: the embedded default backends, and the tokenizer loader."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from miles.core import Capability, ComponentSpec, Kind, hookimpl
from miles.core.contracts.backends import RolloutSetup, TrainSetup
from miles.torch.engine.config import TorchEngineConfig
from miles.torch.engine.memory import torch_engine_memory
from miles.torch.train.checks import fsdp_run_checks
from miles.torch.train.config import FSDPConfig
from miles.torch.train.memory import fsdp_memory

TORCH_ENGINE_CAPABILITIES = frozenset(
    {
        Capability.COLOCATE,
        Capability.ROUTING_RECORD,
        Capability.QUANTIZED_ROLLOUT,
        Capability.LORA_ADAPTERS,
        Capability.PARTIAL_ROLLOUT,
    }
)
FSDP_CAPABILITIES = frozenset(
    {
        Capability.COLOCATE,
        Capability.CRITIC,
        Capability.REFERENCE,
        Capability.LORA,
        Capability.ROUTING_REPLAY,
    }
)


def make_engine(config: TorchEngineConfig, setup: RolloutSetup) -> Any:
    from miles.torch.engine.engine import TorchRolloutEngine

    if setup.device == "cpu" and setup.cpu_threads:
        import torch

        torch.set_num_threads(setup.cpu_threads)
    return TorchRolloutEngine(
        setup.model_path,
        device=setup.device,
        dtype=config.dtype or setup.precision.rollout_dtype,
        max_batch_size=config.max_batch_size,
        seed=setup.seed,
        record_routing=setup.record_routing,
        precision=setup.precision,
        lora=setup.lora,
        sync_timeout_s=setup.sync_timeout_s,
        path=config.path,
        paged=config,
    )


def make_trainer(config: FSDPConfig, setup: TrainSetup) -> Any:
    from miles.torch.train.fsdp import FSDPTrainer

    return FSDPTrainer(config, setup)


@hookimpl
def miles_register_rollout_backends() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.ROLLOUT_BACKEND,
            "torch",
            make_engine,
            "native PyTorch engine: batched generation with a KV cache over HF models",
            TorchEngineConfig,
            capabilities=TORCH_ENGINE_CAPABILITIES,
            memory=torch_engine_memory,
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
            capabilities=FSDP_CAPABILITIES,
            memory=fsdp_memory,
            check=fsdp_run_checks,
        )
    ]


@hookimpl
def miles_load_tokenizer(model_path: str) -> Any:
    from miles.torch.models import load_tokenizer

    return load_tokenizer(model_path)


@hookimpl
def miles_local_checkpoint(model_path: str, gguf_file: str | None) -> str | None:
    from miles.torch import gguf
    from miles.torch.hub import check_hub_model

    if not gguf.is_gguf(model_path, gguf_file):
        check_hub_model(model_path)  # a hub id that cannot be fetched: said before launch
        return None
    return str(gguf.converted_checkpoint(model_path, gguf_file))
