"""Crash test (issue 4): QoS 1 and QoS 2 traffic while the broker is killed with SIGKILL.

The broker runs as a real process (``python -m fastbroker run``) on a data directory in
tmp_path, with [storage] fsync = "interval" and, in a shorter run, "always". While publishers
send QoS 1 and QoS 2 messages to persistent sessions, the test kills it with SIGKILL (by pid)
at seeded-random moments and restarts it on the same data directory and port, many times
(bounded in count and time); then it runs it once more, cleanly, to drain. At the end, every
message that was acknowledged to its publisher must have reached every subscriber at least
once, QoS 2 exactly once, and the first deliveries of each (publisher, topic) in publish order.

The moments of the kills, drawn from the seeded generator:

* 20%: anywhere in start-up, 0-0.5 s after the start (opening the store, restoring, listening);
* 30%: 0.3-1.5 s after "listening";
* 50%: 0.3-1.2 s after "listening", every publisher fills its window at once and the kill
  comes 0-30 ms later, so that it finds messages in every state of their flows; for a random
  half of the publishers, they stop reading just before (and drop the connection unread after
  the kill), so that acknowledgements the broker sent, after storing what they acknowledge,
  never arrive, as when a connection breaks: the publisher resends, and the broker must
  recognise the QoS 2 packet ids it stored;
* DRAIN_KILLS more while the offline subscribers take their queues (in-flight windows of
  sessions with long queues).

Clients, all MQTT persistent sessions with fixed client ids:

* Publishers: raw sockets (``rawmqtt``), MQTT 3.1.1, clean session 0, a window of WINDOW
  messages in flight, rate-limited. Each alternates (seeded-randomly) between its QoS 1
  topic ``crash/q1/p<i>`` and its QoS 2 topic ``crash/q2/p<i>``; the payload says
  publisher, topic and sequence number (per publisher and topic). A message counts as
  acknowledged when its PUBACK (QoS 1) or PUBREC (QoS 2: the broker took it) arrives;
  PUBCOMP is recorded too. After each reconnect a publisher resends, in their original order,
  every PUBLISH not acknowledged (same packet id, DUP set) and every PUBREL not completed, as
  MQTT 4.4 requires. Raw sockets and not paho because paho tells the application nothing of
  PUBREC (its on_publish fires at PUBCOMP for QoS 2), so "acknowledged" would be ambiguous.
* Subscribers: paho-mqtt 2.x, one client object each for the whole test, so that paho's QoS 2
  receive state (packet ids awaiting PUBREL) survives reconnects:

  - ``live-a`` (3.1.1): ``crash/q1/+`` at QoS 1 and ``crash/q2/+`` at QoS 2; connected all
    along, paho reconnecting after each kill (every 20-200 ms while the broker is down).
  - ``live-b`` (MQTT 5, session expiry 3600 s): ``crash/#`` at QoS 2; connected all along.
  - ``off-a`` (3.1.1): like live-a; subscribes at the start, disconnects, and connects again
    only in the final run, to drain what was queued for it across every crash.
  - ``off-b`` (3.1.1): ``crash/q2/+`` at QoS 2 only; offline like off-a.

  Every subscription exists (SUBACK received) before the first message is published.

What the checks rely on from paho (2.2, read in its source and seen in this test's figures):
on_message is called once per QoS 1 PUBLISH received (duplicates included: they are counted),
and once per QoS 2 message, when its PUBREL arrives: a repeated PUBLISH with the same packet id
before the PUBREL (the broker's resend with DUP after a restart) replaces the stored message
and is not delivered again, and a PUBREL for a packet id it does not hold (already released)
is answered with PUBCOMP and delivers nothing. With clean session 0 (clean start 0 in MQTT 5)
paho keeps its received-QoS 2 state across reconnects of the same client object. So the
deliveries counted are application deliveries, and a QoS 2 message counted twice was sent by
the broker as two separate exchanges.

The final run: waits until every publisher has nothing left in flight and every
subscriber has every acknowledged message; restarts the broker cleanly (SIGTERM) and checks
that nothing at all is delivered again; stops it and opens the store to check that it holds the
7 sessions and no queued message, in-flight state or inbound QoS 2 packet id. The broker's log
must show no error. (A SIGKILL loses nothing the broker handed to the OS, so the fsync
policy changes the write path the test goes through, not what it expects; power loss is not
simulated.)

``test_checker_finds_what_is_wrong`` runs the checks on made-up deliveries.

Figures are printed (``pytest -s tests/test_crash.py``): kills, messages published,
acknowledged, checked (message x subscriber pairs), lost, duplicated QoS 2, and more.
FASTBROKER_CRASH_SEED overrides the seeds (printed) to replay a kill schedule.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as paho
import pytest
import rawmqtt as r
from brokers import HOST, REPO, _die_with_parent, fastbroker_available, free_port
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.subscribeoptions import SubscribeOptions

from fastbroker.store import Store

PUBLISHERS = 3
WINDOW = 16  # messages in flight per publisher
RATE = 250  # messages per second per publisher (at most)
MAX_MESSAGES = 6000  # per publisher
LARGE_PAYLOAD = 6000  # bytes, above [storage] compress_above (4096): stored compressed
READY_TIMEOUT = 15.0
DRAIN_TIMEOUT = 30.0
DRAIN_KILLS = 2  # kills while the offline subscribers take their queues
SETTLE = 0.5  # seconds of quiet that must bring no further delivery

SUBSCRIBERS = {
    # name: (MQTT version, live during the crashes, [(filter, QoS)])
    "live-a": (4, True, [("crash/q1/+", 1), ("crash/q2/+", 2)]),
    "live-b": (5, True, [("crash/#", 2)]),
    "off-a": (4, False, [("crash/q1/+", 1), ("crash/q2/+", 2)]),
    "off-b": (4, False, [("crash/q2/+", 2)]),
}


@dataclass(frozen=True)
class Plan:
    fsync: str
    kills: int
    seed: int
    time_cap: float  # seconds for the crash phase, whatever the kill count


PLANS = [
    pytest.param(Plan("interval", 20, 4101, 35.0), id="fsync-interval"),
    pytest.param(Plan("always", 10, 4102, 20.0), id="fsync-always"),
]


# --------------------------------------------------------------------------- the broker


class CrashBroker:
    """One broker configuration, started and killed many times on the same data directory
    and port; every life's stderr is appended to one log."""

    def __init__(self, workdir: Path, port: int, fsync: str):
        self.workdir = workdir
        self.port = port
        self.data_dir = workdir / "data"
        self.config = workdir / "fastbroker.toml"
        self.log_path = workdir / "fastbroker.stderr.log"
        self.proc: subprocess.Popen | None = None
        self.lives = 0
        self.config.write_text(
            "\n".join(
                [
                    "[listener]",
                    f'host = "{HOST}"',
                    f"port = {port}",
                    "[storage]",
                    f'data_dir = "{self.data_dir}"',
                    f'fsync = "{fsync}"',
                    "[log]",
                    'level = "info"',
                    "[sys]",
                    "interval = 0",
                    "[mqtt]",
                    # Offline sessions hold every message published in the run.
                    "max_queued_messages = 1000000",
                    # Small, so that live subscribers have messages both in flight and queued.
                    "max_inflight = 16",
                ]
            )
            + "\n"
        )

    def spawn(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        self.lives += 1
        with open(self.log_path, "ab") as log:
            log.write(f"===== life {self.lives} =====\n".encode())
            log.flush()
            self.log_offset = log.tell()
            env = dict(os.environ)
            if importlib.util.find_spec("fastbroker") is None:
                env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fastbroker", "run", "--config", str(self.config)],
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=log,
                env=env,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )

    def life_log(self) -> str:
        with open(self.log_path, "rb") as log:
            log.seek(self.log_offset)
            return log.read().decode(errors="replace")

    def wait_listening(self, timeout: float = READY_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "listening on" in self.life_log():
                return
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"broker life {self.lives} exited with code {self.proc.returncode} before "
                    f"listening:\n{self.life_log()[-5000:]}"
                )
            time.sleep(0.005)
        raise AssertionError(f"broker life {self.lives} not listening after {timeout}s")

    def start(self) -> None:
        self.spawn()
        self.wait_listening()

    def kill(self) -> None:
        """SIGKILL by pid, then reap."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self) -> int:
        """SIGTERM by pid; the exit code (SIGKILL after 10 s)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


