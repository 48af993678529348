"""MQTT over WebSocket: the opening handshake (fastbroker.websocket), the compiled frame codec
(fastbroker_core.WebSocketCodec), and a broker with a ws listener end to end, with paho-mqtt
and with raw sockets sending bad handshakes and bad frames.

Frames are built and parsed here from RFC 6455, independently of the codec under test.
"""

from __future__ import annotations

import base64
import os
import socket
import struct
import threading
import time

import fastbroker_core
import paho.mqtt.client as mqtt
import pytest
import rawmqtt
from brokers import BrokerProcess, free_port, start_fastbroker, stop_later
from hypothesis import given, settings
from hypothesis import strategies as st

from fastbroker.websocket import (
    MAX_REQUEST_SIZE,
    HandshakeError,
    accept_key,
    error_response,
    parse_request,
    request_end,
    switching_protocols,
)

BINARY, TEXT, CONTINUATION, CLOSE, PING, PONG = 0x2, 0x1, 0x0, 0x8, 0x9, 0xA

# ------------------------------------------------------------------------------ frames


def client_frame(
    opcode: int,
    payload: bytes = b"",
    *,
    fin: bool = True,
    mask: bytes = b"\x37\xfa\x21\x3d",
    masked: bool = True,
    rsv: int = 0,
) -> bytes:
    n = len(payload)
    head = bytes([(0x80 if fin else 0) | (rsv << 4) | opcode])
    bit = 0x80 if masked else 0
    if n < 126:
        head += bytes([bit | n])
    elif n < 65536:
        head += bytes([bit | 126]) + struct.pack(">H", n)
    else:
        head += bytes([bit | 127]) + struct.pack(">Q", n)
    if not masked:
        return head + payload
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def parse_server_frames(data: bytes) -> tuple[list[tuple[bool, int, bytes]], bytes]:
    """(fin, opcode, payload) of each whole server frame in ``data``, and the rest. Server
    frames must not be masked and must use the shortest length encoding."""
    frames = []
    while len(data) >= 2:
        fin, opcode = bool(data[0] & 0x80), data[0] & 0x0F
        assert data[0] & 0x70 == 0, "reserved bits set"
        assert not data[1] & 0x80, "a server frame is masked"
        n, at = data[1] & 0x7F, 2
        if n == 126:
            if len(data) < 4:
                break
            n, at = struct.unpack(">H", data[2:4])[0], 4
            assert n >= 126, "length not minimal"
        elif n == 127:
            if len(data) < 10:
                break
            n, at = struct.unpack(">Q", data[2:10])[0], 10
            assert n >= 65536, "length not minimal"
        if len(data) < at + n:
            break
        frames.append((fin, opcode, data[at : at + n]))
        data = data[at + n :]
    return frames, data


def server_frame(opcode: int, payload: bytes) -> bytes:
    """An unmasked frame with FIN, as the broker writes them."""
    n = len(payload)
    if n < 126:
        return bytes([0x80 | opcode, n]) + payload
    if n < 65536:
        return bytes([0x80 | opcode, 126]) + struct.pack(">H", n) + payload
    return bytes([0x80 | opcode, 127]) + struct.pack(">Q", n) + payload


def split_packets(stream: bytes) -> tuple[list[rawmqtt.Packet], bytes]:
    """The whole MQTT packets at the start of ``stream``, and the rest."""
    packets = []
    while len(stream) >= 2:
        length, shift, at = 0, 0, 1
        while at < len(stream):
            byte = stream[at]
            length += (byte & 0x7F) << shift
            shift += 7
            at += 1
            if not byte & 0x80:
                break
        else:
            break
        if len(stream) < at + length:
            break
        packets.append(rawmqtt.Packet(stream[0] >> 4, stream[0] & 0x0F, stream[at : at + length]))
        stream = stream[at + length :]
    return packets, stream


def close_code(frame: tuple[bool, int, bytes]) -> int:
    fin, opcode, payload = frame
    assert fin and opcode == CLOSE, frame
    return struct.unpack(">H", payload[:2])[0]


