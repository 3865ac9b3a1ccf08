"""The typed config section of the `megatron` train backend. No torch import: listing and plans
stay cheap. The parallel sizes are the run's (`train.parallel`); these are the backend's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LR_SCHEDULES = ("constant", "linear", "cosine")
DTYPES = ("bfloat16", "float32")
COMPILE = ("auto", "on", "off")
# A bare YAML on/off (a boolean in YAML 1.1) is read back as the word.
Switch = Literal["auto", "on", "off"]


@dataclass
class MegatronConfig:
    # Adam through megatron-core's optimizer: fp32 main weights and moments under bf16 weights,
    # sharded over data parallelism by the distributed optimizer (on CUDA).
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; <= 0 turns clipping off (the norm is reported)
    # megatron-core's OptimizerParamScheduler: linear warmup from 0 over `warmup_steps`, then the
    # schedule down to `min_lr_ratio * lr` at `total_steps` (0: the run's optimizer steps).
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    # Real tokens per micro-batch (one packed THD row); bounds activation memory.
    micro_batch_tokens: int = 8192
    # Weights and compute (main weights are fp32 either way); None: the run's precision's
    # (bf16 or fp32, what engines compute in) on GPUs, float32 on CPU ranks.
    dtype: str | None = None
    # Recompute each decoder layer in backward (megatron-core's full, uniform recompute).
    activation_checkpointing: bool = False
    # Each decoder layer's forward through `torch.compile` (Inductor fuses the elementwise work
    # TransformerEngine's kernels would): "auto" on CUDA for dense models, eager for what Dynamo
    # cannot trace; "on" everywhere, errors raised; "off" eager.
    compile: Switch = "off"
    # Routed experts' own tensor-parallel size (megatron-core's expert_tensor_parallel_size);
    # None: the same as train.parallel.tensor.
    expert_tensor_parallel: int | None = None
    # The distributed optimizer (main weights and moments sharded over data parallelism). It
    # needs CUDA: on CPU ranks the plain one runs.
    distributed_optimizer: bool = True
    # Run megatron-core on CPU ranks through `miles.megatron.cpu_shims` (fp32, gloo). For
    # tests and checks of the pipeline only: slow, and nothing a real run should use.
    cpu_test_shims: bool = False

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.compile not in COMPILE:
            raise ValueError(f"compile must be one of {COMPILE}, got {self.compile!r}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.cpu_test_shims and self.dtype == "bfloat16":
            raise ValueError(
                "dtype bfloat16 with cpu_test_shims: megatron-core's optimizer takes bf16 weights "
                "on CUDA only, so CPU ranks compute in float32; set train.dtype: float32 (or "
                "leave it unset)"
            )
        if self.micro_batch_tokens <= 0:
            raise ValueError(f"micro_batch_tokens must be positive, got {self.micro_batch_tokens}")
        if self.warmup_steps < 0 or self.total_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("warmup_steps and total_steps must be >= 0 and min_lr_ratio in [0, 1]")
        if self.expert_tensor_parallel is not None and self.expert_tensor_parallel < 1:
            raise ValueError(
                f"expert_tensor_parallel must be >= 1, got {self.expert_tensor_parallel}"
            )
        if len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers, got {self.betas!r}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))  # YAML gives a list


def schedule_problem(config: MegatronConfig, total_steps: int) -> str | None:
    if config.lr_schedule != "constant" and total_steps <= config.warmup_steps:
        return (
            f"lr_schedule {config.lr_schedule!r} needs total_steps > warmup_steps, got "
            f"total_steps={total_steps}, warmup_steps={config.warmup_steps}"
        )
    return None
