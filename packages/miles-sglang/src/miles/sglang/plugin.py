"""miles-sglang's plugin module: it adds `miles serve` to the command line."""

from __future__ import annotations

import click

from miles.core import hookimpl
from miles.sglang.command import serve


@hookimpl
def miles_register_commands(cli: click.Group) -> None:
    cli.add_command(serve)
