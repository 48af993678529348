"""Per-process state of a load test: settings, the record writer, the timeout sweeper, drain.

Locust runs one of these per process (each ``--processes`` child, each ``--worker``, or the
single local process). Everything here runs in that process's gevent hub, so no locks.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import time
import weakref
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import gevent

from .records import DEFAULT_RESULTS_DIR, RecordWriter, now_ms
from .targets import Node, parse_hosts

log = logging.getLogger("loadtest")

SCENARIOS = ("connect", "fanin", "fanout", "pairs", "retained", "persistent")
SWEEP_INTERVAL_S = 0.05
MQTT_VERSIONS = {"5": 5, "3.1.1": 4, "311": 4, "4": 4}


class MqttFailure(Exception):
    """What Locust shows for a failed request (it groups failures by this text)."""


class Expirable(Protocol):
    def expire(self, now_mono: float) -> None: ...

    def pending_count(self) -> int: ...


def parse_scenarios(values: list[str] | str | None) -> list[str]:
    """``["pairs,retained", "connect"]`` -> ``["pairs", "retained", "connect"]`` (validated)."""
    if values is None:
        values = ["pairs"]
    if isinstance(values, str):
        values = [values]
    out: list[str] = []
    for value in values:
        for name in value.split(","):
            name = name.strip().lower()
            if not name:
                continue
            if name not in SCENARIOS:
                raise ValueError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
            if name not in out:
                out.append(name)
    return out or ["pairs"]


@dataclass
class Settings:
    """Everything the users need from the command line (custom Locust arguments)."""

    scenarios: list[str] = field(default_factory=lambda: ["pairs"])
    qos: int = 1
    protocol: int = 5  # 5 or 4 (MQTT 3.1.1)
    timeout_s: float = 5.0
    payload_size: int = 64
    rate: float = 10.0  # iterations (messages, connect cycles, ...) per second per user; 0: max
    inflight: int = 10  # unresolved messages per user when publishing
    fanout_rate: float = 10.0  # messages per second of each worker's fan-out publisher
    keepalive: int = 60
    batch: int = 10  # persistent: messages published while the subscriber is offline
    offline_s: float = 0.2
    session_expiry_s: int = 300
    cross_node: bool = False  # pairs: subscriber on the next node (routing across a cluster)
    results_dir: str = DEFAULT_RESULTS_DIR
    run_id: str = ""
    username: str | None = None
    password: str | None = None
    tls_insecure: bool = False
    host: str = ""

    @classmethod
    def from_options(cls, options: Any, host: str | None) -> Settings:
        def opt(name: str, default: Any) -> Any:
            value = getattr(options, name, None) if options is not None else None
            return default if value is None else value

        version = str(opt("mqtt_version", "5"))
        if version not in MQTT_VERSIONS:
            raise ValueError(f"--mqtt-version must be 5 or 3.1.1, not {version!r}")
        qos = int(opt("qos", 1))
        if qos not in (0, 1, 2):
            raise ValueError(f"--qos must be 0, 1 or 2, not {qos}")
        return cls(
            scenarios=parse_scenarios(opt("scenario", None)),
            qos=qos,
            protocol=MQTT_VERSIONS[version],
            timeout_s=float(opt("mqtt_timeout", 5.0)),
            payload_size=int(opt("payload_size", 64)),
            rate=float(opt("rate", 10.0)),
            inflight=int(opt("inflight", 10)),
            fanout_rate=float(opt("fanout_rate", 10.0)),
            keepalive=int(opt("keepalive", 60)),
            batch=int(opt("batch", 10)),
            offline_s=float(opt("offline_time", 0.2)),
            session_expiry_s=int(opt("session_expiry", 300)),
            cross_node=bool(opt("cross_node", False)),
            results_dir=str(opt("results_dir", DEFAULT_RESULTS_DIR)),
            run_id=str(opt("run_id", "") or ""),
            username=opt("mqtt_username", None) or None,
            password=opt("mqtt_password", None) or None,
            tls_insecure=bool(opt("tls_insecure", False)),
            host=host or "",
        )

    def public(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("password", None)
        return d


class RunContext:
    """The process-wide singleton the users and the Locust event hooks share."""

    def __init__(self) -> None:
        self.environment: Any = None
        self.settings = Settings()
        self.writer: RecordWriter | None = None
        self.nodes: list[Node] = []
        self.worker_index = 0
        self.worker_tag = "0"
        self.draining = False
        self._expirables: weakref.WeakSet[Any] = weakref.WeakSet()
        self._busy = 0
        self._sweeper: gevent.Greenlet | None = None
        self._user_numbers = itertools.count()
        self.shared: dict[str, Any] = {}  # per-process components (fan-in sink, fan-out source)

    # ---------------------------------------------------------------- lifecycle

    def start(self, environment: Any, settings: Settings, worker_index: int) -> None:
        self.environment = environment
        self.settings = settings
        self.nodes = parse_hosts(settings.host)
        self.worker_index = worker_index
        self.writer = RecordWriter(settings.results_dir, settings.run_id)
        # Short and unique per run and process: it goes into every client id and topic.
        self.worker_tag = hashlib.blake2s(
            f"{settings.run_id}/{self.writer.worker}".encode(), digest_size=4
        ).hexdigest()
        self.draining = False
        self._user_numbers = itertools.count()
        self._sweeper = gevent.spawn(self._sweep_forever)

    def stop(self) -> None:
        """After the users stopped: no more records; flush the file."""
        if self._sweeper is not None:
            self._sweeper.kill(block=False)
            self._sweeper = None
        if self.writer is not None:
            self.writer.flush()
            log.info("%d records written to %s", self.writer.count, self.writer.path)

    def close(self) -> None:
        self.stop()
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    @property
    def active(self) -> bool:
        return self.writer is not None

    # ---------------------------------------------------------------- users

    def next_user_number(self) -> int:
        return next(self._user_numbers)

    def node_for(self, n: int) -> Node:
        """Spread users over the nodes; workers start at different offsets."""
        return self.nodes[(self.worker_index + n) % len(self.nodes)]

    def topic(self, scenario: str, *parts: object) -> str:
        return "/".join(["lt", self.settings.run_id, scenario, self.worker_tag, *map(str, parts)])

    # ---------------------------------------------------------------- records

    def record(
        self,
        scenario: str,
        node: str,
        qos: int,
        kind: str,
        latency_ms: float | None,
        error: str | None = None,
        nbytes: int = 0,
        t_ms: float | None = None,
        failed_after_ms: float = 0.0,
    ) -> None:
        """One raw record and the matching Locust request event."""
        if t_ms is None:
            t_ms = now_ms()
        ok = error is None
        if self.writer is not None:
            self.writer.write(
                scenario=scenario,
                node=node,
                qos=qos,
                kind=kind,
                t_ms=t_ms,
                latency_ms=latency_ms if ok else None,
                ok=ok,
                error=error,
                nbytes=nbytes,
            )
        if self.environment is not None:
            self.environment.events.request.fire(
                request_type=f"{kind}-qos{qos}" if kind in ("e2e", "publish") else kind,
                name=scenario,
                response_time=latency_ms if ok and latency_ms is not None else failed_after_ms,
                response_length=nbytes,
                exception=None if ok else MqttFailure(error),
                context={"node": node},
            )

    # ---------------------------------------------------------------- timeouts

    def register_expirable(self, item: Expirable) -> None:
        self._expirables.add(item)

    def unregister_expirable(self, item: Expirable) -> None:
        self._expirables.discard(item)

    def _sweep_forever(self) -> None:
        while True:
            gevent.sleep(SWEEP_INTERVAL_S)
            now = time.monotonic()
            for item in list(self._expirables):
                try:
                    item.expire(now)
                except Exception:  # one broken tracker must not stop timeouts everywhere
                    log.exception("expiry failed")

    # ---------------------------------------------------------------- drain

    @contextlib.contextmanager
    def cycle(self) -> Iterator[None]:
        """A multi-step iteration (retained, persistent) that the drain waits for."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1

    def pending(self) -> int:
        return self._busy + sum(item.pending_count() for item in list(self._expirables))

    def drain(self, timeout: float) -> bool:
        """Stop new messages; wait until every sent one is received or timed out."""
        self.draining = True
        deadline = time.monotonic() + timeout
        while self.pending() and time.monotonic() < deadline:
            gevent.sleep(0.05)
        left = self.pending()
        if left:
            log.warning("drain: %d messages/operations still pending after %.1fs", left, timeout)
        return left == 0


RUN = RunContext()
