"""One logical broker for publishing: a publish on any node of a real 3-node cluster reaches
every matching subscriber on every node (rust/src/broker/cluster.rs, the data plane).

Real node processes on loopback (tests/clusters.py), real paho clients (conftest.Client), raw
sockets where a client must die without DISCONNECT. What arrives across nodes is compared
with what one node delivers for the same script (differential); the inter-node counters of
`/cluster/status` show where publishes went; links are cut with the fault-injection endpoint
and a node is SIGKILLed in the middle of a stream.
"""

from __future__ import annotations

import asyncio
import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from types import SimpleNamespace
from typing import Any

import fastbroker_core
import pytest
import rawmqtt as r
from certs import make_ca, make_leaf
from clusters import SECRET, Cluster, Node, run_subnet, wait_for
from conftest import Client, MqttError

from fastbroker.cluster.dataplane import DATA
from fastbroker.cluster.partitions import compute_map, partition_of
from fastbroker.cluster.transport import Transport, parse_address

pytestmark = pytest.mark.timeout(180)

NODES = 3
EXPIRY = {"SessionExpiryInterval": 300}


def endpoint(node: Node) -> Any:
    """What conftest.Client connects to."""
    return SimpleNamespace(host=node.ip, port=node.mqtt_port)


def links_up(node: Node, peers: list[str]) -> bool:
    status = node.status()
    if status is None:
        return False
    plane = status.get("data_plane", {})
    return all(plane.get(p, {}).get("up") for p in peers)


def start_cluster(cluster: Cluster, count: int) -> list[Node]:
    """Starts every node at once (n1 founds, the others join through it) and waits until
    the map converged and every data link is up."""
    nodes = [cluster.start(1, wait=False)]
    nodes += [cluster.start(i, wait=False, join=cluster.seeds(1)) for i in range(2, count + 1)]
    ids = [n.node_id for n in nodes]
    cluster.wait_converged(ids, 30)
    for node in nodes:
        others = [i for i in ids if i != node.node_id]
        wait_for(lambda n=node, o=others: links_up(n, o), 15, "data links up", *nodes)
    return nodes


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    with Cluster(tmp_path_factory.mktemp("routing")) as cluster:
        # Addresses of their own: tests below start clusters of theirs meanwhile.
        cluster.subnet = (run_subnet() - 20 + 100) % 200 + 20
        yield start_cluster(cluster, NODES)


def plane(node: Node, peer: str) -> dict[str, Any]:
    status = node.status()
    assert status is not None
    return status["data_plane"][peer]


def wait_rows(node: Node, peer: str, at_least: int) -> None:
    wait_for(lambda: plane(node, peer)["route_rows"] >= at_least, 5, "route rows", node)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def parked_session(node: Node, client_id: str, topic: str, qos: int) -> None:
    """A persistent MQTT 5 session (expiry 300 s) subscribed to `topic` on `node`, its
    client gone."""
    sub = Client(endpoint(node), client_id=client_id, version=5, clean=False, props=EXPIRY)
    sub.connect()
    sub.subscribe(topic, qos=qos)
    sub.disconnect()


def round_trip(publisher_node: Node, subscriber_node: Node, payload: bytes) -> bool:
    """A QoS 1 message published on one node reaches a subscriber on the other."""
    topic = unique("trip")
    sub = Client(endpoint(subscriber_node), client_id=unique("tripsub"), version=5)
    sub.connect()
    sub.subscribe(topic, qos=1)
    wait_rows(publisher_node, subscriber_node.node_id, 1)
    pub = Client(endpoint(publisher_node), client_id=unique("trippub"), version=5)
    pub.connect()
    pub.publish(topic, payload, qos=1)
    got = sub.expect_one(5.0).payload
    pub.disconnect()
    sub.disconnect()
    return got == payload


# ------------------------------------------------------------------ differential


def run_script(publisher_node: Node, subscriber_nodes: list[Node], root: str) -> dict:
    """Subscribers (spread over `subscriber_nodes`) subscribe, a publisher on
    `publisher_node` publishes; returns what each subscriber received, in order."""
    subscribers = [
        ("v5-wild", 5, [(f"{root}/+/temp", 1)]),
        ("v5-all", 5, [(f"{root}/#", 2)]),
        ("v311-exact", 4, [(f"{root}/a/temp", 2), (f"{root}/a/#", 0)]),
        ("v5-qos0", 5, [(f"{root}/b/temp", 0)]),
    ]
    clients = []
    for i, (name, version, filters) in enumerate(subscribers):
        node = subscriber_nodes[i % len(subscriber_nodes)]
        client = Client(endpoint(node), client_id=unique(name), version=version)
        client.connect()
        for f, qos in filters:
            client.subscribe(f, qos=qos)
        clients.append((name, client))
    # The route rows reach the publisher's node before it publishes.
    for node in {*subscriber_nodes} - {publisher_node}:
        wait_rows(publisher_node, node.node_id, 1)
    time.sleep(0.3)
    publisher = Client(endpoint(publisher_node), client_id=unique("pub"), version=5)
    publisher.connect()
    props = {"UserProperty": [("k", "v")], "ContentType": "text/plain"}
    for i in range(30):
        for topic, qos in ((f"{root}/a/temp", i % 3), (f"{root}/b/temp", 1), (f"{root}/c/x", 2)):
            publisher.publish(topic, f"{i}".encode(), qos=qos, props=props if i % 5 == 0 else None)
    publisher.disconnect()
    received = {}
    for name, client in clients:
        msgs = client.drain(1.0)
        received[name] = [
            (
                m.topic.split("/", 1)[1],
                m.payload,
                m.qos,
                m.retain,
                tuple(m.props.get("UserProperty", ())),
                m.props.get("ContentType"),
            )
            for m in msgs
        ]
        client.disconnect()
    return received


def by_flow(received: dict) -> dict:
    """Messages per subscriber, topic and delivered QoS: MQTT orders messages of one topic
    and QoS (a QoS 0 message may pass a QoS 1 one waiting for the in-flight window, on one
    node as on several)."""
    out: dict = {}
    for name, msgs in received.items():
        for m in msgs:
            out.setdefault((name, m[0], m[2]), []).append(m)
    return out


def test_any_node_same_broker_differential(nodes):
    n1, n2, n3 = nodes
    single = run_script(n1, [n1], unique("diff"))
    across = run_script(n1, [n2, n3], unique("diff"))
    # wild: a and b; all: every topic; exact: a once (overlapping filters); qos0: b.
    assert sum(len(v) for v in single.values()) == 60 + 90 + 30 + 30
    assert by_flow(across) == by_flow(single)


# ------------------------------------------------------------------ retained


def test_retained_is_readable_on_every_node_right_after_the_puback(nodes):
    n1, n2, n3 = nodes
    publisher = Client(endpoint(n1), client_id=unique("rpub"), version=5)
    publisher.connect()
    readers = {n: Client(endpoint(n), client_id=unique("rsub"), version=5) for n in (n2, n3)}
    for reader in readers.values():
        reader.connect()
    root = unique("ret")
    missing = []
    for i in range(30):
        topic = f"{root}/{i}"
        # wait=True: returns once the PUBACK is in.
        publisher.publish(topic, f"v{i}".encode(), qos=1, retain=True)
        for node, reader in readers.items():
            reader.subscribe(topic, qos=0)
            got = reader.expect_one(2.0)
            if (got.payload, got.retain) != (f"v{i}".encode(), True):
                missing.append((i, node.node_id, got))
    assert missing == []
    # Deleted on one node, gone on all.
    publisher.publish(f"{root}/0", b"", qos=1, retain=True)
    late = Client(endpoint(n3), client_id=unique("late"), version=5)
    late.connect()
    late.subscribe(f"{root}/#", qos=0)
    assert len(late.drain(0.5)) == 29
    for c in (publisher, late, *readers.values()):
        c.disconnect()


# ------------------------------------------------------------------ where traffic goes


def test_publishes_go_only_to_nodes_with_subscribers_and_once_per_node(nodes):
    n1, n2, n3 = nodes
    topic = unique("fan")
    subscribers = []
    for i in range(50):
        c = Client(endpoint(n2), client_id=unique(f"fan{i}"), version=4)
        c.connect()
        c.subscribe(topic, qos=0)
        subscribers.append(c)
    wait_rows(n1, "n2", 1)
    time.sleep(0.2)
    before_n2 = plane(n2, "n1")["messages_in"]
    before_n3 = plane(n3, "n1")["messages_in"]
    publisher = Client(endpoint(n1), client_id=unique("fanpub"), version=5)
    publisher.connect()
    for i in range(20):
        publisher.publish(topic, f"{i}".encode(), qos=1)
    for c in subscribers:
        assert [m.payload for m in c.expect(20, 5.0)] == [f"{i}".encode() for i in range(20)]
    # n2 got each message once for its 50 subscribers; n3, which has none, got nothing.
    assert plane(n2, "n1")["messages_in"] - before_n2 == 20
    assert plane(n3, "n1")["messages_in"] - before_n3 == 0
    for c in (publisher, *subscribers):
        c.disconnect()


