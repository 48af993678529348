"""The engine's side of authentication, authorization, limits, interception and the access
log, driven sans-I/O: clients are byte streams fed to ``fastbroker_core.Engine``; what the
engine writes is decoded with ``fastbroker_core.Decoder`` (3.1.1 CONNACK return codes are read
from the raw bytes, as the decoder maps them back to MQTT 5 codes).
"""

from __future__ import annotations

from typing import Any

import pytest
from fastbroker_core import FEED_HOLD, FEED_PUBLISHER, Decoder, Engine, Permissions, encode_packet

PUB, SUB, READ = Permissions.PUBLISH, Permissions.SUBSCRIBE, Permissions.READ
EVERYTHING = Permissions([(PUB | SUB | READ, "#")])


class Client:
    """One connection: encodes what it sends, decodes what the engine wrote to it."""

    def __init__(self, harness: Harness, protocol: int) -> None:
        self.h = harness
        self.protocol = protocol
        self.conn = harness.engine.open(harness.now)
        self.decoder = Decoder(protocol)
        self.raw = b""
        self.packets: list[dict[str, Any]] = []
        self.closed = False
        harness.clients[self.conn] = self

    def send(self, packet: dict[str, Any]) -> int:
        return self.send_bytes(encode_packet(packet, self.protocol))

    def send_bytes(self, data: bytes) -> int:
        flags = self.h.engine.feed(self.conn, data, self.h.now)
        self.h.pump()
        return flags

    def connect(self, client_id: str = "", **fields: Any) -> int:
        packet = {"type": "connect", "protocol": self.protocol, "client_id": client_id}
        packet.update(fields)
        return self.send(packet)

    def publish(self, topic: str, payload: bytes = b"x", qos: int = 0, **fields: Any) -> int:
        packet = {"type": "publish", "topic": topic, "payload": payload, "qos": qos}
        packet["pkid"] = fields.pop("pkid", 1 if qos else 0)
        packet.update(fields)
        return self.send(packet)

    def subscribe(self, *filters: str, qos: int = 1) -> list[int]:
        self.send(
            {
                "type": "subscribe",
                "pkid": 9,
                "filters": [{"filter": f, "qos": qos} for f in filters],
            }
        )
        suback = self.take("suback")
        assert len(suback) == 1, suback
        return suback[0]["reason_codes"]

    def take(self, kind: str | None = None) -> list[dict[str, Any]]:
        """Packets received so far (of `kind`), removed from the inbox."""
        got = [p for p in self.packets if kind is None or p["type"] == kind]
        self.packets = [p for p in self.packets if p not in got]
        return got

    def messages(self) -> list[tuple[str, bytes]]:
        return [(p["topic"], p["payload"]) for p in self.take("publish")]

    def connack_code(self) -> int:
        """The CONNACK's code as on the wire: MQTT 5 reason code or 3.1.1 return code."""
        assert self.raw[:2] == b"\x20\x02" or self.protocol == 5, self.raw
        if self.protocol == 4:
            return self.raw[3]
        (connack,) = [p for p in self.packets if p["type"] == "connack"]
        return connack["reason_code"]


class Harness:
    def __init__(self, **config: Any) -> None:
        self.engine = Engine(config)
        self.now = 1_000_000
        self.clients: dict[int, Client] = {}

    def client(self, protocol: int = 5) -> Client:
        return Client(self, protocol)

    def connected(self, client_id: str, protocol: int = 5, permissions: Any = None) -> Client:
        """A client through CONNECT (and auth_done when authentication is required)."""
        c = self.client(protocol)
        c.connect(client_id)
        if self.engine.has_auth_requests():
            (req,) = self.engine.auth_requests()
            assert req[0] == c.conn
            self.engine.auth_done(c.conn, 0, permissions, self.now)
            self.pump()
        assert c.connack_code() == 0
        c.take("connack")
        return c

    def pump(self) -> None:
        for conn, data, close in self.engine.drain():
            c = self.clients[conn]
            c.raw += data
            c.packets.extend(c.decoder.feed(data))
            if close:
                c.closed = True
                self.engine.closed(conn, self.now)

    def tick(self, ms: int) -> None:
        self.now += ms
        self.engine.tick(self.now)
        self.pump()

    def access(self) -> list[tuple[Any, ...]]:
        return self.engine.take_access_events()


