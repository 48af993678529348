"""Sans-I/O parser of the PROXY protocol header, versions 1 and 2.

A load balancer (HAProxy, AWS NLB, nginx, ...) in front of the broker sends this header first
on each connection, to tell the client's real address; see
https://www.haproxy.org/download/2.9/doc/proxy-protocol.txt. This module only parses bytes:
the listener (fastbroker.listeners) reads them and decides what to do.

``parse_proxy_header(data, mode)`` answers with the header once ``data`` holds all of it,
None while more bytes are needed (``bytes_needed`` then says at least how many, so a reader
can take exactly the header and not one byte of what follows, e.g. a TLS ClientHello), and
raises ProxyProtocolError, and only that, for anything else.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

MODES = ("off", "v1", "v2", "any")

V1_PREFIX = b"PROXY "
# The longest v1 line, CRLF included (spec section 2.1).
V1_MAX_LENGTH = 107
# The shortest: "PROXY UNKNOWN\r\n".
V1_MIN_LENGTH = 15
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_FIXED_LENGTH = 16
# Addresses plus TLVs. The format allows 65,535 bytes; real proxies send a few hundred, and
# each connection waiting for its header holds this much at most.
V2_MAX_PAYLOAD = 4096

V2_COMMAND_LOCAL = 0x0
V2_COMMAND_PROXY = 0x1
V2_FAMILY_UNSPEC = 0x0
V2_FAMILY_INET = 0x1
V2_FAMILY_INET6 = 0x2
V2_FAMILY_UNIX = 0x3
V2_TRANSPORT_UNSPEC = 0x0
V2_TRANSPORT_STREAM = 0x1
V2_TRANSPORT_DGRAM = 0x2
# Bytes of the address block per family: source and destination addresses, then ports.
V2_ADDRESS_LENGTHS = {V2_FAMILY_INET: 12, V2_FAMILY_INET6: 36, V2_FAMILY_UNIX: 216}


class ProxyProtocolError(ValueError):
    """The bytes are not a valid PROXY header (of an accepted version)."""


@dataclass(frozen=True)
class ProxyHeader:
    version: int
    # The client's address and the address it connected to, as the proxy saw them; None when
    # the header gives no usable address (v1 UNKNOWN, v2 LOCAL, UNIX or unspecified family):
    # the connection's own address is then the one to use.
    source: tuple[str, int] | None
    destination: tuple[str, int] | None
    # Bytes the header takes at the start of the stream.
    length: int


def parse_proxy_header(
    data: bytes | bytearray | memoryview, mode: str = "any"
) -> ProxyHeader | None:
    """The header at the start of ``data``; None if more bytes are needed."""
    data = bytes(data)
    version = detect_version(data, mode)
    if version is None:
        return None
    return parse_v1(data) if version == 1 else parse_v2(data)


def bytes_needed(data: bytes | bytearray | memoryview, mode: str = "any") -> int:
    """How many more bytes at least ``parse_proxy_header`` needs (>= 1), when it returned
    None for ``data``. Reading no more than this never reads past the header."""
    data = bytes(data)
    version = detect_version(data, mode)
    if version is None:
        # Either version may follow; the shorter minimum is safe for both.
        candidates = []
        if mode in ("v1", "any"):
            candidates.append(V1_MIN_LENGTH)
        if mode in ("v2", "any"):
            candidates.append(V2_FIXED_LENGTH)
        return max(1, min(candidates) - len(data))
    if version == 2:
        if len(data) < V2_FIXED_LENGTH:
            return V2_FIXED_LENGTH - len(data)
        return max(1, V2_FIXED_LENGTH + int.from_bytes(data[14:16], "big") - len(data))
    if len(data) < V1_MIN_LENGTH:
        return V1_MIN_LENGTH - len(data)
    # The line ends with CRLF: two more bytes unless half of it is already in.
    return 1 if data.endswith(b"\r") else 2


def detect_version(data: bytes, mode: str) -> int | None:
    """1 or 2 once ``data`` starts like that version's header; None while too short to tell."""
    if mode not in MODES or mode == "off":
        raise ValueError(f"mode must be one of v1, v2, any, got {mode!r}")
    accepts_v1 = mode in ("v1", "any")
    accepts_v2 = mode in ("v2", "any")
    if accepts_v2 and V2_SIGNATURE.startswith(data[:12]):
        return 2 if len(data) >= 12 else None
    if accepts_v1 and V1_PREFIX.startswith(data[:6]):
        return 1 if len(data) >= 6 else None
    expected = " or ".join(name for name, ok in (("v1", accepts_v1), ("v2", accepts_v2)) if ok)
    raise ProxyProtocolError(f"not a PROXY protocol {expected} header: starts {data[:12]!r}")


