"""SUBSCRIBE / UNSUBSCRIBE, wildcards, $-topics, shared subscriptions, no-local, authorization."""

from __future__ import annotations

import pytest
from conftest import DISCONNECT, expect_quiet


def test_suback_reason_code_per_filter(broker, connect, version, uid):
    c = connect(broker, version=version)
    codes = c.subscribe([(f"{uid}/a", 0), (f"{uid}/b", 1), (f"{uid}/c", 2), (f"{uid}/+/d", 1)])
    assert codes == [0, 1, 2, 1]


def test_resubscribe_replaces_subscription(broker, connect, version, uid):
    c = connect(broker, version=version)
    assert c.subscribe(f"{uid}/t", qos=2) == [2]
    assert c.subscribe(f"{uid}/t", qos=0) == [0]  # [MQTT-3.8.4-3]: replaced, not added
    pub = connect(broker, version=version)
    pub.publish(f"{uid}/t", b"x", qos=2)
    assert [(m.payload, m.qos) for m in c.drain()] == [(b"x", 0)]


def test_unsubscribe_stops_delivery(broker, connect, version, uid):
    c = connect(broker, version=version)
    c.subscribe([(f"{uid}/a", 1), (f"{uid}/b", 1)])
    pub = connect(broker, version=version)
    pub.publish(f"{uid}/a", b"1", qos=1)
    assert c.expect_one().payload == b"1"
    c.unsubscribe(f"{uid}/a")
    pub.publish(f"{uid}/a", b"2", qos=1)
    pub.publish(f"{uid}/b", b"3", qos=1)
    assert [m.payload for m in c.drain()] == [b"3"]  # only the other subscription


def test_v5_unsuback_reason_codes(broker, connect, uid):
    c = connect(broker, version=5)
    c.subscribe(f"{uid}/a", qos=1)
    codes = c.unsubscribe([f"{uid}/a", f"{uid}/never"])
    assert codes == [0x00, 0x11]  # Success, No subscription existed


def test_v311_unsuback_for_unknown_filter(broker, raw, uid):
    r = raw(broker, version=4)
    r.connect()
    ack = r.unsubscribe([f"{uid}/never"])  # [MQTT-3.10.4-5]: UNSUBACK even if none matched
    assert ack.codes == []


WILDCARD_CASES = [
    # filter suffix, topic suffixes that must match (others from TOPICS must not)
    ("a/+", ["a/b", "a/"]),
    ("a/#", ["a", "a/b", "a/b/c", "a/", "a/b/d"]),
    ("+/b", ["a/b"]),
    ("a/+/c", ["a/b/c"]),
    ("#", ["a", "a/b", "a/b/c", "a/", "x/y/z", "a/b/d"]),
    ("+", ["a"]),
    ("a/b/#", ["a/b", "a/b/c", "a/b/d"]),
    ("+/+", ["a/b", "a/"]),
    ("a/+/+", ["a/b/c", "a/b/d"]),
]
TOPICS = ["a", "a/b", "a/b/c", "a/", "x/y/z", "a/b/d"]


def test_wildcard_matching(broker, connect, version, uid):
    subs = {}
    for f, _ in WILDCARD_CASES:
        c = connect(broker, version=version)
        c.subscribe(f"{uid}/{f}", qos=1)
        subs[f] = c
    pub = connect(broker, version=version)
    for t in TOPICS:
        pub.publish(f"{uid}/{t}", t.encode(), qos=1)
    for f, expected in WILDCARD_CASES:
        got = sorted(m.payload.decode() for m in subs[f].expect(len(expected)))
        assert got == sorted(expected), f
    expect_quiet(*subs.values())


def test_dollar_topics_not_matched_by_leading_wildcards(broker, connect, version, uid):
    hash_sub = connect(broker, version=version)
    hash_sub.subscribe("#", qos=0)
    plus_sub = connect(broker, version=version)
    plus_sub.subscribe(f"+/{uid}", qos=0)
    dollar_sub = connect(broker, version=version)
    dollar_sub.subscribe(f"$X{uid}/#", qos=0)
    pub = connect(broker, version=version)
    pub.publish(f"$X{uid}/{uid}", b"dollar", qos=1)
    pub.publish(f"plain/{uid}", b"plain", qos=1)
    # [MQTT-4.7.2-1]: '#' and '+' at the first level do not match topics starting with '$'.
    assert hash_sub.expect_one().payload == b"plain"
    assert plus_sub.expect_one().payload == b"plain"
    assert dollar_sub.expect_one().payload == b"dollar"
    expect_quiet(hash_sub, plus_sub, dollar_sub)


