"""$SYS topics: broker statistics published as retained messages every [sys] interval seconds.

Names as Mosquitto uses them, so existing dashboards work. They are this node's own: the data
plane never forwards a $SYS message, so a client sees the node it is connected to. A cluster
node adds `$SYS/broker/cluster/...`: its node id, the clients connected to every member (as
their pings report them) and the traffic of each of its inter-node links. The workers of one
node (fastbroker.workers) each publish their own, with clients/connected counting every
worker's clients (the others' from their pings); the other counts are the worker's.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from fastbroker._connection import Server, monotonic_ms

PREFIX = "$SYS/broker"
VERSION_TOPIC = f"{PREFIX}/version"
UPTIME_TOPIC = f"{PREFIX}/uptime"
# Engine.stats() key -> topic below the prefix.
STAT_TOPICS = {
    "clients_connected": "clients/connected",
    "messages_received": "messages/received",
    "messages_sent": "messages/sent",
    "bytes_received": "bytes/received",
    "bytes_sent": "bytes/sent",
    "subscriptions": "subscriptions/count",
    "retained": "retained messages/count",
}
# Per inter-node link (the engine's cluster_stats): counters, and the bytes queued for the
# peer (sent and not yet acknowledged, or waiting) as its queue depth.
LINK_TOPICS = {
    "frames_out": "frames/sent",
    "frames_in": "frames/received",
    "messages_out": "messages/sent",
    "messages_in": "messages/received",
    "bytes_out": "bytes/sent",
    "bytes_in": "bytes/received",
    "unacked_bytes": "queue/bytes",
}


def sys_messages(
    stats: dict[str, int],
    uptime_s: int,
    version: str,
    cluster: ClusterView | None = None,
    node_wide_clients: bool = False,
) -> dict[str, bytes]:
    """Topic -> payload of every $SYS message for the given engine stats and, for a cluster
    node, what `cluster` reports (with `node_wide_clients`, its members are one node's
    workers: clients/connected is their sum)."""
    if cluster is not None and node_wide_clients:
        counts = cluster.member_clients().values()
        stats = {**stats, "clients_connected": sum(c for c in counts if c is not None)}
    messages = {
        VERSION_TOPIC: f"fastbroker version {version}".encode(),
        UPTIME_TOPIC: f"{uptime_s} seconds".encode(),
    }
    for key, topic in STAT_TOPICS.items():
        messages[f"{PREFIX}/{topic}"] = str(stats[key]).encode()
    if cluster is None:
        return messages
    base = f"{PREFIX}/cluster"
    messages[f"{base}/node"] = cluster.node_id.encode()
    for member, clients in cluster.member_clients().items():
        if clients is not None:
            messages[f"{base}/members/{member}/clients/connected"] = str(clients).encode()
    for peer, entry in cluster.link_stats().items():
        link = f"{base}/links/{peer}"
        messages[f"{link}/up"] = b"1" if entry.get("up") else b"0"
        for key, topic in LINK_TOPICS.items():
            messages[f"{link}/{topic}"] = str(entry.get(key, 0)).encode()
    return messages


class ClusterView(Protocol):
    """What $SYS needs of a cluster node (fastbroker.cluster.node.ClusterNode)."""

    node_id: str

    def member_clients(self) -> dict[str, int | None]: ...

    def link_stats(self) -> dict[str, dict[str, Any]]: ...


class SysTopicPublisher:
    """Publishes $SYS messages through the engine on a timer; only values that changed."""

    def __init__(
        self,
        engine: Any,
        server: Server,
        loop: asyncio.AbstractEventLoop,
        interval: float,
        version: str,
        cluster: ClusterView | None = None,
        node_wide_clients: bool = False,
    ) -> None:
        self.engine = engine
        self.node_wide_clients = node_wide_clients
        self.server = server
        self.loop = loop
        self.interval = interval
        self.version = version
        self.cluster = cluster
        self.started_ms = monotonic_ms()
        self.published: dict[str, bytes] = {}
        self.timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.interval > 0 and self.timer is None:
            self.publish()

    def stop(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def publish(self) -> None:
        # Rescheduled first so one failure does not end $SYS updates for good.
        self.timer = self.loop.call_later(self.interval, self.publish)
        now_ms = monotonic_ms()
        uptime_s = (now_ms - self.started_ms) // 1000
        messages = sys_messages(
            self.engine.stats(), uptime_s, self.version, self.cluster, self.node_wide_clients
        )
        for topic, payload in messages.items():
            # Retained, so unchanged values need no republishing.
            if self.published.get(topic) != payload:
                self.engine.publish(topic, payload, 0, True, now_ms)
                self.published[topic] = payload
        self.server.schedule_flush()
