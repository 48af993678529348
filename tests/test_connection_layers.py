"""Both connection layers of a plain TCP listener, side by side on real brokers ([listener]
connection_layer: "compiled", fastbroker_core.Reactor, the default; "uvloop", asyncio's
transports): what a client and an operator see must not depend on which one serves them.
The rest of the suite runs on the default layer (FASTBROKER_TEST_CONNECTION_LAYER=uvloop
runs it on the other)."""

from __future__ import annotations

import json
import socket
import time
import urllib.request
from pathlib import Path

import pytest
import rawmqtt
from brokers import BrokerProcess, free_port, start_fastbroker, stop_later

LAYERS = ("compiled", "uvloop")


@pytest.fixture(params=LAYERS)
def layer(request) -> str:
    return request.param


def start(tmp_path: Path, layer: str, extra_toml: str = "") -> BrokerProcess:
    return start_fastbroker(tmp_path, connection_layer=layer, extra_toml=extra_toml)


def client(broker: BrokerProcess, client_id: str, **connect) -> socket.socket:
    sock = socket.create_connection((broker.host, broker.port), timeout=5)
    sock.sendall(rawmqtt.connect(client_id, **connect))
    connack = rawmqtt.parse_connack(rawmqtt.read_packet(sock, 5))
    assert connack.reason == 0, connack
    return sock


@pytest.mark.timeout(60)
def test_publish_subscribe_will_and_retained(tmp_path: Path, layer: str) -> None:
    broker = start(tmp_path, layer)
    try:
        sub = client(broker, "sub")
        sub.sendall(rawmqtt.subscribe(1, [("t/#", 2)]))
        assert rawmqtt.read_packet(sub, 5).name == "SUBACK"
        # A will published when its connection drops without DISCONNECT.
        doomed = client(broker, "doomed", will_topic="t/will", will_payload=b"gone")
        pub = client(broker, "pub")
        for i in range(200):
            pub.sendall(rawmqtt.publish("t/a", b"%d" % i, qos=1, packet_id=i + 1))
        acks = [rawmqtt.read_packet(pub, 5) for _ in range(200)]
        assert {p.name for p in acks} == {"PUBACK"}
        got = []
        for _ in range(200):
            packet = rawmqtt.read_packet(sub, 5)
            assert packet.name == "PUBLISH"
            got.append(packet.body[len(b"\x00\x03t/a") + 2 :])
            packet_id = packet.body[5:7]
            sub.sendall(rawmqtt.puback(int.from_bytes(packet_id, "big")))
        assert got == [b"%d" % i for i in range(200)]
        doomed.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        doomed.close()
        will = rawmqtt.read_packet(sub, 5)
        assert will.name == "PUBLISH" and will.body.endswith(b"gone")
        # Retained, to a subscriber that comes later.
        pub.sendall(rawmqtt.publish("r/x", b"kept", retain=True))
        late = client(broker, "late")
        late.sendall(rawmqtt.subscribe(1, [("r/#", 0)]))
        assert rawmqtt.read_packet(late, 5).name == "SUBACK"
        retained = rawmqtt.read_packet(late, 5)
        assert retained.name == "PUBLISH" and retained.body.endswith(b"kept")
        for sock in (sub, pub, late):
            sock.close()
    finally:
        stop_later(broker)


@pytest.mark.timeout(60)
def test_a_refused_client_reads_why_before_the_end(tmp_path: Path, layer: str) -> None:
    """The broker's last packet is read by the client (linger), then an orderly end."""
    broker = start(tmp_path, layer)
    try:
        sock = socket.create_connection((broker.host, broker.port), timeout=5)
        # 3.1.1 without a client id and without a clean session: CONNACK 2, then the end.
        sock.sendall(rawmqtt.connect("", clean=False))
        connack = rawmqtt.parse_connack(rawmqtt.read_packet(sock, 5))
        assert connack.reason == 2
        assert rawmqtt.expect_closed(sock, 5)
        sock.close()
    finally:
        stop_later(broker)


@pytest.mark.timeout(60)
def test_socket_cap_access_log_and_metrics(tmp_path: Path, layer: str) -> None:
    admin_port = free_port()
    broker = start(
        tmp_path,
        layer,
        "[limits]\nmax_connections = 2\n\n"
        # [log] access_log defaults to "stderr".
        f"[admin]\nenabled = true\nport = {admin_port}\n",
    )
    try:
        held = [client(broker, f"c{i}") for i in range(2)]
        # A third gets CONNACK 0x03 (server unavailable): the engine's client cap.
        extra = socket.create_connection((broker.host, broker.port), timeout=5)
        extra.sendall(rawmqtt.connect("c2"))
        assert rawmqtt.parse_connack(rawmqtt.read_packet(extra, 5)).reason == 3
        extra.close()
        url = f"http://127.0.0.1:{admin_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            body = response.read().decode()
        line = next(
            line
            for line in body.splitlines()
            if line.startswith("fastbroker_connections{") and 'listener="default"' in line
        )
        assert float(line.rsplit(" ", 1)[1]) == 2, line
        local = held[0].getsockname()
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 5
        events: list[dict] = []
        while time.monotonic() < deadline:
            events = [
                json.loads(line.split("fastbroker.access: ", 1)[1])
                for line in broker.stderr_text().splitlines()
                if "fastbroker.access: " in line
            ]
            if any(e["event"] == "disconnect" and e["client_id"] == "c0" for e in events):
                break
            time.sleep(0.05)
        (connect,) = [e for e in events if e["event"] == "connect" and e["client_id"] == "c0"]
        assert connect["peer"] == f"{local[0]}:{local[1]}"
        assert connect["listener"] == "default" and connect["transport"] == "tcp"
        assert any(e["event"] == "disconnect" and e["client_id"] == "c0" for e in events)
    finally:
        stop_later(broker)


@pytest.mark.timeout(60)
def test_the_descriptor_table_is_grown_at_start(tmp_path: Path) -> None:
    """Grown later, while RocksDB's threads run, each doubling of the table stalls the whole
    broker for an RCU grace period (30 ms measured at the 256th connection): the broker grows
    it before it has threads (server.FD_TABLE_AT_START), and its connects stay fast."""
    broker = start(tmp_path, "compiled")
    try:
        status = Path(f"/proc/{broker.pid}/status").read_text()
        fd_size = int(next(x for x in status.splitlines() if x.startswith("FDSize:")).split()[1])
        limits = Path(f"/proc/{broker.pid}/limits").read_text()
        soft = next(x for x in limits.splitlines() if x.startswith("Max open files")).split()[3]
        expected = 65_536 if soft == "unlimited" else min(65_536, int(soft))
        if expected <= 1024:
            pytest.skip(f"open-file limit {soft}: nothing to grow")
        assert fd_size >= expected, (fd_size, soft)
        # And 300 connects, past the 256th descriptor, go through.
        socks = [client(broker, f"c{i}") for i in range(300)]
        for s in socks:
            s.close()
    finally:
        stop_later(broker)
