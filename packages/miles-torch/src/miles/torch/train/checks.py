"""What the `fsdp` backend checks in a run config before launch (its spec's `check`)."""

from __future__ import annotations

from pathlib import Path

from miles.core.config import RunConfig
from miles.torch.train.config import FSDPConfig, schedule_problem


def fsdp_run_checks(run: RunConfig, config: FSDPConfig) -> list[str]:
    problems = []
    total = config.total_steps or run.steps + run.warmstart.steps
    if config.lr_schedule != "constant" and total <= config.warmup_steps:
        problems.append(schedule_problem(config, total))
    if run.lora is not None:
        problems += _lora_target_problems(run.model.path, run.lora.targets)
    return problems


def _lora_target_problems(model_path: str, targets: list[str]) -> list[str]:
    """LoRA targets that match no linear module of the model (built on the meta device: no
    weights are read)."""
    if not model_path or not Path(model_path, "config.json").is_file():
        return []  # a hub id: the trainer checks when it loads
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    linear = sorted(
        {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    )
    unknown = [t for t in targets if t not in linear]
    if not unknown:
        return []
    return [
        f"lora.targets: {', '.join(map(repr, unknown))} match no linear module of "
        f"{type(model).__name__}; available: {', '.join(linear)}"
    ]
