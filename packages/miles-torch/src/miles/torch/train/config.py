"""The typed config section of the FSDP2 train backend. No torch import: listing stays cheap."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LR_SCHEDULES = ("constant", "linear", "cosine")
# fp32 elements of one chunk of the output head's logits (`chunked_head`): about 512 MB each.
LOGIT_CHUNK_ELEMENTS = 1 << 27
# Parameters per chunk that `train.optimizer_offload` streams through the GPU: 256 Mi
# parameters' moments are 2 GiB at a time.
OPTIMIZER_CHUNK_PARAMS = 256 * 1024 * 1024
DTYPES = ("float32", "bfloat16")
PACKING = ("auto", "on", "off")
COMPILE = ("auto", "on", "off")
# A bare YAML on/off (a boolean in YAML 1.1) is read back as the word.
Switch = Literal["auto", "on", "off"]


@dataclass
class FSDPConfig:
    # AdamW. Master weights and optimizer state are always fp32.
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float = (
        1.0  # max global grad norm; <= 0 turns clipping off (the norm is still reported)
    )
    # Linear warmup over `warmup_steps`, then the schedule down to `min_lr_ratio * lr` at
    # `total_steps` (0: the run's optimizer steps, warm-start included; constant ignores it).
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0
    # Real (unpadded) tokens per forward pass; bounds activation and logits memory.
    micro_batch_tokens: int = 8192
    # Compute dtype of forward and backward; "bfloat16" is FSDP2 mixed precision (fp32 grad reduce).
    dtype: str = "float32"
    # How the reference policy (a KL term) is held: "copy", a frozen sharded copy on the device
    # (fast, one more model of memory); "offload", its weight shards in host memory, swapped into
    # the policy model for the reference forward (no extra device memory, two host<->device
    # copies a step).
    ref_mode: str = "copy"
    # transformers' attention for padded micro-batches (packed ones use `packed_attention`).
    attn_implementation: str = "sdpa"
    # Micro-batches as one row of concatenated sequences with variable-length attention, no
    # padding: "auto" where the model family declares it can (`packed_sequences`), "on" to
    # require it, "off" for right-padded blocks with an attention mask.
    packing: Switch = "auto"
    # The critic's AdamW learning rate (None: `lr`), when the run trains one (PPO with GAE).
    critic_lr: float | None = None
    # Recompute each decoder layer in backward instead of storing its activations.
    activation_checkpointing: bool = False
    # Free each layer's gathered weights after its forward (less memory, one more all-gather).
    reshard_after_forward: bool = True
    # AdamW's two moments in pinned host memory, streamed through the GPU a chunk at a time
    # at each step (`host_adamw`): 8 bytes a trained parameter off the GPU, for twice their size
    # over the host link a step. For a model whose fp32 weights, gradients and moments do not
    # fit (an 8B model on one H200); `miles recipes plan` says when it is needed.
    optimizer_offload: bool = False
    # Each decoder layer's forward through `torch.compile` (Inductor fuses its elementwise work;
    # a step launches far fewer kernels): "auto" on CUDA for families that declare it
    # (`compile_layers`), eager for what Dynamo cannot trace; "on" everywhere, errors raised;
    # "off" never.
    compile: Switch = "auto"

    def __post_init__(self) -> None:
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.lr_schedule!r}")
        if self.total_steps < 0:
            raise ValueError(f"total_steps must be >= 0, got {self.total_steps}")
        if self.lr_schedule != "constant" and 0 < self.total_steps <= self.warmup_steps:
            raise ValueError(schedule_problem(self, self.total_steps))
        if self.packing not in PACKING:
            raise ValueError(f"packing must be one of {PACKING}, got {self.packing!r}")
        if self.compile not in COMPILE:
            raise ValueError(f"compile must be one of {COMPILE}, got {self.compile!r}")
        if self.ref_mode not in ("copy", "offload"):
            raise ValueError(f"ref_mode must be 'copy' or 'offload', got {self.ref_mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.micro_batch_tokens <= 0:
            raise ValueError(f"micro_batch_tokens must be positive, got {self.micro_batch_tokens}")
        if self.warmup_steps < 0 or not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError("warmup_steps must be >= 0 and min_lr_ratio in [0, 1]")
        if self.critic_lr is not None and self.critic_lr < 0:
            raise ValueError(f"critic_lr must be >= 0, got {self.critic_lr}")
        if len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers, got {self.betas!r}")
        self.betas = (float(self.betas[0]), float(self.betas[1]))  # YAML gives a list


def schedule_problem(config: FSDPConfig, total_steps: int) -> str:
    return (
        f"lr_schedule {config.lr_schedule!r} needs total_steps > warmup_steps, got "
        f"total_steps={total_steps}, warmup_steps={config.warmup_steps}"
    )
