"""Overload protection ([limits]): connection cap, accept rate, per-client publish rate and the
memory high-water mark, each against a real broker over real sockets. What they share: the
broker pushes back (refuses with the spec's code, or stops reading) and never drops what it
acknowledged."""

from __future__ import annotations

import socket
import threading
import time

from conftest import Client
from rawmqtt import Reader
from rawmqtt import connect as raw_connect
from rawmqtt import puback as raw_puback
from rawmqtt import publish as raw_publish
from rawmqtt import subscribe as raw_subscribe


def limits(**values) -> str:
    body = "\n".join(
        f"{k} = {v!r}" if not isinstance(v, str) else f'{k} = "{v}"' for k, v in values.items()
    )
    return "[limits]\n" + body


def test_max_connections_refuses_with_quota_exceeded_and_frees_on_disconnect(make_broker, raw, uid):
    b = make_broker("fastbroker", extra_toml=limits(max_connections=3))
    clients = [raw(b, version=5) for _ in range(3)]
    for i, c in enumerate(clients):
        c.connect(client_id=f"{uid}-{i}")
    over5 = raw(b, version=5)
    assert over5.connect(client_id=f"{uid}-x", expect_rc=None).rc == 0x97  # quota exceeded
    over5.expect_closed()
    over4 = raw(b, version=4)
    assert over4.connect(client_id=f"{uid}-y", expect_rc=None).rc == 3  # server unavailable
    # A takeover of a connected client id is no extra connection.
    raw(b, version=5).connect(client_id=f"{uid}-0")
    clients[1].disconnect()
    time.sleep(0.2)
    raw(b, version=5).connect(client_id=f"{uid}-z")


def test_connection_rate_limit_closes_sockets_beyond_the_rate(make_broker, raw, uid):
    b = make_broker("fastbroker", extra_toml=limits(max_connection_rate=20))
    time.sleep(1.1)  # a full bucket: 20 accepts
    served = refused = 0
    socks = []
    for i in range(60):
        s = socket.create_connection(b.address, timeout=2)
        s.sendall(raw_connect(f"{uid}-{i}", protocol=4))
        socks.append(s)
    for s in socks:
        try:
            data = s.recv(4)
        except (ConnectionResetError, TimeoutError):
            data = b""
        if data[:1] == b"\x20":
            served += 1
        else:
            refused += 1
        s.close()
    # 20 from the burst, plus what refilled while the 60 were opened.
    assert 20 <= served < 45, (served, refused)
    assert refused >= 15
    time.sleep(1.1)
    raw(b, version=5).connect(client_id=f"{uid}-later")


def test_publish_rate_limit_slows_the_publisher_without_losing_messages(make_broker, uid):
    rate, count = 100, 400
    b = make_broker("fastbroker", extra_toml=limits(max_publish_rate=rate))
    sub = Client(b, client_id=f"{uid}-sub")
    sub.connect()
    sub.subscribe(f"{uid}/t", qos=1)
    pub = socket.create_connection(b.address, timeout=10)
    pub.sendall(raw_connect(f"{uid}-pub", protocol=5))
    reader = Reader(pub)
    assert reader.read().type == 2  # CONNACK
    started = time.monotonic()
    # Everything at once: the broker must pace it, not drop it.
    pub.sendall(
        b"".join(
            raw_publish(f"{uid}/t", b"%d" % i, qos=1, packet_id=i + 1, protocol=5)
            for i in range(count)
        )
    )
    got = sub.expect(count, timeout=30)
    elapsed = time.monotonic() - started
    assert [int(m.payload) for m in got] == list(range(count))
    # The first `rate` go at once (the burst), the rest at `rate` per second.
    assert elapsed >= (count - rate) / rate * 0.85, elapsed
    acks = 0
    deadline = time.monotonic() + 10
    while acks < count and time.monotonic() < deadline:
        acks += sum(1 for p in reader.read_available(timeout=1) if p.type == 4)
    assert acks == count
    pub.close()
    # Another client is not slowed by someone else's limit.
    other = Client(b, client_id=f"{uid}-other")
    other.connect()
    other.subscribe(f"{uid}/o", qos=0)
    t0 = time.monotonic()
    for _ in range(50):
        other.publish(f"{uid}/o", b"x", qos=0)
    other.expect(50, timeout=5)
    assert time.monotonic() - t0 < 3


