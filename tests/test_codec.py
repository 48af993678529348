"""The MQTT codec through its Python bindings: round trips of every packet type for MQTT
3.1.1 and 5.0 at random split points, arbitrary bytes, and malformed packets."""

from __future__ import annotations

import pytest
from fastbroker_core import CodecError, Decoder, encode_packet
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# ---- strategies -------------------------------------------------------------------------

# MQTT strings: UTF-8 (so no surrogates) without U+0000.
text = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"),
    max_size=8,
)
topic_name = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00+#"),
    min_size=1,
    max_size=12,
)
binary = st.binary(max_size=16)
flag = st.integers(0, 1)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFFFFFF)
qos = st.integers(0, 2)
pkid = st.integers(1, 0xFFFF)
byte = st.integers(0, 255)

PROPERTY_VALUES = {
    "payload_format_indicator": flag,
    "message_expiry_interval": u32,
    "content_type": text,
    "response_topic": text,
    "correlation_data": binary,
    "subscription_identifiers": st.lists(st.integers(1, 268_435_455), min_size=1, max_size=3),
    "session_expiry_interval": u32,
    "assigned_client_identifier": text,
    "server_keep_alive": u16,
    "authentication_method": text,
    "authentication_data": binary,
    "request_problem_information": flag,
    "will_delay_interval": u32,
    "request_response_information": flag,
    "response_information": text,
    "server_reference": text,
    "reason_string": text,
    "receive_maximum": st.integers(1, 0xFFFF),
    "topic_alias_maximum": u16,
    "topic_alias": st.integers(1, 0xFFFF),
    "maximum_qos": flag,
    "retain_available": flag,
    "user_properties": st.lists(st.lists(text, min_size=2, max_size=2), min_size=1, max_size=3),
    "maximum_packet_size": st.integers(1, 0xFFFFFFFF),
    "wildcard_subscription_available": flag,
    "subscription_identifier_available": flag,
    "shared_subscription_available": flag,
}

_MESSAGE = [
    "payload_format_indicator",
    "message_expiry_interval",
    "content_type",
    "response_topic",
    "correlation_data",
    "user_properties",
]
_ACK = ["reason_string", "user_properties"]

# Which properties each packet type (and a CONNECT's will) may carry: MQTT 5 table 2-4.
ALLOWED = {
    "connect": [
        "session_expiry_interval",
        "authentication_method",
        "authentication_data",
        "request_problem_information",
        "request_response_information",
        "receive_maximum",
        "topic_alias_maximum",
        "user_properties",
        "maximum_packet_size",
    ],
    "connack": [
        "session_expiry_interval",
        "assigned_client_identifier",
        "server_keep_alive",
        "authentication_method",
        "authentication_data",
        "response_information",
        "server_reference",
        "reason_string",
        "receive_maximum",
        "topic_alias_maximum",
        "maximum_qos",
        "retain_available",
        "user_properties",
        "maximum_packet_size",
        "wildcard_subscription_available",
        "subscription_identifier_available",
        "shared_subscription_available",
    ],
    "publish": [*_MESSAGE, "subscription_identifiers", "topic_alias"],
    "will": [*_MESSAGE, "will_delay_interval"],
    "puback": _ACK,
    "pubrec": _ACK,
    "pubrel": _ACK,
    "pubcomp": _ACK,
    "subscribe": ["subscription_identifiers", "user_properties"],
    "suback": _ACK,
    "unsubscribe": ["user_properties"],
    "unsuback": _ACK,
    "disconnect": ["session_expiry_interval", "server_reference", *_ACK],
    "auth": ["authentication_method", "authentication_data", *_ACK],
}


def properties(kind: str, protocol: int) -> st.SearchStrategy[dict]:
    if protocol == 4:
        return st.just({})
    optional = {name: PROPERTY_VALUES[name] for name in ALLOWED[kind]}
    if kind == "subscribe":  # at most one subscription identifier
        optional["subscription_identifiers"] = st.lists(
            st.integers(1, 268_435_455), min_size=1, max_size=1
        )
    return st.fixed_dictionaries({}, optional=optional)


