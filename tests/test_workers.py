"""One node served by several worker processes ([node] workers, fastbroker.workers): real
supervisors with real workers on loopback, real clients. Which worker holds a connection is
read from /proc (the socket's inode among the worker's descriptors)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import rawmqtt
from brokers import REPO, WORKERS_ENV, BrokerProcess, free_port, start_fastbroker, stop_later

from fastbroker import workers
from fastbroker.config import ConfigError, load_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux /proc")


def start(tmp_path: Path, count: int = 2, **options) -> BrokerProcess:
    broker = start_fastbroker(tmp_path, workers=count, **options)
    wait_workers(broker, count)
    return broker


def worker_pids(broker: BrokerProcess) -> list[int]:
    try:
        with open(f"/proc/{broker.pid}/task/{broker.pid}/children") as file:
            return [int(pid) for pid in file.read().split()]
    except FileNotFoundError:
        return []


def wait_workers(broker: BrokerProcess, count: int, timeout: float = 10) -> list[int]:
    """The workers' pids once `count` of them serve (the supervisor logs it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pids = worker_pids(broker)
        if len(pids) == count and broker.stderr_text().count("workers serving") >= 1:
            return pids
        time.sleep(0.05)
    raise AssertionError(f"{count} workers not serving:\n{broker.stderr_text()}")


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def holder(broker: BrokerProcess, client: socket.socket, timeout: float = 5) -> int:
    """The pid of the worker that holds `client`'s connection (once one has accepted it)."""
    local_port = client.getsockname()[1]
    wanted = (f":{broker.port:04X}", f":{local_port:04X}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as file:
            rows = [line.split() for line in file.readlines()[1:]]
        inodes = {row[9] for row in rows if (row[1][-5:], row[2][-5:]) == wanted}
        for pid in worker_pids(broker):
            if inodes & socket_inodes(pid):
                return pid
        time.sleep(0.01)
    raise AssertionError(f"no worker holds the connection from port {local_port}")


def connect(broker: BrokerProcess, client_id: str, **options) -> tuple[socket.socket, bool]:
    """A connected client and its CONNACK's session present flag."""
    sock = socket.create_connection(broker.address, timeout=5)
    sock.sendall(rawmqtt.connect(client_id, **options))
    connack = rawmqtt.parse_connack(rawmqtt.read_packet(sock, 5))
    assert connack.reason == 0, connack
    return sock, connack.session_present


def reconnect(broker: BrokerProcess, client_id: str, **options) -> tuple[socket.socket, bool]:
    """As a client does after its broker went away: tries again while the broker answers
    0x03 (server unavailable)."""
    deadline = time.monotonic() + 15
    while True:
        sock = socket.create_connection(broker.address, timeout=5)
        sock.sendall(rawmqtt.connect(client_id, **options))
        connack = rawmqtt.parse_connack(rawmqtt.read_packet(sock, 5))
        if connack.reason == 0:
            return sock, connack.session_present
        sock.close()
        assert connack.reason == 3 and time.monotonic() < deadline, connack
        time.sleep(0.2)


def connect_on(broker: BrokerProcess, client_id: str, pid: int, **options) -> socket.socket:
    """A client whose connection lands on worker `pid` (the kernel picks the worker by the
    connection's ports: tried again with new ones until it does)."""
    for _ in range(200):
        probe = socket.create_connection(broker.address, timeout=5)
        if holder(broker, probe) != pid:
            probe.close()
            continue
        probe.sendall(rawmqtt.connect(client_id, **options))
        connack = rawmqtt.parse_connack(rawmqtt.read_packet(probe, 5))
        assert connack.reason == 0, connack
        return probe
    raise AssertionError(f"no connection landed on worker {pid}")


def leave_subscribed(broker: BrokerProcess, client_id: str, pid: int, topic: str) -> None:
    """A persistent session on worker `pid`, subscribed to `topic` (QoS 1), left offline."""
    sub = connect_on(broker, client_id, pid, clean=False)
    sub.sendall(rawmqtt.subscribe(1, [(topic, 1)]))
    assert rawmqtt.read_packet(sub, 5).name == "SUBACK"
    sub.sendall(rawmqtt.disconnect())
    sub.close()


def read_publishes(sock: socket.socket, count: int, timeout: float = 10) -> list[bytes]:
    """`count` PUBLISH payloads, each QoS 1 one acknowledged."""
    payloads = []
    deadline = time.monotonic() + timeout
    while len(payloads) < count:
        packet = rawmqtt.read_packet(sock, max(0.1, deadline - time.monotonic()))
        assert packet.name == "PUBLISH", packet
        publish = rawmqtt.parse_publish(packet)
        if publish.packet_id:
            sock.sendall(rawmqtt.puback(publish.packet_id))
        payloads.append(publish.payload)
    return payloads


@pytest.mark.timeout(60)
def test_connections_spread_over_the_workers_and_publishes_reach_every_one(tmp_path):
    broker = start(tmp_path)
    try:
        pids = worker_pids(broker)
        subs = [connect(broker, f"sub{i}")[0] for i in range(16)]
        for sub in subs:
            sub.sendall(rawmqtt.subscribe(1, [("t/#", 1)]))
            assert rawmqtt.read_packet(sub, 5).name == "SUBACK"
        held = [holder(broker, sub) for sub in subs]
        # 16 connections all on one of two workers: 1 in 32,768 with the kernel's hash.
        assert set(held) == set(pids), held
        # A publisher on each worker: every subscriber gets both, in each one's order.
        publishers = [connect_on(broker, f"pub{i}", pid) for i, pid in enumerate(pids)]
        for i, pub in enumerate(publishers):
            for n in range(50):
                pub.sendall(rawmqtt.publish(f"t/{i}", b"%d-%d" % (i, n), qos=1, packet_id=n + 1))
            assert {rawmqtt.read_packet(pub, 5).name for _ in range(50)} == {"PUBACK"}
        for sub in subs:
            got = read_publishes(sub, 100)
            for i in range(2):
                assert [p for p in got if p.startswith(b"%d-" % i)] == [
                    b"%d-%d" % (i, n) for n in range(50)
                ]
        # A retained message set on one worker is answered by the other.
        publishers[0].sendall(rawmqtt.publish("r/x", b"kept", retain=True))
        time.sleep(0.3)
        late = connect_on(broker, "late", pids[1])
        late.sendall(rawmqtt.subscribe(1, [("r/#", 0)]))
        assert rawmqtt.read_packet(late, 5).name == "SUBACK"
        assert rawmqtt.parse_publish(rawmqtt.read_packet(late, 5)).payload == b"kept"
    finally:
        stop_later(broker)


@pytest.mark.timeout(60)
def test_a_persistent_session_resumes_on_the_other_worker(tmp_path):
    broker = start(tmp_path)
    try:
        first, second = worker_pids(broker)
        options = {"clean": False}
        leave_subscribed(broker, "device", first, "cmd/#")
        pub = connect_on(broker, "pub", second)
        for n in range(100):
            pub.sendall(rawmqtt.publish("cmd/x", b"%d" % n, qos=1, packet_id=n + 1))
        assert {rawmqtt.read_packet(pub, 5).name for _ in range(100)} == {"PUBACK"}
        back = connect_on(broker, "device", second, **options)
        assert read_publishes(back, 100) == [b"%d" % n for n in range(100)]
        back.sendall(rawmqtt.disconnect())
        back.close()
        # And back again: the subscription moved with the session.
        again = connect_on(broker, "device", first, **options)
        pub.sendall(rawmqtt.publish("cmd/y", b"later", qos=1, packet_id=200))
        assert rawmqtt.read_packet(pub, 5).name == "PUBACK"
        assert read_publishes(again, 1) == [b"later"]
    finally:
        stop_later(broker)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("killed", ["session's worker", "publisher's worker"])
def test_a_killed_worker_is_restarted_and_nothing_acknowledged_is_lost(tmp_path, killed):
    broker = start(tmp_path)
    try:
        first, second = worker_pids(broker)
        victim = first if killed == "session's worker" else second
        options = {"clean": False}
        leave_subscribed(broker, "keeper", first, "s/#")
        pub = connect_on(broker, "pub", second)
        acked: set[int] = set()
        sent = 0
        # QoS 1 publishes from one worker to a session on the other, one of them killed
        # midway (fewer than the session queue's limit, 1000).
        deadline = time.monotonic() + 20
        try:
            while time.monotonic() < deadline and sent < 900:
                pub.sendall(rawmqtt.publish("s/x", b"%d" % sent, qos=1, packet_id=sent + 1))
                sent += 1
                if sent == 300:
                    os.kill(victim, signal.SIGKILL)
                if sent % 50 == 0:
                    time.sleep(0.01)
        except OSError:
            pass  # the publisher's connection died with its worker
        while len(acked) < sent:
            try:
                packet = rawmqtt.read_packet(pub, 5)
            except (TimeoutError, ConnectionError):
                break
            if packet.name == "PUBACK":
                acked.add(int.from_bytes(packet.body[:2], "big") - 1)
        if victim == first:
            # The survivor kept acknowledging while the session's worker was down (kept for
            # it on the survivor's disk).
            assert len(acked) > 600, len(acked)
        else:
            assert len(acked) >= 100, len(acked)
        pids = wait_workers(broker, 2)
        assert victim not in pids
        assert "ended (signal 9): restarting it" in broker.stderr_text()
        back, present = reconnect(broker, "keeper", **options)
        assert present
        got = set()
        while True:
            try:
                packet = rawmqtt.read_packet(back, 3)
            except TimeoutError:
                break
            publish = rawmqtt.parse_publish(packet)
            back.sendall(rawmqtt.puback(publish.packet_id))
            got.add(int(publish.payload))
        missing = sorted(acked - got)
        assert not missing, f"{len(missing)} acknowledged messages lost: {missing[:20]}"
    finally:
        stop_later(broker)


@pytest.mark.timeout(90)
def test_the_node_restarted_whole_keeps_every_workers_sessions_and_queues(tmp_path):
    broker = start(tmp_path)
    try:
        pids = worker_pids(broker)
        # A persistent session on each worker, offline, with messages queued from both.
        for i, pid in enumerate(pids):
            leave_subscribed(broker, f"dev{i}", pid, f"to/{i}")
        publishers = [connect_on(broker, f"pub{i}", pid) for i, pid in enumerate(pids)]
        for n in range(200):
            pub = publishers[n % 2]
            pub.sendall(rawmqtt.publish(f"to/{n % 4 // 2}", b"%d" % n, qos=1, packet_id=n + 1))
        for pub in publishers:
            assert {rawmqtt.read_packet(pub, 5).name for _ in range(100)} == {"PUBACK"}
            pub.close()
    finally:
        assert broker.stop(timeout=20) == 0, broker.stderr_text()
    # The same port, so the same working and data directory (brokers.start_fastbroker),
    # started again: each session resumes wherever it lands.
    again = start_fastbroker(tmp_path, port=broker.port, workers=2)
    try:
        assert again.workdir == broker.workdir
        for i in range(2):
            sock, present = reconnect(again, f"dev{i}", clean=False)
            assert present
            got = [int(p) for p in read_publishes(sock, 100)]
            assert sorted(got) == [n for n in range(200) if n % 4 // 2 == i]
            # In order per publisher (the two publishers' messages interleave).
            for parity in (0, 1):
                mine = [n for n in got if n % 2 == parity]
                assert mine == sorted(mine)
    finally:
        stop_later(again)


@pytest.mark.timeout(60)
def test_sigterm_and_sighup_reach_every_worker_and_none_outlives_its_supervisor(tmp_path):
    broker = start(tmp_path)
    pids = worker_pids(broker)
    os.kill(broker.pid, signal.SIGHUP)
    deadline = time.monotonic() + 5
    while broker.stderr_text().count("SIGHUP: reloading files") < 2:
        assert time.monotonic() < deadline, broker.stderr_text()
        time.sleep(0.05)
    assert broker.stop(timeout=15) == 0
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}"), "a worker outlived a SIGTERM"
    # A supervisor killed outright takes its workers with it.
    broker = start(tmp_path)
    pids = worker_pids(broker)
    broker.proc.kill()
    broker.proc.wait()
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{pid}") and not zombie(pid) for pid in pids):
        assert time.monotonic() < deadline, "a worker outlived its supervisor"
        time.sleep(0.05)


@pytest.mark.timeout(60)
def test_a_worker_that_keeps_dying_stops_the_node_instead_of_looping(tmp_path):
    broker = start(tmp_path)
    try:
        spared = worker_pids(broker)[0]
        killed: set[int] = set()
        deadline = time.monotonic() + 30
        # The other worker, killed as soon as it is (re)started.
        while broker.alive() and time.monotonic() < deadline:
            for pid in set(worker_pids(broker)) - killed - {spared}:
                killed.add(pid)
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.02)
        assert broker.proc.wait(10) == 1
        assert len(killed) == workers.CRASH_LOOP_LIMIT
        assert "times within 10 s of its start: stopping" in broker.stderr_text()
    finally:
        stop_later(broker)


def zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


STORM = 15_000


@pytest.mark.timeout(120)
def test_a_connect_storm_of_15000_clients_is_served_by_both_workers(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < STORM + 1000:
        pytest.skip(f"open-file limit {hard} is below {STORM + 1000}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    broker = start(tmp_path)
    try:
        pids = worker_pids(broker)

        async def storm() -> list[asyncio.StreamWriter]:
            gate = asyncio.Semaphore(512)
            writers = []

            async def one(i: int) -> None:
                async with gate:
                    reader, writer = await asyncio.open_connection(*broker.address)
                    writer.write(rawmqtt.connect(f"storm{i}", keepalive=0))
                    header = await asyncio.wait_for(reader.readexactly(4), 30)
                    assert header[0] == 0x20 and header[3] == 0, header
                    writers.append(writer)

            await asyncio.gather(*(one(i) for i in range(STORM)))
            return writers

        loop = asyncio.new_event_loop()
        try:
            writers = loop.run_until_complete(storm())
            counts = {pid: len(socket_inodes(pid)) for pid in pids}
            # Each worker holds a share (its own sockets besides: listeners, links, store).
            assert all(count > STORM // 4 for count in counts.values()), counts
            for writer in writers:
                writer.transport.abort()
            loop.run_until_complete(asyncio.sleep(0))
        finally:
            loop.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        stop_later(broker)


# The end-to-end checks run again with two workers: connect, QoS, retained messages, wills,
# shared subscriptions, TLS and WebSocket.
E2E_ON_WORKERS = (
    "tests/test_e2e_connect.py",
    "tests/test_e2e_qos.py",
    "tests/test_e2e_retained.py",
    "tests/test_e2e_will.py",
    "tests/test_listeners.py",
    "tests/test_websocket.py",
    "tests/test_e2e_subscribe.py::test_shared_subscription_distributes_messages",
    "tests/test_e2e_subscribe.py::test_invalid_shared_subscription",
)


@pytest.mark.timeout(600)
def test_end_to_end_suites_pass_on_two_workers(tmp_path):
    env = {**os.environ, WORKERS_ENV: "2"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *E2E_ON_WORKERS,
            "--broker=fastbroker",
            "-q",
            "-p",
            "no:cacheprovider",
            "--timeout=60",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=580,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_workers_config(tmp_path, monkeypatch):
    assert load_config(overrides={"node": {"workers": "2"}}).node.workers == 2
    assert load_config(overrides={"node": {"workers": "auto"}}).node.workers == "auto"
    with pytest.raises(ConfigError, match="workers"):
        load_config(overrides={"node": {"workers": 0}})
    with pytest.raises(ConfigError, match="not supported yet on a cluster node"):
        load_config(overrides={"node": {"workers": 2}, "cluster": {"node_id": "n1"}})
    # auto: the affinity mask, capped by the cgroup's quota (rounded up).
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    # cgroup v2: the tightest cpu.max on the process's path up to the root.
    own = tmp_path / "cgroup"
    own.write_text("0::/system.slice/fastbroker.service\n")
    service = tmp_path / "v2" / "system.slice" / "fastbroker.service"
    service.mkdir(parents=True)
    (tmp_path / "v2" / "cpu.max").write_text("max 100000\n")
    assert workers.cgroup_cpu_quota(str(tmp_path / "v2"), str(own)) is None
    (service / "cpu.max").write_text("150000 100000\n")
    assert workers.cgroup_cpu_quota(str(tmp_path / "v2"), str(own)) == 1.5
    (service.parent / "cpu.max").write_text("100000 100000\n")
    assert workers.cgroup_cpu_quota(str(tmp_path / "v2"), str(own)) == 1.0
    # cgroup v1: the cpu controller's quota and period.
    own.write_text("3:cpu,cpuacct:/docker/abc\n")
    container = tmp_path / "v1" / "cpu,cpuacct" / "docker" / "abc"
    container.mkdir(parents=True)
    (container / "cpu.cfs_quota_us").write_text("250000\n")
    (container / "cpu.cfs_period_us").write_text("100000\n")
    assert workers.cgroup_cpu_quota(str(tmp_path / "v1"), str(own)) == 2.5
    (container / "cpu.cfs_quota_us").write_text("-1\n")
    assert workers.cgroup_cpu_quota(str(tmp_path / "v1"), str(own)) is None
    monkeypatch.setattr(workers, "cgroup_cpu_quota", lambda: 1.5)
    assert workers.usable_cores() == 2
    monkeypatch.setattr(workers, "cgroup_cpu_quota", lambda: None)
    assert workers.usable_cores() == 4


def test_the_data_directory_keeps_its_workers_link_ports(tmp_path):
    ports = workers.link_ports(tmp_path, 2)
    assert workers.link_ports(tmp_path, 2) == ports
    assert workers.link_ports(tmp_path, 3)[:2] == ports
    with pytest.raises(ConfigError, match="holds the data of 3 workers"):
        workers.link_ports(tmp_path, 2)


def test_each_worker_gets_its_part_of_the_node_and_its_own_directory(tmp_path):
    config = load_config(
        overrides={
            "node": {"workers": 3},
            "storage": {"data_dir": str(tmp_path)},
            "limits": {
                "max_connections": 1000,
                "max_connection_rate": 300,
                "memory_high_water_mb": 3000,
            },
            "admin": {"enabled": True},
        }
    )
    ports = [7001, 7002, 7003]
    first, second = (workers.worker_config(config, i, ports, "s") for i in range(2))
    assert (first.limits.max_connections, first.limits.max_connection_rate) == (334, 100)
    assert first.limits.memory_high_water_mb == 1000
    assert first.admin.enabled and not second.admin.enabled
    assert second.storage.data_dir == str(tmp_path / "workers" / "w2")
    assert second.cluster.join == ("127.0.0.1:7001", "127.0.0.1:7003")
    assert second.cluster.replication_factor == 1 and not second.cluster.link_compression


@pytest.mark.timeout(60)
def test_the_admin_endpoint_shows_the_node_with_a_line_per_worker(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    admin = free_port()
    broker = start(tmp_path, extra_toml=f"[admin]\nenabled = true\nport = {admin}")
    try:
        pids = worker_pids(broker)
        clients = [connect_on(broker, f"c{i}", pid) for i, pid in enumerate(pids * 2)]
        url = f"http://127.0.0.1:{admin}"
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
            text = response.read().decode()
        families = {f.name: f for f in text_string_to_metric_families(text)}
        connected = families["fastbroker_clients_connected"].samples
        assert sorted(s.labels["worker"] for s in connected) == ["w1", "w2"]
        assert sum(s.value for s in connected) == len(clients)
        with urllib.request.urlopen(f"{url}/cluster/status", timeout=5) as response:
            status = json.load(response)
        assert sorted(m["node_id"] for m in status["members"]) == ["w1", "w2"]
        # A worker never leaves its node's workers.
        leave = urllib.request.Request(
            f"{url}/cluster/leave", method="POST", data=b"", headers={"X-Fastbroker-Admin": "1"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(leave, timeout=5)
        assert refused.value.code == 409
        assert "stop the node" in json.load(refused.value)["reason"]
    finally:
        stop_later(broker)


@pytest.mark.timeout(60)
def test_sys_topics_on_every_worker_count_the_node_s_clients(tmp_path):
    broker = start(tmp_path, sys_interval=0.2)
    try:
        pids = worker_pids(broker)
        watchers = [connect_on(broker, f"sys{i}", pid) for i, pid in enumerate(pids)]
        others = [connect_on(broker, f"c{i}", pid) for i, pid in enumerate(pids * 2)]
        for watcher in watchers:
            watcher.sendall(rawmqtt.subscribe(1, [("$SYS/broker/clients/connected", 0)]))
            assert rawmqtt.read_packet(watcher, 5).name == "SUBACK"
        for watcher in watchers:
            deadline = time.monotonic() + 10
            seen = b""
            while seen != b"%d" % (len(watchers) + len(others)):
                assert time.monotonic() < deadline, seen
                seen = rawmqtt.parse_publish(rawmqtt.read_packet(watcher, 5)).payload
    finally:
        stop_later(broker)


def test_merged_metrics_keep_each_family_in_one_piece():
    head = b"# HELP a_total A\n# TYPE a_total counter\n"
    first = head + b'a_total 1.0\n# HELP b B\n# TYPE b gauge\nb{x="1"} 2.0\n'
    second = head + b"a_total 3.0\n# HELP b B\n# TYPE b gauge\nb{} 4.0\n"
    merged = workers.merge_metrics([("w1", first), ("w2", second)]).decode().splitlines()
    assert merged == [
        "# HELP a_total A",
        "# TYPE a_total counter",
        'a_total{worker="w1"} 1.0',
        'a_total{worker="w2"} 3.0',
        "# HELP b B",
        "# TYPE b gauge",
        'b{worker="w1",x="1"} 2.0',
        'b{worker="w2"} 4.0',
    ]