# ------------------------------------------------------------------------------ handshake

KEY = "dGhlIHNhbXBsZSBub25jZQ=="


def request(
    *,
    method: str = "GET",
    target: str = "/mqtt",
    version: str = "HTTP/1.1",
    headers: dict[str, str] | None = None,
    drop: tuple[str, ...] = (),
) -> bytes:
    fields = {
        "Host": "broker.example:8083",
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": KEY,
        "Sec-WebSocket-Version": "13",
        "Sec-WebSocket-Protocol": "mqtt",
    }
    fields.update(headers or {})
    lines = [f"{method} {target} {version}"]
    lines += [f"{k}: {v}" for k, v in fields.items() if k not in drop]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_accept_key_of_rfc_6455_example() -> None:
    assert accept_key(KEY) == "s3pPLMBiTxaQ9kYGzzhZRbK+xOo="


def test_valid_request_gets_101_with_the_asked_subprotocol() -> None:
    head = request(headers={"Connection": "keep-alive, Upgrade", "Upgrade": "WebSocket"})
    assert request_end(head + b"\x82") == len(head)
    upgrade = parse_request(head)
    assert upgrade.subprotocol == "mqtt"
    response = switching_protocols(upgrade).decode()
    assert response.startswith("HTTP/1.1 101 Switching Protocols\r\n")
    assert "\r\nSec-WebSocket-Accept: s3pPLMBiTxaQ9kYGzzhZRbK+xOo=\r\n" in response
    assert "\r\nSec-WebSocket-Protocol: mqtt\r\n" in response
    assert response.endswith("\r\n\r\n")


def test_subprotocol_choice() -> None:
    assert parse_request(request(headers={"Sec-WebSocket-Protocol": "mqttv3.1"})).subprotocol == (
        "mqttv3.1"
    )
    offered = {"Sec-WebSocket-Protocol": "chat, mqtt, mqttv3.1"}
    assert parse_request(request(headers=offered)).subprotocol == "mqtt"


def test_path_rules() -> None:
    assert parse_request(request(target="/mqtt?token=x")).path == "/mqtt?token=x"
    assert parse_request(request(target="/anything"), path="").path == "/anything"
    with pytest.raises(HandshakeError) as error:
        parse_request(request(target="/other"))
    assert error.value.status == 404


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (request(drop=("Sec-WebSocket-Key",)), 400),
        (request(headers={"Sec-WebSocket-Key": "c2hvcnQ="}), 400),  # not 16 bytes
        (request(headers={"Sec-WebSocket-Key": "not base64!!!!!!!!!!!!=="}), 400),
        (request(headers={"Sec-WebSocket-Version": "8"}), 426),
        (request(drop=("Sec-WebSocket-Version",)), 426),
        (request(drop=("Sec-WebSocket-Protocol",)), 400),
        (request(headers={"Sec-WebSocket-Protocol": "chat"}), 400),
        (request(drop=("Upgrade",)), 400),
        (request(headers={"Connection": "keep-alive"}), 400),
        (request(drop=("Host",)), 400),
        (request(method="POST"), 405),
        (request(version="HTTP/1.0"), 400),
        (request(headers={" folded": "x"}), 400),
        (b"GET /mqtt\r\n\r\n", 400),
        (b"\xff\xfe\r\n\r\n", 400),
    ],
)
def test_bad_requests(head: bytes, status: int) -> None:
    with pytest.raises(HandshakeError) as error:
        parse_request(head[: request_end(head)])
    assert error.value.status == status


def test_wrong_version_says_which_one() -> None:
    with pytest.raises(HandshakeError) as error:
        parse_request(request(headers={"Sec-WebSocket-Version": "8"}))
    response = error_response(error.value.status, error.value.reason, error.value.headers)
    assert response.startswith(b"HTTP/1.1 426 Upgrade Required\r\n")
    assert b"\r\nSec-WebSocket-Version: 13\r\n" in response


