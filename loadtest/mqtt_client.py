"""One MQTT connection on paho-mqtt 2.x (callback API VERSION2), driven by a greenlet.

Why a greenlet of our own rather than ``loop_start()``: Locust monkey-patches threading, so
``loop_start()``'s "thread" is a greenlet anyway (it works), but paho then routes every
publish through a socketpair byte to wake that loop, and writes from the loop greenlet. With
paho's external-loop API (``loop_read``/``loop_write``/``loop_misc``) the publishing greenlet
writes to the socket itself, and only reads happen in the loop greenlet: fewer syscalls and
switches per message (measured: see loadtest/README.md).

Every operation is bounded by the run's timeout and ends as one record (connect, subscribe,
publish); nothing here raises into a Locust task for an MQTT-level failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import Callable
from typing import Any

import gevent
import gevent.event
import gevent.select
import gevent.socket
import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from .context import RunContext
from .targets import Node

log = logging.getLogger("loadtest.mqtt")

LOOP_IDLE_S = 1.0  # longest select() wait: loop_misc() (keepalive) runs at least this often
READ_BURST = 256  # packets read per wake-up before yielding to other greenlets
RECV_CHUNK = 65536
# paho reads a packet with 3+ recv() calls (type byte, length bytes, body); we serve those
# from one large read. LOADTEST_READ_BUFFER=0 turns it off (to compare).
READ_BUFFER = os.environ.get("LOADTEST_READ_BUFFER", "1") != "0"


class _ReadBufferedSocket:
    """A plain TCP socket whose recv() is served from one large read.

    paho only calls recv/send/setblocking/pending/fileno/close on its socket (it wraps
    websockets the same way); ``pending()`` tells paho and our loop that bytes are buffered.
    """

    __slots__ = ("_buf", "_pos", "_sock")

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = b""
        self._pos = 0

    def recv(self, bufsize: int) -> bytes:
        if self._pos >= len(self._buf):
            data = self._sock.recv(RECV_CHUNK)  # BlockingIOError and b"" (EOF) go to paho
            if not data:
                return data
            self._buf, self._pos = data, 0
        start = self._pos
        self._pos = min(start + bufsize, len(self._buf))
        return self._buf[start : self._pos]

    def pending(self) -> int:
        return len(self._buf) - self._pos

    def send(self, data: bytes | bytearray | memoryview) -> int:
        return self._sock.send(data)

    def setblocking(self, flag: bool) -> None:
        self._sock.setblocking(flag)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        self._sock.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


class _Client(paho.Client):
    def _create_socket(self) -> Any:
        sock = super()._create_socket()
        if isinstance(sock, socket.socket) and sock.family in (socket.AF_INET, socket.AF_INET6):
            # paho leaves Nagle on: small publishes would wait for ACKs (up to 40 ms) and
            # the latencies we measure would be the client's, not the broker's.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if READ_BUFFER and not self._ssl and isinstance(sock, socket.socket):
            return _ReadBufferedSocket(sock)
        return sock


class MqttConnection:
    """A client connection whose connect/subscribe/publish timings become records.

    ``on_message(payload: bytes)`` is called in the loop greenlet for every PUBLISH received.
    """

    def __init__(
        self,
        ctx: RunContext,
        node: Node,
        client_id: str,
        scenario: str,
        *,
        on_message: Callable[[bytes], None] | None = None,
        clean_start: bool = True,
        session_expiry_s: int = 0,
    ) -> None:
        self.ctx = ctx
        self.node = node
        self.client_id = client_id
        self.scenario = scenario
        self.on_message = on_message
        self.clean_start = clean_start
        self.session_expiry_s = session_expiry_s
        self.session_present = False
        self.client: paho.Client | None = None
        self._loop: gevent.Greenlet | None = None
        self._connack = gevent.event.AsyncResult()
        self._acks: dict[int, gevent.event.AsyncResult] = {}  # SUBACK/UNSUBACK by mid
        # Unacknowledged publishes: mid -> (perf_counter at publish, deadline, bytes, qos, record?)
        self._publishes: dict[int, tuple[float, float, int, int, bool]] = {}
        self._early_acks: dict[
            int, float
        ] = {}  # QoS 0: written inside publish(), before we knew mid
        self._published = gevent.event.Event()
        self._published.set()
        self.connected = False

    # ---------------------------------------------------------------- connect

    def _new_client(self) -> paho.Client:
        settings = self.ctx.settings
        protocol = paho.MQTTv5 if settings.protocol == 5 else paho.MQTTv311
        kwargs: dict[str, Any] = {}
        if protocol == paho.MQTTv311:
            kwargs["clean_session"] = self.clean_start
        client = _Client(
            CallbackAPIVersion.VERSION2,
            client_id=self.client_id,
            protocol=protocol,
            reconnect_on_failure=False,
            **kwargs,
        )
        client.connect_timeout = settings.timeout_s
        # Our window limits what is unresolved; paho's default (20) would queue silently.
        client.max_inflight_messages_set(max(20, settings.inflight))
        if settings.username:
            client.username_pw_set(settings.username, settings.password)
        if self.node.tls:
            client.tls_set(cert_reqs=ssl.CERT_NONE if settings.tls_insecure else ssl.CERT_REQUIRED)
            client.tls_insecure_set(settings.tls_insecure)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_publish = self._on_publish
        client.on_subscribe = self._on_subscribe
        client.on_unsubscribe = self._on_unsubscribe
        client.on_message = self._on_message
        return client

    def connect(self, record: bool = True) -> bool:
        """Connect and wait for CONNACK; one ``connect`` record (latency to CONNACK)."""
        self.close()
        settings = self.ctx.settings
        self.client = client = self._new_client()
        self._connack = gevent.event.AsyncResult()
        properties = None
        kwargs: dict[str, Any] = {}
        if settings.protocol == 5:
            kwargs["clean_start"] = self.clean_start
            if self.session_expiry_s:
                properties = Properties(PacketTypes.CONNECT)
                properties.SessionExpiryInterval = self.session_expiry_s
        t0 = time.perf_counter()
        error: str | None = None
        stage = "TCP connect timeout"
        try:
            with gevent.Timeout(settings.timeout_s, TimeoutError()):
                client.connect(
                    self.node.host,
                    self.node.port,
                    keepalive=settings.keepalive,
                    properties=properties,
                    **kwargs,
                )
                stage = "no CONNACK"
                self._loop = gevent.spawn(self._run_loop, client)
                error = self._connack.get()
        except TimeoutError:
            error = stage
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc.strerror or exc}"
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        if error is None:
            self.connected = True
        else:
            self.close()
        if record:
            self.ctx.record(
                self.scenario,
                self.node.name,
                0,
                "connect",
                elapsed_ms,
                error,
                0,
                failed_after_ms=elapsed_ms,
            )
        return error is None

    def _on_connect(
        self, client: paho.Client, _userdata: Any, flags: Any, reason: Any, _props: Any
    ) -> None:
        if client is not self.client:
            return
        if reason.is_failure:
            self._connack.set(f"refused: {reason}")
        else:
            self.session_present = bool(flags.session_present)
            self._connack.set(None)

    def _on_disconnect(
        self, client: paho.Client, _userdata: Any, _flags: Any, reason: Any, _props: Any
    ) -> None:
        if client is not self.client:
            return
        if self.connected:
            log.debug("%s disconnected from %s: %s", self.client_id, self.node.name, reason)
        self.connected = False
        if not self._connack.ready():
            self._connack.set(f"disconnected: {reason}")
        for ack in self._acks.values():
            if not ack.ready():
                ack.set(None)

    def _run_loop(self, client: paho.Client) -> None:
        """Reads (and writes paho could not finish in publish()) until the socket closes."""
        try:
            while True:
                sock = client.socket()
                if sock is None:
                    break
                if self._buffered(sock):
                    # Bytes wait in a user-space buffer (ours or TLS's): the fd may not say so.
                    gevent.sleep(0)  # yield, as select() would have
                    readable: Any = True
                else:
                    want_write = client.want_write()
                    readable, _w, _x = gevent.select.select(
                        [sock], [sock] if want_write else [], [], LOOP_IDLE_S
                    )
                if readable:
                    for _ in range(READ_BURST):
                        rc = client.loop_read()
                        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or client.socket() is None:
                            break
                        if not self._more_to_read(client):
                            break
                    if client.socket() is None:
                        break
                if client.want_write() and client.loop_write() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    break
                if client.loop_misc() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    break
        except (OSError, ValueError) as exc:  # socket closed under us by close()
            log.debug("loop of %s ended: %s", self.client_id, exc)
        finally:
            if client is self.client:
                self.connected = False
                if not self._connack.ready():
                    self._connack.set("connection lost")

    @staticmethod
    def _buffered(sock: Any) -> bool:
        pending = getattr(sock, "pending", None)
        return pending is not None and pending() > 0

    def _more_to_read(self, client: paho.Client) -> bool:
        sock = client.socket()
        if sock is None:
            return False
        if isinstance(sock, _ReadBufferedSocket):
            # Empty buffer: the last read drained the kernel's too, or select() will say so.
            return sock.pending() > 0
        if self._buffered(sock):
            return True
        readable, _w, _x = gevent.select.select([sock], [], [], 0)
        return bool(readable)

    # ---------------------------------------------------------------- subscribe

    def subscribe(self, topic: str, qos: int, record: bool = True) -> bool:
        """SUBSCRIBE and wait for SUBACK; one ``subscribe`` record (latency to SUBACK)."""
        t0 = time.perf_counter()
        error: str | None = None
        if self.client is None or not self.connected:
            error = "not connected"
        else:
            rc, mid = self.client.subscribe(topic, qos)
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
                error = f"subscribe: {paho.error_string(rc)}"
            else:
                ack = self._acks[mid] = gevent.event.AsyncResult()
                try:
                    codes = ack.get(timeout=self.ctx.settings.timeout_s)
                except gevent.Timeout:
                    codes = None
                self._acks.pop(mid, None)
                if codes is None:
                    error = "no SUBACK" if self.connected else "connection lost"
                else:
                    failed = [c for c in codes if getattr(c, "is_failure", False)]
                    if failed:
                        error = f"refused: {failed[0]}"
        elapsed_ms = (time.perf_counter() - t0) * 1000.0
        if record:
            self.ctx.record(
                self.scenario, self.node.name, qos, "subscribe", elapsed_ms, error, 0,
                failed_after_ms=elapsed_ms,
            )  # fmt: skip
        return error is None

    def unsubscribe(self, topic: str) -> bool:
        if self.client is None or not self.connected:
            return False
        rc, mid = self.client.unsubscribe(topic)
        if rc != MQTTErrorCode.MQTT_ERR_SUCCESS or mid is None:
            return False
        ack = self._acks[mid] = gevent.event.AsyncResult()
        try:
            return ack.get(timeout=self.ctx.settings.timeout_s) is not None
        except gevent.Timeout:
            return False
        finally:
            self._acks.pop(mid, None)

    def _on_subscribe(self, client: paho.Client, _u: Any, mid: int, codes: Any, _p: Any) -> None:
        ack = self._acks.get(mid)
        if ack is not None:
            ack.set(list(codes))

    def _on_unsubscribe(self, client: paho.Client, _u: Any, mid: int, codes: Any, _p: Any) -> None:
        ack = self._acks.get(mid)
        if ack is not None:
            ack.set(list(codes) if codes else [])

    # ---------------------------------------------------------------- publish

    def publish(
        self, topic: str, payload: bytes, qos: int, retain: bool = False, record: bool = True
    ) -> bool:
        """Send a PUBLISH without waiting; its ``publish`` record is written on PUBACK/PUBCOMP
        (QoS 1/2) or once written to the socket (QoS 0). False if it could not be sent."""
        client = self.client
        if client is None or not self.connected:
            return False
        t0 = time.perf_counter()
        info = client.publish(topic, payload, qos, retain)
        if info.rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
            return False
        deadline = time.monotonic() + self.ctx.settings.timeout_s
        if not self._publishes:
            self.ctx.register_expirable(self)  # swept only while something is pending
            self._published.clear()
        self._publishes[info.mid] = (t0, deadline, len(payload), qos, record)
        acked = self._early_acks.pop(info.mid, None)
        if acked is not None:
            self._complete_publish(info.mid, acked)
        if client.want_write():
            # The socket is full: block this publisher until it drains (back-pressure).
            sock = client.socket()
            while sock is not None and client.want_write():
                try:
                    gevent.socket.wait_write(sock.fileno(), timeout=self.ctx.settings.timeout_s)
                except OSError:  # timed out or closed: the pending publishes will time out
                    break
                if client.loop_write() != MQTTErrorCode.MQTT_ERR_SUCCESS:
                    break
                sock = client.socket()
        return True

    def _on_publish(self, client: paho.Client, _u: Any, mid: int, reason: Any, _p: Any) -> None:
        now = time.perf_counter()
        if mid in self._publishes:
            self._complete_publish(mid, now, reason)
        elif client is self.client:
            self._early_acks[mid] = now

    def _complete_publish(self, mid: int, acked: float, reason: Any = None) -> None:
        t0, _deadline, nbytes, qos, record = self._publishes.pop(mid)
        if not self._publishes:
            self._published.set()
            self.ctx.unregister_expirable(self)
        if not record:
            return
        error = None
        if reason is not None and getattr(reason, "is_failure", False):
            error = f"refused: {reason}"
        latency = (acked - t0) * 1000.0
        self.ctx.record(
            self.scenario, self.node.name, qos, "publish", latency, error, nbytes,
            failed_after_ms=latency,
        )  # fmt: skip

    def wait_published(self, timeout: float) -> bool:
        """Every publish so far acknowledged (or timed out)."""
        return self._published.wait(timeout)

    def pending_count(self) -> int:
        return len(self._publishes)

    def expire(self, now_mono: float) -> None:
        expired = [mid for mid, entry in self._publishes.items() if entry[1] <= now_mono]
        for mid in expired:
            _t0, _deadline, nbytes, qos, record = self._publishes.pop(mid)
            if record:
                self.ctx.record(
                    self.scenario, self.node.name, qos, "publish", None, "timeout", nbytes,
                    failed_after_ms=self.ctx.settings.timeout_s * 1000.0,
                )  # fmt: skip
        if not self._publishes:
            self._published.set()
            self.ctx.unregister_expirable(self)

    # ---------------------------------------------------------------- receive

    def _on_message(self, _client: paho.Client, _u: Any, message: paho.MQTTMessage) -> None:
        if self.on_message is not None:
            self.on_message(bytes(message.payload))

    # ---------------------------------------------------------------- disconnect

    def disconnect(self, session_expiry_s: int | None = None) -> None:
        """Send DISCONNECT (v5: optionally overriding the session expiry) and close."""
        client = self.client
        if client is not None and self.connected:
            properties = None
            if session_expiry_s is not None and self.ctx.settings.protocol == 5:
                properties = Properties(PacketTypes.DISCONNECT)
                properties.SessionExpiryInterval = session_expiry_s
            with contextlib.suppress(Exception):
                # Written from this greenlet (paho writes directly when no thread runs it).
                client.disconnect(properties=properties)
                sock = client.socket()
                if sock is not None and client.want_write():
                    gevent.socket.wait_write(sock.fileno(), timeout=1.0)
                    client.loop_write()
        self.close()

    def close(self) -> None:
        """Drop the connection without DISCONNECT (or after it). Pending publishes stay until
        they time out: an unacknowledged publish is a failure whatever the reason."""
        client, loop = self.client, self._loop
        self.connected = False
        self._loop = None
        if loop is not None and not loop.dead and loop is not gevent.getcurrent():
            loop.kill(block=False)
        if client is not None:
            sock = client.socket()
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
            # paho keeps the closed socket object; drop it so the client cannot use it.
            client._sock = None
        self._early_acks.clear()
        for ack in self._acks.values():
            if not ack.ready():
                ack.set(None)

    def forget(self) -> None:
        """The publisher is gone: unacknowledged publishes failed ("stopped")."""
        publishes, self._publishes = self._publishes, {}
        for _t0, _deadline, nbytes, qos, record in publishes.values():
            if record:
                self.ctx.record(
                    self.scenario, self.node.name, qos, "publish", None, "stopped", nbytes
                )
        self._published.set()
        self.ctx.unregister_expirable(self)