# ---- authentication ---------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", [4, 5])
def test_connect_waits_for_the_decision_then_accepts(protocol: int) -> None:
    h = Harness(auth_required=True)
    c = h.client(protocol)
    assert not h.engine.has_auth_requests()
    c.connect("dev1", username="alice", password=b"s3cret")
    assert c.raw == b"" and not c.closed, "no CONNACK before the decision"
    assert h.engine.stats()["auth_pending"] == 1
    assert h.engine.has_auth_requests()
    assert h.engine.auth_requests() == [
        (c.conn, "connect", "dev1", "alice", b"s3cret", protocol, None, None)
    ]
    assert not h.engine.has_auth_requests()
    # Sent before the CONNACK: buffered, handled after acceptance.
    c.send({"type": "subscribe", "pkid": 3, "filters": [{"filter": "t", "qos": 1}]})
    assert c.raw == b""
    assert h.engine.stats()["clients_connected"] == 0, "no session before the decision"
    h.engine.auth_done(c.conn, 0, None, h.now)
    h.pump()
    assert c.connack_code() == 0
    assert [p["type"] for p in c.packets] == ["connack", "suback"]
    assert h.engine.stats()["auth_pending"] == 0
    assert h.access() == [("connect", c.conn, "dev1", "alice", protocol, 0, "")]


def test_empty_client_id_is_assigned_before_the_request() -> None:
    h = Harness(auth_required=True)
    c = h.client(5)
    c.connect("")
    ((_, _, client_id, *_),) = h.engine.auth_requests()
    assert client_id.startswith("fb-")
    h.engine.auth_done(c.conn, 0, None, h.now)
    h.pump()
    (connack,) = c.take("connack")
    assert connack["properties"]["assigned_client_identifier"] == client_id


@pytest.mark.parametrize(
    ("code", "v311"),
    [(0x86, 4), (0x87, 5), (0x89, 3), (0x97, 3), (0x84, 1), (0x85, 2), (0x8C, 3), (0x8A, 3)],
)
def test_refusal_codes_for_both_versions(code: int, v311: int) -> None:
    h = Harness(auth_required=True)
    c5, c4 = h.client(5), h.client(4)
    c5.connect("a", username="u")
    c4.connect("b")
    h.engine.auth_requests()
    for c in (c5, c4):
        h.engine.auth_done(c.conn, code, None, h.now, reason="go away")
    h.pump()
    assert c5.connack_code() == code and c5.closed
    assert c4.raw == bytes([0x20, 2, 0, v311]) and c4.closed
    (connack,) = c5.take("connack")
    assert connack["properties"].get("reason_string") == "go away"
    events = h.access()
    assert [(e[0], e[1], e[5]) for e in events] == [
        ("refused", c5.conn, code),
        ("refused", c4.conn, code),
    ]
    assert events[0][3] == "u" and events[0][4] == 5
    assert h.engine.stats()["connections_refused"] == 2


def test_reason_string_only_when_problem_information_is_wanted() -> None:
    h = Harness(auth_required=True)
    c = h.client(5)
    c.connect("a", properties={"request_problem_information": 0})
    h.engine.auth_requests()
    h.engine.auth_done(c.conn, 0x86, None, h.now, reason="bad password")
    h.pump()
    (connack,) = c.take("connack")
    assert connack["reason_code"] == 0x86
    assert "reason_string" not in connack["properties"]


