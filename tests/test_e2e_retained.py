"""Retained messages."""

from __future__ import annotations

from conftest import DISCONNECT, expect_quiet


def test_retained_delivered_on_subscribe_with_retain_flag(broker, connect, version, uid):
    pub = connect(broker, version=version)
    pub.publish(f"{uid}/r", b"kept", qos=1, retain=True)
    sub = connect(broker, version=version)
    sub.subscribe(f"{uid}/r", qos=1)
    m = sub.expect_one()
    # [MQTT-3.3.1-8]: retained messages sent on subscribe have RETAIN set.
    assert (m.topic, m.payload, m.qos, m.retain) == (f"{uid}/r", b"kept", 1, True)
    sub.expect_none()


def test_retained_replaced_by_newer(broker, connect, version, uid):
    pub = connect(broker, version=version)
    pub.publish(f"{uid}/r", b"old", qos=1, retain=True)
    pub.publish(f"{uid}/r", b"new", qos=1, retain=True)
    sub = connect(broker, version=version)
    sub.subscribe(f"{uid}/r", qos=1)
    assert [m.payload for m in sub.drain()] == [b"new"]


def test_retained_deleted_by_empty_payload(broker, connect, version, uid):
    pub = connect(broker, version=version)
    live = connect(broker, version=version)
    live.subscribe(f"{uid}/r", qos=1)
    pub.publish(f"{uid}/r", b"kept", qos=1, retain=True)
    assert live.expect_one().payload == b"kept"
    pub.publish(f"{uid}/r", b"", qos=1, retain=True)
    # The empty retained message still reaches current subscribers like any message.
    m = live.expect_one()
    assert (m.payload, m.retain) == (b"", False)
    late = connect(broker, version=version)
    late.subscribe(f"{uid}/r", qos=1)
    late.expect_none()  # [MQTT-3.3.1-10/11]: removed, and the empty message not stored


def test_retained_qos_capped_by_subscription(broker, connect, version, uid):
    pub = connect(broker, version=version)
    pub.publish(f"{uid}/r", b"q2", qos=2, retain=True)
    for sq in (0, 1, 2):
        sub = connect(broker, version=version)
        sub.subscribe(f"{uid}/r", qos=sq)
        m = sub.expect_one()
        assert (m.payload, m.qos, m.retain) == (b"q2", sq, True)


def test_wildcard_subscribe_gets_all_matching_retained(broker, connect, version, uid):
    pub = connect(broker, version=version)
    topics = [f"{uid}/a/1", f"{uid}/a/2", f"{uid}/a/b/c", f"{uid}/b/1", f"{uid}/a"]
    for t in topics:
        pub.publish(t, t.encode(), qos=1, retain=True)
    multi = connect(broker, version=version)
    multi.subscribe(f"{uid}/a/#", qos=1)
    single = connect(broker, version=version)
    single.subscribe(f"{uid}/+/1", qos=1)
    got_multi, got_single = multi.expect(4), single.expect(2)
    expect_quiet(multi, single)
    assert sorted(m.topic for m in got_multi) == sorted(
        [f"{uid}/a", f"{uid}/a/1", f"{uid}/a/2", f"{uid}/a/b/c"]
    )
    assert sorted(m.topic for m in got_single) == [f"{uid}/a/1", f"{uid}/b/1"]
    assert all(m.retain for m in got_multi + got_single)


def test_live_message_delivered_without_retain_flag(broker, connect, version, uid):
    sub = connect(broker, version=version)
    sub.subscribe(f"{uid}/r", qos=1)
    pub = connect(broker, version=version)
    pub.publish(f"{uid}/r", b"live", qos=1, retain=True)
    m = sub.expect_one()
    # 3.1.1 [MQTT-3.3.1-9]; 5.0: RETAIN cleared unless Retain As Published.
    assert (m.payload, m.retain) == (b"live", False)


def test_v5_retain_as_published(broker, connect, uid):
    sub = connect(broker, version=5)
    sub.subscribe(f"{uid}/r", qos=1, retain_as_published=True)
    plain = connect(broker, version=5)
    plain.subscribe(f"{uid}/r", qos=1)
    pub = connect(broker, version=5)
    pub.publish(f"{uid}/r", b"retained", qos=1, retain=True)
    pub.publish(f"{uid}/r", b"plain", qos=1, retain=False)
    assert [(m.payload, m.retain) for m in sub.expect(2)] == [
        (b"retained", True),
        (b"plain", False),
    ]
    assert [(m.payload, m.retain) for m in plain.expect(2)] == [
        (b"retained", False),
        (b"plain", False),
    ]


def test_v5_retain_handling_0_sends_on_every_subscribe(broker, connect, uid):
    pub = connect(broker, version=5)
    pub.publish(f"{uid}/r", b"kept", qos=1, retain=True)
    sub = connect(broker, version=5)
    sub.subscribe(f"{uid}/r", qos=1, retain_handling=0)
    assert sub.expect_one().payload == b"kept"
    sub.subscribe(f"{uid}/r", qos=1, retain_handling=0)  # re-subscribe: sent again
    assert sub.expect_one().payload == b"kept"


def test_v5_retain_handling_1_sends_only_for_new_subscription(broker, connect, uid):
    pub = connect(broker, version=5)
    pub.publish(f"{uid}/r", b"kept", qos=1, retain=True)
    sub = connect(broker, version=5)
    sub.subscribe(f"{uid}/r", qos=1, retain_handling=1)
    assert sub.expect_one().payload == b"kept"
    sub.subscribe(f"{uid}/r", qos=1, retain_handling=1)  # already exists: not sent
    sub.expect_none()


def test_v5_retain_handling_2_never_sends_retained(broker, connect, uid):
    pub = connect(broker, version=5)
    pub.publish(f"{uid}/r", b"kept", qos=1, retain=True)
    sub = connect(broker, version=5)
    sub.subscribe(f"{uid}/r", qos=1, retain_handling=2)
    sub.expect_none()
    pub.publish(f"{uid}/r", b"live", qos=1)
    assert sub.expect_one().payload == b"live"  # live messages still flow


def test_retained_survives_publisher_disconnect(broker, connect, version, uid):
    pub = connect(broker, version=version)
    pub.publish(f"{uid}/r", b"kept", qos=0, retain=True)
    pub.disconnect()
    sub = connect(broker, version=version)
    sub.subscribe(f"{uid}/#", qos=0)
    m = sub.expect_one()
    assert (m.topic, m.payload, m.retain) == (f"{uid}/r", b"kept", True)


def test_v5_retain_unavailable(broker_kind, make_broker, raw, uid):
    b = make_broker(broker_kind, retain_available=False)
    r = raw(b, version=5)
    ack = r.connect()
    assert ack.props.get("RetainAvailable") == 0
    r.publish(f"{uid}/r", b"x", qos=1, retain=True)
    seen = r.expect_closed()
    # [MQTT-3.3.1-13]: DISCONNECT 0x9A (Retain not supported).
    assert [(p.type, p.rc) for p in seen] == [(DISCONNECT, 0x9A)], seen
