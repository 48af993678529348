"""MQTT 5 features: properties, expiry, topic aliases, flow control, limits, reason codes."""

from __future__ import annotations

import time

from conftest import CONNACK, DISCONNECT, PUBACK, known_deviation


def test_connack_advertises_limits(broker_kind, make_broker, raw):
    b = make_broker(
        broker_kind,
        maximum_qos=1,
        retain_available=False,
        max_packet_size=4096,
        topic_alias_maximum=5,
    )
    r = raw(b, version=5)
    ack = r.connect()
    assert ack.props.get("MaximumQoS") == 1
    assert ack.props.get("RetainAvailable") == 0
    assert ack.props.get("MaximumPacketSize") == 4096
    assert ack.props.get("TopicAliasMaximum") == 5


def test_connack_defaults(broker, raw):
    ack = raw(broker, version=5).connect()
    # Absent means "2", "available", "no limit": only the values both brokers agree on.
    assert ack.props.get("MaximumQoS", 2) == 2
    assert ack.props.get("RetainAvailable", 1) == 1
    assert ack.props.get("TopicAliasMaximum") == 10
    assert ack.props.get("ReceiveMaximum", 65535) >= 1
    if broker.kind == "fastbroker":
        assert ack.props.get("ReceiveMaximum") == 1024  # [mqtt] receive_maximum default
    else:
        assert ack.props.get("ReceiveMaximum") == 20  # = max_inflight_messages default


def test_message_expiry_drops_expired_message_for_offline_session(broker, connect, uid):
    cid = f"{uid}-exp"
    persistent = {"clean": False, "props": {"SessionExpiryInterval": 300}}
    c = connect(broker, client_id=cid, **persistent)
    c.subscribe(f"{uid}/t", qos=1)
    c.disconnect()
    pub = connect(broker)
    pub.publish(f"{uid}/t", b"short", qos=1, props={"MessageExpiryInterval": 1})
    pub.publish(f"{uid}/t", b"long", qos=1, props={"MessageExpiryInterval": 60})
    time.sleep(2.2)
    c2 = connect(broker, client_id=cid, **persistent)
    assert c2.connack.session_present
    (m,) = c2.drain()
    assert m.payload == b"long"
    # [MQTT-3.3.2-6]: forwarded with the remaining lifetime (60 minus time waited).
    assert 1 <= m.props["MessageExpiryInterval"] <= 58, m.props


def test_message_expiry_forwarded_live(broker, connect, uid):
    sub = connect(broker)
    sub.subscribe(f"{uid}/t", qos=1)
    pub = connect(broker)
    pub.publish(f"{uid}/t", b"x", qos=1, props={"MessageExpiryInterval": 30})
    pub.publish(f"{uid}/t", b"y", qos=1)
    a, b = sub.expect(2)
    assert 29 <= a.props["MessageExpiryInterval"] <= 30
    assert "MessageExpiryInterval" not in b.props


def test_expired_retained_message_not_delivered(broker, connect, uid):
    pub = connect(broker)
    pub.publish(f"{uid}/r", b"short", qos=1, retain=True, props={"MessageExpiryInterval": 1})
    time.sleep(2.2)
    sub = connect(broker)
    sub.subscribe(f"{uid}/r", qos=1)
    sub.expect_none()


def test_properties_forwarded_unchanged(broker, connect, uid):
    sub = connect(broker)
    sub.subscribe(f"{uid}/t", qos=1)
    pub = connect(broker)
    props = {
        "UserProperty": [("a", "1"), ("b", "2"), ("a", "3")],  # order and duplicates kept
        "ContentType": "application/json",
        "PayloadFormatIndicator": 1,
        "ResponseTopic": f"{uid}/reply",
        "CorrelationData": b"\x00\xffcorr",
    }
    for qos in (0, 1, 2):
        pub.publish(f"{uid}/t", b'{"k": 1}', qos=qos, props=props)
        m = sub.expect_one()
        for k, v in props.items():
            assert m.props.get(k) == v, (qos, k, m.props)


def test_subscription_identifier_delivered(broker, connect, uid):
    pub = connect(broker)
    pub.publish(f"{uid}/r", b"retained", qos=1, retain=True)
    sub = connect(broker)
    sub.subscribe(f"{uid}/#", qos=1, props={"SubscriptionIdentifier": 42})
    sub.subscribe(f"{uid}/other", qos=1)  # no identifier
    r = sub.expect_one()
    assert (r.payload, r.props.get("SubscriptionIdentifier")) == (b"retained", [42])
    pub.publish(f"{uid}/x", b"live", qos=1)
    pub.publish(f"{uid}/other", b"plain", qos=1)
    got = [(m.payload, m.props.get("SubscriptionIdentifier")) for m in sub.expect(2)]
    got += [(m.payload, m.props.get("SubscriptionIdentifier")) for m in sub.drain()]
    assert got[0] == (b"live", [42])
    if broker.kind == "mosquitto":
        # One copy per matching subscription (allowed by 5.0 section 3.3.4).
        assert sorted(got[1:], key=repr) == [(b"plain", None), (b"plain", [42])]
    else:
        # One copy carrying the identifier of the one subscription that has one.
        assert got[1:] == [(b"plain", [42])]