def test_enhanced_authentication_two_steps() -> None:
    h = Harness(auth_required=True)
    c = h.client(5)
    method = {"authentication_method": "SCRAM-SHA-1"}
    c.connect("dev", properties={**method, "authentication_data": b"client-first"})
    ((conn, kind, _, _, _, _, m, data),) = h.engine.auth_requests()
    assert (conn, kind, m, data) == (c.conn, "connect", "SCRAM-SHA-1", b"client-first")
    h.engine.auth_continue(c.conn, "SCRAM-SHA-1", b"server-first", h.now)
    h.pump()
    (auth,) = c.take("auth")
    assert auth["reason_code"] == 0x18
    assert auth["properties"] == {**method, "authentication_data": b"server-first"}
    c.send(
        {
            "type": "auth",
            "reason_code": 0x18,
            "properties": {**method, "authentication_data": b"client-final"},
        }
    )
    assert h.engine.auth_requests() == [
        (c.conn, "auth", "dev", None, None, 5, "SCRAM-SHA-1", b"client-final")
    ]
    h.engine.auth_done(c.conn, 0, None, h.now, "SCRAM-SHA-1", b"server-final")
    h.pump()
    (connack,) = c.take("connack")
    assert connack["reason_code"] == 0
    assert connack["properties"]["authentication_method"] == "SCRAM-SHA-1"
    assert connack["properties"]["authentication_data"] == b"server-final"


def test_auth_with_another_method_is_refused() -> None:
    h = Harness(auth_required=True)
    c = h.client(5)
    c.connect("dev", properties={"authentication_method": "A"})
    h.engine.auth_requests()
    h.engine.auth_continue(c.conn, "A", b"challenge", h.now)
    h.pump()
    c.send({"type": "auth", "reason_code": 0x18, "properties": {"authentication_method": "B"}})
    assert c.connack_code() == 0x8C and c.closed
    assert not h.engine.has_auth_requests()


def test_packet_other_than_auth_during_the_exchange_is_refused() -> None:
    h = Harness(auth_required=True)
    c = h.client(5)
    c.connect("dev", properties={"authentication_method": "A"})
    h.engine.auth_requests()
    h.engine.auth_continue(c.conn, "A", None, h.now)
    c.publish("t")
    assert c.connack_code() == 0x82 and c.closed


def test_reauthentication_success_and_failure() -> None:
    h = Harness(auth_required=True)
    c = h.client(5)
    method = {"authentication_method": "TOKEN"}
    c.connect("dev", properties={**method, "authentication_data": b"t1"})
    h.engine.auth_requests()
    h.engine.auth_done(c.conn, 0, Permissions([(PUB, "a/#")]), h.now)
    h.pump()
    c.take("connack")
    sub = h.connected("sub")
    h.engine.auth_requests()
    sub.subscribe("#")

    c.send(
        {
            "type": "auth",
            "reason_code": 0x19,
            "properties": {**method, "authentication_data": b"t2"},
        }
    )
    assert h.engine.auth_requests() == [(c.conn, "reauth", "dev", None, None, 5, "TOKEN", b"t2")]
    # Publishing goes on during re-authentication.
    c.publish("a/1")
    assert sub.messages() == [("a/1", b"x")]
    # A two-step re-authentication, then success with wider permissions.
    h.engine.auth_continue(c.conn, "TOKEN", b"more?", h.now)
    h.pump()
    assert c.take("auth")[0]["reason_code"] == 0x18
    c.send(
        {
            "type": "auth",
            "reason_code": 0x18,
            "properties": {**method, "authentication_data": b"ok"},
        }
    )
    assert [r[1] for r in h.engine.auth_requests()] == ["auth"]
    h.engine.auth_done(c.conn, 0, Permissions([(PUB, "#")]), h.now)
    h.pump()
    (auth,) = c.take("auth")
    assert auth["reason_code"] == 0 and auth["properties"]["authentication_method"] == "TOKEN"
    c.publish("b/1")
    assert sub.messages() == [("b/1", b"x")]

    c.send(
        {
            "type": "auth",
            "reason_code": 0x19,
            "properties": {**method, "authentication_data": b"t3"},
        }
    )
    h.engine.auth_requests()
    h.engine.auth_done(c.conn, 0x87, None, h.now, reason="revoked")
    h.pump()
    (disconnect,) = c.take("disconnect")
    assert disconnect["reason_code"] == 0x87 and c.closed
    assert ("disconnect", c.conn, "dev", None, 5, 0x87, "revoked") in h.access()


