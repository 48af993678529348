"""Tools of the hostile-client test (test_hostile.py): a well-behaved probe client in its own
process, and swarms of non-blocking sockets for floods.

The probe runs in a child process (``python tests/hostile.py probe HOST PORT RATE``) so that
what the test process does to attack the broker (opening thousands of sockets, building
megabyte packets) never delays the probe's own measurements: only the broker can. It
publishes QoS 1 messages to a topic it subscribes to, at a steady rate, and prints one line
per message sent and per message received, with CLOCK_MONOTONIC times (one clock for every
process on Linux), which the parent matches against the time windows of its attacks.
"""

from __future__ import annotations

import errno
import os
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import rawmqtt as r

HERE = Path(__file__).resolve().parent

# ---------------------------------------------------------------------------------------------
# The probe


def run_probe(host: str, port: int, rate: float) -> int:
    """The child process: publish to itself at `rate` per second until stdin closes.

    Lines on stdout: ``ready``; ``S seq t`` (sent at t); ``R seq t`` (received at t);
    ``CLOSED why`` if the broker drops the connection (the parent counts it a failure).
    """
    topic = f"probe/{os.getpid()}"
    sock, _ = r.connect_client(host, port, f"probe-{os.getpid()}", protocol=5, keepalive=30)
    sock.sendall(r.subscribe(1, [(topic, 1)], protocol=5))
    reader = r.Reader(sock)
    ack = r.parse_suback(reader.read(5.0), 5)
    if ack.reasons != [1]:
        print(f"CLOSED subscribe refused {ack.reasons}", flush=True)
        return 1
    print("ready", flush=True)
    sock.setblocking(False)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    out = sys.stdout
    interval = 1.0 / rate
    start = time.monotonic()
    seq = 0
    pending = bytearray()
    while True:
        next_send = start + seq * interval
        now = time.monotonic()
        if now >= next_send:
            pkid = seq % 65535 + 1
            pending += r.publish(topic, struct.pack("!Q", seq), qos=1, packet_id=pkid, protocol=5)
            out.write(f"S {seq} {time.monotonic():.6f}\n")
            seq += 1
        if pending:
            try:
                del pending[: sock.send(pending)]
            except BlockingIOError:
                pass
            except OSError as e:
                print(f"CLOSED send: {e}", flush=True)
                return 1
        out.flush()
        for key, _ in sel.select(max(0.0, next_send - time.monotonic())):
            if key.fileobj is sys.stdin:
                return 0  # the parent is done (stdin closed)
            try:
                data = sock.recv(65536)
            except BlockingIOError:
                continue
            except OSError as e:
                print(f"CLOSED recv: {e}", flush=True)
                return 1
            if not data:
                print("CLOSED by the broker", flush=True)
                return 1
            reader.buf += data
            while (packet := reader._parse()) is not None:
                if packet.type == r.PUBLISH:
                    got = r.parse_publish(packet, 5)
                    (n,) = struct.unpack("!Q", got.payload)
                    out.write(f"R {n} {time.monotonic():.6f}\n")
                    assert got.packet_id is not None  # QoS 1
                    pending += r.puback(got.packet_id, protocol=5)
                elif packet.type != r.PUBACK:
                    print(f"CLOSED unexpected {packet}", flush=True)
                    return 1


@dataclass
class Window:
    """The probe's messages sent during one attack."""

    name: str
    sent: int
    lost: list[int]
    latencies: list[float]  # seconds, sorted

    def quantile(self, q: float) -> float:
        if not self.latencies:
            return float("nan")
        return self.latencies[min(len(self.latencies) - 1, int(q * len(self.latencies)))]

    @property
    def p50(self) -> float:
        return self.quantile(0.50)

    @property
    def p99(self) -> float:
        return self.quantile(0.99)

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.sent} sent, {len(self.lost)} lost, p50 {self.p50 * 1000:.2f} ms,"
            f" p99 {self.p99 * 1000:.2f} ms, max {self.latencies[-1] * 1000:.2f} ms"
            if self.latencies
            else f"{self.name}: {self.sent} sent, {len(self.lost)} lost"
        )


