"""The real connection layer (fastbroker._connection.Server) on a uvloop loop in this process,
listening on a loopback port: for tests that look inside the broker while clients in a thread
talk to it over real sockets. With ``compiled`` the listener is served by the compiled layer
(fastbroker_core.Reactor) instead of uvloop's transports."""

from __future__ import annotations

import asyncio
import gc
import socket
from typing import Any

import fastbroker_core
import uvloop

from fastbroker._connection import Server


class Layer:
    def __init__(self, engine: Any, compiled: bool = False, **options: Any) -> None:
        self.loop = uvloop.new_event_loop()
        self.server: Server | None = Server(engine, self.loop, 1 << 20, **options)
        self.socket: socket.socket | None = None
        if compiled:
            self.socket = socket.create_server(("127.0.0.1", 0))
            reactor = fastbroker_core.Reactor(self.server.read_budget, 1 << 20, 1000)
            reactor.add_listener(self.socket.fileno())
            info = {"listener": "default", "peer": None, "transport": "tcp", "proxy": None}
            self.server.attach_reactor(reactor, [info])
            self.port: int = self.socket.getsockname()[1]
        else:
            self.listener = self.loop.run_until_complete(
                self.loop.create_server(self.server.new_connection, "127.0.0.1", 0)
            )
            self.port = self.listener.sockets[0].getsockname()[1]

    def close(self) -> None:
        assert self.server is not None
        if self.socket is not None:
            self.server.reactor.close_listener(0)
            self.socket.close()
        else:
            self.listener.close()
        self.server.close_connections()
        self.loop.run_until_complete(asyncio.sleep(0.05))
        self.server.detach_reactor()
        self.loop.close()
        # The server and its connections form cycles around the engine, which may only be
        # freed on this thread: collect them now, not in some client library's thread. The
        # caller keeps no reference of its own to the server.
        self.server = None
        gc.collect()
