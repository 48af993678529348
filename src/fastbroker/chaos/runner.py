"""A fault-injection run: a cluster of real nodes in network namespaces behind HAProxy,
persistent subscribers and publishers (paho-mqtt, through HAProxy) that record everything
they do and see, and a nemesis that kills, stops, pauses, cuts off, removes and adds nodes
and fills their disks on a seeded schedule. The history goes to a file; the checker judges
it.

One fault at a time, so the cluster keeps its majority; "<fault>_long" outlasts the failure
timeout (the node is removed and added again), and a short split's links can stay silent
longer than the split (TCP's retransmission backoff), with the same effect (docs/chaos.md).
"""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastbroker.chaos.checker import Result, check
from fastbroker.chaos.front import admin_get
from fastbroker.chaos.history import Recorder, read
from fastbroker.chaos.nodes import Nodes

TOPIC = "chaos/t"
# Each publisher also sets a retained message on its own topic here (not subscribed to by
# the subscribers); the final reads compare them across nodes.
RETAINED_TOPIC = "chaos/r"
# Publishers' wills: under TOPIC, so the subscribers get them.
WILL_TOPIC = f"{TOPIC}/will"
SESSION_EXPIRY = 600
# paho gives up a CONNECT with no CONNACK after one keep alive: longer than a claim's
# longest wait (the failure timeout and 2 s). HAProxy closes the connections of a node it
# marks down, so a dead or paused node's clients find out in about a second anyway.
KEEPALIVE = 10
# As long as clients commonly wait for a CONNACK (paho's default is 5 s, others 10 to 30 s).
CONNECT_TIMEOUT = 10.0
IN_FLIGHT = 10
# What the nemesis does to a node; "<fault>_long" lasts past the failure timeout.
FAULTS = (
    "kill",
    "pause",
    "split",
    "stop",
    "kill_long",
    "pause_long",
    "split_long",
    "stop_long",
    "leave",
    "disk",
    "disk_long",
)
# Partial splits (Jepsen's "bridge"): the node keeps reaching every other node while the
# others, in two halves, stop reaching each other. Not in FAULTS, so that the seeds the docs
# record replay the same schedule; run them with `--faults`.
PARTIAL_FAULTS = ("bridge", "bridge_long")
KNOWN_FAULTS = FAULTS + PARTIAL_FAULTS


@dataclass(frozen=True)
class Schedule:
    nodes: int = 3
    seconds: float = 40.0
    seed: int = 1
    publishers: int = 3
    subscribers: int = 3
    # Publishes per second per publisher (at most IN_FLIGHT unacknowledged).
    rate: float = 20.0
    # "<fault>_long": lasts `long_for` s, past the failure timeout: the node is removed
    # from the cluster, and added again once it is back.
    faults: tuple[str, ...] = FAULTS
    # A fault begins every `fault_every` s (0.5x to 1.5x, seeded) and lasts `fault_for` s;
    # a split lasts from `split_for[0]` to `split_for[1]` s (seeded), shorter than the
    # failure timeout.
    fault_every: float = 6.0
    fault_for: float = 1.5
    split_for: tuple[float, float] = (1.0, 4.0)
    long_for: float = 8.0
    # Each subscriber leaves its node for another every this many s (uniform, seeded).
    move_every: tuple[float, float] = (2.0, 6.0)
    # Every publisher sets its retained message every this many of its publishes.
    retain_every: int = 10
    failure_timeout_ms: int = 5000


