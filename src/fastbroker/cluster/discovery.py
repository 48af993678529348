"""Cluster discovery: where might the other nodes' cluster ports be?

Discovery only finds candidate ADDRESSES. Whether an address belongs to a node of this
cluster is checked by the transport handshake (cluster name + shared secret), and consensus
decides membership. The node polls its provider every interval (1 s by default), so nodes
can be added or removed at runtime without reconfiguring the others.

Specs (``fastbroker run --join ...`` / ``--discovery SPEC``), see :func:`parse_discovery`:

``static:HOST:PORT,...``
    A fixed seed list, the same as ``--join``. IPv6 hosts in brackets: ``[::1]:7000``.
    A missing port means the default cluster port.
``file:PATH``
    A text file, one ``host:port`` (or ``host``) per line, ``#`` starts a comment. Re-read
    on every poll. A missing or unreadable file logs one warning and keeps the last good
    list; a bad line logs a warning naming ``PATH:LINE`` and the other lines are used.
``dns:NAME`` or ``dns:NAME@SERVER[:PORT]``
    SRV records of ``_fastbroker._tcp.NAME`` first (targets resolved to A/AAAA, ports from
    the SRV records); if that name has no SRV records, the A/AAAA records of ``NAME`` with
    the default cluster port. A NAME whose first label starts with ``_`` is taken as the
    full SRV name (e.g. a Kubernetes headless service's
    ``_cluster._tcp.fastbroker.ns.svc.cluster.local``). ``@SERVER`` asks that nameserver (an
    IP address, port 53 by default) instead of the system resolver. Each query gives up
    after 1 s; a failed poll keeps the last good answer.
``multicast`` or ``multicast:GROUP[:PORT][@IFACE_ADDRESS]``
    UDP multicast on a LAN (default group 239.255.77.77, port 7947; not 7946, which
    memberlist/Serf/Docker Swarm use). Every node announces itself every interval and
    listens; announcements carry an HMAC-SHA256 made with the cluster's shared secret, so
    strangers and other clusters on the LAN are ignored, and a timestamp + nonce, so a
    recorded announcement cannot be replayed (nodes' clocks must agree within 30 s). A node
    drops out 3.5 intervals after its last announcement. A node whose cluster address has
    an unspecified host (``0.0.0.0``) is reported at the announcement's source address.
    IPv4 only; TTL 1 (the local network segment).
``python:package.module:factory[:ARG]``
    A user plug-in: imports ``package.module`` and calls ``factory(ARG)`` (``ARG`` is the
    text after the third colon, ``""`` if none); the result is the provider.

Writing your own provider
-------------------------
A provider is any object with these three coroutine methods (:class:`DiscoveryProvider`):

``async start(local: LocalNode) -> None``
    Called once before the first poll, with this node's id, cluster name and own cluster
    address. Open sockets or clients here. Raise only for permanent configuration errors
    (the node refuses to start).
``async peers() -> set[tuple[str, int]]``
    Called every poll interval. Return the current candidate ``(host, port)`` addresses of
    other nodes' cluster ports, own address excluded. Must not raise for transient
    failures: log and return the last good answer. Should return within about a second.
``async stop() -> None``
    Called once at shutdown; release everything ``start`` opened.

Example, ``mycompany/consul_discovery.py``::

    import logging
    from fastbroker.cluster.discovery import LocalNode

    class ConsulProvider:
        def __init__(self, service: str) -> None:
            self.service = service
            self.last: set[tuple[str, int]] = set()

        async def start(self, local: LocalNode) -> None:
            self.local = local

        async def peers(self) -> set[tuple[str, int]]:
            try:
                found = await ask_consul(self.service)  # your client code
            except Exception as exc:
                logging.getLogger(__name__).warning("consul: %s", exc)
                return self.last
            self.last = found - {self.local.address}
            return self.last

        async def stop(self) -> None:
            pass

    def make(arg: str) -> ConsulProvider:
        return ConsulProvider(arg or "fastbroker")

and ``fastbroker run ... --discovery python:mycompany.consul_discovery:make:broker-prod``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import importlib
import ipaddress
import json
import logging
import os
import re
import secrets
import socket
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import dns.asyncresolver
import dns.exception
import dns.name
import dns.nameserver
import dns.rdatatype
import dns.resolver

__all__ = [
    "DEFAULT_MULTICAST_GROUP",
    "DEFAULT_MULTICAST_PORT",
    "Address",
    "Announcement",
    "AnnouncementCodec",
    "AnnouncementRejected",
    "DiscoveryProvider",
    "DnsProvider",
    "FileProvider",
    "LocalNode",
    "MulticastProvider",
    "StaticProvider",
    "load_plugin",
    "parse_address",
    "parse_discovery",
    "static_seeds",
]

log = logging.getLogger(__name__)

Address = tuple[str, int]

DEFAULT_MULTICAST_GROUP = "239.255.77.77"  # IPv4 organisation-local scope (RFC 2365)
DEFAULT_MULTICAST_PORT = 7947
DNS_SRV_PREFIX = "_fastbroker._tcp"
DNS_TIMEOUT = 1.0  # seconds per poll stage; a poll must not hold up the node's loop
REPLAY_WINDOW = 30.0  # seconds of tolerated clock difference between nodes


@dataclass(frozen=True)
class LocalNode:
    """This node, as a provider sees it."""

    node_id: str
    cluster_name: str
    address: Address  # own cluster address (host, port)


@runtime_checkable
class DiscoveryProvider(Protocol):
    """See the module docstring for the contract."""

    async def start(self, local: LocalNode) -> None: ...

    async def peers(self) -> set[Address]: ...

    async def stop(self) -> None: ...


# --------------------------------------------------------------------------- addresses

_HOST_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOSTNAME = re.compile(rf"{_HOST_LABEL}(?:\.{_HOST_LABEL})*\.?")


def _parse_port(text: str, whole: str) -> int:
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= 65535:
        raise ValueError(f"{whole!r}: port must be a number from 1 to 65535")
    return int(text)


def _normalize_host(host: str) -> str:
    """One spelling per host, so that the own address and duplicates compare equal."""
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host.lower().rstrip(".")


def _normalize(address: Address) -> Address:
    return (_normalize_host(address[0]), address[1])


def parse_address(text: str, default_port: int) -> Address:
    """``host``, ``host:port``, ``[ipv6]`` or ``[ipv6]:port`` -> normalized (host, port)."""
    whole = text
    text = text.strip()
    if not text:
        raise ValueError("empty address")
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError(f"{whole!r}: missing ']' after the IPv6 address")
        host, rest = text[1:end], text[end + 1 :]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"{whole!r}: {host!r} in brackets is not an IPv6 address") from None
        if not rest:
            port = default_port
        elif rest.startswith(":"):
            port = _parse_port(rest[1:], whole)
        else:
            raise ValueError(f"{whole!r}: expected ':PORT' after ']'")
    elif text.count(":") > 1:
        raise ValueError(f"{whole!r}: write IPv6 addresses in brackets, e.g. [::1]:7000")
    else:
        host, sep, port_text = text.partition(":")
        port = _parse_port(port_text, whole) if sep else default_port
        if not _HOSTNAME.fullmatch(host) or len(host) > 253:
            raise ValueError(f"{whole!r}: {host!r} is not a host name or IP address")
        if re.fullmatch(r"[0-9.]+", host):
            try:
                ipaddress.IPv4Address(host)
            except ValueError:
                raise ValueError(f"{whole!r}: {host!r} is not an IPv4 address") from None
    return (_normalize_host(host), port)


def _check_default_port(default_port: int) -> None:
    if not 1 <= default_port <= 65535:
        raise ValueError(f"default port {default_port} is not from 1 to 65535")


class _OnceWarner:
    """Logs a problem when it first appears or changes, not on every poll."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._problem: str | None = None

    def problem(self, message: str, kind: str | None = None) -> None:
        """`kind` groups messages that differ only in detail (e.g. elapsed times)."""
        kind = message if kind is None else kind
        if kind != self._problem:
            log.warning("%s: %s; keeping the last good list", self._what, message)
            self._problem = kind

    def ok(self) -> None:
        if self._problem is not None:
            log.info("%s: working again", self._what)
            self._problem = None


