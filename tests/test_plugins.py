"""Plugins end to end: the example plugin (examples/plugins/example_plugin.py) and plugins that
misbehave, in a real `fastbroker run` with paho-mqtt and raw-socket clients."""

from __future__ import annotations

import hashlib
import hmac
import textwrap
import time
from pathlib import Path

import pytest
import rawmqtt
from brokers import run_broker_to_exit
from test_auth_e2e import AckClient, connack_code, connect, password_file, raw_qos2_code

from fastbroker.auth.plugins import ConnectRequest, Message

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "plugins" / "example_plugin.py"
SECRET = "test-secret"
METHOD = "FB-HMAC-CHALLENGE"

pytestmark = pytest.mark.timeout(60)


def token(device_id: str) -> str:
    return hmac.new(SECRET.encode(), device_id.encode(), hashlib.sha256).hexdigest()


def plugin_config(spec: str, options: dict | None = None, **auth) -> str:
    lines = ["[auth]", f"plugins = [{spec!r}]".replace("'", '"')]
    for key, value in auth.items():
        lines.append(f"{key} = {value!r}".replace("'", '"'))
    if options:
        lines.append(f'[auth.plugin_options."{spec}"]')
        for key, value in options.items():
            lines.append(f"{key} = {value!r}".replace("'", '"'))
    return "\n".join(lines) + "\n"


def example_broker(make_broker, tmp_path: Path, **auth):
    options = {"secret": SECRET, "max_payload": 100}
    return make_broker("fastbroker", extra_toml=plugin_config(f"{EXAMPLE}:create", options, **auth))


def device(broker, device_id: str, version: int = 5, password: str | None = None) -> AckClient:
    name = f"device-{device_id}"
    return connect(
        broker,
        version=version,
        client_id=name,
        username=name,
        password=token(device_id) if password is None else password,
    )


# --------------------------------------------------------------------------- example plugin


def test_example_plugin_authenticates_devices(make_broker, tmp_path):
    broker = example_broker(make_broker, tmp_path)
    for version in (4, 5):
        ok = device(broker, "d1", version)
        ok.close()
    wrong = dict(client_id="device-d1", username="device-d1", password=token("d2"))
    assert connack_code(broker, 5, **wrong) == 0x86
    assert connack_code(broker, 4, **wrong) == 4
    # The client id must be the username.
    assert connack_code(broker, 5, client_id="x", username="device-d1", password=token("d1")) == (
        0x86
    )
    # Not a device and no password file: the plugin has no opinion, and anonymous access is
    # off because an authenticating plugin is configured.
    assert connack_code(broker, 5, username="someone", password="x") == 0x87
    assert connack_code(broker, 5) == 0x87


def test_example_plugin_permissions(make_broker, tmp_path):
    broker = example_broker(make_broker, tmp_path)
    d1 = device(broker, "d1")
    d2 = device(broker, "d2")
    try:
        assert d2.subscribe("devices/device-d2/#", qos=1) == [1]
        assert d2.subscribe("devices/device-d1/#", qos=1) == [0x87]
        assert d1.publish_code("devices/device-d1/t") == 0
        assert d1.publish_code("devices/device-d2/cmd") == 0x87
        assert d2.publish_code("devices/device-d2/self") == 0
        assert [m.topic for m in d2.expect(1)] == ["devices/device-d2/self"]
        d2.expect_none()
    finally:
        d1.close()
        d2.close()


def test_example_plugin_drops_large_payloads(make_broker, tmp_path):
    """Dropped messages are acknowledged as success but go nowhere."""
    broker = example_broker(make_broker, tmp_path)
    pub = device(broker, "p")
    try:
        base = "devices/device-p"
        assert pub.subscribe(f"{base}/#", qos=1) == [1]
        assert pub.publish_code(f"{base}/small", b"x" * 100) == 0
        assert pub.publish_code(f"{base}/big", b"x" * 101) == 0
        assert pub.publish_code(f"{base}/after", b"y") == 0
        got = [(m.topic, len(m.payload)) for m in pub.expect(2)]
        assert got == [(f"{base}/small", 100), (f"{base}/after", 1)]
        pub.expect_none()
    finally:
        pub.close()


