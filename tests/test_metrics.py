"""GET /metrics, /health and /ready on the admin endpoint (fastbroker.metrics, fastbroker.admin).

In-process tests drive the collector and the endpoint with a real engine, a real store and
real asyncio servers; end-to-end tests scrape a real broker and a real two-node cluster, and
check that the counters moved by exactly what paho clients did.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import fastbroker_core
import pytest
from brokers import free_port
from clusters import Cluster, wait_for
from conftest import Client
from prometheus_client.parser import text_string_to_metric_families

from fastbroker.admin import AdminServer, Readiness, routes
from fastbroker.metrics import CONTENT_TYPE, BrokerCollector, BrokerMetrics
from fastbroker.store import LATENCY_BUCKETS_NS, LatencyHistogram, Store

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[name, frozenset(labels.items())]


def total(samples: Samples, name: str) -> float:
    """The sum over every label set of ``name``."""
    return sum(v for (n, _), v in samples.items() if n == name)


def get(url: str, timeout: float = 3.0) -> tuple[int, str, str]:
    """(status, content type, body) of a GET; HTTP errors are answers too."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.headers["Content-Type"], error.read().decode()


# --------------------------------------------------------------------------- in process


def test_latency_histogram_buckets_are_upper_bounds() -> None:
    histogram = LatencyHistogram()
    histogram.observe(1)  # fastest bucket
    histogram.observe(LATENCY_BUCKETS_NS[0])  # equal to a bound: that bound's bucket
    histogram.observe(LATENCY_BUCKETS_NS[0] + 1)
    histogram.observe(10 * LATENCY_BUCKETS_NS[-1])  # slower than all: +Inf only
    assert histogram.counts[0] == 2
    assert histogram.counts[1] == 1
    assert histogram.counts[-1] == 1
    assert histogram.count == 4
    assert histogram.sum_ns == 1 + 2 * LATENCY_BUCKETS_NS[0] + 1 + 10 * LATENCY_BUCKETS_NS[-1]


def test_collector_reads_the_engine_and_the_store_at_scrape_time(tmp_path: Path) -> None:
    engine = fastbroker_core.Engine({})
    with Store.open(str(tmp_path / "data"), fsync="interval") as store:
        metrics = BrokerMetrics(BrokerCollector(engine=engine, store=store, version="9.9.9-test"))
        before = parse(metrics.render().decode())
        assert value(before, "fastbroker_store_write_seconds_count") == 0
        assert value(before, "fastbroker_build_info", version="9.9.9-test") == 1
        assert value(before, "fastbroker_messages_received_total") == 0

        store.write([(b"s1", b"a"), (b"s2", b"b")])
        store.write([(b"s1", None)])
        store.sync()
        after = parse(metrics.render().decode())
    assert value(after, "fastbroker_store_write_seconds_count") == 2
    assert value(after, "fastbroker_store_write_seconds_bucket", le="+Inf") == 2
    assert 0 < value(after, "fastbroker_store_write_seconds_sum") < 1
    assert value(after, "fastbroker_store_records_written_total") == 3
    assert value(after, "fastbroker_store_sync_seconds_count") == 1
    assert value(after, "fastbroker_store_write_errors_total") == 0
    # Buckets are cumulative and end at +Inf.
    buckets = sorted(
        (float(dict(labels)["le"]), v)
        for (name, labels), v in after.items()
        if name == "fastbroker_store_write_seconds_bucket"
    )
    assert [le for le, _ in buckets[:2]] == [0.0001, 0.00025]
    assert all(a[1] <= b[1] for a, b in itertools.pairwise(buckets))
    # The process.
    assert value(after, "fastbroker_resident_memory_bytes") > 10 * 2**20
    assert value(after, "fastbroker_open_fds") > 3
    assert value(after, "fastbroker_memory_pressure") == 0
    assert value(after, "fastbroker_uptime_seconds") > 0