def test_topic_alias_from_client(broker, raw, connect, uid):
    sub = connect(broker)
    sub.subscribe(f"{uid}/#", qos=1)
    r = raw(broker, version=5)
    r.connect()
    r.publish(f"{uid}/a", b"1", qos=1, props={"TopicAlias": 1})  # set alias 1
    assert r.recv_type(PUBACK).rc in (0, 0x10)
    r.publish("", b"2", qos=1, props={"TopicAlias": 1})  # use it
    assert r.recv_type(PUBACK).rc in (0, 0x10)
    r.publish(f"{uid}/b", b"3", qos=0, props={"TopicAlias": 1})  # re-map it
    r.publish("", b"4", qos=0, props={"TopicAlias": 1})
    msgs = sub.expect(4)
    got = [(m.topic, m.payload) for m in msgs]
    assert got == [(f"{uid}/a", b"1"), (f"{uid}/a", b"2"), (f"{uid}/b", b"3"), (f"{uid}/b", b"4")]
    # Aliases are per connection: not forwarded to a subscriber that allowed none.
    assert all("TopicAlias" not in m.props for m in msgs)


def test_topic_alias_above_maximum_disconnects(broker, raw, uid):
    r = raw(broker, version=5)
    ack = r.connect()
    limit = ack.props["TopicAliasMaximum"]
    r.publish(f"{uid}/a", b"x", qos=0, props={"TopicAlias": limit + 1})
    seen = r.expect_closed()
    # [MQTT-3.3.2-9]: 0x94 Topic Alias invalid.
    assert [(p.type, p.rc) for p in seen] == [(DISCONNECT, 0x94)], seen


def test_topic_alias_zero_disconnects(broker, raw, uid):
    r = raw(broker, version=5)
    r.connect()
    # paho refuses to encode alias 0: patch the property bytes by hand.
    body = b"\x00\x03" + b"a/b" + b"\x03\x23\x00\x00" + b"x"
    r.send_packet(0x30, body)
    seen = r.expect_closed()
    # 3.3.2.3.4: alias 0 is "Topic Alias invalid" (0x94). Mosquitto 2.0.11 rejects it
    # while decoding properties, as 0x81 Malformed Packet.
    expected = 0x81 if broker.kind == "mosquitto" else 0x94
    assert [(p.type, p.rc) for p in seen] == [(DISCONNECT, expected)], seen


def test_unknown_topic_alias_is_protocol_error(broker, raw):
    r = raw(broker, version=5)
    r.connect()
    r.publish("", b"x", qos=0, props={"TopicAlias": 3})  # never set
    seen = r.expect_closed()
    # [MQTT-3.3.4-?] / 3.3.2.3.4: alias with no mapping and empty topic: Protocol Error.
    assert [(p.type, p.rc) for p in seen] == [(DISCONNECT, 0x82)], seen


def test_topic_alias_disabled_by_config(broker_kind, make_broker, raw, uid):
    b = make_broker(broker_kind, topic_alias_maximum=0)
    r = raw(b, version=5)
    ack = r.connect()
    assert ack.props.get("TopicAliasMaximum", 0) == 0
    r.publish(f"{uid}/a", b"x", qos=0, props={"TopicAlias": 1})
    seen = r.expect_closed()
    assert [(p.type, p.rc) for p in seen] == [(DISCONNECT, 0x94)], seen


def test_outgoing_topic_aliases_resolve_correctly(broker, raw, connect, uid):
    """A client allowing aliases (Topic Alias Maximum 2) must still see the right topic
    for every message, whether or not the broker uses aliases (Mosquitto doesn't)."""
    r = raw(broker, version=5)
    r.connect(props={"TopicAliasMaximum": 2})
    r.subscribe(f"{uid}/#", qos=0)
    pub = connect(broker)
    sent = [f"{uid}/{t}" for t in "aabacab" * 2]
    for i, t in enumerate(sent):
        pub.publish(t, str(i).encode(), qos=0)
    aliases: dict[int, str] = {}
    got = []
    for p in r.expect_publishes(len(sent)):
        alias = p.props.get("TopicAlias")
        if alias is not None:
            assert 1 <= alias <= 2, p  # never above what the client allowed
            if p.topic:
                aliases[alias] = p.topic
            else:
                assert alias in aliases, p  # used only after being set
        got.append((p.topic or aliases[alias], int(p.payload)))
    assert got == [(t, i) for i, t in enumerate(sent)]


