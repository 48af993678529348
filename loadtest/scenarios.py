"""The load-test scenarios: one Locust user class each (selected with ``--scenario``).

Topics are ``lt/RUN_ID/SCENARIO/WORKER_TAG/...``: a receiver's expectations are always
registered in the same process as its publisher, so a missing message is known exactly.
"""

from __future__ import annotations

import logging

import gevent
import gevent.lock

from .context import RunContext
from .mqtt_client import MqttConnection
from .mqtt_user import FAIL_BACKOFF_S, MqttUser
from .records import now_ms
from .tracking import Expectations, make_payload

log = logging.getLogger("loadtest.scenarios")


class ConnectStormUser(MqttUser):
    """connect: CONNECT, time to CONNACK, DISCONNECT, repeat (``--rate`` cycles/s/user)."""

    scenario = "connect"

    def iteration(self) -> None:
        self._seq += 1
        assert self.node is not None
        conn = MqttConnection(self.ctx, self.node, self.client_id(f"c{self._seq}"), self.scenario)
        if conn.connect():
            conn.disconnect()
        else:
            gevent.sleep(FAIL_BACKOFF_S)


class PairsUser(MqttUser):
    """pairs: a publisher and its own subscriber (on the next node with ``--cross-node``)."""

    scenario = "pairs"

    def setup(self) -> None:
        assert self.node is not None
        sub_node = self.ctx.node_for(self.number + 1) if self.settings.cross_node else self.node
        self.topic = self.ctx.topic(self.scenario, self.number)
        self.expected = self.tracker(sub_node)
        self.sub = self.connection("s", sub_node, on_message=self.expected.on_payload)
        self.pub = self.connection("p")

    def iteration(self) -> None:
        if not self.ensure(self.sub, subscribe=self.topic) or not self.ensure(self.pub):
            return
        if not self.acquire_window():
            return
        msg_id, send_ms, payload = self.next_message()
        self.expected.expect(msg_id, send_ms, self.release_window)
        if not self.pub.publish(self.topic, payload, self.settings.qos):
            self.expected.forget(msg_id)


class FanInSink:
    """fanin: one wildcard subscriber per worker process, shared by all fan-in users."""

    def __init__(self, ctx: RunContext) -> None:
        node = ctx.node_for(0)
        self.topic = ctx.topic("fanin", "+")
        self.expected = Expectations(ctx, "fanin", ctx.settings.qos, node.name)
        self.conn = MqttConnection(
            ctx, node, f"lt{ctx.worker_tag}fin", "fanin", on_message=self.expected.on_payload
        )
        self.qos = ctx.settings.qos
        self.users = 0
        self._lock = gevent.lock.Semaphore()

    def ensure(self) -> bool:
        with self._lock:  # one connect attempt at a time, whoever asks
            if self.conn.connected:
                return True
            ok = self.conn.connect() and self.conn.subscribe(self.topic, self.qos)
        if not ok:
            gevent.sleep(FAIL_BACKOFF_S)
        return ok

    def close(self) -> None:
        self.expected.close()
        self.conn.forget()
        self.conn.disconnect()


class FanInUser(MqttUser):
    """fanin: many publishers (the users) -> one wildcard subscriber per worker process."""

    scenario = "fanin"

    def setup(self) -> None:
        sink = self.ctx.shared.get("fanin")
        if sink is None:
            sink = self.ctx.shared["fanin"] = FanInSink(self.ctx)
        sink.users += 1
        self.sink: FanInSink = sink
        self.topic = self.ctx.topic(self.scenario, self.number)
        self.pub = self.connection("p")

    def iteration(self) -> None:
        if not self.sink.ensure() or not self.ensure(self.pub):
            return
        if not self.acquire_window():
            return
        msg_id, send_ms, payload = self.next_message()
        self.sink.expected.expect(msg_id, send_ms, self.release_window)
        if not self.pub.publish(self.topic, payload, self.settings.qos):
            self.sink.expected.forget(msg_id)

    def teardown(self) -> None:
        self.sink.users -= 1
        if self.sink.users == 0 and self.ctx.shared.get("fanin") is self.sink:
            del self.ctx.shared["fanin"]
            self.sink.close()


