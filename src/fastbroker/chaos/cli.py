"""The `fastbroker-chaos` command (also `python -m fastbroker.chaos`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from fastbroker.chaos.checker import Result, check
from fastbroker.chaos.history import HistoryError, read
from fastbroker.chaos.recovery import table
from fastbroker.chaos.runner import FAULTS, KNOWN_FAULTS

EXIT_ANOMALIES = 1
EXIT_BAD_HISTORY = 2
EXIT_CANNOT_RUN = 3


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
    report(check(ops), as_json)


@main.command("run")
@click.option("--nodes", type=click.IntRange(3, 9), default=3, show_default=True)
@click.option("--seconds", type=click.FloatRange(5, 3600), default=40.0, show_default=True)
@click.option("--seed", type=int, default=1, show_default=True, help="Replays a schedule.")
@click.option(
    "--rate",
    type=click.FloatRange(1, 1000),
    default=20.0,
    show_default=True,
    help="Publishes per second per publisher.",
)
@click.option(
    "--faults",
    default=",".join(FAULTS),
    show_default=True,
    help="The kinds of fault the nemesis picks from, comma-separated (also: bridge, "
    "bridge_long: partial splits).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    required=True,
    help="Where the nodes' data, logs and history.jsonl go.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def run_command(
    nodes: int, seconds: float, seed: int, rate: float, faults: str, workdir: Path, as_json: bool
) -> None:
    """Runs a seeded schedule against a cluster of NODES real nodes in network namespaces
    behind HAProxy (kills, stops, pauses, splits, leaves and full disks, one at a time, and
    partial splits if named; needs root, haproxy, nftables), records the history in
    WORKDIR/history.jsonl and checks it."""
    from fastbroker.chaos.front import Front
    from fastbroker.chaos.network import Network
    from fastbroker.chaos.runner import Run, Schedule, clients_unavailable

    kinds = tuple(f.strip() for f in faults.split(",") if f.strip())
    unknown = sorted(set(kinds) - set(KNOWN_FAULTS))
    if unknown or not kinds:
        known = ", ".join(KNOWN_FAULTS)
        raise click.BadParameter(f"unknown: {', '.join(unknown)} (known: {known})")
    # One line, not a traceback, when this machine cannot run it.
    missing = clients_unavailable() or Network.unavailable() or Front.unavailable()
    if missing:
        click.echo(f"fastbroker-chaos: cannot run: {missing}", err=True)
        raise SystemExit(EXIT_CANNOT_RUN)
    schedule = Schedule(nodes=nodes, seconds=seconds, seed=seed, rate=rate, faults=kinds)
    run = Run(schedule, workdir)
    result = run.execute()
    click.echo(f"faults injected: {run.faults}; history: {run.history}")
    report(result, as_json)


def report(result: Result, as_json: bool) -> None:
    """Prints the result (how long each fault hurt, the first instances of each anomaly,
    then the verdict line) and exits 1 if it is not valid."""
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2, sort_keys=True))
    else:
        for line in table(result.recovery):
            click.echo(line)
        for kind, details in result.details.items():
            for detail in details:
                click.echo(f"  {kind}: {detail}")
        click.echo(result.verdict())
    if not result.valid:
        raise SystemExit(EXIT_ANOMALIES)
