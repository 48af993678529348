"""Durable state end to end: a real fastbroker process on a real data directory, restarted
(cleanly and with SIGKILL), refusing damaged or busy directories, and riding out a full disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from brokers import HOST, free_port
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from syscalls import STRACE, calls, needs_strace
from tmpfs import mounted_tmpfs

READY_TIMEOUT = 15.0


class Broker:
    """One fastbroker process on a given data directory."""

    def __init__(
        self,
        data_dir: Path,
        port: int,
        fsync: str = "interval",
        workdir: Path | None = None,
        wrapper: tuple[str, ...] = (),
    ) -> None:
        self.port = port
        # A command the broker runs under (strace): self.proc is then the wrapper's process.
        self.wrapper = wrapper
        workdir = workdir or data_dir.parent
        self.config = workdir / f"fastbroker-{port}.toml"
        self.config.write_text(
            "[storage]\n"
            f"data_dir = {json.dumps(str(data_dir))}\n"
            f'fsync = "{fsync}"\n'
            "[sys]\ninterval = 0\n"
        )
        self.log = workdir / f"fastbroker-{port}-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, expect_ready: bool = True) -> Broker:
        self.stderr = open(self.log, "wb")
        self.proc = subprocess.Popen(
            [
                *self.wrapper,
                *(sys.executable, "-m", "fastbroker", "run", "--config", str(self.config)),
                *("--host", HOST, "--port", str(self.port)),
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
        )
        if expect_ready:
            deadline = time.monotonic() + READY_TIMEOUT
            while "listening on" not in self.text():
                assert self.proc.poll() is None, f"broker exited: {self.text()}"
                assert time.monotonic() < deadline, f"broker not ready: {self.text()}"
                time.sleep(0.02)
        return self

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_exit(self, timeout: float = 10.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.stderr.close()


@pytest.fixture
def brokers() -> Iterator[list[Broker]]:
    started: list[Broker] = []
    yield started
    for b in started:
        b.stop(signal.SIGKILL)


def client(client_id: str, port: int, version: int, clean: bool, on_message=None) -> mqtt.Client:
    protocol = mqtt.MQTTv5 if version == 5 else mqtt.MQTTv311
    c = mqtt.Client(
        CallbackAPIVersion.VERSION2,
        client_id=client_id,
        protocol=protocol,
        **({} if version == 5 else {"clean_session": clean}),
    )
    if on_message is not None:
        c.on_message = on_message
    kwargs: dict = {}
    if version == 5:
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = 0 if clean else 3600
        kwargs = {"clean_start": clean, "properties": props}
    connected = threading.Event()
    c.on_connect = lambda *a: connected.set()
    c.connect(HOST, port, keepalive=30, **kwargs)
    c.loop_start()
    assert connected.wait(10), "no CONNACK"
    return c


def close(c: mqtt.Client) -> None:
    c.disconnect()
    c.loop_stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
@pytest.mark.parametrize("version", [4, 5], ids=["v311", "v5"])
def test_sessions_messages_and_retained_survive_a_restart(tmp_path, brokers, stop, version):
    data = tmp_path / "data"
    port = free_port()
    b = Broker(data, port).start()
    brokers.append(b)
    sub = client("keeper", port, version, clean=False)
    sub.subscribe([("q1/#", 1), ("q2/#", 2)])
    time.sleep(0.3)
    close(sub)
    pub = client("writer", port, version, clean=True)
    for i in range(50):
        pub.publish("q1/a", f"one-{i}", qos=1).wait_for_publish(5)
        pub.publish("q2/a", f"two-{i}", qos=2).wait_for_publish(5)
    pub.publish("state/lamp", "on", qos=1, retain=True).wait_for_publish(5)
    close(pub)
    b.stop(signal.SIGTERM if stop == "sigterm" else signal.SIGKILL)

    b2 = Broker(data, port).start()
    brokers.append(b2)
    assert "restored 1 sessions, 100 queued" in b2.text(), b2.text()
    got: list[tuple[str, str, int]] = []
    lock = threading.Lock()

    def on_message(c, userdata, m):
        with lock:
            got.append((m.topic, m.payload.decode(), m.qos))

    sub = client("keeper", port, version, clean=False, on_message=on_message)
    deadline = time.monotonic() + 10
    while len(got) < 100 and time.monotonic() < deadline:
        time.sleep(0.05)
    sub.subscribe("state/#", 1)
    time.sleep(0.5)
    close(sub)
    ones = [p for t, p, _ in got if t == "q1/a"]
    twos = [p for t, p, _ in got if t == "q2/a"]
    assert ones == [f"one-{i}" for i in range(50)]
    # QoS 2: exactly once, in order.
    assert twos == [f"two-{i}" for i in range(50)]
    assert ("state/lamp", "on", 1) in got


# Timers an idle broker runs: the engine tick (10/s) and, far below the memory mark, its
# check (1/s), two epoll calls per wake-up. The group-commit timer used to run at
# 1/fsync_interval (100/s) even idle.
IDLE_EPOLL_CALLS_PER_S = 100


@needs_strace
@pytest.mark.timeout(60)
def test_group_commit_syncs_what_was_written_and_sleeps_when_idle(tmp_path, brokers):
    """fsync = "interval": a write is synced within the interval, and with nothing written the
    broker neither syncs nor wakes for it (an idle broker costs no CPU to speak of)."""
    trace = tmp_path / "strace.txt"
    wrapper = (STRACE or "strace", "-f", "-qq", "-ttt", "-o", str(trace))
    wrapper += ("-e", "trace=epoll_wait,epoll_pwait,fsync,fdatasync")
    b = Broker(tmp_path / "data", free_port(), wrapper=wrapper).start()
    brokers.append(b)
    assert b.proc is not None
    # The broker is strace's child; killing strace alone would leave it running.
    broker_pid = int(Path(f"/proc/{b.proc.pid}/task/{b.proc.pid}/children").read_text().split()[0])
    try:
        time.sleep(1.0)  # past startup's own syncs
        idle_from = time.time()
        time.sleep(2.0)
        idle_to = time.time()
        sub = client("durable", b.port, 4, clean=False)
        sub.subscribe("d/#", 1)  # a persistent session's subscription is stored
        time.sleep(0.5)
        written_to = time.time()
        close(sub)
        # Stopped through the broker itself: strace then writes its last lines and exits.
        os.kill(broker_pid, signal.SIGTERM)
        assert b.wait_exit(20) == 0
    finally:
        # strace lives as long as the broker does: while it runs, that PID is still ours.
        if b.proc.poll() is None:
            os.kill(broker_pid, signal.SIGKILL)

    traced = calls(trace)
    idle = [name for t, name in traced if idle_from <= t < idle_to]
    written = [name for t, name in traced if idle_to <= t < written_to]
    idle_epolls = sum(name.startswith("epoll") for name in idle)
    assert idle_epolls < IDLE_EPOLL_CALLS_PER_S * (idle_to - idle_from), idle_epolls
    assert not [name for name in idle if name in ("fsync", "fdatasync")]
    assert [name for name in written if name in ("fsync", "fdatasync")], written[-20:]


def tree_digest(path: Path) -> dict[str, str]:
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def prepare_store(tmp_path: Path, brokers: list[Broker]) -> tuple[Path, int]:
    data = tmp_path / "data"
    port = free_port()
    b = Broker(data, port).start()
    brokers.append(b)
    pub = client("w", port, 4, clean=True)
    pub.publish("r/x", "kept", qos=1, retain=True).wait_for_publish(5)
    close(pub)
    b.stop()
    return data, port


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["newer-format", "garbage-current", "no-marker"])
def test_a_damaged_data_dir_is_refused_and_left_untouched(tmp_path, brokers, damage):
    data, port = prepare_store(tmp_path, brokers)
    if damage == "newer-format":
        marker = json.loads((data / "FORMAT").read_text())
        marker["version"] = 99
        (data / "FORMAT").write_text(json.dumps(marker))
    elif damage == "garbage-current":
        (data / "store" / "CURRENT").write_bytes(b"\x00garbage")
    else:
        (data / "FORMAT").unlink()
    before = tree_digest(data)
    b = Broker(data, port)
    brokers.append(b)
    b.start(expect_ready=False)
    assert b.wait_exit() == 1
    lines = [line for line in b.text().splitlines() if line.startswith("fastbroker:")]
    assert len(lines) == 1 and str(data) in lines[0], b.text()
    assert tree_digest(data) == before


@pytest.mark.timeout(60)
def test_a_data_dir_in_use_by_another_broker_is_refused(tmp_path, brokers):
    data = tmp_path / "data"
    first = Broker(data, free_port()).start()
    brokers.append(first)
    second = Broker(data, free_port())
    brokers.append(second)
    second.start(expect_ready=False)
    assert second.wait_exit() == 1
    assert "in use" in second.text(), second.text()
    # The first one is unharmed.
    c = client("probe", first.port, 4, clean=True)
    close(c)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs."""
    with mounted_tmpfs(tmp_path, "24m") as mount_point:
        yield mount_point