def rewriting_broker(make_broker, tmp_path):
    """The example plugin with prefixes inside a device's own tree, so the rewrite and the
    denial are visible to the device itself."""
    base = "devices/device-p/"
    options = {
        "secret": SECRET,
        "max_payload": 100,
        "deny_prefix": base + "forbidden/",
        "rename_from": base + "legacy/",
        "rename_to": base + "v2/",
    }
    spec = f"{EXAMPLE}:create"
    return make_broker("fastbroker", extra_toml=plugin_config(spec, options)), base


@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_example_plugin_denies_and_rewrites(make_broker, tmp_path, version):
    broker, base = rewriting_broker(make_broker, tmp_path)
    pub = device(broker, "p", version=version)
    try:
        assert pub.subscribe(base + "#", qos=1) == [1]
        # 3.1.1 cannot say no: the publisher gets a positive ack, the message goes nowhere.
        denied = 0x87 if version == 5 else 0
        assert pub.publish_code(base + "forbidden/x", b"no", qos=1) == denied
        if version == 4:
            assert pub.publish_code(base + "forbidden/y", b"no", qos=2) == 0
        assert pub.publish_code(base + "legacy/temp", b"21", qos=1) == 0
        assert pub.publish_code(base + "legacy/temp", b"22", qos=2) == 0
        got = [(m.topic, m.payload) for m in pub.expect(2)]
        assert got == [(base + "v2/temp", b"21"), (base + "v2/temp", b"22")]
        pub.expect_none()
    finally:
        pub.close()
    if version == 5:
        # QoS 2 on a raw socket (same client id, so after paho left): paho 2 sends PUBREL even
        # after PUBREC 0x87 (see test_auth_e2e).
        code = raw_qos2_code(broker, "device-p", token("p"), base + "forbidden/y", "device-p")
        assert code == 0x87


def test_interception_keeps_per_connection_order(make_broker, tmp_path):
    """A plugin answering after random delays: each publisher's messages still come out in
    the order they were sent (QoS 0 and 1 mixed), and both publishers progress concurrently."""
    plugin = tmp_path / "jitter.py"
    plugin.write_text(
        textwrap.dedent(
            """
            import asyncio, random
            from fastbroker.auth.plugins import Plugin

            class Jitter(Plugin):
                async def on_publish(self, message):
                    await asyncio.sleep(random.random() * 0.005)
                    return message

            def create():
                return Jitter()
            """
        )
    )
    broker = make_broker("fastbroker", extra_toml=plugin_config(f"{plugin}:create"))
    sub = connect(broker)
    pubs = [connect(broker), connect(broker)]
    try:
        assert sub.subscribe("order/#", qos=1) == [1]
        for i in range(100):
            for n, pub in enumerate(pubs):
                pub.publish(f"order/{n}", str(i).encode(), qos=i % 2, wait=False)
        got = sub.expect(200, timeout=20)
        # Per QoS: paho itself holds QoS 1 messages back past its in-flight window while
        # QoS 0 ones go out, so only the order within one QoS is the broker's to keep.
        for n in range(2):
            for qos in (0, 1):
                payloads = [int(m.payload) for m in got if m.topic == f"order/{n}"]
                assert [p for p in payloads if p % 2 == qos] == list(range(qos, 100, 2))
    finally:
        for c in (sub, *pubs):
            c.close()


# --------------------------------------------------------------------------- enhanced auth


def auth_packet(reason: int, data: bytes | None, method: str = METHOD) -> bytes:
    props = {rawmqtt.AUTHENTICATION_METHOD: method}
    if data is not None:
        props[rawmqtt.AUTHENTICATION_DATA] = data
    return rawmqtt.packet(rawmqtt.AUTH, 0, bytes([reason]) + rawmqtt.properties(props))


def parse_auth(packet: rawmqtt.Packet) -> tuple[int, dict]:
    assert packet.type == rawmqtt.AUTH, packet
    cursor = rawmqtt._Cursor(packet.body)
    return cursor.byte(), cursor.properties()


def challenge_connect(broker, device_id: str, method: str = METHOD):
    sock = rawmqtt.open_socket(*broker.address)
    name = f"device-{device_id}"
    sock.sendall(
        rawmqtt.connect(
            name,
            protocol=5,
            username=name,
            props={
                rawmqtt.AUTHENTICATION_METHOD: method,
                rawmqtt.REQUEST_PROBLEM_INFORMATION: 1,
            },
        )
    )
    return sock


