"""The admin HTTP endpoint: JSON for operators and tools, on its own port.

A few fixed routes, so a small HTTP/1.1 server on asyncio streams does (no web framework
dependency): one request per connection, bounded sizes and a deadline so a slow or hostile
client cannot hold it.

  GET  /health          200 "ok" while the event loop runs (liveness)
  GET  /ready           200 {"ready": true} when the broker can serve clients; else 503 with
                        {"ready": false, "reasons": [...]} (readiness; 503 from the start of
                        shutdown, so load balancers drain)
  GET  /metrics         Prometheus text format (fastbroker.metrics)
  GET  /cluster/status  members, their state, partitions held, map version (JSON)
  POST /cluster/leave   this node leaves the cluster, then stops (JSON result)
  POST /clients/kick    {"client_id": "..."}: ends that client's connection (MQTT 5:
                        DISCONNECT 0x98) and session on this node and every reachable one
  GET  /clients/ID      {"client_id": ..., "session": "connected" | "disconnected" | null}:
                        whether this node holds that client's session (ID percent-encoded)
  POST /debug/block     {"nodes": [...]}: cut links to those nodes; [] heals. Only with
                        [cluster] fault_injection = true (tests of network splits).

POST requests must carry the header `X-Fastbroker-Admin: 1`: a web page open in a browser on
the same host can send a plain POST to a loopback port, but not with a custom header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, NamedTuple

logger = logging.getLogger("fastbroker.admin")

MAX_HEADER = 16 * 1024
MAX_BODY = 64 * 1024
REQUEST_DEADLINE_S = 5.0
# Requests handled at once; more wait in the accept backlog.
MAX_CONCURRENT = 32
ADMIN_HEADER = "x-fastbroker-admin"


class Raw(NamedTuple):
    """A response body sent as is, with its content type."""

    content_type: str
    data: bytes


# (method, path, body) -> (status, body): a str (text/plain), a Raw, or a JSON-able value.
Handler = Callable[[str, str, bytes], Awaitable[tuple[int, Any]]]

REASONS = {
    200: "OK",
    400: "Bad Request",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    409: "Conflict",
    413: "Payload Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class AdminServer:
    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.server: asyncio.Server | None = None
        self.slots = asyncio.Semaphore(MAX_CONCURRENT)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        self.server = await asyncio.start_server(self.serve, host, port, limit=MAX_HEADER)
        bound = self.server.sockets[0].getsockname()
        return bound[0], bound[1]

    async def start_unix(self, path: str) -> None:
        """On a Unix socket (a worker's, for the first worker only: fastbroker.workers)."""
        self.server = await asyncio.start_unix_server(self.serve, path, limit=MAX_HEADER)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async with self.slots:
            await self.serve_one(reader, writer)

    async def serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(self.read_request(reader), REQUEST_DEADLINE_S)
            if isinstance(request, tuple) and len(request) == 3:
                # Not under the read deadline: some actions (leaving) take longer.
                status, body = await self.handler(*request)
            else:
                status, body = request
        except TimeoutError:
            status, body = 408, {"error": "request not received in time"}
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        except Exception:
            logger.exception("admin request failed")
            status, body = 500, {"error": "internal error"}
        if isinstance(body, Raw):
            content_type, data = body
        elif isinstance(body, str):
            content_type, data = "text/plain", body.encode()
        else:
            content_type, data = "application/json", (json.dumps(body, indent=1) + "\n").encode()
        head = (
            f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n"
        )
        try:
            writer.write(head.encode() + data)
            await asyncio.wait_for(writer.drain(), REQUEST_DEADLINE_S)
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()

    async def read_request(
        self, reader: asyncio.StreamReader
    ) -> tuple[str, str, bytes] | tuple[int, Any]:
        """(method, path, body), or (status, error body) for a bad request."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            return 413, {"error": "request header too large"}
        except asyncio.IncompleteReadError:
            return 400, {"error": "incomplete request"}
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            return 400, {"error": "bad request line"}
        method, target = parts[0], parts[1]
        length = 0
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            value = headers["content-length"]
            if not (value.isascii() and value.isdigit() and len(value) <= 12):
                return 400, {"error": "bad Content-Length"}
            length = int(value)
        if method == "POST" and headers.get(ADMIN_HEADER) != "1":
            return 403, {"error": f"POST needs the header {ADMIN_HEADER}: 1"}
        if length > MAX_BODY:
            return 413, {"error": "request body too large"}
        body = await reader.readexactly(length) if length else b""
        return method, target.split("?", 1)[0], body


class Readiness:
    """Whether the broker can serve clients now, with the reasons when it cannot.

    Built once the store is open and restored. Not ready while: shutdown has begun
    (`stopping` is set), a listener is not serving (before the start, or closed), the store is
    closed or its writes fail, or, for a cluster node, it is not a member of a cluster map or
    a reachable member's retained set has not arrived yet.
    """

    def __init__(
        self,
        *,
        stopping: asyncio.Event | None = None,
        listeners: Iterable[Any] = (),
        server: Any = None,
        store: Any = None,
        cluster: Any = None,
    ) -> None:
        self.stopping = stopping
        self.listeners = list(listeners)
        self.server = server
        self.store = store
        self.cluster = cluster

    def reasons(self) -> list[str]:
        reasons = []
        if self.stopping is not None and self.stopping.is_set():
            reasons.append("shutting down")
        if not all(listener.is_serving() for listener in self.listeners):
            reasons.append("not all listeners are serving")
        if self.store is not None and self.store.closed:
            reasons.append("the store is closed")
        elif getattr(self.server, "store_failing", False):
            reasons.append("store writes are failing")
        if self.cluster is not None:
            status = self.cluster.status()
            if not status.get("member") or status.get("map_version") is None:
                reasons.append("not a member of a cluster map yet")
            pending = self.cluster.retained_pending(True)
            if pending:
                reasons.append(f"retained messages of {', '.join(pending)} not received yet")
        return reasons


def parse_json_body(body: bytes) -> Any:
    try:
        return json.loads(body or b"{}")
    except (ValueError, UnicodeDecodeError):
        return None


def routes(
    cluster: Any,
    fault_injection: bool,
    on_left: Callable[[], None],
    *,
    metrics: Callable[[], bytes | Awaitable[bytes]] | None = None,
    metrics_content_type: str = "text/plain; version=0.0.4; charset=utf-8",
    readiness: Readiness | None = None,
    kick: Callable[[str], bool] | None = None,
    session_state: Callable[[str], str | None] | None = None,
) -> Handler:
    """The endpoint's routes; `cluster` is the ClusterNode, or None for a standalone broker;
    `on_left` runs once the node has left its cluster (it then stops); `metrics` renders the
    /metrics document and `readiness` answers /ready, `kick` ends a client id and says
    whether this node held it, `session_state` says whether this node holds a client's
    session (each route 404 when None)."""

    async def handle(method: str, path: str, body: bytes) -> tuple[int, Any]:
        if path == "/health":
            return (200, "ok\n") if method == "GET" else (405, {"error": "use GET"})
        if path == "/ready" and readiness is not None:
            if method != "GET":
                return 405, {"error": "use GET"}
            reasons = readiness.reasons()
            if reasons:
                return 503, {"ready": False, "reasons": reasons}
            return 200, {"ready": True}
        if path == "/metrics" and metrics is not None:
            if method != "GET":
                return 405, {"error": "use GET"}
            document = metrics()
            if not isinstance(document, bytes):
                # The node's workers' documents, gathered (fastbroker.workers).
                document = await document
            return 200, Raw(metrics_content_type, document)
        if path == "/cluster/status":
            if method != "GET":
                return 405, {"error": "use GET"}
            if cluster is None:
                return 200, {"node_id": None, "standalone": True, "members": []}
            return 200, cluster.status()
        if path == "/cluster/leave":
            if method != "POST":
                return 405, {"error": "use POST"}
            if cluster is None:
                return 400, {"error": "this broker is standalone"}
            blocker = cluster.leave_blocker()
            if blocker is not None:
                return 409, {"left": False, "reason": blocker}
            left = await cluster.leave()
            if left:
                on_left()
            return (200 if left else 503), {"left": left}
        if path == "/clients/kick" and kick is not None:
            if method != "POST":
                return 405, {"error": "use POST"}
            request = parse_json_body(body)
            client_id = request.get("client_id") if isinstance(request, dict) else None
            if not isinstance(client_id, str) or len(client_id.encode()) > 65535:
                return 400, {"error": 'POST {"client_id": "..."}'}
            return 200, {"client_id": client_id, "held_here": kick(client_id)}
        if path.startswith("/clients/") and path != "/clients/kick" and session_state:
            if method != "GET":
                return 405, {"error": "use GET"}
            try:
                client_id = urllib.parse.unquote(path.removeprefix("/clients/"), errors="strict")
            except UnicodeDecodeError:
                client_id = ""
            if not client_id or len(client_id.encode()) > 65535:
                return 400, {"error": "GET /clients/<percent-encoded client id>"}
            return 200, {"client_id": client_id, "session": session_state(client_id)}
        if path == "/debug/block":
            if cluster is None or not fault_injection:
                return 404, {"error": "fault injection is off ([cluster] fault_injection)"}
            request = parse_json_body(body)
            nodes = request.get("nodes") if isinstance(request, dict) else None
            if method != "POST" or not isinstance(nodes, list):
                return 400, {"error": 'POST {"nodes": [node ids]}'}
            cluster.transport.block({str(n) for n in nodes})
            return 200, {"blocked": sorted(cluster.transport.blocked)}
        return 404, {"error": f"no such path {path}"}

    return handle
