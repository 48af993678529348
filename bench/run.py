#!/usr/bin/env python3
"""Side-by-side benchmark: fastbroker against Mosquitto on loopback, same load generator.

    python bench/run.py [--rounds 3] [--duration 5] [--warmup 1] [--scenarios fan-in,qos1,...]
                        [--results bench/results] [--quick]
    python bench/run.py --scenarios persistent      # only the durable-storage scenarios

Every scenario runs once per broker per round, on a broker started fresh for it (on a free
loopback port, in its own temporary directory, with its queue and in-flight limits lifted).
The order alternates: fastbroker first in odd rounds, Mosquitto first in even ones. The load
generator is bench/loadgen (built with cargo if missing). The harness reads each broker's CPU
time and RSS from /proc, prints one table with each figure's medians and the ratio
fastbroker / Mosquitto as min-median-max over the rounds, and writes one JSON line per
scenario x broker x round plus a summary JSON under the results directory.

The durable-storage scenarios (qos1-persistent-always/-interval/-never, startup-1m) run with
persistence on in both brokers; they are part of the full run but not of --quick (the perf
gate's set). startup-1m fills a stored session with 1,000,000 messages, stops the broker with
SIGTERM and times its restart on the same data until a CONNACK.

The security scenarios (--scenarios security: fan-in-acl, connect-plain, connect-auth,
pairs-tls, pairs-ws) run only when named. Each repeats a standard load with one feature on in
both brokers: an ACL file, a password file (each broker's own tool and default hash, whose
costs are timed in isolation and logged), a TLS or a WebSocket listener. Certificates and
password files are made at run time (openssl, fastbroker passwd, mosquitto_passwd) in the
run's temporary directory.

Only the processes this script starts are ever stopped, by PID, with bounded waits.
Standard library only; Linux only (/proc).
"""

from __future__ import annotations

import argparse
import atexit
import base64
import ctypes
import hashlib
import importlib.util
import itertools
import json
import math
import os
import re
import resource
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
LOADGEN_MANIFEST = REPO / "bench" / "loadgen" / "Cargo.toml"
LOADGEN_BIN = REPO / "bench" / "loadgen" / "target" / "release" / "fastbroker-loadgen"
DEFAULT_RESULTS = REPO / "bench" / "results"
SCHEMA = "fastbroker-bench/1"
BROKERS = ("fastbroker", "mosquitto")
READY_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
SAMPLE_INTERVAL_S = 0.1
CONNECTION_SOURCES = "127.0.0.2-127.0.0.16"
# Durable-storage scenarios: the persistent subscriber's fixed client id, and startup-1m.
PERSISTENT_SUBSCRIBER = "fbl-bench-persistent-sub"
STARTUP_MESSAGES = 1_000_000
FILL_TIME_LIMIT_S = 60.0  # the fill (not timed) fails past this; ~4-7 s on 2 cores
SHUTDOWN_TIMEOUT_S = 120.0  # SIGTERM -> exit after the fill (Mosquitto writes its file then)
STARTUP_TIMEOUT_S = 120.0  # process start -> CONNACK
DRAIN_TIME_LIMIT_S = 30.0  # the optional drain of the stored messages after start-up
PROBE_RETRY_S = 0.002  # start-up probe: pause between refused connects
# Security scenarios (opt-in: --scenarios security). Throwaway credentials and certificates,
# made at run time in the run's temporary directory (deleted at its end).
BENCH_USERNAME = "bench"
BENCH_PASSWORD = "bench-password-not-secret"
AUTH_CONNECTIONS = 300  # connect-auth: fastbroker's scrypt checks take ~10 s for these
AUTH_CONCURRENCY = 32  # under fastbroker's 256 waiting checks (0x89 past them)
WS_PATH = "/mqtt"
HASH_TIMING_S = 1.0  # measuring each hash function's cost in isolation
SECURITY_NAMES = ("fan-in-acl", "connect-plain", "connect-auth", "pairs-tls", "pairs-ws")

# Mosquitto runs with its limits lifted, so it never drops, queues or throttles where fastbroker
# would not; fastbroker runs with its default settings (the targets are for those), except in
# the persistence scenarios, whose 1M-message fill needs a queue that large.
FASTBROKER_MQTT_LIMITS: dict[str, int] = {
    "max_queued_messages": 1_000_000,
    "max_inflight": 65535,
    "receive_maximum": 65535,
}
MOSQUITTO_LIMITS: dict[str, int | str] = {
    "max_queued_messages": 0,  # 0: no limit
    "max_inflight_messages": 0,  # 0: no limit
    "max_queued_bytes": 0,  # 0: no limit
    "max_connections": -1,  # -1: no limit
    "persistence": "false",
    "set_tcp_nodelay": "true",
}
LIMITS_TEXT = (
    "fastbroker: default [mqtt] settings (persistence scenarios: max_queued_messages=1000000 "
    "max_inflight=65535 receive_maximum=65535), [sys] interval=0, log level warning; "
    "mosquitto: max_queued_messages 0, "
    "max_inflight_messages 0, max_queued_bytes 0 (0 = unlimited), max_connections -1, "
    "persistence false, set_tcp_nodelay true, sys_interval 0, errors/warnings logged only"
)


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Persistence:
    """Durable storage in a scenario: fastbroker's [storage] fsync policy and the Mosquitto
    settings closest to it (besides `persistence true` and a persistence_location in the
    run's temporary directory)."""

    fsync: str  # fastbroker [storage] fsync: always | interval | never
    mosquitto: tuple[tuple[str, str], ...]  # extra mosquitto.conf lines
    mosquitto_words: str  # how close that is, for the printed parameters

    def params(self, broker: str) -> dict[str, Any]:
        if broker == "fastbroker":
            out: dict[str, Any] = {"fsync": self.fsync}
            if self.fsync == "interval":
                out["fsync_interval_ms"] = 10
            return out
        if broker == "mosquitto":
            return {"persistence": "true", **dict(self.mosquitto), "note": self.mosquitto_words}
        return {}


# Mosquitto keeps everything in memory and writes a whole snapshot of it (to a temporary
# file, fflush + fsync + rename) at shutdown, every `autosave_interval` seconds (default
# 1800), or, with `autosave_on_changes true`, once a main-loop iteration ends with at least
# `autosave_interval` counted changes (queued messages, subscription changes, retained
# messages, persistent connects). It never holds a PUBACK back for a save.
PERSISTENCE: dict[str, Persistence] = {
    "always": Persistence(
        "always",
        (("autosave_on_changes", "true"), ("autosave_interval", "1")),
        "autosave_on_changes true + autosave_interval 1: a snapshot after every loop iteration "
        "with a counted change, its closest to per-write durability (PUBACKs not held back)",
    ),
    "interval": Persistence(
        "interval",
        (("autosave_interval", "1"),),
        "autosave_interval 1: a snapshot every second, its shortest interval "
        "(fastbroker: group commit every 10 ms)",
    ),
    "never": Persistence(
        "never",
        (),
        "default autosave_interval 1800: no snapshot during the run, only at shutdown "
        "(nothing closer to 'write, never fsync')",
    ),
}
# startup-1m: fastbroker's default policy; Mosquitto's default persistence (the file is
# written at the SIGTERM that ends the fill).
STARTUP_PERSISTENCE = Persistence(
    "interval",
    (),
    "default autosave_interval 1800: the file is written at shutdown (SIGTERM)",
)


@dataclass(frozen=True)
class Security:
    """What a security scenario turns on, the same way in both brokers: an ACL file, a
    password file (then anonymous clients are refused), and the transport (tcp, tls, ws).
    The loadgen's clients get the matching options (see security_loadgen_options)."""

    acl: bool = False
    passwords: bool = False
    transport: str = "tcp"  # tcp | tls | ws

    def params(self) -> dict[str, Any]:
        return {"acl": self.acl, "passwords": self.passwords, "transport": self.transport}


@dataclass(frozen=True)
class Figure:
    """One measured number of a scenario: a key of the loadgen's JSON (or one the harness
    derives, such as rss_per_conn_bytes), shown as one table row with its own ratio."""

    key: str
    label: str
    direction: str = "higher"  # which way is better: "higher" or "lower"
    unit: str = ""
    optional: bool = False  # a run without it is kept (with a note), not failed


@dataclass(frozen=True)
class Scenario:
    name: str
    command: str  # the loadgen's scenario argument
    options: tuple[tuple[str, str], ...]
    summary: str  # parameters in words, for the table
    figures: tuple[Figure, ...]
    uses_broker: bool = True
    persistence: Persistence | None = None  # None: nothing persisted (the standard set)
    kind: str = "loadgen"  # "loadgen": one timed loadgen run; "startup": see measure_startup
    security: Security | None = None  # None: plain TCP, no auth (every standard scenario)

    def loadgen_args(self, settings: Settings) -> list[str]:
        """The loadgen's command line (for "startup", that of its fill phase)."""
        args = [self.command]
        if self.uses_broker:
            args += ["--host", HOST, "--port", "{port}"]
        if self.kind == "loadgen":
            args += [
                "--duration",
                fmt_num(settings.duration),
                "--warmup",
                fmt_num(settings.warmup),
            ]
        for key, value in self.options:
            args += [f"--{key}", value]
        if self.security is not None:
            args += security_loadgen_options(self.security)
        return args

    def params(self, settings: Settings) -> dict[str, Any]:
        out: dict[str, Any] = {"loadgen_scenario": self.command}
        for key, value in self.options:
            out[key] = parse_scalar(value)
        if self.security is not None:
            out["security"] = self.security.params()
        if self.kind == "loadgen":
            out["duration_s"] = settings.duration
            out["warmup_s"] = settings.warmup
        return out


