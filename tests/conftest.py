"""Shared fixtures for the end-to-end and differential suites.

Fixtures
--------
broker_kind   "fastbroker" / "mosquitto" (restricted with ``--broker``)
broker        a fresh broker process of ``broker_kind`` with default options
make_broker   factory: ``make_broker(kind, **options)`` (options in fastbroker's names)
fastbroker    a fresh fastbroker (tests of behaviour mosquitto cannot express)
version       MQTT protocol level, 4 (3.1.1) and 5
connect       factory: ``connect(broker, client_id=..., version=5, ...)`` -> connected Client
raw           factory: ``raw(broker, version=5)`` -> RawClient (hand-made packets)

Every wait is bounded; every client is closed and every broker stopped at teardown.
"""

from __future__ import annotations

import itertools
import queue
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field

import paho.mqtt.client as paho
import pytest
from brokers import BrokerProcess, reap_stopping, start_broker, stop_later
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

KINDS = ("fastbroker", "mosquitto")
DEFAULT_TEST_TIMEOUT = 30  # seconds, per test (pytest-timeout)
WAIT = 2.0  # default bound for positive waits
QUIET = 0.3  # default window for negative checks ("nothing arrives")


# --------------------------------------------------------------------------- options


def pytest_addoption(parser):
    parser.addoption(
        "--broker",
        action="store",
        default="both",
        choices=("fastbroker", "mosquitto", "both"),
        help="which broker(s) the e2e suite runs against (default: both)",
    )


def selected_kinds(config) -> tuple[str, ...]:
    choice = config.getoption("--broker")
    return KINDS if choice == "both" else (choice,)


def pytest_configure(config):
    config.addinivalue_line("markers", "timeout(seconds): per-test time limit")


def pytest_sessionfinish(session, exitstatus):
    reap_stopping(block=True)


def pytest_generate_tests(metafunc):
    if "broker_kind" in metafunc.fixturenames:
        kinds = selected_kinds(metafunc.config)
        metafunc.parametrize("broker_kind", kinds, ids=list(kinds))


def _is_e2e(item) -> bool:
    name = item.path.name
    return name.startswith("test_e2e_") or name == "test_differential.py"


def pytest_collection_modifyitems(config, items):
    # End-to-end tests get a tight default bound (each needs < 15 s even on Mosquitto);
    # other suites keep whatever --timeout the run was given.
    for item in items:
        if _is_e2e(item) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TEST_TIMEOUT))


def _has_pytest_timeout(config) -> bool:
    return config.pluginmanager.hasplugin("timeout")


