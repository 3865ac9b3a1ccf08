"""The ``miles`` command line.

These are the commands of a minimal install: plugins, components and recipes. Plugins add the
others through the ``miles_register_commands`` hook: `miles run` and `miles recipes plan` come
with miles-runtime, `miles serve` with miles-serve, `miles report` with miles-report.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import click

# Not a terminal (a pipe, a file, CI): no progress bars (ours, transformers', the hub's) glued
# into the log lines; `miles run` logs a plain `step` line instead. tqdm reads TQDM_* once, when
# it is imported, so this comes before anything imports it; the run's actors inherit it.
if not sys.stderr.isatty():
    os.environ.setdefault("TQDM_DISABLE", "1")

from miles.core import __version__
from miles.core.contracts.components import ComponentConflictError, ComponentNotFoundError, Kind
from miles.core.registry.plugins import PluginManager, get_plugin_manager
from miles.core.registry.validation import EMBEDDED_DEFAULTS


def plugin_manager(strict: bool = True) -> PluginManager:
    """The plugins; with `strict`, a name two distributions register is an error here."""
    manager = get_plugin_manager()
    if strict:
        try:
            manager.require_no_conflicts()
        except ComponentConflictError as exc:
            raise click.ClickException(str(exc)) from None
    return manager


class _MilesGroup(click.Group):
    """Built-in commands, then top-level commands a distribution names in the `miles.commands`
    entry-point group (loaded alone, by name: `miles run` imports no plugin before it has set up
    Ray), then those plugins add (`miles_register_commands`), which load only when a name is not
    found otherwise or the commands are listed. The top-level group, `miles plugins` (where
    miles-plugin-kit adds `new` and `check`) and `miles recipes` are all of this class."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        if ctx.parent is None:
            for name in _named_commands():
                self.get_command(ctx, name)
        _add_plugin_commands()
        return super().list_commands(ctx)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = super().get_command(ctx, cmd_name)
        if command is None and ctx.parent is None and cmd_name in _named_commands():
            command = _named_commands()[cmd_name].load()
            self.add_command(command, cmd_name)
        if command is None:
            _add_plugin_commands()
            command = super().get_command(ctx, cmd_name)
        if command is None:
            name = f"{ctx.command_path.partition(' ')[2]} {cmd_name}".strip()
            if name in _COMMANDS_ELSEWHERE:
                raise click.UsageError(f"`miles {name}` {_COMMANDS_ELSEWHERE[name]}")
        return command


def _named_commands() -> dict[str, Any]:
    """The `miles.commands` entry points, by command name (not loaded)."""
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group="miles.commands")}


# Commands other distributions add, and what to install for them: said instead of click's
# "No such command" in a minimal install (`pip install miles-core` alone has no runtime).
_COMMANDS_ELSEWHERE = {
    "run": "comes with miles-runtime, which the default backends bring: "
    f"pip install {EMBEDDED_DEFAULTS}",
    "recipes plan": "comes with miles-runtime (the memory planner): pip install miles-runtime",
    "serve": "comes with miles-serve: pip install miles-serve",
    "report": "comes with miles-report: pip install miles-report",
}


_commands_added_by: PluginManager | None = None


def _add_plugin_commands() -> None:
    """Lets the plugins add their commands to `cli`, once per process-wide plugin manager."""
    global _commands_added_by
    manager = get_plugin_manager()
    if manager is not _commands_added_by:
        _commands_added_by = manager
        manager.pm.hook.miles_register_commands(cli=cli)


@click.group(cls=_MilesGroup, context_settings={"help_option_names": ["-h", "--help"]})
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
    from miles.core.observability.logsetup import configure_logging

    ctx.ensure_object(dict)
    ctx.obj["log_format"], ctx.obj["log_level"] = log_format, log_level
    configure_logging(log_format, log_level)  # type: ignore[arg-type]


# ── plugins ──────────────────────────────────────────────────────────────────────────────────────