def test_auth_method_without_auth_required_keeps_bad_method() -> None:
    h = Harness()
    c = h.client(5)
    c.connect("dev", properties={"authentication_method": "SCRAM-SHA-1"})
    assert c.connack_code() == 0x8C and c.closed
    assert not h.engine.has_auth_requests()


def test_pending_authentication_times_out() -> None:
    h = Harness(auth_required=True, connect_timeout_ms=5000)
    c = h.client(5)
    c.connect("slow")
    h.engine.auth_requests()
    h.tick(4000)
    assert not c.closed
    h.tick(1000)
    assert c.closed and c.raw == b""
    ((kind, conn, client_id, _, level, code, reason),) = h.access()
    assert (kind, conn, client_id, level, code) == ("refused", c.conn, "slow", 5, 0)
    assert "timeout" in reason
    # The late answer is ignored, and the id is not reused before it comes.
    other = h.client(5)
    assert other.conn != c.conn
    h.engine.auth_done(c.conn, 0, None, h.now)
    h.pump()
    assert h.engine.stats()["clients_connected"] == 0
    assert h.client(5).conn == c.conn, "freed once answered"


def test_bytes_beyond_max_conn_buffer_hold_the_pending_connection() -> None:
    h = Harness(auth_required=True, max_conn_buffer=100)
    sub = h.connected("sub", permissions=None)
    sub.subscribe("t")
    c = h.client(5)
    assert c.connect("pub") == 0
    assert c.publish("t", b"a" * 40) == 0
    assert c.publish("t", b"b" * 40) == 0
    assert c.publish("t", b"c" * 40) & FEED_HOLD
    assert h.engine.stats()["held_connections"] == 1
    (req,) = h.engine.auth_requests()
    h.engine.auth_done(req[0], 0, None, h.now)
    h.pump()
    assert h.engine.take_resumed() == [c.conn]
    assert [p for _, p in sub.messages()] == [b"a" * 40, b"b" * 40, b"c" * 40]
    assert h.engine.stats()["held_connections"] == 0


# ---- authorization ----------------------------------------------------------------------------


def test_permissions_are_validated() -> None:
    with pytest.raises(ValueError, match="a/#/b"):
        Permissions([(PUB, "a/#"), (SUB, "a/#/b")])
    with pytest.raises(ValueError, match="rights 9"):
        Permissions([(9, "a")])
    p = Permissions([(PUB | READ, "a/+"), (SUB, "a/#")])
    assert p.rules == [(5, "a/+"), (2, "a/#")]
    assert p.allows(PUB, "a/b") and not p.allows(PUB, "a/b/c")
    assert p.covers(SUB, "a/b/+") and not p.covers(READ, "a/#")