def reason(protocol: int) -> st.SearchStrategy[int]:
    return byte if protocol == 5 else st.just(0)


def packets(protocol: int) -> st.SearchStrategy[dict]:
    """Valid packet dicts exactly as ``Decoder.feed`` returns them."""
    v5 = protocol == 5

    will = st.fixed_dictionaries(
        {
            "topic": topic_name,
            "payload": binary,
            "qos": qos,
            "retain": st.booleans(),
            "properties": properties("will", protocol),
        }
    )

    @st.composite
    def connect(draw):
        username = draw(st.none() | text)
        # 3.1.1 forbids a password without a user name.
        password = draw(st.none() | binary) if v5 or username is not None else None
        return {
            "type": "connect",
            "protocol": protocol,
            "clean_start": draw(st.booleans()),
            "keep_alive": draw(u16),
            "client_id": draw(text),
            "will": draw(st.none() | will),
            "username": username,
            "password": password,
            "properties": draw(properties("connect", protocol)),
        }

    # 3.1.1 return codes 0..5 come back as their MQTT 5 reason codes.
    connack_reason = byte if v5 else st.sampled_from([0, 0x84, 0x85, 0x88, 0x86, 0x87])
    connack = st.fixed_dictionaries(
        {
            "type": st.just("connack"),
            "session_present": st.booleans(),
            "reason_code": connack_reason,
            "properties": properties("connack", protocol),
        }
    )

    @st.composite
    def publish(draw):
        q = draw(qos)
        return {
            "type": "publish",
            "dup": draw(st.booleans()) if q else False,
            "qos": q,
            "retain": draw(st.booleans()),
            "topic": draw(topic_name),
            "pkid": draw(pkid) if q else 0,
            "properties": draw(properties("publish", protocol)),
            "payload": draw(st.binary(max_size=64)),
        }

    def ack(kind):
        return st.fixed_dictionaries(
            {
                "type": st.just(kind),
                "pkid": pkid,
                "reason_code": reason(protocol),
                "properties": properties(kind, protocol),
            }
        )

    subscription = st.fixed_dictionaries(
        {
            "filter": text,
            "qos": qos,
            "no_local": st.booleans() if v5 else st.just(False),
            "retain_as_published": st.booleans() if v5 else st.just(False),
            "retain_handling": st.integers(0, 2) if v5 else st.just(0),
        }
    )
    subscribe = st.fixed_dictionaries(
        {
            "type": st.just("subscribe"),
            "pkid": pkid,
            "filters": st.lists(subscription, min_size=1, max_size=4),
            "properties": properties("subscribe", protocol),
        }
    )
    suback = st.fixed_dictionaries(
        {
            "type": st.just("suback"),
            "pkid": pkid,
            "reason_codes": st.lists(byte if v5 else st.sampled_from([0, 1, 2, 0x80]), max_size=4),
            "properties": properties("suback", protocol),
        }
    )
    unsubscribe = st.fixed_dictionaries(
        {
            "type": st.just("unsubscribe"),
            "pkid": pkid,
            "filters": st.lists(text, min_size=1, max_size=4),
            "properties": properties("unsubscribe", protocol),
        }
    )
    unsuback = st.fixed_dictionaries(
        {
            "type": st.just("unsuback"),
            "pkid": pkid,
            "reason_codes": st.lists(byte, max_size=4) if v5 else st.just([]),
            "properties": properties("unsuback", protocol),
        }
    )

    def reason_only(kind):
        return st.fixed_dictionaries(
            {
                "type": st.just(kind),
                "reason_code": reason(protocol),
                "properties": properties(kind, protocol),
            }
        )

    choices = [
        connect(),
        connack,
        publish(),
        *(ack(k) for k in ("puback", "pubrec", "pubrel", "pubcomp")),
        subscribe,
        suback,
        unsubscribe,
        unsuback,
        st.just({"type": "pingreq"}),
        st.just({"type": "pingresp"}),
        reason_only("disconnect"),
    ]
    if v5:
        choices.append(reason_only("auth"))
    return st.one_of(choices)


