"""A planned stop (SIGTERM) of a cluster node, as in a rolling restart: its clients are sent
elsewhere and resume there with nothing lost and nothing delivered twice (issue 17)."""

from __future__ import annotations

import signal
import time

from clusters import MQTT_PORT, Cluster, wait_for
from conftest import Client
from test_cluster_routing import all_acknowledged, endpoint, links_up, start_cluster, unique


def test_a_stopped_node_sends_its_clients_on_and_they_resume_elsewhere_exactly(tmp_path):
    """Five persistent subscribers on n2 (four MQTT 5, one 3.1.1) received and acknowledged
    20 QoS 1 messages; n2 gets SIGTERM. The MQTT 5 ones are told to use another server
    (0x9C, with the configured reference); all resume on other nodes with the 5 messages
    published meanwhile, and none of the 20 again. n2 told the others it stops for a restart:
    it stays a member past the failure timeout, and its return changes no map."""
    with Cluster(tmp_path) as cluster:
        reference = f"{cluster.ip(1)}:{MQTT_PORT}"
        cluster.settings["server_reference"] = reference
        n1, n2, n3 = start_cluster(cluster, 3)
        root = unique("stop")
        expiry = {"SessionExpiryInterval": 600}
        ids = [unique("dev") for _ in range(5)]
        subs = []
        for i, cid in enumerate(ids):
            v5 = i < 4
            c = Client(
                endpoint(n2),
                client_id=cid,
                version=5 if v5 else 4,
                clean=False,
                props=expiry if v5 else None,
            )
            c.connect()
            c.subscribe(f"{root}/#", qos=1)
            subs.append(c)
        publisher = Client(endpoint(n3), client_id=unique("pub"), version=5)
        publisher.connect()
        first = [f"{i}".encode() for i in range(20)]
        all_acknowledged([publisher.publish(f"{root}/m", p, qos=1, wait=False) for p in first], 10)
        for c in subs:
            assert [m.payload for m in c.expect(20, 10.0)] == first
        time.sleep(0.5)  # their PUBACKs reach n2

        assert n2.proc is not None
        n2.proc.send_signal(signal.SIGTERM)
        assert n2.proc.wait(15) == 0
        stopped = time.monotonic()
        for c in subs[:4]:
            wait_for(lambda c=c: c.disconnect_rc is not None, 5, "DISCONNECT", n1)
            assert c.disconnect_rc == 0x9C
            assert c.disconnect_props.get("ServerReference") == reference
        assert "not acknowledged" not in n2.log()
        # Its links closing as it ends wrote nothing to the closed store.
        assert "ERROR" not in n2.log(), n2.log()[-2000:]
        before = n1.status()
        assert before is not None
        late = [f"late{i}".encode() for i in range(5)]
        all_acknowledged([publisher.publish(f"{root}/m", p, qos=1, wait=False) for p in late], 10)

        for i, cid in enumerate(ids):
            v5 = i < 4
            for c in subs:
                if c.client_id == cid:
                    c.close()
            # The MQTT 5 clients go where they were told; the 3.1.1 one to another node.
            back = Client(
                endpoint(n1 if v5 else n3),
                client_id=cid,
                version=5 if v5 else 4,
                clean=False,
                props=expiry if v5 else None,
            )
            assert back.connect(timeout=10).session_present, cid
            assert [m.payload for m in back.expect(5, 10.0)] == late, cid
            assert back.drain(0.3) == [], cid
            back.disconnect()
        publisher.disconnect()

        # Away longer than the failure timeout (2 s here), n2 is still a member ...
        time.sleep(max(0.0, 2.5 - (time.monotonic() - stopped)))
        assert "is stopping for a restart" in n1.log()
        for node in (n1, n3):
            status = node.status()
            assert status is not None and status["map_version"] == before["map_version"]
            assert sorted(m["node_id"] for m in status["members"]) == ["n1", "n2", "n3"]
        assert "removing member n2" not in n1.log() + n3.log()
        # ... and its return moves nothing: the same map, its links up again.
        cluster.start(2)
        wait_for(lambda: links_up(n1, ["n2", "n3"]), 15, "n2 linked again", n1, n2)
        cluster.wait_converged(["n1", "n2", "n3"], 15)
        status = n2.status()
        assert status is not None and status["map_version"] == before["map_version"]


def test_a_killed_node_is_removed_after_the_failure_timeout_as_before(tmp_path):
    """SIGKILL says nothing: the stop notice is what keeps a stopped member in the map."""
    with Cluster(tmp_path) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        n2.kill()
        cluster.wait_converged(["n1", "n3"], 10)
        assert "removing member n2" in n1.log() + n3.log()
