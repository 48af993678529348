#!/usr/bin/env python3
"""What a CONNECT's claim of its client id costs in a cluster: one client at a time
connecting (CONNECT to CONNACK, then DISCONNECT) to one node of an N-node cluster, against
the same on a single node, side by side in one run; and how many nodes each claim asked.

    python bench/cluster_claims.py [--rounds 3] [--connects 2000] [--nodes 3,5]

Each round starts a fresh single node and fresh clusters (bench/cluster_hop.py's setup).
Clients are MQTT 3.1.1 clean sessions with distinct client ids, over raw sockets (no client
library in the timing), all to node 1. A claim goes through the first owner of the client
id's partition in reach (inter-node protocol 10): it asks that owner to stamp it unless node
1 is that owner, then the nodes the owner names and the partition's owners (nobody, when
the owner knows that no node holds the client id, as for these new ones). Reported: the
median and p99 CONNECT-to-CONNACK time, connects per second, and claim messages per CONNECT
(node 1's `cluster_claim_messages_total` over `cluster_session_claims_total`, route requests
not counted). Only processes this script starts are stopped.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import cluster_hop  # noqa: E402  (bench/cluster_hop.py, found through the path set above)
from cluster_session_move import Reader, packet, string  # noqa: E402


def clean_connect(client_id: str) -> bytes:
    # MQTT 3.1.1, clean session 1 (connect flags 0x02), keepalive 60.
    return packet(0x10, string("MQTT") + b"\x04\x02" + (60).to_bytes(2, "big") + string(client_id))


def connects(addr: str, count: int, prefix: str) -> list[float]:
    """Seconds from CONNECT to CONNACK of `count` clients, one at a time."""
    host, port = addr.rsplit(":", 1)
    times = []
    for i in range(count):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            started = time.perf_counter()
            sock.sendall(clean_connect(f"{prefix}-{i}"))
            kind, body = Reader(sock).next()
            times.append(time.perf_counter() - started)
            if kind != 0x20 or body[1:2] != b"\x00":
                raise RuntimeError(f"CONNECT refused: {kind:#x} {body!r}")
            sock.sendall(b"\xe0\x00")
    return times


def admin_metrics(admin_port: int) -> dict[str, float]:
    url = f"http://{cluster_hop.HOST}:{admin_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = out.get(name, 0.0) + float(value)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--connects", type=int, default=2000)
    parser.add_argument("--nodes", default="3,5")
    args = parser.parse_args()
    sizes = [int(n) for n in args.nodes.split(",")]
    results: dict[str, list[tuple[float, float, float, float]]] = {}
    for r in range(args.rounds):
        for nodes in [1, *sizes]:
            base = Path(tempfile.mkdtemp(prefix="claims-"))
            if nodes == 1:
                setup = cluster_hop.start_single(base)
                admin = None
            else:
                setup = cluster_hop.start_cluster(base, None, nodes=nodes)
                admin = setup.admins[0]
            try:
                times = connects(setup.addrs[0], args.connects, f"c{r}")
                per_connect = 0.0
                if admin is not None:
                    m = admin_metrics(admin)
                    made = m.get("fastbroker_cluster_session_claims_total", 0.0)
                    asked = m.get("fastbroker_cluster_claim_messages_total", 0.0)
                    per_connect = asked / made if made else 0.0
            finally:
                setup.stop()
            times.sort()
            p50 = statistics.median(times) * 1e3
            p99 = times[int(len(times) * 0.99) - 1] * 1e3
            rate = len(times) / sum(times)
            name = "single node" if nodes == 1 else f"{nodes}-node cluster"
            results.setdefault(name, []).append((p50, p99, rate, per_connect))
            print(
                f"round {r + 1}  {name:<16}  CONNACK p50 {p50:6.3f} ms  p99 {p99:6.3f} ms  "
                f"{rate:8.0f} connects/s  claim messages per CONNECT {per_connect:.2f}",
                flush=True,
            )
    print("\nsetup | CONNACK p50 ms | p99 ms | connects/s | vs single node | claim msgs/CONNECT")
    single = statistics.median(v[2] for v in results["single node"])
    for name, values in results.items():
        p50 = statistics.median(v[0] for v in values)
        p99 = statistics.median(v[1] for v in values)
        rate = statistics.median(v[2] for v in values)
        per = statistics.median(v[3] for v in values)
        print(f"{name} | {p50:.3f} | {p99:.3f} | {rate:.0f} | {rate / single:.2f}x | {per:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
