"""The network a fault-injection run splits: one Linux network namespace per node, each with
a veth cable to a bridge in a "switch" namespace, as hosts on one LAN. Everything is created
by the run and deleted by it; the host's own interfaces and firewall are never touched.

    10.S.0.1 (n1) ─┐
    10.S.0.2 (n2) ─┼─ br0 in the switch namespace (10.S.0.254: HAProxy lives there)
    10.S.0.3 (n3) ─┘

A split is a set of nftables rules in each node's namespace that drop, silently, what
arrives from the nodes on the other side (as a broken link does: no reset, no error, the
packets just stop), while every node still reaches the switch, so HAProxy and the clients
behind it keep reaching both sides. Needs root, iproute2 and nftables.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterable

SWITCH_HOST = 254
_networks = itertools.count()


def run(argv: list[str], stdin: str | None = None, check: bool = True) -> str:
    result = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=10)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {result.stderr.strip() or result.returncode}")
    return result.stdout


class Network:
    """Namespaces ``<prefix>sw`` (the switch) and ``<prefix>n1``..``<prefix>nN``."""

    def __init__(self, count: int, subnet: int, prefix: str | None = None) -> None:
        self.count = count
        self.subnet = subnet
        self.prefix = prefix or f"fbc{os.getpid()}x{next(_networks)}"
        self.switch = f"{self.prefix}sw"
        self.created: list[str] = []
        self.split_sides: list[list[int]] = []

    @staticmethod
    def unavailable() -> str | None:
        """Why the network cannot be made here (for an error message or a skip), or None."""
        for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
            if shutil.which(tool) is None:
                return f"`{tool}` is not installed (Debian package {package}; /usr/sbin on PATH)"
        if os.geteuid() != 0:
            return "network namespaces need root"
        probe = f"fbcprobe{os.getpid()}"
        result = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if result.returncode != 0:
            return f"`ip netns add` is not permitted here: {result.stderr.strip()}"
        subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
        return None

    def namespace(self, index: int) -> str:
        return f"{self.prefix}n{index}"

    def ip(self, index: int) -> str:
        return f"10.{self.subnet}.0.{index}"

    @property
    def switch_ip(self) -> str:
        return self.ip(SWITCH_HOST)

    def command(self, namespace: str, argv: list[str]) -> list[str]:
        """argv run inside a namespace (``ip netns exec`` execs it: the PID is argv's own)."""
        return ["ip", "netns", "exec", namespace, *argv]

    def create(self) -> None:
        try:
            self._add(self.switch)
            run(["ip", "-n", self.switch, "link", "add", "br0", "type", "bridge"])
            run(["ip", "-n", self.switch, "addr", "add", f"{self.switch_ip}/24", "dev", "br0"])
            run(["ip", "-n", self.switch, "link", "set", "br0", "up"])
            for index in range(1, self.count + 1):
                ns, port = self.namespace(index), f"n{index}"
                self._add(ns)
                run(["ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer",
                     "name", "eth0", "netns", ns])  # fmt: skip
                run(["ip", "-n", self.switch, "link", "set", port, "master", "br0"])
                run(["ip", "-n", self.switch, "link", "set", port, "up"])
                run(["ip", "-n", ns, "addr", "add", f"{self.ip(index)}/24", "dev", "eth0"])
                run(["ip", "-n", ns, "link", "set", "eth0", "up"])
        except BaseException:
            self.delete()
            raise

    def _add(self, namespace: str) -> None:
        run(["ip", "netns", "add", namespace])
        self.created.append(namespace)
        run(["ip", "-n", namespace, "link", "set", "lo", "up"])

    def split(self, sides: Iterable[Iterable[int]]) -> None:
        """Nodes on different sides stop reaching each other (node numbers from 1); a node on
        no side keeps reaching every node. Replaces any split in place."""
        self.heal()
        self.split_sides = [sorted(side) for side in sides]
        for side in self.split_sides:
            others = [self.ip(i) for other in self.split_sides if other != side for i in other]
            if not others:
                continue
            rules = (
                "table inet fastbroker_chaos {\n"
                "  chain input {\n"
                "    type filter hook input priority 0; policy accept;\n"
                f"    ip saddr {{ {', '.join(others)} }} drop\n"
                "  }\n"
                "}\n"
            )
            for index in side:
                run(self.command(self.namespace(index), ["nft", "-f", "-"]), stdin=rules)

    def heal(self) -> None:
        for side in self.split_sides:
            for index in side:
                ns = self.namespace(index)
                run(self.command(ns, ["nft", "delete", "table", "inet", "fastbroker_chaos"]),
                    check=False)  # fmt: skip
        self.split_sides = []

    def delete(self) -> None:
        """Deletes every namespace made here (their veth cables go with them)."""
        for namespace in reversed(self.created):
            run(["ip", "netns", "delete", namespace], check=False)
        self.created.clear()