def test_admin_endpoint_serves_metrics_and_readiness() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        listener = await loop.create_server(asyncio.Protocol, "127.0.0.1", 0, start_serving=False)
        stopping = asyncio.Event()
        readiness = Readiness(stopping=stopping, listeners=[listener])
        collector = BrokerCollector(engine=fastbroker_core.Engine({}), readiness=readiness)
        handle = routes(
            None,
            False,
            lambda: None,
            metrics=BrokerMetrics(collector).render,
            metrics_content_type=CONTENT_TYPE,
            readiness=readiness,
        )
        admin = AdminServer(handle)
        host, port = await admin.start("127.0.0.1", 0)
        base = f"http://{host}:{port}"

        async def fetch(path: str) -> tuple[int, str, str]:
            return await asyncio.to_thread(get, base + path)

        try:
            status, _, body = await fetch("/ready")
            assert status == 503
            assert json.loads(body) == {
                "ready": False,
                "reasons": ["not all listeners are serving"],
            }
            await listener.start_serving()
            status, _, body = await fetch("/ready")
            assert (status, json.loads(body)) == (200, {"ready": True})
            status, content_type, body = await fetch("/metrics")
            assert status == 200
            assert content_type == "text/plain; version=0.0.4; charset=utf-8"
            assert value(parse(body), "fastbroker_ready") == 1
            assert (await fetch("/health"))[:1] == (200,)

            stopping.set()  # shutdown began: not ready, while still serving
            status, _, body = await fetch("/ready")
            assert status == 503
            assert json.loads(body)["reasons"] == ["shutting down"]
            assert value(parse((await fetch("/metrics"))[2]), "fastbroker_ready") == 0
        finally:
            await admin.stop()
            listener.close()
            await listener.wait_closed()

    asyncio.run(scenario())
    # The loop leaves reference cycles holding the engine, which must be freed on this thread
    # (a PyO3 unsendable object): collect them now, not in some later test's paho thread.
    gc.collect()


# --------------------------------------------------------------------------- a real broker


def scrape(admin: str) -> Samples:
    status, content_type, body = get(f"http://{admin}/metrics")
    assert status == 200, body
    assert content_type == CONTENT_TYPE
    return parse(body)


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.mark.timeout(40)
def test_broker_metrics_count_exactly_what_clients_did(make_broker) -> None:
    admin_port = free_port()
    broker = make_broker(
        "fastbroker",
        extra_toml=f"[admin]\nenabled = true\nport = {admin_port}\nshutdown_delay_ms = 1500\n",
    )
    admin = f"127.0.0.1:{admin_port}"
    wait_until(lambda: get(f"http://{admin}/ready")[0] == 200, 5, "/ready to say 200")

    subscriber = Client(broker, client_id="metrics-sub", version=5)
    subscriber.connect()
    assert subscriber.subscribe("m/#", qos=0) == [0]
    publisher = Client(broker, client_id="metrics-pub", version=5)
    publisher.connect()

    before = scrape(admin)
    assert total(before, "fastbroker_connections") == 2
    assert value(before, "fastbroker_clients_connected") == 2
    assert value(before, "fastbroker_subscriptions") == 1

    count = 50
    for i in range(count):
        publisher.publish(f"m/{i}", b"x" * 10)
    assert len(subscriber.expect(count, timeout=5)) == count
    after = scrape(admin)

    def moved(name: str) -> float:
        return value(after, name) - value(before, name)

    assert moved("fastbroker_messages_received_total") == count
    assert moved("fastbroker_messages_sent_total") == count  # one subscriber
    # Each PUBLISH is at least its 10-byte payload and its topic.
    assert moved("fastbroker_bytes_received_total") >= count * 13
    assert moved("fastbroker_bytes_sent_total") >= count * 13
    assert value(after, "fastbroker_publish_dropped_total") == 0

    # A persistent session's QoS 1 message goes through the store.
    writes_before = value(after, "fastbroker_store_write_seconds_count")
    durable = Client(
        broker,
        client_id="metrics-durable",
        version=5,
        clean=False,
        props={"SessionExpiryInterval": 600},
    )
    durable.connect()
    assert durable.subscribe("d/x", qos=1) == [1]
    publisher.publish("d/x", b"keep me", qos=1)
    durable.expect_one()
    stored = scrape(admin)
    assert value(stored, "fastbroker_store_write_seconds_count") > writes_before
    assert value(stored, "fastbroker_store_records_written_total") > 0
    assert value(stored, "fastbroker_sessions") >= 3
    durable.disconnect()
    subscriber.disconnect()
    publisher.disconnect()
    wait_until(
        lambda: total(scrape(admin), "fastbroker_connections") == 0, 5, "connections to close"
    )

    # Shutdown: /ready turns 503 at once and the MQTT listener still accepts meanwhile.
    broker.terminate()
    wait_until(lambda: get(f"http://{admin}/ready")[0] == 503, 1.0, "/ready to say 503")
    status, _, body = get(f"http://{admin}/ready")
    assert status == 503 and "shutting down" in json.loads(body)["reasons"]
    with socket.create_connection(broker.address, timeout=1):
        pass
    assert get(f"http://{admin}/health")[0] == 200
    assert broker.proc.wait(10) == 0


