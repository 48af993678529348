"""Startup and shutdown: the engine, the listener, $SYS, signals, on asyncio + uvloop."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import resource
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

import fastbroker_core
import uvloop

from fastbroker import __version__
from fastbroker._connection import DEFAULT_READ_BUDGET, Server, monotonic_ms
from fastbroker.access_log import open_access_log
from fastbroker.admin import AdminServer, Raw, Readiness, routes
from fastbroker.auth import AuthCoordinator, engine_keys
from fastbroker.config import DEFAULT_LISTENER_NAME, Config, ConfigError
from fastbroker.heap import HeapTrimmer
from fastbroker.listeners import (
    CONNECT_TIMEOUT_MS,
    MAX_PACKET_SIZE,
    ListenerBindError,
    ListenerGroup,
    bind_listeners,
)
from fastbroker.overload import MemoryGuard, high_water_bytes
from fastbroker.store import Store, StoreError
from fastbroker.sys_topics import SysTopicPublisher

logger = logging.getLogger("fastbroker.server")

# Large enough that connection bursts (reconnect storms, load tests) are not refused.
LISTEN_BACKLOG = 4096
# How long clients get to take their last bytes at shutdown before they are cut off.
SHUTDOWN_GRACE_S = 2.0
# Sockets allowed beyond [limits] max_connections, so clients over the limit can be told why
# (CONNACK 0x97) instead of being cut off, while a flood still meets a hard cap.
SOCKETS_OVER_MAX_CONNECTIONS = 1024


class StartupError(Exception):
    """The broker cannot start (listener, data directory); described in one line."""


def configure_logging(level: str, tag: str = "") -> None:
    """Log lines to stderr; a worker's carry its name (``tag``)."""
    handler = logging.StreamHandler(sys.stderr)
    prefix = f"[{tag}] " if tag else ""
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s %(levelname)s {prefix}%(name)s: %(message)s")
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def engine_config(config: Config) -> dict[str, Any]:
    """The [mqtt] table as the engine's config, plus what the broker sets itself."""
    limits = config.limits
    return {
        **config.mqtt,
        "version": __version__,
        "durable": True,
        "compress_above": config.storage.compress_above,
        "max_connections": limits.max_connections,
        "max_publish_rate": limits.max_publish_rate,
        "cluster_outbox_memory": config.cluster.outbox_memory_mb << 20,
        "cluster_ack_replicas": config.cluster.ack_replicas,
        # A peer down for the failure timeout has its sessions taken over from their copies.
        "cluster_takeover_ms": config.cluster.failure_timeout_ms if config.cluster.node_id else 0,
        "cluster_minority_acts": config.cluster.split_delivery == "both",
        "cluster_compress": config.cluster.link_compression,
        # auth_required / intercept, only when [auth] is used.
        **engine_keys(config.auth),
    }


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


# Records handed to the engine per call at start-up.
RESTORE_CHUNK = 10_000


def restore(engine: Any, store: Store) -> None:
    """Rebuilds the engine's durable state from the store; damaged records are reported (and
    left on disk for inspection), never delivered."""
    started = time.monotonic()
    engine.set_wall_clock(wall_ms(), monotonic_ms())
    damaged = 0
    chunk: list[tuple[bytes, bytes]] = []
    for record in store.load():
        chunk.append(record)
        if len(chunk) >= RESTORE_CHUNK:
            damaged += report_damaged(engine.restore(chunk))
            chunk = []
    damaged += report_damaged(engine.restore(chunk))
    summary = engine.finish_restore(monotonic_ms())
    # Deletes of orphaned records and wills that fired at start.
    store.write(engine.take_store_ops())
    if any(summary.values()) or damaged:
        logger.info(
            "restored %d sessions, %d queued and %d in-flight messages, %d retained messages "
            "in %.2f s (%d expired sessions and %d orphaned records removed, %d damaged)",
            summary["sessions"],
            summary["messages"],
            summary["inflight"],
            summary["retained"],
            time.monotonic() - started,
            summary["expired_sessions"],
            summary["orphans"],
            damaged,
        )


def report_damaged(bad: list[tuple[bytes, str]]) -> int:
    for key, why in bad:
        logger.error("stored record %r is damaged and skipped: %s", key[:80], why)
    return len(bad)


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def os_error_reason(error: OSError) -> str:
    """The short lowercase cause, e.g. 'address already in use'."""
    if isinstance(error, socket.gaierror):
        return str(error.strerror).lower()
    if error.errno is not None and error.errno > 0:
        return os.strerror(error.errno).lower()
    return str(error)


