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
    # Which layer serves plain TCP sockets (no PROXY protocol): "compiled"
    # (fastbroker_core.Reactor: Rust owns the sockets, Python runs once per loop iteration)
    # or "uvloop" (asyncio transports). TLS, WebSocket and PROXY listeners stay on uvloop.
    connection_layer: str = "compiled"


CONNECTION_LAYERS = ("uvloop", "compiled")
MAX_WORKERS = 1024
LISTENER_TYPES = ("tcp", "tls", "ws", "wss")
LISTENER_DEFAULT_PORTS = {"tcp": 1883, "tls": 8883, "ws": 8083, "wss": 8084}
PROXY_PROTOCOL_MODES = ("off", "v1", "v2", "any")
# The name of the listener [listener] describes.
DEFAULT_LISTENER_NAME = "default"


@dataclass(frozen=True)
class ListenerSpec:
    """One listener (fastbroker.listeners): [listener] or one of [[listeners]]."""

    name: str = DEFAULT_LISTENER_NAME
    type: str = "tcp"
    host: str = "127.0.0.1"
    port: int = 1883
    # tls and wss: the server's certificate chain and key (PEM). cafile: client certificates
    # are verified against it; require_certificate refuses clients without one;
    # use_identity_as_username makes the certificate's CN the client's username.
    certfile: str = ""
    keyfile: str = ""
    cafile: str = ""
    require_certificate: bool = False
    use_identity_as_username: bool = False
    tls_min_version: str = "1.2"
    # A PROXY protocol header is expected first on every connection: "v1", "v2", "any".
    proxy_protocol: str = "off"
    # Set by the worker supervisor (fastbroker.workers), never from TOML: every worker binds
    # the same address (SO_REUSEPORT) and the kernel spreads connections among them.
    reuse_port: bool = False
    # ws and wss: the HTTP path of the endpoint; "" accepts any.
    path: str = "/mqtt"

    @property
    def tls(self) -> bool:
        return self.type in ("tls", "wss")

    @property
    def websocket(self) -> bool:
        return self.type in ("ws", "wss")


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
    # Connects, refusals and disconnects as JSON lines (fastbroker.access_log): "stderr"
    # (through the normal log, at level info), "off", or a file path (reopened when rotated).
    access_log: str = "stderr"


@dataclass(frozen=True)
class SysConfig:
    # Seconds between $SYS updates; 0 disables $SYS topics.
    interval: float = 10


@dataclass(frozen=True)
class NodeConfig:
    # Processes serving this node (fastbroker.workers): a number, or "auto" for the cores
    # this process may use (affinity mask and cgroup CPU quota). 1: one process, no
    # supervisor (see the README for why 1 is the default).
    workers: int | str = 1
    # Set by the worker supervisor (fastbroker.workers), never from TOML: the abstract Unix
    # socket on which this worker serves its /metrics to the first worker, and those of the
    # other workers, which the first one gathers into the node's /metrics.
    metrics_socket: str = ""
    peer_metrics_sockets: tuple[str, ...] = ()


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
    # A member that stopped for a restart (SIGTERM) stays in the map this long instead, so
    # that a rolling restart moves no partitions; 0: as long as the failure timeout.
    restart_timeout_ms: int = 300_000
    discovery_interval_ms: int = 1000
    # Lets the admin endpoint cut links to chosen nodes (split tests); never in production.
    fault_injection: bool = False
    # TLS on links between nodes (all three or none): this node's certificate and key, used
    # both to accept and to dial, and the cluster's CA, which every peer's certificate must
    # chain to (mutual authentication, beside the shared secret).
    tls_certfile: str = ""
    tls_keyfile: str = ""
    tls_cafile: str = ""
    # A down peer's queue (kept on disk) holds at most this much in memory; the rest is read
    # back from disk when the peer is back.
    outbox_memory_mb: int = 64
    # Nodes that must hold a QoS 1/2 message for a persistent session (its home and copies
    # on the partition's other owners) before the publish is acknowledged; at most
    # replication_factor. With no owner reachable, one copy suffices (counted as degraded).
    ack_replicas: int = 2
    # Where MQTT 5 clients are told to go when this node stops for a planned restart
    # (SIGTERM): DISCONNECT 0x9C "use another server" with this Server Reference, such as the
    # load balancer's "host:port". Empty: DISCONNECT 0x8B "server shutting down".
    server_reference: str = ""
    # Which side of a network split acts on what both sides hold (a session's state at the
    # split): "majority" (more than half of the members, or half with the first by name)
    # delivers QoS 2 and serves session copies, the other side waits for the heal, so
    # QoS 2 reaches a client that crosses the split once; "both" keeps both sides
    # delivering (such a client may get a QoS 2 message twice).
    split_delivery: str = "majority"
    # Batches for a node that is down or backed up are zstd-compressed (engine
    # cluster_compress); off where CPU is scarcer than bandwidth (between workers).
    link_compression: bool = True
    # Set by the worker supervisor (fastbroker.workers), never from TOML: the cluster of one
    # node's workers. Its seeds are every member there is (a fresh one need not wait to hear
    # of a running cluster first), and a worker never leaves it (the node stops instead).
    workers_of_node: bool = False


