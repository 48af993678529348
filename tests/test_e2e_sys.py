"""$SYS topics, and Mosquitto's command-line clients against the broker."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import pytest

SYS_TOPICS = [
    "$SYS/broker/version",
    "$SYS/broker/uptime",
    "$SYS/broker/clients/connected",
    "$SYS/broker/messages/received",
    "$SYS/broker/messages/sent",
    "$SYS/broker/bytes/received",
    "$SYS/broker/bytes/sent",
    "$SYS/broker/subscriptions/count",
    "$SYS/broker/retained messages/count",
]
NUMERIC = SYS_TOPICS[2:]


def collect_until(client, predicate, timeout: float):
    """Gather messages into {topic: [Msg...]} until predicate(seen) or timeout."""
    seen: dict[str, list] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for m in client.drain(0.1):
            seen.setdefault(m.topic, []).append(m)
        if predicate(seen):
            return seen
    return seen


def leading_int(payload: bytes) -> int:
    m = re.match(rb"^\s*(\d+)", payload)
    assert m, payload
    return int(m.group(1))


def test_sys_topics_published(broker_kind, make_broker, connect, version):
    b = make_broker(broker_kind, sys_interval=1)
    c = connect(b, version=version)
    c.subscribe("$SYS/broker/#", qos=0)
    seen = collect_until(c, lambda s: all(t in s for t in SYS_TOPICS), timeout=3.5)
    missing = [t for t in SYS_TOPICS if t not in seen]
    assert not missing, f"missing $SYS topics: {missing}; got {sorted(seen)}"
    assert seen["$SYS/broker/version"][0].payload.strip()
    for t in NUMERIC:
        leading_int(seen[t][0].payload)  # integer first ("12" or mosquitto's "12 seconds")
    assert leading_int(seen["$SYS/broker/uptime"][0].payload) >= 0


def test_sys_topics_retained(broker_kind, make_broker, connect):
    b = make_broker(broker_kind, sys_interval=1)
    c = connect(b)
    c.subscribe("$SYS/broker/version", qos=0)
    m = c.expect_one(timeout=2.5)
    assert m.retain  # stored retained: a new subscriber gets it at once


def test_sys_counters_track_activity(broker_kind, make_broker, connect, uid):
    b = make_broker(broker_kind, sys_interval=1)
    watcher = connect(b)
    watcher.subscribe("$SYS/broker/clients/connected", qos=0)
    watcher.subscribe("$SYS/broker/messages/received", qos=0)
    others = [connect(b) for _ in range(2)]
    for o in others:
        o.publish(f"{uid}/x", b"1", qos=1)

    def done(seen):
        clients = [leading_int(m.payload) for m in seen.get("$SYS/broker/clients/connected", [])]
        received = [leading_int(m.payload) for m in seen.get("$SYS/broker/messages/received", [])]
        return clients and max(clients) >= 3 and received and max(received) >= 2

    seen = collect_until(watcher, done, timeout=4.0)
    assert done(seen), {t: [m.payload for m in ms] for t, ms in seen.items()}


def test_sys_disabled_when_interval_zero(broker_kind, make_broker, connect):
    b = make_broker(broker_kind, sys_interval=0)
    c = connect(b)
    c.subscribe("$SYS/#", qos=0)
    c.expect_none(1.2)


def test_client_cannot_inject_sys_messages(broker_kind, make_broker, connect, uid):
    """A client publishing under $SYS/broker/ must not overwrite broker statistics."""
    b = make_broker(broker_kind, sys_interval=1)
    evil = connect(b)
    evil.publish("$SYS/broker/version", b"evil", qos=1, retain=True)
    c = connect(b)
    c.subscribe("$SYS/broker/version", qos=0)
    got = [m.payload for m in collect_until(c, lambda s: False, 1.3).get("$SYS/broker/version", [])]
    assert got and b"evil" not in got, got


# --------------------------------------------------------------------------- CLI clients


@pytest.mark.parametrize("cli_version", ["mqttv311", "mqttv5"])
def test_mosquitto_cli_clients(broker, uid, cli_version):
    sub_exe, pub_exe = shutil.which("mosquitto_sub"), shutil.which("mosquitto_pub")
    if not (sub_exe and pub_exe):
        pytest.skip("mosquitto-clients not installed (apt-get install -y mosquitto-clients)")
    common = ["-h", broker.host, "-p", str(broker.port), "-V", cli_version, "-q", "1"]
    topic = f"{uid}/cli"
    sub = subprocess.Popen(
        [sub_exe, *common, "-t", topic, "-C", "1", "-W", "8"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        # mosquitto_sub gives no "subscribed" signal: publish until it has its message.
        deadline = time.monotonic() + 6
        while sub.poll() is None and time.monotonic() < deadline:
            subprocess.run(
                [pub_exe, *common, "-t", topic, "-m", "hello from cli"],
                check=True,
                timeout=5,
                capture_output=True,
            )
            try:
                sub.wait(timeout=0.3)
            except subprocess.TimeoutExpired:
                pass
        out, err = sub.communicate(timeout=5)
    finally:
        if sub.poll() is None:
            sub.kill()
            sub.wait()
    assert sub.returncode == 0, err
    assert out.decode().strip() == "hello from cli"