# --------------------------------------------------------------------------- static


class StaticProvider:
    """A fixed list of seed addresses."""

    def __init__(self, addresses: Iterable[Address]) -> None:
        self.addresses: tuple[Address, ...] = tuple(dict.fromkeys(map(_normalize, addresses)))
        self._own: Address | None = None

    async def start(self, local: LocalNode) -> None:
        self._own = _normalize(local.address)

    async def peers(self) -> set[Address]:
        return {a for a in self.addresses if a != self._own}

    async def stop(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"StaticProvider({list(self.addresses)!r})"


def static_seeds(seeds: str, default_port: int) -> StaticProvider:
    """``"host:port,host:port"`` (IPv6 as ``[::1]:port``) -> StaticProvider."""
    _check_default_port(default_port)
    items = seeds.split(",")
    if not seeds.strip():
        raise ValueError("no seed addresses given")
    addresses = []
    for item in items:
        if not item.strip():
            raise ValueError(f"{seeds!r}: empty entry in the seed list")
        addresses.append(parse_address(item, default_port))
    return StaticProvider(addresses)


# --------------------------------------------------------------------------- file


class FileProvider:
    """Addresses listed in a text file, re-read whenever it changes."""

    def __init__(self, path: str | os.PathLike[str], default_port: int) -> None:
        _check_default_port(default_port)
        self.path = os.fspath(path)
        self.default_port = default_port
        self._own: Address | None = None
        self._last: set[Address] = set()
        self._text: str | None = None
        self._warner = _OnceWarner(f"discovery file {self.path}")

    async def start(self, local: LocalNode) -> None:
        self._own = _normalize(local.address)
        self._refresh()

    async def peers(self) -> set[Address]:
        self._refresh()
        return {a for a in self._last if a != self._own}

    async def stop(self) -> None:
        pass

    def _refresh(self) -> None:
        # Re-read on every poll rather than trusting the mtime: coarse timestamps can miss
        # two same-size edits within one tick, and a small local file costs microseconds.
        try:
            with open(self.path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as exc:
            self._warner.problem(exc.strerror or str(exc))
            return
        self._warner.ok()
        if text != self._text:  # parse (and warn about bad lines) once per version
            self._text = text
            self._last = self._parse(text)

    def _parse(self, text: str) -> set[Address]:
        found: set[Address] = set()
        for lineno, line in enumerate(text.splitlines(), 1):
            entry = line.split("#", 1)[0].strip()
            if not entry:
                continue
            try:
                found.add(parse_address(entry, self.default_port))
            except ValueError as exc:
                log.warning("%s:%d: %s; line ignored", self.path, lineno, exc)
        return found

    def __repr__(self) -> str:
        return f"FileProvider({self.path!r})"


# --------------------------------------------------------------------------- DNS


class DnsProvider:
    """SRV records (else A/AAAA with the default port) of a DNS name."""

    def __init__(
        self,
        name: str,
        default_port: int,
        nameserver: Address | None = None,
        timeout: float = DNS_TIMEOUT,
    ) -> None:
        _check_default_port(default_port)
        try:
            self.name = dns.name.from_text(name)
        except dns.exception.DNSException as exc:
            raise ValueError(f"{name!r} is not a DNS name: {exc}") from None
        first = self.name.labels[0] if self.name.labels else b""
        self.srv_name = (
            self.name if first.startswith(b"_") else dns.name.from_text(f"{DNS_SRV_PREFIX}.{name}")
        )
        self.default_port = default_port
        self.nameserver = nameserver
        self.timeout = timeout
        self._resolver: dns.asyncresolver.Resolver | None = None
        self._own: Address | None = None
        self._last: set[Address] = set()
        self._warner = _OnceWarner(f"discovery dns:{name}")
        self._unresolvable: set[dns.name.Name] = set()

    async def start(self, local: LocalNode) -> None:
        self._own = _normalize(local.address)

    async def peers(self) -> set[Address]:
        try:
            found = await self._lookup()
        except (dns.exception.DNSException, OSError) as exc:
            self._warner.problem(str(exc) or type(exc).__name__, type(exc).__name__)
        except Exception as exc:  # a provider must not take the node's poll loop down
            self._warner.problem(f"unexpected {type(exc).__name__}: {exc}", type(exc).__name__)
        else:
            self._warner.ok()
            self._last = found
        return {a for a in self._last if a != self._own}

    async def stop(self) -> None:
        self._resolver = None

    def _get_resolver(self) -> dns.asyncresolver.Resolver:
        if self._resolver is None:
            if self.nameserver is None:
                resolver = dns.asyncresolver.Resolver()  # /etc/resolv.conf
            else:
                resolver = dns.asyncresolver.Resolver(configure=False)
                host, port = self.nameserver
                resolver.nameservers = [dns.nameserver.Do53Nameserver(host, port)]
            resolver.timeout = self.timeout
            resolver.lifetime = self.timeout
            resolver.cache = None  # records change at runtime; every poll asks again
            self._resolver = resolver
        return self._resolver

    async def _query(self, qname: dns.name.Name, rdtype: str) -> dns.resolver.Answer | None:
        """The answer, or None when the name or record type authoritatively does not exist."""
        try:
            answer = await self._get_resolver().resolve(
                qname, rdtype, raise_on_no_answer=False, lifetime=self.timeout
            )
        except dns.resolver.NXDOMAIN:
            return None
        return answer if answer.rrset is not None else None

    async def _lookup(self) -> set[Address]:
        srv = await self._query(self.srv_name, "SRV")
        if srv is None:
            return await self._host_addresses(self.name, self.default_port)
        assert srv.rrset is not None
        glue: dict[dns.name.Name, set[str]] = {}
        for rrset in srv.response.additional:
            if rrset.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                glue.setdefault(rrset.name, set()).update(rr.address for rr in rrset)
        targets: dict[dns.name.Name, set[int]] = {}
        for rr in srv.rrset:
            if rr.target != dns.name.root and rr.port != 0:  # "." = service not offered
                targets.setdefault(rr.target, set()).add(rr.port)
        unglued = [t for t in targets if t not in glue]
        resolved = await _gather_or_raise([self._host_ips(t) for t in unglued])
        glue.update(zip(unglued, resolved, strict=True))
        found: set[Address] = set()
        for target, ports in targets.items():
            ips = glue[target]
            if ips:
                self._unresolvable.discard(target)
            elif target not in self._unresolvable:
                log.warning("discovery dns: SRV target %s has no A/AAAA records", target)
                self._unresolvable.add(target)
            found.update((_normalize_host(ip), port) for ip in ips for port in ports)
        return found

    async def _host_ips(self, qname: dns.name.Name) -> set[str]:
        answers = await _gather_or_raise([self._query(qname, "A"), self._query(qname, "AAAA")])
        return {rr.address for answer in answers if answer is not None for rr in answer}

    async def _host_addresses(self, qname: dns.name.Name, port: int) -> set[Address]:
        return {(_normalize_host(ip), port) for ip in await self._host_ips(qname)}

    def __repr__(self) -> str:
        return f"DnsProvider({self.name.to_text()!r}, nameserver={self.nameserver!r})"


async def _gather_or_raise(coros: list[Any]) -> list[Any]:
    # return_exceptions: every query is bounded by its lifetime, so waiting for all of them
    # leaves no orphan task behind when one fails.
    results = await asyncio.gather(*coros, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return results


# --------------------------------------------------------------------------- multicast


@dataclass(frozen=True)
class Announcement:
    node_id: str
    address: Address


class AnnouncementRejected(Exception):
    """An announcement datagram that must be ignored; ``reason`` is a short counter key."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class AnnouncementCodec:
    """Signed multicast announcements: ``FBD1`` + JSON body + HMAC-SHA256 of both.

    Body fields: c cluster name, n node id, h/p cluster address, t sender's wall clock,
    r random nonce. Checks, in order: structure (``malformed``), the MAC (``bad_mac``),
    the cluster name (``other_cluster``), the timestamp within +-replay_window
    (``stale``), the nonce not seen before (``replay``), a usable address (``no_address``:
    the node announced a wildcard host and the datagram came from an unspecified source).
    """

    MAGIC = b"FBD1"
    MAC_SIZE = 32

    def __init__(
        self, secret: bytes, cluster_name: str, replay_window: float = REPLAY_WINDOW
    ) -> None:
        # A key of its own, so a discovery MAC can never stand in for a handshake MAC made
        # with the same shared secret.
        self._key = hmac.new(secret, b"fastbroker discovery v1", hashlib.sha256).digest()
        self.cluster_name = cluster_name
        self.replay_window = replay_window
        self._seen: dict[str, float] = {}  # nonce -> wall time after which it is stale anyway
        self._next_prune = 0.0

    def _mac(self, signed: bytes) -> bytes:
        return hmac.new(self._key, signed, hashlib.sha256).digest()

    def encode(
        self, node_id: str, address: Address, *, now: float | None = None, nonce: str | None = None
    ) -> bytes:
        body = {
            "c": self.cluster_name,
            "n": node_id,
            "h": address[0],
            "p": address[1],
            "t": time.time() if now is None else now,
            "r": secrets.token_hex(12) if nonce is None else nonce,
        }
        signed = self.MAGIC + json.dumps(body, separators=(",", ":")).encode()
        return signed + self._mac(signed)

    def decode(self, data: bytes, source_host: str, *, now: float | None = None) -> Announcement:
        """Verify and unpack; raises AnnouncementRejected. Accepted nonces are remembered."""
        if len(data) <= len(self.MAGIC) + self.MAC_SIZE or not data.startswith(self.MAGIC):
            raise AnnouncementRejected("malformed")
        signed, mac = data[: -self.MAC_SIZE], data[-self.MAC_SIZE :]
        if not hmac.compare_digest(mac, self._mac(signed)):
            raise AnnouncementRejected("bad_mac")
        try:
            body = json.loads(signed[len(self.MAGIC) :])
            cluster, node_id, host, port = body["c"], body["n"], body["h"], body["p"]
            sent, nonce = float(body["t"]), body["r"]
            if not (
                isinstance(cluster, str)
                and isinstance(node_id, str)
                and isinstance(host, str)
                and isinstance(nonce, str)
                and type(port) is int
                and 1 <= port <= 65535
            ):
                raise TypeError("field types")
        except (ValueError, KeyError, TypeError):
            raise AnnouncementRejected("malformed") from None
        if cluster != self.cluster_name:
            raise AnnouncementRejected("other_cluster")
        now = time.time() if now is None else now
        if not abs(now - sent) <= self.replay_window:
            raise AnnouncementRejected("stale")
        self._prune(now)
        if nonce in self._seen:
            raise AnnouncementRejected("replay")
        self._seen[nonce] = sent + self.replay_window
        if host in ("", "0.0.0.0", "::"):
            host = source_host  # the node listens on every interface: use where it spoke from
            if host in ("", "0.0.0.0", "::"):
                raise AnnouncementRejected("no_address")
        return Announcement(node_id, (_normalize_host(host), port))

    def _prune(self, now: float) -> None:
        if now >= self._next_prune:
            self._seen = {n: until for n, until in self._seen.items() if until >= now}
            self._next_prune = now + 1.0


class _AnnouncementProtocol(asyncio.DatagramProtocol):
    def __init__(self, provider: MulticastProvider) -> None:
        self._provider = provider

    def datagram_received(self, data: bytes, addr: tuple[Any, ...]) -> None:
        self._provider._on_datagram(data, addr[0])

    def error_received(self, exc: Exception) -> None:
        self._provider._send_warner.problem(f"sending announcements: {exc}")


class MulticastProvider:
    """Announce this node on a UDP multicast group and collect the others' announcements.

    ``rejected`` counts ignored datagrams by reason (see :class:`AnnouncementCodec`), for
    diagnostics: strangers, other clusters and replays show up there.
    """

    def __init__(
        self,
        secret: bytes,
        group: str = DEFAULT_MULTICAST_GROUP,
        port: int = DEFAULT_MULTICAST_PORT,
        interface: str | None = None,
        *,
        interval: float = 1.0,
        expiry: float | None = None,
        replay_window: float = REPLAY_WINDOW,
    ) -> None:
        if not secret:
            raise ValueError("multicast discovery needs the cluster's shared secret")
        try:
            group_ip = ipaddress.ip_address(group)
        except ValueError:
            raise ValueError(f"multicast group {group!r} is not an IP address") from None
        if group_ip.version != 4 or not group_ip.is_multicast:
            raise ValueError(f"{group!r} is not an IPv4 multicast address (224.0.0.0/4)")
        if interface is not None:
            try:
                ipaddress.IPv4Address(interface)
            except ValueError:
                raise ValueError(f"interface {interface!r} is not an IPv4 address") from None
        if not 1 <= port <= 65535:
            raise ValueError(f"multicast port {port} is not from 1 to 65535")
        self.group, self.port, self.interface = str(group_ip), port, interface
        self.interval = interval
        self.expiry = 3.5 * interval if expiry is None else expiry
        self.replay_window = replay_window
        self.rejected: Counter[str] = Counter()
        self._secret = secret
        self._codec: AnnouncementCodec | None = None
        self._local: LocalNode | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._announcer: asyncio.Task[None] | None = None
        self._heard: dict[str, tuple[Address, float]] = {}  # node id -> (address, monotonic)
        self._send_warner = _OnceWarner(f"discovery multicast {self.group}:{self.port}")

    async def start(self, local: LocalNode) -> None:
        self._local = local
        self._codec = AnnouncementCodec(self._secret, local.cluster_name, self.replay_window)
        try:
            sock = self._open_socket()
        except OSError as exc:
            where = f" on {self.interface}" if self.interface else ""
            raise OSError(
                exc.errno,
                f"multicast discovery: cannot join {self.group}:{self.port}{where}: "
                f"{exc.strerror or exc}",
            ) from exc
        loop = asyncio.get_running_loop()
        self._transport, _ = await loop.create_datagram_endpoint(
            lambda: _AnnouncementProtocol(self), sock=sock
        )
        self._announcer = asyncio.create_task(self._announce_forever())

    def _open_socket(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_UDP)
        try:
            # Several nodes on one host share the group port.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            # Bound to the group address, the socket gets only this group's datagrams.
            sock.bind((self.group, self.port))
            iface = socket.inet_aton(self.interface or "0.0.0.0")
            membership = socket.inet_aton(self.group) + iface
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, membership)
            if self.interface:
                sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, iface)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)  # same-host nodes
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    async def _announce_forever(self) -> None:
        assert self._codec is not None and self._local is not None
        while self._transport is not None and not self._transport.is_closing():
            datagram = self._codec.encode(self._local.node_id, self._local.address)
            self._transport.sendto(datagram, (self.group, self.port))
            await asyncio.sleep(self.interval)

    def _on_datagram(self, data: bytes, source_host: str) -> None:
        if self._codec is None or self._local is None:
            return
        try:
            announcement = self._codec.decode(data, source_host)
        except AnnouncementRejected as exc:
            self.rejected[exc.reason] += 1
            return
        if announcement.node_id == self._local.node_id:
            self._send_warner.ok()  # our own announcement came back: sending works
            return
        self._heard[announcement.node_id] = (announcement.address, time.monotonic())

    async def peers(self) -> set[Address]:
        deadline = time.monotonic() - self.expiry
        self._heard = {n: seen for n, seen in self._heard.items() if seen[1] >= deadline}
        own = _normalize(self._local.address) if self._local else None
        return {address for address, _ in self._heard.values() if address != own}

    async def stop(self) -> None:
        if self._announcer is not None:
            self._announcer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._announcer
            self._announcer = None
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self._heard.clear()

    def __repr__(self) -> str:
        where = f"@{self.interface}" if self.interface else ""
        return f"MulticastProvider({self.group}:{self.port}{where})"


# --------------------------------------------------------------------------- plug-ins


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def load_plugin(target: str, arg: str = "") -> DiscoveryProvider:
    """``package.module:factory`` -> ``factory(arg)``, checked to be a provider."""
    module_name, sep, factory_name = target.partition(":")
    if not sep or not module_name or not factory_name:
        raise ValueError("expected python:package.module:factory[:ARG]")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(f"cannot import {module_name}: {_one_line(exc)}") from exc
    factory = getattr(module, factory_name, None)
    if not callable(factory):
        raise ValueError(f"{module_name} has no callable {factory_name!r}")
    try:
        provider = factory(arg)
    except Exception as exc:
        raise ValueError(f"{factory_name}({arg!r}) failed: {_one_line(exc)}") from exc
    missing = [m for m in ("start", "peers", "stop") if not callable(getattr(provider, m, None))]
    if missing:
        raise ValueError(
            f"{target}() returned {type(provider).__name__}, "
            f"which lacks {', '.join(missing)} (see the DiscoveryProvider interface)"
        )
    return provider  # type: ignore[no-any-return]


# --------------------------------------------------------------------------- specs


def _parse_dns(rest: str, default_port: int) -> DnsProvider:
    name, at, server = rest.partition("@")
    if not name:
        raise ValueError("dns: expected dns:NAME or dns:NAME@SERVER[:PORT]")
    nameserver = None
    if at:
        nameserver = parse_address(server, 53)
        try:
            ipaddress.ip_address(nameserver[0])
        except ValueError:
            raise ValueError(f"dns:{rest}: the nameserver must be an IP address") from None
    try:
        return DnsProvider(name, default_port, nameserver)
    except ValueError as exc:
        raise ValueError(f"dns:{rest}: {exc}") from None


def _parse_multicast(rest: str, secret: bytes) -> MulticastProvider:
    where, at, interface = rest.partition("@")
    group, port = DEFAULT_MULTICAST_GROUP, DEFAULT_MULTICAST_PORT
    if where.count(":") > 1 or where.startswith("["):
        raise ValueError(f"{where!r}: IPv6 multicast is not supported; use an IPv4 group")
    if where:
        group, sep, port_text = where.partition(":")
        if sep:
            port = _parse_port(port_text, rest)
    if at and not interface:
        raise ValueError(f"multicast:{rest}: expected an interface address after '@'")
    return MulticastProvider(secret, group, port, interface or None)


def parse_discovery(spec: str, *, default_port: int, secret: bytes) -> DiscoveryProvider:
    """A ``--discovery`` spec -> provider; ValueError with a one-line message if it is bad."""
    _check_default_port(default_port)
    kind, sep, rest = spec.strip().partition(":")
    try:
        if kind == "static" and sep:
            return static_seeds(rest, default_port)
        if kind == "file" and sep:
            if not rest:
                raise ValueError("expected file:PATH")
            return FileProvider(rest, default_port)
        if kind == "dns" and sep:
            return _parse_dns(rest, default_port)
        if kind == "multicast" or kind.startswith("multicast@"):
            # "multicast@10.0.0.5" has no colon but still names an interface
            return _parse_multicast(spec.strip()[len("multicast") :].lstrip(":"), secret)
        if kind == "python" and sep:
            module_name, sep2, remainder = rest.partition(":")
            factory_name, _, arg = remainder.partition(":")
            return load_plugin(f"{module_name}:{factory_name}" if sep2 else module_name, arg)
    except ValueError as exc:
        message = " ".join(str(exc).split())
        raise ValueError(f"--discovery {spec!r}: {message}") from None
    raise ValueError(
        f"--discovery {spec!r}: unknown kind; expected static:HOST:PORT,..., file:PATH, "
        "dns:NAME[@SERVER], multicast[:GROUP:PORT][@IFACE] or python:module:factory[:ARG]"
    )
