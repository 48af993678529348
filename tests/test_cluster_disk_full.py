"""Disk full on one node of a cluster (issue 17): that node refuses what it cannot store, the
rest of the cluster goes on unaffected, and it recovers by itself with nothing acknowledged
lost."""

from __future__ import annotations

import os
import time

import pytest
from clusters import Cluster, wait_for
from conftest import Client
from test_cluster_routing import endpoint, start_cluster, unique
from tmpfs import mounted_tmpfs


@pytest.mark.timeout(180)
def test_a_node_whose_disk_fills_stalls_no_publisher_elsewhere_and_recovers(tmp_path):
    """n2's data directory is on a small tmpfs; "slow" (offline, persistent, on n2) and
    "watch" (online, on n1) subscribe to the same topic, and a publisher on n1 sends 32 KiB
    QoS 1 messages until n2's disk is full and on for as many more. Every publish is
    acknowledged within a second or two (n2 closes its data links: n1 keeps what is for it on
    its own disk); watch gets each one at once. Space returns: n2 resumes by itself and
    slow gets every acknowledged message."""
    with Cluster(tmp_path) as cluster:
        n2 = cluster.node(2)
        with mounted_tmpfs(n2.workdir, "48m") as fs:
            (n2.workdir / "data").symlink_to(fs)
            n1, n2, _ = start_cluster(cluster, 3)
            root = unique("full")
            slow_id = unique("slow")
            slow = Client(endpoint(n2), client_id=slow_id, version=4, clean=False)
            slow.connect()
            slow.subscribe(f"{root}/#", qos=1)
            slow.disconnect()
            watch = Client(endpoint(n1), client_id=unique("watch"), version=5)
            watch.connect()
            watch.subscribe(f"{root}/#", qos=1)
            filler = fs / "filler"
            free = os.statvfs(fs).f_bavail * os.statvfs(fs).f_frsize
            filler.write_bytes(b"\0" * max(0, free - 6 * 1024 * 1024))

            publisher = Client(endpoint(n1), client_id=unique("pub"), version=5)
            publisher.connect()
            payload = os.urandom(32 * 1024)  # incompressible
            acked: list[int] = []
            failed_at = None
            started = time.monotonic()
            while time.monotonic() - started < 60:
                i = len(acked)
                info = publisher.publish(f"{root}/x", i.to_bytes(4, "big") + payload, qos=1)
                info.wait_for_publish(5)
                assert info.is_published(), f"publish {i} not acknowledged in 5 s"
                acked.append(i)
                got = watch.expect(1, 5.0)
                assert int.from_bytes(got[0].payload[:4], "big") == i
                if failed_at is None and "store failing" in n2.log():
                    failed_at = i
                if failed_at is not None and i >= 2 * failed_at:
                    break
            assert failed_at is not None, "n2's disk did not fill"
            assert n2.proc is not None and n2.proc.poll() is None, "n2 died"
            print(f"\nn2's store failed after {failed_at} messages; {len(acked)} acknowledged")

            filler.unlink()
            wait_for(lambda: "store recovered" in n2.log(), 15, "n2's store back", n2)
            # As after a pause, n2 refuses CONNECTs (0x88) until it is in touch again (its
            # sessions may have moved meanwhile); clients retry.
            deadline = time.monotonic() + 15
            while True:
                back = Client(endpoint(n2), client_id=slow_id, version=4, clean=False)
                ack = back.connect(timeout=10, expect_rc=None)
                if ack.rc == 0 or time.monotonic() > deadline:
                    break
                back.close()
                time.sleep(0.2)
            assert ack.rc == 0 and ack.session_present, ack
            seen: set[int] = set()
            deadline = time.monotonic() + 30
            while not set(acked) <= seen and time.monotonic() < deadline:
                for m in back.drain(0.5):
                    seen.add(int.from_bytes(m.payload[:4], "big"))
            missing = sorted(set(acked) - seen)
            assert not missing, f"{len(missing)} lost, e.g. {missing[:10]}"
            for c in (back, watch, publisher):
                c.disconnect()
            cluster.stop_all()
