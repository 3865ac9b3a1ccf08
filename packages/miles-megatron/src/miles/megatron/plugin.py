"""miles-megatron's plugin module: the `megatron` train backend."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from miles.core import Capability, ComponentSpec, Kind, hookimpl
from miles.core.contracts.backends import TrainSetup
from miles.megatron.checks import megatron_run_checks
from miles.megatron.config import MegatronConfig
from miles.megatron.memory import megatron_memory

# What the backend does; what it leaves out (LoRA, a critic, context parallelism) the run refuses
# before launch, by these.
MEGATRON_CAPABILITIES = frozenset(
    {
        Capability.TENSOR_PARALLEL,
        Capability.PIPELINE_PARALLEL,
        Capability.EXPERT_PARALLEL,
        Capability.COLOCATE,
        Capability.REFERENCE,
        Capability.ROUTING_REPLAY,
    }
)


def make_trainer(config: MegatronConfig, setup: TrainSetup) -> Any:
    from miles.megatron.trainer import MegatronTrainer

    return MegatronTrainer(config, setup)


@hookimpl
def miles_register_train_backends() -> Iterable[ComponentSpec]:
    return [
        ComponentSpec(
            Kind.TRAIN_BACKEND,
            "megatron",
            make_trainer,
            "Megatron-core: TP, PP and EP over CUDA GPUs, distributed optimizer, 1F1B",
            MegatronConfig,
            capabilities=MEGATRON_CAPABILITIES,
            memory=megatron_memory,
            check=megatron_run_checks,
        )
    ]
