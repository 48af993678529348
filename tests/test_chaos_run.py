"""The fault-injection suite's short schedule (issue 17): a 3-node cluster of real processes,
each in its own network namespace, behind HAProxy; persistent QoS 2 subscribers and QoS 1/2
publishers (paho-mqtt, through HAProxy) moving between nodes, while nodes are SIGKILLed and
restarted, SIGSTOPped and resumed, or cut off from the other nodes, one at a time. The
checker must find no anomaly in the recorded history."""

from __future__ import annotations

import json
import os

import pytest

from fastbroker.chaos.front import Front
from fastbroker.chaos.history import read
from fastbroker.chaos.network import Network
from fastbroker.chaos.runner import Run, Schedule

MISSING = Network.unavailable() or Front.unavailable()
pytestmark = pytest.mark.skipif(
    bool(MISSING) and os.environ.get("FASTBROKER_REQUIRED") != "1",
    reason=MISSING or "",
)


# 30 s of faults, then the heal, the drain and the stops: about a minute; bounded waits
# (each at most 60 s) can make a slow machine's run longer.
@pytest.mark.timeout(300)
def test_the_short_schedule_shows_no_anomaly(tmp_path):
    # Seed 7 with the faults shorter than the failure timeout: a pause, a split of 1.3 s, a
    # kill. (Faults past it, "<fault>_long", still find anomalies: docs/chaos.md.)
    run = Run(Schedule(seconds=30, seed=7, faults=("kill", "pause", "split")), tmp_path)
    result = run.execute()
    assert result.valid, json.dumps(result.to_dict(), indent=1)[:4000]
    # It did test something: faults of every kind, hundreds of acknowledged messages, every
    # one delivered to each of the three subscribers, retained messages read on every node.
    ops = read(run.history)
    faults = {op.f for op in ops if op.process == "nemesis"}
    assert {"kill", "pause", "split"} <= faults, faults
    assert run.faults >= 3
    assert result.counts["acknowledged"] > 300
    retained = [op for op in ops if op.f == "publish" and op.type == "ok" and op.value["retain"]]
    assert retained
    streamed = result.counts["acknowledged"] - len(retained)
    assert result.counts["receives"] >= 3 * streamed
    assert result.counts["retained_topics"] == 3
    reads = [op for op in ops if op.f == "retained"]
    assert len(reads) == 9 and all(op.value["id"] for op in reads), reads
    # Subscribers moved between nodes (through HAProxy) and resumed their sessions.
    moves = [op for op in ops if op.f == "connect" and op.type == "ok" and op.process[0] == "s"]
    assert len(moves) > 3
    assert all(op.value["session_present"] for op in moves[3:])


def test_the_disk_fault_fills_a_nodes_data_directory_and_gives_the_space_back(tmp_path):
    """The nemesis's `disk` fault on a node's own tmpfs (no node process needed): while it
    lasts a write there fails with ENOSPC; afterwards it succeeds."""
    import errno

    from fastbroker.chaos.nodes import NodeProcess

    node = NodeProcess("n1", "10.0.0.1", tmp_path / "n1", {}, lambda argv: argv, "")
    node.mount_disk()
    try:
        node.data_dir.mkdir()
        probe = node.data_dir / "probe"
        node.fill_disk()
        with pytest.raises(OSError) as full:
            probe.write_bytes(b"x" * 65536)
        assert full.value.errno == errno.ENOSPC
        node.empty_disk()
        probe.write_bytes(b"x" * 65536)
    finally:
        node.unmount_disk()
    assert not os.path.ismount(node.disk)
