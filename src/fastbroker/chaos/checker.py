"""Checks a fault-injection history (``history.py``) for the anomalies the cluster must not
show, from the history alone (Jepsen's checker design: the broker is not asked).

- ``lost``: a QoS >= 1 publish acknowledged (``ok``) after a persistent client's
  subscription of at least QoS 1 that matches its topic was acknowledged, and that the
  client never unsubscribed, never reached that client.
- ``duplicated``: a client received one message at QoS 2 more than once.
- ``reordered``: a client received messages of one publisher on one topic (at one QoS) out
  of the order they were published in (first receipts count; redeliveries may repeat).
- ``resurrected``: a client received a message published after it unsubscribed every
  filter that matches the topic (a subscription that came back), or one it never
  subscribed to; retained messages sent on subscribe are not counted.
- ``retained_diverged``: nodes hold different retained messages for a topic after the heal;
  ``retained_stale``: they agree on one older than an acknowledged write that began after
  it completed (or on none while such a write set one).
- ``sessions``: more than one node holds a session of one client id after the heal, or
  none holds a persistent subscriber's.
- ``will_twice``: a will (one per connection, by its id) reached one client twice as a new
  message (not a redelivery with the DUP flag).
- ``will_lost``: a connection with a will, acknowledged (CONNACK), ended without the
  client's DISCONNECT (its node killed, paused, cut off or out of store, or the client gave
  up on it), and its will never reached a persistent client whose matching subscription of
  at least QoS 1 was acknowledged before that end. Connections that ended within
  ``WILL_GRACE_S`` of the history's end (its final reads) are not checked: a will may
  wait the failure timeout after a node's return.

Exceptions, reported apart with their counts, not as anomalies: lost messages of a client
up to the number the broker counted as dropped for it (its queue limit); lost messages up
to the number of degraded acknowledgements given by nodes whose data was then destroyed;
and late receipts of publishes whose outcome is unknown (``reordered_indeterminate``: the
publisher's connection ended before the acknowledgement, and it went on in a new clean
session). As in Jepsen, such a publish may take effect at any moment after it was invoked,
so it has no place in its publisher's order: it is not checked against the others, and
they are not checked against it.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fastbroker.chaos.history import Op
from fastbroker.chaos.recovery import Recovery, by_kind, measure

ANOMALIES = (
    "lost",
    "duplicated",
    "reordered",
    "resurrected",
    "retained_diverged",
    "retained_stale",
    "sessions",
    "will_twice",
    "will_lost",
)
# Seconds before the final reads within which an ended connection's will is not expected.
WILL_GRACE_S = 10.0
# Details kept per anomaly kind (the counts are always whole).
DETAILS_MAX = 20


def topic_matches(topic_filter: str, topic: str) -> bool:
    """MQTT filter matching (``+`` one level, ``#`` the rest; ``$`` topics only by filters
    that name their first level)."""
    levels = topic.split("/")
    parts = topic_filter.split("/")
    if topic.startswith("$") and parts[0] in ("+", "#"):
        return False
    for i, part in enumerate(parts):
        if part == "#":
            return True
        if i >= len(levels):
            return False
        if part != "+" and part != levels[i]:
            return False
    return len(parts) == len(levels)


@dataclass
class Publish:
    client: str
    topic: str
    qos: int
    retain: bool
    id: str
    invoked: int
    outcome: str = "info"
    completed: int | None = None


@dataclass
class Result:
    anomalies: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ANOMALIES, 0))
    details: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    exceptions: dict[str, int] = field(
        default_factory=lambda: {"dropped": 0, "degraded": 0, "reordered_indeterminate": 0}
    )
    counts: dict[str, int] = field(default_factory=dict)
    # Not anomalies: how long each fault hurt (recovery.py).
    recovery: list[Recovery] = field(default_factory=list)

    @property
    def valid(self) -> bool:
        return not any(self.anomalies.values())

    def add(self, kind: str, detail: str) -> None:
        self.anomalies[kind] += 1
        if len(self.details[kind]) < DETAILS_MAX:
            self.details[kind].append(detail)

    def verdict(self) -> str:
        """One line: the verdict, the anomalies by kind, the exceptions and what was checked."""
        word = "VALID" if self.valid else "INVALID"
        found = " ".join(f"{k}={v}" for k, v in self.anomalies.items())
        excepted = " ".join(f"{k}={v}" for k, v in self.exceptions.items())
        checked = " ".join(f"{k}={v}" for k, v in sorted(self.counts.items()))
        return f"{word}: anomalies {found}; exceptions {excepted}; checked {checked}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "valid": self.valid,
            "anomalies": self.anomalies,
            "details": dict(self.details),
            "exceptions": self.exceptions,
            "counts": self.counts,
            "recovery": [r.to_dict() for r in self.recovery],
            "recovery_by_kind": by_kind(self.recovery),
        }


class History:
    """What the checks need, indexed once."""

    def __init__(self, ops: Iterable[Op]) -> None:
        self.publishes: dict[str, Publish] = {}
        self.by_process_publish: dict[str, list[Publish]] = defaultdict(list)
        # Per client: (filter, qos, acknowledged at, unsubscribe invoked at or None).
        self.subscriptions: dict[str, list[list[Any]]] = defaultdict(list)
        # Per client and filter: the indexes of subscribe invokes and unsubscribe oks.
        self.subscribe_invokes: dict[tuple[str, str], list[int]] = defaultdict(list)
        self.unsubscribe_oks: dict[tuple[str, str], list[int]] = defaultdict(list)
        self.filters: dict[str, set[str]] = defaultdict(set)
        self.clean: dict[str, bool] = {}
        self.receives: list[Op] = []
        self.retained: dict[str, dict[str, str | None]] = defaultdict(dict)
        self.sessions: dict[str, list[str]] = {}
        self.wills: dict[str, str] = {}
        self.will_topics: dict[str, str] = {}
        # Wills of acknowledged connections, and how those ended: (time, index, reason).
        self.wills_accepted: set[str] = set()
        self.will_ends: dict[str, tuple[float, int, str]] = {}
        # The time of the last record (the final reads).
        self.end = 0.0
        current_will: dict[str, str] = {}
        self.dropped: Counter[str] = Counter()
        self.degraded_destroyed = 0
        pending_subscribe: dict[tuple[str, str], int] = {}
        pending_publish: dict[str, Publish] = {}
        last = 0.0
        for op in ops:
            v = op.value
            last = op.t
            if op.f == "connect" and op.type == "invoke":
                client = str(v["client"])
                # Persistent only if every connect of the run keeps the session.
                self.clean[client] = self.clean.get(client, False) or bool(v.get("clean"))
                will = v.get("will")
                current_will.pop(op.process, None)
                if will:
                    self.wills[str(will["id"])] = client
                    self.will_topics[str(will["id"])] = str(will["topic"])
                    current_will[op.process] = str(will["id"])
            elif op.f == "connect" and op.type == "ok" and op.process in current_will:
                self.wills_accepted.add(current_will[op.process])
            elif op.f == "disconnected" and op.process in current_will:
                ident = current_will.pop(op.process)
                self.will_ends[ident] = (op.t, op.index, str(v.get("reason", "")))
            elif op.f == "subscribe":
                key = (str(v["client"]), str(v["filter"]))
                if op.type == "invoke":
                    pending_subscribe[key] = op.index
                    self.subscribe_invokes[key].append(op.index)
                    self.filters[key[0]].add(key[1])
                elif op.type == "ok":
                    pending_subscribe.pop(key, None)
                    qos = int(v.get("qos", 0))
                    self.subscriptions[key[0]].append([key[1], qos, op.index, None])
            elif op.f == "unsubscribe":
                client, topic_filter = str(v["client"]), str(v["filter"])
                if op.type == "invoke":
                    for sub in self.subscriptions[client]:
                        if sub[0] == topic_filter and sub[3] is None:
                            sub[3] = op.index
                elif op.type == "ok":
                    self.unsubscribe_oks[(client, topic_filter)].append(op.index)
            elif op.f == "publish":
                self._publish(op, pending_publish)
            elif op.f == "receive":
                self.receives.append(op)
            elif op.f == "retained":
                ident = v.get("id")
                self.retained[str(v["topic"])][str(v["node"])] = str(ident) if ident else None
            elif op.f == "sessions":
                self.sessions[str(v["client"])] = [str(n) for n in v.get("nodes", [])]
            elif op.f == "dropped":
                self.dropped[str(v["client"])] += int(v.get("count", 0))
            elif op.f == "degraded" and v.get("destroyed"):
                self.degraded_destroyed += int(v.get("count", 0))
        self.end = last

    def _publish(self, op: Op, pending: dict[str, Publish]) -> None:
        v = op.value
        ident = str(v.get("id", ""))
        key = f"{op.process}\0{ident}"
        if op.type == "invoke":
            p = Publish(
                client=str(v.get("client", op.process)),
                topic=str(v["topic"]),
                qos=int(v.get("qos", 0)),
                retain=bool(v.get("retain")),
                id=ident,
                invoked=op.index,
            )
            pending[key] = p
            self.by_process_publish[op.process].append(p)
            if ident:
                self.publishes[ident] = p
        elif key in pending:
            p = pending.pop(key)
            p.outcome = op.type
            p.completed = op.index


def check(ops: Iterable[Op]) -> Result:
    ops = list(ops)
    h = History(ops)
    result = Result(recovery=measure(ops))
    received: dict[str, Counter[str]] = defaultdict(Counter)
    received_new: dict[str, Counter[str]] = defaultdict(Counter)
    qos2: dict[str, set[str]] = defaultdict(set)
    for r in h.receives:
        client, ident = str(r.value["client"]), str(r.value.get("id", ""))
        received[client][ident] += 1
        if not r.value.get("dup"):
            received_new[client][ident] += 1
        if int(r.value.get("qos", 0)) == 2:
            qos2[client].add(ident)
    check_lost(h, received, result)
    for client, ids in qos2.items():
        for ident in sorted(ids):
            times = received[client][ident]
            if times > 1:
                result.add("duplicated", f"{client} got QoS 2 message {ident} {times} times")
    check_order(h, result)
    check_resurrected(h, result)
    check_retained(h, result)
    check_wills_lost(h, received, result)
    for client, nodes in sorted(h.sessions.items()):
        if len(nodes) > 1:
            result.add("sessions", f"{client} has sessions on {', '.join(sorted(nodes))}")
        elif not nodes:
            result.add("sessions", f"{client} has a session on no node")
    for ident, owner in sorted(h.wills.items()):
        for client, counts in received_new.items():
            if counts[ident] > 1:
                detail = f"the will {ident} of {owner} reached {client} {counts[ident]} times"
                result.add("will_twice", detail)
    acked = [p for p in h.publishes.values() if p.outcome == "ok" and p.qos > 0]
    result.counts = {
        "publishes": sum(len(ps) for ps in h.by_process_publish.values()),
        "acknowledged": len(acked),
        "receives": len(h.receives),
        "clients": len(h.clean),
        "retained_topics": len(h.retained),
        # Wills of ended connections that reached a subscriber (each connection has its own).
        "wills": len({i for counts in received_new.values() for i in counts if i in h.wills}),
    }
    return result


def check_lost(h: History, received: dict[str, Counter[str]], result: Result) -> None:
    persistent = [c for c, clean in h.clean.items() if not clean]
    lost: Counter[str] = Counter()
    details: list[str] = []
    for p in h.publishes.values():
        if p.outcome != "ok" or p.qos == 0 or not p.id:
            continue
        for client in persistent:
            if received[client][p.id]:
                continue
            wants = any(
                sub_qos > 0 and until is None and at < p.invoked and topic_matches(f, p.topic)
                for f, sub_qos, at, until in h.subscriptions[client]
            )
            if wants:
                lost[client] += 1
                details.append(f"{p.id} ({p.client} on {p.topic}) never reached {client}")
    budget = h.degraded_destroyed
    for client, count in sorted(lost.items()):
        dropped = min(count, h.dropped[client])
        result.exceptions["dropped"] += dropped
        degraded = min(count - dropped, budget)
        budget -= degraded
        result.exceptions["degraded"] += degraded
        for _ in range(count - dropped - degraded):
            result.anomalies["lost"] += 1
    result.details["lost"] = details[:DETAILS_MAX] if result.anomalies["lost"] else []


def check_wills_lost(h: History, received: dict[str, Counter[str]], result: Result) -> None:
    persistent = [c for c, clean in h.clean.items() if not clean]
    for ident, (t, index, reason) in sorted(h.will_ends.items()):
        if ident not in h.wills_accepted or reason == "Normal disconnection":
            continue
        if t + WILL_GRACE_S > h.end:
            continue
        topic = h.will_topics[ident]
        for client in persistent:
            if received[client][ident]:
                continue
            wants = any(
                sub_qos > 0 and until is None and at < index and topic_matches(f, topic)
                for f, sub_qos, at, until in h.subscriptions[client]
            )
            if wants:
                detail = (
                    f"the will {ident} of {h.wills[ident]} (its connection ended at {t:.3f} s: "
                    f"{reason}) never reached {client}"
                )
                result.add("will_lost", detail)


def check_order(h: History, result: Result) -> None:
    # Each publish's place in its publisher's sequence on its topic at its QoS.
    place: dict[str, tuple[str, int]] = {}
    for process, publishes in h.by_process_publish.items():
        seq: Counter[tuple[str, int]] = Counter()
        for p in publishes:
            if p.id:
                stream = f"{process} {p.topic} qos{p.qos}"
                place[p.id] = (stream, seq[(p.topic, p.qos)])
                seq[(p.topic, p.qos)] += 1
    last: dict[tuple[str, str], int] = {}
    seen: set[tuple[str, str]] = set()
    for r in h.receives:
        client, ident = str(r.value["client"]), str(r.value.get("id", ""))
        if (client, ident) in seen or ident not in place or r.value.get("retain"):
            continue
        seen.add((client, ident))
        stream, n = place[ident]
        before = last.get((client, stream), -1)
        if h.publishes[ident].outcome == "info":
            # Unknown outcome: its moment is not known either (see the module's docstring).
            result.exceptions["reordered_indeterminate"] += int(n < before)
            continue
        if n < before:
            result.add("reordered", f"{client} got {ident} (#{n} of {stream}) after #{before}")
        last[(client, stream)] = max(n, before)


def check_resurrected(h: History, result: Result) -> None:
    for r in h.receives:
        client, ident = str(r.value["client"]), str(r.value.get("id", ""))
        p = h.publishes.get(ident)
        if p is None or r.value.get("retain") or ident in h.wills:
            continue
        matching = [f for f in h.filters[client] if topic_matches(f, p.topic)]
        if not matching:
            result.add("resurrected", f"{client} got {ident} on {p.topic}, never subscribed")
        elif not any(subscribed(h, client, f, p.invoked, r.index) for f in matching):
            result.add("resurrected", f"{client} got {ident} on {p.topic} after unsubscribing")


def subscribed(h: History, client: str, topic_filter: str, published: int, received: int) -> bool:
    """Whether `client` had `topic_filter` when a message was published (the last of its
    subscribe invokes and unsubscribe oks before is a subscribe), or subscribed it again
    before it received the message."""
    key = (client, topic_filter)
    subs = h.subscribe_invokes[key]
    last_sub = max((i for i in subs if i < published), default=-1)
    last_unsub = max((i for i in h.unsubscribe_oks[key] if i < published), default=-1)
    return last_sub > last_unsub or any(published <= i < received for i in subs)


def check_retained(h: History, result: Result) -> None:
    writes: dict[str, list[Publish]] = defaultdict(list)
    for publishes in h.by_process_publish.values():
        for p in publishes:
            if p.retain:
                writes[p.topic].append(p)
    for topic, by_node in sorted(h.retained.items()):
        values = set(by_node.values())
        if len(values) > 1:
            shown = ", ".join(f"{n}={v}" for n, v in sorted(by_node.items()))
            result.add("retained_diverged", f"{topic}: {shown}")
            continue
        value = values.pop()
        ws = [w for w in writes[topic] if w.outcome != "fail"]
        acked = [w for w in ws if w.outcome == "ok" and w.completed is not None]

        def superseded(w: Publish, acked: list[Publish] = acked) -> bool:
            # A write whose outcome is unknown may take effect at any later moment.
            if w.outcome != "ok" or w.completed is None:
                return False
            return any(a.invoked > w.completed for a in acked)

        allowed = {w.id or None for w in ws if not superseded(w)}
        if not acked:
            allowed.add(None)
        if value not in allowed:
            expected = ", ".join(sorted(map(str, allowed)))
            result.add(
                "retained_stale", f"{topic}: every node holds {value}, not one of {expected}"
            )
