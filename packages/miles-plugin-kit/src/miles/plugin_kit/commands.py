"""`miles plugins new` and `miles plugins check`.

Loading plugins imports this module (`miles --help` does), so it imports nothing the plugin
manager has not: the scaffolder and the checks are imported inside the commands that use them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from miles.core.contracts.components import ComponentNotFoundError
from miles.core.registry.plugins import PluginManager, get_plugin_manager


def _lookup(manager: PluginManager, kind: str, name: str) -> Any:
    try:
        return manager.get(kind, name)
    except (ComponentNotFoundError, LookupError) as exc:
        raise click.ClickException(str(exc.args[0] if exc.args else exc)) from None


@click.command("new")
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
    from miles.plugin_kit.scaffold import RewardNames, ScaffoldError, scaffold_reward

    try:
        RewardNames.parse(name)  # a bad NAME fails before plugins load, which takes a while
        taken = [c.name for c in get_plugin_manager().registry.all() if c.kind == kind]
        names, path = scaffold_reward(name, dest, taken=taken)
    except ScaffoldError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"created {names.dist} in {path} (reward {names.reward!r})")
    click.echo("next:")
    click.echo(f"  cd {path}")
    click.echo('  pip install -e ".[test]"')
    click.echo(f"  pytest && miles plugins check {names.dist}")
    click.echo("  see docs/publish-a-reward.md to build and upload it")


@click.command("check")
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

    from miles.plugin_kit.conformance import check_reward, format_results

    manager = get_plugin_manager()
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
