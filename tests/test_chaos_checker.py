"""The fault-injection suite's checker, fed histories with each anomaly planted (it must
catch every one) and a clean history (it must pass it)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastbroker.chaos.checker import check, topic_matches
from fastbroker.chaos.history import HistoryError, Op, Recorder, parse


class Run:
    """A history made by hand, as a run would record it."""

    def __init__(self) -> None:
        self.out = io.StringIO()
        self.rec = Recorder(self.out, 0.0)
        self.now = 0.0

    def op(self, process: str, kind: str, f: str, **value: Any) -> None:
        self.now += 0.001
        self.rec.record(self.now, process, kind, f, **value)

    def connect(self, client: str, clean: bool = False, will: dict[str, str] | None = None) -> None:
        self.op(client, "invoke", "connect", client=client, node="n1", clean=clean, will=will)
        self.op(client, "ok", "connect", client=client, node="n1", session_present=False)

    def subscribe(self, client: str, topic_filter: str, qos: int = 1) -> None:
        self.op(client, "invoke", "subscribe", client=client, filter=topic_filter, qos=qos)
        self.op(client, "ok", "subscribe", client=client, filter=topic_filter, qos=qos)

    def unsubscribe(self, client: str, topic_filter: str) -> None:
        self.op(client, "invoke", "unsubscribe", client=client, filter=topic_filter)
        self.op(client, "ok", "unsubscribe", client=client, filter=topic_filter)

    def publish(
        self,
        client: str,
        topic: str,
        ident: str,
        qos: int = 1,
        retain: bool = False,
        outcome: str = "ok",
    ) -> None:
        value = {"client": client, "topic": topic, "qos": qos, "retain": retain, "id": ident}
        self.op(client, "invoke", "publish", **value)
        self.op(client, outcome, "publish", **value)

    def receive(self, client: str, topic: str, ident: str, qos: int = 1, **flags: bool) -> None:
        self.op(client, "info", "receive", client=client, topic=topic, qos=qos, id=ident, **flags)

    def ops(self) -> list[Op]:
        return list(parse(self.out.getvalue().splitlines()))


def clean_run() -> Run:
    """Two persistent subscribers, a publisher with QoS 1 and 2 streams, a retained topic,
    a will: everything as it must be."""
    run = Run()
    for sub in ("s1", "s2"):
        run.connect(sub)
        run.subscribe(sub, "a/#", qos=2)
    run.connect("p", clean=True, will={"topic": "w/p", "id": "will-p"})
    for i in range(5):
        run.publish("p", "a/1", f"q1-{i}", qos=1)
        run.publish("p", "a/2", f"q2-{i}", qos=2)
    for sub in ("s1", "s2"):
        for i in range(5):
            run.receive(sub, "a/1", f"q1-{i}", qos=1)
            run.receive(sub, "a/2", f"q2-{i}", qos=2)
    # A QoS 1 redelivery after a reconnect is allowed.
    run.receive("s1", "a/1", "q1-4", qos=1, dup=True)
    run.publish("p", "r/1", "r-old", retain=True)
    run.publish("p", "r/1", "r-new", retain=True)
    for node in ("n1", "n2", "n3"):
        run.op("final", "info", "retained", node=node, topic="r/1", id="r-new")
    run.op("final", "info", "sessions", client="s1", nodes=["n2"])
    return run


def kinds(run: Run) -> dict[str, int]:
    return {k: v for k, v in check(run.ops()).anomalies.items() if v}


def test_a_clean_history_is_valid():
    result = check(clean_run().ops())
    assert result.valid, result.details
    assert result.verdict().startswith("VALID: anomalies lost=0 ")
    assert result.counts["acknowledged"] == 12
    assert result.counts["receives"] == 21
    assert result.counts["wills"] == 0  # the publisher's connection did not end


def test_an_acknowledged_message_that_never_arrives_is_lost():
    run = clean_run()
    run.publish("p", "a/3", "gone", qos=1)
    run.receive("s1", "a/3", "gone")
    assert kinds(run) == {"lost": 1}
    result = check(run.ops())
    assert result.details["lost"] == ["gone (p on a/3) never reached s2"]


def test_what_is_not_owed_is_not_lost():
    run = clean_run()
    # Unacknowledged, refused, QoS 0; a clean-session subscriber; one that unsubscribed;
    # one whose subscription was acknowledged after the publish began.
    run.publish("p", "a/3", "unknown", outcome="info")
    run.publish("p", "a/3", "refused", outcome="fail")
    run.publish("p", "a/3", "qos0", qos=0)
    run.connect("c", clean=True)
    run.subscribe("c", "a/#")
    run.connect("u")
    run.subscribe("u", "a/#")
    run.unsubscribe("u", "a/#")
    run.op("late", "invoke", "publish", client="late", topic="a/9", qos=1, retain=False, id="x")
    run.connect("late-sub")
    run.subscribe("late-sub", "a/9")
    run.op("late", "ok", "publish", client="late", topic="a/9", qos=1, retain=False, id="x")
    for sub in ("s1", "s2"):
        run.receive(sub, "a/9", "x")
    run.publish("p", "a/4", "both")
    for sub in ("s1", "s2", "c"):
        run.receive(sub, "a/4", "both")
    assert kinds(run) == {}


def test_lost_messages_the_broker_counted_as_dropped_or_degraded_are_exceptions():
    run = clean_run()
    for i in range(3):
        run.publish("p", "a/3", f"over-{i}")
        run.receive("s1", "a/3", f"over-{i}")
    run.op("final", "info", "dropped", client="s2", count=2)
    result = check(run.ops())
    assert result.anomalies["lost"] == 1
    assert result.exceptions == {"dropped": 2, "degraded": 0, "reordered_indeterminate": 0}
    run.op("final", "info", "degraded", node="n1", count=5, destroyed=True)
    result = check(run.ops())
    assert result.valid
    assert result.exceptions == {"dropped": 2, "degraded": 1, "reordered_indeterminate": 0}


def test_a_qos2_message_received_twice_is_duplicated():
    run = clean_run()
    run.receive("s2", "a/2", "q2-3", qos=2, dup=True)
    assert kinds(run) == {"duplicated": 1}


def test_messages_of_one_publisher_on_one_topic_out_of_order_are_reordered():
    run = clean_run()
    run.subscribe("s1", "o/#")
    for i in range(3):
        run.publish("p", "o/1", f"o-{i}")
    for ident in ("o-0", "o-2", "o-1"):
        run.receive("s1", "o/1", ident)
    # Other topics or publishers may interleave freely.
    run.publish("p2", "o/1", "p2-0")
    run.publish("p", "o/2", "o2-0")
    run.receive("s1", "o/2", "o2-0")
    run.receive("s1", "o/1", "p2-0")
    assert kinds(run) == {"reordered": 1}


def test_a_publish_of_unknown_outcome_received_late_is_an_exception_not_a_reorder():
    run = clean_run()
    run.subscribe("s1", "o/#")
    run.publish("p", "o/1", "o-0")
    # Its connection ended before the answer: it may take effect at any later moment.
    run.publish("p", "o/1", "o-1", outcome="info")
    run.publish("p", "o/1", "o-2")
    run.publish("p", "o/1", "o-3")
    for ident in ("o-0", "o-2", "o-1", "o-3"):
        run.receive("s1", "o/1", ident)
    result = check(run.ops())
    assert result.valid, result.details
    assert result.exceptions["reordered_indeterminate"] == 1
    # An acknowledged one late is still a reorder (an unknown one early changes nothing).
    run.publish("p", "o/1", "o-4")
    run.publish("p", "o/1", "o-5", outcome="info")
    run.publish("p", "o/1", "o-6")
    for ident in ("o-5", "o-6", "o-4"):
        run.receive("s1", "o/1", ident)
    assert kinds(run) == {"reordered": 1}


def test_a_message_received_after_unsubscribing_is_a_resurrected_subscription():
    run = clean_run()
    run.connect("r")
    run.subscribe("r", "z/#")
    run.publish("p", "z/1", "before")
    run.unsubscribe("r", "z/#")
    run.publish("p", "z/1", "after")
    # What was queued before the unsubscribe may still come; what came after may not.
    run.receive("r", "z/1", "before")
    run.receive("r", "z/1", "after")
    assert kinds(run) == {"resurrected": 1}
    # Subscribed again before receiving it: fine.
    run2 = clean_run()
    run2.connect("r")
    run2.subscribe("r", "z/#")
    run2.unsubscribe("r", "z/#")
    run2.publish("p", "z/1", "after")
    run2.subscribe("r", "z/+")
    run2.receive("r", "z/1", "after")
    assert kinds(run2) == {}


def test_a_message_on_a_topic_never_subscribed_is_flagged_but_retained_on_subscribe_is_not():
    run = clean_run()
    run.receive("s1", "r/1", "r-new", retain=True)
    assert kinds(run) == {}
    run.receive("s1", "r/1", "r-old")
    assert kinds(run) == {"resurrected": 1}


def test_retained_messages_that_differ_between_nodes_diverged():
    run = clean_run()
    run.publish("p", "r/2", "x", retain=True)
    run.op("final", "info", "retained", node="n1", topic="r/2", id="x")
    run.op("final", "info", "retained", node="n2", topic="r/2", id=None)
    assert kinds(run) == {"retained_diverged": 1}


def test_a_retained_message_older_than_a_later_acknowledged_write_is_stale():
    run = clean_run()
    for node in ("n1", "n2"):
        run.op("final", "info", "retained", node=node, topic="r/1", id="r-old")
    # n3 says r-new (diverged), n1 and n2 r-old: the topic counts once, as diverged.
    assert kinds(run) == {"retained_diverged": 1}
    run = Run()
    run.connect("p")
    run.publish("p", "r/1", "r-old", retain=True)
    run.publish("p", "r/1", "r-new", retain=True)
    run.publish("p", "r/2", "set", retain=True)
    run.publish("p", "r/3", "deleted", retain=True)
    run.publish("p", "r/3", "", retain=True)
    for node in ("n1", "n2"):
        run.op("final", "info", "retained", node=node, topic="r/1", id="r-old")
        run.op("final", "info", "retained", node=node, topic="r/2", id=None)
        run.op("final", "info", "retained", node=node, topic="r/3", id=None)
    assert kinds(run) == {"retained_stale": 2}


def test_concurrent_or_unknown_retained_writes_may_end_either_way():
    run = Run()
    run.connect("a")
    run.connect("b")
    base = {"topic": "r/1", "qos": 1, "retain": True}
    run.op("a", "invoke", "publish", client="a", id="from-a", **base)
    run.op("b", "invoke", "publish", client="b", id="from-b", **base)
    run.op("a", "ok", "publish", client="a", id="from-a", **base)
    run.op("b", "ok", "publish", client="b", id="from-b", **base)
    run.publish("a", "r/2", "acked", retain=True)
    run.publish("b", "r/2", "unknown", retain=True, outcome="info")
    for node in ("n1", "n2"):
        run.op("final", "info", "retained", node=node, topic="r/1", id="from-a")
        run.op("final", "info", "retained", node=node, topic="r/2", id="unknown")
    assert kinds(run) == {}


def test_two_sessions_of_one_client_id_after_the_heal():
    run = clean_run()
    run.op("final", "info", "sessions", client="s2", nodes=["n1", "n3"])
    assert kinds(run) == {"sessions": 1}


def test_a_persistent_session_found_on_no_node_after_the_heal():
    run = clean_run()
    run.op("final", "info", "sessions", client="s2", nodes=[])
    assert kinds(run) == {"sessions": 1}


def test_a_will_that_reaches_a_client_twice_as_new():
    run = clean_run()
    run.connect("ws")
    run.subscribe("ws", "w/#")
    run.receive("ws", "w/p", "will-p")
    run.receive("ws", "w/p", "will-p", dup=True)
    assert kinds(run) == {}
    run.receive("ws", "w/p", "will-p")
    assert kinds(run) == {"will_twice": 1}
    assert check(run.ops()).counts["wills"] == 1


def will_run(reason: str, then: float = 20.0, acknowledged: bool = True) -> Run:
    """A clean run with s1 subscribed to the wills too; the publisher's connection ends
    (`reason`) `then` s before the final reads."""
    run = clean_run()
    run.subscribe("s1", "w/#")
    if not acknowledged:
        will = {"topic": "w/p", "id": "will-p2"}
        run.op("p", "invoke", "connect", client="p", node="n1", clean=True, will=will)
    run.op("p", "info", "disconnected", client="p", reason=reason)
    run.now += then
    run.op("final", "info", "sessions", client="s2", nodes=["n1"])
    return run


def test_a_will_that_never_reaches_a_subscriber_that_wants_it_is_lost():
    run = will_run("Unspecified error")
    # s2 subscribed to a/# only: it does not want it.
    assert kinds(run) == {"will_lost": 1}
    details = check(run.ops()).details["will_lost"]
    assert details[0].startswith("the will will-p of p (its connection ended at ")
    assert details[0].endswith("s: Unspecified error) never reached s1")
    run.receive("s1", "w/p", "will-p")
    assert kinds(run) == {}


def test_no_will_is_expected_after_disconnect_just_before_the_end_or_without_connack():
    assert kinds(will_run("Normal disconnection")) == {}
    assert kinds(will_run("Unspecified error", then=5.0)) == {}
    assert kinds(will_run("Unspecified error", acknowledged=False)) == {}


@pytest.mark.parametrize(
    ("topic_filter", "topic", "want"),
    [
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("a/+", "a/b", True),
        ("a/+", "a/b/c", False),
        ("+/+", "a/b", True),
        ("#", "$SYS/x", False),
        ("$SYS/#", "$SYS/x", True),
        ("a/b", "a/b", True),
        ("a/b", "a/c", False),
        ("a/+/c", "a//c", True),
    ],
)
def test_topic_matching(topic_filter, topic, want):
    assert topic_matches(topic_filter, topic) is want


def test_unreadable_histories_are_refused_with_the_line():
    with pytest.raises(HistoryError, match="line 2: not JSON"):
        list(parse(['{"t":0,"process":"a","type":"ok","f":"x"}', "{"]))
    with pytest.raises(HistoryError, match="line 1: type 'done'"):
        list(parse(['{"t":0,"process":"a","type":"done","f":"x"}']))
    with pytest.raises(HistoryError, match="line 1: missing or bad field"):
        list(parse(['{"process":"a","type":"ok","f":"x"}']))


@given(st.lists(st.text(max_size=60), max_size=5))
def test_the_history_parser_never_fails_otherwise(lines):
    try:
        list(parse(lines))
    except HistoryError:
        pass


@given(
    st.lists(
        st.fixed_dictionaries(
            {
                "t": st.floats(0, 1e6),
                "process": st.sampled_from(["a", "b", "nemesis"]),
                "type": st.sampled_from(["invoke", "ok", "fail", "info"]),
                "f": st.sampled_from(["publish", "receive", "subscribe", "connect", "kill"]),
                "value": st.fixed_dictionaries(
                    {
                        "client": st.sampled_from(["a", "b"]),
                        "topic": st.sampled_from(["t/1", "t/2"]),
                        "filter": st.sampled_from(["t/#", "t/1"]),
                        "id": st.sampled_from(["", "m1", "m2"]),
                        "qos": st.integers(0, 2),
                    }
                ),
            }
        ),
        max_size=30,
    )
)
def test_the_checker_takes_any_well_formed_history(records):
    result = check(parse(json.dumps(r) for r in records))
    assert result.verdict().split(":")[0] in ("VALID", "INVALID")


def test_the_command_prints_one_verdict_and_exits_1_on_anomalies(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(clean_run().out.getvalue())
    bad_run = clean_run()
    bad_run.receive("s2", "a/2", "q2-3", qos=2)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(bad_run.out.getvalue())
    broken = tmp_path / "broken.jsonl"
    broken.write_text("not json\n")

    def run(path):
        cmd = [sys.executable, "-m", "fastbroker.chaos", "check", str(path)]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=60)

    ok = run(good)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1].startswith("VALID: anomalies lost=0 duplicated=0")
    failed = run(bad)
    assert failed.returncode == 1
    assert "  duplicated: s2 got QoS 2 message q2-3 2 times" in failed.stdout
    assert failed.stdout.splitlines()[-1].startswith("INVALID: anomalies lost=0 duplicated=1")
    refused = run(broken)
    assert refused.returncode == 2
    assert "line 1: not JSON" in refused.stderr


def test_run_without_paho_says_what_to_install_before_starting_anything(tmp_path):
    # The broker's own install has no MQTT client library; the runner's clients need one.
    code = "import sys; sys.modules['paho'] = None; from fastbroker.chaos.cli import main; main()"
    work = tmp_path / "run"
    cmd = [sys.executable, "-c", code, "run", "--seconds", "5", "--workdir", str(work)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 3, done.stderr
    assert done.stderr.strip() == (
        "fastbroker-chaos: cannot run: paho-mqtt is not installed (pip install 'fastbroker[chaos]')"
    )
    assert not work.exists()


def test_recovery_figures_per_fault_and_per_kind():
    """From the history alone: how long the cluster took to be whole after each fault, and
    the longest any publisher went unacknowledged, any subscriber without a message and
    any client waited for a CONNACK, between the fault and the cluster whole again."""
    run = clean_run()

    def at(t: float, process: str, kind: str, f: str, **value: Any) -> None:
        run.now = t - 0.001
        run.op(process, kind, f, **value)

    value = {"client": "p", "topic": "a/1", "qos": 1, "retain": False}
    for t in (10.0, 10.1, 10.2, 13.5, 13.6):  # acknowledged publishes: a 3.3 s gap
        at(t, "p", "ok", "publish", id=f"x{t}", **value)
    # Receives: a gap from 11.05 s to past the window's end (13.75 s): 2.7 s.
    for t in (10.05, 11.05, 14.0):
        at(t, "s1", "info", "receive", client="s1", topic="a/1", qos=1, id=f"x{t}")
    for t in (10.2, 11.5, 12.5, 13.5, 60.0):
        at(t, "s2", "info", "receive", client="s2", topic="a/1", qos=1, id=f"x{t}")
    at(10.5, "nemesis", "info", "kill", node="n2", seconds=1.5)
    at(12.0, "nemesis", "info", "start", node="n2")
    at(12.5, "s2", "ok", "connect", client="s2", node="front", session_present=True, waited=1.25)
    at(13.75, "nemesis", "info", "converged", node="n2", after=1.75)
    at(20.0, "nemesis", "info", "split", node="n1", seconds=2.0)
    at(22.0, "nemesis", "info", "heal", node="n1")
    at(52.0, "nemesis", "info", "not_converged", node="n1")
    at(60.0, "nemesis", "info", "kill", node="n3", seconds=1.5)
    at(61.5, "nemesis", "info", "start", node="n3")
    at(62.0, "nemesis", "info", "converged", node="n3", after=0.5)

    result = check(run.ops())
    assert result.valid, result.details
    kill, split, kill2 = result.recovery
    assert (kill.fault, kill.node, kill.lasted, kill.whole_after) == ("kill", "n2", 1.5, 1.75)
    assert kill.publish_gap == 3.3
    assert kill.receive_gap == 2.7
    assert kill.connect_wait == 1.25
    assert (split.fault, split.whole_after) == ("split", None)
    # Nothing after 14 s: the gap runs to the end of the window (52 s).
    assert split.publish_gap == 52.0 - 13.6
    kinds = result.to_dict()["recovery_by_kind"]
    assert kinds["kill"]["count"] == 2 and kinds["kill"]["whole_after_max"] == 1.75
    assert kinds["split"]["whole_after_max"] is None
    assert kill2.whole_after == 0.5


def test_the_command_prints_recovery_figures_before_the_verdict(tmp_path):
    run = clean_run()
    run.op("nemesis", "info", "pause", node="n1", seconds=1.5)
    run.op("nemesis", "info", "resume", node="n1")
    run.op("nemesis", "info", "converged", node="n1", after=0.25)
    path = tmp_path / "h.jsonl"
    path.write_text(run.out.getvalue())
    cmd = [sys.executable, "-m", "fastbroker.chaos", "check", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("recovery (s): fault node at lasted whole_after")
    assert lines[1].startswith("  pause n1 ")
    assert any(line.startswith("  pause 1 0.25 ") for line in lines)
    assert lines[-1].startswith("VALID: ")
