"""The Locust user base class: pacing, connections that heal, message ids."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, ClassVar

import gevent
import gevent.lock
from locust import User, constant, task

from .context import RUN, RunContext
from .mqtt_client import MqttConnection
from .records import now_ms
from .targets import Node
from .tracking import Expectations, make_payload

FAIL_BACKOFF_S = 0.5  # after a failed connect: keeps a dead broker from being hammered
DRAIN_IDLE_S = 0.1
MAX_CATCH_UP_S = 1.0  # pacing: a late user skips ahead rather than bursting


class MqttUser(User):
    """One simulated device (or pair of devices). Subclasses implement ``setup``,
    ``iteration`` and optionally ``teardown``; all MQTT failures become records."""

    abstract = True
    scenario: ClassVar[str] = ""
    wait_time = constant(0)  # we pace ourselves: see pace()

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        self.ctx: RunContext = RUN
        self.number = -1
        self.node: Node | None = None
        self.connections: list[MqttConnection] = []
        self.trackers: list[Expectations] = []
        self._seq = 0
        self._next_at = 0.0
        self.window: gevent.lock.Semaphore | None = None

    # ---------------------------------------------------------------- Locust hooks

    def on_start(self) -> None:
        self.number = self.ctx.next_user_number()
        self.node = self.ctx.node_for(self.number)
        inflight = self.ctx.settings.inflight
        self.window = gevent.lock.Semaphore(inflight) if inflight > 0 else None
        self._next_at = time.monotonic()
        self.setup()

    def on_stop(self) -> None:
        if not self.ctx.draining:
            # A ramp-down stops this user alone: let its messages arrive first. (At the end
            # of a run the drain has done that for everyone.)
            deadline = time.monotonic() + self.settings.timeout_s
            for tracker in self.trackers:
                tracker.wait_empty(max(0.0, deadline - time.monotonic()))
        try:
            self.teardown()
        finally:
            for tracker in self.trackers:
                tracker.close()
            for conn in self.connections:
                conn.forget()
                conn.disconnect()

    @task
    def run_iteration(self) -> None:
        if self.ctx.draining:
            gevent.sleep(DRAIN_IDLE_S)
            return
        self.iteration()
        self.pace()

    # ---------------------------------------------------------------- for subclasses

    def setup(self) -> None:
        pass

    def iteration(self) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        pass

    @property
    def settings(self) -> Any:
        return self.ctx.settings

    def connection(
        self,
        role: str,
        node: Node | None = None,
        on_message: Callable[[bytes], None] | None = None,
        **kwargs: Any,
    ) -> MqttConnection:
        conn = MqttConnection(
            self.ctx,
            node or self.node or self.ctx.node_for(0),
            self.client_id(role),
            self.scenario,
            on_message=on_message,
            **kwargs,
        )
        self.connections.append(conn)
        return conn

    def tracker(self, node: Node, qos: int | None = None) -> Expectations:
        tracker = Expectations(
            self.ctx, self.scenario, self.settings.qos if qos is None else qos, node.name
        )
        self.trackers.append(tracker)
        return tracker

    def client_id(self, role: str) -> str:
        # Short (MQTT 3.1.1 servers may refuse > 23 characters) and unique per run.
        return f"lt{self.ctx.worker_tag}{self.number}{role}"

    def ensure(
        self, conn: MqttConnection, subscribe: str | None = None, qos: int | None = None
    ) -> bool:
        """Connected (and subscribed) or a recorded failure plus a back-off."""
        if conn.connected:
            return True
        ok = conn.connect()
        if ok and subscribe is not None and not conn.session_present:
            ok = conn.subscribe(subscribe, self.settings.qos if qos is None else qos)
        if not ok:
            gevent.sleep(FAIL_BACKOFF_S)
        return ok

    def next_message(self) -> tuple[str, float, bytes]:
        """(unique id, send time ms, payload) for a new message."""
        self._seq += 1
        msg_id = f"{self.ctx.worker_tag}.{self.number}.{self._seq}"
        send_ms = now_ms()
        return msg_id, send_ms, make_payload(send_ms, msg_id, self.settings.payload_size)

    def acquire_window(self) -> bool:
        """Wait for room in this user's in-flight window; False if the test is draining."""
        if self.window is not None:
            while not self.window.acquire(timeout=DRAIN_IDLE_S):
                if self.ctx.draining:
                    return False
            if self.ctx.draining:
                self.window.release()
                return False
        return not self.ctx.draining

    def release_window(self) -> None:
        if self.window is not None:
            self.window.release()

    def pace(self) -> None:
        rate = self.settings.rate
        if rate <= 0:
            gevent.sleep(0)  # let the loop greenlets read
            return
        now = time.monotonic()
        self._next_at = max(self._next_at + 1.0 / rate, now - MAX_CATCH_UP_S)
        delay = self._next_at - now
        gevent.sleep(delay if delay > 0 else 0)