# The size the descriptor table is grown to at start (or the open-file limit, if lower).
# Linux grows a process's table by doubling, and once the process has threads (RocksDB's)
# each doubling waits for an RCU grace period: measured, 30 ms with every client of the
# broker stalled, at the 256th descriptor and at each doubling after. Grown at start, while
# the broker has one thread, it costs nothing; 65,536 entries are about 0.5 MiB of kernel
# memory. Past it, doublings stall as before.
FD_TABLE_AT_START = 65_536


def raise_fd_limit() -> None:
    """Lets the broker hold as many connections as the hard limit allows (the soft limit is
    often 1024, far below what a broker needs), and grows the descriptor table for them."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as error:
            logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, error)
    grow_fd_table(min(soft, FD_TABLE_AT_START))


def grow_fd_table(size: int) -> None:
    """Makes the kernel's descriptor table hold `size` descriptors now (see
    FD_TABLE_AT_START): a descriptor duplicated to number size - 1, then closed."""
    if size <= 1024:
        return
    fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.dup2(fd, size - 1, inheritable=False)
        os.close(size - 1)
    except OSError as error:
        logger.debug("descriptor table not grown to %d: %s", size, error)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class WorkerSeat:
    """What a worker process (fastbroker.workers) gets from its supervisor: its name, for
    its log lines, and the pipe on which it says it serves."""

    name: str
    ready_fd: int


def run(config: Config, worker: WorkerSeat | None = None) -> None:
    """Runs the broker until SIGTERM or SIGINT. Raises ConfigError or StartupError."""
    configure_logging(config.log.level, worker.name if worker is not None else "")
    raise_fd_limit()
    try:
        engine = fastbroker_core.Engine(engine_config(config))
    except ValueError as error:
        raise ConfigError(f"{config.source or '<defaults>'}: [mqtt] {error}") from None
    data_dir = config.storage.data_dir
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as error:
        reason = os_error_reason(error)
        raise StartupError(f"cannot create data directory {data_dir}: {reason}") from None
    uvloop.run(serve(config, engine, worker))


def open_store(config: Config, engine: Any) -> Store:
    """Opens the data directory's store and rebuilds the engine's durable state from it."""
    storage = config.storage
    try:
        store = Store.open(storage.data_dir, storage.fsync, storage.fsync_interval_ms)
    except StoreError as error:
        raise StartupError(str(error)) from None
    try:
        restore(engine, store)
    except StoreError as error:
        store.close()
        raise StartupError(str(error)) from None
    return store


def make_reactor(config: Config) -> Any:
    """The compiled connection layer for plain TCP listeners ([listener] connection_layer =
    "compiled", the default), or None (uvloop's transports; also where fastbroker_core has
    no Reactor: it is built on Linux only)."""
    if config.listener.connection_layer != "compiled" or not hasattr(fastbroker_core, "Reactor"):
        return None
    limits = config.limits
    return fastbroker_core.Reactor(
        DEFAULT_READ_BUDGET,
        config.listener.write_buffer_high,
        limits.close_linger_ms,
        limits.max_connections + SOCKETS_OVER_MAX_CONNECTIONS if limits.max_connections else 0,
        float(limits.max_connection_rate),
    )


async def serve(config: Config, engine: Any, worker: WorkerSeat | None = None) -> None:
    loop = asyncio.get_running_loop()
    reactor = make_reactor(config)
    try:
        # Bound before the store is opened, so a port in use fails fast and touches nothing;
        # connections wait in the backlog until the state is restored.
        listener = await bind_listeners(
            config.listeners,
            loop,
            # Each step before MQTT (PROXY header, TLS, WebSocket handshake) gets as long as
            # a client has to send CONNECT.
            handshake_timeout=config.mqtt.get("connect_timeout_ms", CONNECT_TIMEOUT_MS) / 1000,
            max_packet_size=config.mqtt.get("max_packet_size", MAX_PACKET_SIZE),
            backlog=LISTEN_BACKLOG,
            reactor=reactor,
        )
    except ListenerBindError as error:
        spec = error.spec
        address = format_address(spec.host, spec.port)
        which = "" if spec.name == DEFAULT_LISTENER_NAME else f" (listener {spec.name})"
        reason = os_error_reason(error.error)
        raise StartupError(f"cannot listen on {address}{which}: {reason}") from None
    except ValueError as error:
        # A certificate file changed since the config was read.
        raise StartupError(str(error)) from None
    for spec, bound in listener.addresses():
        if spec.name != DEFAULT_LISTENER_NAME or len(config.listeners) > 1:
            logger.info("listener %s (%s) on %s", spec.name, spec.type, format_address(*bound))
    store = open_store(config, engine)
    server = None
    try:
        server = Server(engine, loop, config.listener.write_buffer_high, store=store)
        listener.attach(server)
        if reactor is not None:
            server.attach_reactor(reactor, listener.reactor_infos)
        await run_server(config, engine, server, listener, store, worker)
    finally:
        if server is not None:
            server.close_store()
        try:
            store.close()
        except StoreError as error:
            logger.error("%s", error)


async def run_server(
    config: Config,
    engine: Any,
    server: Server,
    listener: ListenerGroup,
    store: Store,
    worker: WorkerSeat | None = None,
) -> None:
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    # First: a plugin that fails to start stops the broker before anything else runs.
    auth = await start_auth(config, engine, server, loop)
    access_log = open_access_log(config.log.access_log)
    # A passing copy of a plain connection's details: logging keeps no dict per connection.
    server.access_handler = access_log.hook(lambda conn: server.conn_info(conn, False))
    # Before serving clients: a cluster or admin port in use stops the broker at startup.
    cluster = await start_cluster(config, loop, engine, server)
    try:
        admin = await start_admin(
            config,
            cluster,
            stop_requested,
            engine=engine,
            server=server,
            store=store,
            listeners=[listener],
            auth=auth,
        )
    except StartupError:
        if cluster is not None:
            await cluster.stop()
        raise
    if cluster is not None:
        if worker is not None:
            # A worker serves as part of the node or not at all: until the workers have
            # formed their cluster, it could route nothing to the others.
            await cluster.wait_member()
        # A node that comes back answers its first subscribes with the cluster's retained set.
        await cluster.wait_retained()
    await listener.start_serving()

    # Installed before the "listening" line, so a signal sent on seeing it is always handled.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)
    loop.add_signal_handler(signal.SIGHUP, reload_files, auth, listener)

    limits = config.limits
    if limits.max_connections:
        server.max_sockets = limits.max_connections + SOCKETS_OVER_MAX_CONNECTIONS
    server.connection_rate = limits.max_connection_rate
    server.close_linger = limits.close_linger_ms / 1000
    memory_guard = MemoryGuard(
        loop, server.set_memory_pressure, high_water_bytes(limits.memory_high_water_mb)
    )
    memory_guard.start()
    server.start_ticking()
    if store.fsync == "interval":
        server.start_syncing(store.fsync_interval_ms / 1000)
    sys_topics = SysTopicPublisher(
        engine,
        server,
        loop,
        config.sys.interval,
        __version__,
        cluster=cluster,
        node_wide_clients=worker is not None,
    )
    sys_topics.start()
    heap_trimmer = HeapTrimmer(loop)
    heap_trimmer.start()

    addresses = ", ".join(format_address(*bound) for _, bound in listener.addresses())
    logger.info("fastbroker %s listening on %s", __version__, addresses)
    if worker is not None:
        os.write(worker.ready_fd, b"1")
        os.close(worker.ready_fd)

    await stop_requested.wait()
    logger.info("shutting down")
    if admin is not None and config.admin.shutdown_delay_ms:
        # /ready already answers 503: load balancers stop sending clients before we close.
        await asyncio.sleep(config.admin.shutdown_delay_ms / 1000)
    listener.close()
    if admin is not None:
        await admin.stop()
    sys_topics.stop()
    heap_trimmer.stop()
    memory_guard.stop()
    # A cluster node stopping (expected back, or not): its clients go to the others.
    reference = config.cluster.server_reference if cluster is not None else ""
    await close_connections(server, reference or None)
    if cluster is not None:
        # Left the cluster: what sessions are still here go to their owners.
        await cluster.hand_over_sessions()
        # After the connections: the wills their ends publish still reach the other nodes,
        # and the copies of their sessions are complete.
        await cluster.settle_peers()
        await cluster.stop(planned=True)
    if auth is not None:
        await auth.stop()
    server.stop_ticking()
    server.stop_syncing()
    await listener.wait_closed()
    logger.info("stopped")


def reload_files(auth: Any, listener: ListenerGroup) -> None:
    """SIGHUP: re-reads the password and ACL files and the listeners' certificates. A bad new
    file is logged and the old one kept; the broker never stops for it."""
    logger.info("SIGHUP: reloading files")
    if auth is not None:
        auth.reload()
    listener.reload_certificates()


async def start_auth(
    config: Config, engine: Any, server: Server, loop: asyncio.AbstractEventLoop
) -> AuthCoordinator | None:
    """The [auth] coordinator wired to the connection layer, or None without [auth]."""
    if not config.auth.enabled:
        return None
    auth = AuthCoordinator(config.auth, engine, loop, server.conn_info, server.schedule_flush)
    try:
        await auth.start()
    except ConfigError as error:
        # A plugin that cannot start is a runtime failure (exit 1), not a config mistake.
        raise StartupError(str(error)) from None
    server.auth_handler = auth.on_auth_requests
    server.intercept_handler = auth.on_intercepted
    return auth


def cluster_secret(config: Config) -> str:
    settings = config.cluster
    if not settings.secret_file:
        if not settings.secret:
            logger.warning(
                "[cluster] has no secret: any process that knows the cluster name can join"
            )
        return settings.secret
    try:
        with open(settings.secret_file, encoding="utf-8") as file:
            secret = file.read().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise StartupError(f"cannot read [cluster] secret_file: {error}") from None
    if not secret:
        raise StartupError(f"[cluster] secret_file {settings.secret_file} is empty")
    return secret


async def start_cluster(
    config: Config, loop: asyncio.AbstractEventLoop, engine: Any = None, server: Any = None
) -> Any:
    """The cluster node, or None for a standalone broker. With the engine and its server, the
    node forwards publishes between nodes (the data plane)."""
    if not config.cluster.node_id:
        return None
    # Imported here: a standalone broker loads none of the cluster code.
    from fastbroker.cluster.node import ClusterNode, ClusterStartupError

    settings = dataclasses.replace(config.cluster, secret=cluster_secret(config), secret_file="")
    try:
        node = ClusterNode(settings, config.storage.data_dir, loop, engine, server)
    except ClusterStartupError as error:
        raise StartupError(str(error)) from None
    try:
        await node.start()
    except ClusterStartupError as error:
        await node.stop()
        raise StartupError(str(error)) from None
    return node


async def start_admin(
    config: Config,
    cluster: Any,
    stop_requested: asyncio.Event,
    *,
    engine: Any,
    server: Server,
    store: Store,
    # Anything with is_serving(): asyncio.Server, fastbroker.listeners.ListenerGroup.
    listeners: list[Any],
    auth: Any = None,
) -> AdminServer | None:
    enabled = config.admin.enabled
    node = config.node
    if not (enabled if enabled is not None else cluster is not None) and not node.metrics_socket:
        return None
    # Imported here: a broker without the admin endpoint does not load prometheus_client.
    from fastbroker.metrics import CONTENT_TYPE, BrokerCollector, BrokerMetrics

    def leave_done() -> None:
        # Leaving ends the node: its partitions now live elsewhere.
        asyncio.get_running_loop().call_later(0.2, stop_requested.set)

    def kick(client_id: str) -> bool:
        held = engine.kick(client_id, cluster is not None, monotonic_ms())
        server.schedule_flush()
        return held

    readiness = Readiness(
        stopping=stop_requested, listeners=listeners, server=server, store=store, cluster=cluster
    )
    collector = BrokerCollector(
        engine=engine,
        server=server,
        store=store,
        cluster=cluster,
        readiness=readiness,
        auth=auth,
        version=__version__,
    )
    render: Any = BrokerMetrics(collector).render
    if node.metrics_socket:
        # A worker but the first: its /metrics only, for the first to gather.
        return await start_worker_metrics(node.metrics_socket, render, CONTENT_TYPE)
    if node.peer_metrics_sockets:
        from fastbroker.workers import node_metrics

        render = node_metrics(render, node.peer_metrics_sockets)
    handle = routes(
        cluster,
        config.cluster.fault_injection,
        leave_done,
        metrics=render,
        metrics_content_type=CONTENT_TYPE,
        readiness=readiness,
        kick=kick,
        session_state=engine.session_state,
    )
    admin = AdminServer(handle)
    host, port = config.admin.host, config.admin.port
    try:
        bound = await admin.start(host, port)
    except OSError as error:
        address = format_address(host, port)
        reason = os_error_reason(error)
        raise StartupError(f"cannot listen for admin on {address}: {reason}") from None
    logger.info("admin endpoint on http://%s/", format_address(*bound[:2]))
    return admin


async def start_worker_metrics(
    path: str, render: Callable[[], bytes], content_type: str
) -> AdminServer:
    """A worker's own /metrics on its socket (fastbroker.workers), nothing else."""

    async def handle(method: str, route: str, body: bytes) -> tuple[int, Any]:
        if method == "GET" and route == "/metrics":
            return 200, Raw(content_type, render())
        return 404, {"error": "not found"}

    admin = AdminServer(handle)
    try:
        await admin.start_unix(path)
    except OSError as error:
        reason = os_error_reason(error)
        raise StartupError(f"cannot serve this worker's metrics: {reason}") from None
    return admin


async def close_connections(server: Server, server_reference: str | None = None) -> None:
    """Closes every connection, waiting up to SHUTDOWN_GRACE_S for their buffers to drain
    (MQTT 5 clients are sent to `server_reference` if given: DISCONNECT 0x9C)."""
    server.close_connections(server_reference)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SHUTDOWN_GRACE_S
    while server.open_connections and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if server.open_connections:
        logger.warning("aborting %d connections that did not close", server.open_connections)
        server.abort_connections()
        # Lets the transports deliver connection_lost, which tells the engine.
        await asyncio.sleep(0)