def test_request_head_is_bounded() -> None:
    assert request_end(b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 10) is None
    with pytest.raises(HandshakeError) as error:
        request_end(b"GET / HTTP/1.1\r\n" + b"X" * MAX_REQUEST_SIZE)
    assert error.value.status == 431


# ------------------------------------------------------------------------------ codec


def test_codec_examples() -> None:
    codec = fastbroker_core.WebSocketCodec(1000)
    payload, replies, closed = codec.decode(
        client_frame(BINARY, b"\x10\x00") + client_frame(PING, b"hb")
    )
    assert (payload, closed) == (b"\x10\x00", None)
    assert parse_server_frames(replies) == ([(True, PONG, b"hb")], b"")
    # Pongs (unsolicited heartbeats) are ignored.
    assert codec.decode(client_frame(PONG, b"x")) == (b"", b"", None)
    payload, replies, closed = codec.decode(client_frame(CLOSE, struct.pack(">H", 1001) + b"bye"))
    assert closed == 1001 and codec.closed == 1001
    assert close_code(parse_server_frames(replies)[0][0]) == 1001
    assert codec.decode(client_frame(BINARY, b"more")) == (b"", b"", 1001)


def test_close_without_code_is_answered_without_one() -> None:
    codec = fastbroker_core.WebSocketCodec()
    _, replies, closed = codec.decode(client_frame(CLOSE))
    assert closed == 1005
    assert parse_server_frames(replies)[0][0] == (True, CLOSE, b"")


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (client_frame(BINARY, b"abc", masked=False), 1002),
        (client_frame(TEXT, b"{}"), 1003),
        (client_frame(BINARY, b"a", rsv=4), 1002),
        (client_frame(0x3, b"a"), 1002),
        (client_frame(CONTINUATION, b"a"), 1002),
        (client_frame(BINARY, b"a", fin=False) + client_frame(BINARY, b"b"), 1002),
        (client_frame(PING, b"", fin=False), 1002),
        (client_frame(PING, b"p" * 126), 1002),
        (client_frame(CLOSE, b"\x03"), 1002),
        (client_frame(CLOSE, struct.pack(">H", 1005)), 1002),
        (client_frame(CLOSE, struct.pack(">H", 999)), 1002),
        (client_frame(CLOSE, struct.pack(">H", 1000) + b"\xc3"), 1007),
        (client_frame(BINARY, bytes(101)), 1009),
        (client_frame(BINARY, bytes(60), fin=False) + client_frame(CONTINUATION, bytes(60)), 1009),
    ],
)
def test_codec_violations(data: bytes, code: int) -> None:
    codec = fastbroker_core.WebSocketCodec(100)
    _, replies, closed = codec.decode(data)
    assert closed == code
    frames, rest = parse_server_frames(replies)
    assert rest == b"" and close_code(frames[-1]) == code


def test_oversized_frame_is_refused_from_its_header() -> None:
    # A 1 GiB frame is refused when its 10-byte header arrives: nothing is buffered for it.
    codec = fastbroker_core.WebSocketCodec(1 << 20)
    header = bytes([0x82, 0x80 | 127]) + struct.pack(">Q", 1 << 30) + b"\x00\x00\x00\x00"
    assert codec.decode(header)[2] == 1009


def test_close_frame() -> None:
    codec = fastbroker_core.WebSocketCodec()
    frames, _ = parse_server_frames(codec.close_frame(1001, "é" * 100))
    assert close_code(frames[0]) == 1001
    assert len(frames[0][2]) <= 125
    frames[0][2][2:].decode()  # cut on a character boundary
    with pytest.raises(ValueError):
        codec.close_frame(1005)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=70_000))
def test_encode_is_one_minimal_binary_frame(data: bytes) -> None:
    frames, rest = parse_server_frames(fastbroker_core.WebSocketCodec().encode(data))
    assert frames == [(True, BINARY, data)] and rest == b""


