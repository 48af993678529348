"""The broker's listeners: TCP, TLS, WebSocket and secure WebSocket, each optionally behind
the PROXY protocol, all feeding the same engine through fastbroker's Connection protocol.

Every listener is a plain TCP server; what a connection needs before MQTT starts is done by
adapters here, once per connection, in this order:

1. PROXY header (``proxy_protocol`` set): read and parsed (fastbroker.proxy_protocol); the
   client address it gives becomes the connection's peer.
2. TLS (``tls``, ``wss``): the loop's TLS protocol is put on the socket (as
   ``loop.start_tls`` does), so it also works after a PROXY header; a failed handshake is
   logged with the client's address; the client certificate's CN is recorded.
3. WebSocket (``ws``, ``wss``): the HTTP Upgrade handshake (fastbroker.websocket), then every
   read is unframed by the compiled ``fastbroker_core.WebSocketCodec`` (one call per read) and
   every write framed by it (one call per batch the engine drains).

Then the connection is handed to a Connection (fastbroker._connection) with ``info`` set:
"listener", "peer", "cert_cn", "use_identity_as_username", "transport" and "proxy" (the
proxy's own address, or None). For TCP and TLS the socket is handed over with
``transport.set_protocol``: the adapter leaves the path, and the engine is fed exactly as on
a plain listener. A plain TCP listener without PROXY has no adapter at all.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, cast

import fastbroker_core
import uvloop

from fastbroker.config import ListenerSpec
from fastbroker.proxy_protocol import ProxyProtocolError, bytes_needed, parse_proxy_header
from fastbroker.websocket import (
    HandshakeError,
    error_response,
    parse_request,
    request_end,
    switching_protocols,
)

if TYPE_CHECKING:
    from fastbroker._connection import Connection, Server

logger = logging.getLogger("fastbroker.listeners")

# The engine's defaults of [mqtt] connect_timeout_ms and max_packet_size.
CONNECT_TIMEOUT_MS = 10_000
MAX_PACKET_SIZE = 16_777_216
TLS_VERSIONS = {"1.2": ssl.TLSVersion.TLSv1_2, "1.3": ssl.TLSVersion.TLSv1_3}
# Bytes read per call while looking for a PROXY header when what follows may be read too.
PROXY_READ_SIZE = 4096
# Whatever max_packet_size says, a WebSocket message may hold this much: clients that put
# several small MQTT packets in one message must not be refused for it.
MIN_WEBSOCKET_MESSAGE = 65_536
WEBSOCKET_GOING_AWAY = 1001


def build_ssl_context(spec: ListenerSpec) -> ssl.SSLContext:
    """The server context of a tls or wss listener. Raises ValueError (one line) when a file
    cannot be read or the certificate and key do not go together."""
    for key in ("certfile", "keyfile", "cafile"):
        path = getattr(spec, key)
        if not path:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as error:
            raise ValueError(f"{key} {path}: {error.strerror or error}") from None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = TLS_VERSIONS[spec.tls_min_version]
    try:
        context.load_cert_chain(spec.certfile, spec.keyfile)
    except ssl.SSLError as error:
        raise ValueError(
            f"certfile {spec.certfile} and keyfile {spec.keyfile} cannot be used together: "
            f"{ssl_reason(error)}"
        ) from None
    if spec.cafile:
        try:
            context.load_verify_locations(cafile=spec.cafile)
        except ssl.SSLError as error:
            raise ValueError(f"cafile {spec.cafile}: {ssl_reason(error)}") from None
        # OPTIONAL still refuses a certificate that does not verify; it only lets clients
        # without one in.
        context.verify_mode = ssl.CERT_REQUIRED if spec.require_certificate else ssl.CERT_OPTIONAL
    return context


def ssl_reason(error: ssl.SSLError) -> str:
    return str(error.reason or error).lower().replace("_", " ")


def certificate_cn(transport: asyncio.BaseTransport) -> str | None:
    """The subject common name of the client's verified certificate, if it sent one."""
    certificate = transport.get_extra_info("peercert")
    if not certificate:
        return None
    for rdn in certificate.get("subject", ()):
        for name, value in rdn:
            if name == "commonName":
                return str(value)
    return None