def broker_rss(pid: int) -> int:
    with open(f"/proc/{pid}/statm", "rb") as f:
        return int(f.read().split()[1]) * 4096


def test_memory_high_water_stops_reading_publishers_until_subscribers_drain(make_broker, uid):
    """A subscriber that does not read makes the broker queue; past the mark the publisher is
    no longer read (its sends block), the subscriber's acks are still read, and once it reads
    again every message arrives: nothing acknowledged is dropped."""
    payload = b"p" * 65536
    count = 3000  # ~200 MB published in all
    mark_mb = 160
    b = make_broker(
        "fastbroker",
        max_queued_messages=1_000_000,
        log_level="warning",
        extra_toml=limits(memory_high_water_mb=mark_mb),
    )
    base = broker_rss(b.pid)
    assert base < mark_mb * 1024 * 1024 / 2, base
    sub = socket.create_connection(b.address, timeout=10)
    sub.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sub.sendall(raw_connect(f"{uid}-sub", protocol=5))
    sub_reader = Reader(sub)
    assert sub_reader.read().type == 2
    sub.sendall(raw_subscribe(1, [(f"{uid}/big", 1)], protocol=5))
    assert sub_reader.read().type == 9  # SUBACK
    pub = socket.create_connection(b.address, timeout=60)
    pub.sendall(raw_connect(f"{uid}-pub", protocol=5))
    pub_reader = Reader(pub)
    assert pub_reader.read().type == 2
    # Reader left a short timeout on the socket; the sends must outlast the pushback.
    pub.settimeout(60)
    sent = [0]

    def publish_all() -> None:
        for i in range(count):
            pub.sendall(
                raw_publish(f"{uid}/big", payload, qos=1, packet_id=i % 65535 + 1, protocol=5)
            )
            sent[0] = i + 1

    publisher = threading.Thread(target=publish_all, daemon=True)
    publisher.start()
    # The subscriber reads nothing: the broker queues until it reaches the mark.
    peak = 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        peak = max(peak, broker_rss(b.pid))
        if "memory high-water mark reached" in b.stderr_text():
            break
        time.sleep(0.05)
    assert "memory high-water mark reached" in b.stderr_text()
    time.sleep(1.0)
    stalled_at = sent[0]
    time.sleep(1.0)
    # The publisher is pushed back: hardly anything more is taken from it.
    assert sent[0] < count and sent[0] - stalled_at < 40, (stalled_at, sent[0])
    peak = max(peak, broker_rss(b.pid))
    # Now the subscriber reads and acknowledges everything.
    received = 0
    deadline = time.monotonic() + 60
    while received < count and time.monotonic() < deadline:
        for p in sub_reader.read_available(timeout=1):
            if p.type == 3:
                received += 1
                topic_len = int.from_bytes(p.body[:2], "big")
                packet_id = int.from_bytes(p.body[2 + topic_len : 4 + topic_len], "big")
                sub.sendall(raw_puback(packet_id, protocol=5))
        peak = max(peak, broker_rss(b.pid))
    publisher.join(timeout=10)
    assert sent[0] == count
    assert received == count
    assert "reading publishers again" in b.stderr_text()
    # Bounded by the mark plus what is in flight in buffers at the moment it is crossed.
    assert peak < (mark_mb + 96) * 1024 * 1024, peak >> 20
    pub.close()
    sub.close()


