#!/usr/bin/env python3
"""What moving a persistent session between nodes costs: the time from CONNECT to CONNACK, and
to the last queued message, for a client that reconnects to the node that holds its session
and for one that reconnects to another node of a 2-node cluster, side by side in one run.

    python bench/cluster_session_move.py [--rounds 3] [--queued 0,1000,10000]

Each round starts a fresh 2-node cluster (bench/cluster_hop.py's setup). A persistent MQTT
3.1.1 session (clean session 0) subscribes to one topic at QoS 1 on node 1 and goes away;
`--queued` QoS 1 messages of 64 bytes are published to it from node 1 (the nodes' session
queue limit, `max_queued_messages`, is raised to the largest count); the client then
connects again, over a raw socket (no client library in the timing), to node 1 ("same node")
or to node 2 ("other node", which claims the session from node 1), and reads until the
CONNACK and until the last queued PUBLISH. Only processes this script starts are stopped.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cluster_hop  # noqa: E402  (bench/cluster_hop.py, found through the path set above)

HOST = cluster_hop.HOST


def packet(kind: int, body: bytes) -> bytes:
    length, encoded = len(body), bytearray()
    while True:
        byte, length = length % 128, length // 128
        encoded.append(byte | (0x80 if length else 0))
        if not length:
            return bytes([kind]) + bytes(encoded) + body


def string(s: str) -> bytes:
    return len(s).to_bytes(2, "big") + s.encode()


def connect_packet(client_id: str) -> bytes:
    # MQTT 3.1.1, clean session 0 (connect flags 0), keepalive 60.
    return packet(0x10, string("MQTT") + b"\x04\x00" + (60).to_bytes(2, "big") + string(client_id))


class Reader:
    """Whole MQTT packets from a socket, acknowledging QoS 1 PUBLISHes as they come."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def next(self) -> tuple[int, bytes]:
        while True:
            if len(self.buf) >= 2:
                length, shift, i = 0, 0, 1
                while i < len(self.buf):
                    byte = self.buf[i]
                    length |= (byte & 0x7F) << shift
                    shift += 7
                    i += 1
                    if not byte & 0x80:
                        break
                else:
                    i = -1
                if i > 0 and len(self.buf) >= i + length:
                    kind, body = self.buf[0], self.buf[i : i + length]
                    self.buf = self.buf[i + length :]
                    return kind, body
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("closed by the broker")
            self.buf += data


def fill(address: str, client_id: str, topic: str, queued: int) -> None:
    """Makes the persistent session on `address` and queues `queued` messages for it."""
    host, port = address.rsplit(":", 1)
    sub = socket.create_connection((host, int(port)), timeout=10)
    sub.sendall(connect_packet(client_id))
    reader = Reader(sub)
    kind, body = reader.next()
    assert kind == 0x20 and body[1] == 0, f"CONNECT refused: {kind:#x} {body!r}"
    sub.sendall(packet(0x82, (1).to_bytes(2, "big") + string(topic) + b"\x01"))
    kind, body = reader.next()
    assert kind == 0x90, f"no SUBACK: {kind:#x} {body!r}"
    sub.sendall(packet(0xE0, b""))
    sub.close()
    pub = socket.create_connection((host, int(port)), timeout=10)
    pub.sendall(packet(0x10, string("MQTT") + b"\x04\x02\x00\x3c" + string(client_id + "-pub")))
    reader = Reader(pub)
    reader.next()
    payload = b"x" * 64
    acked = 0
    for start in range(0, queued, 500):
        batch = b""
        for i in range(start, min(queued, start + 500)):
            pkid = i % 65535 + 1
            batch += packet(0x32, string(topic) + pkid.to_bytes(2, "big") + payload)
        pub.sendall(batch)
        while acked < min(queued, start + 500):
            kind, _ = reader.next()
            acked += kind >> 4 == 4
    pub.close()


def reconnect(address: str, client_id: str, queued: int) -> tuple[float, float]:
    """Seconds until CONNACK and until the last queued message."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = Reader(sock)
    started = time.perf_counter()
    sock.sendall(connect_packet(client_id))
    kind, body = reader.next()
    connack = time.perf_counter() - started
    assert kind == 0x20 and body[0] == 1, f"no session present: {kind:#x} {body!r}"
    got = 0
    while got < queued:
        kind, body = reader.next()
        if kind >> 4 == 3:
            got += 1
            if kind & 0x06:
                sock.sendall(packet(0x40, body[2 + int.from_bytes(body[:2], "big") :][:2]))
    drained = time.perf_counter() - started
    sock.close()
    return connack, drained


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queued", default="0,1000,10000")
    args = parser.parse_args()
    counts = [int(q) for q in args.queued.split(",")]
    results: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r in range(args.rounds):
        for queued in counts:
            for where in ("same node", "other node"):
                base = Path(tempfile.mkdtemp(prefix="session-move-"))
                limit = {"max_queued_messages": max(counts)}
                setup = cluster_hop.start_cluster(base, None, nodes=2, mqtt_settings=limit)
                try:
                    client_id, topic = f"mover-{r}", f"move/{r}"
                    fill(setup.addrs[0], client_id, topic, queued)
                    target = setup.addrs[0 if where == "same node" else 1]
                    connack, drained = reconnect(target, client_id, queued)
                finally:
                    setup.stop()
                results.setdefault((queued, where), []).append((connack, drained))
                print(
                    f"round {r + 1}  queued {queued:>6}  {where:<10}  CONNACK "
                    f"{connack * 1e3:8.2f} ms  last message {drained * 1e3:8.2f} ms",
                    flush=True,
                )
    print("\nqueued | reconnect to | CONNACK ms (median) | last queued message ms (median)")
    for (queued, where), values in sorted(results.items()):
        connack = statistics.median(v[0] for v in values) * 1e3
        drained = statistics.median(v[1] for v in values) * 1e3
        print(f"{queued} | {where} | {connack:.2f} | {drained:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
