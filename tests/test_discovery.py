"""Cluster discovery providers: static seeds, file, DNS, UDP multicast, plug-ins.

Everything runs on real sockets: the DNS tests run a small DNS server on 127.0.0.1, the
multicast test runs nodes as separate processes inside a network namespace of its own
(skipped only where `ip netns add` is not permitted). Run as a script, this file is one such
node (or the replaying attacker); see ``child_main``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from dnsserver import DnsServer
from netns import Netns

from fastbroker.cluster.discovery import (
    DEFAULT_MULTICAST_GROUP,
    DEFAULT_MULTICAST_PORT,
    Announcement,
    AnnouncementCodec,
    AnnouncementRejected,
    DnsProvider,
    FileProvider,
    LocalNode,
    MulticastProvider,
    StaticProvider,
    parse_address,
    parse_discovery,
    static_seeds,
)

pytestmark = pytest.mark.timeout(30)

LOGGER = "fastbroker.cluster.discovery"
LOCAL = LocalNode("me", "alpha", ("127.0.0.1", 7000))
SRC = str(Path(__file__).resolve().parent.parent / "src")


def run_async(main: Coroutine[Any, Any, None], loop_kind: str = "asyncio") -> None:
    if loop_kind == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main)
    else:
        asyncio.run(main)


def warnings_from(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelname == "WARNING"]


# --------------------------------------------------------------------------- static


def test_static_seeds_parse_hosts_ports_and_ipv6() -> None:
    provider = static_seeds(
        "a.example:7001, 10.0.0.2:7002,[::1]:7003,[FE80:0::1],Host-B,10.0.0.2:7002", 7000
    )
    assert provider.addresses == (
        ("a.example", 7001),
        ("10.0.0.2", 7002),
        ("::1", 7003),
        ("fe80::1", 7000),
        ("host-b", 7000),
    )
    same: Any = parse_discovery("static:[::1]:7003,h", default_port=9, secret=b"s")
    assert same.addresses == (("::1", 7003), ("h", 9))


def test_static_peers_exclude_own_address_in_any_spelling() -> None:
    provider = static_seeds("127.0.0.1:7000,[::1]:7000,127.0.0.1:7001", 7000)

    async def main() -> None:
        await provider.start(LocalNode("me", "alpha", ("0:0::1", 7000)))
        assert await provider.peers() == {("127.0.0.1", 7000), ("127.0.0.1", 7001)}
        await provider.stop()

    run_async(main())


@pytest.mark.parametrize(
    ("seeds", "message"),
    [
        ("", "no seed addresses"),
        ("a:1,,b:2", "empty entry"),
        ("a:0", "port must be a number from 1 to 65535"),
        ("a:65536", "port must be a number from 1 to 65535"),
        ("a:x", "port must be a number"),
        ("a:", "port must be a number"),
        ("a: 1", "port must be a number"),
        ("::1:7000", "IPv6 addresses in brackets"),
        ("[::1:7000", "missing ']'"),
        ("[10.0.0.1]:7000", "not an IPv6 address"),
        ("[::1]7000", "expected ':PORT'"),
        ("bad host:1", "not a host name"),
        ("-bad:1", "not a host name"),
        ("300.1.1.1:1", "not an IPv4 address"),
    ],
)
def test_static_seeds_reject_bad_lists_with_one_line(seeds: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^[^\n]*$") as info:
        static_seeds(seeds, 7000)
    assert message in str(info.value)


def test_parse_address_default_port() -> None:
    assert parse_address(" node-1.example. ", 7000) == ("node-1.example", 7000)
    assert parse_address("[::ffff:10.0.0.1]:1", 7000) == ("::ffff:a00:1", 1)


# --------------------------------------------------------------------------- specs


def test_parse_discovery_kinds(tmp_path: Path) -> None:
    def parse(spec: str) -> Any:
        return parse_discovery(spec, default_port=7000, secret=b"secret")

    assert isinstance(parse("static:a:1"), StaticProvider)
    file = parse(f"file:{tmp_path}/peers:v2.txt")  # everything after "file:" is the path
    assert isinstance(file, FileProvider) and file.path == f"{tmp_path}/peers:v2.txt"
    dns_ = parse("dns:cluster.test@127.0.0.1:5353")
    assert isinstance(dns_, DnsProvider) and dns_.nameserver == ("127.0.0.1", 5353)
    assert dns_.srv_name.to_text() == "_fastbroker._tcp.cluster.test."
    assert parse("dns:_cluster._tcp.svc.local").srv_name.to_text() == "_cluster._tcp.svc.local."
    assert parse("dns:cluster.test@[::1]").nameserver == ("::1", 53)
    assert parse("dns:cluster.test").nameserver is None
    multicast = parse("multicast")
    assert isinstance(multicast, MulticastProvider)
    assert (multicast.group, multicast.port, multicast.interface) == (
        DEFAULT_MULTICAST_GROUP,
        DEFAULT_MULTICAST_PORT,
        None,
    )
    multicast = parse("multicast:239.1.2.3:9000@127.0.0.1")
    assert (multicast.group, multicast.port, multicast.interface) == (
        "239.1.2.3",
        9000,
        "127.0.0.1",
    )
    assert parse("multicast:239.1.2.3").port == DEFAULT_MULTICAST_PORT
    assert parse("multicast@10.0.0.5").interface == "10.0.0.5"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "unknown kind"),
        ("bogus:x", "unknown kind"),
        ("static", "unknown kind"),
        ("static:", "no seed addresses"),
        ("file:", "expected file:PATH"),
        ("dns:", "expected dns:NAME"),
        ("dns:cluster.test@ns.example", "nameserver must be an IP address"),
        ("dns:cluster.test@127.0.0.1:0", "port must be"),
        ("dns:bad..name", "not a DNS name"),
        ("multicast:10.0.0.1", "not an IPv4 multicast address"),
        ("multicast:[ff02::1]:7000", "IPv6 multicast is not supported"),
        ("multicast:239.1.1.1:0", "port must be"),
        ("multicast:239.1.1.1:x", "port must be"),
        ("multicast:239.1.1.1@", "expected an interface address"),
        ("multicast@eth0", "not an IPv4 address"),
        ("multicastx", "unknown kind"),
        ("python:no_such_module_xyz:make", "cannot import no_such_module_xyz"),
        ("python:os", "expected python:package.module:factory"),
        ("python:os:no_such_factory", "has no callable 'no_such_factory'"),
        ("python:os.path:basename", "lacks start, peers, stop"),
        ("python:json:loads:{", "loads('{') failed: JSONDecodeError"),
    ],
)
def test_parse_discovery_rejects_bad_specs_with_one_line(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=r"^--discovery [^\n]*$") as info:
        parse_discovery(spec, default_port=7000, secret=b"secret")
    assert message in str(info.value)


def test_multicast_needs_a_secret() -> None:
    with pytest.raises(ValueError, match="shared secret"):
        parse_discovery("multicast", default_port=7000, secret=b"")


# --------------------------------------------------------------------------- plug-ins


def test_python_plugin_gets_its_argument_and_is_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "fbt_plugins"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "listing.py").write_text(
        textwrap.dedent(
            """
            class ListingProvider:
                def __init__(self, arg):
                    self.addresses = {(h, int(p)) for h, p in (x.split("/") for x in arg.split())}
                    self.started = self.stopped = None

                async def start(self, local):
                    self.started = local

                async def peers(self):
                    return self.addresses - {self.started.address}

                async def stop(self):
                    self.stopped = True

            def make(arg):
                return ListingProvider(arg)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = "python:fbt_plugins.listing:make:10.0.0.1/7001 127.0.0.1/7000 10.0.0.3/7003"
    provider: Any = parse_discovery(spec, default_port=7000, secret=b"s")

    async def main() -> None:
        await provider.start(LOCAL)
        assert await provider.peers() == {("10.0.0.1", 7001), ("10.0.0.3", 7003)}
        await provider.stop()

    run_async(main())
    assert provider.started == LOCAL and provider.stopped is True
    without_arg: Any = parse_discovery(
        "python:fbt_plugins.listing:make", default_port=1, secret=b""
    )
    assert without_arg.addresses == set()


