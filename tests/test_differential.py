"""Differential scenarios: the same multi-client script against every selected broker.

Each scenario records, per client, the sequence of what it observed: received messages
as (topic, payload, qos, retain) plus a few protocol events (CONNACK session-present,
SUBACK codes). The transcripts of all brokers that ran must be identical, and equal to
the transcript written down here (so a run against Mosquitto alone still checks the
script, and a run against fastbroker alone still checks fastbroker).

Scripts avoid what the specs leave open (QoS 0 queued for offline clients, ordering
between different publishers, overlapping subscriptions, shared-subscription choice):
each step has a single publisher, and the recorder waits for all clients to go quiet
before the next step.
"""

from __future__ import annotations

import queue
import time

import pytest
from conftest import selected_kinds

QUIET = 0.15


class Recorder:
    def __init__(self, broker, connect, version: int):
        self.broker = broker
        self._connect = connect
        self.version = version
        self.clients = {}
        self.log: dict[str, list] = {}

    def persistent(self) -> dict:
        if self.version == 5:
            return {"clean": False, "props": {"SessionExpiryInterval": 300}}
        return {"clean": False}

    def client(self, name: str, client_id: str | None = None, **kw):
        """(Re)connect the client called ``name``; its transcript continues."""
        old = self.clients.get(name)
        if old is not None:
            self._collect(name)
            old.close()
        kw.setdefault("version", self.version)
        c = self._connect(self.broker, client_id=client_id, **kw)
        self.clients[name] = c
        self.log.setdefault(name, []).append(("connack", c.connack.session_present))
        return c

    def subscribe(self, name: str, *args, **kw):
        """Log the SUBACK, then whatever the subscription brings (retained messages),
        whether the broker sends those before or after the SUBACK."""
        self._collect(name)
        codes = self.clients[name].subscribe(*args, **kw)
        self.log[name].append(("suback", tuple(codes)))
        self.settle()
        return codes

    def drop(self, name: str, clean: bool = True):
        """Disconnect (DISCONNECT packet when clean, else just close the socket)."""
        self._collect(name)
        c = self.clients.pop(name)
        if clean:
            c.disconnect()
        else:
            c.kill()

    def _collect(self, name: str) -> int:
        c = self.clients.get(name)
        n = 0
        while c is not None:
            try:
                m = c.messages.get_nowait()
            except queue.Empty:
                break
            self.log[name].append((m.topic, m.payload, m.qos, m.retain))
            n += 1
        return n

    def settle(self):
        """Wait until no client has received anything for QUIET seconds (bounded)."""
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            time.sleep(QUIET)
            if sum(self._collect(name) for name in list(self.clients)) == 0:
                return
        raise AssertionError("clients never went quiet")

    def transcript(self) -> dict:
        self.settle()
        return {name: list(events) for name, events in self.log.items()}


# --------------------------------------------------------------------------- scenarios


def retained_lifecycle(rec: Recorder, u: str):
    pub = rec.client("pub")
    pub.publish(f"{u}/s/1", b"one", qos=1, retain=True)
    pub.publish(f"{u}/s/2", b"two", qos=1, retain=True)
    rec.client("early")
    rec.subscribe("early", f"{u}/s/#", qos=1)
    rec.settle()
    pub.publish(f"{u}/s/1", b"one-b", qos=1, retain=True)
    rec.settle()
    pub.publish(f"{u}/s/2", b"", qos=1, retain=True)
    rec.settle()
    rec.client("late")
    rec.subscribe("late", f"{u}/s/#", qos=2)


def retained_lifecycle_expected(u: str, v: int) -> dict:
    return {
        "pub": [("connack", False)],
        "early": [
            ("connack", False),
            ("suback", (1,)),
            (f"{u}/s/1", b"one", 1, True),
            (f"{u}/s/2", b"two", 1, True),
            (f"{u}/s/1", b"one-b", 1, False),
            (f"{u}/s/2", b"", 1, False),
        ],
        "late": [("connack", False), ("suback", (2,)), (f"{u}/s/1", b"one-b", 1, True)],
    }


