"""The majority lost for good: `fastbroker cluster recover` makes the survivor the only member
of a new cluster from its own state (issue 17), with real nodes and the real CLI."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import rawmqtt as r
from clusters import Cluster, wait_for
from conftest import Client
from test_cluster_routing import (
    all_acknowledged,
    endpoint,
    metric,
    retained_values,
    serving,
    start_cluster,
    unique,
    will_copies,
)

from fastbroker.cluster.partitions import compute_map, partition_of
from fastbroker.cluster.raft import ClusterConfig, PersistentState
from fastbroker.cluster.recover import RecoverError, alone, committed_config
from fastbroker.store import Store


def recover(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastbroker", "cluster", "recover", *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_the_survivor_of_a_lost_majority_forms_a_new_cluster_with_its_sessions_and_retained(
    tmp_path,
):
    """n2 and n3 are destroyed; n1 held a copy of "dev"'s session (homed on n2, six QoS 1
    messages queued for it), the will of "sensor" (connected to n2) and the retained set.
    Recovered, n1 restarts alone and serves them, a fresh node joins it (a membership
    change, impossible without a majority), and n2 back with its old disk is refused rather
    than forming a cluster of its own with it."""
    with Cluster(tmp_path) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        owners = compute_map(["n1", "n2", "n3"]).replicas
        dev, sensor_id = (
            next(
                cid
                for cid in (unique(prefix) for _ in range(1000))
                if set(owners[partition_of(cid.encode(), len(owners))]) == {"n1", "n2"}
            )
            for prefix in ("dev", "sensor")
        )
        root = unique("rec")
        # A clean session with a retained QoS 1 will on n2: n1 holds its will copy.
        sensor, _ = r.connect_client(
            n2.ip,
            n2.mqtt_port,
            sensor_id,
            will_topic=f"{root}/will",
            will_payload=b"off",
            will_qos=1,
            will_retain=True,
        )
        wait_for(lambda: will_copies(n1) == 1, 5, "the will copy on n1", n1)
        expiry = {"SessionExpiryInterval": 600}
        sub = Client(endpoint(n2), client_id=dev, version=5, clean=False, props=expiry)
        sub.connect()
        sub.subscribe(f"{root}/#", qos=1)
        sub.disconnect()
        publisher = Client(endpoint(n3), client_id=unique("pub"), version=5)
        publisher.connect()
        payloads = [f"{i}".encode() for i in range(5)]
        infos = [publisher.publish(f"{root}/m", p, qos=1, wait=False) for p in payloads]
        infos.append(publisher.publish(f"{root}/state", b"on", qos=1, retain=True, wait=False))
        all_acknowledged(infos, 10)
        publisher.disconnect()
        wait_for(lambda: retained_values(n1, f"{root}/state") != {}, 5, "retained on n1", n1)
        time.sleep(1.2)  # n1 writes the will copy to its store once it has lived a second

        before = n1.status()
        assert before is not None
        for node in (n1, n2, n3):
            node.kill()
        sensor.close()
        data_dir = str(n1.workdir / "data")
        refused = recover("--data-dir", str(n2.workdir / "nowhere"), "--yes")
        assert refused.returncode == 1 and "no cluster node's" in refused.stderr
        with Store.open(data_dir) as store:
            # n1 kept n2's route rows ("dev"'s filter) on its disk...
            assert [k for k, _ in store.load(b"n") if b"n2" in k]
        done = recover("--data-dir", data_dir, "--yes")
        assert done.returncode == 0, done.stderr
        assert "only member of cluster" in done.stdout and "removed n2, n3" in done.stdout
        with Store.open(data_dir) as store:
            # ...which go with the members removed.
            assert list(store.load(b"n")) == []

        cluster.start(1)
        wait_for(lambda: serving(n1), 15, "n1 serving", n1)
        cluster.wait_converged(["n1"], 15)
        status = n1.status()
        assert status is not None and status["leader"] == "n1"
        assert status["cluster_id"] != before["cluster_id"]
        assert f"cluster {status['cluster_id']} (was {before['cluster_id']};" in done.stdout
        assert status["map_version"] > before["map_version"]
        # Refused while the node runs: its data directory is locked.
        running = recover("--data-dir", data_dir, "--yes")
        assert running.returncode == 1 and "stop the node first" in running.stderr

        # The session n1 had a copy of resumes there with what was queued for it.
        back = Client(endpoint(n1), client_id=dev, version=5, clean=False, props=expiry)
        assert back.connect().session_present
        got = back.expect(7, 10.0)
        assert [m.payload for m in got if m.topic != f"{root}/will"] == [*payloads, b"on"]
        # The will of the lost node's connection went out once.
        assert [m.payload for m in got if m.topic == f"{root}/will"] == [b"off"]
        assert metric(n1, "cluster_wills_published_for_dead_nodes") == 1
        assert retained_values(n1, f"{root}/#") == {
            f"{root}/state": b"on",
            f"{root}/will": b"off",
        }

        # Membership changes work again: a fresh node joins, and gets the retained set.
        n4 = cluster.start(4, join=cluster.seeds(1))
        cluster.wait_converged(["n1", "n4"], 20, on=[n1, n4])
        assert retained_values(n4, f"{root}/state") == {f"{root}/state": b"on"}
        assert metric(n4, "cluster_wills_published_for_dead_nodes") == 0
        publisher = Client(endpoint(n4), client_id=unique("pub4"), version=5)
        publisher.connect()
        all_acknowledged([publisher.publish(f"{root}/m", b"after", qos=1, wait=False)], 10)
        assert [m.payload for m in back.expect(1, 10.0)] == [b"after"]
        assert back.drain(0.3) == []

        # n2 back with its old disk (members n1, n2, n3 there): refused at the handshake.
        cluster.start(2, join=cluster.seeds(1))
        wait_for(lambda: "cluster id differs" in n2.log(), 15, "n2 refused", n2)
        assert "cluster id differs" in n1.log()
        cluster.wait_converged(["n1", "n4"], 5, on=[n1, n4])
        old = n2.status()
        assert old is not None and old["cluster_id"] == before["cluster_id"]
        for client in (back, publisher):
            client.disconnect()


def config(*members: str, cluster_id: str = "old") -> ClusterConfig:
    return ClusterConfig(
        tuple((m, f"127.0.0.1:{i + 1}") for i, m in enumerate(members)), 8, 2, cluster_id
    )


def test_the_new_state_is_above_every_index_and_term_of_the_old_log_and_keeps_the_settings():
    three = config("n1", "n2", "n3")
    # An entry past the commit index (a change not agreed yet) is not the config recovered.
    state = PersistentState(
        term=7,
        voted_for="n2",
        snapshot_index=4,
        snapshot_term=3,
        snapshot_config=config("n1", "n2"),
        snapshot_config_index=2,
        entries=[(5, three), (6, None), (6, config("n1", "n2", "n3", "n4"))],
        commit_index=6,
    )
    assert committed_config(state) == (5, three)
    new, old = alone(state, "n3")
    assert old == three
    assert new.snapshot_index == new.commit_index == new.snapshot_config_index == 8
    assert new.term == new.snapshot_term == 8 and new.voted_for is None and new.entries == []
    assert new.snapshot_config is not None
    assert new.snapshot_config.members == (("n3", "127.0.0.1:3"),)
    assert (new.snapshot_config.partitions, new.snapshot_config.replication_factor) == (8, 2)
    assert new.snapshot_config.cluster_id not in ("old", "")
    # It survives the round trip through the state file's format.
    assert PersistentState.from_wire(new.to_wire()) == new


def test_a_node_that_is_not_a_member_of_its_last_agreed_cluster_is_not_recovered():
    state = PersistentState(
        term=2,
        voted_for=None,
        snapshot_index=1,
        snapshot_term=1,
        snapshot_config=config("n1", "n2"),
        snapshot_config_index=1,
        entries=[(2, config("n1", "n2", "n3"))],
        commit_index=1,
    )
    # n3 was being added, not agreed yet.
    with pytest.raises(RecoverError, match="not a member"):
        alone(state, "n3")
    fresh = PersistentState(0, None, 0, 0, None, [], 0, 0)
    with pytest.raises(RecoverError, match="not a member"):
        alone(fresh, "n1")


def test_recover_asks_before_it_changes_anything(tmp_path):
    (tmp_path / "cluster").mkdir()
    answered = subprocess.run(
        [sys.executable, "-m", "fastbroker", "cluster", "recover", "--data-dir", str(tmp_path)],
        input="n\n",
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert answered.returncode == 1 and "Aborted" in answered.stderr
    assert list(tmp_path.iterdir()) == [tmp_path / "cluster"]
