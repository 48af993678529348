"""The real connection layer (fastbroker._connection.Server) on a uvloop loop in this process,
listening on a loopback port: for tests that look inside the broker while clients in a thread
talk to it over real sockets."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import uvloop

from fastbroker._connection import Server


class Layer:
    def __init__(self, engine: Any, **options: Any) -> None:
        self.loop = uvloop.new_event_loop()
        self.server: Server | None = Server(engine, self.loop, 1 << 20, **options)
        self.listener = self.loop.run_until_complete(
            self.loop.create_server(self.server.new_connection, "127.0.0.1", 0)
        )
        self.port: int = self.listener.sockets[0].getsockname()[1]

    def close(self) -> None:
        assert self.server is not None
        self.listener.close()
        self.server.close_connections()
        self.loop.run_until_complete(asyncio.sleep(0.05))
        self.loop.close()
        # The server and its connections form cycles around the engine, which may only be
        # freed on this thread: collect them now, not in some client library's thread. The
        # caller keeps no reference of its own to the server.
        self.server = None
        gc.collect()