def peer_address(transport: asyncio.BaseTransport) -> tuple[str, int] | None:
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and len(peer) >= 2:
        return (str(peer[0]), int(peer[1]))
    return None


def format_peer(peer: tuple[str, int] | None) -> str:
    if peer is None:
        return "unknown"
    host, port = peer
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


@dataclass
class ListenerContext:
    """What every connection of one listener shares."""

    spec: ListenerSpec
    ssl_context: ssl.SSLContext | None
    # Filled in once the engine's state is restored (the listeners are bound before).
    server: Server | None
    loop: asyncio.AbstractEventLoop
    # Bound on each step before MQTT (PROXY header, TLS handshake, WebSocket handshake).
    handshake_timeout: float
    max_message_size: int

    def info(
        self,
        peer: tuple[str, int] | None,
        proxy: tuple[str, int] | None = None,
        cert_cn: str | None = None,
    ) -> dict[str, Any]:
        return {
            "listener": self.spec.name,
            "peer": peer,
            "cert_cn": cert_cn,
            "use_identity_as_username": self.spec.use_identity_as_username,
            "transport": self.spec.type,
            "proxy": proxy,
        }

    @cached_property
    def plain_info(self) -> dict[str, Any]:
        return self.info(None)

    def new_connection(self) -> Connection:
        """The Connection for a socket that an AcceptedConnection already let in."""
        assert self.server is not None, "connections are accepted once the server exists"
        connection = self.server.new_connection()
        connection.admitted = True
        return connection

    def plain_connection(self) -> Connection:
        """Protocol factory of a plain TCP listener: the Connection itself, no adapter."""
        assert self.server is not None, "connections are accepted once the server exists"
        # Its own connection_made applies the connection limits.
        connection = self.server.new_connection()
        # Shared by the listener's plain connections; the peer is looked up when asked for
        # (Server.conn_info): nothing more per accept, no dict per idle connection.
        connection.info = self.plain_info
        return connection


def ssl_protocol_class(loop: asyncio.AbstractEventLoop) -> Any:
    """The loop's own TLS protocol: uvloop's compiled one under uvloop, asyncio's otherwise.
    Both take the arguments of asyncio.sslproto.SSLProtocol."""
    if isinstance(loop, uvloop.Loop):
        return uvloop.loop.SSLProtocol  # type: ignore[attr-defined]
    from asyncio import sslproto

    return sslproto.SSLProtocol


