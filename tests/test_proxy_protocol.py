"""The PROXY protocol header parser (fastbroker.proxy_protocol), v1 and v2.

Headers are built here from the specification (haproxy's proxy-protocol.txt), independently
of the parser, then parsed back whole and in pieces. The reader contract is checked as a
listener uses it: ``bytes_needed`` never asks for a byte past the header.
"""

from __future__ import annotations

import ipaddress
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastbroker.proxy_protocol import (
    V1_MAX_LENGTH,
    V2_MAX_PAYLOAD,
    V2_SIGNATURE,
    ProxyHeader,
    ProxyProtocolError,
    bytes_needed,
    parse_proxy_header,
)

# ------------------------------------------------------------------------------ builders


def v1(family: str, source: tuple[str, int], destination: tuple[str, int]) -> bytes:
    return f"PROXY {family} {source[0]} {destination[0]} {source[1]} {destination[1]}\r\n".encode()


def v2(
    *,
    command: int = 1,
    family: int = 1,
    transport: int = 1,
    addresses: bytes = b"",
    tlvs: bytes = b"",
    version: int = 2,
    length: int | None = None,
) -> bytes:
    payload = addresses + tlvs
    size = len(payload) if length is None else length
    return (
        V2_SIGNATURE
        + bytes([(version << 4) | command, (family << 4) | transport])
        + struct.pack(">H", size)
        + payload
    )


def v2_inet(source: tuple[str, int], destination: tuple[str, int], tlvs: bytes = b"") -> bytes:
    src, dst = ipaddress.ip_address(source[0]), ipaddress.ip_address(destination[0])
    family = 1 if src.version == 4 else 2
    addresses = src.packed + dst.packed + struct.pack(">HH", source[1], destination[1])
    return v2(family=family, addresses=addresses, tlvs=tlvs)


def tlv(kind: int, value: bytes) -> bytes:
    return bytes([kind]) + struct.pack(">H", len(value)) + value


# ------------------------------------------------------------------------------ examples


def test_v1_tcp4() -> None:
    data = b"PROXY TCP4 192.168.0.1 192.168.0.11 56324 443\r\nMQTT"
    header = parse_proxy_header(data, "v1")
    assert header == ProxyHeader(1, ("192.168.0.1", 56324), ("192.168.0.11", 443), len(data) - 4)


def test_v1_tcp6() -> None:
    data = v1("TCP6", ("2001:db8::1", 1), ("::1", 65535))
    header = parse_proxy_header(data, "any")
    assert header == ProxyHeader(1, ("2001:db8::1", 1), ("::1", 65535), len(data))


def test_v1_unknown_ignores_the_rest_of_the_line() -> None:
    for data in (b"PROXY UNKNOWN\r\n", b"PROXY UNKNOWN ffff::1 ffff::2 1 2\r\n"):
        assert parse_proxy_header(data, "v1") == ProxyHeader(1, None, None, len(data))


def test_v1_longest_line_is_accepted_and_one_more_byte_is_not() -> None:
    longest = b"PROXY UNKNOWN " + b"x" * (V1_MAX_LENGTH - 16) + b"\r\n"
    assert len(longest) == V1_MAX_LENGTH
    assert parse_proxy_header(longest, "v1") == ProxyHeader(1, None, None, V1_MAX_LENGTH)
    too_long = b"PROXY UNKNOWN " + b"x" * (V1_MAX_LENGTH - 15) + b"\r\n"
    with pytest.raises(ProxyProtocolError, match="CRLF"):
        parse_proxy_header(too_long, "v1")


