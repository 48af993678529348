"""The `fastbroker` command."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NoReturn

import click

from fastbroker import __version__
from fastbroker.config import LOG_LEVELS, ConfigError, load_config

EXIT_STARTUP_ERROR = 1
EXIT_CONFIG_ERROR = 2


def fail(message: str, exit_code: int) -> NoReturn:
    click.echo(f"fastbroker: {message}", err=True)
    raise SystemExit(exit_code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="fastbroker")
def main() -> None:
    """fastbroker: a performance-first MQTT broker."""


@main.command()
@click.option("--host", help="Address to listen on (overrides [listener] host).")
@click.option("--port", type=click.IntRange(0, 65535), help="TCP port (overrides [listener] port).")
@click.option(
    "--config",
    "config_path",
    # Not exists=True: a missing file gets the same one-line error as any other bad config.
    type=click.Path(dir_okay=False, path_type=Path),
    help="TOML config file (see fastbroker.example.toml).",
)
@click.option(
    "--log-level",
    type=click.Choice(LOG_LEVELS, case_sensitive=False),
    help="Log level (overrides [log] level).",
)
@click.option(
    "--data-dir",
    type=click.Path(file_okay=False, path_type=Path),
    help="Data directory, created if missing (overrides [storage] data_dir).",
)
def run(
    host: str | None,
    port: int | None,
    config_path: Path | None,
    log_level: str | None,
    data_dir: Path | None,
) -> None:
    """Run the broker until SIGTERM or SIGINT."""
    overrides: dict[str, dict[str, Any]] = {
        "listener": {"host": host, "port": port},
        "log": {"level": log_level},
        "storage": {"data_dir": str(data_dir) if data_dir is not None else None},
    }
    try:
        config = load_config(config_path, overrides)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG_ERROR)

    try:
        # Imported here so that config errors and --help work without loading the engine.
        from fastbroker import server
    except ImportError as error:
        fail(f"cannot load the broker: {error}", EXIT_STARTUP_ERROR)

    try:
        server.run(config)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG_ERROR)
    except server.StartupError as error:
        fail(str(error), EXIT_STARTUP_ERROR)
    except KeyboardInterrupt:
        # SIGINT before the signal handlers are installed: nothing to clean up yet.
        pass