class Run:
    """One run: `execute()` returns the checker's result; the history is in `history`."""

    def __init__(self, schedule: Schedule, workdir: Path, subnet: int | None = None) -> None:
        self.schedule = schedule
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.history = workdir / "history.jsonl"
        subnet = subnet if subnet is not None else 220 + os.getpid() % 30
        settings = {
            "heartbeat_ms": 100,
            "election_timeout_ms": 400,
            "failure_timeout_ms": schedule.failure_timeout_ms,
            "discovery_interval_ms": 300,
        }
        self.cluster = Nodes(schedule.nodes, workdir, subnet, settings)
        self.prefix = f"chaos{schedule.seed}-{os.getpid()}"
        self.lock = threading.Lock()
        self.recorder: Recorder | None = None
        self.publishing = threading.Event()
        self.subscribing = threading.Event()
        self.last_receive = time.monotonic()
        self.faults = 0

    def record(self, process: str, kind: str, f: str, **value: Any) -> None:
        with self.lock:
            assert self.recorder is not None
            self.recorder.record(time.monotonic(), process, kind, f, **value)
            if f == "receive":
                self.last_receive = time.monotonic()

    def execute(self) -> Result:
        s = self.schedule
        with open(self.history, "w", encoding="utf-8") as out:
            self.recorder = Recorder(out, time.monotonic())
            try:
                self.cluster.start(60)
                self.drive(s)
            finally:
                self.publishing.clear()
                self.subscribing.clear()
                self.cluster.stop()
        return check(read(self.history))

    def drive(self, s: Schedule) -> None:
        subscribers = [Subscriber(self, f"s{i}", s.seed * 1000 + i) for i in range(s.subscribers)]
        publishers = [
            Publisher(self, f"p{i}", s.seed * 1000 + 500 + i, qos=1 + i % 2)
            for i in range(s.publishers)
        ]
        self.subscribing.set()
        for sub in subscribers:
            sub.thread.start()
        deadline = time.monotonic() + 30
        while not all(sub.subscribed for sub in subscribers):
            if time.monotonic() > deadline:
                raise TimeoutError("the subscribers did not subscribe within 30 s")
            time.sleep(0.05)
        self.publishing.set()
        for pub in publishers:
            pub.thread.start()
        # In this thread: a node started from another thread would die with it (its parent
        # death signal follows the thread that forked it).
        self.nemesis(time.monotonic() + s.seconds)
        self.record("nemesis", "info", "heal")
        self.cluster.wait_converged(60)
        self.publishing.clear()
        for pub in publishers:
            pub.thread.join()
        # Every subscriber connected, and nothing new for 3 s (60 s at most).
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            quiet = time.monotonic() - self.last_receive > 3
            if quiet and all(sub.connected for sub in subscribers):
                break
            time.sleep(0.1)
        self.subscribing.clear()
        for sub in subscribers:
            sub.thread.join()
        topics = sorted({pub.retained_topic for pub in publishers})
        for node in self.cluster.nodes:
            self.read_retained(node.node_id, self.cluster.front.node_mqtt(node.node_id), topics)
        self.read_sessions([sub.client_id for sub in subscribers])

    def read_sessions(self, clients: list[str]) -> None:
        """Records which nodes hold a session of each of `clients` (each node's admin
        endpoint, `GET /clients/ID`; a node that does not answer counts as holding none)."""
        front = self.cluster.front
        for client in clients:
            held = []
            for node in self.cluster.nodes:
                answer = admin_get(front.node_admin(node.node_id), f"/clients/{quote(client)}")
                if isinstance(answer, dict) and answer.get("session"):
                    held.append(node.node_id)
            self.record("reader", "info", "sessions", client=client, nodes=held)

    def read_retained(self, node: str, path: str, topics: list[str]) -> None:
        """Records the retained message `node` holds for each of `topics` (through its own
        socket): subscribes, and takes what comes until 1 s passes with nothing new. A node
        that refuses the connect (0x88: catching up after a pause or a full disk, for the
        failure timeout) is asked again, for 20 s at most."""
        from paho.mqtt.client import CallbackAPIVersion, Client
        from paho.mqtt.enums import MQTTProtocolVersion

        held: dict[str, str] = {}
        last = [time.monotonic()]

        def on_message(client: Any, userdata: Any, message: Any) -> None:
            held[message.topic] = message.payload.decode(errors="replace")
            last[0] = time.monotonic()

        until = time.monotonic() + 20
        while True:
            client = Client(
                CallbackAPIVersion.VERSION2,
                client_id=f"{self.prefix}-read-{node}",
                protocol=MQTTProtocolVersion.MQTTv5,
                transport="unix",
            )
            client.on_message = on_message
            client.connect(path, keepalive=KEEPALIVE)
            deadline = time.monotonic() + 2
            while not client.is_connected() and time.monotonic() < deadline:
                if client.loop(0.05) != 0:
                    break
            if client.is_connected() or time.monotonic() >= until:
                break
            client.disconnect()
            time.sleep(0.5)
        client.subscribe(f"{RETAINED_TOPIC}/#", qos=1)
        last[0] = time.monotonic()
        deadline = time.monotonic() + 10
        while time.monotonic() - last[0] < 1.0 and time.monotonic() < deadline:
            client.loop(0.05)
        client.disconnect()
        for topic in topics:
            self.record("reader", "info", "retained", node=node, topic=topic, id=held.get(topic))

    def nemesis(self, end: float) -> None:
        """Faults, one at a time, until `end` (monotonic s)."""
        s = self.schedule
        rng = random.Random(s.seed)
        while True:
            wait = s.fault_every * (0.5 + rng.random())
            if time.monotonic() + wait >= end:
                time.sleep(max(0.0, end - time.monotonic()))
                return
            time.sleep(wait)
            node = rng.choice(self.cluster.nodes)
            fault = rng.choice(s.faults)
            self.faults += 1
            number = self.cluster.nodes.index(node) + 1
            network = self.cluster.network
            # The fault, what ends it, and the name of its end in the history.
            kind = fault.removesuffix("_long")
            sides = split_sides(kind, number, s.nodes)
            apply, revert, reverted = {
                "kill": (node.kill, node.start, "start"),
                "pause": (node.pause, node.resume, "resume"),
                # A planned stop (SIGTERM, waited for), as in a rolling restart.
                "stop": (node.stop, node.start, "start"),
                # Scaling in, then out: it leaves the cluster (its partitions move to the
                # others), and joins again as a new node with an empty disk.
                "leave": (node.leave, node.join_afresh, "join"),
                # Cut off from the other nodes; HAProxy still reaches it.
                "split": (partial(network.split, sides), network.heal, "heal"),
                # The node is the only one that reaches both halves of the others.
                "bridge": (partial(network.split, sides), network.heal, "heal"),
                # Its data directory's file system full (every free byte taken), then
                # space again: it refuses what it cannot store and recovers by itself.
                "disk": (node.fill_disk, node.empty_disk, "space"),
            }[kind]
            if fault != kind:
                lasts = s.long_for
            elif kind in ("split", "bridge", "disk"):
                lasts = rng.uniform(*s.split_for)
            else:
                lasts = s.fault_for
            self.record("nemesis", "info", fault, node=node.node_id, seconds=round(lasts, 3))
            apply()
            time.sleep(lasts)
            revert()
            self.record("nemesis", "info", reverted, node=node.node_id)
            # The next fault only once the cluster is whole again (how long that took is
            # one of the recovery figures: chaos/recovery.py).
            try:
                after = self.cluster.wait_converged(30)
            except TimeoutError:
                self.record("nemesis", "info", "not_converged", node=node.node_id)
            else:
                self.record(
                    "nemesis", "info", "converged", node=node.node_id, after=round(after, 3)
                )