@pytest.mark.parametrize(
    "bad",
    ["a/#/b", "a+", "a/b#", "#/", "", "$share/g+/x", "$share/g/a/#/b"],
    ids=[
        "hash-not-last",
        "plus-in-level",
        "hash-in-level",
        "hash-then-level",
        "empty",
        "share-name-wildcard",
        "share-bad-filter",
    ],
)
def test_invalid_topic_filter(broker, raw, version, uid, bad):
    r = raw(broker, version=version)
    r.connect()
    if broker.kind == "mosquitto":
        # Mosquitto treats any invalid filter as a malformed packet and closes the
        # connection (5.0: DISCONNECT 0x81 first). Allowed by both specs.
        r.subscribe([(f"{uid}/ok", 1), (bad, 1)], wait=False)
        seen = r.expect_closed()
        expected = [(DISCONNECT, 0x81)] if version == 5 else []
        assert [(p.type, p.rc) for p in seen] == expected, seen
        return
    # fastbroker, by design: the bad filter fails alone (0x80 / 0x8F Topic Filter
    # invalid), the rest of the SUBSCRIBE is granted and the connection stays up.
    ack = r.subscribe([(f"{uid}/ok", 1), (bad, 1)])
    assert ack.codes == [1, 0x8F if version == 5 else 0x80]
    r.ping()
    assert r.recv().name == "PINGRESP"


@pytest.mark.parametrize("bad", ["$share/g", "$share//x"], ids=["no-filter", "empty-name"])
def test_invalid_shared_subscription(broker, raw, version, uid, bad):
    r = raw(broker, version=version)
    r.connect()
    ack = r.subscribe([(f"{uid}/ok", 1), (bad, 1)])
    if broker.kind == "mosquitto":
        # Mosquitto 2.0.11 does not recognise these as (broken) shared subscriptions
        # and grants them as ordinary filters.
        assert ack.codes == [1, 1]
    else:
        # 5.0 4.8.2: ShareName is at least one character and is followed by '/' and a
        # Topic Filter; fastbroker refuses the filter alone.
        assert ack.codes == [1, 0x8F if version == 5 else 0x80]


def test_shared_subscription_distributes_messages(broker, connect, version, uid):
    members = [connect(broker, version=version) for _ in range(2)]
    for m in members:
        assert m.subscribe(f"$share/g/{uid}/t", qos=1) == [1]
    other_group = connect(broker, version=version)
    other_group.subscribe(f"$share/h/{uid}/t", qos=1)
    plain = connect(broker, version=version)
    plain.subscribe(f"{uid}/t", qos=1)
    pub = connect(broker, version=version)
    n = 20
    for i in range(n):
        pub.publish(f"{uid}/t", str(i).encode(), qos=1)
    assert len(other_group.expect(n)) == n  # every group gets every message
    assert len(plain.expect(n)) == n
    expect_quiet(plain, other_group)
    per_member = [m.pending() for m in members]
    got = sorted(int(m.payload) for msgs in per_member for m in msgs)
    assert got == list(range(n))  # each message to exactly one member of the group
    assert all(msgs for msgs in per_member), [len(x) for x in per_member]
    for msgs in per_member:
        assert all(m.topic == f"{uid}/t" for m in msgs)  # the real topic, not $share/...


def test_shared_subscription_unsubscribe(broker, connect, version, uid):
    a = connect(broker, version=version)
    b = connect(broker, version=version)
    a.subscribe(f"$share/g/{uid}/t", qos=1)
    b.subscribe(f"$share/g/{uid}/t", qos=1)
    a.unsubscribe(f"$share/g/{uid}/t")
    pub = connect(broker, version=version)
    for i in range(4):
        pub.publish(f"{uid}/t", str(i).encode(), qos=1)
    assert len(b.expect(4)) == 4
    expect_quiet(a, b)


def test_v5_no_local(broker, connect, uid):
    c = connect(broker, version=5)
    c.subscribe(f"{uid}/t", qos=1, no_local=True)
    c.subscribe(f"{uid}/u", qos=1)  # without no-local: own messages come back
    other = connect(broker, version=5)
    other.subscribe(f"{uid}/t", qos=1)
    c.publish(f"{uid}/t", b"mine", qos=1)
    c.publish(f"{uid}/u", b"echo", qos=1)
    assert [m.payload for m in c.drain()] == [b"echo"]
    assert other.expect_one().payload == b"mine"


def test_own_messages_echoed_without_no_local(broker, connect, version, uid):
    c = connect(broker, version=version)
    c.subscribe(f"{uid}/t", qos=1)
    c.publish(f"{uid}/t", b"echo", qos=1)
    assert c.expect_one().payload == b"echo"


def test_subscribe_denied_filter(broker_kind, make_broker, raw, version, uid):
    b = make_broker(broker_kind, denied_subscriptions=[f"{uid}/secret/#"])
    r = raw(b, version=version)
    r.connect()
    ack = r.subscribe([(f"{uid}/secret/#", 1), (f"{uid}/open/#", 1)])
    # Only the denied filter fails: 0x80 (3.1.1) / 0x87 Not authorized (5.0).
    assert ack.codes == [0x87 if version == 5 else 0x80, 1]
    p = raw(b, version=version)
    p.connect()
    p.publish(f"{uid}/open/x", b"ok", qos=0)
    p.publish(f"{uid}/secret/x", b"no", qos=0)
    (m,) = r.expect_publishes(1)
    assert m.payload == b"ok"
    r.expect_silence()


def test_subscribe_without_filters_is_protocol_error(broker, raw, version):
    r = raw(broker, version=version)
    r.connect()
    r.send_packet(0x82, b"\x00\x01" + (b"\x00" if version == 5 else b""))  # no payload
    seen = r.expect_closed()
    assert all(p.type == DISCONNECT for p in seen), seen
