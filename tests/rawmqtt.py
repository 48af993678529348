"""A tiny raw MQTT 3.1.1 / 5.0 client for tests.

Written by hand from the specification and deliberately independent of fastbroker's own
codec, so tests can use it to check that codec. Encoders accept ``bytes`` wherever a string
goes, so tests can put invalid UTF-8 on the wire; nothing here validates what it sends.

Every read is bounded by a socket timeout: ``read_packet`` raises ``TimeoutError`` or
``Closed``; ``expect_closed`` returns a bool.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any

# Packet types (upper nibble of the first byte).
CONNECT = 1
CONNACK = 2
PUBLISH = 3
PUBACK = 4
PUBREC = 5
PUBREL = 6
PUBCOMP = 7
SUBSCRIBE = 8
SUBACK = 9
UNSUBSCRIBE = 10
UNSUBACK = 11
PINGREQ = 12
PINGRESP = 13
DISCONNECT = 14
AUTH = 15

PACKET_NAMES = {
    CONNECT: "CONNECT",
    CONNACK: "CONNACK",
    PUBLISH: "PUBLISH",
    PUBACK: "PUBACK",
    PUBREC: "PUBREC",
    PUBREL: "PUBREL",
    PUBCOMP: "PUBCOMP",
    SUBSCRIBE: "SUBSCRIBE",
    SUBACK: "SUBACK",
    UNSUBSCRIBE: "UNSUBSCRIBE",
    UNSUBACK: "UNSUBACK",
    PINGREQ: "PINGREQ",
    PINGRESP: "PINGRESP",
    DISCONNECT: "DISCONNECT",
    AUTH: "AUTH",
}

MAX_REMAINING_LENGTH = 268_435_455

# MQTT 5 reason codes used by the tests.
RC_SUCCESS = 0x00
RC_UNSPECIFIED = 0x80
RC_MALFORMED = 0x81
RC_PROTOCOL_ERROR = 0x82
RC_IMPLEMENTATION_SPECIFIC = 0x83
RC_UNSUPPORTED_PROTOCOL_VERSION = 0x84
RC_CLIENT_ID_NOT_VALID = 0x85
RC_KEEP_ALIVE_TIMEOUT = 0x8D
RC_TOPIC_FILTER_INVALID = 0x8F
RC_TOPIC_NAME_INVALID = 0x90
RC_RECEIVE_MAXIMUM_EXCEEDED = 0x93
RC_TOPIC_ALIAS_INVALID = 0x94
RC_PACKET_TOO_LARGE = 0x95
RC_QUOTA_EXCEEDED = 0x97

# MQTT 3.1.1 CONNACK return codes.
V3_ACCEPTED = 0x00
V3_UNACCEPTABLE_PROTOCOL_VERSION = 0x01
V3_IDENTIFIER_REJECTED = 0x02

# MQTT 5 property identifiers and their value types.
PAYLOAD_FORMAT_INDICATOR = 0x01
MESSAGE_EXPIRY_INTERVAL = 0x02
CONTENT_TYPE = 0x03
RESPONSE_TOPIC = 0x08
CORRELATION_DATA = 0x09
SUBSCRIPTION_IDENTIFIER = 0x0B
SESSION_EXPIRY_INTERVAL = 0x11
ASSIGNED_CLIENT_IDENTIFIER = 0x12
SERVER_KEEP_ALIVE = 0x13
AUTHENTICATION_METHOD = 0x15
AUTHENTICATION_DATA = 0x16
REQUEST_PROBLEM_INFORMATION = 0x17
WILL_DELAY_INTERVAL = 0x18
REQUEST_RESPONSE_INFORMATION = 0x19
RESPONSE_INFORMATION = 0x1A
SERVER_REFERENCE = 0x1C
REASON_STRING = 0x1F
RECEIVE_MAXIMUM = 0x21
TOPIC_ALIAS_MAXIMUM = 0x22
TOPIC_ALIAS = 0x23
MAXIMUM_QOS = 0x24
RETAIN_AVAILABLE = 0x25
USER_PROPERTY = 0x26
MAXIMUM_PACKET_SIZE = 0x27
WILDCARD_SUBSCRIPTION_AVAILABLE = 0x28
SUBSCRIPTION_IDENTIFIER_AVAILABLE = 0x29
SHARED_SUBSCRIPTION_AVAILABLE = 0x2A

_BYTE, _U16, _U32, _VARINT, _STR, _BIN, _PAIR = "byte", "u16", "u32", "varint", "str", "bin", "pair"
PROPERTY_TYPES = {
    PAYLOAD_FORMAT_INDICATOR: _BYTE,
    MESSAGE_EXPIRY_INTERVAL: _U32,
    CONTENT_TYPE: _STR,
    RESPONSE_TOPIC: _STR,
    CORRELATION_DATA: _BIN,
    SUBSCRIPTION_IDENTIFIER: _VARINT,
    SESSION_EXPIRY_INTERVAL: _U32,
    ASSIGNED_CLIENT_IDENTIFIER: _STR,
    SERVER_KEEP_ALIVE: _U16,
    AUTHENTICATION_METHOD: _STR,
    AUTHENTICATION_DATA: _BIN,
    REQUEST_PROBLEM_INFORMATION: _BYTE,
    WILL_DELAY_INTERVAL: _U32,
    REQUEST_RESPONSE_INFORMATION: _BYTE,
    RESPONSE_INFORMATION: _STR,
    SERVER_REFERENCE: _STR,
    REASON_STRING: _STR,
    RECEIVE_MAXIMUM: _U16,
    TOPIC_ALIAS_MAXIMUM: _U16,
    TOPIC_ALIAS: _U16,
    MAXIMUM_QOS: _BYTE,
    RETAIN_AVAILABLE: _BYTE,
    USER_PROPERTY: _PAIR,
    MAXIMUM_PACKET_SIZE: _U32,
    WILDCARD_SUBSCRIPTION_AVAILABLE: _BYTE,
    SUBSCRIPTION_IDENTIFIER_AVAILABLE: _BYTE,
    SHARED_SUBSCRIPTION_AVAILABLE: _BYTE,
}

Str = str | bytes
# A property list: (identifier, value) pairs, kept in order and duplicates allowed, so tests
# can send what a well-behaved client never would. A dict is accepted too.
Props = list[tuple[int, Any]] | dict[int, Any] | None


class Closed(ConnectionError):
    """The peer closed or reset the connection."""


# ---------------------------------------------------------------------------------------------
# Encoding primitives


def varint(n: int) -> bytes:
    """Variable Byte Integer (1 to 4 bytes for 0 .. 268435455; more if asked, for tests)."""
    if n < 0:
        raise ValueError(n)
    out = bytearray()
    while True:
        byte, n = n % 128, n // 128
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def u16(n: int) -> bytes:
    return struct.pack("!H", n)


def u32(n: int) -> bytes:
    return struct.pack("!I", n)


def string(s: Str) -> bytes:
    """Length-prefixed string; ``bytes`` go on the wire unchecked."""
    raw = s.encode("utf-8") if isinstance(s, str) else bytes(s)
    return u16(len(raw)) + raw


binary = string


def properties(props: Props) -> bytes:
    """Property block (length + properties). ``None`` or empty gives a zero length."""
    if not props:
        return b"\x00"
    items = props.items() if isinstance(props, dict) else props
    body = bytearray()
    for ident, value in items:
        kind = PROPERTY_TYPES.get(ident)
        body += varint(ident)
        if isinstance(value, (bytes, bytearray)) and kind not in (_STR, _BIN):
            body += value  # raw value, for malformed properties
        elif kind == _BYTE:
            body.append(value)
        elif kind == _U16:
            body += u16(value)
        elif kind == _U32:
            body += u32(value)
        elif kind == _VARINT:
            body += varint(value)
        elif kind in (_STR, _BIN):
            body += string(value)
        elif kind == _PAIR:
            body += string(value[0]) + string(value[1])
        else:
            raise ValueError(f"unknown property 0x{ident:02x}: pass its value as bytes")
    return varint(len(body)) + bytes(body)


def packet(ptype: int, flags: int, body: bytes = b"") -> bytes:
    """Fixed header + body: any type and any flags, valid or not."""
    return bytes([(ptype << 4) | (flags & 0x0F)]) + varint(len(body)) + body


# ---------------------------------------------------------------------------------------------
# Packet encoders


def connect(
    client_id: Str = "",
    *,
    protocol: int = 4,
    clean: bool = True,
    keepalive: int = 60,
    username: Str | None = None,
    password: bytes | None = None,
    will_topic: Str | None = None,
    will_payload: bytes = b"",
    will_qos: int = 0,
    will_retain: bool = False,
    will_props: Props = None,
    props: Props = None,
    protocol_name: Str = "MQTT",
    reserved_flag: bool = False,
    header_flags: int = 0,
) -> bytes:
    """CONNECT. ``protocol`` is the level byte (4 = 3.1.1, 5 = 5.0, anything for tests);
    properties are written when ``protocol == 5``."""
    flags = (0x02 if clean else 0) | (0x01 if reserved_flag else 0)
    if will_topic is not None:
        flags |= 0x04 | (will_qos << 3) | (0x20 if will_retain else 0)
    if password is not None:
        flags |= 0x40
    if username is not None:
        flags |= 0x80
    body = string(protocol_name) + bytes([protocol, flags]) + u16(keepalive)
    if protocol == 5:
        body += properties(props)
    body += string(client_id)
    if will_topic is not None:
        if protocol == 5:
            body += properties(will_props)
        body += string(will_topic) + binary(will_payload)
    if username is not None:
        body += string(username)
    if password is not None:
        body += binary(password)
    return packet(CONNECT, header_flags, body)


def publish(
    topic: Str,
    payload: bytes = b"",
    *,
    qos: int = 0,
    retain: bool = False,
    dup: bool = False,
    packet_id: int | None = None,
    protocol: int = 4,
    props: Props = None,
) -> bytes:
    """PUBLISH. ``qos`` may be 3 (invalid) and ``packet_id`` may be 0, for tests; the packet
    id is written when ``qos > 0`` (default 1)."""
    flags = (0x08 if dup else 0) | (qos << 1) | (0x01 if retain else 0)
    body = string(topic)
    if qos > 0:
        body += u16(1 if packet_id is None else packet_id)
    if protocol == 5:
        body += properties(props)
    return packet(PUBLISH, flags, body + payload)


def subscribe(
    packet_id: int,
    filters: list[tuple[Str, int]],
    *,
    protocol: int = 4,
    props: Props = None,
    flags: int = 0x02,
) -> bytes:
    """SUBSCRIBE with (filter, options) pairs; options are the QoS (3.1.1) or the whole v5
    subscription-options byte. ``flags`` must be 2; other values make a malformed packet."""
    body = u16(packet_id)
    if protocol == 5:
        body += properties(props)
    for topic_filter, options in filters:
        body += string(topic_filter) + bytes([options])
    return packet(SUBSCRIBE, flags, body)


def unsubscribe(
    packet_id: int,
    filters: list[Str],
    *,
    protocol: int = 4,
    props: Props = None,
    flags: int = 0x02,
) -> bytes:
    body = u16(packet_id)
    if protocol == 5:
        body += properties(props)
    for topic_filter in filters:
        body += string(topic_filter)
    return packet(UNSUBSCRIBE, flags, body)


def _ack(ptype: int, flags: int, packet_id: int, protocol: int, reason: int, props: Props):
    body = u16(packet_id)
    if protocol == 5 and (reason or props):
        body += bytes([reason]) + properties(props)
    return packet(ptype, flags, body)


def puback(packet_id: int, *, protocol: int = 4, reason: int = 0, props: Props = None):
    return _ack(PUBACK, 0, packet_id, protocol, reason, props)


def pubrec(packet_id: int, *, protocol: int = 4, reason: int = 0, props: Props = None):
    return _ack(PUBREC, 0, packet_id, protocol, reason, props)


def pubrel(
    packet_id: int, *, protocol: int = 4, reason: int = 0, props: Props = None, flags: int = 2
):
    """PUBREL; ``flags`` must be 2, other values make a malformed packet."""
    return _ack(PUBREL, flags, packet_id, protocol, reason, props)


def pubcomp(packet_id: int, *, protocol: int = 4, reason: int = 0, props: Props = None):
    return _ack(PUBCOMP, 0, packet_id, protocol, reason, props)


def pingreq(flags: int = 0) -> bytes:
    return packet(PINGREQ, flags)


def disconnect(*, protocol: int = 4, reason: int = 0, props: Props = None) -> bytes:
    if protocol == 5 and (reason or props):
        return packet(DISCONNECT, 0, bytes([reason]) + properties(props))
    return packet(DISCONNECT, 0)


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass
class Packet:
    type: int
    flags: int
    body: bytes

    @property
    def name(self) -> str:
        return PACKET_NAMES.get(self.type, f"type{self.type}")

    def __repr__(self) -> str:
        shown = self.body[:32].hex() + ("..." if len(self.body) > 32 else "")
        return f"<{self.name} flags={self.flags:#x} len={len(self.body)} {shown}>"


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"timed out with {len(buf)}/{n} bytes of a packet")
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            raise TimeoutError(f"timed out with {len(buf)}/{n} bytes of a packet") from None
        except OSError as e:  # ECONNRESET, EPIPE, ...
            raise Closed(str(e)) from e
        if not chunk:
            raise Closed("connection closed by peer")
        buf += chunk
    return bytes(buf)


def read_packet(sock: socket.socket, timeout: float = 2.0) -> Packet:
    """Reads one whole packet. Reads exactly the packet's bytes, so a plain socket needs no
    buffer of its own. Raises ``TimeoutError`` or ``Closed``; ``ValueError`` when the
    remaining length is not a valid Variable Byte Integer."""
    deadline = time.monotonic() + timeout
    first = _recv_exact(sock, 1, deadline)[0]
    length, shift = 0, 0
    for _ in range(4):
        b = _recv_exact(sock, 1, deadline)[0]
        length += (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            break
    else:
        raise ValueError("remaining length longer than 4 bytes")
    return Packet(first >> 4, first & 0x0F, _recv_exact(sock, length, deadline))


class Reader:
    """Buffered packet reader for one socket: reads in large chunks, so it keeps up with a
    flood where ``read_packet`` (a few small reads per packet) would not. Do not mix it
    with ``read_packet`` on the same socket."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.buf = bytearray()

    def _parse(self) -> Packet | None:
        buf = self.buf
        length, shift, i = 0, 0, 1
        while True:
            if i >= len(buf):
                return None
            b = buf[i]
            length += (b & 0x7F) << shift
            shift += 7
            i += 1
            if not b & 0x80:
                break
            if i > 4:
                raise ValueError("remaining length longer than 4 bytes")
        if len(buf) < i + length:
            return None
        p = Packet(buf[0] >> 4, buf[0] & 0x0F, bytes(buf[i : i + length]))
        del buf[: i + length]
        return p

    def read(self, timeout: float = 2.0) -> Packet:
        """The next packet; raises ``TimeoutError`` or ``Closed`` like ``read_packet``."""
        deadline = time.monotonic() + timeout
        while (p := self._parse()) is None:
            self._fill(deadline)
        return p

    def read_available(self, timeout: float = 2.0) -> list[Packet]:
        """Every whole packet buffered after at most one wait of up to ``timeout``
        (possibly none). Raises ``Closed`` when the peer closed and nothing is left."""
        out: list[Packet] = []
        while (p := self._parse()) is not None:
            out.append(p)
        if out:
            return out
        try:
            self._fill(time.monotonic() + timeout)
        except TimeoutError:
            return out
        while (p := self._parse()) is not None:
            out.append(p)
        return out

    def _fill(self, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("timed out waiting for a packet")
        self.sock.settimeout(remaining)
        try:
            chunk = self.sock.recv(1 << 18)
        except TimeoutError:
            raise TimeoutError("timed out waiting for a packet") from None
        except OSError as e:
            raise Closed(str(e)) from e
        if not chunk:
            raise Closed("connection closed by peer")
        self.buf += chunk


def read_until_closed(sock: socket.socket, timeout: float = 2.0) -> tuple[bool, list[Packet]]:
    """Reads packets until the peer closes or resets (``True``) or ``timeout`` passes
    (``False``); returns that and the packets read on the way."""
    deadline = time.monotonic() + timeout
    packets: list[Packet] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False, packets
        try:
            packets.append(read_packet(sock, remaining))
        except Closed:
            return True, packets
        except TimeoutError:
            return False, packets
        except ValueError:  # garbage from the peer: not ours to judge here, keep draining
            return _drain_until_closed(sock, deadline), packets


def _drain_until_closed(sock: socket.socket, deadline: float) -> bool:
    while (remaining := deadline - time.monotonic()) > 0:
        sock.settimeout(remaining)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


def expect_closed(sock: socket.socket, timeout: float = 2.0) -> bool:
    """True when the peer closes or resets the connection within ``timeout``; whatever it
    sends before that is read and discarded."""
    return read_until_closed(sock, timeout)[0]


def is_open(sock: socket.socket, wait: float = 0.0) -> bool:
    """True when the peer has not closed within ``wait`` seconds (data is left unread)."""
    deadline = time.monotonic() + wait
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            data = sock.recv(1, socket.MSG_PEEK)
        except TimeoutError:
            if time.monotonic() >= deadline:
                return True
            continue
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        return True  # data waiting means still open (for now)


# ---------------------------------------------------------------------------------------------
# Parsing


class _Cursor:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("packet body too short")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def byte(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return struct.unpack("!H", self.take(2))[0]

    def u32(self) -> int:
        return struct.unpack("!I", self.take(4))[0]

    def varint(self) -> int:
        value, shift = 0, 0
        for _ in range(4):
            b = self.byte()
            value += (b & 0x7F) << shift
            shift += 7
            if not b & 0x80:
                return value
        raise ValueError("variable byte integer longer than 4 bytes")

    def string(self) -> str:
        return self.take(self.u16()).decode("utf-8")

    def binary(self) -> bytes:
        return self.take(self.u16())

    def properties(self) -> dict[int, Any]:
        """Parses a property block. Repeatable properties (user property, subscription
        identifier) come back as lists; others as their value."""
        end = self.varint() + self.pos
        if end > len(self.data):
            raise ValueError("property length past the end of the packet")
        props: dict[int, Any] = {}
        while self.pos < end:
            ident = self.varint()
            kind = PROPERTY_TYPES.get(ident)
            if kind == _BYTE:
                value: Any = self.byte()
            elif kind == _U16:
                value = self.u16()
            elif kind == _U32:
                value = self.u32()
            elif kind == _VARINT:
                value = self.varint()
            elif kind == _STR:
                value = self.string()
            elif kind == _BIN:
                value = self.binary()
            elif kind == _PAIR:
                value = (self.string(), self.string())
            else:
                raise ValueError(f"unknown property 0x{ident:02x}")
            if ident in (USER_PROPERTY, SUBSCRIPTION_IDENTIFIER):
                props.setdefault(ident, []).append(value)
            else:
                props[ident] = value
        if self.pos != end:
            raise ValueError("property block overran its length")
        return props


@dataclass
class Connack:
    session_present: bool
    reason: int  # the v5 reason code or the 3.1.1 return code
    props: dict[int, Any] = field(default_factory=dict)


@dataclass
class Suback:
    packet_id: int
    reasons: list[int]
    props: dict[int, Any] = field(default_factory=dict)


@dataclass
class Disconnect:
    reason: int
    props: dict[int, Any] = field(default_factory=dict)


@dataclass
class Publish:
    topic: str
    payload: bytes
    qos: int
    retain: bool
    dup: bool
    packet_id: int | None
    props: dict[int, Any] = field(default_factory=dict)


def parse_connack(p: Packet, protocol: int = 4) -> Connack:
    if p.type != CONNACK:
        raise ValueError(f"expected CONNACK, got {p!r}")
    c = _Cursor(p.body)
    ack_flags, reason = c.byte(), c.byte()
    props = c.properties() if protocol == 5 and c.left() else {}
    return Connack(bool(ack_flags & 1), reason, props)


def parse_suback(p: Packet, protocol: int = 4) -> Suback:
    if p.type != SUBACK:
        raise ValueError(f"expected SUBACK, got {p!r}")
    c = _Cursor(p.body)
    packet_id = c.u16()
    props = c.properties() if protocol == 5 else {}
    return Suback(packet_id, list(c.take(c.left())), props)


def parse_disconnect(p: Packet) -> Disconnect:
    """DISCONNECT as sent by a v5 server (an empty body means reason 0)."""
    if p.type != DISCONNECT:
        raise ValueError(f"expected DISCONNECT, got {p!r}")
    c = _Cursor(p.body)
    reason = c.byte() if c.left() else 0
    props = c.properties() if c.left() else {}
    return Disconnect(reason, props)


def parse_ack(p: Packet) -> tuple[int, int]:
    """PUBACK/PUBREC/PUBREL/PUBCOMP/UNSUBACK: (packet id, reason code or 0)."""
    c = _Cursor(p.body)
    packet_id = c.u16()
    return packet_id, (c.byte() if c.left() else 0)


def parse_publish(p: Packet, protocol: int = 4) -> Publish:
    if p.type != PUBLISH:
        raise ValueError(f"expected PUBLISH, got {p!r}")
    c = _Cursor(p.body)
    topic = c.string()
    qos = (p.flags >> 1) & 3
    packet_id = c.u16() if qos else None
    props = c.properties() if protocol == 5 else {}
    return Publish(
        topic, c.take(c.left()), qos, bool(p.flags & 1), bool(p.flags & 8), packet_id, props
    )


# ---------------------------------------------------------------------------------------------
# Convenience


def open_socket(host: str, port: int, timeout: float = 2.0, *, rcvbuf: int | None = None):
    """A connected TCP socket; ``rcvbuf`` (set before connecting) shrinks the receive
    window, for slow-consumer tests."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(timeout)
        sock.connect((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def connect_client(
    host: str,
    port: int,
    client_id: Str = "",
    *,
    protocol: int = 4,
    timeout: float = 2.0,
    rcvbuf: int | None = None,
    **connect_kw: Any,
) -> tuple[socket.socket, Connack]:
    """Opens a socket, sends CONNECT, reads the CONNACK and requires success."""
    sock = open_socket(host, port, timeout, rcvbuf=rcvbuf)
    try:
        sock.sendall(connect(client_id, protocol=protocol, **connect_kw))
        ack = parse_connack(read_packet(sock, timeout), protocol)
        if ack.reason != 0:
            raise ConnectionRefusedError(f"CONNACK reason 0x{ack.reason:02x}")
    except BaseException:
        sock.close()
        raise
    return sock, ack


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """``sendall`` that reports a peer reset/close as ``False`` instead of raising."""
    try:
        sock.sendall(data)
        return True
    except OSError:
        return False
