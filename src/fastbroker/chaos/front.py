"""HAProxy in front of the nodes, as operators run it (docs/load-balancer.md): round robin,
PROXY protocol v2 to the nodes' listeners, an MQTT-level health check. In a run it lives in
the switch namespace and listens on Unix sockets in a directory of the run, the only way in
from the host: ``mqtt.sock`` (the balanced front), and per node ``nN-mqtt.sock`` (its MQTT
listener, for the final reads) and ``nN-admin.sock`` (its admin endpoint)."""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from fastbroker.admin import ADMIN_HEADER

# MQTT 3.1.1 CONNECT, clean session, empty client id, keep alive 10 s; the answer a healthy
# node gives is CONNACK "accepted". A paused or overloaded node that still accepts TCP
# connections fails it.
HEALTH_CONNECT = "100c00044d5154540402000a0000"
HEALTH_CONNACK = "20020000"


def haproxy_config(
    nodes: list[tuple[str, str]],
    mqtt_port: int,
    bind: str,
    *,
    check_interval_ms: int = 2000,
    maxconn: int = 10000,
    extra: str = "",
) -> str:
    """The configuration for `nodes` ((name, ip) pairs) behind the front bound at `bind`
    (``:1883`` or ``unix@/path``); `extra` is appended (more listen sections)."""
    servers = "\n".join(f"    server {name} {ip}:{mqtt_port}" for name, ip in nodes)
    return f"""\
global
    # Two descriptors per connection: the process's open-file limit must allow 2 x maxconn.
    maxconn {maxconn}

defaults
    mode tcp
    timeout connect 2s
    # Longer than any client's keep alive x 1.5: MQTT connections idle between pings.
    timeout client 1h
    timeout server 1h
    # A node that refuses a connection: try another one.
    retries 2
    option redispatch

frontend mqtt
    bind {bind}
    default_backend nodes

backend nodes
    balance roundrobin
    option tcp-check
    tcp-check send-binary {HEALTH_CONNECT}
    tcp-check expect binary {HEALTH_CONNACK}
    # send-proxy-v2: the nodes see each client's own address ([listener] proxy_protocol).
    # A node marked down has its connections closed, so its clients reconnect elsewhere.
    default-server send-proxy-v2 check check-send-proxy inter {check_interval_ms}ms \
fall 2 rise 2 on-marked-down shutdown-sessions
{servers}
{extra}"""


class Front:
    """HAProxy run in a namespace (`command` wraps argv to run there), started and stopped
    by PID."""

    def __init__(
        self,
        nodes: list[tuple[str, str]],
        mqtt_port: int,
        admin_port: int,
        sockets: Path,
        workdir: Path,
        command: Any,
    ) -> None:
        self.sockets = sockets
        self.workdir = workdir
        self.command = command
        self.mqtt_socket = str(sockets / "mqtt.sock")
        listens = []
        for name, ip in nodes:
            listens.append(
                f"listen {name}-mqtt\n    bind unix@{self.node_mqtt(name)}\n"
                f"    server {name} {ip}:{mqtt_port} send-proxy-v2\n"
                f"listen {name}-admin\n    bind unix@{self.node_admin(name)}\n"
                f"    server {name} {ip}:{admin_port}\n"
            )
        self.config = haproxy_config(
            nodes,
            mqtt_port,
            f"unix@{self.mqtt_socket}",
            check_interval_ms=500,
            maxconn=1000,
            extra="\n".join(listens),
        )
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def unavailable() -> str | None:
        if shutil.which("haproxy") is None:
            return "`haproxy` is not installed (Debian package haproxy; /usr/sbin on PATH)"
        return None

    def node_mqtt(self, name: str) -> str:
        return str(self.sockets / f"{name}-mqtt.sock")

    def node_admin(self, name: str) -> str:
        return str(self.sockets / f"{name}-admin.sock")

    def start(self, preexec_fn: Any) -> None:
        config = self.workdir / "haproxy.cfg"
        config.write_text(self.config)
        with open(self.workdir / "haproxy.log", "ab") as log:
            # -db: in the foreground, so the PID is HAProxy's own.
            self.proc = subprocess.Popen(
                self.command(["haproxy", "-db", "-f", str(config)]),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=preexec_fn,
            )
        deadline = time.monotonic() + 10
        while not Path(self.mqtt_socket).exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"HAProxy did not start: see {self.workdir / 'haproxy.log'}")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.unix_path)
        self.sock = sock


def admin_get(path: str, resource: str, timeout: float = 1.0) -> Any:
    """GET `resource` of the admin endpoint behind Unix socket `path` (JSON), or None if it
    does not answer within `timeout`."""
    return admin_request(path, "GET", resource, timeout)


def admin_request(path: str, method: str, resource: str, timeout: float) -> Any:
    """`method` `resource` of the admin endpoint behind Unix socket `path`: its JSON
    answer, or None if it does not answer 200 within `timeout`."""
    connection = UnixHTTPConnection(path, timeout)
    # The header the admin endpoint wants on a POST (as the CLI sends it).
    headers = {ADMIN_HEADER: "1"} if method == "POST" else {}
    try:
        connection.request(method, resource, headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            return None
        return json.loads(response.read())
    except (OSError, ValueError, http.client.HTTPException):
        return None
    finally:
        connection.close()