@st.composite
def streams(draw):
    protocol = draw(st.sampled_from([4, 5]))
    pkts = draw(st.lists(packets(protocol), min_size=1, max_size=8))
    return protocol, pkts


def feed_in_chunks(decoder: Decoder, data: bytes, cuts: list[int]) -> list[dict]:
    out = []
    start = 0
    for cut in [*sorted(c % (len(data) + 1) for c in cuts), len(data)]:
        out += decoder.feed(data[start:cut])
        start = cut
    return out


# ---- round trips ------------------------------------------------------------------------


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.lists(st.integers(min_value=0), max_size=6))
def test_roundtrip_at_random_split_points(stream, cuts):
    protocol, pkts = stream
    data = b"".join(encode_packet(p, protocol) for p in pkts)
    decoder = Decoder(protocol)
    assert feed_in_chunks(decoder, data, cuts) == pkts
    assert decoder.buffered == 0


@pytest.mark.parametrize("protocol", [4, 5])
def test_every_type_byte_by_byte(protocol):
    # Every packet type at least once, fed one byte at a time.
    kinds = [
        {"type": "connect", "client_id": "c", "username": "u", "password": b"p"},
        {"type": "connack", "reason_code": 0x86},
        {"type": "publish", "topic": "a/b", "qos": 2, "pkid": 7, "payload": b"x"},
        {"type": "puback", "pkid": 1},
        {"type": "pubrec", "pkid": 2},
        {"type": "pubrel", "pkid": 3},
        {"type": "pubcomp", "pkid": 4},
        {"type": "subscribe", "pkid": 5, "filters": [{"filter": "a/#", "qos": 1}]},
        {"type": "suback", "pkid": 5, "reason_codes": [1]},
        {"type": "unsubscribe", "pkid": 6, "filters": ["a/#"]},
        {"type": "unsuback", "pkid": 6},
        {"type": "pingreq"},
        {"type": "pingresp"},
        {"type": "disconnect"},
    ]
    if protocol == 5:
        kinds.append({"type": "auth", "reason_code": 0x18})
    data = b"".join(encode_packet(p, protocol) for p in kinds)
    decoder = Decoder(protocol)
    got = []
    for i in range(len(data)):
        got += decoder.feed(data[i : i + 1])
    assert [p["type"] for p in got] == [p["type"] for p in kinds]
    assert got[0]["protocol"] == protocol and got[0]["password"] == b"p"
    assert got[1]["reason_code"] == 0x86
    assert got[2]["payload"] == b"x" and got[2]["pkid"] == 7
    # Encoding what was decoded gives the same bytes back.
    assert b"".join(encode_packet(p, protocol) for p in got) == data


def test_decoder_switches_to_the_connect_protocol():
    connect = encode_packet({"type": "connect", "client_id": "old"}, 4)
    # In 3.1.1 a PUBLISH has no property length: decoding it as 5.0 would differ.
    publish = encode_packet({"type": "publish", "topic": "t", "payload": b"\x00\x01"}, 4)
    decoder = Decoder(5)
    got = decoder.feed(connect + publish)
    assert got[0]["protocol"] == 4
    assert got[1]["payload"] == b"\x00\x01"


def test_encode_defaults_and_properties():
    data = encode_packet(
        {
            "type": "publish",
            "topic": "a",
            "properties": {
                "user_properties": [("k", "v")],
                "content_type": "json",
                "topic_alias": None,  # None means absent
            },
        }
    )
    [p] = Decoder().feed(data)
    assert p["properties"] == {"content_type": "json", "user_properties": [["k", "v"]]}
    assert p["qos"] == 0 and p["payload"] == b""


@pytest.mark.parametrize(
    "packet, protocol",
    [
        ({"type": "nope"}, 5),
        ({"type": "puback", "pkid": 1}, 3),
        ({"type": "puback"}, 5),  # missing pkid
        ({"type": "publish", "topic": "t", "qos": 3}, 5),
        ({"type": "publish", "topic": "x" * 65536}, 5),
        ({"type": "publish", "topic": "t", "properties": {"no_such": 1}}, 5),
        ({"type": "disconnect", "properties": {"user_properties": [["a", "b", "c"]]}}, 5),
        ({"type": "subscribe", "pkid": 1, "filters": [{"filter": "a", "retain_handling": 3}]}, 5),
    ],
)
def test_encode_rejects_bad_dicts(packet, protocol):
    with pytest.raises(ValueError):
        encode_packet(packet, protocol)


