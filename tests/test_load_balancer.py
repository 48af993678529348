"""HAProxy in front of fastbroker, as docs/load-balancer.md configures it: the committed
deploy/haproxy.cfg is what fastbroker.chaos.front generates (and the fault-injection suite
runs), HAProxy accepts it, and a real client through a real HAProxy reaches a node that sees
the client's own address (PROXY protocol v2) and passes the MQTT health check."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from brokers import free_port, start_fastbroker

from fastbroker.chaos.front import haproxy_config
from fastbroker.chaos.nodes import die_with_parent

REPO = Path(__file__).resolve().parent.parent
HAPROXY = shutil.which("haproxy")
# scripts/test.sh installs it: there (FASTBROKER_REQUIRED=1) a missing one fails the tests.
needs_haproxy = pytest.mark.skipif(
    HAPROXY is None and os.environ.get("FASTBROKER_REQUIRED") != "1",
    reason="haproxy is not installed",
)
# A loopback address of the client's own, to tell it from HAProxy's.
CLIENT_IP = "127.0.0.77"


def test_the_documented_configuration_is_the_one_the_suite_generates():
    text = (REPO / "deploy" / "haproxy.cfg").read_text()
    body = "".join(line for line in text.splitlines(True) if not line.startswith("# "))
    nodes = [("node1", "10.0.0.1"), ("node2", "10.0.0.2"), ("node3", "10.0.0.3")]
    assert body.lstrip("\n") == haproxy_config(nodes, 1883, ":1883")


@needs_haproxy
def test_haproxy_accepts_the_documented_configuration():
    assert HAPROXY is not None, "haproxy is not installed"
    result = subprocess.run(
        [HAPROXY, "-c", "-f", str(REPO / "deploy" / "haproxy.cfg")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@needs_haproxy
@pytest.mark.timeout(60)
def test_a_client_through_haproxy_reaches_the_node_under_its_own_address(tmp_path):
    assert HAPROXY is not None, "haproxy is not installed"
    behind = free_port()
    listener = (
        f'[[listeners]]\nname = "behind-haproxy"\nhost = "127.0.0.1"\nport = {behind}\n'
        'proxy_protocol = "v2"\n'
    )
    broker = start_fastbroker(tmp_path, extra_toml=listener)
    front = free_port()
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        haproxy_config(
            [("node1", "127.0.0.1")],
            behind,
            f"127.0.0.1:{front}",
            check_interval_ms=200,
            maxconn=100,
        )
    )
    log = open(tmp_path / "haproxy.log", "wb")
    proxy = subprocess.Popen(
        [HAPROXY, "-db", "-f", str(config)],
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=die_with_parent,
    )
    try:
        # Several health checks (200 ms apart, 2 failures mark the node down): a node that
        # failed them would be out of the rotation and the connect below refused.
        time.sleep(1.0)
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="through-haproxy")
        got: list[bytes] = []
        client.on_message = lambda c, u, m: got.append(m.payload)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.connect("127.0.0.1", front, bind_address=CLIENT_IP)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        client.loop_start()
        try:
            client.subscribe("lb/t", qos=1)
            time.sleep(0.3)
            client.publish("lb/t", b"hello", qos=1).wait_for_publish(5)
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            client.disconnect()
            client.loop_stop()
        assert got == [b"hello"]
        log_text = (tmp_path / "haproxy.log").read_text()
        assert "is DOWN" not in log_text, log_text
        deadline = time.monotonic() + 5
        while '"client_id": "through-haproxy"' not in broker.stderr_text():
            assert time.monotonic() < deadline, broker.stderr_text()
            time.sleep(0.1)
        access = [
            line
            for line in broker.stderr_text().splitlines()
            if '"client_id": "through-haproxy"' in line
        ]
        assert access and all(f'"peer": "{CLIENT_IP}:' in line for line in access), access
    finally:
        proxy.terminate()
        proxy.wait(10)
        log.close()
        broker.stop()
