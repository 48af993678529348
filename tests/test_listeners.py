"""One broker with every kind of listener at once (tcp, tls, ws, wss, and tcp, tls and ws
behind the PROXY protocol): clients on each exchange messages across them; client
certificates are required or turned into usernames; PROXY headers set the client address
the access log shows; bad listener configs stop the broker with one-line errors.

Certificates are made at test time (tests/certs.py).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
import rawmqtt
from brokers import (
    BrokerProcess,
    free_port,
    free_ports,
    run_broker_to_exit,
    start_fastbroker,
    stop_later,
)
from certs import Certs, KeyPair, make_certs, make_leaf

HOST = "127.0.0.1"
CONNECT_TIMEOUT_MS = 1000
NAMES = ("tls", "tls-id", "ws", "wss", "tcp-proxy", "tls-proxy", "ws-proxy")


@dataclass
class Setup:
    broker: BrokerProcess
    certs: Certs
    ports: dict[str, int]

    def log(self) -> str:
        return self.broker.stderr_text(limit=1_000_000)

    def access(self) -> list[dict]:
        """The access log lines so far, parsed."""
        lines = []
        for line in self.log().splitlines():
            _, marker, record = line.partition("fastbroker.access: ")
            if marker:
                lines.append(json.loads(record))
        return lines


def listeners_toml(certs: Certs, ports: dict[str, int]) -> str:
    server = f'certfile = "{certs.server.cert}"\nkeyfile = "{certs.server.key}"\n'
    ca = f'cafile = "{certs.ca}"\n'
    tables = {
        "tls": f'type = "tls"\n{server}{ca}require_certificate = true\n',
        # Clients without a certificate get in at the TLS level and are refused by [auth].
        "tls-id": f'type = "tls"\n{server}{ca}use_identity_as_username = true\n',
        "ws": 'type = "ws"\n',
        "wss": f'type = "wss"\n{server}',
        "tcp-proxy": 'type = "tcp"\nproxy_protocol = "any"\n',
        "tls-proxy": f'type = "tls"\n{server}proxy_protocol = "v1"\n',
        "ws-proxy": 'type = "ws"\nproxy_protocol = "v2"\npath = ""\n',
    }
    return "\n".join(
        f'[[listeners]]\nname = "{name}"\nport = {ports[name]}\n{body}'
        for name, body in tables.items()
    )


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("listeners")
    certs = make_certs(directory / "certs")
    acl = directory / "acl"
    # Everyone may use x/#; a user only its own devices/<username>/#.
    acl.write_text("topic readwrite x/#\npattern readwrite devices/%u/#\n")
    ports = dict(zip(NAMES, free_ports(len(NAMES)), strict=True))
    extra = f'[auth]\nacl_file = "{acl}"\n\n' + listeners_toml(certs, ports)
    broker = start_fastbroker(directory, connect_timeout_ms=CONNECT_TIMEOUT_MS, extra_toml=extra)
    ports["tcp"] = broker.port
    yield Setup(broker, certs, ports)
    stop_later(broker)


# ------------------------------------------------------------------------------ clients


def paho_client(
    setup: Setup, name: str, client_id: str, client_cert: KeyPair | None = None
) -> mqtt.Client:
    transport = "websockets" if name in ("ws", "wss") else "tcp"
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        transport=transport,  # type: ignore[arg-type]
        protocol=mqtt.MQTTv5,
    )
    if name in ("tls", "tls-id", "wss"):
        client.tls_set_context(setup.certs.client_context(client_cert))
    connected = threading.Event()
    client.on_connect = lambda c, u, f, rc, p: connected.set()
    client.connect(HOST, setup.ports[name])
    client.loop_start()
    assert connected.wait(5), f"{client_id} did not connect to {name}"
    return client


def proxy_v1(source: tuple[str, int]) -> bytes:
    family = "TCP4" if ":" not in source[0] else "TCP6"
    destination = "127.0.0.1" if family == "TCP4" else "::1"
    return f"PROXY {family} {source[0]} {destination} {source[1]} 1883\r\n".encode()


def proxy_v2(source: tuple[str, int]) -> bytes:
    address = ipaddress.ip_address(source[0])
    family = 0x11 if address.version == 4 else 0x21
    destination = ipaddress.ip_address("127.0.0.1" if address.version == 4 else "::1")
    payload = address.packed + destination.packed + struct.pack(">HH", source[1], 1883)
    signature = b"\r\n\r\n\x00\r\nQUIT\n"
    return signature + bytes([0x21, family]) + struct.pack(">H", len(payload)) + payload


def raw_connect(
    setup: Setup, name: str, client_id: str, header: bytes, context: ssl.SSLContext | None = None
) -> socket.socket:
    """A socket that sent ``header`` (a PROXY header) and, over TLS if ``context``, CONNECT
    (MQTT 3.1.1); the CONNACK is read and must be a success."""
    sock = socket.create_connection((HOST, setup.ports[name]), timeout=5)
    sock.sendall(header)
    if context is not None:
        sock = context.wrap_socket(sock, server_hostname="localhost")
    sock.sendall(rawmqtt.connect(client_id))
    assert rawmqtt.parse_connack(rawmqtt.read_packet(sock, 5)).reason == 0
    return sock


def ws_connect(setup: Setup, name: str, client_id: str, header: bytes) -> socket.socket:
    """A raw WebSocket MQTT client behind a PROXY header, connected; frames are small, one
    MQTT packet each (see WsFrames)."""
    sock = socket.create_connection((HOST, setup.ports[name]), timeout=5)
    sock.sendall(
        header
        + b"GET /any/path HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Protocol: mqtt\r\n\r\n"
    )
    response = b""
    while not response.endswith(b"\r\n\r\n"):
        response += sock.recv(1)
    assert response.startswith(b"HTTP/1.1 101 "), response
    send_ws(sock, rawmqtt.connect(client_id))
    assert recv_ws(sock)[:2] == b"\x20\x02"  # CONNACK, 3.1.1
    return sock


def send_ws(sock: socket.socket, data: bytes) -> None:
    mask = b"\x01\x02\x03\x04"
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
    assert len(data) < 126
    sock.sendall(bytes([0x82, 0x80 | len(data)]) + mask + masked)


def recv_ws(sock: socket.socket) -> bytes:
    """The payload of the next (small, binary) server frame."""
    head = rawmqtt._recv_exact(sock, 2, time.monotonic() + 5)
    assert head[0] == 0x82 and head[1] < 126, head
    return rawmqtt._recv_exact(sock, head[1], time.monotonic() + 5)


def wait_for(predicate, timeout: float = 5.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


# ------------------------------------------------------------------------------ tests


def test_messages_cross_every_kind_of_listener(setup: Setup) -> None:
    """A subscriber on each of tcp, tls, ws and wss, and one behind PROXY + TLS, receive what
    a publisher on every listener sends."""
    certs = setup.certs
    received: dict[str, set[str]] = {}
    subscribers = []
    for name in ("tcp", "tls", "ws", "wss"):
        topics: set[str] = set()
        received[name] = topics
        client = paho_client(setup, name, f"sub-{name}", certs.client)
        client.on_message = lambda c, u, m, topics=topics: topics.add(m.topic)
        done = threading.Event()
        client.on_subscribe = lambda *args, done=done: done.set()
        client.subscribe("x/#", qos=1)
        assert done.wait(5)
        subscribers.append(client)
    tls_proxied = raw_connect(
        setup, "tls-proxy", "sub-tls-proxy", proxy_v1(("203.0.113.9", 5000)), certs.client_context()
    )
    tls_proxied.sendall(rawmqtt.subscribe(1, [("x/#", 0)]))
    assert rawmqtt.read_packet(tls_proxied).type == rawmqtt.SUBACK

    publishers = [paho_client(setup, name, f"pub-{name}", certs.client) for name in received]
    try:
        for client, name in zip(publishers, received, strict=True):
            client.publish(f"x/{name}", name.encode(), qos=1).wait_for_publish(5)
        tcp_proxied = raw_connect(
            setup, "tcp-proxy", "pub-tcp-proxy", proxy_v2(("198.51.100.7", 4000))
        )
        tcp_proxied.sendall(rawmqtt.publish("x/tcp-proxy", b"p"))
        ws_proxied = ws_connect(setup, "ws-proxy", "pub-ws-proxy", proxy_v2(("2001:db8::5", 6000)))
        send_ws(ws_proxied, rawmqtt.publish("x/ws-proxy", b"w"))
        expected = {f"x/{name}" for name in received} | {"x/tcp-proxy", "x/ws-proxy"}
        assert wait_for(lambda: all(topics == expected for topics in received.values())), received
        got = set()
        while got != expected:
            got.add(rawmqtt.parse_publish(rawmqtt.read_packet(tls_proxied, 5)).topic)
        tcp_proxied.close()
        ws_proxied.close()
        tls_proxied.close()
    finally:
        for client in subscribers + publishers:
            client.disconnect()
            client.loop_stop()

    # The access log names each connection's listener, transport and (proxied) address.
    connects = {r["client_id"]: r for r in setup.access() if r["event"] == "connect"}
    for name, transport in (("tcp", "tcp"), ("tls", "tls"), ("ws", "ws"), ("wss", "wss")):
        assert connects[f"pub-{name}"]["transport"] == transport
        assert connects[f"pub-{name}"]["listener"] == ("default" if name == "tcp" else name)
        assert connects[f"pub-{name}"]["peer"].startswith("127.0.0.1:")
    assert connects["sub-tls-proxy"]["peer"] == "203.0.113.9:5000"
    assert connects["sub-tls-proxy"]["transport"] == "tls"
    assert connects["pub-tcp-proxy"]["peer"] == "198.51.100.7:4000"
    assert connects["pub-tcp-proxy"]["listener"] == "tcp-proxy"
    assert connects["pub-ws-proxy"]["peer"] == "[2001:db8::5]:6000"
    assert connects["pub-ws-proxy"]["transport"] == "ws"


def tls_session_works(setup: Setup, name: str, context: ssl.SSLContext, client_id: str) -> bool:
    """Whether an MQTT session gets through TLS on listener ``name`` with ``context``."""
    try:
        with socket.create_connection((HOST, setup.ports[name]), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname="localhost") as sock:
                # With TLS 1.3 the server checks the client's certificate after the client
                # considers the handshake done: the refusal shows on the first read.
                sock.sendall(rawmqtt.connect(client_id))
                return rawmqtt.parse_connack(rawmqtt.read_packet(sock, 5)).reason == 0
    except (ssl.SSLError, rawmqtt.Closed, ConnectionError):
        return False


def test_require_certificate(setup: Setup) -> None:
    certs = setup.certs
    assert not tls_session_works(setup, "tls", certs.client_context(), "no-cert")
    other = ssl.create_default_context(cafile=str(certs.ca))
    other.load_cert_chain(str(certs.other_client.cert), str(certs.other_client.key))
    assert not tls_session_works(setup, "tls", other, "other-ca")
    assert tls_session_works(setup, "tls", certs.client_context(certs.client), "good-cert")
    # Refusals are logged with the client's address, and change nothing for others.
    assert wait_for(lambda: setup.log().count("TLS handshake with 127.0.0.1:") >= 2)
    assert "certificate" in setup.log()


def test_certificate_cn_is_the_username(setup: Setup) -> None:
    certs = setup.certs
    with socket.create_connection((HOST, setup.ports["tls-id"]), timeout=5) as raw:
        context = certs.client_context(certs.client)
        with context.wrap_socket(raw, server_hostname="localhost") as sock:
            # The username sent is ignored: the certificate's CN (device-1) is the username.
            sock.sendall(rawmqtt.connect("cn-client", protocol=5, username="spoof"))
            assert rawmqtt.parse_connack(rawmqtt.read_packet(sock, 5), 5).reason == 0
            sock.sendall(
                rawmqtt.subscribe(
                    1, [("devices/device-1/#", 1), ("devices/spoof/#", 1)], protocol=5
                )
            )
            reasons = rawmqtt.parse_suback(rawmqtt.read_packet(sock, 5), 5).reasons
            assert reasons == [0x01, 0x87]
    # Without a certificate, such a listener has no identity to give: refused (0x87).
    with socket.create_connection((HOST, setup.ports["tls-id"]), timeout=5) as raw:
        with certs.client_context().wrap_socket(raw, server_hostname="localhost") as sock:
            sock.sendall(rawmqtt.connect("no-cn", protocol=5, username="device-1"))
            assert rawmqtt.parse_connack(rawmqtt.read_packet(sock, 5), 5).reason == 0x87


def test_bad_proxy_headers_are_refused_and_logged(setup: Setup) -> None:
    port = setup.ports["tcp-proxy"]
    # MQTT straight away, without the header the listener requires.
    with rawmqtt.open_socket(HOST, port, 5) as sock:
        sock.sendall(rawmqtt.connect("no-header"))
        assert rawmqtt.expect_closed(sock, 3)
    # A v1 line with an address that is not one.
    with rawmqtt.open_socket(HOST, port, 5) as sock:
        sock.sendall(b"PROXY TCP4 1.2.3 4.5.6.7 1 2\r\n" + rawmqtt.connect("bad-header"))
        assert rawmqtt.expect_closed(sock, 3)
    # A partial header, then silence: closed after the connect timeout.
    with rawmqtt.open_socket(HOST, port, 5) as sock:
        started = time.monotonic()
        sock.sendall(b"PROXY TCP4 ")
        assert rawmqtt.expect_closed(sock, 5)
        assert time.monotonic() - started >= CONNECT_TIMEOUT_MS / 1000 - 0.1
    # v2 LOCAL (a proxy's health check): the socket's own address is the peer.
    local = b"\r\n\r\n\x00\r\nQUIT\n\x20\x00\x00\x00"
    raw_connect(setup, "tcp-proxy", "health-check", local).close()
    assert wait_for(lambda: setup.log().count("on tcp-proxy: bad PROXY header") >= 2)
    assert "on tcp-proxy: no PROXY header within 1 s" in setup.log()
    connects = {r["client_id"]: r for r in setup.access() if r["event"] == "connect"}
    assert connects["health-check"]["peer"].startswith("127.0.0.1:")
    assert "no-header" not in connects and "bad-header" not in connects


# ------------------------------------------------------------------------------ config


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("config-certs"))


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            'type = "tls"\nport = 0\ncertfile = "{missing}"\nkeyfile = "{key}"\n',
            "[[listeners]] tls-0: certfile {missing}: No such file or directory",
        ),
        (
            'type = "tls"\nport = 0\ncertfile = "{cert}"\nkeyfile = "{wrong_key}"\n',
            "[[listeners]] tls-0: certfile {cert} and keyfile {wrong_key} cannot be used "
            "together: key values mismatch",
        ),
        (
            'type = "wss"\nport = 0\ncertfile = "{cert}"\n',
            "[[listeners]] wss-0: a wss listener needs certfile and keyfile",
        ),
        (
            'type = "tls"\nport = 0\ncertfile = "{cert}"\nkeyfile = "{key}"\n'
            "require_certificate = true\n",
            "[[listeners]] tls-0: require_certificate needs cafile",
        ),
        ('type = "quic"\n', "[[listeners]] #1: type: expected one of tcp, tls, ws, wss"),
        ('type = "tcp"\ncertfile = "{cert}"\n', "[[listeners]] tcp-1883: certfile is only for"),
        (
            'name = "a"\nport = {port}\n\n[[listeners]]\nname = "b"\nport = {port}\n',
            "listeners a and b are both on port {port}",
        ),
        (
            'proxy_protocol = "v3"\n',
            "[[listeners]] #1: proxy_protocol: expected one of off, v1, v2, any",
        ),
    ],
)
def test_bad_listener_configs_exit_2_with_one_line(
    tmp_path: Path, certs: Certs, body: str, expected: str
) -> None:
    values = {
        "missing": str(tmp_path / "missing.pem"),
        "cert": str(certs.server.cert),
        "key": str(certs.server.key),
        "wrong_key": str(certs.client.key),
        "port": str(free_port()),
    }
    result = run_broker_to_exit(tmp_path, "[[listeners]]\n" + body.format(**values))
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert expected.format(**values) in lines[0]


def test_listener_port_in_use_names_the_listener(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind((HOST, 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run_broker_to_exit(
            tmp_path,
            f'[listener]\nport = 0\n\n[[listeners]]\nname = "busy"\ntype = "ws"\nport = {port}\n',
        )
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"fastbroker: cannot listen on 127.0.0.1:{port} (listener busy): address already in use"
    )


def server_certificate(port: int, context: ssl.SSLContext) -> bytes:
    """The DER certificate the broker's TLS listener on ``port`` presents now."""
    with socket.create_connection((HOST, port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as sock:
            der = sock.getpeercert(binary_form=True)
            assert der is not None
            return der


def der_of(path: Path) -> bytes:
    return ssl.PEM_cert_to_DER_cert(path.read_text())


def test_sighup_reloads_certificates_and_keeps_the_old_on_bad_files(tmp_path: Path) -> None:
    """Certificate rotation without a restart: after the files are replaced and SIGHUP sent,
    new handshakes get the new certificate while a session already up goes on; a new key
    that does not match its certificate is refused with a log line, and the listener keeps
    serving what it had."""
    directory = tmp_path / "certs"
    certs = make_certs(directory)
    live = KeyPair(tmp_path / "live.pem", tmp_path / "live.key")
    shutil.copyfile(certs.server.cert, live.cert)
    shutil.copyfile(certs.server.key, live.key)
    port = free_port()
    extra = (
        f'[[listeners]]\nname = "tls"\ntype = "tls"\nport = {port}\n'
        f'certfile = "{live.cert}"\nkeyfile = "{live.key}"\n'
    )
    broker = start_fastbroker(tmp_path, extra_toml=extra)
    context = certs.client_context()
    try:
        assert server_certificate(port, context) == der_of(certs.server.cert)
        # A session that stays up across the reload.
        before = raw_connect(Setup(broker, certs, {"tls": port}), "tls", "before", b"", context)

        # The renewal: a new certificate for the same names, from the same CA.
        ca = KeyPair(certs.ca, certs.ca.with_suffix(".key"))
        renewed = make_leaf(
            directory,
            ca,
            "renewed",
            "localhost",
            "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
            "extendedKeyUsage=serverAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n",
        )
        assert der_of(renewed.cert) != der_of(certs.server.cert)
        shutil.copyfile(renewed.cert, live.cert)
        shutil.copyfile(renewed.key, live.key)
        os.kill(broker.pid, signal.SIGHUP)
        assert wait_for(lambda: "listener tls: certificate reloaded" in broker.stderr_text())
        assert server_certificate(port, context) == der_of(renewed.cert)
        before.sendall(rawmqtt.pingreq())
        assert rawmqtt.read_packet(before, 5).type == rawmqtt.PINGRESP
        before.close()

        # A bad renewal: the key of another certificate. Logged; the listener goes on with
        # the renewed pair it loaded.
        shutil.copyfile(certs.server.cert, live.cert)
        shutil.copyfile(certs.client.key, live.key)
        os.kill(broker.pid, signal.SIGHUP)
        assert wait_for(
            lambda: "listener tls keeps its previous certificate" in broker.stderr_text()
        ), broker.stderr_text()
        assert server_certificate(port, context) == der_of(renewed.cert)
        assert broker.proc.poll() is None
    finally:
        stop_later(broker)


def test_sighup_without_files_to_reload_does_not_stop_the_broker(tmp_path: Path) -> None:
    """SIGHUP's default action ends a process: the broker handles it even with no password,
    ACL or certificate file, so a reload sent to every broker of a fleet stops none."""
    broker = start_fastbroker(tmp_path)
    try:
        os.kill(broker.pid, signal.SIGHUP)
        assert wait_for(lambda: "SIGHUP: reloading files" in broker.stderr_text())
        sock = socket.create_connection((HOST, broker.port), timeout=5)
        sock.sendall(rawmqtt.connect("after-hup"))
        assert rawmqtt.parse_connack(rawmqtt.read_packet(sock, 5)).reason == 0
        sock.close()
        assert broker.proc.poll() is None
    finally:
        stop_later(broker)
