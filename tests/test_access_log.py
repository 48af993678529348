"""The access log: JSON lines for connects, refusals and disconnects (fastbroker.access_log).

Unit tests feed hand-made engine events; the end-to-end test reads the lines a real broker
writes for a paho client, a refused CONNECT and a keep-alive timeout.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import Client

from fastbroker.access_log import MAX_FIELD_CHARS, AccessLog, iso_utc_ms, open_access_log
from fastbroker.config import ConfigError, load_config

KEYS = [
    "ts",
    "event",
    "client_id",
    "username",
    "peer",
    "listener",
    "transport",
    "protocol",
    "reason_code",
    "reason",
]


class Lines(logging.Handler):
    """Keeps what the access logger emits."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def captured():
    logger = logging.getLogger("test.access")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    handler = Lines()
    logger.addHandler(handler)
    yield logger, handler
    logger.removeHandler(handler)


INFO = {
    7: {"peer": ("10.0.0.7", 51234), "listener": "default", "transport": "tcp"},
    8: {"peer": "[::1]:40000", "listener": "ws", "transport": "ws"},
}


def test_connect_then_disconnect_lines_in_order_with_duration(captured) -> None:
    logger, handler = captured
    clock = Clock(100.0)
    log = AccessLog(logger=logger, clock=clock, wall_clock=lambda: 1738314902.481)
    log.handle([("connect", 7, "sensor-17", "alice", 5, 0, "success")], INFO.get)
    assert log.connected_at == {7: 100.0}
    clock.now = 142.5174
    log.handle([("disconnect", 7, "sensor-17", "alice", 5, 141, "keep alive timeout")], INFO.get)

    first, second = (json.loads(line) for line in handler.lines)
    assert list(first) == KEYS
    assert first == {
        "ts": "2025-01-31T09:15:02.481Z",
        "event": "connect",
        "client_id": "sensor-17",
        "username": "alice",
        "peer": "10.0.0.7:51234",
        "listener": "default",
        "transport": "tcp",
        "protocol": 5,
        "reason_code": 0,
        "reason": "success",
    }
    assert list(second) == [*KEYS, "duration_s"]
    assert second["event"] == "disconnect"
    assert second["reason_code"] == 141
    assert second["duration_s"] == 42.517
    # Forgotten at the disconnect: the id will belong to another connection.
    assert log.connected_at == {}


def test_refused_has_no_duration_and_unknown_details_are_null(captured) -> None:
    logger, handler = captured
    log = AccessLog(logger=logger)
    log.handle(
        [
            ("refused", 9, "", None, 4, 2, "identifier rejected"),
            ("disconnect", 10, "never-seen", None, 4, 0, "normal"),
        ],
        INFO.get,
    )
    refused, orphan = (json.loads(line) for line in handler.lines)
    assert list(refused) == KEYS
    assert refused["peer"] is refused["listener"] is refused["transport"] is None
    assert refused["username"] is None
    assert refused["reason_code"] == 2
    # A disconnect whose connect was not seen (say, logged before a restart of the log).
    assert orphan["duration_s"] is None


def test_ipv6_peer_and_clipped_client_strings(captured) -> None:
    logger, handler = captured
    log = AccessLog(logger=logger)
    info = {1: {"peer": ("::1", 40000, 0, 0)}}
    log.handle([("connect", 1, "x" * 70_000, "u" * 300, 5, 0, "success")], info.get)
    line = json.loads(handler.lines[0])
    assert line["peer"] == "[::1]:40000"
    assert line["client_id"] == "x" * MAX_FIELD_CHARS + "..."
    assert line["username"] == "u" * MAX_FIELD_CHARS + "..."
    assert len(handler.lines[0]) < 1000


def test_hostile_strings_stay_one_json_line(captured) -> None:
    logger, handler = captured
    log = AccessLog(logger=logger)
    evil = 'a"\n{"event": "connect"}\x00\u2028'
    log.handle([("connect", 1, evil, evil, 5, 0, "success")], None)
    (line,) = handler.lines
    assert "\n" not in line
    assert json.loads(line)["client_id"] == evil


def test_off_logs_nothing_and_has_no_hook(captured) -> None:
    logger, handler = captured
    log = AccessLog(enabled=False, logger=logger)
    log.handle([("connect", 1, "c", None, 4, 0, "success")], None)
    assert handler.lines == []
    assert log.hook(None) is None
    assert open_access_log("off").hook(None) is None


def test_hook_passes_batches_with_conn_info(captured) -> None:
    logger, handler = captured
    log = AccessLog(logger=logger)
    hook = log.hook(INFO.get)
    assert hook is not None
    hook([("connect", 8, "c1", None, 5, 0, "success"), ("connect", 7, "c2", None, 4, 0, "ok")])
    assert [json.loads(line)["listener"] for line in handler.lines] == ["ws", "default"]


def test_iso_timestamps_are_utc_with_milliseconds() -> None:
    assert iso_utc_ms(0.0) == "1970-01-01T00:00:00.000Z"
    assert iso_utc_ms(1738314902.999) == "2025-01-31T09:15:02.999Z"
    assert iso_utc_ms(1738314902.9996) == "2025-01-31T09:15:03.000Z"