def test_enhanced_auth_challenge_response(make_broker, tmp_path):
    broker = example_broker(make_broker, tmp_path)
    sock = challenge_connect(broker, "e1")
    try:
        reason, props = parse_auth(rawmqtt.read_packet(sock))
        assert reason == 0x18  # continue authentication
        assert props[rawmqtt.AUTHENTICATION_METHOD] == METHOD
        nonce = props[rawmqtt.AUTHENTICATION_DATA]
        assert len(nonce) == 16
        answer = hmac.new(token("e1").encode(), nonce, hashlib.sha256).digest()
        sock.sendall(auth_packet(0x18, answer))
        ack = rawmqtt.parse_connack(rawmqtt.read_packet(sock), 5)
        assert ack.reason == 0
        assert ack.props[rawmqtt.AUTHENTICATION_METHOD] == METHOD
        assert ack.props[rawmqtt.AUTHENTICATION_DATA] == b"welcome"
        # Authenticated like any device: its own tree only.
        sock.sendall(rawmqtt.subscribe(1, [("devices/device-e1/#", 1)], protocol=5))
        assert rawmqtt.parse_suback(rawmqtt.read_packet(sock), 5).reasons == [1]

        # MQTT 5 re-authentication on the same connection: a new challenge, then success.
        sock.sendall(auth_packet(0x19, None))
        reason, props = parse_auth(rawmqtt.read_packet(sock))
        assert reason == 0x18
        nonce2 = props[rawmqtt.AUTHENTICATION_DATA]
        assert nonce2 != nonce
        sock.sendall(
            auth_packet(0x18, hmac.new(token("e1").encode(), nonce2, hashlib.sha256).digest())
        )
        reason, props = parse_auth(rawmqtt.read_packet(sock))
        assert reason == 0x00
        assert props[rawmqtt.AUTHENTICATION_DATA] == b"welcome"
    finally:
        sock.close()


def test_enhanced_auth_wrong_answer_and_unknown_method(make_broker, tmp_path):
    broker = example_broker(make_broker, tmp_path)
    sock = challenge_connect(broker, "e2")
    try:
        reason, _ = parse_auth(rawmqtt.read_packet(sock))
        assert reason == 0x18
        sock.sendall(auth_packet(0x18, b"\0" * 32))
        ack = rawmqtt.parse_connack(rawmqtt.read_packet(sock), 5)
        assert ack.reason == 0x86
        assert ack.props[rawmqtt.REASON_STRING] == "wrong answer to the challenge"
        assert rawmqtt.expect_closed(sock)
    finally:
        sock.close()
    sock = challenge_connect(broker, "e3", method="SCRAM-SHA-1")
    try:
        assert rawmqtt.parse_connack(rawmqtt.read_packet(sock), 5).reason == 0x8C
    finally:
        sock.close()


# --------------------------------------------------------------------------- misbehaving plugins

BROKEN = """
import asyncio
from fastbroker.auth.plugins import AuthResult, Plugin

class Broken(Plugin):
    async def authenticate(self, request):
        if request.username == "raise":
            raise RuntimeError("database is down")
        if request.username == "slow":
            await asyncio.sleep(30)
        if request.username == "nonsense":
            return "yes please"
        if request.username == "badrules":
            return AuthResult.accept(username="badrules")
        return AuthResult.accept()

    async def permissions(self, request, username):
        if username == "badrules":
            return [(1, "a/#/b")]
        return [(7, "ok/#")]

    async def on_publish(self, message):
        if message.topic == "ok/raise":
            raise ValueError("cannot parse payload")
        if message.topic == "ok/slow":
            await asyncio.sleep(30)
        if message.topic == "ok/nonsense":
            return 42
        return message

def create():
    return Broken()
"""