def parse_scalar(text: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


@dataclass(frozen=True)
class Settings:
    rounds: int = 3
    duration: float = 5.0
    warmup: float = 1.0
    connections: int = 15000
    hold: float = 3.0
    payloads: tuple[int, ...] = (16, 1024, 65536)
    quick: bool = False
    auth_connections: int = AUTH_CONNECTIONS


QUICK = Settings(rounds=3, duration=2.0, warmup=0.5, connections=3000, hold=1.5, quick=True)

MSGS = "msg/s"


def payload_name(size: int) -> str:
    if size >= 1024 and size % 1024 == 0:
        return f"payload-{size // 1024}k"
    return f"payload-{size}"


def payload_words(size: int) -> str:
    if size >= 1024 and size % 1024 == 0:
        return f"{size // 1024} KiB"
    return f"{size} B"


def build_scenarios(settings: Settings) -> list[Scenario]:
    """Every scenario, in the order they run within a round."""
    o = tuple
    scenarios = [
        Scenario(
            "fan-in",
            "fan-in",
            o([("publishers", "8"), ("payload", "64"), ("qos", "0")]),
            "8 publishers -> 1 wildcard subscriber, QoS 0, 64 B",
            (Figure("delivered_per_s", "delivered msg/s", unit=MSGS),),
        ),
        Scenario(
            "fan-out",
            "fan-out",
            o([("subscribers", "50"), ("payload", "64")]),
            "1 publisher -> 50 subscribers of one topic, QoS 0, 64 B",
            (Figure("delivered_per_s", "delivered msg/s", unit=MSGS),),
        ),
        Scenario(
            "pairs",
            "pairs",
            o([("pairs", "50"), ("payload", "64")]),
            "50 independent publisher/subscriber pairs, QoS 0, 64 B",
            (Figure("delivered_per_s", "delivered msg/s", unit=MSGS),),
        ),
        Scenario(
            "qos1",
            "qos1",
            o([("publishers", "8"), ("inflight", "64"), ("payload", "64")]),
            "8 QoS 1 publishers, 64 in flight each -> 1 QoS 1 subscriber, 64 B",
            (
                Figure("acked_per_s", "acked publishes/s", unit=MSGS),
                Figure("delivered_per_s", "delivered msg/s", unit=MSGS),
            ),
        ),
        Scenario(
            "latency",
            "latency",
            o([("rate", "5000"), ("payload", "64")]),
            "1 publisher at a fixed 5,000 msg/s -> 1 subscriber, QoS 0, 64 B",
            (
                Figure("p50_us", "p50 latency us", "lower", "us"),
                Figure("p99_us", "p99 latency us", "lower", "us"),
                Figure("p999_us", "p99.9 latency us", "lower", "us"),
            ),
        ),
        Scenario(
            "connections",
            "connections",
            o(
                [
                    ("count", str(settings.connections)),
                    ("sources", CONNECTION_SOURCES),
                    ("hold", fmt_num(settings.hold)),
                    ("concurrency", "256"),
                ]
            ),
            f"{settings.connections:,} idle connections from {CONNECTION_SOURCES}, "
            "256 connecting at a time",
            (
                Figure("connects_per_s", "connects/s", unit="conn/s"),
                Figure("rss_per_conn_bytes", "broker RSS bytes/conn", "lower", "B"),
            ),
        ),
    ]
    for size in settings.payloads:
        scenarios.append(
            Scenario(
                payload_name(size),
                "throughput",
                o([("payload", str(size))]),
                f"payload sweep: {payload_words(size)} messages, 1 publisher -> 1 subscriber",
                (Figure("mb_per_s", "MB/s delivered", unit="MB/s"),),
            )
        )
    if settings.payloads:
        scenarios.append(
            Scenario(
                "loopback",
                "loopback",
                o([("payload", "65536")]),
                "no broker: loopback TCP copy of 64 KiB writes (the physical ceiling)",
                (Figure("mb_per_s", "MB/s loopback ceiling", unit="MB/s"),),
                uses_broker=False,
            )
        )
    return scenarios


def persistent_scenarios(settings: Settings) -> list[Scenario]:
    """The durable-storage scenarios: in the full run, not in --quick (nor the perf gate)."""
    o = tuple
    qos1_options = [("publishers", "8"), ("inflight", "64"), ("payload", "64")]
    scenarios = []
    for policy, p in PERSISTENCE.items():
        scenarios.append(
            Scenario(
                f"qos1-persistent-{policy}",
                "qos1",
                o([*qos1_options, ("persistent-subscriber", PERSISTENT_SUBSCRIBER)]),
                "8 QoS 1 publishers, 64 in flight each -> 1 QoS 1 subscriber with a persistent "
                f"session, 64 B; fastbroker fsync={policy}, mosquitto "
                + (", ".join(f"{k} {v}" for k, v in p.mosquitto) or "default autosave"),
                (
                    Figure("acked_per_s", "acked publishes/s", unit=MSGS),
                    Figure("delivered_per_s", "delivered msg/s", unit=MSGS),
                ),
                persistence=p,
            )
        )
    scenarios.append(
        Scenario(
            "startup-1m",
            "fill",
            o(
                [
                    ("count", str(STARTUP_MESSAGES)),
                    *qos1_options,
                    ("persistent-subscriber", PERSISTENT_SUBSCRIBER),
                    ("time-limit", fmt_num(FILL_TIME_LIMIT_S)),
                ]
            ),
            f"restart with {STARTUP_MESSAGES:,} QoS 1 64 B messages stored for 1 offline "
            "session: process start -> first CONNACK; RSS then; drain of all to the subscriber",
            (
                Figure("startup_s", "start-up s, process start -> CONNACK", "lower", "s"),
                Figure("rss_after_startup_mib", "RSS after start-up MiB", "lower", "MiB"),
                Figure(
                    "drain_s",
                    f"all {STARTUP_MESSAGES:,} delivered after s",
                    "lower",
                    "s",
                    optional=True,
                ),
            ),
            persistence=STARTUP_PERSISTENCE,
            kind="startup",
        )
    )
    return scenarios


def security_loadgen_options(sec: Security) -> list[str]:
    """The loadgen options for a transport ({tls_ca} is filled in per run)."""
    if sec.transport == "tls":
        return ["--tls-ca", "{tls_ca}"]
    if sec.transport == "ws":
        return ["--ws-path", WS_PATH]
    return []


def security_scenarios(settings: Settings) -> list[Scenario]:
    """What the security features cost, each at the load of a standard scenario so the two
    compare: run only when named (--scenarios security, or by name)."""
    o = tuple
    user = ("username", BENCH_USERNAME)
    pairs = [("pairs", "50"), ("payload", "64")]
    n = settings.auth_connections
    connect = [("count", str(n)), ("hold", "0.5"), ("concurrency", str(AUTH_CONCURRENCY))]
    msgs = (Figure("delivered_per_s", "delivered msg/s", unit=MSGS),)
    conn_figures = (Figure("connects_per_s", "connects/s", unit="conn/s"),)
    return [
        Scenario(
            "fan-in-acl",
            "fan-in",
            o([("publishers", "8"), ("payload", "64"), ("qos", "0"), user]),
            f"fan-in with an ACL file of {len(ACL_RULES)} rules (per user, %c/%u patterns) "
            f"that allows it; clients send username {BENCH_USERNAME}, no password",
            msgs,
            security=Security(acl=True),
        ),
        Scenario(
            "connect-plain",
            "connections",
            o(connect),
            f"{n} connections, {AUTH_CONCURRENCY} connecting at a time, no credentials "
            "(the baseline of connect-auth)",
            conn_figures,
        ),
        Scenario(
            "connect-auth",
            "connections",
            o([*connect, user, ("password", BENCH_PASSWORD)]),
            f"{n} connections with username/password checked against a password file, "
            f"{AUTH_CONCURRENCY} at a time; fastbroker scrypt (its default cost), mosquitto "
            "PBKDF2-SHA512 (its default): the hash costs differ, see the log",
            conn_figures,
            security=Security(passwords=True),
        ),
        Scenario(
            "pairs-tls",
            "pairs",
            o(pairs),
            "pairs over TLS (throwaway P-256 certificate; rustls client)",
            msgs,
            security=Security(transport="tls"),
        ),
        Scenario(
            "pairs-ws",
            "pairs",
            o(pairs),
            f"pairs over WebSocket (path {WS_PATH}, subprotocol mqtt)",
            msgs,
            security=Security(transport="ws"),
        ),
    ]


def default_scenarios(settings: Settings) -> list[Scenario]:
    """What runs without --scenarios: everything, or with --quick the standard set only."""
    if settings.quick:
        return build_scenarios(settings)
    return build_scenarios(settings) + persistent_scenarios(settings)


def select_scenarios(
    scenarios: list[Scenario], spec: str | None, extra: Sequence[Scenario] = ()
) -> list[Scenario]:
    """--scenarios: names, "payload" for the whole sweep, "persistent" for the durable-storage
    scenarios, "security" for the security ones; the loopback ceiling comes along with any
    payload scenario. Without a spec,
    `scenarios`; with one, any of `scenarios` and `extra` (scenarios run only when named)."""
    if not spec:
        return scenarios
    pool = list(scenarios) + [s for s in extra if s.name not in {x.name for x in scenarios}]
    wanted = {s.strip() for s in spec.split(",") if s.strip()}
    known = {s.name for s in pool} | {"payload"}
    if any(s.persistence for s in pool):
        known.add("persistent")
    security = {s.name for s in pool if s.name in SECURITY_NAMES}
    if security:
        known.add("security")
    unknown = wanted - known
    if unknown:
        raise SystemExit(
            f"unknown scenario(s): {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}"
        )
    if "persistent" in wanted:
        wanted |= {s.name for s in pool if s.persistence}
    if "security" in wanted:
        wanted |= security
    scenarios = pool
    if "payload" in wanted:
        wanted |= {s.name for s in scenarios if s.command == "throughput"}
    if any(s.command == "throughput" and s.name in wanted for s in scenarios):
        wanted.add("loopback")
    return [s for s in scenarios if s.name in wanted]


# --------------------------------------------------------------------------- security set-up

PUB, SUB, READ = "publish", "subscribe", "read"
ALL = frozenset({PUB, SUB, READ})
# One ACL for both brokers: (user or None for a pattern that applies to everyone, rights,
# filter). fan-in's traffic is allowed by two of them: the publishers (username bench, topics
# bench/in/NN) by the %u pattern, the subscriber (bench/in/+) by a rule of user bench; the
# others are what a real file holds besides (other users, per-client subtrees), there so that
# a broker that scans its rules pays for them. Mosquitto's topic lines before the first user
# line apply to anonymous clients only (fastbroker's to everyone), so everyone-rules are
# patterns here.
ACL_RULES: tuple[tuple[str | None, frozenset[str], str], ...] = (
    (None, ALL, "clients/%c/#"),
    (None, frozenset({PUB}), "devices/%c/telemetry"),
    (None, frozenset({SUB, READ}), "devices/%c/commands/#"),
    (None, ALL, "users/%u/#"),
    (None, frozenset({SUB, READ}), "%u/status/%c"),
    (None, frozenset({PUB}), "%u/in/+"),
    ("alice", ALL, "sensors/alice/#"),
    ("alice", frozenset({SUB, READ}), "alerts/#"),
    ("alice", frozenset({PUB}), "logs/alice/#"),
    ("bob", ALL, "sensors/bob/#"),
    ("bob", frozenset({SUB, READ}), "alerts/#"),
    ("bob", frozenset({PUB}), "logs/bob/#"),
    ("carol", ALL, "home/carol/#"),
    ("carol", frozenset({SUB, READ}), "home/+/status"),
    (BENCH_USERNAME, frozenset({PUB}), "bench/out/#"),
    (BENCH_USERNAME, ALL, "bench/control/#"),
    (BENCH_USERNAME, frozenset({SUB, READ}), "bench/status/#"),
    (BENCH_USERNAME, frozenset({SUB, READ}), "bench/in/+"),
    (BENCH_USERNAME, frozenset({PUB}), "bench/alerts/#"),
    ("dave", ALL, "factory/line-1/#"),
    ("dave", frozenset({SUB, READ}), "factory/+/alarms"),
)


def acl_rights(broker: str, rights: frozenset[str]) -> str:
    """Rights in each broker's words. Mosquitto's `read` also allows subscribing, so
    subscribe+read is `read` there; fastbroker needs `subscribe,read` for the same."""
    if rights == ALL:
        return "readwrite"
    if broker == "mosquitto":
        if rights == {PUB}:
            return "write"
        if rights <= {SUB, READ}:
            return "read"
    elif broker == "fastbroker":
        return ",".join(r for r in (PUB, SUB, READ) if r in rights)
    raise ValueError(f"no {broker} words for {sorted(rights)}")


def acl_text(broker: str) -> str:
    """The ACL file of ACL_RULES for `broker` (fastbroker and mosquitto share the syntax of
    `user`, `topic` and `pattern` lines, not the rights' names)."""
    lines = [f"# fastbroker benchmark ACL ({len(ACL_RULES)} rules) for {broker}"]
    lines += [
        f"pattern {acl_rights(broker, rights)} {flt}"
        for user, rights, flt in ACL_RULES
        if user is None
    ]
    users = list(dict.fromkeys(u for u, _, _ in ACL_RULES if u is not None))
    for name in users:
        lines += ["", f"user {name}"]
        lines += [
            f"topic {acl_rights(broker, rights)} {flt}"
            for user, rights, flt in ACL_RULES
            if user == name
        ]
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class SecurityAssets:
    """Files the security scenarios configure both brokers with (made once per run)."""

    directory: Path
    ca: Path  # the loadgen trusts this
    cert: Path  # server certificate (CN and subjectAltName 127.0.0.1), signed by ca
    key: Path
    fastbroker_passwords: Path
    mosquitto_passwords: Path
    fastbroker_acl: Path
    mosquitto_acl: Path

    def acl(self, broker: str) -> Path:
        return self.fastbroker_acl if broker == "fastbroker" else self.mosquitto_acl

    def passwords(self, broker: str) -> Path:
        return self.fastbroker_passwords if broker == "fastbroker" else self.mosquitto_passwords


def run_tool(cmd: Sequence[str], what: str, stdin: str | None = None) -> None:
    try:
        res = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"{what}: {e}") from e
    if res.returncode != 0:
        raise RuntimeError(f"{what}: exit code {res.returncode}: {res.stderr.strip()[-500:]}")


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 signed by it (ECDSA P-256, 2
    days), with the openssl CLI: (ca, cert, key). rustls accepts no self-signed CA as a
    server certificate, hence the two."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("openssl not found (apt-get install openssl)")
    directory.mkdir(parents=True, exist_ok=True)
    ca, ca_key = directory / "ca.pem", directory / "ca.key"
    cert, key, csr = directory / "server.pem", directory / "server.key", directory / "server.csr"
    ext = directory / "server.ext"
    ext.write_text(
        f"subjectAltName = IP:{HOST}\nbasicConstraints = critical, CA:FALSE\n"
        "keyUsage = critical, digitalSignature\nextendedKeyUsage = serverAuth\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    run_tool(
        [openssl, "req", "-x509", *ec, "-keyout", str(ca_key), "-out", str(ca), "-days", "2",
         "-subj", "/CN=fastbroker-bench-ca"],
        "openssl (CA)",
    )  # fmt: skip
    run_tool(
        [openssl, "req", *ec, "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={HOST}"],
        "openssl (server key)",
    )
    run_tool(
        [openssl, "x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
         "-CAcreateserial", "-out", str(cert), "-days", "2", "-extfile", str(ext)],
        "openssl (server certificate)",
    )  # fmt: skip
    for path in (ca_key, key):
        path.chmod(0o600)
    return ca, cert, key