@pytest.mark.parametrize("protocol", [4, 5])
def test_denied_publish_codes_and_nothing_routed(protocol: int) -> None:
    h = Harness(auth_required=True)
    sub = h.connected("sub", permissions=EVERYTHING)
    sub.subscribe("#", qos=2)
    pub = h.connected("pub", protocol, Permissions([(PUB, "ok/#")]))
    for qos in (0, 1, 2):
        pub.publish("secret/x", qos=qos, retain=True)
    want = 0x87 if protocol == 5 else 0
    acks = pub.take()
    assert [(p["type"], p["pkid"], p.get("reason_code", 0)) for p in acks] == [
        ("puback", 1, want),
        ("pubrec", 1, want),
    ]
    if protocol == 4:
        # 3.1.1 acknowledges positively: the QoS 2 flow completes.
        pub.send({"type": "pubrel", "pkid": 1})
        assert [p["type"] for p in pub.take()] == ["pubcomp"]
    assert sub.take() == []
    pub.publish("ok/1", qos=1)
    assert sub.messages() == [("ok/1", b"x")]
    stats = h.engine.stats()
    assert stats["publish_denied"] == 3 and stats["retained"] == 0
    late = h.connected("late", permissions=EVERYTHING)
    late.subscribe("#")
    assert late.take() == [], "a denied retained message is not kept"


@pytest.mark.parametrize("protocol", [4, 5])
def test_denied_subscribe_codes(protocol: int) -> None:
    h = Harness(auth_required=True)
    c = h.connected("c", protocol, Permissions([(SUB | READ, "a/#"), (SUB, "b/+"), (PUB, "x/#")]))
    codes = c.subscribe("a/b/+", "b/#", "b/c", "$share/g/a/x", "$share/g/b/#", "x/1", qos=1)
    no = 0x87 if protocol == 5 else 0x80
    assert codes == [1, no, 1, 1, no, no]
    assert h.engine.stats()["subscribe_denied"] == 3
    assert h.engine.stats()["subscriptions"] == 3
    pub = h.connected("pub", permissions=EVERYTHING)
    pub.publish("b/2")
    pub.publish("x/1")
    assert c.messages() == [], "refused filters were not added"


def test_read_rules_filter_deliveries_covered_and_per_message() -> None:
    h = Harness(auth_required=True)
    read_a = Permissions([(SUB, "#"), (READ, "a/#")])
    covered = h.connected("covered", permissions=read_a)
    wide = h.connected("wide", permissions=read_a)
    pub = h.connected("pub", permissions=EVERYTHING)
    pub.publish("a/ret", b"r1", retain=True)
    pub.publish("b/ret", b"r2", retain=True)
    assert covered.subscribe("a/+") == [1]
    assert covered.messages() == [("a/ret", b"r1")]
    assert wide.subscribe("#") == [1]
    assert wide.messages() == [("a/ret", b"r1")], "retained on subscribe is filtered too"
    for topic in ("a/1", "b/1", "a/2", "c"):
        pub.publish(topic, qos=1)
    assert [t for t, _ in covered.messages()] == ["a/1", "a/2"]
    assert [t for t, _ in wide.messages()] == ["a/1", "a/2"]
    # Wider rights from now on.
    h.engine.set_permissions(wide.conn, EVERYTHING)
    pub.publish("b/2")
    assert wide.messages() == [("b/2", b"x")]
    h.engine.set_permissions(wide.conn, Permissions([(READ, "a/#")]))
    pub.publish("b/3")
    assert wide.messages() == []
    assert wide.subscribe("a/x") == [0x87], "no SUBSCRIBE right any more"


@pytest.mark.parametrize("protocol", [4, 5])
def test_will_topic_not_publishable_refuses_the_connect(protocol: int) -> None:
    h = Harness(auth_required=True)
    c = h.client(protocol)
    c.connect("w", will={"topic": "secret/will", "payload": b"bye"})
    h.engine.auth_requests()
    h.engine.auth_done(c.conn, 0, Permissions([(PUB, "ok/#")]), h.now)
    h.pump()
    assert c.connack_code() == (0x87 if protocol == 5 else 5) and c.closed
    ok = h.client(protocol)
    ok.connect("w2", will={"topic": "ok/will", "payload": b"bye"})
    h.engine.auth_requests()
    h.engine.auth_done(ok.conn, 0, Permissions([(PUB, "ok/#")]), h.now)
    h.pump()
    assert ok.connack_code() == 0


