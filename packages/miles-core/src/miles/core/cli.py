"""The ``miles`` command line.

Heavy modules (torch, ray, transformers, the OpenTelemetry SDK) are imported inside the commands
that need them, so ``miles --help`` stays fast.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from miles.core import __version__


def _manager(strict: bool = True) -> Any:
    from miles.core.components import ComponentConflictError
    from miles.core.plugins import PluginManager

    try:
        return PluginManager().load(strict=strict)
    except ComponentConflictError as exc:
        raise click.ClickException(str(exc)) from None


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="miles")
@click.option(
    "--log-format",
    type=click.Choice(["auto", "console", "json"]),
    default="auto",
    show_default=True,
    help="Human-readable on a TTY and JSON lines otherwise, unless forced.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False),
    default="info",
    show_default=True,
)
@click.pass_context
def cli(ctx: click.Context, log_format: str, log_level: str) -> None:
    """Miles: PyTorch-native RL post-training for large language models."""
    from miles.core.logsetup import configure_logging

    ctx.ensure_object(dict)
    ctx.obj["log_format"], ctx.obj["log_level"] = log_format, log_level
    configure_logging(log_format, log_level)  # type: ignore[arg-type]


# ── plugins ──────────────────────────────────────────────────────────────────────────────────────


@cli.group()
def plugins() -> None:
    """Installed plugin distributions."""


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def plugins_list(as_json: bool) -> None:
    """Every distribution in the `miles` entry-point group, its status and components."""
    manager = _manager(strict=False)
    records = list(manager.records.values())
    if as_json:
        click.echo(json.dumps([r.to_json() for r in records], indent=2))
    else:
        rows = [("NAME", "VERSION", "STATUS", "COMPONENTS")]
        for r in records:
            kinds = [f"{kind}: {', '.join(names)}" for kind, names in r.components.items()]
            detail = kinds or ([r.error] if r.error else ["-"])
            rows.append((r.name, r.version, r.status, detail[0]))
            rows.extend(("", "", "", line) for line in detail[1:])
        _print_table(rows)
    for conflict in manager.conflicts:
        click.secho(f"error: {conflict}", fg="red", err=True)
    if manager.conflicts:
        sys.exit(1)


@plugins.command("show")
@click.argument("name")
def plugins_show(name: str) -> None:
    """Everything known about one plugin distribution."""
    from packaging.utils import canonicalize_name

    manager = _manager(strict=False)
    record = manager.records.get(canonicalize_name(name))
    if record is None:
        import difflib

        close = difflib.get_close_matches(canonicalize_name(name), list(manager.records), n=3)
        hint = f" Did you mean: {', '.join(close)}?" if close else ""
        raise click.ClickException(f"no plugin distribution named {name!r}.{hint}")
    data = record.to_json()
    for key in ("name", "version", "status", "error", "core_range"):
        click.echo(f"{key + ':':<12}{data[key] if data[key] is not None else '-'}")
    click.echo("entry points:")
    for ep in record.entry_points:
        click.echo(f"  {ep}")
    click.echo("hooks:")
    for hook in record.hooks:
        click.echo(f"  {hook}")
    click.echo("components:")
    for kind, names in record.components.items():
        for component_name in names:
            summary = manager.registry.get(kind, component_name).spec.summary
            click.echo(f"  {kind}/{component_name}: {summary}")


@plugins.command("new")
@click.argument("kind", type=click.Choice(["reward"]))
@click.argument("name")
@click.option(
    "--dir",
    "dest",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to write the package (default: ./miles-reward-NAME).",
)
def plugins_new(kind: str, name: str, dest: Path | None) -> None:
    """Scaffold a ready-to-publish plugin package: `miles plugins new reward NAME`.

    NAME is the reward's name, e.g. math-verify: the package is miles-reward-math-verify, the
    module miles_reward_math_verify, and run configs use `reward: {name: math_verify}`.
    """
    from miles.core.scaffold import RewardNames, ScaffoldError, scaffold_reward

    try:
        RewardNames.parse(name)  # a bad NAME fails before plugins load, which takes a while
        taken = [c.name for c in _manager(strict=False).registry.all() if c.kind == kind]
        names, path = scaffold_reward(name, dest, taken=taken)
    except ScaffoldError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"created {names.dist} in {path} (reward {names.reward!r})")
    click.echo("next:")
    click.echo(f"  cd {path}")
    click.echo('  pip install -e ".[test]"')
    click.echo(f"  pytest && miles plugins check {names.dist}")
    click.echo("  see docs/publish-a-reward.md to build and upload it")


@plugins.command("check")
@click.argument("name")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of check results.")
@click.option(
    "--timeout",
    type=float,
    default=10.0,
    show_default=True,
    help="Seconds one reward call may take.",
)
def plugins_check(name: str, as_json: bool, timeout: float) -> None:
    """Conformance checks on the rewards of a distribution, or on one `reward/NAME`.

    Each reward is built with its default config and must return finite floats within its
    declared reward_range on ordinary, empty and garbage responses, pickle for Ray, and be
    deterministic if it says so. Exits 1 if any check fails.
    """
    from dataclasses import asdict

    from packaging.utils import canonicalize_name

    from miles.core.conformance import check_reward, format_results

    manager = _manager(strict=False)
    kind, sep, component = name.partition("/")
    if sep:
        if kind != "reward":
            raise click.ClickException(f"only rewards can be checked, not {kind!r} components")
        targets = [_lookup(manager, "reward", component)]
        label = f"reward {component!r}"
    else:
        record = manager.records.get(canonicalize_name(name))
        if record is None:
            import difflib

            close = difflib.get_close_matches(canonicalize_name(name), list(manager.records), n=3)
            hint = f" Did you mean: {', '.join(close)}?" if close else ""
            raise click.ClickException(f"no plugin distribution named {name!r}.{hint}")
        if record.status != "ok":
            raise click.ClickException(f"{record.name} is {record.status}: {record.error}")
        rewards = record.components.get("reward", [])
        if not rewards:
            provides = ", ".join(f"{k}: {', '.join(v)}" for k, v in record.components.items())
            raise click.ClickException(
                f"{record.name} provides no reward to check (it provides: {provides or 'nothing'})"
            )
        targets = [_lookup(manager, "reward", r) for r in rewards]
        label = f"{record.name} {record.version}"
    results = [r for target in targets for r in check_reward(target, timeout=timeout)]
    failed = [r for r in results if not r.passed]
    if as_json:
        click.echo(json.dumps([{**asdict(r), "passed": r.passed} for r in results], indent=2))
    else:
        click.echo(format_results(results))
        click.echo()
        for r in failed:
            click.secho(f"FAIL {r.message}", fg="red")
        verdict = (
            f"{len(failed)} of {len(results)} checks failed" if failed else "all checks passed"
        )
        click.echo(f"{label}: {verdict}")
    if failed:
        sys.exit(1)


def _lookup(manager: Any, kind: str, name: str) -> Any:
    from miles.core.components import ComponentNotFoundError

    try:
        return manager.get(kind, name)
    except (ComponentNotFoundError, LookupError) as exc:
        raise click.ClickException(str(exc.args[0] if exc.args else exc)) from None


# ── components ───────────────────────────────────────────────────────────────────────────────────


@cli.group()
def components() -> None:
    """Registered components (rewards, losses, backends, ...)."""


@components.command("list")
@click.option("--kind", "kind", default=None, help="Only this kind, e.g. reward or loss.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def components_list(kind: str | None, as_json: bool) -> None:
    """Every registered component: kind, name, providing distribution, summary."""
    from miles.core.components import Kind

    if kind is not None and kind not in {k.value for k in Kind}:
        raise click.BadParameter(
            f"unknown kind {kind!r}; choose from {', '.join(k.value for k in Kind)}",
            param_hint="--kind",
        )
    manager = _manager()
    items = [c for c in manager.registry.all() if kind is None or c.kind == kind]
    if as_json:
        data = [
            {
                "kind": str(c.kind),
                "name": c.name,
                "distribution": c.distribution,
                "version": c.version,
                "summary": c.spec.summary,
            }
            for c in items
        ]
        click.echo(json.dumps(data, indent=2))
        return
    rows = [("KIND", "NAME", "PROVIDED BY", "SUMMARY")]
    rows += [(str(c.kind), c.name, c.provider, c.spec.summary) for c in items]
    _print_table(rows)


# ── recipes ──────────────────────────────────────────────────────────────────────────────────────


@cli.group()
def recipes() -> None:
    """Ready-to-run recipes: list them, show their config, plan their memory."""


@recipes.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def recipes_list(as_json: bool) -> None:
    """Every installed recipe, with its model and layout."""
    from miles.core.components import Kind
    from miles.core.recipe import describe

    manager = _manager()
    items = [describe(c) for c in manager.registry.all() if c.kind == Kind.RECIPE]
    if as_json:
        click.echo(json.dumps(items, indent=2))
        return
    rows = [("NAME", "MODEL", "GPUS", "PROVIDED BY", "SUMMARY")]
    rows += [(i["name"], i["model"], str(i["gpus"]), i["provided_by"], i["summary"]) for i in items]
    _print_table(rows)


@recipes.command("show")
@click.argument("name")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a key.")
def recipes_show(name: str, overrides: tuple[str, ...]) -> None:
    """Print a recipe's resolved config (every default filled in) as YAML."""
    from miles.core.recipe import resolved_yaml

    click.echo(resolved_yaml(_load_recipe(name), list(overrides)), nl=False)