def make_password_files(directory: Path) -> tuple[Path, Path]:
    """BENCH_USERNAME's password in each broker's own tool and default hash: (fastbroker's,
    mosquitto's)."""
    directory.mkdir(parents=True, exist_ok=True)
    fb, mq = directory / "fastbroker.passwd", directory / "mosquitto.passwd"
    run_tool(
        [*fastbroker_command(), "passwd", "-c", "--password-stdin", str(fb), BENCH_USERNAME],
        "fastbroker passwd",
        stdin=BENCH_PASSWORD + "\n",
    )
    tool = shutil.which("mosquitto_passwd")
    if tool is None:
        raise RuntimeError("mosquitto_passwd not found (apt-get install mosquitto)")
    run_tool([tool, "-c", "-b", str(mq), BENCH_USERNAME, BENCH_PASSWORD], "mosquitto_passwd")
    return fb, mq


def make_security_assets(directory: Path) -> SecurityAssets:
    directory.mkdir(parents=True, exist_ok=True)
    ca, cert, key = make_certificates(directory)
    fb_pw, mq_pw = make_password_files(directory)
    fb_acl, mq_acl = directory / "fastbroker.acl", directory / "mosquitto.acl"
    fb_acl.write_text(acl_text("fastbroker"))
    mq_acl.write_text(acl_text("mosquitto"))
    return SecurityAssets(directory, ca, cert, key, fb_pw, mq_pw, fb_acl, mq_acl)


_assets: dict[Path, SecurityAssets] = {}


def security_assets(base: Path) -> SecurityAssets:
    """The run's assets, made on first use in base/security (the run's temporary directory:
    the private keys never reach the results directory)."""
    if base not in _assets:
        _assets[base] = make_security_assets(base / "security")
    return _assets[base]


def b64decode_loose(text: str) -> bytes:
    """Base64 with or without padding, '.' for '+' (passlib's alphabet) accepted."""
    text = text.replace(".", "+")
    return base64.b64decode(text + "=" * (-len(text) % 4))


def password_line(path: Path, user: str) -> str:
    for line in path.read_text().splitlines():
        name, sep, rest = line.partition(":")
        if sep and name == user:
            return rest.strip()
    raise RuntimeError(f"no line for {user!r} in {path}")


def time_hash(fn: Callable[[], bytes], budget_s: float = HASH_TIMING_S) -> tuple[float, bytes]:
    """(median seconds of one call, its result) over about budget_s, at least 3 calls."""
    times: list[float] = []
    result = b""
    t_end = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < 1000):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def measure_hash_costs(assets: SecurityAssets, password: str = BENCH_PASSWORD) -> dict[str, Any]:
    """One password check of each broker's default hash, timed here in isolation (one
    thread, OpenSSL through hashlib, the parameters and salt read from the files the brokers
    use); `verified` says the result equals the stored hash, i.e. the same computation."""
    pw = password.encode()
    out: dict[str, Any] = {}
    fb = re.fullmatch(
        r"\$scrypt\$ln=(\d+),r=(\d+),p=(\d+)\$([^$]+)\$([^$]+)",
        password_line(assets.fastbroker_passwords, BENCH_USERNAME),
    )
    if fb is None:
        raise RuntimeError(f"{assets.fastbroker_passwords}: not a $scrypt$ line")
    ln, r, p = (int(fb.group(i)) for i in (1, 2, 3))
    salt, digest = b64decode_loose(fb.group(4)), b64decode_loose(fb.group(5))
    maxmem = 128 * r * ((1 << ln) + p + 2) + 65536
    secs, got = time_hash(
        lambda: hashlib.scrypt(pw, salt=salt, n=1 << ln, r=r, p=p, maxmem=maxmem, dklen=len(digest))
    )
    out["fastbroker"] = {
        "hash": f"scrypt ln={ln} r={r} p={p} ({128 * r * (1 << ln) // MIB} MiB)",
        "ms_per_check": secs * 1000,
        "verified": got == digest,
    }
    mq = re.fullmatch(
        r"\$(\d+)\$(\d+)\$([^$]+)\$([^$]+)",
        password_line(assets.mosquitto_passwords, BENCH_USERNAME),
    )
    if mq is None or mq.group(1) != "7":
        raise RuntimeError(f"{assets.mosquitto_passwords}: not a $7$ (PBKDF2-SHA512) line")
    iterations = int(mq.group(2))
    salt, digest = b64decode_loose(mq.group(3)), b64decode_loose(mq.group(4))
    secs, got = time_hash(
        lambda: hashlib.pbkdf2_hmac("sha512", pw, salt, iterations, dklen=len(digest))
    )
    out["mosquitto"] = {
        "hash": f"PBKDF2-SHA512 {iterations} iterations",
        "ms_per_check": secs * 1000,
        "verified": got == digest,
    }
    out["ratio_fb_over_mosq"] = out["fastbroker"]["ms_per_check"] / out["mosquitto"]["ms_per_check"]
    return out


def security_lines(scenarios: Sequence[Scenario], base: Path) -> tuple[list[str], dict[str, Any]]:
    """How the selected security scenarios set up both brokers, for the log, and the hash
    costs measured in isolation (a connect-auth scenario only)."""
    secured = [sc for sc in scenarios if sc.security is not None]
    if not secured:
        return [], {}
    assets = security_assets(base)
    out = [
        "security (security scenarios only): files made for this run in "
        f"{assets.directory} (deleted at its end): CA + server certificate (openssl, "
        f"P-256), password files (fastbroker passwd; mosquitto_passwd), ACL files "
        f"({len(ACL_RULES)} rules each, the same rules in each broker's words)"
    ]
    costs: dict[str, Any] = {}
    for sc in secured:
        sec = sc.security
        assert sec is not None
        if sec.acl:
            out.append(
                f"  {sc.name}: fastbroker [auth] acl_file (allow_anonymous default: true); "
                "mosquitto acl_file + allow_anonymous true; no password file"
            )
        if sec.passwords:
            out.append(
                f"  {sc.name}: fastbroker [auth] password_file; mosquitto password_file + "
                "allow_anonymous false; every client sends the right password"
            )
            costs = measure_hash_costs(assets)
            fb, mq = costs["fastbroker"], costs["mosquitto"]
            out.append(
                "  password check cost, one hash timed here in isolation (one thread): "
                f"fastbroker {fb['hash']}: {fb['ms_per_check']:.1f} ms; mosquitto "
                f"{mq['hash']}: {mq['ms_per_check']:.3f} ms "
                f"({costs['ratio_fb_over_mosq']:,.0f}x). Each broker's default: scrypt is "
                "deliberately slow (and memory-hard); connect-auth's ratio measures the "
                "hashes more than the brokers"
                + ("" if fb["verified"] and mq["verified"] else " [recomputed hash MISMATCH]")
            )
        if sec.transport == "tls":
            out.append(
                f"  {sc.name}: fastbroker [[listeners]] type tls; mosquitto listener with "
                "certfile/keyfile; both OpenSSL's defaults for versions and ciphers; the "
                "loadgen (rustls, ring) logs the negotiated suite in its params"
            )
        if sec.transport == "ws":
            out.append(
                f"  {sc.name}: fastbroker [[listeners]] type ws path {WS_PATH}; mosquitto "
                "listener with protocol websockets (libwebsockets; it binds every interface "
                "whatever the address, and needs a plain listener besides: one, unused, on "
                "127.0.0.1); the loadgen frames with a zero mask key"
            )
    return out, costs


