"""A rolling upgrade with two real builds side by side (issue 17, docs/upgrade.md): a cluster
with one node on the previous release (inter-node protocol 14) and two on this one
(`PROTOCOL_MAX`) routes, keeps retained messages and moves sessions both ways; then that
node is upgraded with a planned stop, and its session resumes on the new build."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
from brokers import REPO
from clusters import Cluster, wait_for
from conftest import Client
from test_cluster_routing import (
    all_acknowledged,
    endpoint,
    retained_values,
    round_trip,
    serving,
    start_cluster,
    unique,
    wait_rows,
)

from fastbroker.cluster.transport import PROTOCOL_MAX

# The previous release: the last commit that speaks protocol 14 (before session messages
# passed on carry the node they came from).
PREVIOUS = "80b016b"


@pytest.fixture(scope="module")
def previous_build() -> Path:
    """That release, built from this repository's history into build/previous (a few
    minutes the first time, its crates compiled in a target directory of its own)."""
    target = REPO / "build" / "previous"
    script = REPO / "scripts" / "build-previous.sh"
    found = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{PREVIOUS}^{{commit}}"],
        capture_output=True,
        timeout=30,
    )
    if found.returncode != 0:
        # A shallow clone: the previous release is not in its history.
        pytest.skip(f"commit {PREVIOUS} (the previous release) is not in this clone's history")
    subprocess.run(
        ["bash", str(script), PREVIOUS, str(target), sys.executable], check=True, timeout=1200
    )
    return target


@pytest.mark.timeout(1500)
def test_a_cluster_runs_mixed_during_an_upgrade_and_after_it(tmp_path, previous_build):
    with Cluster(tmp_path) as cluster:
        cluster.node(3).build = previous_build
        n1, n2, n3 = start_cluster(cluster, 3)
        assert "up, protocol 14" in n1.log() and f"up, protocol {PROTOCOL_MAX}" in n1.log()
        # n3 runs the previous engine too: it lacks a counter added since (handed_on).
        probe = (
            "import fastbroker_core as c; "
            "print(c.__file__, 'handed_on' in c.Engine().replica_stats())"
        )
        old = subprocess.run(
            [sys.executable, "-c", probe],
            env={"PYTHONPATH": str(previous_build)},
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.split()
        assert old == [str(previous_build / "fastbroker_core" / "__init__.py"), "False"], old

        # Routing both ways between the builds, and one retained set.
        root = unique("up")
        assert round_trip(n1, n3, b"new to old")
        assert round_trip(n3, n2, b"old to new")
        setter = Client(endpoint(n3), client_id=unique("ret"), version=5)
        setter.connect()
        all_acknowledged([setter.publish(f"{root}/state", b"old", qos=1, retain=True)], 10)
        setter.disconnect()
        wait_for(
            lambda: retained_values(n1, f"{root}/state") == {f"{root}/state": b"old"},
            10,
            "the old build's retained message on n1",
            n1,
        )

        # A persistent session made on the new build resumes on the old one, and the other
        # way round, with what was queued for it meanwhile.
        expiry = {"SessionExpiryInterval": 600}
        publisher = Client(endpoint(n2), client_id=unique("pub"), version=5)
        publisher.connect()
        for made_on, resumed_on in ((n1, n3), (n3, n1)):
            dev = unique("dev")
            c = Client(endpoint(made_on), client_id=dev, version=5, clean=False, props=expiry)
            c.connect()
            c.subscribe(f"{root}/cmd/{dev}", qos=1)
            c.disconnect()
            wait_rows(n2, made_on.node_id, 1)
            msgs = [f"{dev}-{i}".encode() for i in range(5)]
            all_acknowledged(
                [publisher.publish(f"{root}/cmd/{dev}", m, qos=1, wait=False) for m in msgs], 10
            )
            back = Client(endpoint(resumed_on), client_id=dev, version=5, clean=False, props=expiry)
            assert back.connect(timeout=10).session_present, (made_on.node_id, resumed_on.node_id)
            assert [m.payload for m in back.expect(5, 10.0)] == msgs
            back.disconnect()

        # The upgrade: a session on n3, messages queued for it, then n3 is stopped
        # (SIGTERM) and started on this build.
        dev = unique("dev")
        c = Client(endpoint(n3), client_id=dev, version=5, clean=False, props=expiry)
        c.connect()
        c.subscribe(f"{root}/cmd/{dev}", qos=1)
        c.disconnect()
        wait_rows(n2, "n3", 1)
        msgs = [f"{dev}-{i}".encode() for i in range(5)]
        all_acknowledged(
            [publisher.publish(f"{root}/cmd/{dev}", m, qos=1, wait=False) for m in msgs], 10
        )
        assert n3.proc is not None
        n3.proc.send_signal(signal.SIGTERM)
        assert n3.proc.wait(15) == 0
        n3.build = None
        cluster.start(3)
        cluster.wait_converged(["n1", "n2", "n3"], 30)
        linked = f"up, protocol {PROTOCOL_MAX}"
        wait_for(lambda: linked in n3.log(), 15, f"n3 linked on protocol {PROTOCOL_MAX}", n3)
        wait_for(lambda: serving(n3), 15, "n3 serving MQTT", n3)
        back = Client(endpoint(n3), client_id=dev, version=5, clean=False, props=expiry)
        assert back.connect(timeout=10).session_present
        assert [m.payload for m in back.expect(5, 10.0)] == msgs
        back.disconnect()
        assert round_trip(n1, n3, b"after the upgrade")
        assert retained_values(n3, f"{root}/state") == {f"{root}/state": b"old"}
        publisher.disconnect()