def test_misbehaving_plugin_refuses_and_denies_but_never_crashes(make_broker, tmp_path):
    plugin = tmp_path / "broken.py"
    plugin.write_text(BROKEN)
    broker = make_broker(
        "fastbroker", extra_toml=plugin_config(f"{plugin}:create", plugin_timeout_ms=300)
    )
    for username in ("raise", "nonsense", "badrules"):
        assert connack_code(broker, 5, username=username, password="x") == 0x80, username
    assert connack_code(broker, 4, username="raise", password="x") == 3
    started = time.monotonic()
    assert connack_code(broker, 5, username="slow", password="x") == 0x80
    assert time.monotonic() - started < 3

    client = connect(broker, username="fine", password="x")
    try:
        assert client.subscribe("ok/#", qos=1) == [1]
        for topic in ("ok/raise", "ok/slow", "ok/nonsense"):
            assert client.publish_code(topic, b"x", qos=1) == 0x87, topic
        assert client.publish_code("ok/fine", b"x", qos=1) == 0
        assert [m.topic for m in client.expect(1)] == ["ok/fine"]
        client.expect_none()
    finally:
        client.close()
    log = broker.stderr_text()
    assert "auth plugin Broken: authenticate raised" in log
    assert "RuntimeError: database is down" in log
    assert "auth plugin Broken: authenticate took longer than 300 ms" in log
    assert "auth plugin Broken: on_publish raised" in log
    assert "bad permissions" in log
    assert broker.alive()


def test_plugin_load_and_start_failures(tmp_path):
    done = run_broker_to_exit(tmp_path, plugin_config("no.such.module:create"))
    assert done.returncode == 2
    assert "cannot load 'no.such.module:create': ModuleNotFoundError" in done.stderr

    (tmp_path / "nostart.py").write_text(
        "from fastbroker.auth.plugins import Plugin\n"
        "class NoStart(Plugin):\n"
        "    async def start(self):\n"
        "        raise ConnectionError('no database')\n"
        "def create(**options):\n"
        "    return NoStart()\n"
    )
    done = run_broker_to_exit(tmp_path, plugin_config(f"{tmp_path / 'nostart.py'}:create"))
    assert done.returncode == 1
    assert "plugin NoStart failed to start: ConnectionError: no database" in done.stderr

    spec = f"{tmp_path / 'nostart.py'}:create"
    done = run_broker_to_exit(
        tmp_path, plugin_config(spec) + '[auth.plugin_options."other:create"]\nx = 1\n'
    )
    assert done.returncode == 2
    assert "'other:create' is not one of [auth] plugins" in done.stderr


def test_plugin_with_password_file_and_identity_from_result(make_broker, tmp_path):
    """A plugin with no opinion falls through to the password file; one that accepts with a
    username gives that identity to the ACL's user blocks."""
    plugin = tmp_path / "mapper.py"
    plugin.write_text(
        "from fastbroker.auth.plugins import AuthResult, Plugin\n"
        "class Mapper(Plugin):\n"
        "    async def authenticate(self, request):\n"
        "        # The connection's details reach plugins (peer, listener).\n"
        "        seen = request.peer and request.peer[0] == '127.0.0.1' and request.listener\n"
        "        if request.password == b'magic' and seen:\n"
        "            return AuthResult.accept(username='mapped')\n"
        "        return None\n"
        "def create():\n"
        "    return Mapper()\n"
    )
    users = password_file(tmp_path / "passwords", {"alice": "pw"})
    (tmp_path / "acl").write_text(
        "user mapped\ntopic readwrite m/#\nuser alice\ntopic readwrite a/#\n"
    )
    broker = make_broker(
        "fastbroker",
        extra_toml=plugin_config(
            f"{plugin}:create", password_file=str(users), acl_file=str(tmp_path / "acl")
        ),
    )
    mapped = connect(broker, username="whoever", password="magic")
    alice = connect(broker, username="alice", password="pw")
    try:
        assert mapped.publish_code("m/1") == 0
        assert mapped.publish_code("a/1") == 0x87
        assert alice.publish_code("a/1") == 0
        assert alice.publish_code("m/1") == 0x87
        assert connack_code(broker, 5, username="alice", password="bad") == 0x86
    finally:
        mapped.close()
        alice.close()


# --------------------------------------------------------------------------- interface


def test_interface_objects():
    """What plugins build on: requests are mutable (context), answers and messages not."""
    from fastbroker.auth.plugins import AuthResult

    request = ConnectRequest(conn=1, client_id="c", username=None, password=None, protocol_level=5)
    request.context["nonce"] = b"n"
    assert request.peer is None and request.kind == "connect"
    assert AuthResult.accept().accepted
    assert not AuthResult.refuse(0x86).accepted
    assert AuthResult.continue_(b"d").continues
    with pytest.raises(ValueError):
        AuthResult.refuse(0x00)
    message = Message("c", None, "t", b"p", 1, False)
    with pytest.raises(AttributeError):
        message.topic = "other"  # type: ignore[misc]