@dataclass(frozen=True)
class AdminConfig:
    # HTTP admin endpoint (/metrics, /health, /ready, /cluster/status); port 0 picks a free
    # one. Unset: on for a cluster node, off for a standalone broker.
    enabled: bool | None = None
    host: str = "127.0.0.1"
    port: int = 18830
    # At shutdown, /ready answers 503 this long before the listeners close, so load
    # balancers stop sending clients first.
    shutdown_delay_ms: int = 0


@dataclass(frozen=True)
class LimitsConfig:
    # Overload protection (docs/operations.md). 0 = no limit.
    # Connected clients at most: one more gets CONNACK 0x97 (3.1.1: 3, server unavailable).
    max_connections: int = 0
    # New sockets accepted per second (burst of one second); beyond it they are closed at once.
    max_connection_rate: float = 0
    # PUBLISH packets per second one connection may send; beyond it the broker stops reading
    # that connection until its rate allows (backpressure, nothing is dropped).
    max_publish_rate: int = 0
    # Past this RSS (MiB) the broker stops reading publishers until memory falls below 80 % of
    # it; "auto" = half of the RAM (or cgroup limit), 0 = off.
    memory_high_water_mb: int | str = "auto"
    # A connection the broker closes is half-closed and still read for this long, so its
    # client reads the DISCONNECT or CONNACK that says why instead of a reset; 0 = no linger.
    close_linger_ms: int = 1000