@pytest.mark.parametrize("protocol", [4, 5])
def test_max_connections(protocol: int) -> None:
    h = Harness(max_connections=2)
    a = h.connected("a")
    h.connected("b")
    c = h.client(protocol)
    c.connect("c")
    assert c.connack_code() == (0x97 if protocol == 5 else 3) and c.closed
    # A takeover of a connected client id is no new connection.
    a2 = h.client(protocol)
    a2.connect("a")
    assert a2.connack_code() == 0
    assert a.closed
    # A slot frees when a connection ends.
    a2.send({"type": "disconnect"})
    assert h.connected("c").conn is not None
    assert h.engine.stats()["connections_refused"] == 1


# ---- publish rate -----------------------------------------------------------------------------


def test_rate_limit_holds_and_resumes_without_losing_a_message() -> None:
    h = Harness(max_publish_rate=10)
    sub = h.connected("sub")
    sub.subscribe("t", qos=1)
    pub = h.connected("pub")
    n = 35
    data = b"".join(
        encode_packet(
            {"type": "publish", "topic": "t", "qos": 1, "pkid": i, "payload": b"%d" % i}, 5
        )
        for i in range(1, n + 1)
    )
    flags = pub.send_bytes(data)
    assert flags == FEED_HOLD | FEED_PUBLISHER
    received: list[bytes] = []

    def collect() -> None:
        msgs = sub.take("publish")
        received.extend(p["payload"] for p in msgs)
        for p in msgs:
            sub.send({"type": "puback", "pkid": p["pkid"]})

    collect()
    assert len(received) == 10, "a burst of the rate"
    assert h.engine.stats()["held_connections"] == 1
    assert not h.engine.has_resumed()
    h.tick(500)
    collect()
    assert len(received) == 15 and not h.engine.has_resumed()
    # Held is alive: the keepalive (60 s) does not count the silence the broker caused.
    for _ in range(3):
        h.tick(1000)
        collect()
    assert len(received) == n
    assert h.engine.take_resumed() == [pub.conn]
    assert received == [b"%d" % i for i in range(1, n + 1)]
    assert len(pub.take("puback")) == n
    assert h.engine.stats()["held_connections"] == 0
    # Tokens come back with time: no hold for a publish a while later.
    h.tick(1000)
    assert pub.publish("t", qos=1, pkid=99) == FEED_PUBLISHER


def test_held_connection_is_not_timed_out_by_keepalive() -> None:
    h = Harness(max_publish_rate=1)
    pub = h.client(5)
    pub.connect("pub", keep_alive=2)
    data = encode_packet({"type": "publish", "topic": "t", "payload": b"1"}, 5) * 2
    assert pub.send_bytes(data) & FEED_HOLD
    # Not held after the second publish is decoded, one second later; nothing more comes.
    h.tick(1000)
    assert h.engine.take_resumed() == [pub.conn]
    h.tick(2900)
    assert not pub.closed, "the keepalive counts from the resume"
    h.tick(200)
    assert pub.closed


def test_feed_flags_without_limits() -> None:
    h = Harness()
    c = h.connected("c")
    assert c.send({"type": "pingreq"}) == 0
    assert c.publish("t") == FEED_PUBLISHER
    assert c.send({"type": "pingreq"}) == FEED_PUBLISHER


# ---- interception -----------------------------------------------------------------------------


def intercept_setup(protocol: int = 5, **config: Any) -> tuple[Harness, Client, Client]:
    h = Harness(intercept=True, **config)
    sub = h.connected("sub")
    sub.subscribe("#", qos=2)
    pub = h.connected("pub", protocol)
    return h, sub, pub