class AcceptedConnection(asyncio.BufferedProtocol):
    """A connection on a listener that needs more than plain TCP: reads the PROXY header (if
    configured), starts TLS (if configured), then hands over to MQTT or to the WebSocket
    handshake.

    The PROXY header is read with get_buffer sized by ``bytes_needed`` when TLS follows, so
    not one byte of the TLS handshake is read here (the TLS layer must see all of it);
    otherwise in larger reads, the surplus going to the next step.

    TLS is the loop's TLS protocol put on the transport in place of this one, as
    ``loop.start_tls`` does, but without a task per connection, and with the handshake's
    outcome (a future) logged with the client's address."""

    def __init__(self, context: ListenerContext) -> None:
        self.context = context
        self.transport: asyncio.Transport | None = None
        self.socket_peer: tuple[str, int] | None = None
        self.header = bytearray()
        self.read_buffer = bytearray()
        self.timer: asyncio.TimerHandle | None = None
        self.done = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert self.context.server is not None
        if not self.context.server.admit_socket():
            # Over [limits] max_connection_rate or the socket cap: refused before any
            # handshake costs anything.
            transport.abort()
            return
        # uvloop's transports do not subclass asyncio.Transport, they only act like one.
        self.transport = cast(asyncio.Transport, transport)
        self.socket_peer = peer_address(transport)
        if self.context.spec.proxy_protocol == "off":
            # Nothing has been read yet: uvloop starts reading after connection_made, for
            # the protocol that has replaced this one by then.
            self.proxied(self.socket_peer, None, b"")
            return
        self.timer = self.context.loop.call_later(
            self.context.handshake_timeout, self.header_timed_out
        )

    def get_buffer(self, sizehint: int) -> bytearray:
        size = PROXY_READ_SIZE
        if self.context.ssl_context is not None:
            size = bytes_needed(self.header, self.context.spec.proxy_protocol)
        if len(self.read_buffer) != size:
            self.read_buffer = bytearray(size)
        return self.read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self.done:
            return
        self.header += self.read_buffer[:nbytes]
        mode = self.context.spec.proxy_protocol
        try:
            header = parse_proxy_header(self.header, mode)
        except ProxyProtocolError as error:
            self.refuse(f"bad PROXY header: {error}")
            return
        if header is None:
            return
        rest = bytes(self.header[header.length :])
        self.header = bytearray()
        peer = header.source or self.socket_peer
        # The access log shows the client's address; this line also names the proxy.
        logger.debug(
            "connection from %s on %s via proxy %s",
            format_peer(peer),
            self.context.spec.name,
            format_peer(self.socket_peer),
        )
        self.proxied(peer, self.socket_peer, rest)

    def header_timed_out(self) -> None:
        self.timer = None
        if not self.done:
            self.refuse(f"no PROXY header within {self.context.handshake_timeout:g} s")

    def refuse(self, why: str) -> None:
        self.done = True
        self.cancel_timer()
        logger.info(
            "closing connection from %s on %s: %s",
            format_peer(self.socket_peer),
            self.context.spec.name,
            why,
        )
        if self.transport is not None:
            self.transport.abort()

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def proxied(
        self, peer: tuple[str, int] | None, proxy: tuple[str, int] | None, rest: bytes
    ) -> None:
        """The PROXY step is done (or not configured): on to TLS or the next protocol, which
        replaces this one on the transport (uvloop's set_protocol switches the reading over
        to it)."""
        self.done = True
        self.cancel_timer()
        transport = self.transport
        assert transport is not None
        context = self.context
        info = context.info(peer, proxy)
        if context.ssl_context is None:
            start_protocol(context, transport, info, rest)
            return
        # The header was read exactly: nothing of the TLS handshake has been read here.
        assert not rest
        waiter = context.loop.create_future()
        established = TlsEstablished(context, info)
        tls = ssl_protocol_class(context.loop)(
            context.loop,
            established,
            context.ssl_context,
            waiter,
            server_side=True,
            ssl_handshake_timeout=context.handshake_timeout,
        )
        waiter.add_done_callback(established.handshake_done)
        transport.set_protocol(tls)
        tls.connection_made(transport)

    def data_received(self, data: bytes) -> None:  # pragma: no cover - BufferedProtocol
        raise AssertionError("read through get_buffer")

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.done = True
        self.cancel_timer()


class TlsEstablished(asyncio.Protocol):
    """The application side of the TLS layer until the handshake is done; then hands the
    TLS transport to the next protocol (nothing is read in between)."""

    def __init__(self, context: ListenerContext, info: dict[str, Any]) -> None:
        self.context = context
        self.info = info
        self.established = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.established = True
        tls_transport = cast(asyncio.Transport, transport)
        self.info["cert_cn"] = certificate_cn(tls_transport)
        start_protocol(self.context, tls_transport, self.info, b"")

    def handshake_done(self, waiter: asyncio.Future[None]) -> None:
        if waiter.cancelled() or self.established:
            return
        error = waiter.exception()
        logger.info(
            "TLS handshake with %s on %s failed: %s",
            format_peer(self.info["peer"]),
            self.context.spec.name,
            ssl_failure(error) if error is not None else "connection closed",
        )

    def data_received(self, data: bytes) -> None:  # pragma: no cover - replaced before
        raise AssertionError("the next protocol takes over at connection_made")

    def connection_lost(self, exc: Exception | None) -> None:
        pass


def start_protocol(
    context: ListenerContext, transport: asyncio.Transport, info: dict[str, Any], early: bytes
) -> None:
    """Puts MQTT (a Connection) or the WebSocket handshake on ``transport``, and gives it
    ``early``, bytes already read that are its."""
    if context.spec.websocket:
        websocket = WebSocketProtocol(context, info)
        transport.set_protocol(websocket)
        websocket.connection_made(transport)
        if early:
            websocket.data_received(early)
        return
    connection = context.new_connection()
    connection.info = info
    transport.set_protocol(connection)
    connection.connection_made(transport)
    if connection.transport is not None and early:
        # (None: refused on accept by the connection limits, and already aborted.)
        connection.data_received(early)