# --------------------------------------------------------------------------- file


def test_file_follows_edits_and_survives_bad_lines_and_a_missing_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    path = tmp_path / "peers.txt"
    provider = parse_discovery(f"file:{path}", default_port=7000, secret=b"")

    async def main() -> None:
        await provider.start(LOCAL)  # the file does not exist yet
        assert await provider.peers() == set()
        assert await provider.peers() == set()
        assert len(warnings_from(caplog)) == 1 and str(path) in warnings_from(caplog)[0]

        path.write_text(
            "# cluster seeds\n"
            "10.0.0.1:7001\n"
            "\n"
            "  10.0.0.2   # default port\n"
            "[::1]:7003\n"
            "127.0.0.1:7000\n"  # this node itself
            "10.0.0.9:notaport\n"
            "node-5.example:7005\n"
        )
        caplog.clear()
        expected = {("10.0.0.1", 7001), ("10.0.0.2", 7000), ("::1", 7003), ("node-5.example", 7005)}
        assert await provider.peers() == expected
        assert await provider.peers() == expected
        bad_line = warnings_from(caplog)
        assert len(bad_line) == 1 and f"{path}:7:" in bad_line[0], bad_line

        with path.open("a") as f:  # a node added at runtime
            f.write("10.0.0.6:7006\n")
        assert await provider.peers() == expected | {("10.0.0.6", 7006)}

        # A node removed, rewritten in place with the same size: the mtime is no help here.
        text = path.read_text()
        path.write_text(text.replace("10.0.0.1:7001", "10.0.0.1:7009"))
        expected = (expected - {("10.0.0.1", 7001)}) | {("10.0.0.1", 7009), ("10.0.0.6", 7006)}
        assert await provider.peers() == expected

        caplog.clear()
        path.unlink()  # gone: keep the last good list, warn once
        for _ in range(3):
            assert await provider.peers() == expected
        assert len(warnings_from(caplog)) == 1

        path.write_text("10.0.0.7:7007\n")
        assert await provider.peers() == {("10.0.0.7", 7007)}
        await provider.stop()

    run_async(main())