class Probe:
    """The parent's handle on the probe process."""

    def __init__(self, host: str, port: int, rate: float = 50.0):
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "hostile.py"), "probe", host, str(port), str(rate)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=HERE,
        )
        self.sent: dict[int, float] = {}
        self.received: dict[int, float] = {}
        self.closed: str | None = None
        self.errors = ""  # the end of its stderr, once stopped
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        if not self._ready.wait(10.0) or self.closed:
            self.stop()
            raise RuntimeError(f"probe not ready: {self.closed}; stderr: {self.errors}")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            kind, _, rest = line.rstrip("\n").partition(" ")
            if kind in ("S", "R"):
                seq, t = rest.split()
                with self._lock:
                    (self.sent if kind == "S" else self.received).setdefault(int(seq), float(t))
            elif kind == "ready":
                self._ready.set()
            else:
                self.closed = line.strip()
        if self.closed is None:
            self.closed = f"probe exited ({self.proc.poll()})"
        self._ready.set()

    def window(self, name: str, start: float, end: float, settle: float = 5.0) -> Window:
        """The messages sent in [start, end]; waits up to `settle` s for late ones."""
        deadline = time.monotonic() + settle
        while True:
            with self._lock:
                seqs = sorted(s for s, t in self.sent.items() if start <= t <= end)
                missing = [s for s in seqs if s not in self.received]
                latencies = sorted(
                    self.received[s] - self.sent[s] for s in seqs if s in self.received
                )
            if not missing or time.monotonic() >= deadline or self.closed:
                return Window(name, len(seqs), missing, latencies)
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5.0)
        self._thread.join(5.0)
        if self.proc.stderr is not None:
            self.errors = self.proc.stderr.read()[-4000:]
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


# ---------------------------------------------------------------------------------------------
# Swarms of sockets


@dataclass
class Peer:
    """One attacking socket: what it received and when the broker closed it."""

    sock: socket.socket
    received: bytearray = field(default_factory=bytearray)
    closed_at: float | None = None
    opened_at: float = 0.0

    def packets(self) -> list[r.Packet]:
        """The whole packets received (a truncated tail is ignored)."""
        reader = r.Reader(self.sock)
        reader.buf = bytearray(self.received)
        out = []
        while (p := reader._parse()) is not None:
            out.append(p)
        return out


class Swarm:
    """Many non-blocking sockets to one broker; every one is closed by `close` (also on
    leaving a ``with`` block)."""

    def __init__(self, address: tuple[str, int]):
        self.address = address
        self.peers: list[Peer] = []
        self.failed_connects = 0

    def __enter__(self) -> Swarm:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self, n: int) -> list[Peer]:
        """Starts `n` connects without waiting for them (see `wait_connected`)."""
        new = []
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setblocking(False)
            err = s.connect_ex(self.address)
            if err not in (0, errno.EINPROGRESS):
                s.close()
                self.failed_connects += 1
                continue
            new.append(Peer(s, opened_at=time.monotonic()))
        self.peers += new
        return new

    def wait_connected(self, peers: list[Peer], timeout: float) -> list[Peer]:
        """The peers whose connect completed within `timeout`; the others are closed."""
        sel = selectors.DefaultSelector()
        for p in peers:
            sel.register(p.sock, selectors.EVENT_WRITE, p)
        done: list[Peer] = []
        deadline = time.monotonic() + timeout
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(min(left, 0.5)):
                peer: Peer = key.data
                sel.unregister(peer.sock)
                if peer.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                    done.append(peer)
                else:
                    self.failed_connects += 1
                    peer.closed_at = time.monotonic()
        for key in list(sel.get_map().values()):
            self.failed_connects += 1
            key.data.closed_at = time.monotonic()
        sel.close()
        return done

    @staticmethod
    def send(peers: list[Peer], data: bytes) -> None:
        """Sends `data` (small: it fits the socket buffer) to every peer still open; a
        refused send marks the peer closed."""
        for p in peers:
            if p.closed_at is not None:
                continue
            try:
                p.sock.send(data)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                p.closed_at = time.monotonic()

    @staticmethod
    def poll(peers: list[Peer], timeout: float) -> None:
        """Reads what arrived for `timeout` s, noting closes."""
        sel = selectors.DefaultSelector()
        for p in peers:
            if p.closed_at is None:
                sel.register(p.sock, selectors.EVENT_READ, p)
        deadline = time.monotonic() + timeout
        while sel.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in sel.select(left):
                peer: Peer = key.data
                try:
                    data = peer.sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:
                    peer.received += data
                else:
                    peer.closed_at = time.monotonic()
                    sel.unregister(peer.sock)
        sel.close()

    @classmethod
    def wait_closed(cls, peers: list[Peer], timeout: float) -> list[Peer]:
        """Reads until every peer is closed or `timeout`; returns those still open."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            open_peers = [p for p in peers if p.closed_at is None]
            if not open_peers:
                return []
            cls.poll(open_peers, min(left, 0.2))
        return [p for p in peers if p.closed_at is None]

    def close(self, *, abort: bool = False) -> None:
        """Closes every socket; `abort` sends RST instead of FIN (no TIME_WAIT left)."""
        for p in self.peers:
            if abort:
                try:
                    p.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                except OSError:
                    pass
            p.sock.close()
        self.peers.clear()


# ---------------------------------------------------------------------------------------------
# The broker process seen from outside


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "probe":
        sys.exit(run_probe(sys.argv[2], int(sys.argv[3]), float(sys.argv[4])))
    sys.exit("usage: hostile.py probe HOST PORT RATE")