def ssl_failure(error: BaseException) -> str:
    if isinstance(error, ssl.SSLError):
        return ssl_reason(error)
    return str(error) or type(error).__name__


class WebSocketTransport(asyncio.Transport):
    """What the MQTT Connection writes to on a WebSocket: frames its bytes, delegates the
    rest to the socket's transport."""

    def __init__(
        self, transport: asyncio.Transport, codec: Any, protocol: asyncio.BaseProtocol
    ) -> None:
        super().__init__()
        self.transport = transport
        self.codec = codec
        self.encode = codec.encode
        self.protocol = protocol
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not self.closing and data:
            self.transport.write(self.encode(data))

    def writelines(self, list_of_data: Iterable[bytes | bytearray | memoryview]) -> None:
        self.write(b"".join(list_of_data))

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        if not self.transport.is_closing():
            if self.codec.closed is None:
                # The broker ends the connection: say so in WebSocket terms first.
                self.transport.write(self.codec.close_frame(1000))
            self.transport.close()

    def abort(self) -> None:
        self.closing = True
        self.transport.abort()

    def is_closing(self) -> bool:
        return self.closing or self.transport.is_closing()

    def can_write_eof(self) -> bool:
        return False

    def write_eof(self) -> None:
        raise NotImplementedError("a WebSocket connection has no half-close")

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size()

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self.transport.get_write_buffer_limits()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self.transport.set_write_buffer_limits(high, low)

    def pause_reading(self) -> None:
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.transport.resume_reading()

    def is_reading(self) -> bool:
        return self.transport.is_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol

    def get_protocol(self) -> asyncio.BaseProtocol:
        return self.protocol