def test_a_stalled_node_holds_only_the_publishers_that_wait_on_it_and_loses_no_qos0(nodes):
    """n2 stops reading (SIGSTOP, shorter than the failure timeout): a QoS 0 publisher on n1
    whose messages go to n2 is held once n1's queue for n2 is full, instead of n1 buffering
    without bound or dropping; a publisher whose messages go to n3 goes on meanwhile."""
    n1, n2, n3 = nodes
    slow, fast = unique("slow"), unique("fast")
    sub_slow = Client(endpoint(n2), client_id=unique("ssub"), version=5)
    sub_slow.connect()
    sub_slow.subscribe(slow, qos=1)
    sub_fast = Client(endpoint(n3), client_id=unique("fsub"), version=5)
    sub_fast.connect()
    sub_fast.subscribe(fast, qos=1)
    wait_rows(n1, "n2", 1)
    wait_rows(n1, "n3", 1)
    time.sleep(0.2)
    holds_before = plane(n1, "n2")["publisher_holds"]
    dropped_before = plane(n1, "n2")["dropped"]
    rng = random.Random(7)
    # 600 x 64 KiB that do not compress: 39 MiB, more than n1 queues for one peer (16 MiB).
    payloads = [rng.randbytes(64 * 1024) for _ in range(600)]
    heavy = Client(endpoint(n1), client_id=unique("heavy"), version=5)
    heavy.connect()
    light = Client(endpoint(n1), client_id=unique("light"), version=5)
    light.connect()
    assert n2.proc is not None
    os.kill(n2.proc.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        sender = threading.Thread(
            target=lambda: [heavy.publish(slow, p, qos=0, wait=False) for p in payloads]
        )
        sender.start()
        started = time.monotonic()
        for i in range(100):
            light.publish(fast, f"{i}".encode(), qos=1)
        light_took = time.monotonic() - started
        # Resumed well before the failure timeout (2 s), which would end the link.
        held = 0
        while not held and time.monotonic() - stopped < 1.6:
            time.sleep(0.05)
            held = plane(n1, "n2")["publisher_holds"] - holds_before
    finally:
        os.kill(n2.proc.pid, signal.SIGCONT)
    sender.join(30)
    got = [m.payload for m in sub_slow.expect(600, 30.0)]
    assert got == payloads
    assert held >= 1
    assert plane(n1, "n2")["dropped"] == dropped_before
    assert len(sub_fast.expect(100, 5.0)) == 100
    assert light_took < 1.0, f"a publisher to n3 waited {light_took:.2f}s behind n2"
    for c in (heavy, light, sub_slow, sub_fast):
        c.disconnect()


# ------------------------------------------------------------------ shared subscriptions


def test_shared_subscription_members_on_every_node_share_the_load(nodes):
    topic = unique("share")
    members = []
    for node in nodes:
        c = Client(endpoint(node), client_id=unique(f"member-{node.node_id}"), version=5)
        c.connect()
        c.subscribe(f"$share/workers/{topic}/#", qos=1)
        members.append(c)
    for node in nodes[1:]:
        wait_rows(nodes[0], node.node_id, 1)
    time.sleep(0.2)
    publisher = Client(endpoint(nodes[0]), client_id=unique("sharepub"), version=5)
    publisher.connect()
    for i in range(60):
        publisher.publish(f"{topic}/job", f"{i}".encode(), qos=1)
    got = [[m.payload for m in c.drain(1.0)] for c in members]
    everything = sorted((p for per_member in got for p in per_member), key=int)
    # Each message to exactly one member cluster-wide, and every node's member got a share.
    assert everything == [f"{i}".encode() for i in range(60)]
    assert all(len(per_member) >= 10 for per_member in got), [len(g) for g in got]
    for c in (publisher, *members):
        c.disconnect()


# ------------------------------------------------------------------ wills


def test_a_will_fires_once_on_every_node(nodes):
    n1, n2, n3 = nodes
    topic = unique("will")
    watchers = []
    for node in (n2, n3):
        c = Client(endpoint(node), client_id=unique("watch"), version=5)
        c.connect()
        c.subscribe(topic, qos=1)
        watchers.append(c)
    wait_rows(n1, "n2", 1)
    wait_rows(n1, "n3", 1)
    time.sleep(0.2)
    sock, _ = r.connect_client(
        n1.ip, n1.mqtt_port, unique("dying"), will_topic=topic, will_payload=b"gone", will_qos=1
    )
    sock.close()  # no DISCONNECT: the will is published
    for c in watchers:
        assert [m.payload for m in c.drain(1.0)] == [b"gone"]
        c.disconnect()


# ------------------------------------------------------------------ faults


def stream(publisher: Client, topic: str, qos: int, count: int, during=None) -> list[bytes]:
    """Publishes `count` messages, each acknowledged before the next; `during(i)` runs
    before message i. Returns the payloads acknowledged."""
    acked = []
    for i in range(count):
        if during is not None:
            during(i)
        payload = f"{i}".encode()
        publisher.publish(topic, payload, qos=qos, timeout=10.0)
        acked.append(payload)
    return acked


def all_acknowledged(infos: list[Any], timeout: float) -> None:
    """Every publish sent with wait=False (paho's message infos) is acknowledged."""
    for info in infos:
        info.wait_for_publish(timeout)
        assert info.is_published()


@pytest.mark.parametrize("qos", [1, 2])
def test_a_cut_link_loses_nothing_acknowledged_and_duplicates_no_qos2(nodes, qos):
    n1, n2, _ = nodes
    topic = unique(f"cut{qos}")
    subscriber = Client(endpoint(n2), client_id=unique("cutsub"), version=5)
    subscriber.connect()
    subscriber.subscribe(topic, qos=qos)
    wait_rows(n1, "n2", 1)
    time.sleep(0.2)
    publisher = Client(endpoint(n1), client_id=unique("cutpub"), version=5)
    publisher.connect()
    resent_before = plane(n1, "n2")["resent"]

    def cut(i: int) -> None:
        if i == 100:
            n1.block(["n2"])
        elif i == 250:
            n1.block([])

    acked = stream(publisher, topic, qos, 400, cut)
    wait_for(lambda: links_up(n1, ["n2"]), 10, "the link back", n1, n2)
    got = [m.payload for m in subscriber.drain(2.0)]
    assert sorted(set(got), key=int) == acked, f"{len(got)} of {len(acked)}"
    if qos == 2:
        assert len(got) == len(set(got)), "a QoS 2 message was delivered twice"
    # Publishes made while the link was down were kept and sent when it came back.
    assert plane(n1, "n2")["resent"] >= resent_before
    publisher.disconnect()
    subscriber.disconnect()


def serving(node: Node) -> bool:
    """The node's MQTT port accepts connections."""
    try:
        socket.create_connection((node.ip, node.mqtt_port), timeout=0.5).close()
    except OSError:
        return False
    return True


def connect_retrying(node: Node, prefix: str) -> Client:
    """A clean MQTT 5 client connected to `node`. A node that opened its port but has not
    the cluster's map yet refuses with 0x88 (a joining node makes no sessions): a client
    tries again, as this one does."""
    deadline = time.monotonic() + 10
    while True:
        client = Client(endpoint(node), client_id=unique(prefix), version=5)
        try:
            client.connect()
            return client
        except MqttError:
            client.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def retained_values(node: Node, filter_: str, quiet: float = 0.5) -> dict[str, bytes]:
    """topic -> payload of what a new subscriber to `filter_` on `node` gets as retained."""
    reader = connect_retrying(node, "rread")
    reader.subscribe(filter_, qos=0)
    got = {m.topic: m.payload for m in reader.drain(quiet)}
    reader.disconnect()
    return got


def test_a_node_killed_mid_stream_stalls_no_publisher_and_comes_back_with_the_retained_set(
    tmp_path,
):
    with Cluster(tmp_path) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        topic = unique("kill")
        root = unique("back")
        publisher = Client(endpoint(n1), client_id=unique("kpub"), version=5)
        publisher.connect()
        publisher.publish(f"{root}/gone", b"old", qos=1, retain=True)
        subs = {}
        for node in (n2, n3):
            c = Client(endpoint(node), client_id=unique("ksub"), version=5)
            c.connect()
            c.subscribe(topic, qos=1)
            subs[node.node_id] = c
            wait_rows(n1, node.node_id, 1)
        time.sleep(0.2)
        started = time.monotonic()
        acked = stream(publisher, topic, 1, 300, lambda i: i == 100 and n3.kill())
        # Acknowledgements did not wait for the dead node (nor for the failure timeout).
        assert time.monotonic() - started < 15
        got = [m.payload for m in subs["n2"].drain(2.0)]
        assert got == acked
        subs["n2"].disconnect()

        # While n3 is dead: retained messages set and one it holds deleted. Back, it has
        # the cluster's retained set before it serves its first subscribe.
        for i in range(40):
            publisher.publish(f"{root}/{i}", f"v{i}".encode(), qos=1, retain=True)
        publisher.publish(f"{root}/gone", b"", qos=1, retain=True)
        publisher.disconnect()
        # Its peers refuse its links at first: it must not serve clients meanwhile.
        for node in (n1, n2):
            node.block(["n3"])
        cluster.start(3, join=cluster.seeds(1))
        assert not serving(n3)
        for node in (n1, n2):
            node.block([])
        wait_for(lambda: serving(n3), 20, "n3 serving", n3)
        got = retained_values(n3, f"{root}/#")
        assert sorted(got) == sorted(f"{root}/{i}" for i in range(40))
        assert got[f"{root}/7"] == b"v7"

        # A node joining for the first time (no map yet) waits the same way.
        for node in (n1, n2, n3):
            node.block(["n4"])
        n4 = cluster.start(4, join=cluster.seeds(1))
        assert not serving(n4)
        for node in (n1, n2, n3):
            node.block([])
        wait_for(lambda: serving(n4), 20, "n4 serving", n4)
        got = retained_values(n4, f"{root}/#")
        assert sorted(got) == sorted(f"{root}/{i}" for i in range(40))


def test_acknowledged_messages_for_a_dead_node_survive_the_publishing_node_dying_too(tmp_path):
    """n3 (holding a persistent session) is dead; n1 acknowledges QoS 1 publishes for it at
    once, keeping them on its disk (2.7 MiB, past the 1 MiB it keeps in memory for a down
    peer); n1 is SIGKILLed too. Both come back: the session gets every acknowledged message,
    in order, the most of them read back from n1's disk as the link drains."""
    with Cluster(tmp_path, {"outbox_memory_mb": 1}) as cluster:
        n1, _, n3 = start_cluster(cluster, 3)
        topic = unique("outbox")
        session = unique("offline")
        sub = Client(endpoint(n3), client_id=session, version=4, clean=False)
        sub.connect()
        sub.subscribe(topic, qos=1)
        wait_rows(n1, "n3", 1)
        sub.disconnect()
        n3.kill()
        publisher = Client(endpoint(n1), client_id=unique("opub"), version=5)
        publisher.connect()
        rng = random.Random(3)
        # 900: under the session's queue limit (max_queued_messages, 1000).
        payloads = [i.to_bytes(4, "big") + rng.randbytes(3 * 1024) for i in range(900)]
        started = time.monotonic()
        infos = [publisher.publish(topic, p, qos=1, wait=False) for p in payloads]
        all_acknowledged(infos, 20)
        assert time.monotonic() - started < 20
        n1.kill()
        cluster.start(1, wait=False)
        cluster.start(3, wait=False, join=cluster.seeds(2))
        wait_for(lambda: serving(n1) and serving(n3), 20, "n1 and n3 serving", n1, n3)
        sub = Client(endpoint(n3), client_id=session, version=4, clean=False)
        sub.connect()
        got = [m.payload for m in sub.expect(900, 30.0)]
        assert [g[:4] for g in got] == [p[:4] for p in payloads]
        assert got == payloads
        # Most of it came back from n1's disk, and none of it is left there.
        assert plane(n1, "n3")["read_back"] > 0
        wait_for(lambda: plane(n1, "n3")["unacked_bytes"] == 0, 5, "queue drained", n1)
        sub.disconnect()


def test_a_node_restarted_while_a_peer_is_out_of_reach_keeps_publishes_for_its_sessions(
    tmp_path,
):
    """n2 homes an offline persistent session. n3 is SIGKILLed and comes back while its
    links to n2 are cut (n2 blocks them; n1, the leader, reaches both, so no one is removed):
    it routes by the rows of n2 it kept on its disk, so the QoS 1 messages published on it
    are kept for n2 and reach the session once the links are back. Before, a restarted node
    knew no rows of a peer out of its reach, and dropped them."""
    with Cluster(tmp_path) as cluster:
        _, n2, n3 = start_cluster(cluster, 3)
        topic, session = unique("rows"), unique("dev")
        expiry = EXPIRY
        parked_session(n2, session, topic, 1)
        wait_rows(n3, "n2", 1)
        n3.kill()
        n2.block(["n3"])
        # It serves once n2's retained set came or the failure timeout passed.
        cluster.start(3, join=cluster.seeds(1))
        wait_for(lambda: serving(n3), 20, "n3 serving", n3)
        assert not plane(n3, "n2")["up"]
        assert plane(n3, "n2")["route_rows"] == 1
        publisher = connect_retrying(n3, "rpub")
        payloads = [f"{i}".encode() for i in range(20)]
        all_acknowledged([publisher.publish(topic, p, qos=1, wait=False) for p in payloads], 10)
        n2.block([])
        sub = Client(endpoint(n2), client_id=session, version=5, clean=False, props=expiry)
        assert sub.connect().session_present
        assert [m.payload for m in sub.expect(20, 10.0)] == payloads
        assert sub.drain(0.5) == []
        for c in (sub, publisher):
            c.disconnect()


def test_a_node_cut_off_alone_resumes_no_session_from_its_copy(tmp_path):
    """n3 holds the copy of a session homed on n1 (a QoS 2 message queued for it) and is
    cut off alone. The home may live on beyond the split as far as n3 can tell, so n3 does
    not resume the session from its copy (the client would get again there what the home
    gave it meanwhile) nor give it a fresh one (which would leave the message in the copy):
    it refuses the CONNECT (0x88), past the failure timeout too. After the heal the
    session resumes with the message, once."""
    with Cluster(tmp_path) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        owners = compute_map(["n1", "n2", "n3"]).replicas
        dev = next(
            cid
            for cid in (unique("dev") for _ in range(1000))
            if set(owners[partition_of(cid.encode(), len(owners))]) == {"n1", "n3"}
        )
        topic = unique("side")
        expiry = EXPIRY
        parked_session(n1, dev, topic, 2)
        wait_rows(n2, "n1", 1)
        publisher = Client(endpoint(n2), client_id=unique("sidepub"), version=5)
        publisher.connect()
        # Acknowledged once n1 and n3 (the copy) have it (ack_replicas = 2).
        all_acknowledged([publisher.publish(topic, b"m1", qos=2, wait=False)], 10)
        n3.block(["n1", "n2"])
        wait_for(lambda: not plane(n3, "n1")["up"] and not plane(n3, "n2")["up"], 5, "cut", n3)
        # Past the claim's wait for a silent home (the failure timeout and 2 s), a node
        # that acts would answer from its copy.
        time.sleep(4.5)
        there = Client(endpoint(n3), client_id=dev, version=5, clean=False, props=expiry)
        there.connect(expect_rc=0x88)
        there.close()
        n3.block([])
        wait_for(lambda: links_up(n3, ["n1", "n2"]), 20, "links back", n1, n3)
        back = Client(endpoint(n1), client_id=dev, version=5, clean=False, props=expiry)
        assert back.connect().session_present
        assert [m.payload for m in back.expect(1, 5.0)] == [b"m1"]
        assert back.drain(1.0) == []
        for c in (back, publisher):
            c.disconnect()


def test_a_client_kicked_through_one_node_loses_its_connection_and_session_on_another(nodes):
    n1, n2, n3 = nodes
    expiry = {"SessionExpiryInterval": 300}
    v5, v3 = unique("kick5"), unique("kick3")
    c5 = Client(endpoint(n3), client_id=v5, version=5, clean=False, props=expiry)
    c5.connect()
    c5.subscribe(f"{v5}/cmd", qos=1)
    c3 = Client(endpoint(n2), client_id=v3, version=4, clean=False)
    c3.connect()
    c3.subscribe(f"{v3}/cmd", qos=1)

    def sessions_of(node_id: str) -> int:
        members = n1.request("GET", "/cluster/status")["members"]
        return next(m["sessions"] or 0 for m in members if m["node_id"] == node_id)

    # Every node's sessions, as its pings report them.
    wait_for(lambda: sessions_of("n2") >= 1 and sessions_of("n3") >= 1, 5, "sessions", n1)
    # Which node holds a client's session (the fault suite's final reads).
    held = [n.request("GET", f"/clients/{v5}")["session"] for n in (n1, n2, n3)]
    assert held == [None, None, "connected"]
    assert "error" in n1.request("GET", "/clients/%FF")
    # The CLI, through n1's admin endpoint (n1 holds neither).
    kicked = subprocess.run(
        [sys.executable, "-m", "fastbroker", "clients", "kick", v5, "--admin", n1.admin],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert kicked.returncode == 0, kicked.stderr
    assert f"kicked {v5}" in kicked.stdout and "not held on this node" in kicked.stdout
    wait_for(lambda: c5.disconnect_rc is not None, 5, "the kicked client disconnected", n3)
    assert c5.disconnect_rc == 0x98 and c5.disconnect_from_server
    assert n3.request("GET", f"/clients/{v5}")["session"] is None
    # The endpoint itself; a 3.1.1 client is just closed.
    assert n1.request("POST", "/clients/kick", {"client_id": v3}) == {
        "client_id": v3,
        "held_here": False,
    }
    wait_for(lambda: c3.disconnect_rc is not None, 5, "the kicked client disconnected", n2)
    # Their sessions went with them: a reconnect finds none.
    for node, cid, version, props in ((n3, v5, 5, expiry), (n2, v3, 4, None)):
        again = Client(endpoint(node), client_id=cid, version=version, clean=False, props=props)
        assert not again.connect().session_present
        again.disconnect()
    assert "error" in n1.request("POST", "/clients/kick", {"client": v3})


def test_sys_topics_show_clients_per_node_and_the_traffic_of_each_link(tmp_path):
    """$SYS stays on its node (never forwarded): a client sees its node's own figures, and
    under $SYS/broker/cluster/ every member's clients and this node's links."""
    with Cluster(tmp_path, sys_interval=0.5) as cluster:
        n1, n2 = start_cluster(cluster, 2)
        watcher = Client(endpoint(n2), client_id=unique("sys"), version=5)
        watcher.connect()
        watcher.subscribe("$SYS/#", qos=0)
        others = [Client(endpoint(n1), client_id=unique("sysc"), version=5) for _ in range(2)]
        for c in others:
            c.connect()
        seen: dict[str, bytes] = {}

        def got(topic: str, payload: bytes | None = None) -> bool:
            for m in watcher.drain(0.1):
                seen[m.topic] = m.payload
            return topic in seen and (payload is None or seen[topic] == payload)

        members = "$SYS/broker/cluster/members"
        wait_for(lambda: got(f"{members}/n1/clients/connected", b"2"), 10, "n1's clients", n2)
        wait_for(lambda: got(f"{members}/n2/clients/connected", b"1"), 10, "n2's clients", n2)
        link = "$SYS/broker/cluster/links/n1"
        wait_for(lambda: got(f"{link}/queue/bytes"), 10, "n2's link to n1", n2)
        assert seen["$SYS/broker/cluster/node"] == b"n2"
        assert seen[f"{link}/up"] == b"1"
        assert int(seen[f"{link}/frames/sent"]) > 0 and int(seen[f"{link}/bytes/received"]) > 0
        # This node's own count, not n1's.
        assert got("$SYS/broker/clients/connected", b"1")
        for c in [*others, watcher]:
            c.disconnect()


def test_concurrent_retained_writes_on_different_nodes_end_in_one_value(nodes):
    n1, n2, n3 = nodes
    root = unique("race")
    topics = [f"{root}/{i}" for i in range(20)]
    writers = [Client(endpoint(n), client_id=unique("rw"), version=5) for n in (n1, n2, n3)]
    for w in writers:
        w.connect()
    start = threading.Barrier(len(writers))

    def write(w: Client, k: int) -> None:
        start.wait()
        infos = []
        for round_ in range(5):
            for t in topics:
                # Some writes delete: deletions race with sets too.
                payload = b"" if (round_ + k) % 3 == 0 else f"w{k}-{round_}".encode()
                infos.append(w.publish(t, payload, qos=1, retain=True, wait=False))
        for info in infos:
            info.wait_for_publish(10)

    threads = [threading.Thread(target=write, args=(w, k)) for k, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for w in writers:
        w.disconnect()
    time.sleep(0.5)
    values = [retained_values(n, f"{root}/#") for n in (n1, n2, n3)]
    assert values[0] == values[1] == values[2]
    # Each value is the last write of one of the writers (or a deletion).
    assert all(v.decode().endswith("-4") for v in values[0].values()), values[0]


def test_a_peer_sending_malformed_batches_is_dropped_and_changes_nothing(nodes):
    """A peer that holds the secret but sends garbage as data batches (and a batch with an
    invalid route filter) loses its link; the node logs why and keeps routing."""
    n1, n2, _ = nodes
    rows_before = {p: plane(n2, p)["route_rows"] for p in ("n1", "n3")}

    async def hostile() -> list[str]:
        loop = asyncio.get_running_loop()
        downs: list[str] = []
        ups: list[str] = []
        transport = Transport(
            loop,
            node_id="hostile",
            cluster_name="fastbroker",
            secret=SECRET.encode(),
            advertise="127.0.0.1:9",
            on_message=lambda *a: None,
            on_data_up=ups.append,
            on_data_down=downs.append,
        )
        transport.set_targets({parse_address(n2.cluster_address)})
        # "hostile" < "n2": it dials the data link, once the control link is up.
        for payload in (b"junk", bad_route_batch()):
            deadline = loop.time() + 5
            while "n2" not in transport.data_links and loop.time() < deadline:
                transport.maintain()
                await asyncio.sleep(0.05)
            link = transport.data_links["n2"]
            link.write_frames(fastbroker_core.encode_frame(DATA, payload), 1)
            deadline = loop.time() + 5
            while "n2" in transport.data_links and loop.time() < deadline:
                await asyncio.sleep(0.05)
        await transport.close()
        return downs

    downs = asyncio.run(hostile())
    assert downs == ["n2", "n2"]
    log = n2.log()
    assert "malformed data batch: unknown batch version" in log
    assert "malformed data batch: invalid route filter" in log
    assert {p: plane(n2, p)["route_rows"] for p in ("n1", "n3")} == rows_before
    # n2 still routes what n1 forwards.
    assert round_trip(n1, n2, b"still")


def bad_route_batch() -> bytes:
    """A well-formed batch (version 1, no compression) with one route row that is not a
    valid filter."""
    filter_ = b"a/#/b"
    item = b"\x02" + (1).to_bytes(8, "little") + len(filter_).to_bytes(4, "little") + filter_
    items = (1).to_bytes(4, "little") + item
    header = b"\x01\x00" + (7).to_bytes(8, "little") + (1).to_bytes(8, "little") + bytes(16)
    return header + len(items).to_bytes(4, "little") + items


@pytest.fixture(autouse=True)
def _quiet_threads():
    # paho threads of a failed test must not outlive it.
    yield
    for t in threading.enumerate():
        if t.name.startswith("paho") and t.is_alive():
            t.join(0.5)


# ------------------------------------------------------------------ TLS links


def test_links_over_tls_with_mutual_authentication(tmp_path):
    """With [cluster] tls_* set, links are TLS both ways: messages cross them, and a node
    whose certificate comes from another CA (holding the right secret) is never linked."""
    certs = tmp_path / "certs"
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    certs.mkdir()
    ca = make_ca(certs, "cluster-ca")
    other_ca = make_ca(certs, "other-ca")
    usage = (
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    keys = {i: make_leaf(certs, ca, f"n{i}", f"n{i}", usage) for i in (1, 2)}
    keys[3] = make_leaf(certs, other_ca, "n3", "n3", usage)

    def tls(i: int, authority) -> dict[str, str]:
        pair = keys[i]
        return {
            "tls_certfile": str(pair.cert),
            "tls_keyfile": str(pair.key),
            "tls_cafile": str(authority.cert),
        }

    with Cluster(tmp_path / "nodes") as cluster:
        n1 = cluster.start(1, wait=False, **tls(1, ca))
        n2 = cluster.start(2, wait=False, join=cluster.seeds(1), **tls(2, ca))
        n3 = cluster.start(3, wait=False, join=cluster.seeds(1), **tls(3, other_ca))
        cluster.wait_converged(["n1", "n2"], 30, on=[n1, n2])
        wait_for(lambda: links_up(n1, ["n2"]) and links_up(n2, ["n1"]), 15, "TLS link", n1, n2)
        assert round_trip(n1, n2, b"secret")
        status1 = n1.status()
        assert status1 is not None and status1["links"]["n2"]["tls"] in ("TLSv1.2", "TLSv1.3")
        # n3 holds the secret but not a certificate of the cluster's CA: never linked.
        status3 = n3.status()
        assert status3 is not None and not status3["member"]
        assert status3["data_plane"] == {}
        assert "n3" not in (n1.status() or {}).get("data_plane", {})


# ------------------------------------------------------------------ sessions across nodes
# Last in the module: the relays they leave behind end a few seconds later, changing route
# rows that earlier tests compare.


def test_a_persistent_session_follows_its_client_from_node_to_node(nodes):
    """The client reconnects to another node each time: session present, no subscribe
    again, what was queued for it (QoS 1 and 2) in order; a connection still open on the
    old node is taken over with 0x8E."""
    n1, n2, n3 = nodes
    cid, topic = unique("roam"), unique("roam/cmd")
    expiry = {"SessionExpiryInterval": 300}
    publisher = Client(endpoint(n3), client_id=unique("rpub"), version=5)
    publisher.connect()
    sub = Client(endpoint(n1), client_id=cid, version=5, clean=False, props=expiry)
    sub.connect()
    sub.subscribe(topic, qos=2)
    wait_rows(n3, "n1", 1)
    sent: list[bytes] = []
    for hop, node in enumerate((n2, n3, n1, n2)):
        sub.disconnect()
        for i in range(20):
            payload = f"{hop}-{i}".encode()
            publisher.publish(topic, payload, qos=1 + i % 2)
            sent.append(payload)
        sub = Client(endpoint(node), client_id=cid, version=5, clean=False, props=expiry)
        assert sub.connect().session_present
        got = [m.payload for m in sub.expect(20, 10.0)]
        # In order per QoS (paho hands a QoS 2 message over at PUBREL, after the QoS 1
        # ones that came with it).
        for qos in (1, 2):
            mine = [p for p in sent[-20:] if int(p.split(b"-")[1]) % 2 == qos - 1]
            assert [p for p in got if p in mine] == mine, (hop, qos, got)
        assert sorted(got) == sorted(sent[-20:])
    # n2 received the session twice (from n1, then from n3), as its metrics say.
    with urllib.request.urlopen(f"http://{n2.admin}/metrics", timeout=5) as response:
        text = response.read().decode()
    received = [
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("fastbroker_cluster_sessions_received_total")
    ]
    assert received and received[0] >= 2, received
    # Still connected on n2: a connect on n3 takes it over.
    taker = Client(endpoint(n3), client_id=cid, version=5, clean=False, props=expiry)
    assert taker.connect().session_present
    wait_for(lambda: sub.disconnect_rc is not None, 5, "the old connection closed", n2)
    assert sub.disconnect_rc == 0x8E
    publisher.publish(topic, b"last", qos=1)
    assert [m.payload for m in taker.expect(1, 5.0)] == [b"last"]
    taker.disconnect()
    publisher.disconnect()


def test_a_session_moving_mid_stream_loses_nothing_acknowledged(nodes):
    """A QoS 1 stream from n3 runs while its persistent subscriber hops between n1 and n2:
    the route rows move under the stream, and the old home relays what still reaches it.
    Every acknowledged message arrives (QoS 1 may repeat one whose PUBACK a hop cut off)."""
    n1, n2, n3 = nodes
    cid, topic = unique("hop"), unique("hop/cmd")
    expiry = {"SessionExpiryInterval": 300}
    sub = Client(endpoint(n1), client_id=cid, version=5, clean=False, props=expiry)
    sub.connect()
    sub.subscribe(topic, qos=1)
    wait_rows(n3, "n1", 1)
    publisher = Client(endpoint(n3), client_id=unique("hpub"), version=5)
    publisher.connect()
    acked: list[bytes] = []

    def publish() -> None:
        for i in range(400):
            publisher.publish(topic, i.to_bytes(4, "big"), qos=1)
            acked.append(i.to_bytes(4, "big"))
            time.sleep(0.002)

    sender = threading.Thread(target=publish)
    sender.start()
    got: list[bytes] = []

    def take(client: Client, seconds: float) -> list[bytes]:
        end, out = time.monotonic() + seconds, []
        while (left := end - time.monotonic()) > 0:
            try:
                out.append(client.messages.get(timeout=left).payload)
            except queue.Empty:
                break
        return out

    hops = 0
    while sender.is_alive() and hops < 12:
        got += take(sub, 0.15)
        sub.disconnect()
        got += [m.payload for m in sub.drain(0.0)]
        hops += 1
        node = (n2, n1)[hops % 2]
        sub = Client(endpoint(node), client_id=cid, version=5, clean=False, props=expiry)
        assert sub.connect().session_present
    sender.join(60)
    assert len(acked) == 400 and hops >= 3
    deadline = time.monotonic() + 10
    while set(acked) - set(got) and time.monotonic() < deadline:
        got += [m.payload for m in sub.drain(0.3)]
    missing = sorted(int.from_bytes(m, "big") for m in set(acked) - set(got))
    assert not missing, f"{len(missing)} acknowledged messages lost over {hops} hops: {missing}"
    sub.disconnect()
    publisher.disconnect()


class Qos2Receiver:
    """A raw MQTT 3.1.1 persistent subscriber that keeps its QoS 2 state across connections,
    as the protocol requires of a client: a message is taken at its first PUBLISH, and a
    PUBLISH with a packet id awaiting PUBREL is the same message again (not taken twice)."""

    def __init__(self, client_id: str, topic: str) -> None:
        self.client_id, self.topic = client_id, topic
        self.got: list[bytes] = []
        self.awaiting_pubrel: set[int] = set()
        self.sock: socket.socket | None = None
        self.reader: r.Reader | None = None

    def connect(self, node: Node, first: bool = False) -> bool:
        sock, ack = r.connect_client(node.ip, node.mqtt_port, self.client_id, clean=False)
        self.sock, self.reader = sock, r.Reader(sock)
        if first:
            sock.sendall(r.subscribe(1, [(self.topic, 2)]))
            while self.reader.read().type != r.SUBACK:
                pass
        return ack.session_present

    def pump(self, seconds: float) -> None:
        assert self.sock is not None and self.reader is not None
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            for p in self.reader.read_available(min(left, 0.05)):
                if p.type == r.PUBLISH:
                    pub = r.parse_publish(p)
                    assert pub.qos == 2 and pub.packet_id is not None
                    if pub.packet_id not in self.awaiting_pubrel:
                        self.got.append(pub.payload)
                        self.awaiting_pubrel.add(pub.packet_id)
                    self.sock.sendall(r.pubrec(pub.packet_id))
                elif p.type == r.PUBREL:
                    pid, _ = r.parse_ack(p)
                    self.awaiting_pubrel.discard(pid)
                    self.sock.sendall(r.pubcomp(pid))

    def drop(self) -> None:
        """The connection ends without DISCONNECT, whatever is in flight."""
        assert self.sock is not None
        self.sock.close()
        self.sock = self.reader = None


def test_a_session_moving_mid_qos2_stream_gets_every_message_exactly_once_in_order(nodes):
    """A QoS 2 stream from n3 (each publish completed, PUBCOMP, before the next) while its
    persistent subscriber hops between n1 and n2, its connection cut wherever the QoS 2
    exchanges stand: every message exactly once, in publish order. (Before message ids, a
    session coming back to a node whose relay for it was still on got a message twice, in
    1 of 15 runs: through the relay and in the records handed over.)"""
    n1, n2, n3 = nodes
    cid, topic = unique("hop2"), unique("hop2/cmd")
    sub = Qos2Receiver(cid, topic)
    sub.connect(n1, first=True)
    wait_rows(n3, "n1", 1)
    publisher = Client(endpoint(n3), client_id=unique("h2pub"), version=5)
    publisher.connect()
    sent: list[bytes] = []

    def publish() -> None:
        for i in range(150):
            publisher.publish(topic, i.to_bytes(4, "big"), qos=2, timeout=10.0)
            sent.append(i.to_bytes(4, "big"))
            time.sleep(0.002)

    sender = threading.Thread(target=publish)
    sender.start()
    hops = 0
    while sender.is_alive() and hops < 12:
        sub.pump(0.15)
        sub.drop()
        hops += 1
        assert sub.connect((n2, n1)[hops % 2])
    sender.join(60)
    assert len(sent) == 150 and hops >= 3
    deadline = time.monotonic() + 10
    while len(sub.got) < len(sent) and time.monotonic() < deadline:
        sub.pump(0.3)
    sub.pump(0.5)
    got = [int.from_bytes(g, "big") for g in sub.got]
    assert sorted(set(got)) == list(range(150)), f"missing over {hops} hops"
    assert len(got) == len(set(got)), f"delivered twice over {hops} hops"
    assert got == sorted(got), f"out of order over {hops} hops: {got}"
    sub.drop()
    publisher.disconnect()


def test_racing_connects_with_one_client_id_on_three_nodes_leave_one(nodes):
    cid = unique("race")
    clients = [
        Client(
            endpoint(nodes[i % 3]),
            client_id=cid,
            version=5,
            clean=False,
            props={"SessionExpiryInterval": 60},
        )
        for i in range(12)
    ]
    threads = [threading.Thread(target=c.connect, kwargs={"expect_rc": None}) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)

    def survivors() -> list[Client]:
        return [c for c in clients if c.connack is not None and c.disconnect_rc is None]

    wait_for(lambda: len(survivors()) <= 1, 10, "one survivor", *nodes)
    time.sleep(1.0)
    alive = survivors()
    assert len(alive) == 1, [(c.connack, c.disconnect_rc) for c in clients]
    for c in clients:
        c.disconnect()


def metric(node: Node, name: str) -> float:
    with urllib.request.urlopen(f"http://{node.admin}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = [
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{PREFIX}{name}")
    ]
    return sum(values)


PREFIX = "fastbroker_"


def watch_wills(node: Node, *publishers: Node) -> Client:
    """A subscriber to wills/# on `node`, once `publishers` have its route row."""
    watcher = Client(endpoint(node), client_id=unique("watch"), version=5)
    watcher.connect()
    watcher.subscribe("wills/#", qos=1)
    for p in publishers:
        wait_rows(p, node.node_id, 1)
    return watcher


def connect_with_will(node: Node, client_id: str, clean: bool) -> socket.socket:
    """A raw MQTT 3.1.1 connection to `node` whose will (QoS 1) is "gone" on wills/<id>."""
    sock, _ = r.connect_client(
        node.ip,
        node.mqtt_port,
        client_id,
        clean=clean,
        will_topic=f"wills/{client_id}",
        will_payload=b"gone",
        will_qos=1,
    )
    return sock


def will_copies(*nodes: Node) -> float:
    return sum(metric(n, "cluster_will_copies") for n in nodes)


def test_wills_of_clean_sessions_on_a_killed_node_are_published_once(tmp_path):
    """The usual fleet pattern: devices with clean sessions and a will ("offline") on n1.
    "sensor" stays connected, "quiet" says DISCONNECT first (no will), "back" reconnects
    on n2 right after n1 is SIGKILLed (its old connection's will comes before its new
    CONNACK, as a takeover on one node). sensor's will comes once, after the failure
    timeout, from an owner of its partition; nothing more when n1 comes back."""
    with Cluster(tmp_path) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        watcher = watch_wills(n3, n1, n2)
        ids = {name: unique(name) for name in ("sensor", "quiet", "back")}
        socks = {}
        for name, cid in ids.items():
            socks[name], _ = r.connect_client(
                n1.ip, n1.mqtt_port, cid, will_topic=f"wills/{name}", will_payload=b"offline"
            )

        # Each will is copied to the owners of its partition besides n1 (1 or 2 of them).
        wait_for(lambda: will_copies(n2, n3) >= 3, 5, "will copies", n2, n3)
        before = will_copies(n2, n3)
        socks["quiet"].sendall(r.disconnect())
        wait_for(lambda: will_copies(n2, n3) < before, 5, "quiet's will copies dropped", n2, n3)
        n1.kill()
        killed = time.monotonic()
        # "back" reconnects on n2 before the failure timeout (once n2 and n3 saw the link
        # to n1 drop): its old will first.
        gone = lambda n: not plane(n, "n1")["up"]  # noqa: E731
        wait_for(lambda: gone(n2) and gone(n3), 2, "links to n1 down", n2, n3)
        again, _ = r.connect_client(n2.ip, n2.mqtt_port, ids["back"])
        got = watcher.expect(1, 5.0)
        assert [(m.topic, m.payload) for m in got] == [("wills/back", b"offline")]
        assert time.monotonic() - killed < 1.5
        # sensor's: once, after the failure timeout.
        got = watcher.expect(1, 15.0)
        assert [(m.topic, m.payload) for m in got] == [("wills/sensor", b"offline")]
        assert time.monotonic() - killed >= 1.5
        published = sum(metric(n, "cluster_wills_published_for_dead_nodes") for n in (n2, n3))
        assert published == 2
        cluster.start(1, join=cluster.seeds(2))
        wait_for(lambda: serving(n1), 20, "n1 serving", n1)
        assert [m.topic for m in watcher.drain(1.5)] == []
        again.close()
        for sock in socks.values():
            sock.close()
        watcher.disconnect()


def test_a_node_killed_and_restarted_at_once_has_its_dead_connections_wills_published(
    tmp_path,
):
    """A supervisor (systemd, Kubernetes) brings a SIGKILLed node back well within the
    failure timeout (20 s here): its clean-session connections died with it, so their wills
    go out once it is back, from an owner of their partitions, and not again later."""
    with Cluster(tmp_path, settings={"failure_timeout_ms": 20_000}) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        watcher = watch_wills(n3, n1, n2)
        sensor, _ = r.connect_client(
            n1.ip, n1.mqtt_port, unique("sensor"), will_topic="wills/s", will_payload=b"off"
        )

        wait_for(lambda: will_copies(n2, n3) >= 1, 5, "will copies", n2, n3)
        n1.kill()
        killed = time.monotonic()
        cluster.start(1, join=cluster.seeds(2))
        got = watcher.expect(1, 15.0)
        assert [(m.topic, m.payload) for m in got] == [("wills/s", b"off")]
        assert time.monotonic() - killed < 20.0
        assert will_copies(n2, n3) == 0
        published = sum(metric(n, "cluster_wills_published_for_dead_nodes") for n in (n2, n3))
        assert published == 1
        assert watcher.drain(1.5) == []
        sensor.close()
        watcher.disconnect()


def test_after_a_power_cut_of_the_whole_cluster_a_clean_sessions_will_is_published_once(
    tmp_path,
):
    """Every node SIGKILLed at once and started again: the owners read the will copy of
    "sensor" (clean session, retained will, connected to n1) back from their disks, and one
    of them publishes it once n1 is back with a new incarnation (or the failure timeout
    passed)."""
    with Cluster(tmp_path) as cluster:
        nodes = start_cluster(cluster, 3)
        n1, n2, n3 = nodes
        sensor, _ = r.connect_client(
            n1.ip,
            n1.mqtt_port,
            unique("sensor"),
            will_topic="wills/power",
            will_payload=b"off",
            will_retain=True,
        )
        wait_for(lambda: will_copies(n2, n3) >= 1, 5, "will copies", n2, n3)
        time.sleep(1.5)  # owners write a copy to their stores once it has lived a second
        for node in nodes:
            node.kill()
        sensor.close()
        for i in (1, 2, 3):
            cluster.start(i, wait=False, join=cluster.seeds(*(j for j in (1, 2, 3) if j != i)))
        for node in nodes:
            wait_for(lambda n=node: serving(n), 20, "serving again", node)
        published = lambda: sum(  # noqa: E731
            metric(n, "cluster_wills_published_for_dead_nodes") for n in nodes
        )
        wait_for(lambda: published() >= 1, 10, "the will published", *nodes)
        watcher = Client(endpoint(n3), client_id=unique("watch"), version=5)
        watcher.connect()
        watcher.subscribe("wills/#", qos=1)
        got = watcher.expect(1, 5.0)
        assert [(m.topic, m.payload) for m in got] == [("wills/power", b"off")]
        time.sleep(2.5)  # past the failure timeout: nothing more
        assert published() == 1
        assert will_copies(n2, n3) == 0
        watcher.disconnect()


def test_a_node_cut_off_past_the_failure_timeout_ends_the_connection_whose_will_went_out(
    tmp_path,
):
    """n1's links are cut for longer than the failure timeout while "sensor" (clean
    session, with a will) stays connected to it: an owner of its partition publishes the
    will. Once the links are back, n1 learns of it and closes the connection, without a
    second will."""
    with Cluster(tmp_path) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        watcher = watch_wills(n3, n1)
        sensor, _ = r.connect_client(
            n1.ip, n1.mqtt_port, unique("sensor"), will_topic="wills/s", will_payload=b"off"
        )

        wait_for(lambda: will_copies(n2, n3) >= 1, 5, "will copies", n2, n3)
        n1.block(["n2", "n3"])
        got = watcher.expect(1, 15.0)
        assert [(m.topic, m.payload) for m in got] == [("wills/s", b"off")]
        n1.block([])
        sensor.settimeout(30.0)
        assert sensor.recv(1) == b""  # closed by n1 (3.1.1: no DISCONNECT)
        assert watcher.drain(1.5) == []
        sensor.close()
        watcher.disconnect()


def test_sessions_of_a_killed_node_live_on_with_every_acknowledged_message_and_one_will(tmp_path):
    """n1 holds three persistent sessions: "dev" offline with 300 QoS 1 messages queued
    (published and acknowledged on n2), "lamp" connected with a will, "brief" offline with a
    2 s expiry. n1 is SIGKILLed. dev resumes on n3 with every acknowledged message, in
    order (from the copy on an owner of its partition); the lamp's will is published once,
    by the owner that takes the session over after the failure timeout; brief is gone once
    its expiry passed. n1 comes back: it drops the sessions that live elsewhere now, and no
    second will is published."""
    with Cluster(tmp_path) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        topic = unique("copy/cmd")
        dev, lamp, brief = unique("dev"), unique("lamp"), unique("brief")
        watcher = Client(endpoint(n3), client_id=unique("watch"), version=5)
        watcher.connect()
        watcher.subscribe(f"wills/{lamp}", qos=1)
        wait_rows(n1, "n3", 1)
        for cid, expiry in ((dev, 300), (brief, 2)):
            c = Client(
                endpoint(n1),
                client_id=cid,
                version=5,
                clean=False,
                props={"SessionExpiryInterval": expiry},
            )
            c.connect()
            c.subscribe(topic, qos=1)
            c.disconnect()
        sock = connect_with_will(n1, lamp, clean=False)
        wait_rows(n2, "n1", 1)
        publisher = Client(endpoint(n2), client_id=unique("cpub"), version=5)
        publisher.connect()
        payloads = [f"{i}".encode() for i in range(300)]
        infos = [publisher.publish(topic, p, qos=1, wait=False) for p in payloads]
        all_acknowledged(infos, 20)
        # Acknowledged means a copy on another owner: none of them had to wait for a
        # missing one.
        assert metric(n1, "cluster_degraded_acks_total") == 0
        assert metric(n1, "cluster_copy_ops_sent_total") >= 300

        # Cluster status shows the copies each node holds (from its pings): dev, lamp and
        # brief are each copied to at least one other owner.
        def copies() -> int:
            return sum(m["copies"] or 0 for m in n2.request("GET", "/cluster/status")["members"])

        wait_for(lambda: copies() >= 3, 5, "copies in cluster status", n2)
        n1.kill()
        killed = time.monotonic()

        expiry = {"SessionExpiryInterval": 300}
        sub = Client(endpoint(n3), client_id=dev, version=5, clean=False, props=expiry)
        assert sub.connect().session_present
        got = [m.payload for m in sub.expect(300, 20.0)]
        assert got == payloads
        publisher.publish(topic, b"after", qos=1)
        assert [m.payload for m in sub.expect(1, 5.0)] == [b"after"]

        # The lamp's will: once, after the failure timeout, from the owner that took it over.
        assert [m.payload for m in watcher.expect(1, 15.0)] == [b"gone"]
        assert time.monotonic() - killed >= 1.5
        takeovers = sum(metric(n, "cluster_session_takeovers_total") for n in (n2, n3))
        assert takeovers >= 1

        # brief's 2 s expiry passed while its home was dead. Until its home has been out of
        # reach for a claim's wait (the failure timeout and 2 s), a node without its session
        # refuses it (0x88: the home may hold it), and the client connects again.
        time.sleep(max(0.0, killed + 2.5 - time.monotonic()))
        short = {"SessionExpiryInterval": 2}
        deadline = time.monotonic() + 10
        while True:
            late = Client(endpoint(n2), client_id=brief, version=5, clean=False, props=short)
            connack = late.connect(expect_rc=None)
            if connack.rc != 0x88 or time.monotonic() > deadline:
                break
            late.close()
            time.sleep(0.5)
        assert connack.rc == 0 and not connack.session_present
        late.disconnect()

        # n1 comes back: the copies' owners tell it that its sessions live on elsewhere.
        sock.close()
        cluster.start(1, join=cluster.seeds(2))
        wait_for(lambda: serving(n1), 20, "n1 serving", n1)
        wait_for(lambda: metric(n1, "cluster_sessions_fenced_total") >= 1, 10, "fenced", n1)
        time.sleep(2.5)  # past its deferred will
        assert [m.payload for m in watcher.drain(0.5)] == []
        publisher.publish(topic, b"back", qos=1)
        assert [m.payload for m in sub.expect(1, 5.0)] == [b"back"]
        assert sub.drain(0.5) == []
        for c in (sub, publisher, watcher):
            c.disconnect()


def test_a_client_whose_home_is_frozen_resumes_elsewhere_with_every_acknowledged_message(
    tmp_path,
):
    """n1 homes "dev" (offline, 50 QoS 1 messages queued, acknowledged on n2), "lamp"
    (persistent, connected, with a will) and "sensor" (clean session, connected, with a
    will), and is frozen (SIGSTOP, as a stalled VM): its links stay open and say nothing.
    dev and lamp reconnect to n3: each CONNECT waits until n1 is found down at the failure
    timeout (4 s here, longer than the 3 s a claim waits for a silent peer) and resumes from
    the copy on an owner, dev with every message (a claim that gave up at 3 s started an
    empty session). lamp's old will and sensor's will are published once each. n1 resumes
    (SIGCONT) and finds their sockets closed before it sees its links were: it keeps those
    wills until it is in touch again and learns that they went out (it published them a
    second time before). What is published then reaches dev once."""
    with Cluster(tmp_path, settings={"failure_timeout_ms": 4000}) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        watcher = watch_wills(n2, n1, n3)
        topic, dev, lamp, sensor = unique("frozen/cmd"), unique("dev"), unique("lamp"), unique("s")
        expiry = {"SessionExpiryInterval": 300}
        c = Client(endpoint(n1), client_id=dev, version=5, clean=False, props=expiry)
        c.connect()
        c.subscribe(topic, qos=1)
        c.disconnect()
        socks = [
            connect_with_will(n1, lamp, clean=False),
            connect_with_will(n1, sensor, clean=True),
        ]
        wait_rows(n2, "n1", 1)
        publisher = Client(endpoint(n2), client_id=unique("fpub"), version=5)
        publisher.connect()
        payloads = [f"{i}".encode() for i in range(50)]
        infos = [publisher.publish(topic, p, qos=1, wait=False) for p in payloads]
        all_acknowledged(infos, 10)
        time.sleep(1.5)  # will copies are stored once they lived a second
        assert n1.proc is not None
        os.kill(n1.proc.pid, signal.SIGSTOP)
        try:
            sub = Client(endpoint(n3), client_id=dev, version=5, clean=False, props=expiry)
            back = Client(endpoint(n3), client_id=lamp, clean=False)
            assert sub.connect(timeout=15.0).session_present
            assert back.connect(timeout=15.0).session_present
            assert [m.payload for m in sub.expect(50, 10.0)] == payloads
            assert metric(n3, "cluster_claims_timed_out_total") == 0
            wills = sorted(m.topic for m in watcher.expect(2, 10.0))
            assert wills == sorted([f"wills/{lamp}", f"wills/{sensor}"])
            # Their clients gave up on the old sockets: n1 sees them closed as it resumes.
            for sock in socks:
                sock.close()
        finally:
            os.kill(n1.proc.pid, signal.SIGCONT)
        publisher.publish(topic, b"after", qos=1)
        assert [m.payload for m in sub.expect(1, 5.0)] == [b"after"]
        time.sleep(3.0)
        assert sub.drain(0.5) == []
        assert watcher.drain(0.5) == []
        for client in (sub, back, publisher, watcher):
            client.disconnect()


def test_a_claim_goes_through_the_partition_owner_and_does_not_wait_for_a_frozen_bystander(
    tmp_path,
):
    """ "dev" is homed on n2 (offline, 20 QoS 1 messages acknowledged for it on n3), and its
    partition is owned by n2 and n3. n1, which holds nothing of dev, is frozen (SIGSTOP: its
    links stay open and say nothing). dev reconnects to n3: its claim goes through the
    partition's first owner, which names n2 only, and it resumes at once with every
    message. Sent to every node (protocol 9), the claim waited until n1 was found down at
    the failure timeout (4 s here)."""
    with Cluster(tmp_path, settings={"failure_timeout_ms": 4000}) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        owners = compute_map(["n1", "n2", "n3"]).replicas
        dev = next(
            cid
            for cid in (unique("dev") for _ in range(1000))
            if "n1" not in owners[partition_of(cid.encode(), len(owners))]
        )
        root = unique("bystander")
        topic = f"{root}/0"
        offline_subscribers(n2, root, [dev])
        wait_rows(n3, "n2", 1)
        publisher = Client(endpoint(n3), client_id=unique("bpub"), version=5)
        publisher.connect()
        payloads = [f"{i}".encode() for i in range(20)]
        all_acknowledged([publisher.publish(topic, p, qos=1, wait=False) for p in payloads], 10)
        directed = metric(n3, "cluster_claims_directed_total")
        assert n1.proc is not None
        os.kill(n1.proc.pid, signal.SIGSTOP)
        try:
            expiry = {"SessionExpiryInterval": 300}
            sub = Client(endpoint(n3), client_id=dev, version=5, clean=False, props=expiry)
            started = time.monotonic()
            assert sub.connect(timeout=10.0).session_present
            took = time.monotonic() - started
            assert [m.payload for m in sub.expect(20, 10.0)] == payloads
        finally:
            os.kill(n1.proc.pid, signal.SIGCONT)
        assert took < 2.0, f"the CONNECT waited {took:.1f} s for the frozen node"
        assert metric(n3, "cluster_claims_directed_total") == directed + 1
        assert metric(n3, "cluster_claims_timed_out_total") == 0
        for client in (sub, publisher):
            client.disconnect()


def offline_subscribers(node: Node, root: str, ids: list[str]) -> None:
    """Persistent MQTT 5 sessions on `node` (300 s expiry), the i-th subscribed to
    `root/i` at QoS 1, their clients gone."""
    for i, cid in enumerate(ids):
        props = {"SessionExpiryInterval": 300}
        c = Client(endpoint(node), client_id=cid, version=5, clean=False, props=props)
        c.connect()
        c.subscribe(f"{root}/{i}", qos=1)
        c.disconnect()


def test_what_nodes_kept_for_a_dead_home_reaches_its_sessions_without_it_coming_back(
    tmp_path,
):
    """n1 homes six offline persistent QoS 1 sessions (each on its own topic); n2 publishes
    20 messages to each, then n1 freezes (SIGSTOP: no connection reset) and n2 publishes 30
    more to each: written to n1's link until n2 counts n1 down (the failure timeout), kept
    for it and then acknowledged (8 KiB of random bytes each: n2 keeps at most 1 MiB of
    n1's queue in memory, the rest only in its store); n1 is SIGKILLed. Three clients
    resume on n3 at once (claims answered from the copies); the other three on n2 once n1
    was removed from the cluster and the owners took its sessions over. n1 never comes
    back: every acknowledged message arrives, once and in order: n2 sent what it kept for
    n1 to where the sessions live (the batches only in its store read back), the batches
    written to n1's link too, past how far the copies say n1 applied them."""
    with Cluster(tmp_path, {"outbox_memory_mb": 1}) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        root = unique("keptfor")
        expiry = {"SessionExpiryInterval": 300}
        ids = [unique(f"kf{i}") for i in range(6)]
        offline_subscribers(n1, root, ids)
        wait_rows(n2, "n1", 6)
        publisher = Client(endpoint(n2), client_id=unique("kfpub"), version=5)
        publisher.connect()

        def payload(i: int, k: int) -> bytes:
            # Random bytes, other for each session: kept batches are compressed.
            pad = b" " + random.Random(k * 8 + i).randbytes(8192) if k >= 20 else b""
            return f"{k}".encode() + pad

        def publish(first: int, count: int) -> None:
            infos = [
                publisher.publish(f"{root}/{i}", payload(i, k), qos=1, wait=False)
                for k in range(first, first + count)
                for i in range(len(ids))
            ]
            all_acknowledged(infos, 20)

        publish(0, 20)
        assert n1.proc is not None
        os.kill(n1.proc.pid, signal.SIGSTOP)
        publish(20, 30)
        assert not plane(n2, "n1")["up"]
        assert plane(n2, "n1")["unacked_bytes"] > 0
        n1.kill()

        def resume(node: Node, i: int) -> None:
            sub = Client(endpoint(node), client_id=ids[i], version=5, clean=False, props=expiry)
            assert sub.connect().session_present, ids[i]
            got = [m.payload for m in sub.expect(50, 15.0)]
            got += [m.payload for m in sub.drain(0.3)]
            want = [payload(i, k) for k in range(50)]
            assert got == want, (ids[i], node.node_id, [m.split(b" ")[0] for m in got])
            sub.disconnect()

        for i in range(3):
            resume(n3, i)

        def members() -> list[str]:
            return [m["node_id"] for m in n2.request("GET", "/cluster/status")["members"]]

        wait_for(lambda: "n1" not in members(), 15, "n1 removed", n2)

        def takeovers() -> float:
            return sum(metric(n, "cluster_session_takeovers_total") for n in (n2, n3))

        wait_for(lambda: takeovers() >= 3, 10, "the other sessions taken over", n2, n3)
        for i in range(3, 6):
            resume(n2, i)
        assert metric(n2, "cluster_kept_messages_handed_total") >= 1
        assert metric(n2, "cluster_kept_batches_read_back_total") >= 1
        publisher.disconnect()


def test_a_node_cut_off_from_a_sessions_new_home_reaches_it_through_the_old_one(tmp_path):
    """A persistent QoS 1 subscriber leaves n1 and resumes on n2 while n3 cannot reach n2
    (its link blocked; the failure timeout is long enough that no one is removed). What n3
    publishes goes to n1, the only home of the subscription n3 knows, and n1 relays it:
    also past the 5 s a relay lasted before protocol 8, since n2 has not yet told n1 that
    every node has its rows. Once n3's link to n2 is back, n3 sends to both for a moment
    (n2 takes each message once), then n1's relay and its row end. Every acknowledged
    message arrives once, in order."""
    with Cluster(tmp_path, settings={"failure_timeout_ms": 30_000}) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        topic = unique("cutoff")
        cid = unique("cutoffsub")
        expiry = EXPIRY
        parked_session(n1, cid, topic, 1)
        wait_rows(n3, "n1", 1)
        n3.block(["n2"])
        wait_for(lambda: not links_up(n2, ["n3"]), 10, "n2's link to n3 down", n2, n3)
        sub = Client(endpoint(n2), client_id=cid, version=5, clean=False, props=expiry)
        assert sub.connect().session_present
        publisher = Client(endpoint(n3), client_id=unique("cutoffpub"), version=5)
        publisher.connect()
        acked = stream(publisher, topic, 1, 10)
        time.sleep(6)
        acked += [f"{i}".encode() for i in range(10, 20)]
        for payload in acked[10:]:
            publisher.publish(topic, payload, qos=1, timeout=10.0)
        n3.block([])
        wait_for(lambda: links_up(n3, ["n2"]), 15, "n3's link to n2 back", n2, n3)
        for i in range(20, 30):
            publisher.publish(topic, f"{i}".encode(), qos=1, timeout=10.0)
            acked.append(f"{i}".encode())
        wait_for(lambda: plane(n3, "n1")["route_rows"] == 0, 15, "n1's relay ended", n1, n3)
        for i in range(30, 40):
            publisher.publish(topic, f"{i}".encode(), qos=1, timeout=10.0)
            acked.append(f"{i}".encode())
        got = [m.payload for m in sub.expect(len(acked), 15.0)]
        got += [m.payload for m in sub.drain(0.5)]
        assert got == acked
        publisher.disconnect()
        sub.disconnect()


def test_a_joining_node_is_streamed_the_copies_it_owns_and_the_home_can_then_die(tmp_path):
    """n1 homes 12 offline persistent sessions with 40 QoS 1 messages queued for each
    (published and acknowledged on n2), copied to n2 (2 nodes, replication factor 2). n3
    joins: n1 streams it the sessions whose partition it gained (paced, in the background),
    and n2 keeps its copies of partitions it no longer owns until n3 has its own, then drops
    them. n1 is then SIGKILLed: every client resumes on n3 with every acknowledged message,
    in order."""
    with Cluster(tmp_path) as cluster:
        n1, n2 = start_cluster(cluster, 2)
        root = unique("stream")
        # Four of them in partitions n2 no longer owns once n3 is in (so it must release
        # them), the rest wherever they fall.
        owners = compute_map(["n1", "n2", "n3"]).replicas

        def owners_of(cid: str) -> set[str]:
            return set(owners[partition_of(cid.encode(), len(owners))])

        clients = [
            next(c for c in (unique(f"mover{i}") for _ in range(1000)) if "n2" not in owners_of(c))
            for i in range(4)
        ] + [unique(f"mover{i}") for i in range(4, 12)]
        expiry = {"SessionExpiryInterval": 300}
        offline_subscribers(n1, root, clients)
        wait_rows(n2, "n1", 12)
        publisher = Client(endpoint(n2), client_id=unique("spub"), version=5)
        publisher.connect()
        infos = [
            publisher.publish(f"{root}/{i}", f"{i}:{k}".encode(), qos=1, wait=False)
            for k in range(40)
            for i in range(len(clients))
        ]
        all_acknowledged(infos, 20)
        publisher.disconnect()
        assert metric(n2, "cluster_session_copies") == 12

        n3 = cluster.start(3, join=cluster.seeds(1))
        ids = ["n1", "n2", "n3"]
        cluster.wait_converged(ids, 30)
        wait_for(lambda: links_up(n3, ["n1", "n2"]), 15, "n3's data links", n3)

        def streamed() -> bool:
            return (
                metric(n1, "cluster_sessions_streamed_total") >= 1
                and metric(n1, "cluster_session_stream_backlog") == 0
            )

        wait_for(streamed, 15, "copies streamed to n3", n1, n3)

        # Cluster status shows each member's rebalance backlog (STREAMING), from its pings.
        def backlog() -> dict[str, Any]:
            return {
                m["node_id"]: m["streaming"]
                for m in n2.request("GET", "/cluster/status")["members"]
            }

        wait_for(lambda: backlog() == {"n1": 0, "n2": 0, "n3": 0}, 10, "status", n2)
        # n3 owns some of the partitions now; n2 holds only those it still owns.
        kept = sum("n2" in owners_of(c) for c in clients)
        wait_for(lambda: metric(n2, "cluster_session_copies") == kept, 10, "released", n2)
        assert metric(n3, "cluster_session_copies") == sum("n3" in owners_of(c) for c in clients)

        n1.kill()
        for i, cid in enumerate(clients):
            sub = Client(endpoint(n3), client_id=cid, version=5, clean=False, props=expiry)
            assert sub.connect().session_present, cid
            got = [m.payload for m in sub.expect(40, 20.0)]
            assert got == [f"{i}:{k}".encode() for k in range(40)], cid
            sub.disconnect()


def test_a_home_killed_mid_stream_loses_no_acknowledged_qos1_message(tmp_path):
    """Six connected persistent QoS 1 subscribers on n1 (each on its own topic: for about a
    third of them n1 is not an owner of the partition, so two owners hold copies that can
    differ) while n2 publishes to them; n1 is SIGKILLed in the middle of the stream. The
    subscribers reconnect to n3 at once and resume from the copies (the most current one);
    n1 comes back, and what n2 kept for it meanwhile reaches the sessions on n3. Every
    message n2 acknowledged arrives (QoS 1 may repeat one)."""
    with Cluster(tmp_path) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        root = unique("midkill")
        expiry = {"SessionExpiryInterval": 300}
        ids = [unique(f"mk{i}") for i in range(6)]
        subs = {}
        for i, cid in enumerate(ids):
            c = Client(endpoint(n1), client_id=cid, version=5, clean=False, props=expiry)
            c.connect()
            c.subscribe(f"{root}/{i}", qos=1)
            subs[cid] = c
        wait_rows(n2, "n1", 6)
        publisher = Client(endpoint(n2), client_id=unique("mkpub"), version=5)
        publisher.connect()
        acked: dict[int, list[bytes]] = {i: [] for i in range(len(ids))}
        sent = threading.Event()

        def publish() -> None:
            for k in range(150):
                for i in range(len(ids)):
                    payload = f"{i}:{k}".encode()
                    publisher.publish(f"{root}/{i}", payload, qos=1, timeout=15.0)
                    acked[i].append(payload)
                if k == 40:
                    sent.set()
                time.sleep(0.005)

        sender = threading.Thread(target=publish)
        sender.start()
        assert sent.wait(20)
        n1.kill()
        got: dict[int, list[bytes]] = {i: [] for i in range(len(ids))}
        for i, cid in enumerate(ids):
            got[i] += [m.payload for m in subs[cid].drain(0.0)]
            subs[cid].close()
            sub = Client(endpoint(n3), client_id=cid, version=5, clean=False, props=expiry)
            assert sub.connect().session_present, cid
            subs[cid] = sub
        sender.join(90)
        assert not sender.is_alive()
        cluster.start(1, join=cluster.seeds(2))
        wait_for(lambda: serving(n1), 20, "n1 serving", n1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(
            set(acked[i]) - set(got[i]) for i in range(len(ids))
        ):
            for i, cid in enumerate(ids):
                got[i] += [m.payload for m in subs[cid].drain(0.2)]
        missing = {i: sorted(set(acked[i]) - set(got[i])) for i in range(len(ids))}
        lost = {i: m for i, m in missing.items() if m}
        degraded = metric(n2, "cluster_degraded_acks_total")
        assert not lost, f"acknowledged messages lost ({degraded} degraded acks): {lost}"
        for c in (*subs.values(), publisher):
            c.disconnect()


def test_a_home_killed_mid_qos2_stream_delivers_each_acknowledged_message_exactly_once(
    tmp_path,
):
    """A persistent QoS 2 subscriber (raw MQTT 3.1.1, keeping its QoS 2 state across
    connections as a client must) on n1 while n2 publishes QoS 2 to it; n1 is SIGKILLed in
    the middle of the stream, the subscriber resumes on n3 from the copy, and n1 comes back.
    Every message n2 completed (PUBCOMP) arrives exactly once."""
    with Cluster(tmp_path) as cluster:
        n1, n2, n3 = start_cluster(cluster, 3)
        cid, topic = unique("q2kill"), unique("q2kill/cmd")
        receiver = Qos2Receiver(cid, topic)
        receiver.connect(n1, first=True)
        wait_rows(n2, "n1", 1)
        publisher = Client(endpoint(n2), client_id=unique("q2pub"), version=5)
        publisher.connect()
        done: list[bytes] = []
        sent = threading.Event()

        def publish() -> None:
            for k in range(300):
                payload = k.to_bytes(4, "big")
                publisher.publish(topic, payload, qos=2, timeout=15.0)
                done.append(payload)
                if k == 80:
                    sent.set()

        sender = threading.Thread(target=publish)
        sender.start()
        while not sent.is_set():
            receiver.pump(0.05)
        receiver.pump(0.05)
        n1.kill()
        receiver.drop()
        assert receiver.connect(n3)
        while sender.is_alive():
            receiver.pump(0.1)
        sender.join()
        cluster.start(1, join=cluster.seeds(2))
        wait_for(lambda: serving(n1), 20, "n1 serving", n1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and set(done) - set(receiver.got):
            receiver.pump(0.2)
        receiver.pump(0.5)
        missing = sorted(int.from_bytes(m, "big") for m in set(done) - set(receiver.got))
        twice = sorted(
            int.from_bytes(m, "big") for m in set(receiver.got) if receiver.got.count(m) > 1
        )
        assert not missing and not twice, f"lost: {missing}; delivered twice: {twice}"
        publisher.disconnect()


@pytest.mark.parametrize("layer", ["compiled", "uvloop"])
def test_data_links_on_either_connection_layer_carry_messages_and_count_their_traffic(
    tmp_path, layer
):
    """With the compiled connection layer (the default) the reactor serves the data links
    once their handshake is done (Link.adopt): batches are fed and written in Rust. Either
    way a message crosses, acknowledgements come back, and the links' traffic is counted."""
    with Cluster(tmp_path, connection_layer=layer) as cluster:
        n1, n2 = start_cluster(cluster, 2)
        status = n1.status()
        assert status is not None
        assert status["links"]["n2"]["data"]["compiled"] is (layer == "compiled")
        before = status["links"]["n2"]["data"]
        for i in range(3):
            assert round_trip(n1, n2, b"m%d" % i)
        after = (n1.status() or {})["links"]["n2"]["data"]
        for key in ("bytes_out", "frames_out", "bytes_in", "frames_in"):
            assert after[key] > before[key], (key, before, after)
        # A data link that goes down (the peer stops) is noticed and comes back with it.
        n2.stop()
        wait_for(lambda: not links_up(n1, ["n2"]), 15, "n2's data link down", n1)
        cluster.start(2, wait=False, join=cluster.seeds(1))
        wait_for(lambda: links_up(n1, ["n2"]) and links_up(n2, ["n1"]), 30, "back", n1, n2)
        assert round_trip(n2, n1, b"again")
        status = n1.status()
        assert status is not None
        assert status["links"]["n2"]["data"]["compiled"] is (layer == "compiled")