# --------------------------------------------------------------------------- publishers


@dataclass(eq=False)
class Sent:
    pub: int
    topic: str
    qos: int
    seq: int
    payload: bytes
    pkid: int = 0
    acked: bool = False  # PUBACK (QoS 1) or PUBREC (QoS 2) arrived
    acked_in_drain: bool = False  # ... only in the final run
    completed: bool = False  # PUBCOMP arrived (QoS 2)


class Publisher(threading.Thread):
    """A raw-socket MQTT 3.1.1 publisher with a persistent session that reconnects and
    resends by itself (see the module docstring). Runs in its own thread."""

    def __init__(self, index: int, port: int, seed: int, problems: list[str]):
        super().__init__(name=f"crash-pub-{index}", daemon=True)
        self.index = index
        self.port = port
        self.rng = random.Random(seed)
        self.problems = problems
        self.client_id = f"crash-pub-{index}"
        self.messages: list[Sent] = []
        self.outstanding: dict[int, Sent] = {}  # by packet id, in the order first sent
        self.next_seq: Counter[str] = Counter()
        self.next_pkid = 0
        self.stopping = threading.Event()
        self.draining = threading.Event()
        # Set by the test around some kills: send a window's worth at once (burst); stop
        # reading (deaf), so that acknowledgements sent just before the kill never arrive,
        # as when a connection breaks; close the connection without reading (lose).
        self.burst = threading.Event()
        self.deaf = threading.Event()
        self.lose = threading.Event()
        self.sock: socket.socket | None = None
        self.reader: r.Reader | None = None
        self.connects = 0
        self.resent_publish = 0
        self.resent_pubrel = 0
        self.send_at = 0.0

    # ---- bookkeeping
    def problem(self, text: str) -> None:
        self.problems.append(f"{self.client_id}: {text}")

    def new_message(self) -> Sent:
        qos = self.rng.choice((1, 2))
        topic = f"crash/q{qos}/p{self.index}"
        self.next_seq[topic] += 1
        seq = self.next_seq[topic]
        head = f"{self.index}|{topic}|{seq}|".encode()
        pad = LARGE_PAYLOAD if self.rng.random() < 0.03 else self.rng.randrange(0, 200)
        m = Sent(self.index, topic, qos, seq, head + b"x" * pad)
        self.messages.append(m)
        return m

    def allocate_pkid(self) -> int:
        while True:
            self.next_pkid = self.next_pkid % 65535 + 1
            if self.next_pkid not in self.outstanding:
                return self.next_pkid

    # ---- connection
    def drop(self) -> None:
        if self.sock is not None:
            try:
                self.sock.close()
            except OSError:
                pass
        self.sock = self.reader = None

    def connect(self) -> bool:
        try:
            sock = socket.create_connection((HOST, self.port), timeout=1.0)
        except OSError:
            return False
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(r.connect(self.client_id, clean=False, keepalive=0))
            reader = r.Reader(sock)
            connack = r.parse_connack(reader.read(timeout=2.0))
        except (OSError, r.Closed, TimeoutError):
            sock.close()
            return False
        if connack.reason != 0:
            self.problem(f"CONNACK return code {connack.reason}")
            sock.close()
            return False
        if self.connects and not connack.session_present:
            self.problem(f"session not present on reconnect {self.connects}")
        self.connects += 1
        self.sock, self.reader = sock, reader
        # MQTT-4.4.0-1: resend unacknowledged PUBLISH and PUBREL packets, in order, with
        # their original packet ids.
        out = bytearray()
        for m in self.outstanding.values():
            if m.acked:
                out += r.pubrel(m.pkid)
                self.resent_pubrel += 1
            else:
                out += r.publish(m.topic, m.payload, qos=m.qos, dup=True, packet_id=m.pkid)
                self.resent_publish += 1
        try:
            if out:
                sock.sendall(out)
        except OSError:
            self.drop()
            return False
        return True

    # ---- the loop
    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                if self.sock is None and not self.connect():
                    time.sleep(0.02)
                    continue
                try:
                    self.step()
                except (OSError, r.Closed):
                    self.drop()
        except Exception as error:  # reported by the test, never swallowed
            self.problem(f"publisher thread failed: {error!r}")
        finally:
            self.drop()

    def step(self) -> None:
        assert self.sock is not None and self.reader is not None
        if self.lose.is_set():
            self.lose.clear()
            self.deaf.clear()
            self.drop()
            return
        now = time.monotonic()
        # The rate limit lets a short burst through after a reconnect, not a flood.
        self.send_at = max(self.send_at, now - WINDOW / RATE)
        if self.burst.is_set():
            self.burst.clear()
            self.send_at = now - WINDOW / RATE
        out = bytearray()
        while (
            not self.draining.is_set()
            and len(self.outstanding) < WINDOW
            and len(self.messages) < MAX_MESSAGES
            and self.send_at <= now
        ):
            m = self.new_message()
            m.pkid = self.allocate_pkid()
            self.outstanding[m.pkid] = m
            out += r.publish(m.topic, m.payload, qos=m.qos, packet_id=m.pkid)
            self.send_at += 1 / RATE
        if out:
            self.sock.sendall(out)
        if self.deaf.is_set():
            time.sleep(0.002)
            return
        ready, _, _ = select.select([self.sock], [], [], 0.005)
        if not ready:
            return
        out = bytearray()
        for p in self.reader.read_available(timeout=0.001):
            out += self.handle(p)
        if out:
            self.sock.sendall(out)

    def handle(self, p: r.Packet) -> bytes:
        if p.type not in (r.PUBACK, r.PUBREC, r.PUBCOMP):
            self.problem(f"unexpected packet {p!r}")
            return b""
        pkid, _ = r.parse_ack(p)
        m = self.outstanding.get(pkid)
        expected = {r.PUBACK: (1, False), r.PUBREC: (2, False), r.PUBCOMP: (2, True)}[p.type]
        if m is None or (m.qos, m.acked) != expected:
            state = "unknown" if m is None else f"QoS {m.qos}, acknowledged {m.acked}"
            self.problem(f"{p.name} for packet id {pkid} ({state})")
            return b""
        if p.type == r.PUBACK:
            m.acked, m.acked_in_drain = True, self.draining.is_set()
            del self.outstanding[pkid]
            return b""
        if p.type == r.PUBREC:
            m.acked, m.acked_in_drain = True, self.draining.is_set()
            return r.pubrel(pkid)
        m.completed = True
        del self.outstanding[pkid]
        return b""


