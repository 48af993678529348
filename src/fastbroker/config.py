"""fastbroker's TOML configuration: parsing, validation and defaults.

Every problem becomes a ConfigError whose message is one line naming the file and the key, so
a bad config fails before the engine starts. See fastbroker.example.toml for every key.
"""

from __future__ import annotations

import math
import reprlib
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import fastbroker_core

from fastbroker.store import FSYNC_INTERVAL_MS_MAX, FSYNC_INTERVAL_MS_MIN, FSYNC_POLICIES

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

U16_MAX = 65_535
# Nothing sensible is bigger; bounds the values handed to the engine's unsigned integers.
U63_MAX = 2**63 - 1


class ConfigError(Exception):
    """A configuration problem, described in one line."""


@dataclass(frozen=True)
class ListenerConfig:
    host: str = "127.0.0.1"
    port: int = 1883
    # Per-connection transport buffer above which the engine is told to stop writing to it.
    write_buffer_high: int = 262_144


@dataclass(frozen=True)
class StorageConfig:
    data_dir: str = "./fastbroker-data"
    # When the store's writes reach the disk (fastbroker.store): "always" before each write
    # returns, "interval" every fsync_interval_ms, "never" when the OS decides.
    fsync: str = "interval"
    fsync_interval_ms: int = 10
    # Stored values (messages, retained payloads) above this many bytes are zstd-compressed;
    # 0 = never.
    compress_above: int = 4096


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"


@dataclass(frozen=True)
class SysConfig:
    # Seconds between $SYS updates; 0 disables $SYS topics.
    interval: float = 10


@dataclass(frozen=True)
class ClusterConfig:
    # Empty: a standalone broker. Set: this node's id in the cluster, stable across restarts.
    node_id: str = ""
    # Address other nodes connect to ("host:port"); advertise is what they are told to dial
    # (defaults to listen, which must then not be a wildcard address).
    listen: str = "127.0.0.1:7883"
    advertise: str = ""
    # Nodes only link with nodes of the same name that hold the same secret.
    name: str = "fastbroker"
    secret: str = ""
    secret_file: str = ""
    # Static seeds, and/or one discovery provider spec (fastbroker.cluster.discovery).
    join: tuple[str, ...] = ()
    discovery: str = ""
    # A fresh node founds a new cluster only when this many fresh nodes (itself included)
    # see each other and none is in a cluster yet; the smallest node id founds it.
    bootstrap_expect: int = 1
    # Fixed when the cluster is founded; later values are ignored (the agreed ones win).
    partitions: int = 256
    replication_factor: int = 2
    heartbeat_ms: int = 150
    # Elections start after a random silence between this and twice this.
    election_timeout_ms: int = 1000
    # A member the leader has not heard from for this long is removed from the map.
    failure_timeout_ms: int = 5000
    discovery_interval_ms: int = 1000
    # Lets the admin endpoint cut links to chosen nodes (split tests); never in production.
    fault_injection: bool = False


@dataclass(frozen=True)
class AdminConfig:
    # HTTP admin endpoint (/cluster/status, /health); port 0 picks a free one. Unset: on for a
    # cluster node, off for a standalone broker (which has nothing to administer there yet).
    enabled: bool | None = None
    host: str = "127.0.0.1"
    port: int = 18830


