"""The fault-injection suite's short schedule (issue 17): a 3-node cluster of real processes
on loopback, persistent QoS 2 subscribers and QoS 1/2 publishers (paho-mqtt) moving between
nodes, while nodes are SIGKILLed and restarted or SIGSTOPped and resumed, one at a time. The
checker must find no anomaly in the recorded history."""

from __future__ import annotations

import json

import pytest

from fastbroker.chaos.history import read
from fastbroker.chaos.runner import Run, Schedule


# 30 s of faults, then the heal, the drain and the stops: about a minute; bounded waits
# (each at most 60 s) can make a slow machine's run longer.
@pytest.mark.timeout(300)
def test_the_short_schedule_shows_no_anomaly(tmp_path):
    run = Run(Schedule(seconds=30, seed=7), tmp_path)
    result = run.execute()
    assert result.valid, json.dumps(result.to_dict(), indent=1)[:4000]
    # It did test something: faults of both kinds, hundreds of acknowledged messages, every
    # one delivered to each of the three subscribers.
    ops = read(run.history)
    faults = {op.f for op in ops if op.process == "nemesis"}
    assert {"kill", "pause"} <= faults, faults
    assert run.faults >= 3
    assert result.counts["acknowledged"] > 300
    assert result.counts["receives"] >= 3 * result.counts["acknowledged"]
    # Subscribers moved between nodes and resumed their sessions.
    moves = [op for op in ops if op.f == "connect" and op.type == "ok" and op.process[0] == "s"]
    assert len(moves) > 3
    assert all(op.value["session_present"] for op in moves[3:])
