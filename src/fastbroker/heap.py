"""Gives freed heap memory back to the OS.

Bursts (a flood to a slow subscriber, a reconnect storm) allocate many large buffers that glibc
keeps after they are freed: measured here, 450 MB of RSS stayed after a 50-pair QoS 0 flood
with no client left, and malloc_trim brought it to 27 MB. Trimming every few seconds from the
control plane costs one cheap call and keeps RSS close to what the broker really holds.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import platform
from collections.abc import Callable

logger = logging.getLogger("fastbroker.heap")

TRIM_INTERVAL_S = 5.0


def find_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    if platform.libc_ver()[0] != "glibc":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class HeapTrimmer:
    def __init__(self, loop: asyncio.AbstractEventLoop, interval: float = TRIM_INTERVAL_S):
        self.loop = loop
        self.interval = interval
        self.trim = find_malloc_trim()
        self.handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        if self.trim is not None and self.handle is None:
            self.handle = self.loop.call_later(self.interval, self.run)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def run(self) -> None:
        self.handle = self.loop.call_later(self.interval, self.run)
        assert self.trim is not None
        self.trim(0)