@dataclass(frozen=True)
class AuthConfig:
    # Authentication and authorization (docs/auth.md). All empty: every client may connect
    # and do anything, and the engine never waits for Python.
    password_file: str = ""
    acl_file: str = ""
    # None: false when a password file or an authenticating plugin is configured, else true.
    allow_anonymous: bool | None = None
    # "module.path:factory" or "file.py:factory"; options per spec in [auth.plugin_options].
    plugins: tuple[str, ...] = ()
    plugin_options: Mapping[str, Mapping[str, Any]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    # Longest a plugin hook may take before the client is refused or the message denied.
    plugin_timeout_ms: int = 5000

    @property
    def enabled(self) -> bool:
        return bool(
            self.password_file or self.acl_file or self.plugins or self.allow_anonymous is False
        )


@dataclass(frozen=True)
class Config:
    listener: ListenerConfig = field(default_factory=ListenerConfig)
    # Every listener to open: [listener] (when it applies) first, then [[listeners]].
    listeners: tuple[ListenerSpec, ...] = field(default_factory=lambda: (ListenerSpec(),))
    storage: StorageConfig = field(default_factory=StorageConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sys: SysConfig = field(default_factory=SysConfig)
    node: NodeConfig = field(default_factory=NodeConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    admin: AdminConfig = field(default_factory=AdminConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
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


def memory_mark(value: Any) -> int | str:
    if value == "auto" or (type(value) is int and 0 <= value <= 2**40):
        return value
    raise ValueError('expected "auto" or a number of MiB (0 = off)')


def access_log_target(value: Any) -> str:
    if type(value) is not str or not value or not value.isprintable():
        raise ValueError('expected "stderr", "off" or a file path')
    return value


def optional_file(value: Any) -> str:
    # Read at startup: a missing file fails here, with the other config errors.
    if type(value) is not str:
        raise ValueError("expected a file path")
    if value and not Path(value).is_file():
        raise ValueError("no such file")
    return value


def plugin_specs(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(
        type(v) is str and v.rpartition(":")[0] and v.rpartition(":")[2] for v in value
    ):
        raise ValueError('expected a list of "module.path:factory" strings')
    return tuple(value)


def plugin_options(value: Any) -> Mapping[str, Mapping[str, Any]]:
    if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
        raise ValueError('expected tables [auth.plugin_options."module.path:factory"]')
    return MappingProxyType({spec: MappingProxyType(dict(v)) for spec, v in value.items()})


def workers_value(value: Any) -> int | str:
    if value == "auto" or (type(value) is int and 1 <= value <= MAX_WORKERS):
        return value
    if type(value) is str and value.isdigit() and 1 <= int(value) <= MAX_WORKERS:
        # From the command line.
        return int(value)
    raise ValueError(f'expected "auto" or a number of workers from 1 to {MAX_WORKERS}')


def log_level(value: Any) -> str:
    if type(value) is not str or value.lower() not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
    return value.lower()


SCHEMA: dict[str, dict[str, Check]] = {
    "listener": {
        "host": host_name,
        "port": integer(0, U16_MAX),
        "write_buffer_high": integer(1, U63_MAX),
        "connection_layer": one_of(*CONNECTION_LAYERS),
    },
    "storage": {
        "data_dir": nonempty_string,
        "fsync": one_of(*FSYNC_POLICIES),
        "fsync_interval_ms": integer(FSYNC_INTERVAL_MS_MIN, FSYNC_INTERVAL_MS_MAX),
        "compress_above": integer(0, U63_MAX),
    },
    "log": {"level": log_level, "access_log": access_log_target},
    "sys": {"interval": number(0)},
    "node": {"workers": workers_value},
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
        "restart_timeout_ms": integer(0, 86_400_000),
        "discovery_interval_ms": integer(100, 600_000),
        "fault_injection": boolean,
        "tls_certfile": nonempty_string,
        "tls_keyfile": nonempty_string,
        "tls_cafile": nonempty_string,
        "outbox_memory_mb": integer(1, 1_000_000),
        "ack_replicas": integer(1, 16),
        "server_reference": any_string,
        "split_delivery": one_of("majority", "both"),
        "link_compression": boolean,
    },
    "admin": {
        "enabled": boolean,
        "host": host_name,
        "port": integer(0, U16_MAX),
        "shutdown_delay_ms": integer(0, 600_000),
    },
    "limits": {
        "max_connections": integer(0, 10_000_000),
        "max_connection_rate": number(0),
        "close_linger_ms": integer(0, 60_000),
        "max_publish_rate": integer(0, 100_000_000),
        "memory_high_water_mb": memory_mark,
    },
    "auth": {
        "password_file": optional_file,
        "acl_file": optional_file,
        "allow_anonymous": boolean,
        "plugins": plugin_specs,
        "plugin_options": plugin_options,
        "plugin_timeout_ms": integer(1, 600_000),
    },
    # Handed to fastbroker_core.Engine as is, which checks it (check_mqtt): one set of rules.
    "mqtt": {},
}

SECTION_TYPES: dict[str, type] = {
    "listener": ListenerConfig,
    "storage": StorageConfig,
    "log": LogConfig,
    "sys": SysConfig,
    "node": NodeConfig,
    "cluster": ClusterConfig,
    "admin": AdminConfig,
    "limits": LimitsConfig,
    "auth": AuthConfig,
}


def load_config(
    path: Path | str | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Reads ``path`` (defaults only when None), then applies ``overrides`` (from command-line
    flags, ``{table: {key: value}}``; None values are ignored)."""
    source = str(path) if path is not None else None
    tables = read_toml(Path(path)) if path is not None else {}
    # An array of tables, unlike the others: checked on its own (listener_specs).
    listener_tables = tables.pop("listeners", None)
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
    if settings["node"].workers != 1 and settings["cluster"].node_id:
        raise ConfigError(
            f"{source or '<defaults>'}: [node] workers: more than one worker is not supported "
            "yet on a cluster node ([cluster] node_id is set); use workers = 1"
        )
    # [listener] is a listener unless only [[listeners]] are given (its write_buffer_high
    # alone does not count).
    listener_given = listener_tables is None or bool(
        {"host", "port"}
        & (set(tables.get("listener", {})) | set(flag_sections.get("listener", {})))
    )
    listeners = listener_specs(
        listener_tables, settings["listener"] if listener_given else None, source or "<defaults>"
    )
    for spec in listeners:
        # The CN becomes the username in the authentication step, which runs only with [auth].
        if spec.use_identity_as_username and not settings["auth"].enabled:
            raise ConfigError(
                f"{source or '<defaults>'}: listener {spec.name}: use_identity_as_username needs "
                "[auth] (for example allow_anonymous = false, or an acl_file)"
            )
    return Config(
        **settings,
        listeners=listeners,
        mqtt=MappingProxyType(dict(sections.get("mqtt", {}))),
        source=source,
    )


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
        sections[table] = check_keys(values, SCHEMA[table], f"{source}: [{table}]")
    return sections


def check_keys(values: Mapping[str, Any], checks: Mapping[str, Any], where: str) -> dict[str, Any]:
    """Each key of one table checked by its function in ``checks``; unknown keys refused."""
    checked: dict[str, Any] = {}
    for key, value in values.items():
        if key not in checks:
            raise ConfigError(f"{where} {key}: unknown key (known: {', '.join(checks)})")
        try:
            checked[key] = checks[key](value)
        except ValueError as error:
            raise ConfigError(
                f"{where} {key}: {error}, got {one_line(reprlib.repr(value))}"
            ) from None
    return checked


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
    elif cluster.ack_replicas > cluster.replication_factor:
        problem = "ack_replicas must be at most replication_factor"
    elif cluster.secret and cluster.secret_file:
        problem = "set secret or secret_file, not both"
    elif len({bool(cluster.tls_certfile), bool(cluster.tls_keyfile), bool(cluster.tls_cafile)}) > 1:
        problem = "set all of tls_certfile, tls_keyfile and tls_cafile, or none"
    elif len(cluster.server_reference.encode()) > 65535 or "\x00" in cluster.server_reference:
        problem = "server_reference must be an MQTT string (at most 65,535 bytes, no NUL)"
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


def listener_name(value: Any) -> str:
    if (
        type(value) is not str
        or not 0 < len(value) <= 64
        or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in value)
    ):
        raise ValueError("expected 1-64 letters, digits, '-', '_' or '.'")
    return value


def websocket_path(value: Any) -> str:
    if type(value) is not str or (
        value and (not value.startswith("/") or not value.isprintable() or " " in value)
    ):
        raise ValueError('expected a path starting with "/" ("" accepts any)')
    return value


LISTENER_KEYS: dict[str, Check] = {
    "name": listener_name,
    "type": one_of(*LISTENER_TYPES),
    "host": host_name,
    "port": integer(0, U16_MAX),
    "certfile": nonempty_string,
    "keyfile": nonempty_string,
    "cafile": nonempty_string,
    "require_certificate": boolean,
    "use_identity_as_username": boolean,
    "tls_min_version": one_of("1.2", "1.3"),
    "proxy_protocol": one_of(*PROXY_PROTOCOL_MODES),
    "path": websocket_path,
}
TLS_ONLY_KEYS = (
    "certfile",
    "keyfile",
    "cafile",
    "require_certificate",
    "use_identity_as_username",
    "tls_min_version",
)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def listener_specs(
    tables: Any, default: ListenerConfig | None, source: str
) -> tuple[ListenerSpec, ...]:
    """The listeners of [[listeners]] (``tables``, None when absent) after the one of
    [listener] (``default``, None when it is not a listener). Checks keys, the rules between
    them, TLS files (by loading them) and clashes of names and ports."""
    specs: list[ListenerSpec] = []
    if default is not None:
        specs.append(ListenerSpec(host=default.host, port=default.port))
    if tables is not None and not (
        isinstance(tables, list) and all(isinstance(t, dict) for t in tables)
    ):
        raise ConfigError(f"{source}: listeners: expected an array of tables [[listeners]]")
    for index, table in enumerate(tables or ()):
        label = table.get("name") if type(table.get("name")) is str else f"#{index + 1}"
        checked = check_keys(table, LISTENER_KEYS, f"{source}: [[listeners]] {label}:")
        kind = checked.setdefault("type", "tcp")
        checked.setdefault("port", LISTENER_DEFAULT_PORTS[kind])
        checked.setdefault("name", f"{kind}-{checked['port']}")
        spec = ListenerSpec(**checked)
        check_listener(spec, set(checked), f"{source}: [[listeners]] {spec.name}")
        specs.append(spec)
    check_clashes(specs, source)
    return tuple(specs)


def check_listener(spec: ListenerSpec, keys: set[str], where: str) -> None:
    problem = None
    if not spec.tls and keys & set(TLS_ONLY_KEYS):
        key = next(k for k in TLS_ONLY_KEYS if k in keys)
        problem = f"{key} is only for tls and wss listeners (type is {spec.type})"
    elif not spec.websocket and "path" in keys:
        problem = f"path is only for ws and wss listeners (type is {spec.type})"
    elif spec.tls and not (spec.certfile and spec.keyfile):
        problem = f"a {spec.type} listener needs certfile and keyfile"
    elif spec.require_certificate and not spec.cafile:
        problem = "require_certificate needs cafile (the CA client certificates are checked with)"
    elif spec.use_identity_as_username and not spec.cafile:
        problem = "use_identity_as_username needs cafile (and require_certificate)"
    if problem is not None:
        raise ConfigError(f"{where}: {problem}")
    if spec.tls:
        # Loaded now, so a missing file, an unreadable key or a key that is not the
        # certificate's is a config error at startup, not a failure at the first client.
        from fastbroker.listeners import build_ssl_context

        try:
            build_ssl_context(spec)
        except ValueError as error:
            raise ConfigError(f"{where}: {one_line(str(error))}") from None


def check_clashes(specs: list[ListenerSpec], source: str) -> None:
    seen_names: set[str] = set()
    for index, spec in enumerate(specs):
        if spec.name in seen_names:
            raise ConfigError(f"{source}: two listeners are named {spec.name}")
        seen_names.add(spec.name)
        if spec.port == 0:
            continue
        for other in specs[:index]:
            same_host = (
                spec.host == other.host
                or spec.host in WILDCARD_HOSTS
                or other.host in WILDCARD_HOSTS
            )
            if other.port == spec.port and same_host:
                raise ConfigError(
                    f"{source}: listeners {other.name} and {spec.name} are both on port {spec.port}"
                )
