"""A throwaway Linux network namespace for tests (needs root and iproute2).

    with Netns() as ns:  # loopback up, multicast on, 224.0.0.0/4 via lo (from 127.0.0.1)
        proc = ns.popen([sys.executable, "-c", "..."], stdout=subprocess.PIPE)
        ns.run(["ip", "addr"])

    with Netns() as host1, Netns() as host2:  # two "hosts" on one LAN segment
        host1.connect(host2, "10.77.0.1", "10.77.0.2")

Names are unique per test run (``fbt<pid>x<n>``). On exit every process started with
``popen`` that is still running is killed (by its pid; ``ip netns exec`` execs the command,
so the pid is the command's own) and the namespace is deleted, even when the body raised.
``Netns.unavailable()`` says why namespaces cannot be used here (for ``pytest.skip``), or
returns None.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from types import TracebackType
from typing import Any

_counter = itertools.count()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


class Netns:
    def __init__(self, prefix: str = "fbt", *, multicast: bool = True) -> None:
        self.name = f"{prefix}{os.getpid()}x{next(_counter)}"
        self.multicast = multicast
        self.processes: list[subprocess.Popen[Any]] = []
        self._created = False

    @staticmethod
    def unavailable() -> str | None:
        """Why a namespace cannot be created here, or None if it can (tries one)."""
        if shutil.which("ip") is None:
            return "iproute2's `ip` command is not installed"
        probe = f"fbtprobe{os.getpid()}"
        result = _ip("netns", "add", probe, check=False)
        if result.returncode != 0:
            return f"`ip netns add` is not permitted here: {result.stderr.strip()}"
        _ip("netns", "delete", probe, check=False)
        return None

    def create(self) -> None:
        _ip("netns", "add", self.name)
        self._created = True
        try:
            self.run(["ip", "link", "set", "lo", "up"])
            if self.multicast:
                # lo has no MULTICAST flag by default and a fresh namespace has no routes.
                # Without `src`, multicast from lo leaves with source 0.0.0.0 (127.0.0.1 is
                # host-scoped), and receivers could not tell where it came from.
                self.run(["ip", "link", "set", "lo", "multicast", "on"])
                self.run(["ip", "route", "add", "224.0.0.0/4", "dev", "lo", "src", "127.0.0.1"])
        except BaseException:
            self.delete()
            raise

    def connect(self, other: Netns, address: str, other_address: str, *, prefix: int = 24) -> None:
        """A veth cable between two namespaces, as between two hosts on one LAN segment.

        Gives this end ``address``/prefix and the other ``other_address``/prefix (both
        called ``lan0``), and routes multicast over the cable in both, replacing the
        loopback route: then nodes on one "host" see each other only by IP_MULTICAST_LOOP.
        """
        _ip("-n", self.name, "link", "add", "lan0", "type", "veth", "peer", "name", "lan0",
            "netns", other.name)  # fmt: skip
        for ns, cidr in ((self, f"{address}/{prefix}"), (other, f"{other_address}/{prefix}")):
            ns.run(["ip", "addr", "add", cidr, "dev", "lan0"])
            ns.run(["ip", "link", "set", "lan0", "up"])
            ns.run(["ip", "route", "replace", "224.0.0.0/4", "dev", "lan0"])

    def delete(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        self.processes.clear()
        if self._created:
            _ip("netns", "delete", self.name, check=False)
            self._created = False

    def command(self, argv: list[str]) -> list[str]:
        """argv wrapped to run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def popen(self, argv: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self.processes.append(proc)
        return proc

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        kwargs.setdefault("capture_output", True)
        kwargs.setdefault("text", True)
        kwargs.setdefault("timeout", 10)
        kwargs.setdefault("check", True)
        return subprocess.run(self.command(argv), **kwargs)

    def __enter__(self) -> Netns:
        self.create()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.delete()