@pytest.mark.timeout(120)
def test_disk_full_disconnects_publishers_and_recovers_without_losing_acked(
    tmp_path, brokers, small_fs
):
    data = small_fs / "data"
    port = free_port()
    b = Broker(data, port, workdir=tmp_path).start()
    brokers.append(b)
    sub = client("slowpoke", port, 4, clean=False)
    sub.subscribe("fill/#", 1)
    time.sleep(0.3)
    close(sub)
    # Leave a little room, then publish 32 KiB QoS 1 messages until the store fails.
    filler = small_fs / "filler"
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    filler.write_bytes(b"\0" * max(0, free - 6 * 1024 * 1024))
    acked: list[int] = []
    disconnected = threading.Event()
    pub = mqtt.Client(CallbackAPIVersion.VERSION2, client_id="filler", clean_session=True)
    pub.on_disconnect = lambda *a: disconnected.set()
    pub.connect(HOST, port)
    pub.loop_start()
    # Incompressible, and large enough that the queue limit (1000 messages) is not reached first.
    payload = os.urandom(32 * 1024)
    i = 0
    started = time.monotonic()
    deadline = started + 60
    while not disconnected.is_set() and time.monotonic() < deadline:
        info = pub.publish("fill/x", i.to_bytes(4, "big") + payload, qos=1)
        try:
            info.wait_for_publish(2)
        except (RuntimeError, ValueError):
            break
        if not info.is_published():
            # Not acknowledged: the store failed under it (the broker dropped the connection).
            break
        acked.append(i)
        i += 1
    assert disconnected.wait(10), "the publisher of the failed batch was not disconnected"
    # paho reconnects by itself; the broker reads nothing while its store fails, so stop it.
    pub.disconnect()
    pub.loop_stop()
    print(f"\npublishing stopped after {time.monotonic() - started:.1f} s")
    assert disconnected.is_set() or "no space left on device" in b.text(), b.text()
    assert "no space left on device" in b.text()
    assert b.proc is not None and b.proc.poll() is None, "the broker died"
    # Space returns: the broker stores the held batch and goes on by itself.
    filler.unlink()
    deadline = time.monotonic() + 15
    while "writable again" not in b.text():
        assert time.monotonic() < deadline, b.text()
        time.sleep(0.1)
    got: list[int] = []
    sub = client(
        "slowpoke",
        port,
        4,
        clean=False,
        on_message=lambda c, u, m: got.append(int.from_bytes(m.payload[:4], "big")),
    )
    deadline = time.monotonic() + 15
    while not set(acked) <= set(got) and time.monotonic() < deadline:
        time.sleep(0.05)
    close(sub)
    assert acked, "nothing was acknowledged before the disk filled"
    assert set(acked) <= set(got), f"lost: {sorted(set(acked) - set(got))[:10]}"
    print(f"\nacknowledged {len(acked)} before the disk filled; all delivered after recovery")