def test_memory_guard_hysteresis():
    """Pressure starts above the mark and ends only below 80 % of it (no flapping)."""
    import asyncio

    from fastbroker.overload import MemoryGuard

    readings = iter([50, 101, 95, 85, 79, 90, 101])
    changes: list[bool] = []
    loop = asyncio.new_event_loop()
    try:
        guard = MemoryGuard(loop, changes.append, 100, rss=lambda: next(readings))
        guard.trim = None
        for _ in range(7):
            guard.check()
        guard.stop()
    finally:
        loop.close()
    assert changes == [True, False, True]
    assert guard.episodes == 2


def test_limits_config_errors_are_one_line(tmp_path):
    import pytest

    from fastbroker.config import ConfigError, load_config

    path = tmp_path / "c.toml"
    for text, needle in [
        ("[limits]\nmax_connections = -1", "max_connections"),
        ('[limits]\nmemory_high_water_mb = "lots"', "memory_high_water_mb"),
        ("[limits]\nmax_publish_rate = true", "max_publish_rate"),
        ("[limits]\nunknown = 1", "unknown key"),
    ]:
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(path)
        assert needle in str(info.value) and "\n" not in str(info.value)
    path.write_text("[limits]\nmax_connections = 5\nmemory_high_water_mb = 0")
    config = load_config(path)
    assert config.limits.max_connections == 5 and config.limits.memory_high_water_mb == 0


def test_connection_rate_limit_refuses_tls_sockets_before_their_handshake(make_broker, tmp_path):
    """On a TLS listener the limits apply at accept: a handshake flood beyond the rate costs
    the broker an accept and a close, not a TLS handshake each."""
    import ssl

    from brokers import free_port
    from certs import make_certs

    certs = make_certs(tmp_path / "certs")
    port = free_port()
    b = make_broker(
        "fastbroker",
        extra_toml=(
            f'[[listeners]]\ntype = "tls"\nport = {port}\n'
            f'certfile = "{certs.server.cert}"\nkeyfile = "{certs.server.key}"\n\n'
            + limits(max_connection_rate=10)
        ),
    )
    time.sleep(1.1)  # a full bucket: 10 accepts
    context = certs.client_context()
    served = refused = 0
    for _ in range(40):
        raw_sock = socket.create_connection((b.host, port), timeout=5)
        try:
            with context.wrap_socket(raw_sock, server_hostname="localhost") as tls:
                tls.sendall(raw_connect("rate", protocol=4))
                served += tls.recv(4)[:1] == b"\x20"
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError, OSError):
            refused += 1
        raw_sock.close()
    assert 10 <= served < 30, (served, refused)
    assert refused >= 10
    # Refused sockets never reached the TLS layer: no handshake failure is logged for them.
    assert "TLS handshake" not in b.stderr_text()


def test_memory_guard_checks_less_often_far_below_the_mark():
    """An idle broker far below its mark is not woken 20 times a second; near the mark, past
    it and under pressure the checks keep the short pace that bounds the overshoot."""
    import asyncio

    from fastbroker.overload import (
        CHECK_INTERVAL_S,
        MAX_CHECK_INTERVAL_S,
        MAX_GROWTH_BYTES_PER_S,
        MemoryGuard,
    )

    mark = 16 << 30
    loop = asyncio.new_event_loop()
    try:
        guard = MemoryGuard(loop, lambda pressure: 0, mark, rss=lambda: None)
        assert guard.delay(100 << 20) == MAX_CHECK_INTERVAL_S
        halfway = mark - MAX_GROWTH_BYTES_PER_S // 2
        assert guard.delay(halfway) == 0.5
        assert guard.delay(mark - (1 << 20)) == CHECK_INTERVAL_S
        assert guard.delay(mark + 1) == CHECK_INTERVAL_S
        assert guard.delay(None) == CHECK_INTERVAL_S
        guard.pressure = True
        assert guard.delay(100 << 20) == CHECK_INTERVAL_S
    finally:
        loop.close()
