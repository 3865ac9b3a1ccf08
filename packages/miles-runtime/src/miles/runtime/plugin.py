"""miles-runtime's plugin: `miles run` and `miles recipes plan` join the CLI."""

from __future__ import annotations

import click

from miles.core import hookimpl


@hookimpl
def miles_register_commands(cli: click.Group) -> None:
    from miles.runtime.commands import add_commands

    add_commands(cli)
