"""The access log: one JSON object per line for every connect, refused connect and disconnect.

The engine records these events as tuples (`Engine.take_access_events`); the connection layer
hands each batch to `AccessLog.handle` together with a `conn_info(conn_id)` lookup, before the
connection's details are forgotten. Nothing here runs per message.

A line (keys always in this order; ``duration_s`` only on disconnects, null when the connect
was not seen)::

    {"ts": "2025-01-31T09:15:02.481Z", "event": "disconnect", "client_id": "sensor-17",
     "username": "alice", "peer": "10.0.0.7:51234", "listener": "default", "transport": "tcp",
     "protocol": 5, "reason_code": 141, "reason": "keep alive timeout", "duration_s": 42.517}

Where it goes (``[log] access_log``): "stderr" logs through the normal log (logger
``fastbroker.access`` at level info, so ``[log] level = "warning"`` silences it); a file path
gets the bare JSON lines, whatever ``[log] level`` says, through a WatchedFileHandler (the file
is reopened when logrotate moves it away); "off" logs nothing.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from fastbroker.config import ConfigError

LOGGER_NAME = "fastbroker.access"
# Client ids may be 64 KiB long: strings from clients are cut to this many characters so a
# line stays bounded and readable.
MAX_FIELD_CHARS = 256

# (kind, conn_id, client_id, username, protocol_level, reason_code, reason), as the engine
# produces them; kind is "connect", "refused" or "disconnect".
AccessEvent = Sequence[Any]
# conn_id -> the connection's details ("peer", "listener", "transport"), or None if unknown.
ConnInfo = Callable[[int], Mapping[str, Any] | None]


def iso_utc_ms(wall_time: float) -> str:
    # Whole milliseconds first: 1738314902.481 is 1738314902.48099995 as a float.
    seconds, millis = divmod(round(wall_time * 1000), 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def clip(text: Any) -> Any:
    if isinstance(text, str) and len(text) > MAX_FIELD_CHARS:
        return text[:MAX_FIELD_CHARS] + "..."
    return text


def format_peer(peer: Any) -> str | None:
    """'host:port' ('[v6]:port') from a socket address tuple; strings are kept as they are."""
    if isinstance(peer, tuple | list) and len(peer) >= 2:
        host, port = peer[0], peer[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return peer if isinstance(peer, str) else None


class AccessLog:
    """Turns access events into log lines and remembers connect times for ``duration_s``."""

    def __init__(
        self,
        enabled: bool = True,
        logger: logging.Logger | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = enabled
        self.logger = logger if logger is not None else logging.getLogger(LOGGER_NAME)
        self.wall_clock = wall_clock
        self.clock = clock
        # conn_id -> when its connect was logged (clock); forgotten at its disconnect. Ids are
        # reused by later connections, so a missed disconnect is overwritten, never leaked.
        self.connected_at: dict[int, float] = {}
        # The handler open_access_log() added for a file, removed by close().
        self.handler: logging.Handler | None = None

    def handle(self, events: Iterable[AccessEvent], conn_info: ConnInfo | None) -> None:
        if not self.enabled:
            return
        logger = self.logger
        if not logger.isEnabledFor(logging.INFO):
            # Nothing to write: no connect times kept either (memory per idle connection).
            return
        # One clock reading per batch: its events all happened in one loop iteration.
        now = self.clock()
        ts = iso_utc_ms(self.wall_clock())
        connected_at = self.connected_at
        for kind, conn, client_id, username, protocol, reason_code, reason in events:
            if kind == "connect":
                connected_at[conn] = now
                started = None
            else:
                started = connected_at.pop(conn, None)
            info = conn_info(conn) if conn_info is not None else None
            if info is None:
                info = {}
            line: dict[str, Any] = {
                "ts": ts,
                "event": kind,
                "client_id": clip(client_id),
                "username": clip(username),
                "peer": format_peer(info.get("peer")),
                "listener": info.get("listener"),
                "transport": info.get("transport"),
                "protocol": protocol,
                "reason_code": reason_code,
                "reason": reason,
            }
            if kind == "disconnect":
                line["duration_s"] = round(now - started, 3) if started is not None else None
            logger.info("%s", json.dumps(line))

    def hook(self, conn_info: ConnInfo | None) -> Callable[[list[AccessEvent]], None] | None:
        """The callable the connection layer calls with each batch (None when off, so the
        layer skips the call)."""
        if not self.enabled:
            return None

        def handle_batch(events: list[AccessEvent]) -> None:
            self.handle(events, conn_info)

        return handle_batch

    def close(self) -> None:
        """Closes the file, if any; the logger goes back to logging through the normal log."""
        if self.handler is not None:
            self.logger.removeHandler(self.handler)
            self.handler.close()
            self.handler = None
            self.logger.propagate = True
            self.logger.setLevel(logging.NOTSET)


def open_access_log(target: str) -> AccessLog:
    """The access log ``[log] access_log`` asks for: "off", "stderr" or a file path. Raises
    ConfigError (one line) when the file cannot be opened."""
    if target == "off":
        return AccessLog(enabled=False)
    logger = logging.getLogger(LOGGER_NAME)
    if target == "stderr":
        logger.propagate = True
        return AccessLog(enabled=True, logger=logger)
    try:
        handler = logging.handlers.WatchedFileHandler(target, encoding="utf-8")
    except OSError as error:
        reason = error.strerror.lower() if error.strerror else str(error)
        raise ConfigError(f"[log] access_log: cannot open {target}: {reason}") from None
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    # Bare JSON lines in their own file, whatever [log] level says.
    logger.setLevel(logging.INFO)
    logger.propagate = False
    access_log = AccessLog(enabled=True, logger=logger)
    access_log.handler = handler
    return access_log