@pytest.mark.parametrize(
    "line",
    [
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1111\r\n",  # a field missing
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1111 2222 3333\r\n",  # one too many
        b"PROXY TCP4  1.2.3.4 5.6.7.8 1111 2222\r\n",  # two spaces
        b"PROXY TCP5 1.2.3.4 5.6.7.8 1111 2222\r\n",
        b"PROXY TCP4 1.2.3 5.6.7.8 1111 2222\r\n",
        b"PROXY TCP4 ::1 5.6.7.8 1111 2222\r\n",  # IPv6 in TCP4
        b"PROXY TCP6 1.2.3.4 ::1 1111 2222\r\n",  # IPv4 in TCP6
        b"PROXY TCP4 1.2.3.4 5.6.7.8 65536 2222\r\n",
        b"PROXY TCP4 1.2.3.4 5.6.7.8 01111 2222\r\n",  # leading zero
        b"PROXY TCP4 1.2.3.4 5.6.7.8 -1 2222\r\n",
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1111 2222\n",  # LF without CR
        b"PROXY TCP4 1.2.3.4\r5.6.7.8 1111 2222\r\n",
        b"PROXY TCP4 1.2.3.4 5.6.7.8 1111 \xff\r\n",
        b"proxy TCP4 1.2.3.4 5.6.7.8 1111 2222\r\n",
        b"\x10\x0e\x00\x04MQTT\x04\x02\x00<\x00\x02id",  # MQTT without a header
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",  # a TLS ClientHello
    ],
)
def test_v1_malformed(line: bytes) -> None:
    with pytest.raises(ProxyProtocolError):
        parse_proxy_header(line, "v1")


def test_v2_inet_with_tlvs_skipped() -> None:
    tlvs = tlv(0x01, b"mqtt") + tlv(0x05, b"unique-id") + tlv(0x20, b"\x01" + bytes(4))
    data = v2_inet(("10.1.2.3", 40000), ("10.0.0.1", 1883), tlvs) + b"\x10"
    header = parse_proxy_header(data, "v2")
    assert header == ProxyHeader(2, ("10.1.2.3", 40000), ("10.0.0.1", 1883), len(data) - 1)


def test_v2_inet6() -> None:
    data = v2_inet(("2001:db8::7", 5), ("2001:db8::1", 8883))
    assert parse_proxy_header(data, "any") == ProxyHeader(
        2, ("2001:db8::7", 5), ("2001:db8::1", 8883), 16 + 36
    )


def test_v2_local_and_addressless_families_keep_the_socket_address() -> None:
    local = v2(command=0, family=0, transport=0)
    assert parse_proxy_header(local, "v2") == ProxyHeader(2, None, None, 16)
    # LOCAL with addresses (a health check from the proxy): they are ignored.
    local_inet = v2(command=0, addresses=bytes(12))
    assert parse_proxy_header(local_inet, "v2") == ProxyHeader(2, None, None, 28)
    unspecified = v2(family=0, transport=0)
    assert parse_proxy_header(unspecified, "v2") == ProxyHeader(2, None, None, 16)
    unix = v2(family=3, addresses=bytes(216))
    assert parse_proxy_header(unix, "v2") == ProxyHeader(2, None, None, 16 + 216)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (v2(version=1, addresses=bytes(12)), "version 1"),
        (v2(command=2, addresses=bytes(12)), "command 2"),
        (v2(family=4, addresses=bytes(12)), "family"),
        (v2(transport=3, addresses=bytes(12)), "family"),
        (v2(transport=2, addresses=bytes(12)), "datagram"),
        (v2(addresses=bytes(11)), "too short"),
        (v2(family=2, addresses=bytes(12)), "too short"),
        (v2(length=V2_MAX_PAYLOAD + 1), "at most"),
        (V2_SIGNATURE[:11] + b"X" + bytes(4), "not a PROXY"),
    ],
)
def test_v2_malformed(data: bytes, match: str) -> None:
    with pytest.raises(ProxyProtocolError, match=match):
        parse_proxy_header(data, "v2")


def test_modes_accept_only_their_version() -> None:
    one = v1("TCP4", ("1.2.3.4", 1), ("5.6.7.8", 2))
    two = v2_inet(("1.2.3.4", 1), ("5.6.7.8", 2))
    assert parse_proxy_header(one, "any") is not None
    assert parse_proxy_header(two, "any") is not None
    with pytest.raises(ProxyProtocolError, match="v2"):
        parse_proxy_header(one, "v2")
    with pytest.raises(ProxyProtocolError, match="v1"):
        parse_proxy_header(two, "v1")
    with pytest.raises(ValueError, match="mode"):
        parse_proxy_header(one, "off")


def test_too_long_v2_is_refused_before_its_payload_arrives() -> None:
    # The length alone condemns it: no need to wait for 64 KiB.
    fixed = v2(length=65535)
    with pytest.raises(ProxyProtocolError):
        parse_proxy_header(fixed, "v2")