def clients_unavailable() -> str | None:
    """Why the run's MQTT clients cannot be made here, or None: paho-mqtt comes with the
    `chaos` extra, not with the broker."""
    try:
        import paho.mqtt.client  # noqa: F401
    except ImportError:
        return "paho-mqtt is not installed (pip install 'fastbroker[chaos]')"
    return None


def split_sides(kind: str, number: int, nodes: int) -> list[list[int]]:
    """The sides of a `split` (node `number` alone against the others) or a `bridge` (the
    others in two halves, node `number` on neither: it reaches both)."""
    rest = [i for i in range(1, nodes + 1) if i != number]
    if kind == "bridge":
        return [rest[::2], rest[1::2]]
    return [[number], rest]


class Connection:
    """A paho-mqtt client driven by its own thread (`loop()`), moved to another node when
    its connection drops."""

    def __init__(self, run: Run, name: str, seed: int, persistent: bool) -> None:
        self.run = run
        self.name = name
        self.client_id = f"{run.prefix}-{name}"
        self.rng = random.Random(seed)
        self.persistent = persistent
        self.connected = False
        self.mqtt: Any = None
        self.connecting_since = 0.0
        # Connections made so far (a will's id names the connection it belongs to).
        self.connections = 0

    def new_client(self) -> Any:
        # paho-mqtt is the `chaos` extra's (`clients_unavailable` checks it first).
        from paho.mqtt.client import CallbackAPIVersion, Client
        from paho.mqtt.enums import MQTTProtocolVersion

        client = Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=MQTTProtocolVersion.MQTTv5,
            transport="unix",
        )
        client.on_connect = self.on_connect
        client.on_disconnect = self.on_disconnect
        return client

    def will(self) -> dict[str, str] | None:
        """The will of the next connection ({"topic", "id"}), or None."""
        return None

    def connect(self) -> bool:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties

        props = Properties(PacketTypes.CONNECT)
        if self.persistent:
            props.SessionExpiryInterval = SESSION_EXPIRY
        self.connections += 1
        will = self.will()
        self.mqtt.will_clear()
        if will is not None:
            self.mqtt.will_set(will["topic"], will["id"].encode(), qos=1)
        # Through HAProxy: which node it lands on is HAProxy's choice (round robin).
        value = {"client": self.client_id, "node": "front", "clean": not self.persistent}
        self.run.record(self.name, "invoke", "connect", **value, will=will)
        try:
            self.mqtt.connect(
                self.run.cluster.front.mqtt_socket,
                keepalive=KEEPALIVE,
                clean_start=not self.persistent,
                properties=props,
            )
        except OSError as error:
            self.run.record(self.name, "fail", "connect", **value, error=str(error))
            time.sleep(0.2)
            return False
        self.connecting_since = time.monotonic()
        deadline = self.connecting_since + CONNECT_TIMEOUT
        while not self.connected and time.monotonic() < deadline:
            if self.mqtt.loop(0.05) != 0:
                break
        if not self.connected:
            self.run.record(self.name, "info", "connect", **value, error="no CONNACK")
            self.mqtt.disconnect()
            return False
        return True

    def on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        value = {"client": self.client_id, "node": "front"}
        if reason.is_failure:
            self.run.record(self.name, "fail", "connect", **value, reason=str(reason))
            return
        self.connected = True
        present = bool(flags.session_present)
        waited = round(time.monotonic() - self.connecting_since, 3)
        self.run.record(self.name, "ok", "connect", **value, session_present=present, waited=waited)

    def on_disconnect(
        self, client: Any, userdata: Any, flags: Any, reason: Any, props: Any
    ) -> None:
        if self.connected:
            self.run.record(
                self.name, "info", "disconnected", client=self.client_id, reason=str(reason)
            )
        self.connected = False


