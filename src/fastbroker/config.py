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

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

# MQTT's largest packet: 1 fixed-header byte, 4 length bytes, 268435455 bytes of remainder.
MQTT_MAX_PACKET_SIZE = 268_435_460
U16_MAX = 65_535
U32_MAX = 4_294_967_295
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


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"


@dataclass(frozen=True)
class SysConfig:
    # Seconds between $SYS updates; 0 disables $SYS topics.
    interval: float = 10


@dataclass(frozen=True)
class Config:
    listener: ListenerConfig = field(default_factory=ListenerConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sys: SysConfig = field(default_factory=SysConfig)
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


def boolean(value: Any) -> bool:
    if type(value) is not bool:
        raise ValueError("expected true or false")
    return value


def nonempty_string(value: Any) -> str:
    if type(value) is not str or not value:
        raise ValueError("expected a non-empty string")
    return value


def host_name(value: Any) -> str:
    if type(value) is not str or not value or not value.isprintable() or " " in value:
        raise ValueError("expected a host name or IP address")
    return value


def log_level(value: Any) -> str:
    if type(value) is not str or value.lower() not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
    return value.lower()


def topic_filter_list(value: Any) -> list[str]:
    if type(value) is not list:
        raise ValueError("expected a list of topic filters")
    for topic_filter in value:
        if not is_valid_topic_filter(topic_filter):
            raise ValueError(f"invalid topic filter {reprlib.repr(topic_filter)}")
    return value


def is_valid_topic_filter(topic_filter: Any) -> bool:
    """MQTT rules: non-empty UTF-8 without NUL, at most 65535 bytes, `+` a whole level, `#` a
    whole last level."""
    if type(topic_filter) is not str or not topic_filter or "\0" in topic_filter:
        return False
    if len(topic_filter.encode("utf-8", "surrogatepass")) > U16_MAX:
        return False
    levels = topic_filter.split("/")
    for index, level in enumerate(levels):
        if "+" in level and level != "+":
            return False
        if "#" in level and (level != "#" or index != len(levels) - 1):
            return False
    return True


SCHEMA: dict[str, dict[str, Check]] = {
    "listener": {
        "host": host_name,
        "port": integer(0, U16_MAX),
        "write_buffer_high": integer(1, U63_MAX),
    },
    "storage": {"data_dir": nonempty_string},
    "log": {"level": log_level},
    "sys": {"interval": number(0)},
    # Handed to fastbroker_core.Engine as is; checked here so mistakes fail before it starts.
    "mqtt": {
        "max_packet_size": integer(1, MQTT_MAX_PACKET_SIZE),
        "max_keepalive": integer(0, U16_MAX),
        "receive_maximum": integer(1, U16_MAX),
        "max_inflight": integer(1, U16_MAX),
        "max_queued_messages": integer(0, U63_MAX),
        "max_queued_bytes": integer(0, U63_MAX),
        "topic_alias_maximum": integer(0, U16_MAX),
        "outgoing_topic_aliases": boolean,
        "maximum_qos": integer(0, 2),
        "retain_available": boolean,
        "max_session_expiry": integer(0, U32_MAX),
        "connect_timeout_ms": integer(0, U63_MAX),
        "denied_subscriptions": topic_filter_list,
        "max_client_id_len": integer(1, U16_MAX),
    },
}

SECTION_TYPES: dict[str, type] = {
    "listener": ListenerConfig,
    "storage": StorageConfig,
    "log": LogConfig,
    "sys": SysConfig,
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


def one_line(text: str) -> str:
    return " ".join(text.split())