messages = st.lists(
    st.tuples(
        st.lists(st.binary(max_size=300), min_size=1, max_size=4),  # fragments of a message
        st.one_of(st.none(), st.binary(max_size=125)),  # a ping after its first fragment
        st.binary(min_size=4, max_size=4),  # the mask
    ),
    max_size=8,
)


@settings(max_examples=300, deadline=None)
@given(messages, st.lists(st.integers(0, 4000), max_size=10))
def test_any_stream_decodes_the_same_whatever_the_reads(
    stream: list[tuple[list[bytes], bytes | None, bytes]], cuts: list[int]
) -> None:
    wire = b""
    expected_payload = b""
    expected_pongs = []
    for fragments, ping, mask in stream:
        for i, fragment in enumerate(fragments):
            opcode = BINARY if i == 0 else CONTINUATION
            wire += client_frame(opcode, fragment, fin=i == len(fragments) - 1, mask=mask)
            expected_payload += fragment
            if i == 0 and ping is not None:
                wire += client_frame(PING, ping, mask=mask)
                expected_pongs.append((True, PONG, ping))
    codec = fastbroker_core.WebSocketCodec(1 << 20)
    payload, replies = b"", b""
    start = 0
    for point in sorted({min(c, len(wire)) for c in cuts} | {len(wire)}):
        out, answer, closed = codec.decode(wire[start:point])
        assert closed is None
        payload += out
        replies += answer
        start = point
    assert payload == expected_payload
    assert parse_server_frames(replies) == (expected_pongs, b"")
    assert codec.buffered == 0


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=400), st.integers(1, 300))
def test_arbitrary_bytes_never_raise(data: bytes, limit: int) -> None:
    codec = fastbroker_core.WebSocketCodec(limit)
    payload, replies, closed = codec.decode(data)
    assert len(payload) <= len(data)
    assert codec.buffered <= 14 + 125
    if closed is not None:
        frames, rest = parse_server_frames(replies)
        assert rest == b"" and frames[-1][1] == CLOSE


# ------------------------------------------------------------------------------ end to end

HANDSHAKE_TIMEOUT_MS = 1000


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> BrokerProcess:
    ws_port = free_port()
    listeners = f'[[listeners]]\nname = "ws"\ntype = "ws"\nport = {ws_port}\n'
    bp = start_fastbroker(
        tmp_path_factory.mktemp("ws"),
        connect_timeout_ms=HANDSHAKE_TIMEOUT_MS,
        max_packet_size=2_000_000,
        extra_toml=listeners,
    )
    bp.ws_port = ws_port  # type: ignore[attr-defined]
    yield bp
    stop_later(bp)


class WsClient:
    """A raw WebSocket client: the handshake, masked frames out, frames in."""

    def __init__(self, port: int, head: bytes | None = None, timeout: float = 5.0):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.buffer = b""
        if head is not None:
            self.sock.sendall(head)

    def response(self) -> bytes:
        """The HTTP response head (and the body of an error, which closes)."""
        while b"\r\n\r\n" not in self.buffer:
            chunk = self.sock.recv(65536)
            if not chunk:
                break
            self.buffer += chunk
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        return head

    def upgrade(self) -> bytes:
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(request(headers={"Sec-WebSocket-Key": key}))
        head = self.response()
        assert head.startswith(b"HTTP/1.1 101 "), head
        assert f"Sec-WebSocket-Accept: {accept_key(key)}".encode() in head
        return head

    def send(self, opcode: int, payload: bytes = b"", **kw: object) -> None:
        self.sock.sendall(client_frame(opcode, payload, **kw))  # type: ignore[arg-type]

    def frames(self, count: int = 1) -> list[tuple[bool, int, bytes]]:
        frames: list[tuple[bool, int, bytes]] = []
        while True:
            got, self.buffer = parse_server_frames(self.buffer)
            frames += got
            if len(frames) >= count:
                # Frames beyond ``count`` go back in front of the buffer.
                extra = b"".join(server_frame(o, p) for _, o, p in frames[count:])
                self.buffer = extra + self.buffer
                return frames[:count]
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise rawmqtt.Closed(f"closed after {frames}")
            self.buffer += chunk

    def mqtt_packets(self, count: int) -> list[rawmqtt.Packet]:
        """The next ``count`` MQTT packets, from the binary frames that carry them (control
        frames are skipped)."""
        stream = b""
        while True:
            packets, rest = split_packets(stream)
            if len(packets) >= count:
                assert not rest
                return packets
            _, opcode, payload = self.frames(1)[0]
            if opcode in (BINARY, CONTINUATION):
                stream += payload

    def closed_by_server(self, timeout: float = 3.0) -> bool:
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


