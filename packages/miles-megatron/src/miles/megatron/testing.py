"""Test helpers: a `MegatronTrainer` in one call, and megatron-core on CPU ranks (the shims of
`miles.megatron.cpu_shims`, re-exported here for the checks that use them)."""

from __future__ import annotations

from typing import Any

from miles.megatron.cpu_shims import run_megatron_on_cpu

__all__ = ["make_trainer", "run_megatron_on_cpu"]


def make_trainer(
    model_path: str,
    *,
    master_port: int,
    rank: int = 0,
    world_size: int = 1,
    device: str = "cpu",
    **options: Any,
) -> Any:
    """A `MegatronTrainer` for tests and benchmarks: `options` are MegatronConfig and TrainSetup
    fields alike (tensor=2, pipeline=2 and expert=2 set the parallel layout); on CPU it runs
    through this module's shims, in fp32 by default."""
    import dataclasses

    from miles.core.config import ParallelConfig
    from miles.core.contracts.backends import TrainSetup
    from miles.megatron.config import MegatronConfig
    from miles.megatron.trainer import MegatronTrainer
    from miles.precision.dtype import bf16, fp32

    cpu = device == "cpu"
    parallel = ParallelConfig(
        **{k: options.pop(k) for k in ("tensor", "pipeline", "expert") if k in options}
    )
    options.setdefault("cpu_test_shims", cpu)
    setup_fields = {f.name for f in dataclasses.fields(TrainSetup)}
    setup = TrainSetup(
        model_path=model_path,
        rank=rank,
        world_size=world_size,
        master_addr="127.0.0.1",
        master_port=master_port,
        device=device,
        seed=options.pop("seed", 0),
        precision=options.pop("precision", None) or (fp32() if cpu else bf16()),
        parallel=parallel,
        **{k: options.pop(k) for k in list(options) if k in setup_fields},
    )
    return MegatronTrainer(MegatronConfig(**options), setup)
