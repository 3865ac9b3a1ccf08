"""`miles run` and `miles recipes plan`: the commands that need the runtime. `run` is found by name
through the `miles.commands` entry point (so no other plugin is imported before it sets up Ray);
`plan` joins `miles recipes` through this package's plugin (`miles_register_commands`). Ray and
the planner load inside them, so `miles --help` stays fast."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from miles.core.cli import load_recipe, plugin_manager


def add_commands(cli: click.Group) -> None:
    """`plan` under `recipes` (`run` is the `miles.commands` entry point's)."""
    recipes = cli.commands["recipes"]
    assert isinstance(recipes, click.Group)
    recipes.add_command(recipes_plan)


@click.command()
@click.argument("target", required=False)
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="KEY=VALUE",
    help="Override any config key, e.g. --set steps=20 --set rollout.temperature=0.8.",
)
@click.option(
    "--run-dir",
    type=click.Path(path_type=Path),
    default=None,
    help="Where the run writes its files (default: runs/NAME-TIMESTAMP).",
)
@click.option(
    "--resume", is_flag=True, help="Continue the run in --run-dir from its last checkpoint."
)
@click.option("--ray-address", default=None, help="Join this Ray cluster instead of starting one.")
@click.pass_context
def run(
    ctx: click.Context,
    target: str | None,
    overrides: tuple[str, ...],
    run_dir: Path | None,
    resume: bool,
    ray_address: str | None,
) -> None:
    """Run RL post-training from CONFIG.yaml or a recipe name (see `miles recipes list`)."""
    if target is None and not resume:
        raise click.UsageError("give a CONFIG.yaml or a recipe name (or --resume --run-dir DIR)")
    if not ray_address:
        # The local Ray this run starts requires Ray's auth token on every connection. Ray reads
        # the mode once, on import: set it before anything imports ray.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from miles.runtime.runner import RunRequest, run_from_cli

    request = RunRequest(
        target=target or "",
        overrides=list(overrides),
        run_dir=run_dir,
        resume=resume,
        ray_address=ray_address,
        log_format=ctx.obj["log_format"],
        log_level=ctx.obj["log_level"],
    )
    sys.exit(run_from_cli(request))


@click.command("plan")
@click.argument("target")
@click.option("--gpus", type=int, default=None, help="Re-lay the recipe out on this many GPUs.")
@click.option("--gpu-mem", default=None, help="Memory of one GPU, e.g. 141GB or 80GiB.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a key.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def recipes_plan(
    target: str, gpus: int | None, gpu_mem: str | None, overrides: tuple[str, ...], as_json: bool
) -> None:
    """Per-GPU memory of a recipe (or CONFIG.yaml): weights, gradients, optimizer state,
    activations and KV cache. Exits 1 when it does not fit in --gpu-mem."""
    from miles.core.config import ConfigError, apply_overrides, load_yaml, parse
    from miles.runtime.planning.gpu_memory import MemoryParseError, parse_memory
    from miles.runtime.planning.plan_table import format_plan
    from miles.runtime.planning.planner import PlanError, plan

    recipe = None
    try:
        if target.endswith((".yaml", ".yml")) or Path(target).is_file():
            data = load_yaml(target)
        else:
            recipe = load_recipe(target)
            data = dict(recipe.config)
        config = parse(apply_overrides(data, list(overrides)))
        hf_config = None
        if recipe is not None and not config.model.path and "model.path" in recipe.prepares:
            hf_config = _made_model_config(recipe, config)
        mem = parse_memory(gpu_mem) if gpu_mem else None
        if gpus is not None and gpus < 1:
            raise PlanError("--gpus must be at least 1")
        plugin_manager()
        result = plan(config, gpus=gpus, gpu_mem_gb=mem, hf_config=hf_config)
    except (ConfigError, PlanError, MemoryParseError) as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        click.echo(format_plan(result))
        if gpus is not None:
            layout = result.layout
            click.echo(
                f"to run this layout: --set train.world_size={layout.train_gpus} "
                f"--set rollout.engines={layout.engines}"
            )
    if result.fits is False:
        sys.exit(1)


def _made_model_config(recipe: Any, config: Any) -> dict[str, Any]:
    """The config.json of the model a recipe makes at run time: as the recipe says it, or else
    read from the model its `prepare` makes in a temporary directory (then deleted)."""
    import tempfile

    from miles.core.registry.families import read_config

    if recipe.model_config is not None:
        return dict(recipe.model_config(config))
    with tempfile.TemporaryDirectory(prefix="miles-plan-") as assets:
        made = recipe.prepare(Path(assets), config)
        found = read_config(str(made.get("model.path", "")))
    if found is None:
        raise click.ClickException("the recipe's prepare made no model with a config.json")
    return found