def test_intercept_route_with_rewrite_and_retain() -> None:
    h, sub, pub = intercept_setup()
    pub.publish("in/1", b"raw", qos=1, retain=True)
    assert sub.take() == [] and pub.take() == [], "nothing routed nor acked before release"
    assert h.engine.has_intercepted()
    ((ticket, conn, cid, user, topic, payload, qos, retain),) = h.engine.take_intercepted()
    assert (conn, cid, user, topic, payload, qos, retain) == (
        pub.conn,
        "pub",
        None,
        "in/1",
        b"raw",
        1,
        True,
    )
    assert h.engine.stats()["intercepted_pending"] == 1
    h.engine.release(ticket, 0, "out/1", b"cooked", h.now)
    h.pump()
    assert sub.messages() == [("out/1", b"cooked")]
    assert [(p["type"], p["reason_code"]) for p in pub.take()] == [("puback", 0)]
    late = h.connected("late")
    late.subscribe("#")
    assert late.messages() == [("out/1", b"cooked")], "retained on release"
    assert h.engine.stats()["intercepted_pending"] == 0
    h.engine.release(ticket, 0, None, None, h.now)  # unknown now: ignored


@pytest.mark.parametrize("protocol", [4, 5])
def test_intercept_drop_and_deny(protocol: int) -> None:
    h, sub, pub = intercept_setup(protocol)
    pub.publish("a", qos=1, pkid=1)
    pub.publish("b", qos=2, pkid=2)
    pub.publish("c", qos=1, pkid=3)
    pub.publish("d", qos=2, pkid=4)
    tickets = [t[0] for t in h.engine.take_intercepted()]
    assert tickets == sorted(tickets) and len(set(tickets)) == 4
    h.engine.release(tickets[0], 1, None, None, h.now)
    h.engine.release(tickets[1], 1, None, None, h.now)
    h.engine.release(tickets[2], 2, None, None, h.now)
    h.engine.release(tickets[3], 2, None, None, h.now)
    h.pump()
    deny = 0x87 if protocol == 5 else 0
    assert [(p["type"], p["pkid"], p["reason_code"]) for p in pub.take()] == [
        ("puback", 1, 0),
        ("pubrec", 2, 0),
        ("puback", 3, deny),
        ("pubrec", 4, deny),
    ]
    assert sub.take() == []
    assert h.engine.stats()["publish_denied"] == 2
    # A dropped QoS 2 completes its flow normally.
    pub.send({"type": "pubrel", "pkid": 2})
    assert [(p["type"], p["reason_code"]) for p in pub.take()] == [("pubcomp", 0)]


def test_intercept_invalid_new_topic_denies() -> None:
    h, sub, pub = intercept_setup()
    pub.publish("a", qos=1)
    ((ticket, *_),) = h.engine.take_intercepted()
    h.engine.release(ticket, 0, "bad/#", None, h.now)
    h.pump()
    assert [(p["type"], p["reason_code"]) for p in pub.take()] == [("puback", 0x87)]
    assert sub.take() == []


def test_intercept_qos2_resend_makes_no_second_ticket() -> None:
    h, sub, pub = intercept_setup()
    pub.publish("q2", qos=2, pkid=7)
    pub.publish("q2", qos=2, pkid=7, dup=True)
    tickets = h.engine.take_intercepted()
    assert len(tickets) == 1
    assert pub.take() == [], "PUBREC only on release"
    h.engine.release(tickets[0][0], 0, None, None, h.now)
    h.pump()
    assert [(p["type"], p["reason_code"]) for p in pub.take()] == [("pubrec", 0)]
    assert sub.messages() == [("q2", b"x")]
    # A resend after the PUBREC is acknowledged again, never delivered twice.
    pub.publish("q2", qos=2, pkid=7, dup=True)
    assert [p["type"] for p in pub.take()] == ["pubrec"]
    assert not h.engine.has_intercepted() and sub.take() == []
    pub.send({"type": "pubrel", "pkid": 7})
    assert [(p["type"], p["reason_code"]) for p in pub.take()] == [("pubcomp", 0)]