def test_garbage_fails_at_the_first_byte_that_cannot_start_a_header() -> None:
    with pytest.raises(ProxyProtocolError):
        parse_proxy_header(b"G", "any")
    with pytest.raises(ProxyProtocolError):
        parse_proxy_header(b"PROXX", "any")
    with pytest.raises(ProxyProtocolError):
        parse_proxy_header(b"\r\n\r\n\x00\r\nQUIX", "any")


# ------------------------------------------------------------------------------ properties

ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(str)
ports = st.integers(0, 65535)


@st.composite
def valid_headers(draw: st.DrawFn) -> tuple[bytes, ProxyHeader]:
    """A valid header of either version and what parsing it must give."""
    kind = draw(st.sampled_from(["v1-tcp4", "v1-tcp6", "v1-unknown", "v2-inet", "v2-local"]))
    if kind == "v2-local":
        data = v2(command=0, family=0, transport=0, tlvs=draw(st.binary(max_size=40)))
        return data, ProxyHeader(2, None, None, len(data))
    if kind == "v1-unknown":
        data = b"PROXY UNKNOWN\r\n"
        return data, ProxyHeader(1, None, None, len(data))
    addresses = ipv4 if kind in ("v1-tcp4",) else ipv6
    if kind == "v2-inet":
        addresses = draw(st.sampled_from([ipv4, ipv6]))
    source = (draw(addresses), draw(ports))
    destination_strategy = ipv4 if ":" not in source[0] else ipv6
    destination = (draw(destination_strategy), draw(ports))
    if kind.startswith("v1"):
        data = v1("TCP4" if kind == "v1-tcp4" else "TCP6", source, destination)
        return data, ProxyHeader(1, source, destination, len(data))
    tlvs = b"".join(
        tlv(k, v)
        for k, v in draw(
            st.lists(st.tuples(st.integers(0, 255), st.binary(max_size=30)), max_size=4)
        )
    )
    data = v2_inet(source, destination, tlvs)
    return data, ProxyHeader(2, source, destination, len(data))


@settings(max_examples=300, deadline=None)
@given(valid_headers(), st.binary(max_size=64), st.lists(st.integers(0, 300), max_size=6))
def test_valid_headers_parse_back_from_any_split(
    case: tuple[bytes, ProxyHeader], rest: bytes, cuts: list[int]
) -> None:
    data, expected = case
    stream = data + rest
    points = sorted({min(c, len(stream)) for c in cuts} | {len(stream)})
    parsed = None
    for point in points:
        parsed = parse_proxy_header(stream[:point], "any")
        if point < len(data):
            assert parsed is None, "a truncated header is incomplete, not an error"
        else:
            assert parsed == expected
    assert parsed == expected


@settings(max_examples=300, deadline=None)
@given(valid_headers(), st.binary(min_size=1, max_size=64))
def test_exact_reads_stop_at_the_end_of_the_header(
    case: tuple[bytes, ProxyHeader], rest: bytes
) -> None:
    data, expected = case
    stream = data + rest
    buffered = b""
    while (header := parse_proxy_header(buffered, "any")) is None:
        needed = bytes_needed(buffered, "any")
        assert 1 <= needed <= len(data) - len(buffered), "asked for a byte past the header"
        buffered += stream[len(buffered) : len(buffered) + needed]
    assert header == expected
    assert buffered == data


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200), st.sampled_from(["v1", "v2", "any"]))
def test_garbage_gives_a_header_none_or_proxy_protocol_error(data: bytes, mode: str) -> None:
    try:
        header = parse_proxy_header(data, mode)
    except ProxyProtocolError:
        return
    if header is not None:
        assert 0 < header.length <= len(data)
    else:
        assert bytes_needed(data, mode) >= 1


@settings(max_examples=300, deadline=None)
@given(valid_headers(), st.data())
def test_corrupted_headers_never_raise_anything_else(
    case: tuple[bytes, ProxyHeader], data: st.DataObject
) -> None:
    header = bytearray(case[0])
    index = data.draw(st.integers(0, len(header) - 1))
    header[index] = data.draw(st.integers(0, 255))
    try:
        parse_proxy_header(bytes(header), "any")
    except ProxyProtocolError:
        pass
