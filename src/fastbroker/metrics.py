"""Prometheus metrics for the admin endpoint's GET /metrics.

Nothing is counted here: a custom collector reads the live values at scrape time (the engine's
counters, the store's batch timings, the cluster transport's traffic, the process) and
prometheus_client writes them in the text exposition format from a private registry. Scrapes
cost the broker nothing between them, and the publish path nothing at all.

The sources are handed over as plain objects (engine, connection-layer server, store, cluster
node or None, readiness); whatever a source does not offer (an older engine's stats, a
standalone broker's cluster) is left out rather than reported as zero. docs/operations.md
lists every metric.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from fastbroker.store import LATENCY_BUCKETS_NS

# The classic text format (0.0.4): what every Prometheus version and scraper reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "fastbroker_"

# engine.stats() key -> (metric name without prefix, "gauge" | "counter", help). Keys the
# engine does not report are skipped, so an engine with fewer counters still scrapes.
ENGINE_STATS: dict[str, tuple[str, str, str]] = {
    "clients_connected": ("clients_connected", "gauge", "MQTT clients connected (CONNECT done)"),
    "sessions": ("sessions", "gauge", "Sessions held, connected or not"),
    "subscriptions": ("subscriptions", "gauge", "Subscriptions of all sessions"),
    "retained": ("retained_messages", "gauge", "Retained messages held"),
    "queued": ("queued_messages", "gauge", "Messages queued for sessions, beyond in-flight"),
    "queued_bytes": ("queued_bytes", "gauge", "Bytes of the messages queued for sessions"),
    "inflight": ("inflight_messages", "gauge", "QoS 1/2 messages sent, not yet acknowledged"),
    "held_connections": (
        "held_connections",
        "gauge",
        "Connections not read for now (publish rate limit, interception, pending auth)",
    ),
    "intercepted_pending": (
        "intercepted_pending",
        "gauge",
        "Messages waiting for the interception plugin",
    ),
    "auth_pending": ("auth_pending", "gauge", "Connects waiting for the authentication plugin"),
    "messages_received": ("messages_received", "counter", "PUBLISH packets received"),
    "messages_sent": ("messages_sent", "counter", "PUBLISH packets sent"),
    "bytes_received": ("bytes_received", "counter", "Bytes received from MQTT clients"),
    "bytes_sent": ("bytes_sent", "counter", "Bytes sent to MQTT clients"),
    "publish_dropped": (
        "publish_dropped",
        "counter",
        "Messages not delivered to a session: its queue was full, or expired",
    ),
    "publish_denied": ("publish_denied", "counter", "PUBLISH packets refused by the ACL"),
    "subscribe_denied": ("subscribe_denied", "counter", "Topic filters refused a subscription"),
    "connections_refused": (
        "connections_refused",
        "counter",
        "CONNECTs refused (bad credentials, not authorized, over max_connections, ...)",
    ),
    "access_events_dropped": (
        "access_events_dropped",
        "counter",
        "Access log events lost because too many piled up between two reads",
    ),
}

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
# Histogram bucket bounds as Prometheus writes them ("0.0001", ..., "1.0").
BUCKET_LABELS = [repr(bound / 1e9) for bound in LATENCY_BUCKETS_NS] + ["+Inf"]


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(PREFIX + name, doc, value=value)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(PREFIX + name, doc, value=value)


def histogram(name: str, doc: str, latency: Any) -> HistogramMetricFamily:
    """A fastbroker.store.LatencyHistogram (nanoseconds) as a histogram in seconds."""
    cumulative = 0
    buckets = []
    for label, count in zip(BUCKET_LABELS, latency.counts, strict=True):
        cumulative += count
        buckets.append((label, cumulative))
    return HistogramMetricFamily(
        PREFIX + name, doc, buckets=buckets, sum_value=latency.sum_ns / 1e9
    )


def resident_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return None


def open_fds() -> int | None:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def connections_by_listener(server: Any) -> dict[tuple[str, str], int]:
    """Open connections per (listener, transport). Without per-connection details (an older
    connection layer), one total with empty labels."""
    connections = getattr(server, "connections", None)
    if isinstance(connections, list):
        counts: dict[tuple[str, str], int] = {}
        for connection in connections:
            if connection is None:
                continue
            info = getattr(connection, "info", None) or {}
            key = (str(info.get("listener") or ""), str(info.get("transport") or ""))
            counts[key] = counts.get(key, 0) + 1
        reactor = getattr(server, "reactor", None)
        if reactor is not None:
            infos = server.reactor_infos
            for index, count in enumerate(reactor.listener_counts()):
                if count and index < len(infos):
                    info = infos[index]
                    key = (str(info.get("listener") or ""), str(info.get("transport") or ""))
                    counts[key] = counts.get(key, 0) + count
        return counts
    total = getattr(server, "open_connections", None)
    return {("", ""): total} if isinstance(total, int) else {}


class BrokerCollector:
    """Reads every metric from its sources at scrape time."""

    def __init__(
        self,
        *,
        engine: Any,
        server: Any = None,
        store: Any = None,
        cluster: Any = None,
        readiness: Any = None,
        auth: Any = None,
        version: str = "",
    ) -> None:
        self.engine = engine
        self.auth = auth
        self.server = server
        self.store = store
        self.cluster = cluster
        self.readiness = readiness
        self.version = version
        self.started = time.monotonic()

    def describe(self) -> list[Metric]:
        # Nothing to check at registration (the registry would otherwise collect once).
        return []

    def collect(self) -> Iterator[Metric]:
        yield from self.process_metrics()
        yield from self.broker_metrics()
        yield from self.store_metrics()
        yield from self.auth_metrics()
        if self.cluster is not None:
            yield from self.cluster_metrics()

    def process_metrics(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            PREFIX + "build_info", "The broker's version (always 1)", labels=["version"]
        )
        info.add_metric([self.version], 1)
        yield info
        yield gauge("uptime_seconds", "Seconds since the broker started", self.uptime())
        rss = resident_bytes()
        if rss is not None:
            yield gauge("resident_memory_bytes", "Resident memory of the process (RSS)", rss)
        fds = open_fds()
        if fds is not None:
            yield gauge("open_fds", "Open file descriptors (sockets included)", fds)
        yield gauge(
            "max_fds",
            "Limit of open file descriptors",
            resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        )
        cpu = os.times()
        yield counter("cpu_seconds", "CPU time used, user and system", cpu.user + cpu.system)
        yield gauge(
            "memory_pressure",
            "1 while memory is past the high-water mark (publishers are not read)",
            int(bool(getattr(self.server, "memory_pressure", 0))),
        )
        if self.readiness is not None:
            yield gauge("ready", "1 when GET /ready answers 200", int(not self.readiness.reasons()))

    def uptime(self) -> float:
        return time.monotonic() - self.started

    def auth_metrics(self) -> Iterator[Metric]:
        checks = getattr(self.auth, "password_checks", None)
        if not isinstance(checks, dict):
            return
        family = CounterMetricFamily(
            PREFIX + "password_checks",
            "Password checks by how they were decided: slow (a scrypt or argon2 hash), "
            "recalled (passed before: one keyed digest), shared (the verdict of the same "
            "credentials' check under way)",
            labels=["kind"],
        )
        for kind, count in sorted(checks.items()):
            family.add_metric([kind], count)
        yield family

    def broker_metrics(self) -> Iterator[Metric]:
        server = self.server
        if server is not None:
            connections = GaugeMetricFamily(
                PREFIX + "connections",
                "Open network connections (MQTT connected or not), per listener and transport",
                labels=["listener", "transport"],
            )
            for (listener, transport), count in sorted(connections_by_listener(server).items()):
                connections.add_metric([listener, transport], count)
            yield connections
            refused = getattr(server, "sockets_refused", None)
            if isinstance(refused, int):
                reactor = getattr(server, "reactor", None)
                refused += reactor.refused if reactor is not None else 0
                yield counter(
                    "sockets_refused",
                    "Sockets closed on accept (connection rate or socket cap)",
                    refused,
                )
            held = getattr(server, "memory_held_connections", None)
            if isinstance(held, int):
                yield gauge(
                    "memory_held_connections",
                    "Publishers not read because of memory pressure",
                    held,
                )
        stats: Mapping[str, Any] = self.engine.stats()
        for key, (name, kind, doc) in ENGINE_STATS.items():
            value = stats.get(key)
            if value is None:
                continue
            yield (gauge if kind == "gauge" else counter)(name, doc, value)

    def store_metrics(self) -> Iterator[Metric]:
        store = self.store
        if store is not None and hasattr(store, "write_latency"):
            yield histogram(
                "store_write_seconds",
                "Time to apply one batch of store writes (one per event-loop iteration)",
                store.write_latency,
            )
            yield histogram(
                "store_sync_seconds",
                'Time of one WAL sync (fsync = "interval"; "always" syncs within the write)',
                store.sync_latency,
            )
            yield counter(
                "store_write_errors", "Store writes and syncs that failed", store.write_errors
            )
            yield counter(
                "store_records_written",
                "Records written or deleted in the store",
                store.records_written,
            )
        failing = getattr(self.server, "store_failing", None)
        if failing is not None:
            yield gauge(
                "store_failing",
                "1 while store writes fail (the broker holds output until they succeed)",
                int(bool(failing)),
            )

    def cluster_metrics(self) -> Iterator[Metric]:
        cluster = self.cluster
        transport = cluster.transport
        directions = (
            ("bytes_received", "bytes_in", "Bytes received from a peer node"),
            ("bytes_sent", "bytes_out", "Bytes sent to a peer node"),
            ("frames_received", "frames_in", "Frames received from a peer node"),
            ("frames_sent", "frames_out", "Frames sent to a peer node"),
            (
                "frames_dropped",
                "dropped_frames",
                "Frames not sent: the link's send buffer was full",
            ),
        )
        traffic = sorted(getattr(transport, "traffic", {}).items())
        for name, field, doc in directions:
            family = CounterMetricFamily(
                PREFIX + "cluster_" + name, doc + ", over all links", labels=["peer"]
            )
            for peer, counts in traffic:
                family.add_metric([peer], getattr(counts, field))
            yield family
        before = getattr(transport, "unauthenticated", None)
        if before is not None:
            yield counter(
                "cluster_handshake_bytes_received",
                "Bytes received on links before they authenticated (handshakes, strangers)",
                before.bytes_in,
            )
            yield counter(
                "cluster_handshake_bytes_sent",
                "Bytes sent on links before they authenticated",
                before.bytes_out,
            )
        yield gauge("cluster_links_up", "Authenticated links to other nodes", len(transport.links))
        dataplane = getattr(cluster, "dataplane", None)
        if dataplane is not None:
            yield from self.dataplane_metrics(dataplane)
        status = cluster.status()
        raft = status.get("raft") or {}
        yield gauge(
            "cluster_members", "Members in the cluster map (0: no map yet)", len(status["members"])
        )
        yield gauge(
            "cluster_member", "1 when this node is in the cluster map", int(bool(status["member"]))
        )
        yield gauge(
            "cluster_is_leader",
            "1 when this node leads the cluster's consensus",
            int(status.get("leader") == status.get("node_id")),
        )
        yield gauge("cluster_raft_term", "Consensus term", raft.get("term", 0))
        yield gauge(
            "cluster_partial_split_stepped_aside",
            "1 while this node keeps its data links closed in a partial split",
            int(status.get("partial_split") is not None),
        )
        version = status.get("map_version")
        if version is not None:
            yield gauge("cluster_map_version", "Version of the cluster map", version)

    def dataplane_metrics(self, dataplane: Any) -> Iterator[Metric]:
        """Routes and forwarded messages per peer (fastbroker.cluster.dataplane)."""
        peers = sorted(dataplane.stats().items())

        def per_peer(family: Any, field: str) -> Any:
            for peer, stats in peers:
                family.add_metric([peer], stats[field])
            return family

        families = (
            ("cluster_messages_forwarded", "messages_out", "Messages forwarded to a peer node"),
            ("cluster_messages_received", "messages_in", "Messages forwarded by a peer node"),
            ("cluster_batches_resent", "resent", "Data batches sent again after a reconnect"),
            (
                "cluster_publisher_holds",
                "publisher_holds",
                "Publishers not read because their messages waited in a peer's full queue",
            ),
            (
                "cluster_batches_read_back",
                "read_back",
                "Batches for a peer read back from the store after its queue spilled to disk",
            ),
            (
                "cluster_forward_dropped",
                "dropped",
                "QoS 0 messages to a peer dropped while its link was down (or far past "
                "full), and "
                "batches dropped past the unacknowledged bound",
            ),
        )
        for name, field, doc in families:
            yield per_peer(CounterMetricFamily(PREFIX + name, doc, labels=["peer"]), field)
        gauges = (
            ("cluster_route_rows", "route_rows", "Route rows (topic filters) held for a peer"),
            (
                "cluster_link_queue_bytes",
                "unacked_bytes",
                "Bytes of data batches for a peer not yet acknowledged by it",
            ),
            (
                "cluster_link_queue_spilled_bytes",
                "spilled_bytes",
                "Bytes of a down peer's queue kept only in the store",
            ),
        )
        for name, field, doc in gauges:
            yield per_peer(GaugeMetricFamily(PREFIX + name, doc, labels=["peer"]), field)
        yield gauge(
            "cluster_local_route_rows",
            "Route rows this node announces (distinct filters of its sessions)",
            dataplane.engine.cluster_local_rows(),
        )
        claims = dataplane.engine.claim_stats()
        yield counter(
            "cluster_session_claims",
            "CONNECTs that claimed their client id from the other nodes",
            claims["made"],
        )
        yield counter(
            "cluster_claims_timed_out",
            "Claims that went on without every answer (a peer up but silent)",
            claims["timed_out"],
        )
        yield counter(
            "cluster_claims_routed",
            "Claims of other nodes this node stamped as their client id's partition owner",
            claims["routed"],
        )
        yield counter(
            "cluster_claims_directed",
            "Claims of this node sent through an owner to the nodes it named",
            claims["directed"],
        )
        yield counter(
            "cluster_claims_broadcast",
            "Claims of this node sent to every node in reach (no owner of protocol 10 in reach)",
            claims["broadcast"],
        )
        yield counter(
            "cluster_claim_messages",
            "Claim messages this node sent (the nodes each claim asked)",
            claims["asked"],
        )
        yield gauge(
            "cluster_registry_clients",
            "Client ids of partitions this node owns whose sessions it knows another node holds",
            claims["registry_clients"],
        )
        yield counter(
            "cluster_sessions_received",
            "Sessions handed over to this node by another (their client reconnected here)",
            claims["sessions_in"],
        )
        yield counter(
            "cluster_sessions_handed_over",
            "Sessions this node handed over to another node",
            claims["sessions_out"],
        )
        yield counter(
            "cluster_kept_messages_handed",
            "Messages kept here for a dead node sent to where its sessions live now",
            claims["kept_handed"],
        )
        yield counter(
            "cluster_kept_batches_read_back",
            "Batches kept here for a dead node only in the store (past outbox_memory_mb), read "
            "back to look through for its sessions",
            claims["kept_read_back"],
        )
        yield counter(
            "cluster_kept_waits_timed_out",
            "Asks for what a node kept for a dead node whose answer did not end within 2 s: "
            "the session sent on without waiting longer",
            claims["kept_waits_timed_out"],
        )
        yield counter(
            "cluster_kept_messages_reordered",
            "Queued messages of a session taken over from a dead node put back in their "
            "publisher's order once the kept messages it asked for had come",
            claims["kept_reordered"],
        )
        yield counter(
            "cluster_relay_waits",
            "Sessions that moved here from a live node held from the first message of a "
            "publishing node that came straight here until the old node's relayed copy came",
            claims["relay_waits"],
        )
        yield counter(
            "cluster_relay_waits_timed_out",
            "Such holds that ended after 2 s without the relayed copy",
            claims["relay_waits_timed_out"],
        )
        yield counter(
            "cluster_moved_home_lost",
            "Sessions that moved here whose old node's link went down while it could still "
            "relay for them: they asked the reachable nodes for what they kept for that node",
            claims["moved_home_lost"],
        )
        yield counter(
            "cluster_took_at_old_home",
            "Messages that came straight to a session that moved here, late, which it had "
            "taken at the node it came from: not delivered again",
            claims["took_at_old_home"],
        )
        yield counter(
            "cluster_taken_lists_told",
            "Lists of what a session that came here (or whose client came back here) in the "
            "last 30 s took, told to a node whose link came back (its version of the session, "
            "made while the two were cut off, does not take those messages again)",
            claims["taken_told"],
        )
        yield counter(
            "cluster_connects_refused_out_of_reach",
            "CONNECTs of persistent sessions refused (0x88) because the nodes that may hold "
            "the session were out of reach",
            claims["refused_out_of_reach"],
        )
        wills = dataplane.engine.will_stats()
        yield gauge(
            "cluster_will_copies",
            "Wills of other nodes' connections (sessions that end with them) held here",
            wills["held"],
        )
        yield counter(
            "cluster_wills_published_for_dead_nodes",
            "Wills of connections on a dead node this node published from its copy",
            wills["published"],
        )
        yield counter(
            "cluster_will_copies_refused",
            "Will copies from other nodes refused: for a partition this node does not own, or "
            "unreadable",
            wills["refused"],
        )
        copies = dataplane.engine.replica_stats()
        yield gauge(
            "cluster_session_copies",
            "Sessions of other nodes copied here (this node owns their partition)",
            copies["copies"],
        )
        for name, key, doc in (
            ("cluster_copy_ops_sent", "ops_out", "Session store operations copied to owners"),
            ("cluster_copy_ops_received", "ops_in", "Session store operations copied here"),
            (
                "cluster_degraded_acks",
                "degraded_acks",
                "QoS 1/2 acknowledgements given with no copy on a reachable owner",
            ),
            (
                "cluster_copies_refused",
                "stale_refused",
                "Copy operations refused: an older version of the session than the one held",
            ),
            (
                "cluster_sessions_fenced",
                "fenced",
                "Sessions dropped here because a newer version lives on another node",
            ),
            (
                "cluster_claims_served_from_copies",
                "claims_served",
                "Claims answered from a copy here (the session's home was down)",
            ),
            (
                "cluster_session_takeovers",
                "takeovers",
                "Sessions of a dead node installed here from their copies",
            ),
            (
                "cluster_sessions_streamed",
                "streamed",
                "Sessions of this node sent in full to an owner their partition gained",
            ),
            (
                "cluster_messages_taken_elsewhere",
                "taken_elsewhere",
                "Messages not delivered to a session here because its version on the sending "
                "node took them while the two were cut off (the versions merge after)",
            ),
            (
                "cluster_released_taken",
                "released_taken",
                "QoS 2 messages that a version of their session giving way to the one here had "
                "sent PUBREL for, taken in flight here under the same packet id (only the "
                "PUBREL goes to the client again)",
            ),
            (
                "cluster_messages_handed_on",
                "handed_on",
                "Messages for a session that had moved on from this node, passed on to where it "
                "went with the node they came from (that node's hand-over is told apart there)",
            ),
            (
                "cluster_copy_checks_sent",
                "checks_out",
                "Versions of sessions and copies told to a node whose link came up (one not "
                "acknowledged yet is not told again: it goes again with its batch)",
            ),
        ):
            yield counter(name, doc, copies[key])
        yield gauge(
            "cluster_session_stream_backlog",
            "Sessions of this node whose copies are still moving to new owners after a map "
            "change (replication lag of a rebalance)",
            copies["stream_backlog"],
        )


class BrokerMetrics:
    """The /metrics document: `render()` collects and formats at each scrape."""

    def __init__(self, collector: BrokerCollector) -> None:
        self.collector = collector
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)

    def render(self) -> bytes:
        return generate_latest(self.registry)