class Subscriber(Connection):
    """A persistent MQTT 5 session subscribed to every publisher's topic at QoS 2 once; one
    paho client for the whole run, so its half-done QoS 2 flows survive a move."""

    def __init__(self, run: Run, name: str, seed: int) -> None:
        super().__init__(run, name, seed, persistent=True)
        self.subscribed = False
        self.mqtt = self.new_client()
        self.mqtt.on_message = self.on_message
        self.mqtt.on_subscribe = self.on_subscribe
        self.thread = threading.Thread(target=self.main, name=name, daemon=True)

    def main(self) -> None:
        move_at = self.next_move()
        while self.run.subscribing.is_set():
            if not self.connected:
                if not self.connect():
                    continue
                if not self.subscribed:
                    value = {"client": self.client_id, "filter": f"{TOPIC}/#", "qos": 2}
                    self.run.record(self.name, "invoke", "subscribe", **value)
                    self.mqtt.subscribe(f"{TOPIC}/#", qos=2)
            if self.run.publishing.is_set() and time.monotonic() >= move_at:
                self.move()
                move_at = self.next_move()
                continue
            if self.mqtt.loop(0.05) != 0:
                self.connected = False
        if self.connected:
            self.mqtt.disconnect()
            self.mqtt.loop(0.1)

    def next_move(self) -> float:
        lo, hi = self.run.schedule.move_every
        return time.monotonic() + self.rng.uniform(lo, hi)

    def move(self) -> None:
        """Leaves its node, to reconnect through HAProxy (to the next node in its rotation):
        half the time with a DISCONNECT, half by dropping the socket (what is in flight is
        then resent)."""
        abrupt = self.rng.random() < 0.5
        self.run.record(self.name, "info", "move", client=self.client_id, abrupt=abrupt)
        if abrupt:
            sock = self.mqtt.socket()
            if sock is not None:
                # paho reads the end of the stream and closes the socket itself.
                sock.shutdown(socket.SHUT_RDWR)
            self.mqtt.loop(0.01)
        else:
            self.mqtt.disconnect()
            self.mqtt.loop(0.05)
        self.connected = False

    def on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, props: Any) -> None:
        value = {"client": self.client_id, "filter": f"{TOPIC}/#"}
        if any(r.is_failure for r in reasons):
            self.run.record(self.name, "fail", "subscribe", **value, qos=2)
            return
        self.run.record(self.name, "ok", "subscribe", **value, qos=int(reasons[0].value))
        self.subscribed = True

    def on_message(self, client: Any, userdata: Any, message: Any) -> None:
        self.run.record(
            self.name,
            "info",
            "receive",
            client=self.client_id,
            topic=message.topic,
            qos=message.qos,
            id=message.payload.decode(errors="replace"),
            retain=bool(message.retain),
            dup=bool(message.dup),
        )


