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
from typing import Any

import fastbroker_core
import uvloop

from fastbroker import __version__
from fastbroker._connection import Server, monotonic_ms
from fastbroker.admin import AdminServer, routes
from fastbroker.config import Config, ConfigError
from fastbroker.heap import HeapTrimmer
from fastbroker.store import Store, StoreError
from fastbroker.sys_topics import SysTopicPublisher

logger = logging.getLogger("fastbroker.server")

# Large enough that connection bursts (reconnect storms, load tests) are not refused.
LISTEN_BACKLOG = 4096
# How long clients get to take their last bytes at shutdown before they are cut off.
SHUTDOWN_GRACE_S = 2.0


class StartupError(Exception):
    """The broker cannot start (listener, data directory); described in one line."""


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def engine_config(config: Config) -> dict[str, Any]:
    """The [mqtt] table as the engine's config, plus what the broker sets itself."""
    return {
        **config.mqtt,
        "version": __version__,
        "durable": True,
        "compress_above": config.storage.compress_above,
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


def raise_fd_limit() -> None:
    """Lets the broker hold as many connections as the hard limit allows (the soft limit is
    often 1024, far below what a broker needs)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as error:
            logger.warning("cannot raise the open-file limit from %d to %d: %s", soft, hard, error)


def run(config: Config) -> None:
    """Runs the broker until SIGTERM or SIGINT. Raises ConfigError or StartupError."""
    configure_logging(config.log.level)
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
    uvloop.run(serve(config, engine))


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


async def serve(config: Config, engine: Any) -> None:
    loop = asyncio.get_running_loop()
    host, port = config.listener.host, config.listener.port
    server: Server | None = None
    try:
        # Bound before the store is opened, so a port in use fails fast and touches nothing;
        # connections wait in the backlog until the state is restored.
        listener = await loop.create_server(
            lambda: server.new_connection(),  # type: ignore[union-attr]
            host,
            port,
            backlog=LISTEN_BACKLOG,
            start_serving=False,
        )
    except OSError as error:
        address = format_address(host, port)
        raise StartupError(f"cannot listen on {address}: {os_error_reason(error)}") from None
    store = open_store(config, engine)
    try:
        server = Server(engine, loop, config.listener.write_buffer_high, store=store)
        await run_server(config, engine, server, listener, store)
    finally:
        try:
            store.close()
        except StoreError as error:
            logger.error("%s", error)


async def run_server(
    config: Config, engine: Any, server: Server, listener: asyncio.Server, store: Store
) -> None:
    loop = asyncio.get_running_loop()
    host, port = config.listener.host, config.listener.port
    stop_requested = asyncio.Event()
    # Before serving clients: a cluster or admin port in use stops the broker at startup.
    cluster = await start_cluster(config, loop)
    try:
        admin = await start_admin(config, cluster, stop_requested)
    except StartupError:
        if cluster is not None:
            await cluster.stop()
        raise
    await listener.start_serving()

    # Installed before the "listening" line, so a signal sent on seeing it is always handled.
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop_requested.set)

    server.start_ticking()
    if store.fsync == "interval":
        server.start_syncing(store.fsync_interval_ms / 1000)
    sys_topics = SysTopicPublisher(engine, server, loop, config.sys.interval, __version__)
    sys_topics.start()
    heap_trimmer = HeapTrimmer(loop)
    heap_trimmer.start()

    bound_port = listener.sockets[0].getsockname()[1] if listener.sockets else port
    logger.info("fastbroker %s listening on %s", __version__, format_address(host, bound_port))

    await stop_requested.wait()
    logger.info("shutting down")
    listener.close()
    if admin is not None:
        await admin.stop()
    if cluster is not None:
        await cluster.stop()
    sys_topics.stop()
    heap_trimmer.stop()
    await close_connections(server)
    server.stop_ticking()
    server.stop_syncing()
    await listener.wait_closed()
    logger.info("stopped")


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


async def start_cluster(config: Config, loop: asyncio.AbstractEventLoop) -> Any:
    """The cluster node, or None for a standalone broker."""
    if not config.cluster.node_id:
        return None
    # Imported here: a standalone broker loads none of the cluster code.
    from fastbroker.cluster.node import ClusterNode, ClusterStartupError

    settings = dataclasses.replace(config.cluster, secret=cluster_secret(config), secret_file="")
    node = ClusterNode(settings, config.storage.data_dir, loop)
    try:
        await node.start()
    except ClusterStartupError as error:
        await node.stop()
        raise StartupError(str(error)) from None
    return node


async def start_admin(
    config: Config, cluster: Any, stop_requested: asyncio.Event
) -> AdminServer | None:
    enabled = config.admin.enabled
    if not (enabled if enabled is not None else cluster is not None):
        return None

    def leave_done() -> None:
        # Leaving ends the node: its partitions now live elsewhere.
        asyncio.get_running_loop().call_later(0.2, stop_requested.set)

    handle = routes(cluster, config.cluster.fault_injection, leave_done)
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


async def close_connections(server: Server) -> None:
    """Closes every connection, waiting up to SHUTDOWN_GRACE_S for their buffers to drain."""
    server.close_connections()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SHUTDOWN_GRACE_S
    while server.open_connections and loop.time() < deadline:
        await asyncio.sleep(0.02)
    if server.open_connections:
        logger.warning("aborting %d connections that did not close", server.open_connections)
        server.abort_connections()
        # Lets the transports deliver connection_lost, which tells the engine.
        await asyncio.sleep(0)
