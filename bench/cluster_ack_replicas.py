#!/usr/bin/env python3
"""What copying persistent sessions costs: QoS 1 publishes to a persistent subscriber on one
node, and across a 3-node cluster with `[cluster] ack_replicas` 1 and 2, side by side in one
run.

    python bench/cluster_ack_replicas.py [--rounds 3] [--messages 5000] [--window 100]

Each round starts fresh brokers (bench/cluster_hop.py's setup). A persistent MQTT 3.1.1
subscriber (clean session 0, QoS 1) is connected to node 2 and acknowledges what it gets; a
publisher on node 1 (on the single node: the same node) sends 64-byte QoS 1 messages over raw
sockets (no client library in the timing):
- throughput: `--messages` with `--window` unacknowledged at once; PUBACKs per second;
- latency: 1,000 one at a time; publish-to-PUBACK p50 and p99 in microseconds.
On the cluster every message crosses a link to the subscriber's node, which stores it and,
with ack_replicas 2, copies it to another owner of the session's partition before the
publisher's PUBACK. Only processes this script starts are stopped, by PID.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cluster_hop  # noqa: E402  (bench/cluster_hop.py, found through the path set above)
from cluster_session_move import Reader, connect_packet, packet, string  # noqa: E402

PAYLOAD = b"x" * 64


def open_client(address: str, client_id: str, clean: bool) -> tuple[socket.socket, Reader]:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if clean:
        body = string("MQTT") + b"\x04\x02\x00\x3c" + string(client_id)
        sock.sendall(packet(0x10, body))
    else:
        sock.sendall(connect_packet(client_id))
    reader = Reader(sock)
    kind, _ = reader.next()
    assert kind == 0x20
    return sock, reader


def subscriber(address: str, topic: str, stop: threading.Event) -> threading.Thread:
    sock, reader = open_client(address, "acked-sub", clean=False)
    sock.sendall(packet(0x82, (1).to_bytes(2, "big") + string(topic) + b"\x01"))
    reader.next()
    sock.settimeout(0.5)

    def run() -> None:
        while not stop.is_set():
            try:
                kind, body = reader.next()
            except TimeoutError:
                continue
            except OSError:
                return
            if kind >> 4 == 3 and kind & 0x06:
                offset = 2 + int.from_bytes(body[:2], "big")
                sock.sendall(packet(0x40, body[offset : offset + 2]))
        sock.close()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def publish(sock: socket.socket, topic: str, pkid: int) -> None:
    sock.sendall(packet(0x32, string(topic) + pkid.to_bytes(2, "big") + PAYLOAD))


def throughput(address: str, topic: str, messages: int, window: int) -> float:
    sock, reader = open_client(address, "acked-pub", clean=True)
    started = time.perf_counter()
    sent = acked = 0
    while acked < messages:
        while sent < messages and sent - acked < window:
            publish(sock, topic, sent % 65535 + 1)
            sent += 1
        kind, _ = reader.next()
        acked += kind >> 4 == 4
    elapsed = time.perf_counter() - started
    sock.close()
    return messages / elapsed


def latency(address: str, topic: str, count: int = 1000) -> tuple[float, float]:
    sock, reader = open_client(address, "acked-lat", clean=True)
    samples = []
    for i in range(count):
        started = time.perf_counter()
        publish(sock, topic, i % 65535 + 1)
        while reader.next()[0] >> 4 != 4:
            pass
        samples.append((time.perf_counter() - started) * 1e6)
    sock.close()
    samples.sort()
    return samples[len(samples) // 2], samples[int(len(samples) * 0.99)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--window", type=int, default=100)
    args = parser.parse_args()
    setups = ("one node", "3 nodes, ack_replicas 1", "3 nodes, ack_replicas 2")
    results: dict[str, list[tuple[float, float, float]]] = {}
    for r in range(args.rounds):
        for name in setups:
            base = Path(tempfile.mkdtemp(prefix="ack-replicas-"))
            if name == "one node":
                setup = cluster_hop.start_single(base)
                pub_at, sub_at = setup.addrs[0], setup.addrs[0]
            else:
                acks = 1 if name.endswith("1") else 2
                setup = cluster_hop.start_cluster(base, None, 3, {"ack_replicas": acks})
                pub_at, sub_at = setup.addrs[0], setup.addrs[1]
            stop = threading.Event()
            try:
                topic = f"acked/{r}"
                reader = subscriber(sub_at, topic, stop)
                time.sleep(0.5)  # the route row reaches node 1
                rate = throughput(pub_at, topic, args.messages, args.window)
                p50, p99 = latency(pub_at, topic)
                stop.set()
                reader.join(5)
            finally:
                setup.stop()
            results.setdefault(name, []).append((rate, p50, p99))
            print(
                f"round {r + 1}  {name:<24} {rate:>10,.0f} acked/s  "
                f"p50 {p50:7.0f} us  p99 {p99:7.0f} us",
                flush=True,
            )
    print("\nsetup | acked/s | publish-to-PUBACK p50 us | p99 us  (medians over rounds)")
    base_rate = statistics.median(v[0] for v in results["one node"])
    for name in setups:
        values = results[name]
        rate = statistics.median(v[0] for v in values)
        p50 = statistics.median(v[1] for v in values)
        p99 = statistics.median(v[2] for v in values)
        print(f"{name} | {rate:,.0f} ({rate / base_rate:.2f}x one node) | {p50:.0f} | {p99:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