# --------------------------------------------------------------------------- broker configs


def mosquitto_config_text(
    port: int,
    as_root: bool,
    persistence: Persistence | None = None,
    workdir: str = "",
    security: Security | None = None,
    assets: SecurityAssets | None = None,
    aux_port: int = 0,
) -> str:
    """`aux_port`: with a WebSocket listener, a plain one there too (unused): mosquitto 2.0.11
    refuses to start with websockets listeners alone ("Unable to start any listening
    sockets"). Its websockets listener also ignores the bind address (libwebsockets binds
    every interface); the clients still connect to 127.0.0.1 only."""
    limits = dict(MOSQUITTO_LIMITS)
    listener = [f"listener {port} {HOST}"]
    extra: list[str] = []
    anonymous = "true"
    if security is not None:
        if assets is None:
            raise ValueError("a security scenario needs its assets")
        if security.transport == "tls":
            listener += [f"certfile {assets.cert}", f"keyfile {assets.key}"]
        elif security.transport == "ws":
            if not aux_port:
                raise ValueError("mosquitto needs a plain listener besides websockets")
            listener = [f"listener {aux_port} {HOST}", *listener, "protocol websockets"]
        if security.acl:
            extra.append(f"acl_file {assets.mosquitto_acl}")
        if security.passwords:
            extra.append(f"password_file {assets.mosquitto_passwords}")
            anonymous = "false"
    if persistence is not None:
        limits["persistence"] = "true"
        extra += [
            f"persistence_location {workdir.rstrip('/')}/",
            "persistence_file mosquitto.db",
            *(f"{key} {value}" for key, value in persistence.mosquitto),
        ]
    lines = [
        *listener,
        f"allow_anonymous {anonymous}",
        *(f"{key} {value}" for key, value in limits.items()),
        *extra,
        "sys_interval 0",
        "log_dest stderr",
        "log_type error",
        "log_type warning",
        "connection_messages false",
    ]
    if as_root:
        # Started as root, mosquitto would switch to user "mosquitto"; stay as we are.
        lines.append("user root")
    return "\n".join(lines) + "\n"


def fastbroker_config_text(
    port: int,
    data_dir: str,
    fsync: str | None = None,
    security: Security | None = None,
    assets: SecurityAssets | None = None,
) -> str:
    listener = ["[listener]", f'host = "{HOST}"', f"port = {port}"]
    auth: list[str] = []
    if security is not None:
        if assets is None:
            raise ValueError("a security scenario needs its assets")
        if security.transport != "tcp":
            # The only listener: a [listener] table (or --host/--port) would open TCP too.
            listener = [
                "[[listeners]]",
                f'type = "{security.transport}"',
                f'host = "{HOST}"',
                f"port = {port}",
            ]
            if security.transport == "tls":
                listener += [
                    f"certfile = {json.dumps(str(assets.cert))}",
                    f"keyfile = {json.dumps(str(assets.key))}",
                ]
            else:
                listener.append(f"path = {json.dumps(WS_PATH)}")
        if security.acl:
            auth.append(f"acl_file = {json.dumps(str(assets.fastbroker_acl))}")
        if security.passwords:
            auth.append(f"password_file = {json.dumps(str(assets.fastbroker_passwords))}")
    lines = [
        *listener,
        "",
        *(["[auth]", *auth, ""] if auth else []),
        "[storage]",
        f"data_dir = {json.dumps(data_dir)}",
        *([f"fsync = {json.dumps(fsync)}"] if fsync else []),
        "",
        "[log]",
        'level = "warning"',
        "",
        "[sys]",
        "interval = 0",
        "",
        "[mqtt]",
        *(f"{key} = {value}" for key, value in FASTBROKER_MQTT_LIMITS.items() if fsync),
    ]
    return "\n".join(lines) + "\n"


def broker_limits(broker: str) -> dict[str, Any]:
    if broker == "fastbroker":
        return {"mqtt": "defaults", "sys_interval": 0}
    if broker == "mosquitto":
        return {**MOSQUITTO_LIMITS, "sys_interval": 0}
    return {}


# --------------------------------------------------------------------------- processes

_LIBC: Any = None
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:
    pass
PR_SET_PDEATHSIG = 1


def raise_nofile_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit (15,000 connections need it)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def _child_setup() -> None:  # preexec_fn: runs in the child between fork and exec
    raise_nofile_limit()
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # die with the harness


_started: dict[int, subprocess.Popen] = {}


