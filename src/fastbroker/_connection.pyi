"""Types of the Cython module built from pyx/fastbroker/_connection.pyx."""

import asyncio
from typing import Any

EVENT_LOG_LEVELS: dict[str, int]
DEFAULT_TICK_INTERVAL: float

def monotonic_ms() -> int: ...

class Server:
    engine: Any
    write_buffer_high: int
    write_buffer_low: int
    tick_interval: float
    read_budget: int
    def __init__(
        self,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        write_buffer_high: int,
        tick_interval: float = ...,
        read_budget: int = ...,
    ) -> None: ...
    def new_connection(self) -> Connection: ...
    @property
    def open_connections(self) -> int: ...
    def schedule_flush(self) -> None: ...
    def flush(self) -> None: ...
    def start_ticking(self) -> None: ...
    def stop_ticking(self) -> None: ...
    def on_tick(self) -> None: ...
    def close_connections(self) -> None: ...
    def abort_connections(self) -> None: ...

# At runtime a cdef class that only duck-types asyncio.Protocol (it cannot subclass it).
class Connection(asyncio.Protocol):
    conn_id: int
    transport: asyncio.Transport | None
    def __init__(self, server: Server) -> None: ...