def offline_queue(rec: Recorder, u: str):
    rec.client("sub", client_id=f"{u}-sub", **rec.persistent())
    rec.subscribe("sub", [(f"{u}/q/+", 2)])
    rec.drop("sub")
    pub = rec.client("pub")
    pub.publish(f"{u}/q/a", b"1", qos=1)
    pub.publish(f"{u}/q/b", b"2", qos=2)
    pub.publish(f"{u}/q/a", b"3", qos=2)
    pub.publish(f"{u}/other", b"x", qos=1)
    rec.settle()
    rec.client("sub", client_id=f"{u}-sub", **rec.persistent())
    rec.settle()
    pub.publish(f"{u}/q/c", b"4", qos=1)
    rec.settle()
    rec.drop("sub")
    rec.client("sub", client_id=f"{u}-sub", clean=True)


def offline_queue_expected(u: str, v: int) -> dict:
    return {
        "sub": [
            ("connack", False),
            ("suback", (2,)),
            ("connack", True),
            (f"{u}/q/a", b"1", 1, False),
            (f"{u}/q/b", b"2", 2, False),
            (f"{u}/q/a", b"3", 2, False),
            (f"{u}/q/c", b"4", 1, False),
            ("connack", False),
        ],
        "pub": [("connack", False)],
    }


def qos_matrix(rec: Recorder, u: str):
    for q in (0, 1, 2):
        rec.client(f"sub{q}")
        rec.subscribe(f"sub{q}", f"{u}/m", qos=q)
    pub = rec.client("pub")
    for q in (0, 1, 2):
        pub.publish(f"{u}/m", f"q{q}".encode(), qos=q)
        rec.settle()


def qos_matrix_expected(u: str, v: int) -> dict:
    out = {}
    for sq in (0, 1, 2):
        out[f"sub{sq}"] = [("connack", False), ("suback", (sq,))] + [
            (f"{u}/m", f"q{pq}".encode(), min(pq, sq), False) for pq in (0, 1, 2)
        ]
    out["pub"] = [("connack", False)]
    return out


def wills(rec: Recorder, u: str):
    rec.client("watch")
    rec.subscribe("watch", f"{u}/status/#", qos=2)
    will = {"topic": f"{u}/status/dev", "payload": b"offline", "qos": 1, "retain": True}
    dev = rec.client("dev", will=will)
    dev.publish(f"{u}/status/dev", b"online", qos=1, retain=True)
    rec.settle()
    rec.drop("dev", clean=False)  # abnormal: the will goes out (and is retained)
    rec.settle()
    polite = {"topic": f"{u}/status/polite", "payload": b"offline", "qos": 1}
    rec.client("polite", will=polite)
    rec.drop("polite", clean=True)  # normal DISCONNECT: no will
    rec.settle()
    rec.client("late")
    rec.subscribe("late", f"{u}/status/+", qos=0)


def wills_expected(u: str, v: int) -> dict:
    return {
        "watch": [
            ("connack", False),
            ("suback", (2,)),
            (f"{u}/status/dev", b"online", 1, False),
            (f"{u}/status/dev", b"offline", 1, False),
        ],
        "dev": [("connack", False)],
        "polite": [("connack", False)],
        "late": [("connack", False), ("suback", (0,)), (f"{u}/status/dev", b"offline", 0, True)],
    }


def wildcards_unsubscribe(rec: Recorder, u: str):
    rec.client("sub")
    rec.subscribe("sub", [(f"{u}/a/+", 1), (f"{u}/b/#", 2)])
    rec.client("dollar")
    rec.subscribe("dollar", "#", qos=0)
    pub = rec.client("pub")
    for t in ("a/x", "a/x/y", "b", "b/c/d", "c"):
        pub.publish(f"{u}/{t}", t.encode(), qos=2)
        rec.settle()
    pub.publish(f"$D{u}/a/x", b"dollar", qos=1)
    rec.settle()
    codes = rec.clients["sub"].unsubscribe(f"{u}/a/+")
    rec.log["sub"].append(("unsuback", len(codes)))
    pub.publish(f"{u}/a/x", b"after", qos=1)
    rec.settle()
    pub.publish(f"{u}/b/z", b"still", qos=1)


