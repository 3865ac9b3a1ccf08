"""miles-report's plugin module: it adds `miles report` to the command line."""

from __future__ import annotations

import click

from miles.core import hookimpl
from miles.report.command import report


@hookimpl
def miles_register_commands(cli: click.Group) -> None:
    cli.add_command(report)