def parse_v1(data: bytes) -> ProxyHeader | None:
    end = data.find(b"\r\n", 0, V1_MAX_LENGTH)
    if end < 0:
        if len(data) >= V1_MAX_LENGTH:
            raise ProxyProtocolError(f"PROXY v1 line without CRLF in {V1_MAX_LENGTH} bytes")
        stray = data.find(b"\n")
        cr = data.find(b"\r")
        if stray >= 0 or 0 <= cr < len(data) - 1:
            raise ProxyProtocolError("PROXY v1 line with a stray CR or LF")
        check_v1_characters(data)
        return None
    line = data[:end]
    check_v1_characters(line)
    fields = line.decode("ascii").split(" ")
    length = end + 2
    if fields[1:2] == ["UNKNOWN"]:
        # The receiver must ignore whatever follows UNKNOWN (spec 2.1).
        return ProxyHeader(1, None, None, length)
    if len(fields) != 6 or fields[1] not in ("TCP4", "TCP6"):
        raise ProxyProtocolError(f"malformed PROXY v1 line {line[:V1_MAX_LENGTH]!r}")
    _, family, source_ip, destination_ip, source_port, destination_port = fields
    version = 4 if family == "TCP4" else 6
    source = (v1_address(source_ip, version), v1_port(source_port))
    destination = (v1_address(destination_ip, version), v1_port(destination_port))
    return ProxyHeader(1, source, destination, length)


def check_v1_characters(data: bytes) -> None:
    # Printable US-ASCII only: a binary stream (TLS, MQTT) fails at its first odd byte.
    body = data.rstrip(b"\r")
    if not all(0x20 <= byte < 0x7F for byte in body):
        raise ProxyProtocolError(f"PROXY v1 line with a non-printable byte: {body[:40]!r}")


def v1_address(text: str, version: int) -> str:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise ProxyProtocolError(f"PROXY v1 address {text!r} is not an IP address") from None
    if address.version != version:
        raise ProxyProtocolError(f"PROXY v1 address {text!r} is not IPv{version}")
    return str(address)


def v1_port(text: str) -> int:
    # Decimal without leading zeros (spec 2.1).
    if not text.isdigit() or not text.isascii() or (len(text) > 1 and text[0] == "0"):
        raise ProxyProtocolError(f"PROXY v1 port {text!r} is not a decimal number")
    port = int(text)
    if port > 65535:
        raise ProxyProtocolError(f"PROXY v1 port {port} is over 65535")
    return port


def parse_v2(data: bytes) -> ProxyHeader | None:
    if len(data) < V2_FIXED_LENGTH:
        if len(data) > 12:
            check_v2_fixed(data)
        return None
    payload_length = check_v2_fixed(data)
    length = V2_FIXED_LENGTH + payload_length
    if len(data) < length:
        return None
    command = data[12] & 0x0F
    family, transport = data[13] >> 4, data[13] & 0x0F
    if command == V2_COMMAND_LOCAL:
        # The proxy's own connection (a health check): its address is the real one.
        return ProxyHeader(2, None, None, length)
    if transport == V2_TRANSPORT_DGRAM:
        raise ProxyProtocolError("PROXY v2 header for a datagram (UDP) connection")
    payload = data[V2_FIXED_LENGTH:length]
    if family == V2_FAMILY_INET:
        source = (str(ipaddress.IPv4Address(payload[0:4])), int.from_bytes(payload[8:10], "big"))
        destination = (
            str(ipaddress.IPv4Address(payload[4:8])),
            int.from_bytes(payload[10:12], "big"),
        )
        return ProxyHeader(2, source, destination, length)
    if family == V2_FAMILY_INET6:
        source = (
            str(ipaddress.IPv6Address(payload[0:16])),
            int.from_bytes(payload[32:34], "big"),
        )
        destination = (
            str(ipaddress.IPv6Address(payload[16:32])),
            int.from_bytes(payload[34:36], "big"),
        )
        return ProxyHeader(2, source, destination, length)
    # UNIX sockets and unspecified families carry no host and port; TLVs are not used.
    return ProxyHeader(2, None, None, length)


def check_v2_fixed(data: bytes) -> int:
    """Checks the bytes of the fixed part that are in ``data``; returns the payload length
    once known (else 0)."""
    version, command = data[12] >> 4, data[12] & 0x0F
    if version != 2:
        raise ProxyProtocolError(f"PROXY v2 header with version {version}")
    if command not in (V2_COMMAND_LOCAL, V2_COMMAND_PROXY):
        raise ProxyProtocolError(f"PROXY v2 header with unknown command {command}")
    if len(data) < 14:
        return 0
    family, transport = data[13] >> 4, data[13] & 0x0F
    if family not in (V2_FAMILY_UNSPEC, *V2_ADDRESS_LENGTHS) or transport > V2_TRANSPORT_DGRAM:
        raise ProxyProtocolError(f"PROXY v2 header with unknown family/transport {data[13]:#04x}")
    if len(data) < V2_FIXED_LENGTH:
        return 0
    payload_length = int.from_bytes(data[14:16], "big")
    if payload_length > V2_MAX_PAYLOAD:
        raise ProxyProtocolError(
            f"PROXY v2 header of {payload_length} bytes (at most {V2_MAX_PAYLOAD} accepted)"
        )
    if command == V2_COMMAND_PROXY and payload_length < V2_ADDRESS_LENGTHS.get(family, 0):
        raise ProxyProtocolError(
            f"PROXY v2 header of {payload_length} bytes is too short for its addresses"
        )
    return payload_length
