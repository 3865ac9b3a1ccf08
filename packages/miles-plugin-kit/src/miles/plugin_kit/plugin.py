"""miles-plugin-kit's plugin module: it adds `new` and `check` to `miles plugins`."""

from __future__ import annotations

import click

from miles.core import hookimpl
from miles.plugin_kit.commands import plugins_check, plugins_new


@hookimpl
def miles_register_commands(cli: click.Group) -> None:
    plugins = cli.commands.get("plugins")
    if not isinstance(plugins, click.Group):
        raise TypeError("miles-plugin-kit adds to the `miles plugins` group, which is missing")
    plugins.add_command(plugins_new)
    plugins.add_command(plugins_check)