# --------------------------------------------------------------------------- DNS


SRV = "_fastbroker._tcp.cluster.test."


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_dns_follows_records_and_keeps_last_good_answer_when_the_server_fails(
    loop_kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, LOGGER)

    async def main() -> None:
        server = DnsServer()
        port = await server.start()
        server.set(SRV, "SRV", "0 0 7001 n1.cluster.test.", "0 0 7002 n2.cluster.test.")
        server.set(SRV, "SRV", *server.records[(SRV, "SRV")], "10 5 7003 n3.cluster.test.")
        server.set("n1.cluster.test.", "A", "127.0.0.11")
        server.set("n2.cluster.test.", "A", "127.0.0.12")
        server.set("n2.cluster.test.", "AAAA", "::12")
        server.set("n3.cluster.test.", "A", "127.0.0.13")
        provider = parse_discovery(
            f"dns:cluster.test@127.0.0.1:{port}", default_port=7000, secret=b""
        )
        await provider.start(LocalNode("n1", "alpha", ("127.0.0.11", 7001)))

        # SRV targets resolved to their addresses, own address left out.
        assert await provider.peers() == {
            ("127.0.0.12", 7002),
            ("::12", 7002),
            ("127.0.0.13", 7003),
        }
        assert (SRV, "SRV") in server.queries and ("n3.cluster.test.", "AAAA") in server.queries

        # A node removed and one added at runtime.
        server.set(SRV, "SRV", "0 0 7001 n1.cluster.test.", "0 0 7004 n4.cluster.test.")
        server.set("n4.cluster.test.", "AAAA", "fd00::4")
        assert await provider.peers() == {("fd00::4", 7004)}

        # Glue in the additional section is used without asking for the targets.
        server.glue = True
        server.set("n4.cluster.test.", "AAAA", "fd00::44")
        server.queries.clear()
        assert await provider.peers() == {("fd00::44", 7004)}
        assert server.queries == [(SRV, "SRV")]
        server.glue = False

        # A target without addresses is skipped with a warning, the others are kept.
        server.set(SRV, "SRV", "0 0 7004 n4.cluster.test.", "0 0 7005 n5.cluster.test.")
        caplog.clear()
        assert await provider.peers() == {("fd00::44", 7004)}
        assert any("n5.cluster.test" in w for w in warnings_from(caplog))

        # No SRV records: A/AAAA of the name itself with the default port.
        server.set(SRV, "SRV")
        server.set("cluster.test.", "A", "127.0.0.21", "127.0.0.22")
        assert await provider.peers() == {("127.0.0.21", 7000), ("127.0.0.22", 7000)}

        # The name is gone (NXDOMAIN): an authoritative empty answer, not a failure.
        server.records.clear()
        assert await provider.peers() == set()
        server.set("cluster.test.", "AAAA", "::1", "::2")
        good = {("::1", 7000), ("::2", 7000)}
        assert await provider.peers() == good

        # SERVFAIL, then the server down: the last good answer, within the 1 s timeout.
        caplog.clear()
        server.servfail = True
        assert await provider.peers() == good
        server.stop()
        for _ in range(2):
            started = time.monotonic()
            assert await provider.peers() == good
            assert time.monotonic() - started < 2.5
        assert len(warnings_from(caplog)) == 2  # one per distinct problem, not per poll

        # Back on the same port with new records: followed again.
        server = DnsServer()
        await server.start(port)
        server.set("cluster.test.", "A", "127.0.0.31")
        assert await provider.peers() == {("127.0.0.31", 7000)}
        await provider.stop()
        server.stop()

    run_async(main(), loop_kind)