def spawn(cmd: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    proc = subprocess.Popen(list(cmd), preexec_fn=_child_setup, **kwargs)
    _started[proc.pid] = proc
    return proc


def stop_process(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT_S) -> int | None:
    """SIGTERM one process this harness started, SIGKILL it after `timeout`. Idempotent."""
    try:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _started.pop(proc.pid, None)
    return proc.returncode


def stop_all_started() -> None:
    for proc in list(_started.values()):
        stop_process(proc)


atexit.register(stop_all_started)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- /proc

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def child_pids(pid: int) -> list[int]:
    """A process's children (a fastbroker supervisor's workers)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        return []


def own_cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process (all its threads), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    return parse_proc_stat_cpu(data)


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process and its children (a broker's workers), in seconds."""
    own = own_cpu_seconds(pid)
    if own is None:
        return None
    return own + sum(own_cpu_seconds(child) or 0.0 for child in child_pids(pid))


def parse_proc_stat_cpu(data: str) -> float:
    # The command name (field 2) may contain spaces and parentheses: split after the last ")".
    fields = data[data.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state); utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status_kb(pid: int, key: str = "VmRSS") -> int | None:
    """A /proc status figure of a process, summed with its children's (a broker's workers)."""
    total = None
    for one in (pid, *child_pids(pid)):
        try:
            with open(f"/proc/{one}/status") as f:
                text = f.read()
        except OSError:
            continue
        value = parse_proc_status_kb(text, key)
        if value is not None:
            total = (total or 0) + value
    return total


def parse_proc_status_kb(text: str, key: str) -> int | None:
    match = re.search(rf"^{re.escape(key)}:\s+(\d+)\s+kB", text, re.MULTILINE)
    return int(match.group(1)) if match else None


def cpu_percent(samples: Sequence[tuple[float, float]], start: float, end: float) -> float | None:
    """CPU % (100 = one core) over [start, end] from (monotonic time, cpu seconds) samples,
    interpolating linearly between samples; None without enough samples."""
    if len(samples) < 2 or end <= start:
        return None

    def at(t: float) -> float:
        if t <= samples[0][0]:
            return samples[0][1]
        for (t0, c0), (t1, c1) in itertools.pairwise(samples):
            if t0 <= t <= t1:
                return c0 if t1 == t0 else c0 + (c1 - c0) * (t - t0) / (t1 - t0)
        return samples[-1][1]

    start = max(start, samples[0][0])
    end = min(end, samples[-1][0])
    if end <= start:
        return None
    return 100.0 * (at(end) - at(start)) / (end - start)


# --------------------------------------------------------------------------- brokers


@dataclass
class Broker:
    kind: str
    port: int
    proc: subprocess.Popen
    workdir: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stderr_tail(self, limit: int = 2000) -> str:
        try:
            return (self.workdir / "stderr.log").read_text(errors="replace")[-limit:]
        except OSError:
            return ""


# fastbroker's `--workers` (bench/run.py --workers, bench/workers.py); 1: one process.
FASTBROKER_WORKERS = 1


def fastbroker_command() -> list[str]:
    script = Path(sys.executable).parent / "fastbroker"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [sys.executable, "-m", "fastbroker"]


def fastbroker_location() -> str:
    """Where the fastbroker that runs is installed (it may differ from this checkout)."""
    try:
        spec = importlib.util.find_spec("fastbroker")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return "not importable from this Python"
    return str(Path(spec.origin).parent)


def mosquitto_executable() -> str | None:
    for cand in (shutil.which("mosquitto"), "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def broker_version(kind: str) -> str:
    try:
        if kind == "fastbroker":
            out = subprocess.run(
                [*fastbroker_command(), "--version"], capture_output=True, text=True, timeout=30
            ).stdout
            match = re.search(r"version\s+(\S+)", out)
        else:
            exe = mosquitto_executable()
            if exe is None:
                return "missing"
            res = subprocess.run([exe, "-h"], capture_output=True, text=True, timeout=30)
            match = re.search(r"mosquitto version\s+(\S+)", res.stdout + res.stderr)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return match.group(1) if match else "unknown"


def broker_command(
    kind: str,
    port: int,
    workdir: Path,
    persistence: Persistence | None = None,
    security: Security | None = None,
    assets: SecurityAssets | None = None,
) -> list[str]:
    """Writes the broker's config into `workdir` (its data goes there too) and returns the
    command that starts it."""
    if kind == "fastbroker":
        config = workdir / "fastbroker.toml"
        fsync = persistence.fsync if persistence else None
        config.write_text(
            fastbroker_config_text(port, str(workdir / "data"), fsync, security, assets)
        )
        cmd = [*fastbroker_command(), "run"]
        if FASTBROKER_WORKERS != 1:
            cmd += ["--workers", str(FASTBROKER_WORKERS)]
        if security is None or security.transport == "tcp":
            cmd += ["--host", HOST, "--port", str(port)]
        return [*cmd, "--config", str(config)]
    if kind == "mosquitto":
        exe = mosquitto_executable()
        if exe is None:
            raise RuntimeError("mosquitto not found (apt-get install mosquitto)")
        config = workdir / "mosquitto.conf"
        config.write_text(
            mosquitto_config_text(
                port,
                os.geteuid() == 0,
                persistence,
                str(workdir),
                security,
                assets,
                aux_port=free_port() if security and security.transport == "ws" else 0,
            )
        )
        return [exe, "-c", str(config)]
    raise ValueError(f"unknown broker {kind!r}")


def listening_sockets(port: int) -> int:
    """TCP sockets listening on `port` (IPv4)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    return sum(1 for row in rows if row[1].endswith(f":{port:04X}") and row[3] == "0A")


def launch(kind: str, port: int, workdir: Path, cmd: Sequence[str]) -> Broker:
    """Starts the broker (stdout and stderr appended to workdir/stderr.log), not waiting."""
    with open(workdir / "stderr.log", "ab") as err:
        proc = spawn(cmd, cwd=workdir, stdin=subprocess.DEVNULL, stdout=err, stderr=err)
    return Broker(kind, port, proc, workdir)


def start_broker(
    kind: str,
    base: Path,
    persistence: Persistence | None = None,
    security: Security | None = None,
) -> Broker:
    last_error = ""
    assets = security_assets(base) if security is not None else None
    for _ in range(3):  # a port from free_port() may be taken before the broker binds it
        port = free_port()
        workdir = Path(tempfile.mkdtemp(prefix=f"{kind}-{port}-", dir=base))
        cmd = broker_command(kind, port, workdir, persistence, security, assets)
        broker = launch(kind, port, workdir, cmd)
        proc = broker.proc
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:
                with socket.create_connection((HOST, port), timeout=0.5):
                    pass
            except OSError:
                time.sleep(0.05)
                continue
            # Workers: the first one listening is not all of them serving (each listens on
            # its own socket of the port).
            if kind != "fastbroker" or listening_sockets(port) >= FASTBROKER_WORKERS:
                return broker
            time.sleep(0.05)
        stop_process(proc)
        last_error = (
            f"{kind} did not start on {HOST}:{port} (exit code {proc.returncode}): "
            f"{broker.stderr_tail()}"
        )
        if "in use" not in last_error.lower():
            break
    raise RuntimeError(last_error)


# --------------------------------------------------------------------------- loadgen


def find_loadgen(explicit: str | None, build: bool = True) -> Path:
    """The loadgen binary: --loadgen / $FASTBROKER_LOADGEN, else bench/loadgen built with
    cargo (a no-op when up to date), else an existing build."""
    chosen = explicit or os.environ.get("FASTBROKER_LOADGEN")
    if chosen:
        path = Path(chosen)
        if not os.access(path, os.X_OK):
            raise SystemExit(f"loadgen {path} is not an executable file")
        return path
    cargo = shutil.which("cargo")
    if build and cargo and LOADGEN_MANIFEST.is_file():
        print(f"building the loadgen: cargo build --release ({LOADGEN_MANIFEST})", flush=True)
        res = subprocess.run(
            [cargo, "build", "--release", "--quiet", "--manifest-path", str(LOADGEN_MANIFEST)],
            stdin=subprocess.DEVNULL,
        )
        if res.returncode != 0 and not LOADGEN_BIN.exists():
            raise SystemExit(f"cargo build of {LOADGEN_MANIFEST} failed (exit {res.returncode})")
    if not LOADGEN_BIN.exists():
        raise SystemExit(
            f"no loadgen at {LOADGEN_BIN}: needs {LOADGEN_MANIFEST} and cargo, or --loadgen PATH"
        )
    return LOADGEN_BIN


def parse_loadgen_output(stdout: str) -> tuple[dict[str, Any] | None, bool]:
    """(final JSON object, whether a {"ready": true} line came first)."""
    final = None
    ready = False
    for line in stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if not isinstance(obj, dict):
            continue
        if obj.get("ready") is True:
            ready = True
        else:
            final = obj
    return final, ready


@dataclass
class Measurement:
    """One scenario x broker x round."""

    scenario: str
    broker: str  # "fastbroker", "mosquitto", or "none" (loopback)
    round: int
    position: int  # 1 = this broker ran first in its round
    params: dict[str, Any]
    figures: dict[str, Any] = field(default_factory=dict)
    loadgen: dict[str, Any] | None = None
    broker_cpu_percent: float | None = None
    broker_rss_kb: int | None = None
    broker_rss_peak_kb: int | None = None
    error: str | None = None
    cpu_window_s: list[float] | None = None  # broker CPU window, from the loadgen's start
    started: float = 0.0
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)  # for the table's notes (run still ok)

    @property
    def ok(self) -> bool:
        return self.error is None


# The loadgen logs this to stderr right before it starts its timeline: publishing begins
# PUBLISH_DELAY_S later, and the measured window `warmup` seconds after that.
PUBLISHING_MARKER = b"publishing"
PUBLISH_DELAY_S = 0.2
STDERR_TAIL = 4096


@dataclass
class LoadgenRun:
    code: int | None
    stdout: str
    start: float  # monotonic times
    end: float
    ready_at: float | None = None  # {"ready": true} line (connections)
    publishing_at: float | None = None  # PUBLISHING_MARKER on stderr
    timed_out: bool = False
    stderr_tail: str = ""


def measured_window(run: LoadgenRun, warmup: float, duration: float) -> tuple[float, float]:
    """The loadgen's measured window in monotonic time: from its stderr marker when it logged
    one, else the last `duration` seconds before it exited (less its ~1 s grace period)."""
    if run.publishing_at is not None:
        start = run.publishing_at + PUBLISH_DELAY_S + warmup
        return start, min(start + duration, run.end)
    end = max(run.start, run.end - 1.0)
    return max(run.start, end - duration), end


def run_loadgen(
    loadgen: Path,
    args: list[str],
    timeout: float,
    on_sample: Callable[[float], None] | None = None,
    on_ready: Callable[[float], None] | None = None,
) -> LoadgenRun:
    """Runs the loadgen to its end (or `timeout`), calling on_sample(now) every
    SAMPLE_INTERVAL_S and on_ready(now) on its {"ready": true} line."""
    start = time.monotonic()
    proc = spawn(
        [str(loadgen), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    run = LoadgenRun(None, "", start, start)
    out_chunks: list[bytes] = []
    err_tail = b""
    pending = {"out": b"", "err": b""}
    sel = selectors.DefaultSelector()
    for name, pipe in (("out", proc.stdout), ("err", proc.stderr)):
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ, name)
    deadline = start + timeout
    try:
        while sel.get_map():
            if time.monotonic() > deadline:
                run.timed_out = True
                stop_process(proc)
                break
            for key, _ in sel.select(timeout=SAMPLE_INTERVAL_S):
                try:
                    data = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                now = time.monotonic()
                if not data:
                    sel.unregister(key.fileobj)
                    continue
                if key.data == "out":
                    out_chunks.append(data)
                else:
                    err_tail = (err_tail + data)[-STDERR_TAIL:]
                buf = pending[key.data] + data
                *lines, pending[key.data] = buf.split(b"\n")
                for line in lines:
                    if key.data == "out" and run.ready_at is None and b'"ready"' in line:
                        if parse_loadgen_output(line.decode(errors="replace"))[1]:
                            run.ready_at = now
                            if on_ready:
                                on_ready(now)
                    elif key.data == "err" and run.publishing_at is None:
                        if PUBLISHING_MARKER in line:
                            run.publishing_at = now
            if on_sample and proc.poll() is None:
                on_sample(time.monotonic())
        run.end = time.monotonic()
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        run.code = stop_process(proc)
    finally:
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
        if proc.poll() is None:
            stop_process(proc)
    run.stdout = b"".join(out_chunks).decode(errors="replace")
    run.stderr_tail = err_tail.decode(errors="replace")
    return run


def check_loadgen_result(run: LoadgenRun, result: dict[str, Any] | None) -> None:
    """Raises unless the loadgen produced a result. Exit code 3 (some of the connections
    failed) still comes with figures: they are kept, with its error count."""
    if run.timed_out:
        raise RuntimeError(f"loadgen timed out; stderr: {run.stderr_tail.strip()[-600:]!r}")
    if result is not None and "error" in result:
        raise RuntimeError(f"loadgen: {result['error']} (exit code {run.code})")
    if result is None or run.code not in (0, 3):
        raise RuntimeError(
            f"loadgen exit code {run.code}, no result; stderr: {run.stderr_tail.strip()[-600:]!r}"
        )


def figures_from(result: dict[str, Any]) -> dict[str, Any]:
    """The loadgen's numeric results (its params and CPU share are kept apart)."""
    skip = {"loadgen_cpu_percent", "loadgen_cores_busy"}
    return {k: v for k, v in result.items() if k not in skip and valid_number(v)}


DELIVERY_NOTE_BELOW = 0.9  # delivered / published under which the table gets a note
LOADGEN_BUSY_PERCENT = 80.0  # loadgen CPU share above which it may have been the bottleneck


def run_notes(measurements: Sequence[Measurement]) -> list[str]:
    """What a reader of the table should know: failed runs, loadgen errors, a broker that
    delivered much less than was published (it queued the rest: its delivered msg/s is not
    sustainable), a loadgen that was busy enough to be the bottleneck."""
    notes = []
    groups: dict[tuple[str, str], list[Measurement]] = {}
    for m in measurements:
        if not m.ok:
            notes.append(f"FAILED run: {m.scenario} {m.broker} round {m.round}: {m.error}")
            continue
        groups.setdefault((m.scenario, m.broker), []).append(m)
        notes += m.notes
        errors = m.figures.get("errors")
        if valid_number(errors) and errors:
            notes.append(
                f"loadgen counted {fmt_num(errors)} errors in {m.scenario} {m.broker} "
                f"round {m.round}"
            )
    for (scenario, broker), ms in groups.items():
        ratios = [m.figures["delivery_ratio"] for m in ms if "delivery_ratio" in m.figures]
        if ratios and statistics.median(ratios) < DELIVERY_NOTE_BELOW:
            peak = max((m.broker_rss_peak_kb or 0) for m in ms)
            notes.append(
                f"{broker} {scenario}: delivered {100 * statistics.median(ratios):.0f}% of what "
                f"was published (median; {100 * min(ratios):.0f}-{100 * max(ratios):.0f}%), "
                f"the rest was queued or dropped; peak RSS {peak / 1024:.0f} MiB"
            )
        busy = [
            (m.loadgen or {}).get("loadgen_cpu_percent")
            for m in ms
            if valid_number((m.loadgen or {}).get("loadgen_cpu_percent"))
        ]
        if broker != "none" and busy and statistics.median(busy) > LOADGEN_BUSY_PERCENT:
            notes.append(
                f"loadgen used {statistics.median(busy):.0f}% of a core in {scenario} "
                f"({broker}): it may have been a bottleneck there"
            )
    return notes


def measure(
    scenario: Scenario,
    broker_kind: str | None,
    round_no: int,
    position: int,
    settings: Settings,
    loadgen: Path,
    base: Path,
) -> Measurement:
    if scenario.kind == "startup":
        assert broker_kind is not None
        return measure_startup(scenario, broker_kind, round_no, position, settings, loadgen, base)
    params = scenario.params(settings)
    if broker_kind:
        params["broker_limits"] = broker_limits(broker_kind)
        if scenario.persistence:
            params["persistence"] = scenario.persistence.params(broker_kind)
    m = Measurement(scenario.name, broker_kind or "none", round_no, position, params)
    m.started = time.time()
    t0 = time.monotonic()
    broker: Broker | None = None
    try:
        if broker_kind:
            broker = start_broker(broker_kind, base, scenario.persistence, scenario.security)
        port = str(broker.port) if broker else "0"
        args = [a.replace("{port}", port) for a in scenario.loadgen_args(settings)]
        if scenario.security is not None and scenario.security.transport == "tls":
            ca = str(security_assets(base).ca)
            args = [a.replace("{tls_ca}", ca) for a in args]
        m.params["loadgen_args"] = args
        samples: list[tuple[float, float]] = []
        # Each worker's, when the broker has workers.
        worker_samples: dict[int, list[tuple[float, float]]] = {}
        rss_last: list[int] = []
        rss_hold: list[int] = []
        rss_before = proc_status_kb(broker.pid) if broker else None
        settle = min(1.0, settings.hold / 2)
        ready_box: list[float] = []

        def on_sample(now: float) -> None:
            if broker is None:
                return
            cpu = proc_cpu_seconds(broker.pid)
            if cpu is not None:
                samples.append((now, cpu))
            for child in child_pids(broker.pid):
                child_cpu = own_cpu_seconds(child)
                if child_cpu is not None:
                    worker_samples.setdefault(child, []).append((now, child_cpu))
            rss = proc_status_kb(broker.pid)
            if rss is not None:
                rss_last[:] = [rss]
                # While every connection is held and idle: after `settle`, before the
                # loadgen starts closing them (closing is not what "per idle connection"
                # measures, and may briefly grow a broker that logs every close).
                if ready_box and ready_box[0] + settle <= now < ready_box[0] + settings.hold:
                    rss_hold.append(rss)

        def on_ready(now: float) -> None:
            ready_box.append(now)

        on_sample(time.monotonic())
        timeout = settings.warmup + settings.duration + 120
        if scenario.command == "connections":
            timeout += settings.hold + 300
        run = run_loadgen(loadgen, args, timeout, on_sample=on_sample, on_ready=on_ready)
        result, _ = parse_loadgen_output(run.stdout)
        if broker is not None and broker.proc.poll() is not None:
            raise RuntimeError(
                f"{broker.kind} exited with code {broker.proc.returncode} during the run: "
                f"{broker.stderr_tail()}"
            )
        check_loadgen_result(run, result)
        assert result is not None
        m.loadgen = result
        m.figures = figures_from(result)
        if broker is not None:
            m.broker_rss_kb = rss_last[0] if rss_last else None
            m.broker_rss_peak_kb = proc_status_kb(broker.pid, "VmHWM")
            if scenario.command == "connections":
                # CPU over the connect phase; RSS per connection while all are held.
                held = max(rss_hold) if rss_hold else m.broker_rss_kb
                window = (run.start, run.ready_at or run.end)
                m.broker_cpu_percent = cpu_percent(samples, *window)
                m.cpu_window_s = [round(t - run.start, 2) for t in window]
                connected = int(result.get("connected") or 0)
                if held is not None and rss_before is not None and connected > 0:
                    m.figures["rss_before_kb"] = rss_before
                    m.figures["rss_holding_kb"] = held
                    m.figures["rss_per_conn_bytes"] = (held - rss_before) * 1024 / connected
                    m.broker_rss_kb = held
            else:
                window = measured_window(run, settings.warmup, settings.duration)
                m.broker_cpu_percent = cpu_percent(samples, *window)
                m.cpu_window_s = [round(t - run.start, 2) for t in window]
            if worker_samples:
                m.params["worker_cpu_percent"] = [
                    cpu_percent(series, *window) for series in worker_samples.values()
                ]
        missing = [
            f.key
            for f in scenario.figures
            if not f.optional and not valid_number(m.figures.get(f.key))
        ]
        if missing:
            raise RuntimeError(f"loadgen result lacks {', '.join(missing)}: {result}")
    except Exception as e:  # one failed run must not end the benchmark
        m.error = f"{type(e).__name__}: {e}"
    finally:
        if broker is not None:
            stop_process(broker.proc)
            shutil.rmtree(broker.workdir, ignore_errors=True)
        m.elapsed_s = time.monotonic() - t0
    return m


# --------------------------------------------------------------------------- start-up


def probe_connect_packet(client_id: str = "fbl-startup-probe") -> bytes:
    """MQTT 3.1.1 CONNECT: clean session, keep alive 0, no will, no credentials."""
    cid = client_id.encode()
    body = b"\x00\x04MQTT\x04\x02\x00\x00" + len(cid).to_bytes(2, "big") + cid
    assert len(body) < 128
    return bytes([0x10, len(body)]) + body


def wait_for_connack(port: int, proc: subprocess.Popen, deadline: float) -> float:
    """Connects a throwaway clean client, again every PROBE_RETRY_S while refused, until a
    successful CONNACK arrives; returns the monotonic time it arrived."""
    packet = probe_connect_packet()
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with code {proc.returncode} while starting")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no CONNACK within {fmt_num(STARTUP_TIMEOUT_S)} s of start")
        try:
            sock = socket.create_connection((HOST, port), timeout=1.0)
        except OSError:
            time.sleep(PROBE_RETRY_S)
            continue
        with sock:
            reply = b""
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                sock.sendall(packet)
                while len(reply) < 4:
                    chunk = sock.recv(4 - len(reply))
                    if not chunk:
                        break
                    reply += chunk
            except OSError:
                pass
            now = time.monotonic()
            if len(reply) == 4:
                if reply[0] != 0x20 or reply[3] != 0:
                    raise RuntimeError(f"the probe's CONNECT got {reply.hex()}, not CONNACK 0")
                try:
                    sock.sendall(b"\xe0\x00")  # DISCONNECT
                except OSError:
                    pass
                return now
        time.sleep(PROBE_RETRY_S)  # closed before a CONNACK: not ready yet


def stored_bytes(path: Path) -> int:
    """Bytes of the files under `path` (a broker's stored state)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


MIB = 1024 * 1024


def measure_startup(
    scenario: Scenario,
    kind: str,
    round_no: int,
    position: int,
    settings: Settings,
    loadgen: Path,
    base: Path,
) -> Measurement:
    """startup-1m: fill (not timed) -> SIGTERM -> timed start on the same data -> drain.

    1. The broker starts empty; the loadgen's `fill` subscribes a persistent session at
       QoS 1, disconnects it and publishes STARTUP_MESSAGES QoS 1 messages to it (all acked).
    2. SIGTERM, and a clean exit (code 0) is required: Mosquitto writes its file then.
    3. os.sync(), then the broker starts again on the same port and data; start-up time is
       process start (just before fork) -> the first successful CONNACK of a throwaway clean
       client that reconnects every PROBE_RETRY_S while refused. RSS and CPU time are read
       right then: "broker CPU %" of this scenario is over the start-up.
    4. The loadgen's `drain` resumes the session and PUBACKs until all messages arrived
       (drain_s, from its CONNECT); past DRAIN_TIME_LIMIT_S the run keeps its start-up
       figures and gets a note instead."""
    persistence = scenario.persistence or STARTUP_PERSISTENCE
    params = scenario.params(settings)
    params["broker_limits"] = broker_limits(kind)
    params["persistence"] = persistence.params(kind)
    params["startup"] = {
        "messages": STARTUP_MESSAGES,
        "probe": f"3.1.1 CONNECT, clean session, retried every {PROBE_RETRY_S * 1000:g} ms",
        "fill_time_limit_s": FILL_TIME_LIMIT_S,
        "drain_time_limit_s": DRAIN_TIME_LIMIT_S,
        "page_cache": "warm (os.sync() before the start, no cache drop)",
    }
    m = Measurement(scenario.name, kind, round_no, position, params)
    m.started = time.time()
    t0 = time.monotonic()
    broker: Broker | None = None
    try:
        broker = start_broker(kind, base, persistence)
        port, workdir = broker.port, broker.workdir
        args = [a.replace("{port}", str(port)) for a in scenario.loadgen_args(settings)]
        m.params["loadgen_args"] = args
        fill_run = run_loadgen(loadgen, args, FILL_TIME_LIMIT_S + 60)
        fill, _ = parse_loadgen_output(fill_run.stdout)
        if broker.proc.poll() is not None:
            raise RuntimeError(
                f"{kind} exited with code {broker.proc.returncode} during the fill: "
                f"{broker.stderr_tail()}"
            )
        check_loadgen_result(fill_run, fill)
        assert fill is not None
        m.figures["fill_s"] = fill["fill_s"]
        m.figures["fill_acked_per_s"] = fill["acked_per_s"]
        rss_filled = proc_status_kb(broker.pid)
        if rss_filled is not None:
            m.figures["rss_after_fill_mib"] = rss_filled / 1024

        t_stop = time.monotonic()
        code = stop_process(broker.proc, SHUTDOWN_TIMEOUT_S)
        m.figures["shutdown_s"] = time.monotonic() - t_stop
        if code != 0:
            raise RuntimeError(
                f"{kind} exit code {code} at SIGTERM after the fill (-9: killed after "
                f"{fmt_num(SHUTDOWN_TIMEOUT_S)} s): {broker.stderr_tail()}"
            )
        data = workdir / ("data" if kind == "fastbroker" else "mosquitto.db")
        if not data.exists():
            raise RuntimeError(f"{kind} left no stored state at {data}")
        m.figures["stored_mib"] = stored_bytes(data) / MIB
        os.sync()  # nothing left to write back while the start is timed

        cmd = broker_command(kind, port, workdir, persistence)
        t_start = time.monotonic()
        broker = launch(kind, port, workdir, cmd)
        t_ready = wait_for_connack(port, broker.proc, t_start + STARTUP_TIMEOUT_S)
        rss = proc_status_kb(broker.pid)
        cpu = proc_cpu_seconds(broker.pid)
        startup = t_ready - t_start
        m.figures["startup_s"] = startup
        if rss is not None:
            m.figures["rss_after_startup_mib"] = rss / 1024
            m.broker_rss_kb = rss
        hwm = proc_status_kb(broker.pid, "VmHWM")
        if hwm is not None:
            m.figures["rss_peak_startup_mib"] = hwm / 1024
        if cpu is not None:
            m.figures["startup_cpu_s"] = cpu
            m.broker_cpu_percent = 100 * cpu / startup
        m.cpu_window_s = [0.0, round(startup, 3)]

        pid = broker.pid
        samples: list[tuple[float, float]] = []

        def on_sample(now: float) -> None:
            c = proc_cpu_seconds(pid)
            if c is not None:
                samples.append((now, c))

        drain_args = [
            "drain",
            "--host",
            HOST,
            "--port",
            str(port),
            "--count",
            str(STARTUP_MESSAGES),
            "--persistent-subscriber",
            PERSISTENT_SUBSCRIBER,
            "--time-limit",
            fmt_num(DRAIN_TIME_LIMIT_S),
        ]
        m.params["drain_loadgen_args"] = drain_args
        on_sample(time.monotonic())
        drain_run = run_loadgen(loadgen, drain_args, DRAIN_TIME_LIMIT_S + 60, on_sample)
        drain, _ = parse_loadgen_output(drain_run.stdout)
        if broker.proc.poll() is not None:
            raise RuntimeError(
                f"{kind} exited with code {broker.proc.returncode} during the drain: "
                f"{broker.stderr_tail()}"
            )
        try:
            check_loadgen_result(drain_run, drain)
        except RuntimeError as e:
            m.notes.append(f"{kind} {scenario.name} round {round_no}: drain incomplete: {e}")
        else:
            assert drain is not None
            m.figures["drain_s"] = drain["drain_s"]
            m.figures["drain_per_s"] = drain["delivered_per_s"]
            m.figures["drain_first_message_s"] = drain["first_message_s"]
            drain_cpu = cpu_percent(samples, drain_run.start, drain_run.end)
            if drain_cpu is not None:
                m.figures["drain_broker_cpu_percent"] = drain_cpu
        m.broker_rss_peak_kb = proc_status_kb(broker.pid, "VmHWM")
        lg_cpu = (drain or {}).get("loadgen_cpu_percent", fill.get("loadgen_cpu_percent"))
        m.loadgen = {"fill": fill, "drain": drain, "loadgen_cpu_percent": lg_cpu}
        missing = [
            f.key
            for f in scenario.figures
            if not f.optional and not valid_number(m.figures.get(f.key))
        ]
        if missing:
            raise RuntimeError(f"no {', '.join(missing)} measured")
    except Exception as e:  # one failed run must not end the benchmark
        m.error = f"{type(e).__name__}: {e}"
    finally:
        if broker is not None:
            stop_process(broker.proc, SHUTDOWN_TIMEOUT_S)
            shutil.rmtree(broker.workdir, ignore_errors=True)
        m.elapsed_s = time.monotonic() - t0
    return m


def valid_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------- statistics


def broker_order(round_no: int) -> tuple[str, str]:
    """fastbroker first in odd rounds, Mosquitto first in even ones."""
    return BROKERS if round_no % 2 == 1 else (BROKERS[1], BROKERS[0])


def spread(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
        "n": len(values),
    }


def round_ratios(fast: dict[int, float], mosq: dict[int, float]) -> list[float]:
    """fastbroker / Mosquitto per round, for the rounds in which both have a figure."""
    out = []
    for rnd in sorted(set(fast) & set(mosq)):
        if mosq[rnd] > 0:
            out.append(fast[rnd] / mosq[rnd])
    return out


@dataclass
class Row:
    scenario: str
    summary: str
    figure: Figure
    values: dict[str, dict[int, float]]  # broker -> round -> value
    ratios: list[float]
    broker_cpu: dict[str, list[float]]
    loadgen_cpu: dict[str, list[float]]
    failures: int = 0
    first: bool = True  # first row of its scenario

    @property
    def row_id(self) -> str:
        return row_id(self.scenario, self.figure.key)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.row_id,
            "scenario": self.scenario,
            "parameters": self.summary,
            "figure": self.figure.key,
            "label": self.figure.label,
            "direction": self.figure.direction,
            "values": {b: spread(list(v.values())) for b, v in self.values.items()},
            "ratio": spread(self.ratios),
            "ratios": self.ratios,
            "broker_cpu_percent": {b: spread(v) for b, v in self.broker_cpu.items()},
            "loadgen_cpu_percent": {b: spread(v) for b, v in self.loadgen_cpu.items()},
            "failed_runs": self.failures,
        }


def row_id(scenario: str, figure_key: str) -> str:
    return f"{scenario}:{figure_key}"


def build_rows(scenarios: Iterable[Scenario], measurements: Iterable[Measurement]) -> list[Row]:
    ms = list(measurements)
    rows = []
    for sc in scenarios:
        mine = [m for m in ms if m.scenario == sc.name]
        kinds = ("none",) if not sc.uses_broker else BROKERS
        for i, fig in enumerate(sc.figures):
            values: dict[str, dict[int, float]] = {k: {} for k in kinds}
            bcpu: dict[str, list[float]] = {k: [] for k in kinds}
            lcpu: dict[str, list[float]] = {k: [] for k in kinds}
            for m in mine:
                if not m.ok or m.broker not in values:
                    continue
                v = m.figures.get(fig.key)
                if valid_number(v):
                    values[m.broker][m.round] = float(v)
                if valid_number(m.broker_cpu_percent):
                    bcpu[m.broker].append(float(m.broker_cpu_percent))  # type: ignore[arg-type]
                lg = (m.loadgen or {}).get("loadgen_cpu_percent")
                if valid_number(lg):
                    lcpu[m.broker].append(float(lg))
            ratios = (
                round_ratios(values["fastbroker"], values["mosquitto"]) if sc.uses_broker else []
            )
            rows.append(
                Row(
                    sc.name,
                    sc.summary,
                    fig,
                    values,
                    ratios,
                    bcpu,
                    lcpu,
                    failures=sum(1 for m in mine if not m.ok),
                    first=i == 0,
                )
            )
    return rows


# --------------------------------------------------------------------------- table


def fmt_num(x: float | None) -> str:
    """Compact number: 0.5, 2, 1,234,567, 12.3."""
    if x is None or not valid_number(x):
        return "-"
    if float(x).is_integer():
        return f"{int(x):,}"
    if abs(x) >= 100:
        return f"{round(x):,}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}".rstrip("0").rstrip(".") if abs(x) >= 0.01 else f"{x:.3g}"


def fmt_ratio(values: Sequence[float]) -> str:
    s = spread(values)
    if s is None:
        return "-"

    def one(x: float) -> str:
        # Two significant digits where two decimals would print 0.00 (connect-auth: ~0.003).
        return f"{x:.2f}" if x >= 0.05 else f"{x:.2g}"

    return f"{one(s['min'])}-{one(s['median'])}-{one(s['max'])}"


def fmt_median(values: dict[int, float]) -> str:
    return fmt_num(statistics.median(values.values())) if values else "-"


def fmt_cpu(per_broker: dict[str, list[float]], kinds: Sequence[str]) -> str:
    parts = [fmt_num(statistics.median(per_broker[k])) if per_broker.get(k) else "-" for k in kinds]
    return " / ".join(parts)


def render_table(rows: Sequence[Row], ceiling: float | None = None) -> str:
    header = [
        "scenario",
        "parameters",
        "figure",
        "fastbroker (median)",
        "mosquitto (median)",
        "ratio fb/mosq min-median-max",
        "broker CPU % fb / mosq",
        "loadgen CPU % fb / mosq",
    ]
    body: list[list[str]] = []
    for r in rows:
        label = r.figure.label
        if r.figure.direction == "lower":
            label += " (lower is better)"
        if r.scenario == "loopback":
            med = fmt_median(r.values.get("none", {}))
            body.append(
                [
                    r.scenario,
                    r.summary,
                    label,
                    med,
                    med,
                    "(ceiling, no broker)",
                    "-",
                    fmt_cpu(r.loadgen_cpu, ("none",)),
                ]
            )
            continue
        figure_text = label
        if r.figure.key == "mb_per_s" and ceiling:
            shares = [
                f"{100 * statistics.median(r.values[b].values()) / ceiling:.0f}%"
                if r.values.get(b)
                else "-"
                for b in BROKERS
            ]
            figure_text += f" ({' / '.join(shares)} of ceiling)"
        ratio = fmt_ratio(r.ratios)
        if r.failures:
            ratio += f" [{r.failures} failed run(s)]"
        body.append(
            [
                r.scenario if r.first else "",
                r.summary if r.first else "",
                figure_text,
                fmt_median(r.values.get("fastbroker", {})),
                fmt_median(r.values.get("mosquitto", {})),
                ratio,
                fmt_cpu(r.broker_cpu, BROKERS) if r.first else "",
                fmt_cpu(r.loadgen_cpu, BROKERS) if r.first else "",
            ]
        )
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)
    ]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out += [line(b) for b in body]
    return "\n".join(out)


# --------------------------------------------------------------------------- results


def git_sha() -> str:
    try:
        res = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    sha = res.stdout.strip()
    return sha if res.returncode == 0 and sha else "unknown"


def git_dirty() -> bool | None:
    try:
        res = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return bool(res.stdout.strip()) if res.returncode == 0 else None


def new_run_id() -> str:
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def json_line(m: Measurement, run: dict[str, Any]) -> dict[str, Any]:
    """One JSON line: a scenario x broker x round, self-describing for later batch jobs."""
    lg = m.loadgen or {}
    return {
        "schema": SCHEMA,
        "run_id": run["run_id"],
        "git_sha": run["git_sha"],
        "git_dirty": run.get("git_dirty"),
        "hostname": run["hostname"],
        "cpu_count": run.get("cpu_count"),
        "timestamp": iso(m.started),
        "quick": run.get("quick", False),
        "broker": m.broker,
        "broker_version": run["broker_versions"].get(m.broker, ""),
        "round": m.round,
        "position": m.position,
        "scenario": m.scenario,
        "params": m.params,
        "figures": m.figures,
        "broker_cpu_percent": m.broker_cpu_percent,
        "broker_rss_kb": m.broker_rss_kb,
        "broker_rss_peak_kb": m.broker_rss_peak_kb,
        "broker_cpu_window_s": m.cpu_window_s,
        "loadgen_cpu_percent": lg.get("loadgen_cpu_percent"),
        "loadgen_cores_busy": lg.get("loadgen_cores_busy"),
        "loadgen": lg,
        "ok": m.ok,
        "error": m.error,
        "notes": m.notes,
        "elapsed_s": round(m.elapsed_s, 3),
    }


# --------------------------------------------------------------------------- main


def run_benchmark(
    settings: Settings,
    scenarios: list[Scenario],
    loadgen: Path,
    results_dir: Path,
    brokers: Sequence[str] = BROKERS,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    t_start = time.monotonic()
    results_dir.mkdir(parents=True, exist_ok=True)
    run: dict[str, Any] = {
        "run_id": new_run_id(),
        "git_sha": git_sha(),
        "git_dirty": git_dirty(),
        "hostname": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "quick": settings.quick,
        "broker_versions": {b: broker_version(b) for b in brokers},
        "fastbroker_path": fastbroker_location(),
    }
    run["broker_versions"]["none"] = ""
    lines_path = results_dir / f"{run['run_id']}.jsonl"
    summary_path = results_dir / f"{run['run_id']}.summary.json"
    nofile = raise_nofile_limit()
    log(
        f"run {run['run_id']}  git {run['git_sha'][:12]}{' (dirty)' if run['git_dirty'] else ''}"
        f"  host {run['hostname']}  {run['cpu_count']} CPUs  load {os.getloadavg()[0]:.2f}"
    )
    log(
        "brokers: "
        + ", ".join(f"{b} {run['broker_versions'][b]}" for b in brokers)
        + f"; loadgen {loadgen}; RLIMIT_NOFILE {nofile[0]}/{nofile[1]}"
    )
    if "fastbroker" in brokers:
        log(f"fastbroker: {' '.join(fastbroker_command())} (package {run['fastbroker_path']})")
    log(f"lifted limits: {LIMITS_TEXT}")
    for text in persistence_lines(scenarios):
        log(text)
    base = Path(tempfile.mkdtemp(prefix="fastbroker-bench-"))
    try:
        security_text, hash_costs = security_lines(scenarios, base)
    except Exception:
        shutil.rmtree(base, ignore_errors=True)
        raise
    for text in security_text:
        log(text)
    log(
        f"settings: rounds {settings.rounds}, duration {fmt_num(settings.duration)} s, warmup "
        f"{fmt_num(settings.warmup)} s; order alternates (fastbroker first in odd rounds)"
    )
    for sc in scenarios:
        log(f"  {sc.name:12} {sc.summary}  [loadgen {' '.join(sc.loadgen_args(settings))}]")
    if settings.connections and any(s.command == "connections" for s in scenarios):
        if nofile[0] < settings.connections + 100:
            log(f"WARNING: RLIMIT_NOFILE {nofile[0]} < {settings.connections} connections")
    measurements: list[Measurement] = []
    try:
        with open(lines_path, "a") as out:
            for rnd in range(1, settings.rounds + 1):
                order = [b for b in broker_order(rnd) if b in brokers]
                for sc in scenarios:
                    kinds: list[str | None] = list(order) if sc.uses_broker else [None]
                    for pos, kind in enumerate(kinds, 1):
                        m = measure(sc, kind, rnd, pos, settings, loadgen, base)
                        measurements.append(m)
                        out.write(json.dumps(json_line(m, run), sort_keys=True) + "\n")
                        out.flush()
                        log(progress_line(m, sc))
    finally:
        stop_all_started()
        shutil.rmtree(base, ignore_errors=True)
        _assets.pop(base, None)
    rows = build_rows(scenarios, measurements)
    ceiling_row = next((r for r in rows if r.scenario == "loopback"), None)
    ceiling = (
        statistics.median(ceiling_row.values["none"].values())
        if ceiling_row and ceiling_row.values["none"]
        else None
    )
    table = render_table(rows, ceiling)
    summary = {
        "schema": SCHEMA + "-summary",
        **{k: v for k, v in run.items() if k != "broker_versions"},
        "broker_versions": {b: run["broker_versions"][b] for b in brokers},
        "settings": settings.__dict__ | {"payloads": list(settings.payloads)},
        "scenarios": [s.name for s in scenarios],
        "limits": LIMITS_TEXT,
        "persistence": persistence_lines(scenarios),
        "security": [line.replace(str(base), "<run tmp>") for line in security_text],
        "hash_costs": hash_costs,
        "rows": [r.to_json() for r in rows],
        "loopback_ceiling_mb_per_s": ceiling,
        "failed_runs": [
            {"scenario": m.scenario, "broker": m.broker, "round": m.round, "error": m.error}
            for m in measurements
            if not m.ok
        ],
        "notes": run_notes(measurements),
        "elapsed_s": round(time.monotonic() - t_start, 1),
        "jsonl": str(lines_path),
        "table": table,
    }
    summary_path.write_text(json.dumps(summary, indent=2) + "\n")
    log("")
    log(table)
    log("")
    log(
        "ratio = fastbroker / mosquitto per round (paired), shown min-median-max; above 1 is "
        "better for fastbroker except rows marked (lower is better). CPU %: 100 = one core, "
        "medians over rounds."
    )
    for note in summary["notes"]:
        log(f"note: {note}")
    log(f"results: {lines_path}")
    log(f"summary: {summary_path}  ({summary['elapsed_s']} s)")
    summary["summary_path"] = str(summary_path)
    return summary


def persistence_lines(scenarios: Sequence[Scenario]) -> list[str]:
    """How the selected durable-storage scenarios set up both brokers, for the log."""
    if not any(s.persistence for s in scenarios):
        return []
    out = [
        "persistence (durable scenarios only): fastbroker [storage] data_dir in the run's "
        "temporary directory (RocksDB); mosquitto persistence true, persistence_location there. "
        "Mosquitto snapshots its whole in-memory state (fsync + rename) at shutdown, every "
        "autosave_interval s, or with autosave_on_changes after a loop iteration with that many "
        "counted changes (queued messages, subscriptions, retained messages); it never holds "
        "a PUBACK back for a save"
    ]
    for sc in scenarios:
        p = sc.persistence
        if p is None:
            continue
        interval = " (group commit every 10 ms)" if p.fsync == "interval" else ""
        out.append(
            f"  {sc.name}: fastbroker fsync = {p.fsync}{interval}; mosquitto {p.mosquitto_words}"
        )
        if sc.kind == "startup":
            out.append(
                f"  {sc.name}: fill {STARTUP_MESSAGES:,} msgs (not timed, limit "
                f"{fmt_num(FILL_TIME_LIMIT_S)} s), SIGTERM (clean exit required), os.sync(), "
                "restart on the same data: process start -> first CONNACK of a clean client "
                f"(retried every {PROBE_RETRY_S * 1000:g} ms), RSS then; drain to the persistent "
                f"subscriber (limit {fmt_num(DRAIN_TIME_LIMIT_S)} s). broker CPU % = over the "
                "start-up; loadgen CPU % = the drain's"
            )
    return out


def progress_line(m: Measurement, sc: Scenario) -> str:
    head = f"[r{m.round}] {m.scenario:12} {m.broker:10}"
    if not m.ok:
        return f"{head} FAILED: {m.error}"
    figs = "  ".join(f"{f.key}={fmt_num(m.figures.get(f.key))}" for f in sc.figures)
    cpu = fmt_num(m.broker_cpu_percent)
    lg = fmt_num((m.loadgen or {}).get("loadgen_cpu_percent"))
    return f"{head} {figs}  broker CPU {cpu}%  loadgen CPU {lg}%  ({m.elapsed_s:.1f} s)"


def settings_from_args(ns: argparse.Namespace) -> Settings:
    base = QUICK if ns.quick else Settings()
    payloads = base.payloads
    if ns.payloads:
        payloads = tuple(int(p) for p in ns.payloads.split(",") if p.strip())
    return Settings(
        rounds=ns.rounds if ns.rounds is not None else base.rounds,
        duration=ns.duration if ns.duration is not None else base.duration,
        warmup=ns.warmup if ns.warmup is not None else base.warmup,
        connections=ns.connections if ns.connections is not None else base.connections,
        hold=ns.hold if ns.hold is not None else base.hold,
        payloads=payloads,
        quick=ns.quick,
        auth_connections=ns.auth_connections or base.auth_connections,
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="fastbroker vs Mosquitto, side by side, with bench/loadgen.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  python bench/run.py --quick                          # what CI runs\n"
        "  python bench/run.py --scenarios fan-in,qos1 --rounds 5 --duration 10\n"
        "  python bench/run.py --scenarios persistent --rounds 2  # only the durable-storage\n"
        "      # scenarios: qos1-persistent-always,-interval,-never and startup-1m\n"
        "  python bench/run.py --scenarios startup-1m\n"
        "  python bench/run.py --scenarios security   # fan-in-acl, connect-plain,\n"
        "      # connect-auth, pairs-tls, pairs-ws: what ACLs, passwords, TLS and WebSocket cost",
    )
    p.add_argument("--rounds", type=int, help="rounds per scenario (default 3)")
    p.add_argument("--duration", type=float, help="measured seconds per run (default 5)")
    p.add_argument("--warmup", type=float, help="warm-up seconds per run (default 1)")
    p.add_argument(
        "--scenarios",
        help="comma-separated: fan-in,fan-out,pairs,qos1,latency,connections,payload "
        "(or payload-16,payload-1k,payload-64k),loopback; durable storage: persistent (or "
        "qos1-persistent-always,qos1-persistent-interval,qos1-persistent-never,startup-1m); "
        "security (or fan-in-acl,connect-plain,connect-auth,pairs-tls,pairs-ws), only run "
        "when named. Default: all but security, or with --quick all but the durable-storage "
        "and security ones",
    )
    p.add_argument("--connections", type=int, help="idle connections (default 15000)")
    p.add_argument("--hold", type=float, help="seconds the connections are held (default 3)")
    p.add_argument("--payloads", help="payload sweep sizes in bytes (default 16,1024,65536)")
    p.add_argument(
        "--auth-connections",
        type=int,
        help=f"connections of connect-auth and connect-plain (default {AUTH_CONNECTIONS})",
    )
    p.add_argument(
        "--results", type=Path, default=DEFAULT_RESULTS, help="results directory (JSON lines)"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="short settings: 3 rounds of 2 s (0.5 s warm-up), 3,000 connections; without "
        "--scenarios, the durable-storage scenarios are left out (what CI runs)",
    )
    p.add_argument("--brokers", default=",".join(BROKERS), help="subset of brokers, for debugging")
    p.add_argument(
        "--workers",
        type=int,
        default=1,
        help="fastbroker's --workers (default 1; bench/workers.py compares 1 and 2 in one run)",
    )
    p.add_argument("--loadgen", help="loadgen binary (default: build bench/loadgen with cargo)")
    p.add_argument("--summary-out", type=Path, help="also copy the summary JSON here")
    ns = p.parse_args(argv)
    if ns.rounds is not None and ns.rounds < 1:
        p.error("--rounds must be at least 1")
    return ns


def _sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    brokers = tuple(b for b in ns.brokers.split(",") if b)
    bad = set(brokers) - set(BROKERS)
    if bad:
        raise SystemExit(f"unknown broker(s): {', '.join(sorted(bad))}")
    settings = settings_from_args(ns)
    scenarios = select_scenarios(
        default_scenarios(settings),
        ns.scenarios,
        extra=persistent_scenarios(settings) + security_scenarios(settings),
    )
    global FASTBROKER_WORKERS
    FASTBROKER_WORKERS = ns.workers
    signal.signal(signal.SIGTERM, _sigterm)
    raise_nofile_limit()
    loadgen = find_loadgen(ns.loadgen)
    summary = run_benchmark(settings, scenarios, loadgen, ns.results, brokers)
    if ns.summary_out:
        ns.summary_out.parent.mkdir(parents=True, exist_ok=True)
        ns.summary_out.write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
