"""The `fastbroker-chaos` command (also `python -m fastbroker.chaos`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fastbroker.chaos.checker import check
from fastbroker.chaos.history import HistoryError, read

EXIT_ANOMALIES = 1
EXIT_BAD_HISTORY = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """fastbroker's fault-injection suite."""


@main.command("check")
@click.argument("history", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def check_command(history: Path, as_json: bool) -> None:
    """Checks a HISTORY (JSON lines) for anomalies: prints one verdict line (and the first
    instances of each anomaly); exits 1 if there is any, 2 if the history cannot be read."""
    try:
        ops = read(history)
    except (HistoryError, OSError) as error:
        click.echo(f"fastbroker-chaos: {history}: {error}", err=True)
        raise SystemExit(EXIT_BAD_HISTORY) from None
    result = check(ops)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    else:
        for kind, details in result.details.items():
            for detail in details:
                click.echo(f"  {kind}: {detail}")
        click.echo(result.verdict())
    if not result.valid:
        raise SystemExit(EXIT_ANOMALIES)
