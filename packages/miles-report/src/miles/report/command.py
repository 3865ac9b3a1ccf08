"""The `miles report` command (added to the `miles` command line by this package's plugin)."""

from __future__ import annotations

from pathlib import Path

import click

from miles.report.build import build_report
from miles.report.load import NotARunError


@click.command()
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option(
    "--out",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where to write the report (default: RUN_DIR/report).",
)
def report(run_dir: Path, out: Path | None) -> None:
    """Write an HTML report of a run (finished or still running): curves, a timeline of the
    actors, idle time and the slowest steps."""
    try:
        written = build_report(run_dir, out)
    except NotARunError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(str(written.page))
    for path in written.figures:
        click.echo(str(path))
