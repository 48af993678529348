"""Message payloads and end-to-end tracking: which messages a receiver still expects.

A payload is ``b"<send time ms>|<unique id>|"`` padded with ``x`` to the payload size, so
the receiver needs nothing but the message to compute the end-to-end latency. The publisher
registers each message with the receiver's :class:`Expectations` *before* publishing; the
receipt resolves it (a success), the sweeper declares it failed once its deadline passes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import gevent.event

from .records import now_ms

if TYPE_CHECKING:
    from .context import RunContext

SEPARATOR = b"|"


def make_payload(send_ms: float, msg_id: str, size: int) -> bytes:
    head = b"%.3f|%s|" % (send_ms, msg_id.encode("ascii"))
    return head + b"x" * (size - len(head)) if len(head) < size else head


def parse_payload(payload: bytes) -> tuple[float, str] | None:
    """(send time ms, id), or None for a payload that is not ours (e.g. an empty retained)."""
    parts = payload.split(SEPARATOR, 2)
    if len(parts) < 3:
        return None
    try:
        return float(parts[0]), parts[1].decode("ascii")
    except (ValueError, UnicodeDecodeError):
        return None


class Expectations:
    """Messages one receiver is waiting for; every one ends as one e2e record."""

    def __init__(self, ctx: RunContext, scenario: str, qos: int, node: str) -> None:
        self.ctx = ctx
        self.scenario = scenario
        self.qos = qos
        self.node = node  # the receiving client's node
        # id -> (deadline (monotonic s), send ms, release callback). Insertion order is
        # deadline order (one timeout per tracker), so expiry only looks at the front.
        self._pending: dict[str, tuple[float, float, Callable[[], None] | None]] = {}
        self._empty = gevent.event.Event()
        self._empty.set()
        self.unexpected = 0  # duplicates, late arrivals, foreign messages
        ctx.register_expirable(self)

    def expect(
        self,
        msg_id: str,
        send_ms: float,
        release: Callable[[], None] | None = None,
        extra_s: float = 0.0,
    ) -> None:
        deadline = time.monotonic() + self.ctx.settings.timeout_s + extra_s
        self._pending[msg_id] = (deadline, send_ms, release)
        self._empty.clear()

    def forget(self, msg_id: str) -> None:
        """The publish never left (no connection): neither a success nor an e2e failure."""
        entry = self._pending.pop(msg_id, None)
        if entry is not None and entry[2] is not None:
            entry[2]()
        if not self._pending:
            self._empty.set()

    def on_payload(self, payload: bytes) -> None:
        t_ms = now_ms()
        parsed = parse_payload(payload)
        entry = self._pending.pop(parsed[1], None) if parsed is not None else None
        if entry is None or parsed is None:
            self.unexpected += 1
            return
        latency = max(0.0, t_ms - parsed[0])  # clocks of two machines may disagree slightly
        self.ctx.record(
            self.scenario, self.node, self.qos, "e2e", latency, None, len(payload), t_ms
        )
        if entry[2] is not None:
            entry[2]()
        if not self._pending:
            self._empty.set()

    def expire(self, now_mono: float) -> None:
        pending = self._pending
        while pending:
            msg_id = next(iter(pending))
            deadline, _send_ms, release = pending[msg_id]
            if deadline > now_mono:
                break
            del pending[msg_id]
            self.ctx.record(
                self.scenario,
                self.node,
                self.qos,
                "e2e",
                None,
                "timeout",
                self.ctx.settings.payload_size,
                failed_after_ms=self.ctx.settings.timeout_s * 1000.0,
            )
            if release is not None:
                release()
        if not pending:
            self._empty.set()

    def pending_count(self) -> int:
        return len(self._pending)

    def wait_empty(self, timeout: float) -> bool:
        return self._empty.wait(timeout)

    def close(self) -> None:
        """The receiver is gone: what it still expects failed ("stopped"), nothing is lost
        silently. After the drain at the end of a run there is nothing left."""
        pending, self._pending = self._pending, {}
        for _deadline, _send, release in pending.values():
            self.ctx.record(
                self.scenario, self.node, self.qos, "e2e", None, "stopped",
                self.ctx.settings.payload_size,
            )  # fmt: skip
            if release is not None:
                release()
        self._empty.set()
        self.ctx.unregister_expirable(self)