def test_intercept_release_after_the_publisher_closed_still_routes() -> None:
    h, sub, pub = intercept_setup()
    pub.publish("gone/1", qos=1)
    pub.publish("gone/2", qos=0)
    h.engine.closed(pub.conn, h.now)
    pub.closed = True
    other = h.client(5)  # may get the closed connection's id: must not get its PUBACK
    other.connect("other")
    other.take()
    for ticket, *_ in h.engine.take_intercepted():
        h.engine.release(ticket, 0, None, None, h.now)
    h.pump()
    assert sub.messages() == [("gone/1", b"x"), ("gone/2", b"x")]
    assert other.take() == []


def test_intercept_backlog_holds_the_publisher() -> None:
    h, sub, pub = intercept_setup(max_intercepted=3)
    data = b"".join(
        encode_packet({"type": "publish", "topic": "t", "payload": b"%d" % i}, 5) for i in range(6)
    )
    assert pub.send_bytes(data) == FEED_HOLD | FEED_PUBLISHER
    first = h.engine.take_intercepted()
    assert [t[5] for t in first] == [b"0", b"1", b"2"]
    h.engine.release(first[0][0], 0, None, None, h.now)
    h.pump()
    # One slot freed: one more decoded, still at the bound.
    assert [t[5] for t in h.engine.take_intercepted()] == [b"3"]
    assert not h.engine.has_resumed()
    for t in first[1:]:
        h.engine.release(t[0], 0, None, None, h.now)
    h.pump()
    rest = h.engine.take_intercepted()
    assert [t[5] for t in rest] == [b"4", b"5"]
    assert not h.engine.has_resumed(), "three pending again: still at the bound"
    assert h.engine.stats()["held_connections"] == 1
    h.engine.release(rest[0][0], 0, None, None, h.now)
    h.pump()
    assert h.engine.take_resumed() == [pub.conn]
    assert h.engine.stats()["held_connections"] == 0
    assert [p for _, p in sub.messages()] == [b"0", b"1", b"2", b"4"]


# ---- access log -------------------------------------------------------------------------------


def test_access_events_one_connect_and_one_disconnect_each() -> None:
    h = Harness()
    normal = h.connected("normal")
    normal.send({"type": "disconnect", "reason_code": 0x04})
    lost = h.connected("lost", 4)
    h.engine.closed(lost.conn, h.now)
    lost.closed = True
    old = h.connected("dup")
    new = h.connected("dup")
    bad = h.connected("bad")
    bad.publish("t/#")  # wildcard in a topic name: 0x90 (decoder-level error)
    idle = h.client(5)
    idle.connect("idle", keep_alive=1)
    h.tick(1600)
    events = h.access()
    live: dict[int, str] = {}
    ends: list[tuple[str, int, str]] = []
    for kind, conn, cid, _user, _level, code, reason in events:
        if kind == "connect":
            assert conn not in live, f"second connect on {conn}"
            live[conn] = cid
        elif kind == "disconnect":
            assert live.pop(conn) == cid, f"disconnect without connect for {cid}"
            ends.append((cid, code, reason))
    assert [(cid, code) for cid, code, _ in ends] == [
        ("normal", 0x04),
        ("lost", 0),
        ("dup", 0x8E),
        ("bad", 0x90),
        ("idle", 0x8D),
    ]
    assert ends[1][2] == "connection lost"
    assert live == {new.conn: "dup"} and not new.closed and old.closed
    assert not h.engine.has_access_events()


def test_refused_access_events_for_malformed_and_timeout() -> None:
    h = Harness(connect_timeout_ms=1000)
    junk = h.client(5)
    junk.send_bytes(b"\x10\x05\x00\x04MQTX\x05")  # bad protocol name
    silent = h.client(5)
    h.tick(1000)
    events = h.access()
    assert [(e[0], e[1]) for e in events] == [("refused", junk.conn), ("refused", silent.conn)]
    assert events[1][4:] == (0, 0, "connect timeout")
    assert junk.closed and silent.closed