def test_encode_rejects_out_of_range_ints():
    with pytest.raises((OverflowError, ValueError)):
        encode_packet({"type": "puback", "pkid": 70000})
    with pytest.raises(TypeError):
        encode_packet({"type": "puback", "pkid": "one"})


# ---- arbitrary and damaged bytes --------------------------------------------------------


def check_any_bytes(data: bytes, protocol: int, cuts: list[int]) -> None:
    """Feeding must give packets or CodecError, never anything else; whatever decodes must
    survive encode -> decode unchanged."""
    decoder = Decoder(protocol, max_packet_size=1 << 16)
    try:
        got = feed_in_chunks(decoder, data, cuts)
    except CodecError as e:
        assert 0x80 <= e.reason_code <= 0xA2
        return
    current = protocol
    for p in got:
        again = Decoder(current).feed(encode_packet(p, current))
        assert again == [p]
        if p["type"] == "connect":
            current = p["protocol"]


@settings(max_examples=500)
@given(st.binary(max_size=200), st.sampled_from([4, 5]), st.lists(st.integers(0), max_size=4))
def test_arbitrary_bytes_never_crash(data, protocol, cuts):
    check_any_bytes(data, protocol, cuts)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(streams(), st.data())
def test_damaged_packets_never_crash(stream, data):
    # Valid streams with a few bytes overwritten reach much deeper than random bytes.
    protocol, pkts = stream
    raw = bytearray(b"".join(encode_packet(p, protocol) for p in pkts))
    for _ in range(data.draw(st.integers(1, 3))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(byte)
    check_any_bytes(bytes(raw), protocol, data.draw(st.lists(st.integers(0), max_size=3)))


# ---- malformed packets ------------------------------------------------------------------


def s(b: bytes) -> bytes:
    return len(b).to_bytes(2, "big") + b


def pkt(first: int, body: bytes) -> bytes:
    assert len(body) < 128
    return bytes([first, len(body)]) + body


def conn(name: bytes, level: int, flags: int, payload: bytes) -> bytes:
    """A CONNECT with keep alive 60 (and no properties: these are for 3.1.1 or fail first)."""
    return pkt(0x10, s(name) + bytes([level, flags, 0, 60]) + payload)


MALFORMED = [
    # (bytes, protocol, reason code)
    pytest.param(pkt(0x60, b"\x00\x01"), 5, 0x81, id="pubrel-flags"),
    pytest.param(pkt(0x80, b"\x00\x01" + s(b"a") + b"\x00"), 4, 0x81, id="subscribe-flags"),
    pytest.param(pkt(0x42, b"\x00\x01"), 5, 0x81, id="puback-flags"),
    pytest.param(pkt(0x36, s(b"t") + b"\x00\x01"), 4, 0x81, id="publish-qos3"),
    pytest.param(pkt(0x38, s(b"t")), 4, 0x81, id="publish-qos0-dup"),
    pytest.param(b"\x30\xff\xff\xff\xff\x01", 5, 0x81, id="remaining-length-5-bytes"),
    pytest.param(pkt(0x30, s(b"a/#") + b"\x00"), 5, 0x90, id="topic-wildcard"),
    pytest.param(pkt(0x30, s(b"") + b"\x00"), 5, 0x82, id="empty-topic-no-alias"),
    pytest.param(pkt(0x30, s(b"")), 4, 0x82, id="empty-topic-v311"),
    pytest.param(pkt(0x32, s(b"t") + b"\x00\x00"), 4, 0x82, id="publish-pkid-0"),
    pytest.param(pkt(0x40, b"\x00\x00"), 5, 0x82, id="puback-pkid-0"),
    pytest.param(pkt(0x82, b"\x00\x01\x00"), 5, 0x82, id="subscribe-no-filters"),
    pytest.param(pkt(0xA2, b"\x00\x01"), 4, 0x82, id="unsubscribe-no-filters"),
    pytest.param(pkt(0x82, b"\x00\x01\x00" + s(b"a") + b"\x30"), 5, 0x82, id="retain-handling-3"),
    pytest.param(pkt(0x82, b"\x00\x01\x00" + s(b"a") + b"\x40"), 5, 0x81, id="sub-reserved-bits"),
    pytest.param(pkt(0x82, b"\x00\x01" + s(b"a") + b"\x04"), 4, 0x81, id="sub-v311-upper-bits"),
    pytest.param(pkt(0x30, s(b"t") + b"\x04\x01\x00\x01\x01"), 5, 0x82, id="duplicate-property"),
    pytest.param(pkt(0x30, s(b"t") + b"\x02\x01\x02"), 5, 0x82, id="payload-format-2"),
    pytest.param(pkt(0x30, s(b"t") + b"\x02\x0b\x00"), 5, 0x82, id="subscription-id-0"),
    pytest.param(pkt(0x30, s(b"t") + b"\x03\x11\x00\x00"), 5, 0x81, id="property-not-allowed"),
    pytest.param(
        pkt(0x30, s(b"t") + b"\x06\x0b\xff\xff\xff\xff\x01"), 5, 0x81, id="varint-property-5-bytes"
    ),
    pytest.param(conn(b"MQIsdp", 0x03, 0x02, s(b"c")), 4, 0x84, id="mqisdp"),
    pytest.param(conn(b"MQTT", 0x06, 0x02, s(b"c")), 5, 0x84, id="level-6"),
    pytest.param(conn(b"MQTT", 0x04, 0x03, s(b"c")), 4, 0x81, id="reserved-flag"),
    pytest.param(conn(b"MQTT", 0x04, 0x08, s(b"c")), 4, 0x81, id="will-qos-no-will"),
    pytest.param(conn(b"MQTT", 0x04, 0x40, s(b"c") + s(b"pw")), 4, 0x81, id="password-only"),
    pytest.param(conn(b"MQTT", 0x04, 0x02, s(b"a\x00")), 4, 0x81, id="nul"),
    pytest.param(conn(b"MQTT", 0x04, 0x02, s(b"\xff")), 4, 0x81, id="bad-utf8"),
    pytest.param(b"\xc0\x01\x00", 4, 0x81, id="pingreq-with-body"),
    pytest.param(b"\xf0\x00", 4, 0x81, id="auth-in-v311"),
]


@pytest.mark.parametrize("data, protocol, code", MALFORMED)
def test_malformed(data, protocol, code):
    decoder = Decoder(protocol)
    with pytest.raises(CodecError) as info:
        decoder.feed(data)
    assert info.value.reason_code == code
    assert isinstance(info.value, ValueError)
    # A broken stream stays broken.
    with pytest.raises(CodecError):
        decoder.feed(b"\xc0\x00")


def test_too_large_before_the_body_arrives():
    decoder = Decoder(5, max_packet_size=100)
    with pytest.raises(CodecError) as info:
        decoder.feed(b"\x30\xc8\x01")  # announces 200 bytes of body
    assert info.value.reason_code == 0x95


def test_incomplete_is_buffered():
    data = encode_packet({"type": "publish", "topic": "t", "payload": b"abc"})
    decoder = Decoder()
    assert decoder.feed(data[:-1]) == []
    assert decoder.buffered == len(data) - 1
    assert len(decoder.feed(data[-1:])) == 1
    assert decoder.buffered == 0


def test_short_acks_v5():
    got = Decoder(5).feed(b"\x40\x02\x00\x05" + b"\x50\x03\x00\x06\x10" + b"\xe0\x00")
    assert got == [
        {"type": "puback", "pkid": 5, "reason_code": 0, "properties": {}},
        {"type": "pubrec", "pkid": 6, "reason_code": 0x10, "properties": {}},
        {"type": "disconnect", "reason_code": 0, "properties": {}},
    ]


def test_bad_decoder_arguments():
    with pytest.raises(ValueError):
        Decoder(3)
    with pytest.raises(ValueError):
        encode_packet({"type": "pingreq"}, 6)