class FanOutSource:
    """fanout: one publisher per worker process; every message is expected by every
    subscriber that had its SUBACK when it was sent."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.node = ctx.node_for(0)
        self.topic = ctx.topic("fanout")
        self.conn = MqttConnection(ctx, self.node, f"lt{ctx.worker_tag}fout", "fanout")
        self.subscribers: list[Expectations] = []
        self.users = 0
        self._seq = 0
        self._greenlet = gevent.spawn(self._publish_forever)

    def _publish_forever(self) -> None:
        settings = self.ctx.settings
        interval = 1.0 / settings.fanout_rate if settings.fanout_rate > 0 else 0.0
        while True:
            if self.ctx.draining or not self.subscribers:
                gevent.sleep(0.1)
                continue
            if not self.conn.connected and not self.conn.connect():
                gevent.sleep(FAIL_BACKOFF_S)
                continue
            self._seq += 1
            msg_id = f"{self.ctx.worker_tag}.fo.{self._seq}"
            send_ms = now_ms()
            receivers = list(self.subscribers)
            for expected in receivers:
                expected.expect(msg_id, send_ms)
            payload = make_payload(send_ms, msg_id, settings.payload_size)
            if not self.conn.publish(self.topic, payload, settings.qos):
                for expected in receivers:
                    expected.forget(msg_id)
            gevent.sleep(interval)

    def close(self) -> None:
        self._greenlet.kill(block=False)
        self.conn.forget()
        self.conn.disconnect()


class FanOutUser(MqttUser):
    """fanout: the users are subscribers of their worker's one fan-out topic."""

    scenario = "fanout"

    def setup(self) -> None:
        source = self.ctx.shared.get("fanout")
        if source is None:
            source = self.ctx.shared["fanout"] = FanOutSource(self.ctx)
        source.users += 1
        self.source: FanOutSource = source
        assert self.node is not None
        self.expected = self.tracker(self.node)
        self.sub = self.connection("s", on_message=self.expected.on_payload)

    def iteration(self) -> None:
        if self.sub.connected:
            gevent.sleep(0.2)  # the source publishes; we only watch our connection
            return
        if self.expected in self.source.subscribers:
            self.source.subscribers.remove(self.expected)
        if self.ensure(self.sub, subscribe=self.source.topic):
            self.source.subscribers.append(self.expected)

    def pace(self) -> None:
        pass

    def teardown(self) -> None:
        if self.expected in self.source.subscribers:
            self.source.subscribers.remove(self.expected)
        self.source.users -= 1
        if self.source.users == 0 and self.ctx.shared.get("fanout") is self.source:
            del self.ctx.shared["fanout"]
            self.source.close()


class RetainedUser(MqttUser):
    """retained: publish a retained message, then a new subscription must receive it.

    e2e = send time in the payload -> receipt by the subscription made after the PUBACK, so
    it covers store + SUBSCRIBE + retained delivery.
    """

    scenario = "retained"

    def setup(self) -> None:
        assert self.node is not None
        self.topic = self.ctx.topic(self.scenario, self.number)
        self.expected = self.tracker(self.node)
        self.sub = self.connection("s", on_message=self.expected.on_payload)
        self.pub = self.connection("p")

    def iteration(self) -> None:
        if not self.ensure(self.sub) or not self.ensure(self.pub):
            return
        timeout = self.settings.timeout_s
        qos = self.settings.qos
        with self.ctx.cycle():
            msg_id, send_ms, payload = self.next_message()
            self.expected.expect(msg_id, send_ms)
            if not self.pub.publish(self.topic, payload, qos, retain=True):
                self.expected.forget(msg_id)
                return
            self.pub.wait_published(timeout)
            if self.sub.subscribe(self.topic, qos):
                self.expected.wait_empty(timeout + 0.1)
                self.sub.unsubscribe(self.topic)

    def teardown(self) -> None:
        # Leave no retained message behind in the broker.
        if self.pub.connected:
            self.pub.publish(self.topic, b"", 0, retain=True, record=False)


class PersistentSessionUser(MqttUser):
    """persistent: a subscriber with a persistent session goes offline, ``--batch`` QoS>=1
    messages are published meanwhile, it reconnects (clean_start false) and must get them all.
    A reconnect without the session is a ``connect`` failure; a missing message an e2e one."""

    scenario = "persistent"

    def setup(self) -> None:
        assert self.node is not None
        self.qos = max(1, self.settings.qos)
        self.topic = self.ctx.topic(self.scenario, self.number)
        self.expected = self.tracker(self.node, self.qos)
        self.sub = self.connection(
            "k",
            on_message=self.expected.on_payload,
            # v5: a new session on the first connect, resumed afterwards (see iteration);
            # 3.1.1 has no "new but persistent": clean_session false from the start.
            clean_start=self.settings.protocol == 5,
            session_expiry_s=self.settings.session_expiry_s,
        )
        self.pub = self.connection("p")

    def iteration(self) -> None:
        if not self.ensure(self.pub) or not self.ensure(self.sub, self.topic, self.qos):
            return
        self.sub.clean_start = False
        settings = self.settings
        with self.ctx.cycle():
            self.sub.disconnect()
            # Deadlines cover the offline time and the reconnect too.
            extra = settings.offline_s + settings.timeout_s
            for _ in range(settings.batch):
                msg_id, send_ms, payload = self.next_message()
                self.expected.expect(msg_id, send_ms, extra_s=extra)
                if not self.pub.publish(self.topic, payload, self.qos):
                    self.expected.forget(msg_id)
            self.pub.wait_published(settings.timeout_s)
            gevent.sleep(settings.offline_s)
            if not self.sub.connect():
                return  # the messages time out: failures
            if not self.sub.session_present:
                self.ctx.record(
                    self.scenario, self.sub.node.name, 0, "connect", None, "session not present"
                )
                self.sub.subscribe(self.topic, self.qos)
            self.expected.wait_empty(extra + 0.1)

    def teardown(self) -> None:
        # End the session in the broker rather than leave it queueing for --session-expiry.
        if self.settings.protocol == 5 and self.sub.connected:
            self.sub.disconnect(session_expiry_s=0)
            return
        self.sub.clean_start = True
        self.sub.session_expiry_s = 0
        if self.sub.connect(record=False):
            self.sub.disconnect()


SCENARIO_USERS: dict[str, type[MqttUser]] = {
    cls.scenario: cls
    for cls in (
        ConnectStormUser,
        FanInUser,
        FanOutUser,
        PairsUser,
        RetainedUser,
        PersistentSessionUser,
    )
}
