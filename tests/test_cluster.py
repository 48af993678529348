"""Clusters of real fastbroker processes on loopback: forming through static seeds, joining and
leaving at runtime, SIGKILL and convergence, a split into minority and majority, the admin
endpoint and `fastbroker cluster status`, and hostile traffic on the cluster port.

Timings use tests/clusters.py's FAST settings (failure timeout 2 s); the bounds below are that
plus generous slack for a loaded 2-core CI machine.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import threading
import time

import paho.mqtt.client as mqtt
import pytest
from clusters import ADMIN_PORT, Cluster, Node, wait_for

pytestmark = pytest.mark.timeout(240)

JOIN_BOUND_S = 20
FAILURE_BOUND_S = 25


def mqtt_roundtrip(node: Node, topic: str, timeout: float = 5.0) -> bool:
    """A client on `node` gets its own QoS 1 publish back: the node serves clients."""
    received: list[bytes] = []
    subscribed = threading.Event()
    client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"probe-{topic}")
    client.on_message = lambda c, u, m: received.append(m.payload)
    client.on_subscribe = lambda *args: subscribed.set()
    client.connect(node.ip, node.mqtt_port, keepalive=10)
    client.loop_start()
    try:
        result, _ = client.subscribe(topic, qos=1)
        assert result == mqtt.MQTT_ERR_SUCCESS
        assert subscribed.wait(timeout)
        client.publish(topic, b"ping", qos=1).wait_for_publish(timeout)
        deadline = time.monotonic() + timeout
        while not received and time.monotonic() < deadline:
            time.sleep(0.02)
        return received == [b"ping"]
    finally:
        client.loop_stop()
        client.disconnect()


def members_of(status: dict) -> list[str]:
    return sorted(m["node_id"] for m in status["members"])


def check_map(status: dict) -> None:
    """The map a node reports is complete and balanced."""
    members = status["members"]
    partitions = status["partitions"]
    replication = min(status["replication_factor"], len(members))
    primaries = sorted(p for m in members for p in m["primary"])
    assert primaries == list(range(partitions))
    copies = sum(len(m["primary"]) + len(m["follower"]) for m in members)
    assert copies == partitions * replication
    ceiling = math.ceil(partitions / len(members))
    for m in members:
        assert len(m["primary"]) <= ceiling + 2, (m["node_id"], len(m["primary"]), ceiling)


def replicas(status: dict) -> dict[int, tuple[str, list[str]]]:
    """partition -> (primary, followers) from a node's status."""
    primary = {p: m["node_id"] for m in status["members"] for p in m["primary"]}
    followers: dict[int, list[str]] = {}
    for m in status["members"]:
        for p in m["follower"]:
            followers.setdefault(p, []).append(m["node_id"])
    return {p: (primary[p], followers.get(p, [])) for p in primary}


def form(cluster: Cluster, count: int, **extra) -> float:
    """n1 founds, n2..n{count} join through n1 as seed; seconds until the map converged."""
    started = time.monotonic()
    cluster.start(1, **extra)
    for i in range(2, count + 1):
        cluster.start(i, join=cluster.seeds(1), **extra)
    cluster.wait_converged([f"n{i}" for i in range(1, count + 1)], JOIN_BOUND_S)
    return time.monotonic() - started