def test_file_target_writes_bare_lines_and_follows_rotation(tmp_path: Path) -> None:
    path = tmp_path / "access.log"
    log = open_access_log(str(path))
    # The file gets the lines whatever the root logger's level.
    root = logging.getLogger()
    old_level = root.level
    root.setLevel(logging.ERROR)
    try:
        log.handle([("connect", 1, "before", None, 5, 0, "success")], None)
        os.rename(path, tmp_path / "access.log.1")  # what logrotate does
        log.handle([("disconnect", 1, "after", None, 5, 0, "normal")], None)
    finally:
        root.setLevel(old_level)
        log.close()
    rotated = (tmp_path / "access.log.1").read_text().splitlines()
    current = path.read_text().splitlines()
    assert [json.loads(line)["client_id"] for line in rotated] == ["before"]
    assert [json.loads(line)["client_id"] for line in current] == ["after"]
    # Closed: the logger is back to logging through the normal log.
    assert logging.getLogger("fastbroker.access").propagate


def test_unopenable_file_is_a_one_line_config_error(tmp_path: Path) -> None:
    target = tmp_path / "missing-dir" / "access.log"
    with pytest.raises(ConfigError, match=r"\[log\] access_log: cannot open .*no such file"):
        open_access_log(str(target))


def test_config_key(tmp_path: Path) -> None:
    assert load_config().log.access_log == "stderr"
    config = tmp_path / "c.toml"
    config.write_text('[log]\naccess_log = "/var/log/fastbroker/access.log"\n')
    assert load_config(config).log.access_log == "/var/log/fastbroker/access.log"
    config.write_text("[log]\naccess_log = 1\n")
    with pytest.raises(ConfigError, match=r"\[log\] access_log"):
        load_config(config)


# --------------------------------------------------------------------------- end to end


def engine_has_access_events() -> bool:
    import fastbroker_core

    return hasattr(fastbroker_core.Engine, "take_access_events")


def access_lines(broker: Any) -> list[dict[str, Any]]:
    """The access log lines in the broker's stderr ("... INFO fastbroker.access: {...}")."""
    marker = " fastbroker.access: "
    return [
        json.loads(line.split(marker, 1)[1])
        for line in broker.stderr_text(200_000).splitlines()
        if marker in line
    ]


def wait_for_lines(broker: Any, count: int, timeout: float = 5.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        lines = access_lines(broker)
        if len(lines) >= count or time.monotonic() > deadline:
            return lines
        time.sleep(0.05)


def raw_connect_311(client_id: bytes, keepalive: int, clean: bool) -> bytes:
    flags = 0x02 if clean else 0x00
    body = (
        b"\x00\x04MQTT\x04"
        + bytes([flags])
        + keepalive.to_bytes(2, "big")
        + len(client_id).to_bytes(2, "big")
        + client_id
    )
    return bytes([0x10, len(body)]) + body


@pytest.mark.timeout(30)
def test_real_broker_logs_connect_refusal_and_keepalive_timeout(make_broker) -> None:
    if not engine_has_access_events():
        pytest.skip("this fastbroker_core has no Engine.take_access_events yet")
    broker = make_broker("fastbroker")  # [log] access_log defaults to "stderr"

    client = Client(broker, client_id="paho-1", version=5)
    client.connect()
    local_port = client.paho.socket().getsockname()[1]
    time.sleep(0.2)
    client.disconnect()

    # 3.1.1, empty client id without a clean session: refused, CONNACK 2.
    with socket.create_connection(broker.address, timeout=2) as sock:
        sock.sendall(raw_connect_311(b"", 60, clean=False))
        assert sock.recv(4)[:4] == b"\x20\x02\x00\x02"

    # Keep-alive 1 s, then silence: the broker closes it after 1.5 s.
    with socket.create_connection(broker.address, timeout=5) as sock:
        sock.sendall(raw_connect_311(b"sleepy", 1, clean=True))
        assert sock.recv(4)[:4] == b"\x20\x02\x00\x00"
        assert sock.recv(16) == b""  # closed by the broker

    lines = wait_for_lines(broker, 5)
    by_client: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        assert list(line)[: len(KEYS)] == KEYS, line
        by_client.setdefault(line["client_id"], []).append(line)

    connect, disconnect = by_client["paho-1"]
    assert connect["event"] == "connect"
    assert connect["protocol"] == 5
    assert connect["reason_code"] == 0
    assert connect["peer"] == f"127.0.0.1:{local_port}"
    assert disconnect["event"] == "disconnect"
    assert 0.15 <= disconnect["duration_s"] < 5

    (refused,) = [line for line in lines if line["event"] == "refused"]
    assert refused["protocol"] == 4
    # The MQTT 5 code, whatever the client's version (a 3.1.1 client got return code 2).
    assert refused["reason_code"] == 0x85
    assert "client identifier" in refused["reason"]
    assert "duration_s" not in refused

    sleepy_connect, sleepy_gone = by_client["sleepy"]
    assert sleepy_connect["event"] == "connect"
    assert sleepy_gone["event"] == "disconnect"
    assert sleepy_gone["reason_code"] == 0x8D, sleepy_gone  # keep alive timeout
    assert 1.0 <= sleepy_gone["duration_s"] < 4