@dataclass(frozen=True)
class Config:
    listener: ListenerConfig = field(default_factory=ListenerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sys: SysConfig = field(default_factory=SysConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    # Only the keys the file sets; the engine supplies the defaults of the rest.
    mqtt: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    # The file the config came from, or None for built-in defaults.
    source: str | None = None


# A check takes a TOML value and returns it (possibly normalized), or raises ValueError with
# what it expected.
Check = Callable[[Any], Any]


def integer(minimum: int, maximum: int) -> Check:
    def check(value: Any) -> int:
        # bool is an int subclass in Python, but `true` is no port number.
        if type(value) is not int or not minimum <= value <= maximum:
            raise ValueError(f"expected an integer from {minimum} to {maximum}")
        return value

    return check


def number(minimum: float) -> Check:
    def check(value: Any) -> float:
        if type(value) not in (int, float) or not minimum <= value < math.inf:
            raise ValueError(f"expected a finite number >= {minimum}")
        return float(value)

    return check


def nonempty_string(value: Any) -> str:
    if type(value) is not str or not value:
        raise ValueError("expected a non-empty string")
    return value


def host_name(value: Any) -> str:
    if type(value) is not str or not value or not value.isprintable() or " " in value:
        raise ValueError("expected a host name or IP address")
    return value


def one_of(*choices: str) -> Check:
    def check(value: Any) -> str:
        if type(value) is not str or value not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return value

    return check


def boolean(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError("expected true or false")
    return value


def node_id(value: Any) -> str:
    # Empty: a standalone broker.
    if (
        type(value) is not str
        or len(value) > 64
        or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in value)
    ):
        raise ValueError("expected 1-64 letters, digits, '-', '_' or '.' (empty: standalone)")
    return value


def any_string(value: Any) -> str:
    if type(value) is not str:
        raise ValueError("expected a string")
    return value


def address(*, allow_any_port: bool = False) -> Check:
    """HOST:PORT; port 0 only where we listen (allow_any_port)."""

    def check(value: Any) -> str:
        from fastbroker.cluster.transport import parse_address

        if type(value) is not str:
            raise ValueError("expected HOST:PORT")
        parse_address(value, allow_any_port=allow_any_port)
        return value

    return check


def optional_address(value: Any) -> str:
    return value if value == "" else address()(value)


def address_list(value: Any) -> tuple[str, ...]:
    from fastbroker.cluster.transport import parse_address

    # The command line gives one comma-separated string; TOML a list.
    items = value.split(",") if type(value) is str else value
    if not isinstance(items, list | tuple) or not all(type(i) is str for i in items):
        raise ValueError("expected a list of HOST:PORT strings")
    items = [i.strip() for i in items if i.strip()]
    for item in items:
        parse_address(item)
    return tuple(items)


def log_level(value: Any) -> str:
    if type(value) is not str or value.lower() not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
    return value.lower()


SCHEMA: dict[str, dict[str, Check]] = {
    "listener": {
        "host": host_name,
        "port": integer(0, U16_MAX),
        "write_buffer_high": integer(1, U63_MAX),
    },
    "storage": {
        "data_dir": nonempty_string,
        "fsync": one_of(*FSYNC_POLICIES),
        "fsync_interval_ms": integer(FSYNC_INTERVAL_MS_MIN, FSYNC_INTERVAL_MS_MAX),
        "compress_above": integer(0, U63_MAX),
    },
    "log": {"level": log_level},
    "sys": {"interval": number(0)},
    "cluster": {
        "node_id": node_id,
        "listen": address(allow_any_port=True),
        "advertise": optional_address,
        "name": nonempty_string,
        "secret": any_string,
        "secret_file": nonempty_string,
        "join": address_list,
        "discovery": any_string,
        "bootstrap_expect": integer(1, 1000),
        "partitions": integer(1, 65536),
        "replication_factor": integer(1, 16),
        "heartbeat_ms": integer(10, 60_000),
        "election_timeout_ms": integer(50, 600_000),
        "failure_timeout_ms": integer(100, 86_400_000),
        "discovery_interval_ms": integer(100, 600_000),
        "fault_injection": boolean,
    },
    "admin": {"enabled": boolean, "host": host_name, "port": integer(0, U16_MAX)},
    # Handed to fastbroker_core.Engine as is, which checks it (check_mqtt): one set of rules.
    "mqtt": {},
}

SECTION_TYPES: dict[str, type] = {
    "listener": ListenerConfig,
    "storage": StorageConfig,
    "log": LogConfig,
    "sys": SysConfig,
    "cluster": ClusterConfig,
    "admin": AdminConfig,
}


def load_config(
    path: Path | str | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Reads ``path`` (defaults only when None), then applies ``overrides`` (from command-line
    flags, ``{table: {key: value}}``; None values are ignored)."""
    source = str(path) if path is not None else None
    tables = read_toml(Path(path)) if path is not None else {}
    sections = validate_tables(tables, source or "<defaults>")
    flag_tables = {
        table: {key: value for key, value in values.items() if value is not None}
        for table, values in (overrides or {}).items()
    }
    flag_sections = validate_tables(flag_tables, "command line")
    for table, values in flag_sections.items():
        sections.setdefault(table, {}).update(values)

    settings: dict[str, Any] = {
        table: section_type(**sections.get(table, {}))
        for table, section_type in SECTION_TYPES.items()
    }
    check_cluster(settings["cluster"], source or "<defaults>")
    return Config(**settings, mqtt=MappingProxyType(dict(sections.get("mqtt", {}))), source=source)


def read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read config file: {error.strerror}") from None
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: invalid TOML: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {one_line(str(error))}") from None


def validate_tables(tables: Mapping[str, Any], source: str) -> dict[str, dict[str, Any]]:
    """Checks every table and key against SCHEMA; returns the checked values per table."""
    sections: dict[str, dict[str, Any]] = {}
    for table, values in tables.items():
        if table not in SCHEMA:
            raise ConfigError(f"{source}: unknown table [{table}] (known: {', '.join(SCHEMA)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{source}: {table}: expected a table [{table}]")
        if table == "mqtt":
            sections[table] = check_mqtt(values, source)
            continue
        checks = SCHEMA[table]
        checked: dict[str, Any] = {}
        for key, value in values.items():
            if key not in checks:
                raise ConfigError(
                    f"{source}: [{table}] {key}: unknown key (known: {', '.join(checks)})"
                )
            try:
                checked[key] = checks[key](value)
            except ValueError as error:
                raise ConfigError(
                    f"{source}: [{table}] {key}: {error}, got {one_line(reprlib.repr(value))}"
                ) from None
        sections[table] = checked
    return sections


def check_cluster(cluster: ClusterConfig, source: str) -> None:
    """Rules between [cluster] keys; only for a node that is in a cluster."""
    if not cluster.node_id:
        return
    from fastbroker.cluster.transport import parse_address

    problem = None
    if cluster.election_timeout_ms < 2 * cluster.heartbeat_ms:
        problem = "election_timeout_ms must be at least twice heartbeat_ms"
    elif cluster.failure_timeout_ms < 2 * cluster.election_timeout_ms:
        problem = "failure_timeout_ms must be at least twice election_timeout_ms"
    elif cluster.secret and cluster.secret_file:
        problem = "set secret or secret_file, not both"
    elif not cluster.advertise and parse_address(cluster.listen, allow_any_port=True)[0] in (
        "0.0.0.0",
        "::",
    ):
        problem = "listen is a wildcard address: set advertise to the address peers dial"
    if problem is not None:
        raise ConfigError(f"{source}: [cluster] {problem}")


ENGINE_OWN_KEYS = frozenset({"version", "durable", "compress_above"})


def check_mqtt(values: Mapping[str, Any], source: str) -> dict[str, Any]:
    """The [mqtt] keys, checked by the engine itself so its rules live in one place (the
    Rust `Config::set`); each key is tried alone so the error names the one at fault."""
    for key, value in values.items():
        try:
            # Set by the broker itself at startup (version, and [storage] settings), not here.
            if key in ENGINE_OWN_KEYS:
                raise ValueError(f"unknown setting {key!r}")
            fastbroker_core.Engine({key: value})
        except ValueError as error:
            raise ConfigError(
                f"{source}: [mqtt] {key}: {error}, got {one_line(reprlib.repr(value))}"
            ) from None
    return dict(values)


def one_line(text: str) -> str:
    return " ".join(text.split())