def connect_over_ws(port: int, client_id: str) -> WsClient:
    client = WsClient(port)
    client.upgrade()
    client.send(BINARY, rawmqtt.connect(client_id))
    frames = client.frames(1)
    assert frames[0][1] == BINARY and frames[0][2][:1] == b"\x20", frames  # CONNACK
    assert rawmqtt.parse_connack(rawmqtt.Packet(2, 0, frames[0][2][2:])).reason == 0
    return client


def paho_client(client_id: str, port: int, transport: str = "tcp") -> mqtt.Client:
    client = mqtt.Client(
        mqtt.CallbackAPIVersion.VERSION2,
        client_id=client_id,
        transport=transport,  # type: ignore[arg-type]
        protocol=mqtt.MQTTv5,
    )
    if transport == "websockets":
        client.ws_set_options(path="/mqtt")
    connected = threading.Event()
    client.on_connect = lambda c, u, f, rc, p: connected.set()
    client.connect("127.0.0.1", port)
    client.loop_start()
    assert connected.wait(5), f"{client_id} did not connect on port {port}"
    return client


def test_paho_over_websocket_all_qos_large_and_many(broker: BrokerProcess) -> None:
    ws_port = broker.ws_port  # type: ignore[attr-defined]
    received: list[tuple[str, bytes, int]] = []
    done = threading.Event()
    expected = 3 + 1 + 500

    def on_message(client: mqtt.Client, userdata: object, message: mqtt.MQTTMessage) -> None:
        received.append((message.topic, message.payload, message.qos))
        if len(received) == expected:
            done.set()

    subscriber = paho_client("ws-sub", ws_port, "websockets")
    subscriber.on_message = on_message
    subscribed = threading.Event()
    subscriber.on_subscribe = lambda *args: subscribed.set()
    subscriber.subscribe("ws/#", qos=2)
    assert subscribed.wait(5)
    tcp_publisher = paho_client("tcp-pub", broker.port)
    ws_publisher = paho_client("ws-pub", ws_port, "websockets")
    try:
        for qos in (0, 1, 2):
            ws_publisher.publish(f"ws/qos{qos}", f"q{qos}".encode(), qos=qos).wait_for_publish(5)
        big = os.urandom(1_000_000)
        tcp_publisher.publish("ws/big", big, qos=1).wait_for_publish(10)
        for i in range(500):
            ws_publisher.publish("ws/small", str(i).encode(), qos=1)
        assert done.wait(20), f"{len(received)} of {expected} messages arrived"
    finally:
        for client in (subscriber, tcp_publisher, ws_publisher):
            client.disconnect()
            client.loop_stop()
    by_topic = {topic: (payload, qos) for topic, payload, qos in received[:4]}
    assert by_topic["ws/qos0"] == (b"q0", 0)
    assert by_topic["ws/qos1"] == (b"q1", 1)
    assert by_topic["ws/qos2"] == (b"q2", 2)
    assert by_topic["ws/big"] == (big, 1)
    assert [payload for topic, payload, _ in received if topic == "ws/small"] == [
        str(i).encode() for i in range(500)
    ]


