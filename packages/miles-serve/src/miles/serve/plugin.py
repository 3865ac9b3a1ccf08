"""miles-serve's plugin module: `miles serve` on the command line."""

from __future__ import annotations

import click

from miles.core import hookimpl


@hookimpl
def miles_register_commands(cli: click.Group) -> None:
    from miles.serve.command import serve

    cli.add_command(serve)