# --------------------------------------------------------------------------- announcements


def test_announcement_codec_accepts_genuine_and_rejects_the_rest() -> None:
    secret = b"cluster secret"
    sender = AnnouncementCodec(secret, "alpha")
    receiver = AnnouncementCodec(secret, "alpha", replay_window=30.0)
    now = 1_000_000.0

    datagram = sender.encode("n1", ("10.0.0.1", 7001), now=now)
    assert receiver.decode(datagram, "10.9.9.9", now=now + 1) == Announcement(
        "n1", ("10.0.0.1", 7001)
    )
    wildcard = sender.encode("n2", ("0.0.0.0", 7002), now=now)
    assert receiver.decode(wildcard, "10.0.0.2", now=now).address == ("10.0.0.2", 7002)
    with pytest.raises(AnnouncementRejected, match="no_address"):
        receiver.decode(sender.encode("n2", ("0.0.0.0", 7002), now=now), "0.0.0.0", now=now)

    def reason(data: bytes, at: float = now) -> str:
        with pytest.raises(AnnouncementRejected) as info:
            receiver.decode(data, "10.9.9.9", now=at)
        return info.value.reason

    assert reason(datagram) == "replay"
    assert reason(b"hello") == "malformed"
    assert reason(b"FBD1" + b"x" * 40) == "bad_mac"
    tampered = bytearray(sender.encode("n1", ("10.0.0.1", 7001), now=now))
    tampered[tampered.index(b"7001")] = ord("8")  # redirect the node to another port
    assert reason(bytes(tampered)) == "bad_mac"
    stranger = AnnouncementCodec(b"other secret", "alpha")
    assert reason(stranger.encode("x", ("10.0.0.7", 7007), now=now)) == "bad_mac"
    other_cluster = AnnouncementCodec(secret, "beta")
    assert reason(other_cluster.encode("y", ("10.0.0.8", 7008), now=now)) == "other_cluster"
    assert reason(sender.encode("n1", ("10.0.0.1", 7001), now=now - 31)) == "stale"
    assert reason(sender.encode("n1", ("10.0.0.1", 7001), now=now + 31)) == "stale"
    # An old datagram replayed after the window is stale, whether or not its nonce is known.
    assert reason(datagram, at=now + 60) == "stale"


# --------------------------------------------------------------------------- multicast


MCAST_GROUP = "239.255.77.77"
MCAST_PORT = 7947
INTERVAL = 0.2