@pytest.mark.parametrize(
    ("head", "status"),
    [
        (request(drop=("Sec-WebSocket-Key",)), b"400"),
        (request(headers={"Sec-WebSocket-Version": "7"}), b"426"),
        (request(drop=("Sec-WebSocket-Protocol",)), b"400"),
        (request(target="/elsewhere"), b"404"),
        (b"GET /mqtt HTTP/1.1\r\n" + b"X-Filler: " + b"a" * 9000 + b"\r\n\r\n", b"431"),
        (b"\x10\x0c\x00\x04MQTT\x04\x02\x00\x3c\x00\x00\r\n\r\n", b"400"),  # MQTT, not HTTP
    ],
)
def test_bad_handshakes_are_refused_cleanly(
    broker: BrokerProcess, head: bytes, status: bytes
) -> None:
    client = WsClient(broker.ws_port, head)  # type: ignore[attr-defined]
    try:
        response = client.response()
        assert response.split(b" ")[1] == status, response
        assert client.closed_by_server()
    finally:
        client.close()


def test_slowloris_handshake_times_out_and_others_are_served(broker: BrokerProcess) -> None:
    ws_port = broker.ws_port  # type: ignore[attr-defined]
    slow = WsClient(ws_port)
    started = time.monotonic()
    try:
        for piece in (b"GET /mqtt HTTP/1.1\r\n", b"Host: x\r\n", b"Upgrade: websocket\r\n"):
            slow.sock.sendall(piece)
            # Meanwhile, another client goes all the way through.
            other = connect_over_ws(ws_port, f"meanwhile-{len(piece)}")
            other.close()
            time.sleep(0.2)
        response = slow.response()
        assert response.startswith(b"HTTP/1.1 408 "), response
        assert slow.closed_by_server()
        elapsed = time.monotonic() - started
        assert HANDSHAKE_TIMEOUT_MS / 1000 - 0.2 < elapsed < HANDSHAKE_TIMEOUT_MS / 1000 + 2
    finally:
        slow.close()


def test_frames_on_a_live_connection(broker: BrokerProcess) -> None:
    ws_port = broker.ws_port  # type: ignore[attr-defined]
    client = connect_over_ws(ws_port, "frames")
    try:
        # An MQTT packet split over frames and a fragmented message, with a ping between.
        packet = rawmqtt.subscribe(1, [("frames/t", 1)])
        client.send(BINARY, packet[:3], fin=False)
        client.send(PING, b"hb")
        client.send(CONTINUATION, packet[3:5], fin=False)
        client.send(CONTINUATION, packet[5:])
        frames = client.frames(2)
        assert frames[0] == (True, PONG, b"hb")
        assert frames[1][2][:1] == b"\x90"  # SUBACK
        # PINGREQ and PUBLISH in one frame: WebSocket and MQTT boundaries are independent.
        client.send(BINARY, rawmqtt.pingreq() + rawmqtt.publish("frames/t", b"x", qos=1))
        packets = client.mqtt_packets(3)
        assert packets[0].type == rawmqtt.PINGRESP
        assert sorted(p.type for p in packets[1:]) == [rawmqtt.PUBLISH, rawmqtt.PUBACK]
        # A text frame ends the connection with 1003.
        client.send(TEXT, b"{}")
        assert close_code(client.frames(1)[0]) == 1003
        assert client.closed_by_server()
    finally:
        client.close()


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (client_frame(BINARY, rawmqtt.pingreq(), masked=False), 1002),
        (client_frame(BINARY, b"\x00" * 10, rsv=2), 1002),
        (client_frame(CLOSE, struct.pack(">H", 1000)), 1000),
    ],
)
def test_violations_and_close_end_the_connection(
    broker: BrokerProcess, frame: bytes, code: int
) -> None:
    client = connect_over_ws(broker.ws_port, f"close-{code}")  # type: ignore[attr-defined]
    try:
        client.sock.sendall(frame)
        frames = client.frames(1)
        assert close_code(frames[-1]) == code
        assert client.closed_by_server()
    finally:
        client.close()
    # The broker goes on serving.
    again = connect_over_ws(broker.ws_port, f"after-{code}")  # type: ignore[attr-defined]
    again.close()