class WebSocketProtocol(asyncio.Protocol):
    """One WebSocket connection: the Upgrade handshake, then frames in and out around an MQTT
    Connection. Python runs once per read here, never per MQTT packet."""

    def __init__(self, context: ListenerContext, info: dict[str, Any] | None) -> None:
        self.context = context
        # None: straight from accept; connection_made fills it in (the socket's peer).
        self.info: dict[str, Any] = info if info is not None else {}
        self.transport: asyncio.Transport | None = None
        self.request = bytearray()
        self.timer: asyncio.TimerHandle | None = None
        self.connection: Connection | None = None
        self.decode: Callable[[bytes], tuple[bytes, bytes, int | None]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, they only act like one.
        self.transport = cast(asyncio.Transport, transport)
        if not self.info:
            self.info = self.context.info(peer_address(transport))
        self.timer = self.context.loop.call_later(
            self.context.handshake_timeout, self.handshake_timed_out
        )

    def data_received(self, data: bytes) -> None:
        decode = self.decode
        if decode is not None:
            payload, replies, closed = decode(data)
            if payload:
                assert self.connection is not None
                self.connection.data_received(payload)
            if replies:
                assert self.transport is not None
                self.transport.write(replies)
            if closed is not None:
                self.closed_by_codec(closed)
            return
        if self.connection is None and self.transport is not None:
            self.handshake(data)

    def handshake(self, data: bytes) -> None:
        self.request += data
        try:
            end = request_end(self.request)
            if end is None:
                return
            request = parse_request(self.request[:end], self.context.spec.path)
        except HandshakeError as error:
            self.refuse(error.status, error.reason, error.headers)
            return
        rest = bytes(self.request[end:])
        self.request = bytearray()
        self.cancel_timer()
        transport = self.transport
        assert transport is not None
        transport.write(switching_protocols(request))
        codec = fastbroker_core.WebSocketCodec(self.context.max_message_size)
        connection = self.context.new_connection()
        connection.info = self.info
        connection.connection_made(WebSocketTransport(transport, codec, connection))
        if connection.transport is None:
            # Refused on accept (connection limits): the socket is already aborted.
            return
        self.connection = connection
        self.decode = codec.decode
        if rest:
            self.data_received(rest)

    def closed_by_codec(self, code: int) -> None:
        """The peer closed (its close frame is echoed) or broke the protocol (our close
        frame is sent): the TCP connection ends once that is written."""
        assert self.transport is not None
        if code not in (1000, 1001, 1005):
            logger.info(
                "closing WebSocket connection from %s on %s: protocol violation (close code %d)",
                format_peer(self.info["peer"]),
                self.context.spec.name,
                code,
            )
        if self.connection is not None and self.connection.transport is not None:
            self.connection.transport.close()
        else:
            self.transport.close()

    def refuse(self, status: int, reason: str, headers: tuple[tuple[str, str], ...] = ()) -> None:
        self.cancel_timer()
        logger.info(
            "WebSocket handshake from %s on %s refused: %d %s",
            format_peer(self.info["peer"]),
            self.context.spec.name,
            status,
            reason,
        )
        transport = self.transport
        self.transport = None
        self.request = bytearray()
        if transport is not None and not transport.is_closing():
            transport.write(error_response(status, reason, headers))
            transport.close()

    def handshake_timed_out(self) -> None:
        self.timer = None
        if self.connection is None and self.transport is not None:
            self.refuse(408, f"no complete request within {self.context.handshake_timeout:g} s")

    def cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.cancel_timer()
        self.transport = None
        self.decode = None
        if self.connection is not None:
            connection, self.connection = self.connection, None
            connection.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.connection is not None:
            self.connection.pause_writing()

    def resume_writing(self) -> None:
        if self.connection is not None:
            self.connection.resume_writing()


class ListenerGroup:
    """Every listener of the broker, started and stopped together; quacks like the one
    asyncio.Server the broker used to have (start_serving, close, wait_closed, sockets,
    is_serving)."""

    def __init__(self) -> None:
        self.contexts: list[ListenerContext] = []
        self.servers: list[asyncio.Server] = []
        # The info dict of each listener socket of the compiled connection layer, by its
        # index in the reactor (filled as they start serving).
        self.reactor_infos: list[dict[str, Any]] = []

    def attach(self, server: Server) -> None:
        """Connections go to ``server`` from now on (set before serving starts)."""
        for context in self.contexts:
            context.server = server

    @property
    def sockets(self) -> list[Any]:
        return [sock for server in self.servers for sock in server.sockets]

    def addresses(self) -> list[tuple[ListenerSpec, tuple[str, int]]]:
        """(spec, bound address) of each listener, in order."""
        out = []
        for context, server in zip(self.contexts, self.servers, strict=True):
            for sock in server.sockets:
                host, port = sock.getsockname()[:2]
                out.append((context.spec, (host, port)))
        return out

    async def start_serving(self) -> None:
        # The first listener last: whoever polls it to see the broker up finds every other
        # one serving too.
        for server in reversed(self.servers):
            await server.start_serving()

    def is_serving(self) -> bool:
        return bool(self.servers) and all(server.is_serving() for server in self.servers)

    def reload_certificates(self) -> None:
        """Re-reads the certificate, key and CA files of every tls and wss listener (SIGHUP):
        handshakes from now on use them, connections already up keep theirs. A listener whose
        new files are unreadable or do not go together keeps its old ones (logged)."""
        for context in self.contexts:
            spec = context.spec
            if not spec.tls:
                continue
            try:
                # A new context, swapped in whole: loading into the live one could leave a new
                # certificate with the old key when the new key is bad.
                fresh = build_ssl_context(spec)
            except ValueError as error:
                logger.error("listener %s keeps its previous certificate: %s", spec.name, error)
                continue
            context.ssl_context = fresh
            logger.info("listener %s: certificate reloaded from %s", spec.name, spec.certfile)

    def close(self) -> None:
        for server in self.servers:
            server.close()

    async def wait_closed(self) -> None:
        for server in self.servers:
            await server.wait_closed()


async def bind_listeners(
    specs: Iterable[ListenerSpec],
    loop: asyncio.AbstractEventLoop,
    *,
    handshake_timeout: float,
    max_packet_size: int,
    backlog: int,
    reactor: Any = None,
) -> ListenerGroup:
    """Binds every listener without serving yet. Raises OSError (the group's listeners
    bound so far are closed) with ``spec`` set on the error for the message, or ValueError
    when a TLS context cannot be built."""
    group = ListenerGroup()
    max_message_size = max(max_packet_size, MIN_WEBSOCKET_MESSAGE)
    try:
        for spec in specs:
            context = ListenerContext(
                spec=spec,
                ssl_context=build_ssl_context(spec) if spec.tls else None,
                server=None,
                loop=loop,
                handshake_timeout=handshake_timeout,
                max_message_size=max_message_size,
            )
            factory: Callable[[], asyncio.BaseProtocol]
            if reactor is not None and spec.proxy_protocol == "off" and spec.type == "tcp":
                # Served by the compiled connection layer: no asyncio server at all.
                try:
                    served: Any = ReactorListener.bind(
                        reactor, context, backlog, group.reactor_infos
                    )
                except OSError as error:
                    raise ListenerBindError(spec, error) from None
                group.contexts.append(context)
                group.servers.append(served)
                continue
            if spec.proxy_protocol != "off" or spec.tls:
                factory = partial(AcceptedConnection, context)
            elif spec.websocket:
                factory = partial(WebSocketProtocol, context, None)
            else:
                factory = context.plain_connection
            try:
                server = await loop.create_server(
                    factory,
                    spec.host,
                    spec.port,
                    backlog=backlog,
                    start_serving=False,
                    reuse_port=spec.reuse_port or None,
                )
            except OSError as error:
                raise ListenerBindError(spec, error) from None
            group.contexts.append(context)
            group.servers.append(server)
    except BaseException:
        group.close()
        raise
    return group


class ReactorListener:
    """A plain TCP listener served by the compiled connection layer (fastbroker_core.Reactor):
    the parts of asyncio.Server that ListenerGroup uses. Bound like asyncio binds (every
    address the host resolves to, SO_REUSEADDR); as with asyncio, the sockets listen only
    from ``start_serving``, so a client that connects earlier is refused rather than queued
    while the broker still starts (signal handlers, the store's restore)."""

    def __init__(
        self,
        reactor: Any,
        sockets: list[socket.socket],
        info: dict[str, Any],
        infos: list[dict[str, Any]],
        backlog: int,
    ) -> None:
        self.reactor = reactor
        self.sockets = sockets
        # The info dict of this listener's connections (Server.conn_info adds the peer), put
        # in `infos` at the reactor's index of each socket.
        self.info = info
        self.infos = infos
        self.backlog = backlog
        self.indexes: list[int] = []

    @classmethod
    def bind(
        cls,
        reactor: Any,
        context: ListenerContext,
        backlog: int,
        infos: list[dict[str, Any]],
    ) -> ReactorListener:
        spec = context.spec
        host = spec.host or None
        addresses = socket.getaddrinfo(
            host, spec.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        sockets: list[socket.socket] = []
        try:
            for family, kind, proto, _, address in dict.fromkeys(addresses):
                sock = socket.socket(family, kind, proto)
                sockets.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if spec.reuse_port:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                if family == socket.AF_INET6:
                    # As asyncio does: the IPv4 address gets its own socket.
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
        except OSError:
            for sock in sockets:
                sock.close()
            raise
        return cls(reactor, sockets, context.plain_info, infos, backlog)

    async def start_serving(self) -> None:
        for sock in self.sockets[len(self.indexes) :]:
            sock.listen(self.backlog)
            index = self.reactor.add_listener(sock.fileno())
            self.indexes.append(index)
            self.infos[index:] = [self.info]

    def is_serving(self) -> bool:
        return bool(self.indexes)

    def close(self) -> None:
        for index in self.indexes:
            self.reactor.close_listener(index)
        self.indexes = []
        for sock in self.sockets:
            sock.close()

    async def wait_closed(self) -> None:
        return None


class ListenerBindError(Exception):
    """A listener's address cannot be bound."""

    def __init__(self, spec: ListenerSpec, error: OSError) -> None:
        super().__init__(f"listener {spec.name}: {error}")
        self.spec = spec
        self.error = error