async def _node(args: argparse.Namespace) -> None:
    host, _, port = args.address.rpartition(":")
    provider = MulticastProvider(args.secret.encode(), MCAST_GROUP, MCAST_PORT, interval=INTERVAL)
    await provider.start(LocalNode(args.node_id, args.cluster, (host, int(port))))
    try:
        while True:
            peers = sorted(f"{h}:{p}" for h, p in await provider.peers())
            status = {"peers": peers, "rejected": dict(provider.rejected)}
            print(json.dumps(status), flush=True)
            await asyncio.sleep(INTERVAL)
    finally:
        await provider.stop()


def _replayer(args: argparse.Namespace) -> None:
    """An attacker without the secret: records one node's announcements, replays them later."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((MCAST_GROUP, MCAST_PORT))
    membership = struct.pack("4s4s", socket.inet_aton(MCAST_GROUP), socket.inet_aton("0.0.0.0"))
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
    sock.settimeout(0.05)
    captured: list[bytes] = []
    go = threading.Event()

    def wait_for_go() -> None:
        sys.stdin.readline()
        go.set()

    threading.Thread(target=wait_for_go, daemon=True).start()
    replayed = 0
    while True:
        if go.is_set():
            for datagram in captured:
                sock.sendto(datagram, (MCAST_GROUP, MCAST_PORT))
                replayed += 1
            print(json.dumps({"captured": len(captured), "replayed": replayed}), flush=True)
            time.sleep(0.05)
            continue
        try:
            datagram = sock.recv(2048)
        except TimeoutError:
            continue
        if f'"n":"{args.replay}"'.encode() in datagram:  # the body is readable, just not forgeable
            captured = [*captured[-9:], datagram]
            print(json.dumps({"captured": len(captured), "replayed": 0}), flush=True)


def child_main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--node-id")
    parser.add_argument("--cluster", default="alpha")
    parser.add_argument("--secret", default="s3cret")
    parser.add_argument("--address")
    parser.add_argument("--uvloop", action="store_true")
    parser.add_argument("--replay", help="act as the replaying attacker of this node id")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if args.replay:
        _replayer(args)
    elif args.uvloop:
        import uvloop

        uvloop.run(_node(args))
    else:
        asyncio.run(_node(args))


class Children:
    """Processes in a namespace whose JSON status lines are collected by reader threads."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.lines: queue.Queue[tuple[str, subprocess.Popen[str], dict[str, Any]]] = queue.Queue()
        self.latest: dict[str, dict[str, Any]] = {}
        self.ever_seen: dict[str, set[str]] = {}

    def start(self, ns: Netns, name: str, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
        stderr = (self.logs / f"{name}.stderr").open("w")
        proc = ns.popen(
            [sys.executable, "-u", __file__, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
        )
        stderr.close()
        self.procs[name] = proc
        self.latest.pop(name, None)
        self.ever_seen[name] = set()

        def read() -> None:
            try:
                for line in proc.stdout:  # type: ignore[union-attr]
                    self.lines.put((name, proc, json.loads(line)))
            except (ValueError, OSError):  # the namespace teardown closed the pipe
                pass

        threading.Thread(target=read, daemon=True).start()

    def peers(self, name: str) -> set[str] | None:
        status = self.latest.get(name)
        return None if status is None else set(status.get("peers", ()))

    def wait_for(self, what: str, condition: Callable[[], bool], timeout: float) -> float:
        started = time.monotonic()
        deadline = started + timeout
        while not condition():
            try:
                item = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"timed out waiting for {what}: {self.report()}") from None
            self._take(*item)
        return time.monotonic() - started

    def drain(self, seconds: float) -> None:
        """Take every status line arriving in the next `seconds`."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self._take(*self.lines.get(timeout=left))
            except queue.Empty:
                return

    def _take(self, name: str, proc: subprocess.Popen[str], status: dict[str, Any]) -> None:
        if proc is self.procs[name]:  # not a leftover line of a replaced process
            self.latest[name] = status
            self.ever_seen[name].update(status.get("peers", ()))

    def report(self) -> str:
        stderr = {p.stem: p.read_text()[-800:] for p in self.logs.glob("*.stderr")}
        return f"latest={self.latest} stderr={ {k: v for k, v in stderr.items() if v} }"


@pytest.fixture
def lan() -> Iterator[tuple[Netns, Netns]]:
    """Two "hosts" (network namespaces) on one LAN segment (a veth cable)."""
    reason = Netns.unavailable()
    if reason:
        pytest.skip(f"multicast test needs network namespaces: {reason}")
    with Netns() as host1, Netns() as host2:
        host1.connect(host2, "10.77.0.1", "10.77.0.2")
        yield host1, host2


def test_multicast_nodes_find_each_other_ignore_strangers_and_expire(
    lan: tuple[Netns, Netns], tmp_path: Path
) -> None:
    host1, host2 = lan
    children = Children(tmp_path)
    # a and b share host1 (they see each other only through IP_MULTICAST_LOOP); c is on
    # host2 and listens on every interface: the others see it at its source address.
    a, b, c = "10.77.0.1:7101", "10.77.0.1:7102", "10.77.0.2:7103"
    children.start(host1, "a", "--node-id", "a", "--address", a, "--uvloop")
    children.start(host1, "b", "--node-id", "b", "--address", b)
    children.start(host2, "c", "--node-id", "c", "--address", "0.0.0.0:7103")
    children.start(host2, "x", "--node-id", "x", "--address", "10.77.0.2:7104", "--secret", "bad")
    children.start(host2, "y", "--node-id", "y", "--address", "10.77.0.2:7105", "--cluster", "beta")
    children.start(host2, "replayer", "--replay", "b")

    took = children.wait_for(
        "a, b and c to see each other",
        lambda: (
            children.peers("a") == {b, c}
            and children.peers("b") == {a, c}
            and children.peers("c") == {a, b}
            and children.latest.get("replayer", {}).get("captured", 0) >= 3
        ),
        timeout=10,
    )
    print(f"three nodes discovered each other {took:.2f} s after their processes started")
    children.drain(5 * INTERVAL)  # several more rounds of the strangers' announcements
    children.wait_for(
        "a, b and c to count the strangers' rejected announcements",
        lambda: all(
            children.latest[n]["rejected"].get("bad_mac", 0) >= 3
            and children.latest[n]["rejected"].get("other_cluster", 0) >= 3
            for n in ("a", "b", "c")
        ),
        timeout=3,
    )
    for name in ("a", "b", "c"):
        assert children.ever_seen[name] <= {a, b, c}, (name, children.ever_seen[name])
    assert children.ever_seen["x"] == set() and children.ever_seen["y"] == set()
    assert children.latest["x"]["rejected"].get("bad_mac", 0) >= 3  # it hears us, cannot verify
    assert children.latest["y"]["rejected"].get("other_cluster", 0) >= 3

    # b dies without a word while the attacker replays its recorded announcements.
    children.procs["b"].kill()
    children.procs["b"].wait(timeout=5)
    assert children.procs["replayer"].stdin is not None
    children.procs["replayer"].stdin.write("go\n")
    children.procs["replayer"].stdin.flush()
    took = children.wait_for(
        "b to expire at a and c",
        lambda: children.peers("a") == {c} and children.peers("c") == {a},
        timeout=5,
    )
    print(f"a killed node expired after {took:.2f} s (expiry {3.5 * INTERVAL:.2f} s)")
    assert took < 3.0
    children.wait_for(
        "replays to be rejected",
        lambda: (
            children.latest["replayer"]["replayed"] >= 20
            and children.latest["a"]["rejected"].get("replay", 0) >= 10
            and children.latest["c"]["rejected"].get("replay", 0) >= 10
        ),
        timeout=3,
    )
    children.drain(3 * INTERVAL)  # replays keep coming; b must stay gone
    assert children.peers("a") == {c} and children.peers("c") == {a}

    # b comes back (a node added at runtime): found again despite the replay defences.
    children.start(host1, "b", "--node-id", "b", "--address", b)
    children.wait_for(
        "b to be found again",
        lambda: (
            children.peers("a") == {b, c}
            and children.peers("c") == {a, b}
            and children.peers("b") == {a, c}
        ),
        timeout=5,
    )


if __name__ == "__main__":
    child_main(sys.argv[1:])