def test_three_nodes_static_seeds_and_status_command(tmp_path):
    with Cluster(tmp_path) as cluster:
        form(cluster, 3)

        def all_alive() -> bool:
            statuses = [n.status() or {"members": []} for n in cluster.running()]
            return all(
                len(s["members"]) == 3
                and all(m["state"] in ("self", "alive") for m in s["members"])
                for s in statuses
            )

        # Links between joiners come up just after the map converges.
        wait_for(all_alive, 10, "every member to see every other alive", *cluster.running())
        statuses = [n.status() for n in cluster.running()]
        assert len({s["cluster_id"] for s in statuses}) == 1
        assert len({s["map_version"] for s in statuses}) == 1
        assert len({s["leader"] for s in statuses}) == 1
        for status in statuses:
            assert members_of(status) == ["n1", "n2", "n3"]
            check_map(status)
        # Every node serves MQTT clients.
        for node in cluster.running():
            assert mqtt_roundtrip(node, f"t/{node.node_id}")

        # The CLI, asked through any node, shows the same map.
        n2 = cluster.node(2)
        out = subprocess.run(
            [sys.executable, "-m", "fastbroker", "cluster", "status", "--admin", n2.admin],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        text = out.stdout
        assert f"map version {statuses[0]['map_version']}" in text
        assert "256 partitions, replication factor 2" in text
        for node_id in ("n1", "n2", "n3"):
            line = next(line for line in text.splitlines() if line.startswith(node_id + " "))
            assert "alive" in line or "self" in line
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "fastbroker",
                "cluster",
                "status",
                "--admin",
                n2.admin,
                "--partitions",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0 and "primary " in out.stdout


def test_five_nodes_join_leave_crash_and_rejoin(tmp_path):
    with Cluster(tmp_path) as cluster:
        form(cluster, 5)
        everyone = ["n1", "n2", "n3", "n4", "n5"]

        # Join at runtime.
        cluster.start(6, join=cluster.seeds(3))
        join_s = cluster.wait_converged([*everyone, "n6"], JOIN_BOUND_S)

        # Leave at runtime: the node asks to be removed, then stops by itself.
        n6 = cluster.node(6)
        started = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-m", "fastbroker", "cluster", "leave", "--admin", n6.admin],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr + n6.log()[-3000:]
        assert n6.proc is not None and n6.proc.wait(15) == 0
        cluster.wait_converged(everyone, JOIN_BOUND_S)
        leave_s = time.monotonic() - started

        # SIGKILL a follower, then the leader: each is removed, the rest converge.
        leader = cluster.node(1).status()["leader"]
        follower = next(n for n in everyone if n != leader)
        for victim in (follower, leader):
            survivor = cluster.nodes[next(n for n in everyone if n != victim)]
            before = replicas(survivor.status())
            cluster.nodes[victim].kill()
            everyone.remove(victim)
            started = time.monotonic()
            cluster.wait_converged(everyone, FAILURE_BOUND_S)
            crash_s = time.monotonic() - started
            assert crash_s >= 1.5, "removed before the failure timeout"
            # The victim's partitions were taken over by their followers (which hold the data).
            after = replicas(survivor.status())
            led = [p for p, (primary, _) in before.items() if primary == victim]
            assert led
            for p in led:
                assert after[p][0] in before[p][1], (p, before[p], after[p])
        for node in cluster.running():
            check_map(node.status())

        # A killed node restarted with its data directory comes back into the map.
        back = int(follower[1:])
        cluster.start(back, join=cluster.seeds(1, 2, 3, 4, 5))
        cluster.wait_converged([*everyone, follower], JOIN_BOUND_S)
        print(f"\nconverged: join {join_s:.2f} s, leave {leave_s:.2f} s, crash {crash_s:.2f} s")


def test_split_minority_keeps_map_and_serves_then_heals(tmp_path):
    with Cluster(tmp_path) as cluster:
        form(cluster, 5)
        everyone = ["n1", "n2", "n3", "n4", "n5"]
        minority, majority = ["n1", "n2"], ["n3", "n4", "n5"]
        before = cluster.node(1).status()
        for node_id in minority:
            cluster.nodes[node_id].block(majority)
        for node_id in majority:
            cluster.nodes[node_id].block(minority)

        # The majority removes the unreachable minority and agrees a new map.
        majority_nodes = [cluster.nodes[n] for n in majority]
        cluster.wait_converged(majority, FAILURE_BOUND_S, on=majority_nodes)

        # The minority keeps the last agreed map, keeps serving, and does not inflate terms.
        time.sleep(3)
        for node_id in minority:
            node = cluster.nodes[node_id]
            assert node.alive()
            status = node.status()
            assert status["map_version"] == before["map_version"]
            assert members_of(status) == everyone
            assert status["raft"]["term"] <= before["raft"]["term"] + 2
            assert mqtt_roundtrip(node, f"minority/{node_id}")
        for node in majority_nodes:
            assert mqtt_roundtrip(node, f"majority/{node.node_id}")

        # Heal: the minority rejoins by itself.
        for node in cluster.nodes.values():
            node.block([])
        started = time.monotonic()
        cluster.wait_converged(everyone, JOIN_BOUND_S * 2)
        print(f"\nheal converged in {time.monotonic() - started:.2f} s")


def test_majority_lost_nodes_keep_serving(tmp_path):
    """Two of three nodes die: the survivor cannot change the map, keeps it, and serves."""
    with Cluster(tmp_path) as cluster:
        form(cluster, 3)
        before = cluster.node(1).status()
        cluster.node(2).kill()
        cluster.node(3).kill()
        time.sleep(5)
        n1 = cluster.node(1)
        assert n1.alive()
        status = n1.status()
        assert status["map_version"] == before["map_version"]
        assert members_of(status) == ["n1", "n2", "n3"]
        assert status["raft"]["role"] != "leader"
        assert mqtt_roundtrip(n1, "alone")
        # Leaving needs a majority too: refused with a clear message, the node keeps running.
        out = subprocess.run(
            [sys.executable, "-m", "fastbroker", "cluster", "leave", "--admin", n1.admin],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 1 and "did not leave" in out.stderr, out.stderr
        assert n1.alive() and mqtt_roundtrip(n1, "still-here")
        # The majority comes back: the map is whole again.
        cluster.start(2)
        cluster.start(3)
        cluster.wait_converged(["n1", "n2", "n3"], JOIN_BOUND_S)


def raw_connect(node: Node) -> socket.socket:
    sock = socket.create_connection((node.ip, 27883), timeout=5)
    sock.settimeout(5)
    return sock


def test_cluster_port_refuses_strangers_and_garbage(tmp_path):
    with Cluster(tmp_path) as cluster:
        form(cluster, 2)
        n1 = cluster.node(1)
        # Random bytes, a huge announced frame, and a half handshake: each is dropped.
        for junk in (os.urandom(4096), b"\xff\xff\xff\xff" + b"x" * 100, b"\x00\x00\x00\x05\x01"):
            sock = raw_connect(n1)
            try:
                sock.sendall(junk)
                try:
                    while sock.recv(65536):
                        pass
                except (TimeoutError, ConnectionResetError):
                    pass
            finally:
                sock.close()

        # A node with the wrong secret is refused and logs why; the cluster is unchanged.
        cluster.node(3)
        cluster.start(3, join=cluster.seeds(1), secret="wrong")
        wait_for(
            lambda: "secrets differ" in cluster.node(3).log(), 15, "the refusal", cluster.node(3)
        )
        # A node of another cluster name is refused too.
        cluster.start(4, join=cluster.seeds(1), name="other")
        wait_for(
            lambda: "cluster name differs" in cluster.node(4).log(), 15, "refusal", cluster.node(4)
        )
        assert n1.alive()
        cluster.wait_converged(["n1", "n2"], 10, on=[n1, cluster.node(2)])
        assert mqtt_roundtrip(n1, "after/garbage")


def test_bad_cluster_config_is_a_clear_error(tmp_path):
    cases = [
        (["--node-id", "bad id!"], "node_id"),
        (["--node-id", "a", "--cluster-listen", "nohost"], "HOST:PORT"),
        (["--node-id", "a", "--join", "h:99999"], "port"),
    ]
    for args, words in cases:
        out = subprocess.run(
            [sys.executable, "-m", "fastbroker", "run", "--data-dir", str(tmp_path / "d"), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 2, (args, out.stderr)
        assert words in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(
    ("toml", "words"),
    [
        ('node_id = "a"\nheartbeat_ms = 600', "election_timeout_ms must be at least twice"),
        ('node_id = "a"\nfailure_timeout_ms = 1000', "failure_timeout_ms must be at least"),
        ('node_id = "a"\nsecret = "x"\nsecret_file = "f"', "secret or secret_file"),
        ('node_id = "a"\nlisten = "0.0.0.0:7883"', "set advertise"),
        ('node_id = "a"\njoin = ["h:0"]', "[cluster] join"),
        ('node_id = "a"\nreplication_factor = 0', "replication_factor"),
        ('node_id = "a"\nack_replicas = 3', "ack_replicas must be at most replication_factor"),
        ('node_id = "a"\ndiscovery = "carrier-pigeon"', "discovery"),
        ('node_id = "a"\ntls_certfile = "n.pem"', "set all of tls_certfile, tls_keyfile"),
        (
            'node_id = "a"\ntls_certfile = "no.pem"\ntls_keyfile = "no.key"\ntls_cafile = "ca.pem"',
            "[cluster] TLS: no.pem: No such file or directory",
        ),
    ],
)
def test_bad_cluster_toml_is_a_clear_error(tmp_path, toml, words):
    config = tmp_path / "fb.toml"
    config.write_text(f"[cluster]\n{toml}\n")
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastbroker",
            "run",
            "--config",
            str(config),
            "--data-dir",
            str(tmp_path / "d"),
            "--port",
            "0",
            "--admin",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode in (1, 2), out.stderr
    assert words in out.stderr and "Traceback" not in out.stderr, out.stderr


def run_briefly(data, node_id: str) -> subprocess.CompletedProcess[str]:
    """`fastbroker run` of a cluster node on `data`, expected to refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "fastbroker", "run", "--data-dir", str(data), "--node-id",
         node_id, "--cluster-listen", "127.0.0.1:0", "--admin", "127.0.0.1:0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )  # fmt: skip


def test_data_dir_belongs_to_one_node_id_and_damage_is_refused(tmp_path):
    with Cluster(tmp_path) as cluster:
        cluster.start(1)
        cluster.wait_converged(["n1"], JOIN_BOUND_S)
        cluster.node(1).stop()
    data = tmp_path / "n1" / "data"
    out = run_briefly(data, "zz")
    assert out.returncode == 1
    assert "belongs to node 'n1'" in out.stderr

    # A damaged Raft state file: a clear refusal, the file left as it was.
    state = data / "cluster" / "raft-state"
    damaged = bytearray(state.read_bytes())
    damaged[-1] ^= 0xFF
    state.write_bytes(bytes(damaged))
    out = run_briefly(data, "n1")
    assert out.returncode == 1, out.stderr
    assert "raft-state is damaged" in out.stderr and "Traceback" not in out.stderr
    assert state.read_bytes() == bytes(damaged)


def test_status_from_a_standalone_broker(tmp_path):
    """Without [cluster], the admin endpoint (when turned on) says so; the CLI too."""
    port = ADMIN_PORT + 1
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastbroker",
            "run",
            "--data-dir",
            str(tmp_path / "d"),
            "--port",
            "0",
            "--admin",
            f"127.0.0.1:{port}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def answers() -> bool:
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "fastbroker",
                    "cluster",
                    "status",
                    "--admin",
                    f"127.0.0.1:{port}",
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
            return "standalone broker" in out.stdout

        wait_for(answers, 20, "the standalone status")

        def raw(request: bytes, wait: float = 10) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=wait) as sock:
                sock.sendall(request)
                chunks = []
                while chunk := sock.recv(65536):
                    chunks.append(chunk)
                return b"".join(chunks)

        # A POST without the admin header (what a web page could send) is refused.
        answer = raw(b"POST /cluster/leave HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 403")
        assert raw(b"GET /x HTTP/1.1\r\nContent-Length: \xc2\xb2\r\n\r\n").startswith(
            b"HTTP/1.1 400"
        )
        assert raw(b"garbage\r\n\r\n").startswith(b"HTTP/1.1 400")
        assert raw(b"GET / HTTP/1.1\r\n" + b"X: y\r\n" * 5000).startswith(b"HTTP/1.1 413")
        # Half a request, then silence: answered 408 after the deadline, not held open.
        assert raw(b"GET /health HTTP/1.1\r\n").startswith(b"HTTP/1.1 408")
        assert raw(b"GET /health HTTP/1.1\r\n\r\n").endswith(b"ok\n")
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_node_waits_for_its_seed_instead_of_founding_its_own_cluster(tmp_path):
    """Started before its seed, a node must not found a second cluster."""
    with Cluster(tmp_path) as cluster:
        n2 = cluster.start(2, join=cluster.seeds(1))
        time.sleep(3.5)  # longer than the bootstrap grace
        status = n2.status()
        assert status is not None and status["cluster_id"] is None
        assert "before forming a cluster" in n2.log()
        cluster.start(1)
        cluster.wait_converged(["n1", "n2"], JOIN_BOUND_S)


def test_a_member_back_at_a_new_address_keeps_its_place(tmp_path):
    with Cluster(tmp_path) as cluster:
        form(cluster, 3)
        n3 = cluster.node(3)
        before = cluster.node(1).status()
        n3.stop()
        moved_to = f"{cluster.ip(9)}:27883"
        cluster.start(3, listen=moved_to)

        def moved() -> bool:
            status = cluster.node(1).status()
            return status is not None and any(
                m["node_id"] == "n3" and m["address"] == moved_to for m in status["members"]
            )

        wait_for(moved, JOIN_BOUND_S, "n3's new address in the map", *cluster.running())
        cluster.wait_converged(["n1", "n2", "n3"], JOIN_BOUND_S)
        after = cluster.node(1).status()
        # One config change (the address), and the partitions stay where they were.
        assert replicas(after) == replicas(before)
