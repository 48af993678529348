"""Will messages."""

from __future__ import annotations

import time

from conftest import known_deviation


def watch(connect, broker, version, topic, qos=1):
    w = connect(broker, version=version)
    w.subscribe(topic, qos=qos)
    return w


def test_will_published_on_abnormal_close(broker, raw, connect, version, uid):
    w = watch(connect, broker, version, f"{uid}/will")
    r = raw(broker, version=version)
    r.connect(will={"topic": f"{uid}/will", "payload": b"died", "qos": 1})
    r.close()  # TCP close without DISCONNECT
    m = w.expect_one()
    assert (m.topic, m.payload, m.qos, m.retain) == (f"{uid}/will", b"died", 1, False)


def test_will_not_published_after_normal_disconnect(broker, raw, connect, version, uid):
    w = watch(connect, broker, version, f"{uid}/will")
    r = raw(broker, version=version)
    r.connect(will={"topic": f"{uid}/will", "payload": b"died", "qos": 1})
    r.disconnect()  # DISCONNECT (0x00): the will is discarded [MQTT-3.1.2-10]
    w.expect_none()


def test_will_qos_is_respected(broker, raw, connect, version, uid):
    w = watch(connect, broker, version, f"{uid}/will", qos=2)
    r = raw(broker, version=version)
    r.connect(will={"topic": f"{uid}/will", "payload": b"q2", "qos": 2})
    r.close()
    m = w.expect_one()
    assert (m.payload, m.qos) == (b"q2", 2)


def test_will_retain(broker, raw, connect, version, uid):
    live = watch(connect, broker, version, f"{uid}/will")
    r = raw(broker, version=version)
    r.connect(will={"topic": f"{uid}/will", "payload": b"last", "qos": 1, "retain": True})
    r.close()
    m = live.expect_one()
    assert (m.payload, m.retain) == (b"last", False)  # live delivery: RETAIN cleared
    late = connect(broker, version=version)
    late.subscribe(f"{uid}/will", qos=1)
    m = late.expect_one()
    assert (m.payload, m.retain) == (b"last", True)  # and it was stored as retained


def test_will_published_when_server_closes_for_protocol_error(broker, raw, connect, version, uid):
    w = watch(connect, broker, version, f"{uid}/will")
    r = raw(broker, version=version)
    r.connect(will={"topic": f"{uid}/will", "payload": b"bad", "qos": 1})
    r.send_raw(b"\x00\x00")  # packet type 0 is reserved: malformed
    r.expect_closed()
    assert w.expect_one().payload == b"bad"


def test_v5_will_properties_forwarded(broker, raw, connect, uid):
    w = watch(connect, broker, 5, f"{uid}/will")
    r = raw(broker, version=5)
    props = {
        "ContentType": "text/plain",
        "ResponseTopic": f"{uid}/resp",
        "CorrelationData": b"\x01\x02",
        "UserProperty": [("k", "v")],
        "PayloadFormatIndicator": 1,
    }
    r.connect(will={"topic": f"{uid}/will", "payload": b"p", "qos": 1, "props": props})
    r.close()
    m = w.expect_one()
    for k, v in props.items():
        assert m.props.get(k) == v, (k, m.props)


def test_v5_will_delay_interval(broker, raw, connect, uid):
    w = watch(connect, broker, 5, f"{uid}/will")
    r = raw(broker, version=5)
    r.connect(
        client_id=f"{uid}-wd",
        props={"SessionExpiryInterval": 30},
        will={
            "topic": f"{uid}/will",
            "payload": b"late",
            "qos": 1,
            "props": {"WillDelayInterval": 1},
        },
    )
    r.close()
    start = time.monotonic()
    w.expect_none(0.5)  # not before the delay
    m = w.expect_one(timeout=3.0)
    assert m.payload == b"late"
    assert time.monotonic() - start >= 0.9


def test_v5_will_not_published_if_client_reconnects_within_delay(broker, raw, connect, uid):
    w = watch(connect, broker, 5, f"{uid}/will")
    will = {"topic": f"{uid}/will", "payload": b"late", "qos": 1, "props": {"WillDelayInterval": 1}}
    r = raw(broker, version=5)
    r.connect(client_id=f"{uid}-wd2", clean=False, props={"SessionExpiryInterval": 30}, will=will)
    r.close()
    time.sleep(0.2)
    r2 = raw(broker, version=5)
    ack = r2.connect(client_id=f"{uid}-wd2", clean=False, props={"SessionExpiryInterval": 30})
    assert ack.session_present
    # [MQTT-3.1.3-9]: the will is not sent if the session resumes before the delay.
    w.expect_none(1.7)
    r2.disconnect()


def test_v5_will_published_at_session_end_when_shorter_than_delay(broker, raw, connect, uid):
    w = watch(connect, broker, 5, f"{uid}/will")
    r = raw(broker, version=5)
    r.connect(
        client_id=f"{uid}-wd3",
        props={"SessionExpiryInterval": 1},
        will={
            "topic": f"{uid}/will",
            "payload": b"end",
            "qos": 1,
            "props": {"WillDelayInterval": 30},
        },
    )
    r.close()
    # 3.1.3.2.2: published when the delay elapses OR the session ends, whichever first.
    assert w.expect_one(timeout=3.0).payload == b"end"


def test_v5_will_delay_with_session_expiry_zero_publishes_at_close(
    request, broker, raw, connect, uid
):
    known_deviation(
        request,
        broker,
        "with Session Expiry 0 the will still waits the full Will Delay Interval "
        "(measured: delay 3 s -> published after ~3.8 s) instead of at session end",
    )
    w = watch(connect, broker, 5, f"{uid}/will")
    r = raw(broker, version=5)
    r.connect(
        client_id=f"{uid}-wd4",
        props={"SessionExpiryInterval": 0},
        will={
            "topic": f"{uid}/will",
            "payload": b"now",
            "qos": 1,
            "props": {"WillDelayInterval": 30},
        },
    )
    r.close()
    # Session Expiry 0: the session ends with the connection, so does the delay.
    assert w.expect_one(timeout=1.5).payload == b"now"


def test_v5_disconnect_with_will_message(broker, raw, connect, uid):
    w = watch(connect, broker, 5, f"{uid}/will")
    r = raw(broker, version=5)
    r.connect(will={"topic": f"{uid}/will", "payload": b"asked", "qos": 1})
    r.disconnect(rc=0x04)  # Disconnect with Will Message
    assert w.expect_one().payload == b"asked"


def test_v5_will_published_on_takeover_with_clean_start(broker, raw, connect, uid):
    """A clean-start takeover ends the old session, so its will is published."""
    w = watch(connect, broker, 5, f"{uid}/will")
    cid = f"{uid}-tw"
    r = raw(broker, version=5)
    r.connect(client_id=cid, will={"topic": f"{uid}/will", "payload": b"taken", "qos": 1})
    connect(broker, client_id=cid, version=5, clean=True)
    r.expect_closed()
    assert w.expect_one().payload == b"taken"