@cli.group(cls=_MilesGroup)
def plugins() -> None:
    """Installed plugin distributions.

    For plugin authors, `pip install miles-plugin-kit` adds `new` (scaffold a package to publish)
    and `check` (conformance checks).
    """


@plugins.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def plugins_list(as_json: bool) -> None:
    """Every distribution in the `miles` entry-point group, its status and components."""
    manager = plugin_manager(strict=False)
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
        print_table(rows)
    for conflict in manager.conflicts:
        click.secho(f"error: {conflict}", fg="red", err=True)
    if manager.conflicts:
        sys.exit(1)


@plugins.command("show")
@click.argument("name")
def plugins_show(name: str) -> None:
    """Everything known about one plugin distribution."""
    from packaging.utils import canonicalize_name

    manager = plugin_manager(strict=False)
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


def _lookup(manager: PluginManager, kind: str, name: str) -> Any:
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
    """Every registered component: kind, name, providing distribution, summary (and, with
    --json, its capabilities)."""
    if kind is not None and kind not in {k.value for k in Kind}:
        raise click.BadParameter(
            f"unknown kind {kind!r}; choose from {', '.join(k.value for k in Kind)}",
            param_hint="--kind",
        )
    manager = plugin_manager()
    items = [c for c in manager.registry.all() if kind is None or c.kind == kind]
    if as_json:
        data = [
            {
                "kind": str(c.kind),
                "name": c.name,
                "distribution": c.distribution,
                "version": c.version,
                "summary": c.spec.summary,
                "capabilities": sorted(c.spec.capabilities),
            }
            for c in items
        ]
        click.echo(json.dumps(data, indent=2))
        return
    rows = [("KIND", "NAME", "PROVIDED BY", "SUMMARY")]
    rows += [(str(c.kind), c.name, c.provider, c.spec.summary) for c in items]
    print_table(rows)


# ── recipes ──────────────────────────────────────────────────────────────────────────────────────


@cli.group(cls=_MilesGroup)
def recipes() -> None:
    """Ready-to-run recipes: list them, show their config, plan their memory."""


@recipes.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list instead of a table.")
def recipes_list(as_json: bool) -> None:
    """Every installed recipe: its model, where it runs, and whether `miles run` would start it
    here (everything it needs installed and supported in this release); if not, why."""
    from miles.core.contracts.recipe import describe
    from miles.core.registry.validation import recipe_problems

    manager = plugin_manager()
    items = [describe(c, recipe_problems) for c in manager.registry.all() if c.kind == Kind.RECIPE]
    if as_json:
        click.echo(json.dumps(items, indent=2))
        return
    rows = [("NAME", "MODEL", "RUNS ON", "READY", "PROVIDED BY", "SUMMARY")]
    rows += [
        (i["name"], i["model"], i["runs_on"], "no" if i["problems"] else "yes",
         i["provided_by"], i["summary"])
        for i in items
    ]  # fmt: skip
    print_table(rows)
    blocked = [i for i in items if i["problems"]]
    if blocked:
        click.echo("\nnot ready here (miles run would stop before launch):")
        for item in blocked:
            first, more = item["problems"][0], len(item["problems"]) - 1
            extra = f" (+{more} more: miles run {item['name']} lists them)" if more else ""
            click.echo(f"  {item['name']}: {first}{extra}")


@recipes.command("show")
@click.argument("name")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a key.")
def recipes_show(name: str, overrides: tuple[str, ...]) -> None:
    """Print a recipe's resolved config (every default filled in) as YAML."""
    from miles.core.contracts.recipe import resolved_yaml

    click.echo(resolved_yaml(load_recipe(name), list(overrides)), nl=False)


def load_recipe(name: str) -> Any:
    """The recipe registered as `name`, made; a click error naming the installed ones if none."""
    return _lookup(plugin_manager(), Kind.RECIPE, name).spec.factory()


def print_table(rows: Sequence[tuple[str, ...]]) -> None:
    """Left-aligned columns, the last one free."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths, strict=False)] + [r[-1]]
        click.echo("  ".join(cells).rstrip())


def main() -> None:
    cli(obj={})


if __name__ == "__main__":
    main()
