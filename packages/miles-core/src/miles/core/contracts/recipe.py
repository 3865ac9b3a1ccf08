"""What a recipe component returns: a config, and optionally a step that makes local assets."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from miles.core.config import ComponentRef, ConfigError, RunConfig, apply_overrides, parse
from miles.core.contracts.components import Component, Kind
from miles.core.contracts.memory import layout_of
from miles.core.registry.factory import options_with_defaults


@dataclass
class Recipe:
    """A ready-to-run config.

    `prepare(assets_dir, config)` may build what the config points at (a tiny model, generated
    data) and returns dotted-key overrides such as ``{"model.path": ...}``; `prepares` names those
    keys. It must be idempotent: a resumed run calls it again on the same directory. `requires`
    says which package provides a component the recipe names that may not be installed (e.g.
    ``{"megatron": "the miles-megatron package"}``), for the error a user sees without it.
    `model_config(config)` is the config.json of the model `prepare` makes, so a recipe whose
    model is made at run time can be planned before it is made. `runs_on` is where the recipe is
    sized to run: "cpu" (a laptop) or "gpu" (the GPUs its layout takes).
    """

    config: dict[str, Any]
    prepare: Callable[[Path, RunConfig], dict[str, Any]] | None = None
    description: str = ""
    prepares: tuple[str, ...] = ()
    requires: dict[str, str] = field(default_factory=dict)
    model_config: Callable[[RunConfig], dict[str, Any]] | None = None
    runs_on: Literal["cpu", "gpu"] = "gpu"
    # Lines the run's final summary adds for this config: what a setting costs on this recipe
    # and what to change (e.g. LoRA on a model with random weights).
    summary_notes: Callable[[RunConfig], list[str]] | None = None


def describe(
    component: Component, problems: Callable[[Recipe], list[str]] | None = None
) -> dict[str, Any]:
    """A recipe's row in `miles recipes list`: its model, where it runs (a CPU, or the GPUs its
    layout takes) and, given `problems` (what would stop `miles run` before launch), whether it
    can run here and why not."""
    recipe: Recipe = component.spec.factory()
    model = recipe.config.get("model", {}).get("path") or "(made at run time)"
    try:
        gpus: int | str = layout_of(parse(dict(recipe.config))).total_gpus
    except ConfigError:
        gpus = "?"
    row: dict[str, Any] = {
        "name": component.name,
        "model": model,
        "runs_on": "CPU" if recipe.runs_on == "cpu" else f"{gpus} GPU" + ("" if gpus == 1 else "s"),
        "gpus": gpus,
        "provided_by": component.provider,
        "summary": component.spec.summary,
    }
    if problems is not None:
        row["problems"] = problems(recipe)
    return row


def resolved_yaml(recipe: Recipe, overrides: list[str]) -> str:
    """The recipe's config with every default filled in, as YAML (what `miles run` would save,
    before the recipe's own `prepare` fills in what it makes)."""
    config = with_defaults(parse(apply_overrides(dict(recipe.config), overrides)))
    text = yaml.safe_dump(config.to_dict(), sort_keys=False)
    if recipe.prepares:
        made = ", ".join(recipe.prepares)
        text = f"# made by the recipe at run time (in RUN_DIR/assets): {made}\n" + text
    return text


def with_defaults(config: RunConfig) -> RunConfig:
    """`config` with each named component's options completed by the defaults of its own config
    section (left as they are for a component not installed here). Backend options stay as
    given: the run derives some of them (the engine dtype from `precision`), so pinning their
    defaults here would override that."""

    def fill(kind: Kind, ref: ComponentRef | None) -> Any:
        if ref is None:
            return None
        return dataclasses.replace(ref, options=options_with_defaults(kind, ref.name, ref.options))

    algo = config.algorithm
    return dataclasses.replace(
        config,
        rollout=dataclasses.replace(
            config.rollout, function=fill(Kind.ROLLOUT_FUNCTION, config.rollout.function)
        ),
        reward=fill(Kind.REWARD, config.reward),
        filters=[fill(Kind.FILTER, f) for f in config.filters],
        algorithm=dataclasses.replace(
            algo,
            advantage=fill(Kind.ADVANTAGE, algo.advantage),
            loss=fill(Kind.LOSS, algo.loss),
            correction=fill(Kind.CORRECTION, algo.correction),
            value_loss=fill(Kind.LOSS, algo.value_loss),
        ),
        precision=fill(Kind.PRECISION, config.precision),
    )
