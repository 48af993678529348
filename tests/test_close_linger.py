"""A client always gets to read the packet the broker closes its connection with.

When the broker ends a connection (DISCONNECT with a reason code, a refusing CONNACK, a
shutdown), the client may still have bytes on their way. Closing a socket with unread bytes in
its receive buffer makes the kernel send a reset, and the reset discards what the client had not
read yet: the very packet that says why. So the broker half-closes, reads and discards until the
client closes or `[limits] close_linger_ms` passes (fastbroker._connection.Connection.linger).

Every case here reads with a raw socket to the end and tells an orderly end of stream (EOF) from
a reset: the packet must be read and the end must be EOF, for MQTT 5 and 3.1.1 alike.
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
import rawmqtt as r
from test_access_log import wait_for_lines

pytestmark = pytest.mark.timeout(60)


def read_to_end(sock: socket.socket, timeout: float = 5.0, *, answer_pubrec: bool = False):
    """Every packet the broker sends until the connection ends, and how it ended: "eof",
    "reset", "write failed" or "timeout". With ``answer_pubrec`` each PUBREC is answered
    with a PUBREL at once, as common client libraries do."""
    reader = r.Reader(sock)
    packets: list[r.Packet] = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            packet = reader.read(max(deadline - time.monotonic(), 0.001))
        except TimeoutError:
            return packets, "timeout"
        except r.Closed as closed:
            reset = isinstance(closed.__cause__, ConnectionResetError)
            return packets, "reset" if reset else "eof"
        packets.append(packet)
        if answer_pubrec and packet.type == r.PUBREC:
            packet_id = int.from_bytes(packet.body[:2], "big")
            try:
                sock.sendall(r.pubrel(packet_id, protocol=5))
            except OSError:
                # What a client library sees as BrokenPipeError: it stops there.
                return packets, "write failed"


def send_in_background(sock: socket.socket, data: bytes) -> threading.Thread:
    """Sends ``data`` from a thread (the broker may stop taking it), so the test reads
    meanwhile."""
    thread = threading.Thread(target=r.send_quietly, args=(sock, data), daemon=True)
    thread.start()
    return thread


def disconnects(packets: list[r.Packet]) -> list[int]:
    return [r.parse_disconnect(p).reason for p in packets if p.type == r.DISCONNECT]


def test_receive_maximum_burst_reads_disconnect_every_time(make_broker):
    # The scenario of the report: QoS 2 past the Receive Maximum in one burst, each PUBREC
    # answered with a PUBREL as it arrives. 20 runs: DISCONNECT 0x93 read every time.
    broker = make_broker("fastbroker")  # Receive Maximum 1024
    burst = b"".join(
        r.publish("rm/t", b"x" * 200, qos=2, packet_id=i, protocol=5) for i in range(1, 3000)
    )
    endings = []
    for run in range(20):
        sock, _ = r.connect_client(*broker.address, f"rm-{run}", protocol=5)
        with sock:
            sender = send_in_background(sock, burst)
            packets, end = read_to_end(sock, answer_pubrec=True)
            sender.join(5)
        endings.append((disconnects(packets), end))
    assert endings == [([r.RC_RECEIVE_MAXIMUM_EXCEEDED], "eof")] * 20, endings
    lines = wait_for_lines(broker, 40)
    gone = [line for line in lines if line["event"] == "disconnect"]
    assert len(gone) == 20
    # The access log has the reason the broker sent, not "connection lost".
    assert {line["reason_code"] for line in gone} == {r.RC_RECEIVE_MAXIMUM_EXCEEDED}, gone


@pytest.mark.parametrize("protocol", [4, 5], ids=["v311", "v5"])
def test_packet_too_large_with_more_input_behind(make_broker, protocol):
    broker = make_broker("fastbroker", max_packet_size=1024)
    sock, _ = r.connect_client(*broker.address, "big", protocol=protocol)
    with sock:
        # The oversized packet and more behind it: all unread when the broker decides.
        big = r.publish("mp/t", b"x" * 4000, protocol=protocol)
        sender = send_in_background(
            sock, big + r.publish("mp/t", b"y" * 500, protocol=protocol) * 2000
        )
        packets, end = read_to_end(sock)
        sender.join(5)
    assert end == "eof", (packets, end)
    assert disconnects(packets) == ([r.RC_PACKET_TOO_LARGE] if protocol == 5 else [])


@pytest.mark.parametrize("protocol", [4, 5], ids=["v311", "v5"])
def test_takeover_of_a_publishing_connection(make_broker, protocol):
    broker = make_broker("fastbroker")
    old, _ = r.connect_client(*broker.address, "twin", protocol=protocol)
    stop = threading.Event()

    def publish_forever() -> None:
        chunk = r.publish("to/t", b"z" * 64, protocol=protocol) * 100
        while not stop.is_set():
            if not r.send_quietly(old, chunk):
                return

    sender = threading.Thread(target=publish_forever, daemon=True)
    with old:
        sender.start()
        time.sleep(0.2)
        new, _ = r.connect_client(*broker.address, "twin", protocol=protocol)
        with new:
            packets, end = read_to_end(old)
            stop.set()
            sender.join(5)
    # The old connection kept sending until its end: the broker cut it off after the linger
    # (a reset is then expected), but only once the DISCONNECT was delivered.
    if protocol == 5:
        assert disconnects(packets) == [0x8E], packets
    assert end in ("eof", "reset"), end
    assert end == "eof" or protocol == 5


@pytest.mark.parametrize("protocol", [4, 5], ids=["v311", "v5"])
def test_refusing_connack_with_packets_behind_it(make_broker, protocol):
    broker = make_broker("fastbroker", max_client_id_len=8)
    with r.open_socket(*broker.address) as sock:
        tail = r.publish("x/y", b"p" * 500, protocol=protocol) * 2000
        sender = send_in_background(
            sock, r.connect("a-client-id-far-too-long", protocol=protocol) + tail
        )
        packets, end = read_to_end(sock)
        sender.join(5)
    assert end == "eof", (packets, end)
    assert [p.type for p in packets] == [r.CONNACK]
    assert r.parse_connack(packets[0], protocol).reason == (0x85 if protocol == 5 else 2)


def test_a_client_that_keeps_sending_is_cut_off_after_the_linger(make_broker):
    broker = make_broker(
        "fastbroker", max_packet_size=1024, extra_toml="[limits]\nclose_linger_ms = 500\n"
    )
    sock, _ = r.connect_client(*broker.address, "hose", protocol=5)
    stop = threading.Event()

    def send_forever() -> None:
        junk = r.publish("h/t", b"j" * 512, protocol=5) * 64
        while not stop.is_set() and r.send_quietly(sock, junk):
            pass

    with sock:
        sock.sendall(r.publish("h/t", b"x" * 4000, protocol=5))
        reader = r.Reader(sock)
        first = reader.read(5)
        decided = time.monotonic()
        assert first.type == r.DISCONNECT
        assert r.parse_disconnect(first).reason == r.RC_PACKET_TOO_LARGE
        sender = threading.Thread(target=send_forever, daemon=True)
        sender.start()
        sender.join(10)
        cut_after = time.monotonic() - decided
        stop.set()
    # Sending failed (the broker cut the socket off) well after the linger began, and not
    # much later than it ends.
    assert not sender.is_alive()
    assert 0.3 <= cut_after < 3.0, cut_after


def test_shutdown_sends_disconnect_0x8b(make_broker):
    broker = make_broker("fastbroker")
    v5, _ = r.connect_client(*broker.address, "v5-client", protocol=5)
    v311, _ = r.connect_client(*broker.address, "v311-client", protocol=4)
    with v5, v311:
        broker.proc.send_signal(signal.SIGTERM)
        packets5, end5 = read_to_end(v5)
        packets4, end4 = read_to_end(v311)
        assert broker.proc.wait(10) == 0
    assert (disconnects(packets5), end5) == ([0x8B], "eof")
    assert (packets4, end4) == ([], "eof")
