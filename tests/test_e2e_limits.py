"""fastbroker's own limits, which Mosquitto has no equivalent for (so these run on fastbroker
only): session expiry cap, client id length, keepalive policy, outgoing topic aliases, queue
byte bound."""

from __future__ import annotations

from conftest import DISCONNECT


def test_session_expiry_is_capped_and_the_client_told(make_broker, raw, uid):
    b = make_broker("fastbroker", max_session_expiry=5)
    r = raw(b, version=5)
    ack = r.connect(client_id=uid, clean=True, props={"SessionExpiryInterval": 3600})
    # MQTT-3.2.2-... the server says which expiry it uses when it differs from the request.
    assert ack.props.get("SessionExpiryInterval") == 5, ack


def test_client_id_longer_than_the_maximum_is_refused(make_broker, raw):
    b = make_broker("fastbroker", max_client_id_len=8)
    r = raw(b, version=5)
    ack = r.connect(client_id="123456789", expect_rc=None)
    assert ack.rc == 0x85, ack  # client identifier not valid
    r.expect_closed()
    r4 = raw(b, version=4)
    ack = r4.connect(client_id="123456789", expect_rc=None)
    assert ack.rc == 2, ack  # 3.1.1: identifier rejected
    raw(b, version=5).connect(client_id="12345678")  # at the limit: fine


def test_max_keepalive_told_to_v5_and_refused_above_for_v311(make_broker, raw):
    b = make_broker("fastbroker", max_keepalive=10)
    ack = raw(b, version=5).connect(keepalive=0)
    assert ack.props.get("ServerKeepAlive") == 10, ack
    ack = raw(b, version=5).connect(keepalive=60)
    assert ack.props.get("ServerKeepAlive") == 10, ack
    ack = raw(b, version=5).connect(keepalive=5)
    assert "ServerKeepAlive" not in ack.props, ack
    # 3.1.1 cannot be told: a client asking for more is refused (as Mosquitto does).
    r4 = raw(b, version=4)
    assert r4.connect(keepalive=60, expect_rc=None).rc == 2
    assert raw(b, version=4).connect(keepalive=10).rc == 0


def test_outgoing_topic_aliases_can_be_turned_off(make_broker, raw, connect, uid):
    b = make_broker("fastbroker", outgoing_topic_aliases=False)
    r = raw(b, version=5)
    r.connect(props={"TopicAliasMaximum": 5})
    r.subscribe(f"{uid}/t", qos=0)
    pub = connect(b)
    for i in range(3):
        pub.publish(f"{uid}/t", str(i).encode(), qos=0)
    for p in r.expect_publishes(3):
        assert p.topic == f"{uid}/t" and "TopicAlias" not in p.props, p


def test_outgoing_topic_aliases_are_used_when_allowed(make_broker, raw, connect, uid):
    b = make_broker("fastbroker")
    r = raw(b, version=5)
    r.connect(props={"TopicAliasMaximum": 5})
    r.subscribe(f"{uid}/t", qos=0)
    pub = connect(b)
    for i in range(3):
        pub.publish(f"{uid}/t", str(i).encode(), qos=0)
    first, *rest = r.expect_publishes(3)
    assert first.topic == f"{uid}/t" and first.props.get("TopicAlias") == 1, first
    # Later messages carry only the alias: the bytes saved are the point of the feature.
    assert all(p.topic == "" and p.props.get("TopicAlias") == 1 for p in rest), rest


def test_queue_byte_bound_for_offline_session(make_broker, raw, connect, uid):
    b = make_broker("fastbroker", max_queued_bytes=1000)
    sub = raw(b, version=5)
    sub.connect(client_id=uid, clean=False, props={"SessionExpiryInterval": 60})
    sub.subscribe(f"{uid}/q", qos=1)
    sub.close()
    pub = connect(b)
    for i in range(10):
        pub.publish(f"{uid}/q", bytes([48 + i]) * 300, qos=1)
    back = raw(b, version=5)
    ack = back.connect(client_id=uid, clean=False, props={"SessionExpiryInterval": 60})
    assert ack.session_present
    got = back.expect_publishes(3)
    # 3 x 300 bytes fit in 1000; the oldest are kept, in order.
    assert [p.payload[:1] for p in got] == [b"0", b"1", b"2"], got
    back.expect_silence()


def test_server_disconnect_reason_on_unsupported_qos(make_broker, raw, uid):
    b = make_broker("fastbroker", maximum_qos=1)
    r = raw(b, version=5)
    ack = r.connect()
    assert ack.props.get("MaximumQoS") == 1, ack
    r.publish(f"{uid}/x", b"too high", qos=2)
    seen = r.expect_closed()
    assert [(p.type, p.rc) for p in seen] == [(DISCONNECT, 0x9B)], seen
