"""$SYS topics: broker statistics published as retained messages every [sys] interval seconds."""

from __future__ import annotations

import asyncio
from typing import Any

from fastbroker._connection import Server, monotonic_ms

VERSION_TOPIC = "$SYS/broker/version"
UPTIME_TOPIC = "$SYS/broker/uptime"
# Engine.stats() key -> topic (names as mosquitto uses them, so existing dashboards work).
STAT_TOPICS = {
    "clients_connected": "$SYS/broker/clients/connected",
    "messages_received": "$SYS/broker/messages/received",
    "messages_sent": "$SYS/broker/messages/sent",
    "bytes_received": "$SYS/broker/bytes/received",
    "bytes_sent": "$SYS/broker/bytes/sent",
    "subscriptions": "$SYS/broker/subscriptions/count",
    "retained": "$SYS/broker/retained messages/count",
}


def sys_messages(stats: dict[str, int], uptime_s: int, version: str) -> dict[str, bytes]:
    """Topic -> payload of every $SYS message for the given engine stats."""
    messages = {
        VERSION_TOPIC: f"fastbroker version {version}".encode(),
        UPTIME_TOPIC: f"{uptime_s} seconds".encode(),
    }
    for key, topic in STAT_TOPICS.items():
        messages[topic] = str(stats[key]).encode()
    return messages


class SysTopicPublisher:
    """Publishes $SYS messages through the engine on a timer; only values that changed."""

    def __init__(
        self,
        engine: Any,
        server: Server,
        loop: asyncio.AbstractEventLoop,
        interval: float,
        version: str,
    ) -> None:
        self.engine = engine
        self.server = server
        self.loop = loop
        self.interval = interval
        self.version = version
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
        messages = sys_messages(self.engine.stats(), uptime_s, self.version)
        for topic, payload in messages.items():
            # Retained, so unchanged values need no republishing.
            if self.published.get(topic) != payload:
                self.engine.publish(topic, payload, 0, True, now_ms)
                self.published[topic] = payload
        self.server.schedule_flush()
