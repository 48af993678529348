"""Overload protection that lives outside the engine: the global memory high-water mark.

Past the mark the connection layer stops reading sockets of connections that publish, so TCP
pushes back on publishers; subscribers are still read, because their acknowledgements are what
lets queued messages go. Nothing acknowledged is dropped and nobody is disconnected. Below the
low-water mark reading resumes. (Per-client publish rates, in-flight windows and connection
limits are enforced by the engine and the connection layer; see docs/operations.md.)
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from fastbroker.heap import find_malloc_trim, rss_bytes

logger = logging.getLogger("fastbroker.overload")

# Reading /proc/self/statm costs microseconds; a short interval bounds the overshoot past the
# mark (loopback publishers can push hundreds of MB per second).
CHECK_INTERVAL_S = 0.05
# Far below the mark the checks are spaced out (an idle broker is not woken 20 times a
# second for them): the next check comes before RSS could reach the mark growing at this
# rate, well above what the broker can take in, and at most this long after the last.
MAX_GROWTH_BYTES_PER_S = 4 << 30
MAX_CHECK_INTERVAL_S = 1.0
# malloc_trim walks the heap (milliseconds): under pressure at most this often.
TRIM_INTERVAL_S = 1.0
# Reading resumes below this share of the high-water mark (hysteresis: no flapping).
LOW_WATER_RATIO = 0.8
# "auto": this share of the memory the broker may use (RAM, or its cgroup's limit).
AUTO_RATIO = 0.5


def available_memory() -> int | None:
    """The memory this process may use: the cgroup v2 limit if set, else physical RAM."""
    try:
        with open("/sys/fs/cgroup/memory.max", encoding="ascii") as f:
            text = f.read().strip()
        if text != "max":
            return int(text)
    except (OSError, ValueError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return None


def high_water_bytes(setting: int | str) -> int:
    """The mark in bytes from the [limits] memory_high_water_mb setting; 0 = off."""
    if setting == "auto":
        total = available_memory()
        return int(total * AUTO_RATIO) if total else 0
    return int(setting) * 1024 * 1024


class MemoryGuard:
    """Samples RSS and tells the server when it crosses the marks."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        set_pressure: Callable[[bool], Any],
        high_water: int,
        rss: Callable[[], int | None] = rss_bytes,
        interval: float = CHECK_INTERVAL_S,
    ):
        self.loop = loop
        self.set_pressure = set_pressure
        self.high_water = high_water
        self.low_water = int(high_water * LOW_WATER_RATIO)
        self.rss = rss
        self.interval = interval
        self.pressure = False
        self.episodes = 0
        self.handle: asyncio.TimerHandle | None = None
        self.trim = find_malloc_trim()
        self.last_trim = 0.0

    def start(self) -> None:
        if self.high_water > 0 and self.handle is None:
            self.handle = self.loop.call_later(self.interval, self.check)

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def delay(self, rss: int | None) -> float:
        """Seconds until the next check."""
        if self.pressure or rss is None:
            return self.interval
        headroom = (self.high_water - rss) / MAX_GROWTH_BYTES_PER_S
        return min(MAX_CHECK_INTERVAL_S, max(self.interval, headroom))

    def check(self) -> None:
        rss = self.rss()
        # Rescheduled first, so one failing check does not end them (past the mark: the
        # short pace, as headroom is negative).
        self.handle = self.loop.call_later(self.delay(rss), self.check)
        if rss is None:
            return
        if not self.pressure:
            if rss > self.high_water:
                self.pressure = True
                self.episodes += 1
                logger.warning(
                    "memory high-water mark reached (RSS %d MiB > %d MiB): not reading "
                    "publishers until RSS is below %d MiB",
                    rss >> 20,
                    self.high_water >> 20,
                    self.low_water >> 20,
                )
                self.set_pressure(True)
            return
        now = self.loop.time()
        if (
            rss >= self.low_water
            and self.trim is not None
            and now - self.last_trim >= TRIM_INTERVAL_S
        ):
            # Freed buffers stay in glibc's heap until trimmed; without it RSS may never fall.
            self.last_trim = now
            self.trim(0)
            rss = self.rss() or rss
        if rss < self.low_water:
            self.pressure = False
            resumed = self.set_pressure(False)
            logger.warning(
                "memory below the low-water mark (RSS %d MiB): reading publishers again "
                "(%s connections resumed)",
                rss >> 20,
                resumed,
            )
