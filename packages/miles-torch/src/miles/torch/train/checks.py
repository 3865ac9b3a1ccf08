"""What the `fsdp` backend checks in a run config before launch (its spec's `check`)."""

from __future__ import annotations

from pathlib import Path

from miles.core.config import RunConfig
from miles.core.contracts.family import ModelFamily
from miles.core.registry.families import family_of_config, read_config
from miles.torch.train.config import FSDPConfig, schedule_problem


def fsdp_run_checks(run: RunConfig, config: FSDPConfig) -> list[str]:
    problems = []
    total = config.total_steps or run.steps + run.warmstart.steps
    if config.lr_schedule != "constant" and total <= config.warmup_steps:
        problems.append(schedule_problem(config, total))
    if run.lora is not None:
        problems += _lora_target_problems(run.model.path, run.lora.targets)
    try:
        packs_sequences(config.packing, run.model.path)
    except ValueError as e:
        problems.append(str(e))
    return problems


def packs_sequences(packing: str, model_path: str) -> bool:
    """Whether micro-batches are packed (`FSDPConfig.packing`), by what the checkpoint's model
    family declares (`packed_sequences`). ValueError when "on" cannot be kept."""
    if packing == "off":
        return False
    family = family_of_checkpoint(model_path)
    can = family is not None and family.packed_sequences
    if packing == "on" and not can:
        which = "no installed model family" if family is None else f"model family {family.name!r}"
        raise ValueError(
            f"train.packing: 'on', but {which} of {model_path} declares packed sequences; "
            "use train.packing: auto (packs where it can) or off"
        )
    return can


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


def family_of_checkpoint(model_path: str) -> ModelFamily | None:
    """The installed family of a local checkpoint's config.json (None: none, or a hub id)."""
    config = read_config(model_path)
    return family_of_config(config) if config is not None else None