def test_receive_maximum_limits_unacked_qos1_to_client(request, broker, raw, connect, uid):
    known_deviation(
        request,
        broker,
        "Receive Maximum 2 is honoured for the first burst only: after one PUBACK it "
        "sends two more messages (3 unacknowledged in flight) [MQTT-3.3.4-9]",
    )
    r = raw(broker, version=5)
    r.connect(props={"ReceiveMaximum": 2})
    r.subscribe(f"{uid}/t", qos=1)
    pub = connect(broker)
    for i in range(5):
        pub.publish(f"{uid}/t", str(i).encode(), qos=1)
    pending = r.expect_publishes(2)
    r.expect_silence()  # [MQTT-3.3.4-9]: never more than Receive Maximum in flight
    got = list(pending)
    while len(got) < 5:
        r.puback(pending.pop(0).pid)  # one slot frees up: exactly one more arrives
        (nxt,) = r.expect_publishes(1)
        got.append(nxt)
        pending.append(nxt)
        r.expect_silence(0.15)
    assert [int(p.payload) for p in got] == list(range(5))


def test_receive_maximum_counts_qos2_until_pubcomp(broker, raw, connect, uid):
    r = raw(broker, version=5)
    r.connect(props={"ReceiveMaximum": 1})
    r.subscribe(f"{uid}/t", qos=2)
    pub = connect(broker)
    pub.publish(f"{uid}/t", b"0", qos=2)
    pub.publish(f"{uid}/t", b"1", qos=2)
    (a,) = r.expect_publishes(1)
    r.pubrec(a.pid)
    rel = r.recv()
    assert rel.name == "PUBREL", rel
    r.expect_silence()  # still in flight until PUBCOMP
    r.pubcomp(a.pid)
    (b,) = r.expect_publishes(1)
    assert (a.payload, b.payload) == (b"0", b"1")


def test_client_maximum_packet_size_respected(broker, raw, connect, uid):
    r = raw(broker, version=5)
    r.connect(props={"MaximumPacketSize": 200})
    r.subscribe(f"{uid}/t", qos=1)
    pub = connect(broker)
    pub.publish(f"{uid}/t", b"small-1", qos=1)
    pub.publish(f"{uid}/t", b"x" * 500, qos=1)  # too large for this client: dropped
    pub.publish(f"{uid}/t", b"small-2", qos=1)
    got = r.expect_publishes(2)
    assert [p.payload for p in got] == [b"small-1", b"small-2"]  # [MQTT-3.1.2-24]
    for p in got:
        r.puback(p.pid)
    r.expect_silence()


def test_server_maximum_packet_size_enforced(broker_kind, make_broker, raw, uid):
    b = make_broker(broker_kind, max_packet_size=1000)
    r = raw(b, version=5)
    ack = r.connect()
    assert ack.props.get("MaximumPacketSize") == 1000
    r.publish(f"{uid}/t", b"ok", qos=1)
    assert r.recv_type(PUBACK)
    r.publish(f"{uid}/t", b"x" * 2000, qos=1)
    seen = r.expect_closed()
    # [MQTT-3.2.2-15]: 0x95 Packet too large.
    assert [(p.type, p.rc) for p in seen] == [(DISCONNECT, 0x95)], seen


def test_v311_server_maximum_packet_size_closes_connection(broker_kind, make_broker, raw, uid):
    b = make_broker(broker_kind, max_packet_size=1000)
    r = raw(b, version=4)
    r.connect()
    r.publish(f"{uid}/t", b"x" * 2000, qos=0)
    assert r.expect_closed() == []


def test_qos_above_maximum_disconnects(broker_kind, make_broker, raw, uid):
    b = make_broker(broker_kind, maximum_qos=1)
    r = raw(b, version=5)
    r.connect()
    r.publish(f"{uid}/t", b"x", qos=2)
    seen = r.expect_closed()
    # [MQTT-3.2.2-11]: 0x9B QoS not supported.
    assert [(p.type, p.rc) for p in seen] == [(DISCONNECT, 0x9B)], seen


def test_puback_no_matching_subscribers(broker, raw, uid):
    r = raw(broker, version=5)
    r.connect()
    r.publish(f"{uid}/nobody", b"x", qos=1)
    assert r.recv_type(PUBACK).rc == 0x10  # No matching subscribers


def test_reason_strings_are_strings_when_present(broker, raw, uid):
    r = raw(broker, version=5)
    r.connect(props={"RequestProblemInformation": 1})
    ack = r.subscribe([(f"{uid}/a", 1)])
    assert isinstance(ack.props.get("ReasonString", ""), str)
    r.publish(f"{uid}/t", b"x", qos=0, props={"TopicAlias": 60000})
    for p in r.expect_closed():
        assert isinstance(p.props.get("ReasonString", ""), str)


def test_connack_does_not_raise_session_expiry(broker, raw):
    r = raw(broker, version=5)
    ack = r.connect(props={"SessionExpiryInterval": 10, "ReceiveMaximum": 10})
    assert ack.type == CONNACK and ack.rc == 0
    # Session Expiry: the server may only send it back to change it.
    assert ack.props.get("SessionExpiryInterval", 10) <= 10