# --------------------------------------------------------------------------- a real cluster


@pytest.mark.timeout(60)
def test_cluster_readiness_and_inter_node_traffic(tmp_path: Path) -> None:
    with Cluster(tmp_path, {"bootstrap_expect": 2}) as cluster:
        n1 = cluster.start(1, join=cluster.seeds(2))
        # Alone, it waits for a second fresh node before founding a cluster: not ready.
        status, _, body = get(f"http://{n1.admin}/ready")
        assert status == 503
        assert "not a member of a cluster map yet" in json.loads(body)["reasons"]
        alone = scrape(n1.admin)
        assert value(alone, "fastbroker_cluster_member") == 0
        assert value(alone, "fastbroker_cluster_links_up") == 0

        n2 = cluster.start(2, join=cluster.seeds(1))
        cluster.wait_converged(["n1", "n2"], 20)
        for node in (n1, n2):
            wait_for(lambda node=node: get(f"http://{node.admin}/ready")[0] == 200, 10, "ready")

        first = {node.node_id: scrape(node.admin) for node in (n1, n2)}
        time.sleep(1.0)  # heartbeats flow meanwhile
        second = {node.node_id: scrape(node.admin) for node in (n1, n2)}
        for me, peer in (("n1", "n2"), ("n2", "n1")):
            a, b = first[me], second[me]
            assert value(b, "fastbroker_cluster_links_up") == 1
            assert value(b, "fastbroker_cluster_members") == 2
            assert value(b, "fastbroker_cluster_member") == 1
            assert value(b, "fastbroker_cluster_map_version") >= 1
            for name in (
                "fastbroker_cluster_bytes_sent_total",
                "fastbroker_cluster_bytes_received_total",
                "fastbroker_cluster_frames_sent_total",
                "fastbroker_cluster_frames_received_total",
            ):
                assert value(b, name, peer=peer) > value(a, name, peer=peer) > 0, (me, name)
            assert value(b, "fastbroker_cluster_handshake_bytes_received_total") > 0
        # What one node sent the other received (frames in flight aside): same order.
        sent = value(second["n1"], "fastbroker_cluster_frames_sent_total", peer="n2")
        received = value(second["n2"], "fastbroker_cluster_frames_received_total", peer="n1")
        assert abs(sent - received) <= 0.1 * sent + 10
        leaders = [value(second[n], "fastbroker_cluster_is_leader") for n in ("n1", "n2")]
        assert sorted(leaders) == [0, 1]
        terms = {value(second[n], "fastbroker_cluster_raft_term") for n in ("n1", "n2")}
        assert len(terms) == 1 and min(terms) >= 1