class Publisher(Connection):
    """Publishes numbered messages to its own topic at one QoS; a new clean session for each
    connection, so an unacknowledged publish whose connection dropped is of unknown outcome
    (recorded `info`) and never sent again. Each connection has a QoS 1 will, one id per
    connection, on a topic the subscribers' filter matches: a connection that ends without
    DISCONNECT (its node killed, paused or cut off past the failure timeout) has it
    published, every subscriber gets it (`will_lost`) and none twice (`will_twice`)."""

    def __init__(self, run: Run, name: str, seed: int, qos: int) -> None:
        super().__init__(run, name, seed, persistent=False)
        self.qos = qos
        self.topic = f"{TOPIC}/{name}"
        self.retained_topic = f"{RETAINED_TOPIC}/{name}"
        self.pending: dict[int, dict[str, Any]] = {}
        self.thread = threading.Thread(target=self.main, name=name, daemon=True)

    def main(self) -> None:
        interval = 1.0 / self.run.schedule.rate
        seq = 0
        next_at = time.monotonic()
        while self.run.publishing.is_set():
            if not self.connected:
                self.forget_pending()
                self.mqtt = self.new_client()
                self.mqtt.on_publish = self.on_publish
                if not self.connect():
                    continue
            if time.monotonic() >= next_at and len(self.pending) < IN_FLIGHT:
                retain = seq % self.run.schedule.retain_every == 0
                value = {
                    "client": self.client_id,
                    "topic": self.retained_topic if retain else self.topic,
                    "qos": self.qos,
                    "retain": retain,
                    "id": f"{self.name}-{seq}",
                }
                seq += 1
                next_at += interval
                self.run.record(self.name, "invoke", "publish", **value)
                info = self.mqtt.publish(
                    value["topic"], value["id"].encode(), qos=self.qos, retain=retain
                )
                self.pending[info.mid] = value
            if self.mqtt.loop(0.01) != 0:
                self.connected = False
        # What is in flight gets 10 s to be acknowledged.
        deadline = time.monotonic() + 10
        while self.pending and self.connected and time.monotonic() < deadline:
            if self.mqtt.loop(0.05) != 0:
                self.connected = False
        self.forget_pending()
        if self.connected:
            self.mqtt.disconnect()
            self.mqtt.loop(0.1)

    def will(self) -> dict[str, str] | None:
        return {"topic": f"{WILL_TOPIC}/{self.name}", "id": f"{self.name}-will-{self.connections}"}

    def forget_pending(self) -> None:
        for value in self.pending.values():
            self.run.record(self.name, "info", "publish", **value)
        self.pending.clear()

    def on_publish(self, client: Any, userdata: Any, mid: int, reason: Any, props: Any) -> None:
        value = self.pending.pop(mid, None)
        if value is None:
            return
        kind = "fail" if reason.is_failure else "ok"
        self.run.record(self.name, kind, "publish", **value)