@recipes.command("plan")
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
    from miles.core.planner import PlanError, format_plan, parse_memory, plan

    recipe = None
    try:
        if target.endswith((".yaml", ".yml")) or Path(target).is_file():
            data = load_yaml(target)
        else:
            recipe = _load_recipe(target)
            data = dict(recipe.config)
        config = parse(apply_overrides(data, list(overrides)))
        if not config.model.path and "model.path" in getattr(recipe, "prepares", ()):
            raise PlanError(
                f"recipe {target!r} makes its model when it runs (a tiny twin on CPU), so there "
                "is nothing to plan before; plan a run of it: miles recipes plan "
                "RUN_DIR/config.yaml"
            )
        mem = parse_memory(gpu_mem) if gpu_mem else None
        if gpus is not None and gpus < 1:
            raise PlanError("--gpus must be at least 1")
        result = plan(config, _manager(), gpus=gpus, gpu_mem_gb=mem)
    except (ConfigError, PlanError) as exc:
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


def _load_recipe(name: str) -> Any:
    from miles.core.components import Kind

    return _lookup(_manager(), Kind.RECIPE, name).spec.factory()


# ── run ──────────────────────────────────────────────────────────────────────────────────────────


@cli.command()
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
    """Run RL post-training from CONFIG.yaml or a recipe name (see `miles components list --kind recipe`)."""
    from miles.core.runner import RunRequest, run_from_cli

    if target is None and not resume:
        raise click.UsageError("give a CONFIG.yaml or a recipe name (or --resume --run-dir DIR)")
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


# ── report ───────────────────────────────────────────────────────────────────────────────────────


@cli.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to write the report (default: RUN_DIR/report).",
)
def report(run_dir: Path, out: Path | None) -> None:
    """Write an HTML report of a run (finished or still running): curves, a timeline of the
    actors, idle time and the slowest steps. Needs matplotlib: pip install 'miles-core[report]'."""
    from miles.core.report import MissingDependencyError, NotARunError, build_report

    try:
        written = build_report(run_dir, out)
    except (NotARunError, MissingDependencyError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(str(written.page))
    for path in written.figures:
        click.echo(str(path))


def _print_table(rows: Sequence[tuple[str, ...]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths, strict=False)] + [r[-1]]
        click.echo("  ".join(cells).rstrip())


def main() -> None:
    cli(obj={})


if __name__ == "__main__":
    main()
