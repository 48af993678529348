"""Fairness of the connection layer under a flood, with the real layer on uvloop in this process
and raw-socket clients in a thread.

libuv reads a busy socket up to 32 times per loop iteration. Without a per-iteration read budget,
one flooding publisher could make the engine route megabytes before a single byte is written to
subscribers (the flush runs once per iteration), and the whole broker stalls for seconds.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import fastbroker_core
import pytest
from layer import Layer
from test_python_calls import CONNECT_PUB, CONNECT_SUB, PUBLISH, SUBSCRIBE, read_exactly

FLOOD_BYTES = 16 * 1024 * 1024


class FeedPerFlush:
    """Forwards to the real engine; records the bytes each connection fed between two drains."""

    def __init__(self, engine: fastbroker_core.Engine) -> None:
        self.engine = engine
        self.current: dict[int, int] = {}
        self.max_per_flush = 0

    def feed(self, conn: int, data: bytes, now: int) -> int:
        self.current[conn] = self.current.get(conn, 0) + len(data)
        return self.engine.feed(conn, data, now)

    def drain(self):
        if self.current:
            self.max_per_flush = max(self.max_per_flush, max(self.current.values()))
        self.current = {}
        return self.engine.drain()

    def __getattr__(self, name: str):
        return getattr(self.engine, name)


def flood(read_budget: int, compiled: bool = False) -> int:
    """Floods 16 MiB of QoS 0 publishes through the layer; returns the most bytes one
    connection fed between two flushes (not seen with the compiled layer, which feeds the
    engine in Rust). Every publish must reach the subscriber."""
    real = fastbroker_core.Engine({"max_queued_messages": 1_000_000})
    engine = real if compiled else FeedPerFlush(real)
    layer = Layer(engine, compiled=compiled, read_budget=read_budget)
    loop, port = layer.loop, layer.port
    n = FLOOD_BYTES // len(PUBLISH)
    done = threading.Event()
    errors: list[BaseException] = []

    def clients() -> None:
        try:
            sub = socket.create_connection(("127.0.0.1", port), timeout=20)
            pub = socket.create_connection(("127.0.0.1", port), timeout=20)
            sub.sendall(CONNECT_SUB)
            read_exactly(sub, 4)
            sub.sendall(SUBSCRIBE)
            read_exactly(sub, 5)
            pub.sendall(CONNECT_PUB)
            read_exactly(pub, 4)
            # Large socket buffers let libuv find plenty to read at once.
            pub.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
            sender = threading.Thread(target=pub.sendall, args=(PUBLISH * n,), daemon=True)
            sender.start()
            got = read_exactly(sub, len(PUBLISH) * n)
            assert got == PUBLISH * n
            sender.join(20)
            sub.close()
            pub.close()
        except BaseException as error:  # reported by the test thread
            errors.append(error)
        finally:
            done.set()

    async def run() -> None:
        while not done.is_set():
            await asyncio.sleep(0.01)

    thread = threading.Thread(target=clients, daemon=True)
    thread.start()
    try:
        loop.run_until_complete(asyncio.wait_for(run(), 60))
    finally:
        thread.join(5)
        layer.close()
    assert not errors, errors
    return 0 if compiled else engine.max_per_flush


@pytest.mark.timeout(120)
def test_a_flooding_publisher_is_read_at_most_a_budget_per_flush():
    budget = 256 * 1024
    most = flood(budget)
    print(f"\nmost bytes fed by one connection between two flushes: {most}")
    # One read may overshoot the budget by at most one read (uvloop reads up to 256 KiB).
    assert most <= budget + 256 * 1024


@pytest.mark.timeout(120)
def test_a_flood_through_the_compiled_layer_arrives_whole():
    """The compiled layer (fastbroker_core.Reactor) under the same flood: partial writes,
    the write buffer's high mark and the subscriber's backpressure, every byte in order."""
    flood(256 * 1024, compiled=True)


def test_accepted_sockets_have_nagle_off():
    """MQTT acks and small publishes must not wait on Nagle's algorithm. The connection layer
    does not set TCP_NODELAY itself: the event loop's TCP transports do (uvloop and asyncio
    alike), and this checks that they still do."""
    layer = Layer(fastbroker_core.Engine({}))
    client = socket.create_connection(("127.0.0.1", layer.port), timeout=10)
    try:
        client.sendall(CONNECT_SUB)

        async def connected() -> list:
            assert layer.server is not None
            for _ in range(500):
                live = [c for c in layer.server.connections if c is not None]
                if live:
                    return live
                await asyncio.sleep(0.01)
            raise AssertionError("the broker never saw the connection")

        (connection,) = layer.loop.run_until_complete(connected())
        sock = connection.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        del connection
    finally:
        client.close()
        layer.close()