class E2ETimeout(BaseException):
    """Not an Exception, so helpers catching TimeoutError cannot swallow it."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Fallback time limit when pytest-timeout is not installed (main thread, POSIX)."""
    marker = item.get_closest_marker("timeout")
    if _has_pytest_timeout(item.config) or not hasattr(signal, "SIGALRM") or marker is None:
        yield
        return
    seconds = int(marker.args[0]) if marker and marker.args else DEFAULT_TEST_TIMEOUT

    def on_alarm(signum, frame):
        raise E2ETimeout(f"test exceeded {seconds}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# --------------------------------------------------------------------------- brokers


class BrokerFactory:
    def __init__(self, config, tmp_path_factory):
        self.config = config
        self.tmp_path_factory = tmp_path_factory
        self.started: list[BrokerProcess] = []

    def __call__(self, kind: str, **options) -> BrokerProcess:
        if kind not in selected_kinds(self.config):
            pytest.skip(f"{kind} not selected (--broker={self.config.getoption('--broker')})")
        tmp = self.tmp_path_factory.mktemp(kind)
        bp = start_broker(kind, tmp, **options)
        self.started.append(bp)
        return bp

    def stop_all(self):
        for bp in reversed(self.started):
            stop_later(bp)  # SIGTERM now, waited for (SIGKILL if needed) at session end


@pytest.fixture
def make_broker(request, tmp_path_factory):
    factory = BrokerFactory(request.config, tmp_path_factory)
    yield factory
    factory.stop_all()
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for bp in factory.started:
            print(f"----- {bp.kind} (pid {bp.pid}) stderr -----\n{bp.stderr_text(8000)}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)


@pytest.fixture
def broker(broker_kind, make_broker) -> BrokerProcess:
    return make_broker(broker_kind)


@pytest.fixture
def fastbroker(make_broker) -> BrokerProcess:
    return make_broker("fastbroker")


@pytest.fixture(params=[4, 5], ids=["v311", "v5"])
def version(request) -> int:
    return request.param


# --------------------------------------------------------------------------- helpers


def known_deviation(request, broker, reason: str, kind: str = "mosquitto") -> None:
    """Mark the running test as an expected (strict) failure on ``kind``.

    For spec requirements the reference broker does not meet: the test still runs
    and asserts the spec; if the deviation ever disappears, the XPASS fails the run.
    """
    if broker.kind == kind:
        request.applymarker(pytest.mark.xfail(reason=f"{kind}: {reason}", strict=True))


def unique_id(prefix: str = "c") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def uid(request):
    """A unique topic prefix / client-id stem per test."""
    return f"t{uuid.uuid4().hex[:8]}"


def props_to_dict(props) -> dict:
    """paho Properties -> {"CompressedName": value}; None -> {}."""
    out = {}
    if props is None:
        return out
    for name in props.names:
        cname = name.replace(" ", "")
        if hasattr(props, cname):
            out[cname] = getattr(props, cname)
    return out


def make_props(packet_type: int, values: dict | None):
    if not values:
        return None
    p = Properties(packet_type)
    for k, v in values.items():
        setattr(p, k, v)
    return p


def rc_value(rc) -> int:
    """ReasonCode / int -> int."""
    return rc if isinstance(rc, int) else rc.value


@dataclass
class Msg:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool = False
    props: dict = field(default_factory=dict)
    mid: int = 0


@dataclass
class Connack:
    session_present: bool
    rc: int
    props: dict


class MqttError(AssertionError):
    pass


# --------------------------------------------------------------------------- paho wrapper


class Client:
    """paho-mqtt 2.x (callback API v2) wrapper with bounded, synchronous helpers."""

    def __init__(
        self,
        broker: BrokerProcess,
        client_id: str | None = None,
        version: int = 5,
        clean: bool = True,
        keepalive: int = 60,
        will: dict | None = None,
        props: dict | None = None,
        username: str | None = None,
        password: str | None = None,
    ):
        self.broker = broker
        self.version = version
        self.client_id = unique_id() if client_id is None else client_id
        self.clean = clean
        self.keepalive = keepalive
        self.connect_props = props
        self.messages: queue.Queue[Msg] = queue.Queue()
        self.connack: Connack | None = None
        self._connected = threading.Event()
        self._disconnected = threading.Event()
        self.disconnect_rc: int | None = None
        self.disconnect_props: dict = {}
        self.disconnect_from_server = False
        self._acks: dict[int, tuple[list[int], dict]] = {}
        self._ack_cv = threading.Condition()
        self._loop_started = False
        self.last_ack_props: dict = {}
        proto = paho.MQTTv5 if version == 5 else paho.MQTTv311
        kwargs = {}
        if version != 5:
            kwargs["clean_session"] = clean
        self.paho = paho.Client(
            paho.CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=proto,
            reconnect_on_failure=False,
            **kwargs,
        )
        if username is not None:
            self.paho.username_pw_set(username, password)
        if will:
            self.paho.will_set(
                will["topic"],
                will.get("payload", b""),
                qos=will.get("qos", 0),
                retain=will.get("retain", False),
                properties=make_props(PacketTypes.WILLMESSAGE, will.get("props")),
            )
        self.paho.on_connect = self._on_connect
        self.paho.on_message = self._on_message
        self.paho.on_disconnect = self._on_disconnect
        self.paho.on_subscribe = self._on_ack
        self.paho.on_unsubscribe = self._on_ack

    # callbacks (paho network thread)
    def _on_connect(self, client, userdata, flags, reason_code, properties):
        self.connack = Connack(
            bool(flags.session_present), rc_value(reason_code), props_to_dict(properties)
        )
        self._connected.set()

    def _on_message(self, client, userdata, m):
        self.messages.put(
            Msg(
                m.topic,
                bytes(m.payload),
                m.qos,
                bool(m.retain),
                bool(m.dup),
                props_to_dict(getattr(m, "properties", None)),
                m.mid,
            )
        )

    def _on_disconnect(self, client, userdata, flags, reason_code, properties):
        self.disconnect_rc = rc_value(reason_code)
        self.disconnect_props = props_to_dict(properties)
        self.disconnect_from_server = bool(flags.is_disconnect_packet_from_server)
        self._disconnected.set()
        self._connected.set()  # unblock a connect() waiting for a CONNACK

    def _on_ack(self, client, userdata, mid, reason_codes, properties):
        with self._ack_cv:
            self._acks[mid] = ([rc_value(rc) for rc in reason_codes], props_to_dict(properties))
            self._ack_cv.notify_all()

    def _wait_ack(self, mid: int, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        with self._ack_cv:
            while mid not in self._acks:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise MqttError(f"{what}: no acknowledgement within {timeout}s")
                self._ack_cv.wait(left)
            return self._acks.pop(mid)

    # API
    def connect(self, timeout: float = 5.0, expect_rc: int | None = 0) -> Connack:
        kwargs = {}
        if self.version == 5:
            kwargs["clean_start"] = self.clean
            kwargs["properties"] = make_props(PacketTypes.CONNECT, self.connect_props)
        self.paho.connect(self.broker.host, self.broker.port, self.keepalive, **kwargs)
        self.paho.loop_start()
        self._loop_started = True
        if not self._connected.wait(timeout):
            raise MqttError(f"no CONNACK from {self.broker.kind} within {timeout}s")
        if self.connack is None:
            raise MqttError(f"connection closed before CONNACK (rc={self.disconnect_rc})")
        if expect_rc is not None and self.connack.rc != expect_rc:
            raise MqttError(f"CONNACK rc {self.connack.rc:#x}, expected {expect_rc:#x}")
        return self.connack

    @property
    def is_connected(self) -> bool:
        return self.paho.is_connected()

    def subscribe(self, topic, qos: int = 0, timeout: float = WAIT, props=None, **opts):
        """subscribe("a/b", qos=1) or subscribe([("a", 1), ("b", SubscribeOptions(...))]).

        ``opts`` (v5 only): no_local, retain_as_published, retain_handling.
        Returns the list of SUBACK reason codes (ints).
        """
        if isinstance(topic, str):
            if self.version == 5:
                topics = [
                    (
                        topic,
                        SubscribeOptions(
                            qos=qos,
                            noLocal=opts.get("no_local", False),
                            retainAsPublished=opts.get("retain_as_published", False),
                            retainHandling=opts.get("retain_handling", 0),
                        ),
                    )
                ]
            else:
                topics = [(topic, qos)]
        else:
            topics = [
                (t, SubscribeOptions(qos=q) if self.version == 5 and isinstance(q, int) else q)
                for t, q in topic
            ]
        rc, mid = self.paho.subscribe(topics, properties=make_props(PacketTypes.SUBSCRIBE, props))
        if rc != paho.MQTT_ERR_SUCCESS:
            raise MqttError(f"subscribe failed locally: {rc}")
        codes, self.last_ack_props = self._wait_ack(mid, timeout, f"SUBSCRIBE {topics}")
        return codes

    def unsubscribe(self, topics, timeout: float = WAIT, props=None) -> list[int]:
        if isinstance(topics, str):
            topics = [topics]
        rc, mid = self.paho.unsubscribe(
            topics, properties=make_props(PacketTypes.UNSUBSCRIBE, props)
        )
        if rc != paho.MQTT_ERR_SUCCESS:
            raise MqttError(f"unsubscribe failed locally: {rc}")
        codes, self.last_ack_props = self._wait_ack(mid, timeout, f"UNSUBSCRIBE {topics}")
        return codes

    def publish(
        self,
        topic: str,
        payload=b"",
        qos: int = 0,
        retain: bool = False,
        props: dict | None = None,
        wait: bool = True,
        timeout: float = WAIT,
    ):
        info = self.paho.publish(
            topic, payload, qos, retain, make_props(PacketTypes.PUBLISH, props)
        )
        if info.rc != paho.MQTT_ERR_SUCCESS:
            raise MqttError(f"publish to {topic!r} failed locally: {info.rc}")
        if wait:
            info.wait_for_publish(timeout)
            if not info.is_published():
                raise MqttError(f"publish to {topic!r} (qos {qos}) not completed in {timeout}s")
        return info

    def expect(self, n: int = 1, timeout: float = WAIT) -> list[Msg]:
        """Exactly-at-least n messages within timeout (returns the first n)."""
        got: list[Msg] = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MqttError(
                    f"{self.client_id}: expected {n} message(s) within {timeout}s, got "
                    f"{len(got)}: {[(m.topic, m.payload) for m in got]}"
                )
            try:
                got.append(self.messages.get(timeout=left))
            except queue.Empty:
                continue
        return got

    def expect_one(self, timeout: float = WAIT) -> Msg:
        return self.expect(1, timeout)[0]

    def expect_none(self, timeout: float = QUIET) -> None:
        try:
            m = self.messages.get(timeout=timeout)
        except queue.Empty:
            return
        raise MqttError(f"{self.client_id}: unexpected message {m}")

    def pending(self) -> list[Msg]:
        """Whatever has arrived so far, without waiting."""
        out = []
        while True:
            try:
                out.append(self.messages.get_nowait())
            except queue.Empty:
                return out

    def drain(self, timeout: float = QUIET) -> list[Msg]:
        """Everything that arrives until the queue stays quiet for ``timeout``."""
        out = []
        while True:
            try:
                out.append(self.messages.get(timeout=timeout))
            except queue.Empty:
                return out

    def wait_disconnected(self, timeout: float = WAIT) -> int | None:
        if not self._disconnected.wait(timeout):
            raise MqttError(f"{self.client_id}: still connected after {timeout}s")
        return self.disconnect_rc

    def kill(self):
        """Drop the TCP connection without a DISCONNECT packet (abnormal close)."""
        sock = self.paho.socket()
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._disconnected.wait(WAIT)
        self.close()

    def disconnect(self, rc: int | None = None, props: dict | None = None):
        if self.paho.is_connected():
            kwargs = {}
            if self.version == 5 and rc is not None:
                kwargs["reasoncode"] = ReasonCode(PacketTypes.DISCONNECT, identifier=rc)
            if self.version == 5 and props:
                kwargs["properties"] = make_props(PacketTypes.DISCONNECT, props)
            self.paho.disconnect(**kwargs)
            self._disconnected.wait(WAIT)
        self.close()

    def close(self):
        if self._loop_started:
            self._loop_started = False
            try:
                if self.paho.is_connected():
                    self.paho.disconnect()
            finally:
                self.paho.loop_stop()


def expect_quiet(*clients: Client, timeout: float = QUIET) -> None:
    """One shared quiet window: none of ``clients`` receives anything more."""
    time.sleep(timeout)
    extra = {c.client_id: c.pending() for c in clients}
    extra = {k: v for k, v in extra.items() if v}
    if extra:
        raise MqttError(f"unexpected messages: {extra}")


# --------------------------------------------------------------------------- raw client

CONNECT, CONNACK, PUBLISH, PUBACK, PUBREC, PUBREL, PUBCOMP = 1, 2, 3, 4, 5, 6, 7
SUBSCRIBE, SUBACK, UNSUBSCRIBE, UNSUBACK, PINGREQ, PINGRESP = 8, 9, 10, 11, 12, 13
DISCONNECT, AUTH = 14, 15
PACKET_NAMES = {
    1: "CONNECT",
    2: "CONNACK",
    3: "PUBLISH",
    4: "PUBACK",
    5: "PUBREC",
    6: "PUBREL",
    7: "PUBCOMP",
    8: "SUBSCRIBE",
    9: "SUBACK",
    10: "UNSUBSCRIBE",
    11: "UNSUBACK",
    12: "PINGREQ",
    13: "PINGRESP",
    14: "DISCONNECT",
    15: "AUTH",
}
_PAHO_TYPES = {
    CONNACK: PacketTypes.CONNACK,
    PUBLISH: PacketTypes.PUBLISH,
    PUBACK: PacketTypes.PUBACK,
    PUBREC: PacketTypes.PUBREC,
    PUBREL: PacketTypes.PUBREL,
    PUBCOMP: PacketTypes.PUBCOMP,
    SUBACK: PacketTypes.SUBACK,
    UNSUBACK: PacketTypes.UNSUBACK,
    DISCONNECT: PacketTypes.DISCONNECT,
    AUTH: PacketTypes.AUTH,
}


def encode_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n % 128
        n //= 128
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def encode_str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("!H", len(b)) + b


def encode_props(packet_type: int, values: dict | None) -> bytes:
    p = make_props(packet_type, values)
    return p.pack() if p is not None else b"\x00"


class ConnectionClosed(AssertionError):
    pass


@dataclass
class Packet:
    type: int
    flags: int
    body: bytes
    pid: int | None = None
    rc: int = 0
    codes: list = field(default_factory=list)
    props: dict = field(default_factory=dict)
    topic: str = ""
    payload: bytes = b""
    session_present: bool = False

    @property
    def name(self) -> str:
        return PACKET_NAMES.get(self.type, str(self.type))

    @property
    def qos(self) -> int:
        return (self.flags >> 1) & 3

    @property
    def retain(self) -> bool:
        return bool(self.flags & 1)

    @property
    def dup(self) -> bool:
        return bool(self.flags & 8)

    def __repr__(self):
        if self.type == PUBLISH:
            return (
                f"PUBLISH(topic={self.topic!r}, payload={self.payload[:40]!r}, qos={self.qos}, "
                f"retain={self.retain}, dup={self.dup}, pid={self.pid}, props={self.props})"
            )
        return (
            f"{self.name}(pid={self.pid}, rc={self.rc:#x}, codes={self.codes}, props={self.props})"
        )


class RawClient:
    """A hand-driven MQTT client: sends exactly the packets a test builds, never
    acknowledges anything by itself, never pings. For protocol corner cases."""

    def __init__(self, broker: BrokerProcess, version: int = 5, timeout: float = WAIT):
        self.broker = broker
        self.version = version
        self.timeout = timeout
        self.sock = socket.create_connection(broker.address, timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.closed = False
        self._pids = itertools.count(1)

    # ---- encoding
    def next_pid(self) -> int:
        return (next(self._pids) - 1) % 65535 + 1

    def send_packet(self, first: int, body: bytes) -> None:
        self.sock.sendall(bytes([first]) + encode_varint(len(body)) + body)

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _props(self, packet_type, props) -> bytes:
        return encode_props(packet_type, props) if self.version == 5 else b""

    def connect(
        self,
        client_id: str = "",
        clean: bool = True,
        keepalive: int = 60,
        will: dict | None = None,
        props: dict | None = None,
        username: str | None = None,
        password: bytes | None = None,
        wait: bool = True,
        expect_rc: int | None = 0,
    ) -> Packet | None:
        flags = 0x02 if clean else 0
        payload = encode_str(client_id)
        if will:
            flags |= 0x04 | (will.get("qos", 0) << 3) | (0x20 if will.get("retain") else 0)
            payload += self._props(PacketTypes.WILLMESSAGE, will.get("props"))
            payload += encode_str(will["topic"])
            wp = will.get("payload", b"")
            payload += encode_str(wp if isinstance(wp, bytes) else wp.encode())
        if username is not None:
            flags |= 0x80
            payload += encode_str(username)
        if password is not None:
            flags |= 0x40
            payload += encode_str(password)
        body = encode_str("MQTT") + bytes([self.version, flags]) + struct.pack("!H", keepalive)
        body += self._props(PacketTypes.CONNECT, props) + payload
        self.send_packet(0x10, body)
        if not wait:
            return None
        p = self.recv()
        assert p.type == CONNACK, f"expected CONNACK, got {p}"
        if expect_rc is not None:
            assert p.rc == expect_rc, f"CONNACK rc {p.rc:#x}, expected {expect_rc:#x}: {p}"
        return p

    def publish(
        self,
        topic: str,
        payload: bytes | str = b"",
        qos: int = 0,
        retain: bool = False,
        dup: bool = False,
        pid: int | None = None,
        props: dict | None = None,
    ) -> int | None:
        if isinstance(payload, str):
            payload = payload.encode()
        first = 0x30 | (0x08 if dup else 0) | (qos << 1) | (1 if retain else 0)
        body = encode_str(topic)
        if qos:
            pid = pid or self.next_pid()
            body += struct.pack("!H", pid)
        body += self._props(PacketTypes.PUBLISH, props) + payload
        self.send_packet(first, body)
        return pid

    def _ack(self, first: int, pid: int, rc: int = 0, props=None):
        body = struct.pack("!H", pid)
        if self.version == 5 and (rc or props):
            body += bytes([rc]) + encode_props(PacketTypes.PUBACK, props)
        self.send_packet(first, body)

    def puback(self, pid, rc=0):
        self._ack(0x40, pid, rc)

    def pubrec(self, pid, rc=0):
        self._ack(0x50, pid, rc)

    def pubrel(self, pid, rc=0):
        self._ack(0x62, pid, rc)

    def pubcomp(self, pid, rc=0):
        self._ack(0x70, pid, rc)

    def subscribe(self, filters, qos: int = 0, props=None, wait: bool = True, **opts):
        """filters: "a/b" | [("a/b", options_byte_or_qos), ...]. Returns SUBACK."""
        if isinstance(filters, str):
            ob = qos
            if opts.get("no_local"):
                ob |= 0x04
            if opts.get("retain_as_published"):
                ob |= 0x08
            ob |= opts.get("retain_handling", 0) << 4
            filters = [(filters, ob)]
        pid = self.next_pid()
        body = struct.pack("!H", pid) + self._props(PacketTypes.SUBSCRIBE, props)
        for f, ob in filters:
            body += encode_str(f) + bytes([ob])
        self.send_packet(0x82, body)
        if not wait:
            return None
        p = self.recv_type(SUBACK)
        assert p.pid == pid, p
        return p

    def unsubscribe(self, filters, props=None, wait: bool = True):
        if isinstance(filters, str):
            filters = [filters]
        pid = self.next_pid()
        body = struct.pack("!H", pid) + self._props(PacketTypes.UNSUBSCRIBE, props)
        for f in filters:
            body += encode_str(f)
        self.send_packet(0xA2, body)
        if not wait:
            return None
        p = self.recv_type(UNSUBACK)
        assert p.pid == pid, p
        return p

    def ping(self):
        self.send_packet(0xC0, b"")

    def disconnect(self, rc: int = 0, props=None):
        body = b""
        if self.version == 5 and (rc or props):
            body = bytes([rc]) + encode_props(PacketTypes.DISCONNECT, props)
        try:
            self.send_packet(0xE0, body)
        except OSError:
            pass
        self.close()

    # ---- decoding
    def _read_more(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        self.sock.settimeout(left)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            raise TimeoutError from None
        except (ConnectionResetError, BrokenPipeError):
            data = b""
        if not data:
            self.closed = True
            raise ConnectionClosed("connection closed by broker")
        self.buf += data

    def _try_parse(self) -> Packet | None:
        buf = self.buf
        if len(buf) < 2:
            return None
        mult, length, i = 1, 0, 1
        while True:
            if i >= len(buf):
                return None
            b = buf[i]
            length += (b & 0x7F) * mult
            mult *= 128
            i += 1
            if not b & 0x80:
                break
        if len(buf) < i + length:
            return None
        first, body = buf[0], buf[i : i + length]
        self.buf = buf[i + length :]
        return self._decode(first >> 4, first & 0x0F, body)

    def _unpack_props(self, ptype: int, data: bytes) -> tuple[dict, int]:
        p = Properties(_PAHO_TYPES[ptype])
        _, used = p.unpack(data)
        return props_to_dict(p), used

    def _decode(self, ptype: int, flags: int, body: bytes) -> Packet:
        p = Packet(ptype, flags, body)
        v5 = self.version == 5
        if ptype == CONNACK:
            p.session_present = bool(body[0] & 1)
            p.rc = body[1]
            if v5 and len(body) > 2:
                p.props, _ = self._unpack_props(ptype, body[2:])
        elif ptype == PUBLISH:
            (tlen,) = struct.unpack("!H", body[:2])
            p.topic = body[2 : 2 + tlen].decode()
            pos = 2 + tlen
            if p.qos:
                (p.pid,) = struct.unpack("!H", body[pos : pos + 2])
                pos += 2
            if v5:
                p.props, used = self._unpack_props(ptype, body[pos:])
                pos += used
            p.payload = bytes(body[pos:])
        elif ptype in (PUBACK, PUBREC, PUBREL, PUBCOMP):
            (p.pid,) = struct.unpack("!H", body[:2])
            if v5 and len(body) > 2:
                p.rc = body[2]
                if len(body) > 3:
                    p.props, _ = self._unpack_props(ptype, body[3:])
        elif ptype in (SUBACK, UNSUBACK):
            (p.pid,) = struct.unpack("!H", body[:2])
            pos = 2
            if v5:
                p.props, used = self._unpack_props(ptype, body[pos:])
                pos += used
            p.codes = list(body[pos:])
        elif ptype in (DISCONNECT, AUTH):
            if v5 and body:
                p.rc = body[0]
                if len(body) > 1:
                    p.props, _ = self._unpack_props(ptype, body[1:])
        return p

    def recv(self, timeout: float | None = None) -> Packet:
        """Next packet; TimeoutError if none within timeout; ConnectionClosed on EOF."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            p = self._try_parse()
            if p is not None:
                return p
            self._read_more(deadline)

    def recv_type(self, ptype: int, timeout: float | None = None) -> Packet:
        """Next packet, which must be of ``ptype``."""
        try:
            p = self.recv(timeout)
        except TimeoutError:
            raise MqttError(f"no {PACKET_NAMES[ptype]} within timeout") from None
        assert p.type == ptype, f"expected {PACKET_NAMES[ptype]}, got {p}"
        return p

    def expect_publishes(self, n: int, timeout: float | None = None) -> list[Packet]:
        """n PUBLISH packets (anything else received in between is an error)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        out = []
        while len(out) < n:
            try:
                p = self.recv(max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise MqttError(f"expected {n} PUBLISH, got {len(out)}: {out}") from None
            assert p.type == PUBLISH, f"expected PUBLISH, got {p} (after {out})"
            out.append(p)
        return out

    def expect_silence(self, timeout: float = QUIET) -> None:
        try:
            p = self.recv(timeout)
        except TimeoutError:
            return
        raise MqttError(f"unexpected packet {p}")

    def expect_closed(self, timeout: float | None = None) -> list[Packet]:
        """Wait for the broker to close the connection; return packets seen first."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        seen = []
        while True:
            try:
                seen.append(self.recv(max(0.0, deadline - time.monotonic())))
            except ConnectionClosed:
                return seen
            except TimeoutError:
                raise MqttError(f"connection still open; received {seen}") from None

    def close(self):
        if not self.closed:
            self.closed = True
        try:
            self.sock.close()
        except OSError:
            pass


# --------------------------------------------------------------------------- client fixtures


@pytest.fixture
def connect():
    """Factory: connect(broker, client_id=None, version=5, clean=True, keepalive=60,
    will=None, props=None, expect_rc=0) -> connected Client."""
    clients: list[Client] = []

    def factory(broker, *, expect_rc: int | None = 0, timeout: float = 5.0, **kw) -> Client:
        c = Client(broker, **kw)
        clients.append(c)
        c.connect(timeout=timeout, expect_rc=expect_rc)
        return c

    yield factory
    for c in clients:
        try:
            c.close()
        except Exception:
            pass


@pytest.fixture
def raw():
    """Factory: raw(broker, version=5) -> RawClient (not yet connected)."""
    clients: list[RawClient] = []

    def factory(broker, version: int = 5, timeout: float = WAIT) -> RawClient:
        r = RawClient(broker, version, timeout)
        clients.append(r)
        return r

    yield factory
    for r in clients:
        r.close()


def pytest_collection_finish(session):
    """Importing locust monkey-patches sockets, threads and time with gevent for the whole
    process, which makes unrelated tests time out: locust runs only in subprocesses."""
    monkey = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("socket"):
        raise pytest.UsageError(
            "a test module imported locust in the pytest process (gevent monkey-patching); "
            "run it in a subprocess instead"
        )