def wildcards_unsubscribe_expected(u: str, v: int) -> dict:
    sent = ["a/x", "a/x/y", "b", "b/c/d", "c"]
    return {
        "sub": [
            ("connack", False),
            ("suback", (1, 2)),
            (f"{u}/a/x", b"a/x", 1, False),
            (f"{u}/b", b"b", 2, False),
            (f"{u}/b/c/d", b"b/c/d", 2, False),
            # paho reports UNSUBACK reason codes for 5.0 only (3.1.1 has none)
            ("unsuback", 1 if v == 5 else 0),
            (f"{u}/b/z", b"still", 1, False),
        ],
        "dollar": [("connack", False), ("suback", (0,))]
        + [(f"{u}/{t}", t.encode(), 0, False) for t in sent]
        + [(f"{u}/a/x", b"after", 0, False), (f"{u}/b/z", b"still", 0, False)],
        "pub": [("connack", False)],
    }


def v5_subscription_options(rec: Recorder, u: str):
    pub = rec.client("pub")
    pub.publish(f"{u}/r", b"kept", qos=1, retain=True)
    rec.client("rap")
    rec.subscribe("rap", f"{u}/r", qos=1, retain_as_published=True, retain_handling=2)
    rec.client("rh1")
    rec.subscribe("rh1", f"{u}/r", qos=1, retain_handling=1)
    rec.subscribe("rh1", f"{u}/r", qos=1, retain_handling=1)  # exists: no retained
    rec.client("self")
    rec.subscribe("self", f"{u}/r", qos=1, no_local=True)
    rec.settle()
    rec.clients["self"].publish(f"{u}/r", b"from-self", qos=1, retain=True)
    rec.settle()
    pub.publish(f"{u}/r", b"from-pub", qos=1)


def v5_subscription_options_expected(u: str, v: int) -> dict:
    return {
        "pub": [("connack", False)],
        "rap": [
            ("connack", False),
            ("suback", (1,)),
            (f"{u}/r", b"from-self", 1, True),
            (f"{u}/r", b"from-pub", 1, False),
        ],
        "rh1": [
            ("connack", False),
            ("suback", (1,)),
            (f"{u}/r", b"kept", 1, True),
            ("suback", (1,)),
            (f"{u}/r", b"from-self", 1, False),
            (f"{u}/r", b"from-pub", 1, False),
        ],
        "self": [
            ("connack", False),
            ("suback", (1,)),
            (f"{u}/r", b"kept", 1, True),
            (f"{u}/r", b"from-pub", 1, False),
        ],
    }


SCENARIOS = [
    (retained_lifecycle, retained_lifecycle_expected, (4, 5)),
    (offline_queue, offline_queue_expected, (4, 5)),
    (qos_matrix, qos_matrix_expected, (4, 5)),
    (wills, wills_expected, (4, 5)),
    (wildcards_unsubscribe, wildcards_unsubscribe_expected, (4, 5)),
    (v5_subscription_options, v5_subscription_options_expected, (5,)),
]
CASES = [
    pytest.param(script, expected, v, id=f"{script.__name__}-{'v5' if v == 5 else 'v311'}")
    for script, expected, versions in SCENARIOS
    for v in versions
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("script", "expected", "version"), CASES)
def test_differential(request, make_broker, connect, uid, script, expected, version):
    transcripts: dict[str, dict] = {}
    skipped: dict[str, str] = {}
    for kind in selected_kinds(request.config):
        try:
            b = make_broker(kind)
        except pytest.skip.Exception as e:
            skipped[kind] = str(e)
            continue
        rec = Recorder(b, connect, version)
        script(rec, uid)
        transcripts[kind] = rec.transcript()
        for c in rec.clients.values():
            c.close()
    if not transcripts:
        pytest.skip(f"no broker could run: {skipped}")
    kinds = list(transcripts)
    for other in kinds[1:]:
        assert transcripts[other] == transcripts[kinds[0]], f"{kinds[0]} and {other} disagree"
    assert transcripts[kinds[0]] == expected(uid, version), f"{kinds} vs the written transcript"