# --------------------------------------------------------------------------- subscribers


class Subscriber:
    """A paho-mqtt persistent session recording every application delivery in order."""

    def __init__(self, name: str, port: int, problems: list[str]):
        version, self.live, self.filters = SUBSCRIBERS[name]
        self.name = name
        self.port = port
        self.version = version
        self.problems = problems
        self.deliveries: list[tuple[str, bytes, int]] = []  # (topic, payload, QoS)
        self.connects = 0
        self.connected = threading.Event()
        self.subacked = threading.Event()
        self.granted: list[int] = []
        kwargs = {} if version == 5 else {"clean_session": False}
        self.client = paho.Client(
            paho.CallbackAPIVersion.VERSION2,
            client_id=f"crash-{name}",
            protocol=paho.MQTTv5 if version == 5 else paho.MQTTv311,
            **kwargs,
        )
        self.client.reconnect_delay_set(0.02, 0.2)  # paho takes floats (seconds)
        self.client.on_connect = self.on_connect
        self.client.on_disconnect = self.on_disconnect
        self.client.on_message = self.on_message
        self.client.on_subscribe = self.on_subscribe

    def on_connect(self, client, userdata, flags, reason_code, properties):
        if reason_code.is_failure:
            self.problems.append(f"{self.name}: CONNACK {reason_code}")
            return
        if self.connects and not flags.session_present:
            self.problems.append(f"{self.name}: session not present on reconnect")
        self.connects += 1
        self.connected.set()

    def on_disconnect(self, client, userdata, flags, reason_code, properties):
        self.connected.clear()

    def on_message(self, client, userdata, message):
        self.deliveries.append((message.topic, bytes(message.payload), message.qos))

    def on_subscribe(self, client, userdata, mid, reason_codes, properties):
        self.granted = [rc.value for rc in reason_codes]
        self.subacked.set()

    def connect(self) -> None:
        if self.version == 5:
            props = Properties(PacketTypes.CONNECT)
            props.SessionExpiryInterval = 3600
            self.client.connect(HOST, self.port, clean_start=False, properties=props)
        else:
            self.client.connect(HOST, self.port)
        self.client.loop_start()

    def wait_connected(self, timeout: float = 10.0) -> None:
        assert self.connected.wait(timeout), f"{self.name}: not connected within {timeout}s"

    def subscribe(self) -> None:
        if self.version == 5:
            topics = [(f, SubscribeOptions(qos=q)) for f, q in self.filters]
        else:
            topics = list(self.filters)
        self.client.subscribe(topics)
        assert self.subacked.wait(5.0), f"{self.name}: no SUBACK"
        assert self.granted == [q for _, q in self.filters], (self.name, self.granted)

    def disconnect(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
        self.connected.clear()

    def expected_qos(self, topic: str, qos: int) -> int | None:
        """The QoS of the delivery of a message on ``topic`` published at ``qos``, or None."""
        granted = [min(qos, q) for f, q in self.filters if topic_matches(f, topic)]
        return max(granted) if granted else None


def topic_matches(topic_filter: str, topic: str) -> bool:
    fparts, tparts = topic_filter.split("/"), topic.split("/")
    for i, f in enumerate(fparts):
        if f == "#":
            return True
        if i >= len(tparts) or (f != "+" and f != tparts[i]):
            return False
    return len(fparts) == len(tparts)


# --------------------------------------------------------------------------- checks


@dataclass
class Figures:
    kills: int = 0
    early_kills: int = 0  # at a random moment of start-up, maybe before listening
    burst_kills: int = 0  # 0-30 ms after a burst from every publisher
    deaf_kills: int = 0  # ... that some publishers were not reading
    drain_kills: int = 0  # while offline subscribers took their queues
    in_flight_at_kills: int = 0  # publisher messages unacknowledged when the broker died
    published: int = 0
    published_qos2: int = 0
    acknowledged: int = 0
    acknowledged_in_drain: int = 0
    completed_qos2: int = 0
    resent_publish: int = 0
    resent_pubrel: int = 0
    checked: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated_qos2: int = 0
    duplicated_qos1: int = 0
    unacknowledged_delivered: int = 0
    restored_queued: int = 0
    restored_inflight: int = 0


def check_deliveries(
    subscribers: list[Subscriber], messages: dict[tuple[int, str, int], Sent], figures: Figures
) -> list[str]:
    """Every acknowledged message delivered to every subscriber at least once, QoS 2 exactly
    once, first deliveries in publish order per (publisher, topic); returns what is wrong."""
    problems: list[str] = []

    def report(text: str) -> None:
        if len(problems) < 40:
            problems.append(text)

    for sub in subscribers:
        counts: Counter[tuple[int, str, int]] = Counter()
        last_first: dict[tuple[int, str], int] = {}
        for topic, payload, qos in sub.deliveries:
            fields = payload.split(b"|", 3)
            key = (int(fields[0]), fields[1].decode(), int(fields[2]))
            m = messages.get(key)
            if m is None or m.topic != topic or m.payload != payload:
                report(f"{sub.name}: a message never published: {topic} {payload[:40]!r}")
                continue
            expected = sub.expected_qos(m.topic, m.qos)
            if qos != expected:
                report(f"{sub.name}: {key} delivered at QoS {qos}, expected {expected}")
            counts[key] += 1
            figures.delivered += 1
            if counts[key] == 1:
                last = last_first.get(key[:2], 0)
                if m.seq < last:
                    report(f"{sub.name}: {m.topic} seq {m.seq} first delivered after seq {last}")
                last_first[key[:2]] = max(last, m.seq)
        for key, m in messages.items():
            expected = sub.expected_qos(m.topic, m.qos)
            if expected is None:
                continue
            n = counts[key]
            if m.acked:
                figures.checked += 1
                if n == 0:
                    figures.lost += 1
                    report(f"{sub.name}: lost acknowledged {key} (QoS {m.qos})")
            elif n:
                figures.unacknowledged_delivered += 1
            if n > 1 and expected == 2:
                figures.duplicated_qos2 += 1
                report(f"{sub.name}: QoS 2 {key} delivered {n} times")
            elif n > 1:
                figures.duplicated_qos1 += 1
    return problems


def store_records(data_dir: Path) -> Counter[str]:
    kinds: Counter[str] = Counter()
    with Store.open(str(data_dir)) as store:
        for key, _ in store.load():
            kinds[chr(key[0])] += 1
    return kinds


RESTORED = re.compile(r"restored \d+ sessions, (\d+) queued and (\d+) in-flight messages")


# --------------------------------------------------------------------------- the test


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def test_checker_finds_what_is_wrong() -> None:
    """The checks of the crash test, on made-up deliveries: none of them is vacuous."""
    sub = Subscriber("live-a", 1, [])  # never connected
    messages = {}
    for topic, qos, seq, acked in [
        ("crash/q1/p0", 1, 1, True),
        ("crash/q1/p0", 1, 2, True),
        ("crash/q1/p0", 1, 3, True),
        ("crash/q2/p0", 2, 1, True),
        ("crash/q2/p0", 2, 2, True),
        ("crash/q2/p0", 2, 3, False),
        ("crash/q2/p0", 2, 4, True),
        ("crash/q2/p0", 2, 5, False),
    ]:
        payload = f"0|{topic}|{seq}|".encode()
        messages[0, topic, seq] = Sent(0, topic, qos, seq, payload, acked=acked)

    def delivery(topic: str, seq: int, qos: int) -> tuple[str, bytes, int]:
        return (topic, messages[0, topic, seq].payload, qos)

    sub.deliveries = [
        delivery("crash/q1/p0", 1, 1),
        delivery("crash/q1/p0", 2, 1),
        delivery("crash/q1/p0", 2, 1),  # a QoS 1 duplicate: allowed
        delivery("crash/q1/p0", 3, 2),  # wrong QoS
        delivery("crash/q2/p0", 1, 2),
        delivery("crash/q2/p0", 1, 2),  # a QoS 2 duplicate
        # crash/q2/p0 2: lost
        delivery("crash/q2/p0", 4, 2),
        delivery("crash/q2/p0", 3, 2),  # unacknowledged, but after 4: out of order
        delivery("crash/q2/p0", 5, 2),
        delivery("crash/q2/p0", 5, 2),  # unacknowledged, and a QoS 2 duplicate
        ("crash/q2/p0", b"0|crash/q2/p0|9|", 2),  # never published
    ]
    figures = Figures()
    problems = check_deliveries([sub], messages, figures)
    assert (figures.checked, figures.lost, figures.duplicated_qos2) == (6, 1, 2)
    assert (figures.duplicated_qos1, figures.unacknowledged_delivered) == (1, 2)
    assert sorted(problems) == sorted(
        [
            "live-a: (0, 'crash/q1/p0', 3) delivered at QoS 2, expected 1",
            "live-a: QoS 2 (0, 'crash/q2/p0', 1) delivered 2 times",
            "live-a: lost acknowledged (0, 'crash/q2/p0', 2) (QoS 2)",
            "live-a: crash/q2/p0 seq 3 first delivered after seq 4",
            "live-a: QoS 2 (0, 'crash/q2/p0', 5) delivered 2 times",
            "live-a: a message never published: crash/q2/p0 b'0|crash/q2/p0|9|'",
        ]
    )


@pytest.mark.timeout(110)
@pytest.mark.parametrize("plan", PLANS)
def test_crash_kill9(plan: Plan, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if request.config.getoption("--broker") == "mosquitto":
        pytest.skip("a test of fastbroker's store (--broker=mosquitto)")
    ok, why = fastbroker_available()
    if not ok:
        if os.environ.get("FASTBROKER_REQUIRED") == "1":
            pytest.fail(why)
        pytest.skip(why)
    seed = int(os.environ.get("FASTBROKER_CRASH_SEED", plan.seed))
    rng = random.Random(seed)
    problems: list[str] = []
    figures = Figures()
    broker = CrashBroker(tmp_path, free_port(), plan.fsync)
    subscribers = [Subscriber(name, broker.port, problems) for name in SUBSCRIBERS]
    publishers = [
        Publisher(i, broker.port, rng.randrange(1 << 32), problems) for i in range(PUBLISHERS)
    ]
    started = time.monotonic()
    try:
        # Sessions and subscriptions, before anything is published.
        broker.start()
        for sub in subscribers:
            sub.connect()
            sub.wait_connected()
            sub.subscribe()
            if not sub.live:
                sub.disconnect()
        for pub in publishers:
            pub.start()

        def crash(during_start_up: bool) -> None:
            """SIGKILLs the broker at a seeded-random moment and starts it again."""
            roll = rng.random()
            if during_start_up and roll < 0.2:
                # Anywhere in start-up: loading the store, restoring, or just listening.
                figures.early_kills += 1
                time.sleep(rng.uniform(0.0, 0.5))
            elif roll < 0.5:
                broker.wait_listening()
                time.sleep(rng.uniform(0.3, 1.5))
            else:
                # Timed to find messages in every state of their flows.
                broker.wait_listening()
                time.sleep(rng.uniform(0.3, 1.2))
                figures.burst_kills += 1
                deaf = [p for p in publishers if rng.random() < 0.5]
                figures.deaf_kills += bool(deaf)
                for pub in deaf:
                    pub.deaf.set()
                for pub in publishers:
                    pub.burst.set()
                time.sleep(rng.uniform(0.0, 0.03))
            figures.in_flight_at_kills += sum(len(p.outstanding) for p in publishers)
            if broker.proc.poll() is not None:
                problems.append(
                    f"broker life {broker.lives} exited by itself with code "
                    f"{broker.proc.returncode}:\n{broker.life_log()[-3000:]}"
                )
            broker.kill()
            figures.kills += 1
            for pub in publishers:
                if pub.deaf.is_set():
                    pub.lose.set()
            broker.spawn()

        # Crashes, with the offline subscribers away.
        crash_started = time.monotonic()
        while figures.kills < plan.kills and time.monotonic() - crash_started < plan.time_cap:
            crash(during_start_up=broker.lives > 1)
        # The offline subscribers connect to take what was queued for them, and the crashes
        # go on a little while they do.
        broker.wait_listening()
        for sub in subscribers:
            if not sub.live:
                if sub.deliveries:
                    problems.append(f"{sub.name}: got messages while meant to be offline")
                sub.connect()
        for _ in range(DRAIN_KILLS):
            crash(during_start_up=False)
            figures.drain_kills += 1
        crash_time = time.monotonic() - crash_started

        # The final run: publishers only finish what they have in flight.
        for pub in publishers:
            pub.draining.set()
        broker.wait_listening()
        assert wait_for(lambda: not any(p.outstanding for p in publishers), DRAIN_TIMEOUT), (
            f"publishers still have messages in flight: {[len(p.outstanding) for p in publishers]}"
        )
        messages = {(m.pub, m.topic, m.seq): m for p in publishers for m in p.messages}
        acked = [m for m in messages.values() if m.acked]

        def has_everything(sub: Subscriber) -> bool:
            got = {payload for _, payload, _ in sub.deliveries}
            return all(
                m.payload in got for m in acked if sub.expected_qos(m.topic, m.qos) is not None
            )

        wait_for(lambda: all(has_everything(s) for s in subscribers), DRAIN_TIMEOUT, 0.2)
        drain_time = time.monotonic() - crash_started - crash_time
        time.sleep(SETTLE)
        problems += check_deliveries(subscribers, messages, figures)

        # A clean restart redelivers nothing.
        delivered = [len(s.deliveries) for s in subscribers]
        connects = [c.connects for c in [*subscribers, *publishers]]
        assert broker.stop() == 0, broker.life_log()[-3000:]
        broker.start()
        assert wait_for(
            lambda: all(
                c.connects > n for c, n in zip([*subscribers, *publishers], connects, strict=True)
            ),
            10.0,
        ), "clients did not reconnect after a clean restart"
        time.sleep(SETTLE)
        for sub, before in zip(subscribers, delivered, strict=True):
            again = sub.deliveries[before:]
            if again:
                problems.append(f"{sub.name}: {len(again)} redelivered after a clean restart")

        # Everything acknowledged: the store holds the sessions and nothing else.
        for pub in publishers:
            pub.stopping.set()
        for pub in publishers:
            pub.join(5.0)
        for sub in subscribers:
            sub.disconnect()
        assert broker.stop() == 0, broker.life_log()[-3000:]
        records = store_records(broker.data_dir)
        expected_records = Counter({"s": PUBLISHERS + len(SUBSCRIBERS)})
        if records != expected_records:
            problems.append(f"store records by kind {dict(records)}, expected {expected_records}")
    except BaseException:
        print(f"\nbroker log ({broker.log_path}), last lines:\n{broker.log_text()[-4000:]}")
        raise
    finally:
        for pub in publishers:
            pub.stopping.set()
        broker.kill()
        for sub in subscribers:
            sub.client.loop_stop()
        for pub in publishers:
            pub.join(5.0)

    log = broker.log_text()
    for line in log.splitlines():
        if " ERROR " in line or " CRITICAL " in line or "Traceback" in line:
            problems.append(f"broker log: {line}")
    for queued, inflight in RESTORED.findall(log):
        figures.restored_queued += int(queued)
        figures.restored_inflight += int(inflight)
    all_messages = [m for p in publishers for m in p.messages]
    figures.published = len(all_messages)
    figures.published_qos2 = sum(m.qos == 2 for m in all_messages)
    figures.acknowledged = sum(m.acked for m in all_messages)
    figures.acknowledged_in_drain = sum(m.acked_in_drain for m in all_messages)
    figures.completed_qos2 = sum(m.completed for m in all_messages)
    figures.resent_publish = sum(p.resent_publish for p in publishers)
    figures.resent_pubrel = sum(p.resent_pubrel for p in publishers)
    f = figures
    print(
        f"\ncrash test fsync={plan.fsync} seed={seed}: {f.kills} kills ({f.early_kills} during "
        f"start-up, {f.burst_kills} during bursts, {f.deaf_kills} with acks unread, "
        f"{f.drain_kills} while offline sessions drained) in "
        f"{crash_time:.1f} s, {broker.lives} broker starts, final drain {drain_time:.1f} s, "
        f"{time.monotonic() - started:.1f} s in all\n"
        f"  published {f.published} ({f.published_qos2} QoS 2), acknowledged {f.acknowledged} "
        f"({f.acknowledged_in_drain} in the final run), QoS 2 completed {f.completed_qos2}; "
        f"unacknowledged at kills {f.in_flight_at_kills}; resent {f.resent_publish} PUBLISH "
        f"and {f.resent_pubrel} PUBREL\n"
        f"  restored at start-up (summed over the starts): {f.restored_queued} queued and "
        f"{f.restored_inflight} in-flight deliveries\n"
        f"  checked {f.checked} (acknowledged message x subscriber), delivered {f.delivered}, "
        f"lost {f.lost}, duplicated QoS 2 {f.duplicated_qos2}, duplicated QoS 1 "
        f"{f.duplicated_qos1}, unacknowledged but delivered {f.unacknowledged_delivered}"
    )
    assert f.kills >= min(plan.kills, 3), "too few kills: the crash phase hit its time cap"
    assert f.acknowledged, "nothing was acknowledged"
    assert not problems, "\n".join([*problems[:40], f"broker log: {broker.log_path}"])
