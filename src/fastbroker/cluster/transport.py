"""Node-to-node links: one TCP connection per pair of nodes, a versioned and authenticated
handshake, Rust framing (fastbroker_core.FrameDecoder / encode_frame), batched writes, and
reconnection with backoff.

Handshake, both sides at once (no round trip is wasted waiting for the other):
  1. each sends HELLO {magic, versions [min, max], cluster, node, address, nonce};
  2. on the peer's HELLO each checks the magic and cluster name, picks the protocol version
     min(our max, their max) (refused if below either side's min), and sends AUTH with
     HMAC-SHA256(secret, role + transcript), where role says whether the signer dialled or
     accepted, and the transcript names both node ids and both nonces in dialler-then-acceptor
     order. It proves the signer holds the secret; the peer's fresh nonce stops replays, and
     the role and both ids stop a stranger from splicing two handshakes together (passing one
     node's proof on to another) or reflecting a node's own proof back to it;
  3. on the peer's valid AUTH the link is up.

The handshake authenticates the peer. Without TLS the frames after it are neither encrypted
nor signed, so links must then run on a network an attacker cannot sit in the middle of.
With `[cluster] tls_*` set, every link is TLS both ways with mutual authentication: each node
presents its certificate and accepts only peers whose certificate chains to the cluster's CA
(host names are not checked: the CA is the cluster's own, and the secret is still required).

Each pair of nodes keeps two links, named in HELLO's `channel`: the control link carries the
control plane's frames (Raft, pings, joins: values encoded here), the data link the data
plane's batches (kind DATA: whole frames made by the engine, written as they are, see
fastbroker.cluster.dataplane). So heartbeats and Raft never wait behind megabytes of
forwarded messages in a socket buffer, and a peer that reads data slowly is not taken for
a dead one. The data link is dialled by the node with the smaller id once the control link
is up, and closed when the control link goes down (the control link's pings are what tell a
vanished peer); a dial of it still in progress is dropped then too, so that one left waiting
by a split does not hold up the data link once the control link is back.
A refusal is sent as REJECT {reason} before closing, so the other side logs why.

Two nodes may dial each other's control link at the same moment; the link dialled by the
node with the smaller id wins and the other is closed, so each pair ends with one.

Fault injection (tests only, off unless the config allows it): `block(node_ids)` drops every
link to those nodes and refuses them at handshake, which looks to both sides like a network
split.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import os
import random
import reprlib
import ssl
from collections.abc import Callable
from typing import Any, cast

import fastbroker_core

logger = logging.getLogger("fastbroker.cluster.transport")

MAGIC = "fastbroker-cluster"
# The inter-node protocol versions this build speaks. Two nodes talk the highest version both
# speak, so a release runs beside the one before it during a rolling upgrade (the rule and
# the procedure: docs/upgrade.md; tests/test_rolling_upgrade.py runs both builds).
# Version 2 added the data plane (routes and forwarded messages): a version 1 node, which
# cannot carry them, is refused at handshake. Version 3 added DATA_KEEPALIVE, claims and
# kicks. Version 4 added copies of sessions (Copy, CopyCheck, Fence batch items). Version 5
# added message ids (a session that just moved tells a message that reached it twice).
# Version 6: a home streams copies to a partition's new owners and then releases the former
# owners' (which keep theirs until then), an owner without a copy asks for one, and copy
# operations and claim answers read from copies carry the home's moment (the claimant takes
# the most current copy). Version 7: a node that installs a session of a dead home asks the
# others for the messages they kept for that home (KeptAsk, answered with kept
# SessionMessages), and a home tells the owners it copies to how far it applied each node's
# batches (Applied; carried in answers read from copies). Version 8: a session's new home
# tells its old home once every node has its route rows for it (RelayEnd), and the old home
# relays until then rather than for a fixed 5 s; a session installed from a dead home's
# copy that moves on carries what was kept for that home with it (KeptState). Version 9: a
# node copies the will of a connection whose session ends with it to the partition's owners
# (WillCopy, WillGone), which publish it if that node dies, and tell it if it was only out of
# reach (WillFired). Version 10: the owners of a client id's partition know which nodes hold
# its sessions (Homes, Home), and a claim goes through the first owner in reach, which stamps
# it and names the nodes to claim from (ClaimRoute, ClaimRouted). Version 11: a message
# for a peer that may be cut off lists the persistent sessions here that took it (a flag
# on Message), so a version of one of them made there meanwhile does not deliver it again.
# Version 12: a node asked for what it kept for a dead home ends its answer (KeptEnd), and
# the asking session sends its client nothing newer until then. Version 13: a node whose
# link comes back first tells the peer, for each session that moved to it lately, the
# session's version and what it delivered (TakenIds, ahead of the batches that waited), so
# the peer's version of such a session, made while the two were cut off, does not deliver
# those again, and the older of the two versions gives way to the newer. Version 14: a
# version of a session that gives way hands over the QoS 2 messages it sent PUBREL for
# with their packet ids (a released SessionMessage), and the newer version sends the PUBREL
# again rather than the message. Version 15: a node passing a session message (or the end
# of a hand-over, KeptEnd) on to where the session went next says which node it came from
# (a handed-on item), so that a hand-over from a version that gave way is told from copies
# of what that version took arriving by other paths, and it passes what another version
# took on as that version's word (TakenIds) rather than as ids the session saw. Version 16:
# a node handing a session over says, per publishing node, which of that node's messages
# came to it while the session lived there (TookRouted), so that a late copy sent straight
# to the new home is not delivered again.
# HELLO's optional "cluster_id" (ignored by nodes that do not send it) refuses links between
# nodes of different clusters, whatever the version.
PROTOCOL_MIN = 2
PROTOCOL_MAX = 16

CONTROL = "control"
DATA_CHANNEL = "data"
# The frame kind of a data-plane batch (fastbroker_core's cluster::batch::DATA_FRAME): the
# only kind a data link carries, and one a control link never does.
DATA_FRAME = 32
# Sent on a data link (version 3 on) that carried nothing for a while, so that a peer's data
# link that went silent (half-open, black-holed) is noticed and dialled again, even while the
# control link beside it stays up.
DATA_KEEPALIVE = 33

# Frame kinds. 0-15 are the link's own; the node's messages start at 16.
HELLO = 1
AUTH = 2
REJECT = 3

HANDSHAKE_TIMEOUT_S = 5.0
# Bytes a peer may send before it has authenticated (HELLO and AUTH take a few hundred), past
# the read that holds its AUTH: a stranger cannot make us buffer or decode more.
MAX_UNAUTHENTICATED_BYTES = 64 * 1024
# Links still in their handshake; more are refused, so a connection flood stays cheap.
MAX_HANDSHAKING = 128
# A peer that announces a bigger frame is broken or hostile. Control frames are small; a data
# batch holds at most one MQTT packet (256 MiB at most) past 1 MiB. A stranger cannot send
# one: before the handshake completes a link takes MAX_UNAUTHENTICATED_BYTES at most.
MAX_FRAME = 320 * 1024 * 1024 + 1024
# Above this many bytes waiting in the socket buffer, further control frames to that peer are
# dropped (control-plane messages are all retried); a stuck peer cannot eat the memory.
WRITE_HIGH_WATER = 8 * 1024 * 1024
# The data plane stops writing to a link above this (the engine keeps its batches, see
# fastbroker.cluster.dataplane) and goes on below the low mark: control frames never queue
# behind more than this.
DATA_HIGH_WATER = 4 * 1024 * 1024
DATA_LOW_WATER = 1024 * 1024
BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0

# (peer node id, frame kind, value)
MessageHandler = Callable[[str, int, Any], None]


class Traffic:
    """Bytes and frames exchanged with one peer over all its links, reconnects included
    (for /metrics: counters that only grow)."""

    __slots__ = ("bytes_in", "bytes_out", "dropped_frames", "frames_in", "frames_out")

    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0
        self.frames_in = 0
        self.frames_out = 0
        self.dropped_frames = 0


def format_address(address: tuple[str, int]) -> str:
    host, port = address
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parse_address(
    text: str, default_port: int | None = None, *, allow_any_port: bool = False
) -> tuple[str, int]:
    """'host:port', '[v6]:port' (or just a host with default_port) -> (host, port). Port 0
    (the system picks one) only where we listen: allow_any_port."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad address {text!r}")
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not host:
        raise ValueError(f"bad address {text!r}: no host")
    if not port_text:
        if default_port is None:
            raise ValueError(f"bad address {text!r}: expected HOST:PORT")
        return host, default_port
    lowest = 0 if allow_any_port else 1
    if not port_text.isdigit() or not lowest <= int(port_text) < 65536:
        raise ValueError(f"bad address {text!r}: port must be {lowest}..65535")
    return host, int(port_text)


def link_tls_contexts(
    certfile: str, keyfile: str, cafile: str
) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(accepting, dialling) contexts for TLS links: both present this node's certificate
    and require the peer's, chained to the cluster CA. ValueError (one line) for a file that
    cannot be read or a certificate and key that do not go together."""
    contexts = []
    for purpose in (ssl.PROTOCOL_TLS_SERVER, ssl.PROTOCOL_TLS_CLIENT):
        context = ssl.SSLContext(purpose)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.check_hostname = False
        context.verify_mode = ssl.CERT_REQUIRED
        try:
            context.load_cert_chain(certfile, keyfile)
            context.load_verify_locations(cafile=cafile)
        except OSError as error:
            raise ValueError(f"{error.filename or certfile}: {error.strerror or error}") from None
        except ssl.SSLError as error:
            raise ValueError(
                f"tls_certfile {certfile}, tls_keyfile {keyfile}, tls_cafile {cafile}: "
                f"{error.reason or error}"
            ) from None
        contexts.append(context)
    return contexts[0], contexts[1]


class Link(asyncio.Protocol):
    """One TCP connection to another node, before and after its handshake."""

    def __init__(
        self,
        transport_owner: Transport,
        dialled: tuple[str, int] | None,
        channel: str = CONTROL,
    ) -> None:
        self.owner = transport_owner
        # The address we dialled, or None for an accepted connection.
        self.dialled = dialled
        # CONTROL or DATA_CHANNEL: said by the dialler in its HELLO.
        self.channel = channel
        self.transport: asyncio.Transport | None = None
        self.decoder = fastbroker_core.FrameDecoder(MAX_FRAME)
        self.nonce = os.urandom(16)
        self.peer_id: str | None = None
        self.peer_address: str | None = None
        self.peer_nonce: bytes | None = None
        self.version: int | None = None
        self.up = False
        self.closed = False
        # connection_lost came (a close waits for the write buffer to drain first).
        self.lost = False
        self.pending: list[bytes] = []
        self.flush_scheduled = False
        self.dropped_frames = 0
        self.handshake_timer: asyncio.TimerHandle | None = None
        # Counted in the owner's handshaking total until up or closed.
        self.counted = False
        self.bytes_in = 0
        self.bytes_out = 0
        self.frames_in = 0
        self.frames_out = 0
        # Where this link's traffic is also added up: the traffic before authentication
        # (handshakes, strangers), then, once up, its peer's (only an authenticated peer gets
        # a total of its own: a stranger cannot grow the dict of peers).
        self.traffic = transport_owner.unauthenticated
        self.last_received = transport_owner.loop.time()
        # Socket writes made by flush(): frames queued in one loop iteration share one.
        self.writes = 0
        # When a data link last looked at its bytes_out, and what it was then: a link that
        # sent nothing since gets a DATA_KEEPALIVE (no per-batch cost for this).
        self.keepalive_at = self.last_received
        self.keepalive_bytes = 0
        # Once the compiled connection layer serves this data link (`adopt`): the server
        # whose reactor holds its socket, the link's id there, and the reactor's counters
        # as last added to this link's.
        self.reactor_server: Any = None
        self.reactor_link: int | None = None
        self.reactor_counted = (0, 0, 0, 0)

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, hence the cast.
        self.transport = cast(asyncio.Transport, transport)
        # Only a data link pauses its writer (the engine keeps its batches meanwhile).
        self.transport.set_write_buffer_limits(high=DATA_HIGH_WATER, low=DATA_LOW_WATER)
        owner = self.owner
        owner.handshaking += 1
        self.counted = True
        if owner.handshaking > MAX_HANDSHAKING:
            self.close("too many links in their handshake", level=logging.WARNING)
            return
        self.handshake_timer = owner.loop.call_later(HANDSHAKE_TIMEOUT_S, self.handshake_timeout)
        self.send_now(
            HELLO,
            {
                "magic": MAGIC,
                "versions": [PROTOCOL_MIN, owner.protocol_max],
                "cluster": owner.cluster_name,
                "cluster_id": owner.cluster_id(),
                "node": owner.node_id,
                "address": owner.advertise,
                "nonce": self.nonce,
                "channel": self.channel,
            },
        )

    def data_received(self, data: bytes) -> None:
        self.bytes_in += len(data)
        self.traffic.bytes_in += len(data)
        self.last_received = self.owner.loop.time()
        if not self.up and self.bytes_in - len(data) > MAX_UNAUTHENTICATED_BYTES:
            self.fail("too many bytes before the handshake completed")
            return
        try:
            frames = self.decoder.feed(data)
        except ValueError as error:
            self.fail(f"malformed frame: {error}")
            return
        self.frames_in += len(frames)
        self.traffic.frames_in += len(frames)
        for kind, value in frames:
            if self.closed:
                return
            if self.up:
                self.owner.deliver(self, kind, value)
            else:
                self.handshake_step(kind, value)
        # Counted once this read's frames are handled: a peer's AUTH may share a read with a
        # burst of data it sends right after (its queue for us, after a reconnect); one read
        # is bounded by the event loop's buffer.
        if not self.up and not self.closed and self.bytes_in > MAX_UNAUTHENTICATED_BYTES:
            self.fail("too many bytes before the handshake completed")

    def pause_writing(self) -> None:
        if self.up and self.channel == DATA_CHANNEL:
            self.owner.link_writable(self, False)

    def resume_writing(self) -> None:
        if self.up and self.channel == DATA_CHANNEL:
            self.owner.link_writable(self, True)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.reactor_link is not None:
            # uvloop's transport, given up when the reactor took the socket (`adopt`).
            return
        self.closed = True
        self.lost = True
        self.uncount()
        if self.handshake_timer is not None:
            self.handshake_timer.cancel()
        self.owner.link_lost(self)

    # -- handshake -------------------------------------------------------------------------

    def handshake_timeout(self) -> None:
        if not self.up:
            self.fail("handshake timed out")

    def handshake_step(self, kind: int, value: Any) -> None:
        owner = self.owner
        if kind == REJECT:
            reason = value.get("reason") if isinstance(value, dict) else None
            self.close(f"refused by the peer: {reason}", level=logging.WARNING)
            return
        if kind == HELLO and self.peer_nonce is None:
            problem = self.check_hello(value)
            if problem is not None:
                self.reject(problem)
                return
            self.send_now(AUTH, {"mac": self.mac(signer_dialled=self.dialled is not None)})
            return
        if kind == AUTH and self.peer_nonce is not None and self.peer_id is not None:
            mac = value.get("mac") if isinstance(value, dict) else None
            expected = self.mac(signer_dialled=self.dialled is None)
            if not isinstance(mac, bytes) or not hmac.compare_digest(mac, expected):
                self.reject("authentication failed: the cluster secrets differ")
                return
            if self.handshake_timer is not None:
                self.handshake_timer.cancel()
            self.uncount()
            self.up = True
            self.traffic = owner.traffic_of(self.peer_id)
            if self.channel == DATA_CHANNEL:
                owner.data_link_up(self)
            else:
                owner.link_up(self)
            return
        self.reject(f"unexpected frame kind {kind} during the handshake")

    def check_hello(self, hello: Any) -> str | None:
        owner = self.owner
        if not isinstance(hello, dict) or hello.get("magic") != MAGIC:
            return "not a fastbroker cluster peer"
        versions = hello.get("versions")
        node = hello.get("node")
        nonce = hello.get("nonce")
        if (
            not isinstance(versions, list)
            or len(versions) != 2
            or not all(type(v) is int for v in versions)
            or not isinstance(node, str)
            or not 0 < len(node) <= 64
            or not isinstance(nonce, bytes)
            or len(nonce) != 16
        ):
            return "malformed HELLO"
        if hello.get("cluster") != owner.cluster_name:
            theirs = reprlib.repr(hello.get("cluster"))
            return f"cluster name differs: ours {owner.cluster_name!r}, theirs {theirs}"
        ours, theirs_id = owner.cluster_id(), hello.get("cluster_id")
        if ours is not None and isinstance(theirs_id, str) and theirs_id != ours:
            # Not a peer: a cluster formed anew (`fastbroker cluster recover`) takes members
            # of the old one back only with an empty data directory.
            return f"cluster id differs: ours {ours}, theirs {reprlib.repr(theirs_id)}"
        if node == owner.node_id:
            # Discovery found our own address.
            return "same node"
        their_min, their_max = versions
        version = min(owner.protocol_max, their_max)
        if version < max(PROTOCOL_MIN, their_min):
            return (
                f"no common protocol version: ours {PROTOCOL_MIN}-{owner.protocol_max}, "
                f"theirs {their_min}-{their_max}"
            )
        if node in owner.blocked:
            return "link blocked by fault injection"
        channel = hello.get("channel", CONTROL)
        if channel not in (CONTROL, DATA_CHANNEL):
            return "malformed HELLO"
        if self.dialled is None:
            # The dialler names the channel (the acceptor's HELLO went before it knew); both
            # sides' AUTH covers it, so they agree on it.
            self.channel = channel
        address = hello.get("address")
        self.peer_id = node
        self.peer_address = address if isinstance(address, str) else None
        self.peer_nonce = nonce
        self.version = version
        return None

    def mac(self, *, signer_dialled: bool) -> bytes:
        """The AUTH proof of the side that dialled (signer_dialled) or accepted this link."""
        assert self.peer_id is not None and self.peer_nonce is not None
        we_dialled = self.dialled is not None
        ours = (self.owner.node_id.encode(), self.nonce)
        theirs = (self.peer_id.encode(), self.peer_nonce)
        (dialler_id, dialler_nonce), (acceptor_id, acceptor_nonce) = (
            (ours, theirs) if we_dialled else (theirs, ours)
        )
        transcript = b"\0".join((b"fbc1", dialler_id, acceptor_id, self.channel.encode()))
        transcript += dialler_nonce + acceptor_nonce
        role = b"D" if signer_dialled else b"A"
        return hmac.new(self.owner.secret, role + transcript, hashlib.sha256).digest()

    def uncount(self) -> None:
        if self.counted:
            self.counted = False
            self.owner.handshaking -= 1

    def reject(self, reason: str) -> None:
        level = logging.DEBUG if reason == "same node" else logging.WARNING
        self.send_now(REJECT, {"reason": reason})
        self.close(f"refused: {reason}", level=level)

    # -- sending ---------------------------------------------------------------------------

    def send(self, kind: int, value: Any) -> bool:
        """Queues a frame; all frames queued in one loop iteration go out in one write."""
        transport = self.transport
        if self.closed or transport is None:
            return False
        if transport.get_write_buffer_size() > WRITE_HIGH_WATER:
            self.dropped_frames += 1
            self.traffic.dropped_frames += 1
            return False
        self.pending.append(fastbroker_core.encode_frame(kind, value))
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.owner.loop.call_soon(self.flush)
        return True

    def flush(self) -> None:
        self.flush_scheduled = False
        if self.pending and not self.closed and self.transport is not None:
            data = b"".join(self.pending)
            self.count_out(len(data), len(self.pending))
            self.writes += 1
            self.transport.write(data)
        self.pending.clear()

    def write_frames(self, data: bytes, frames: int) -> None:
        """Writes frames made elsewhere (the engine's data batches) after what is queued."""
        if self.closed or self.transport is None:
            return
        if self.pending:
            self.flush()
        self.count_out(len(data), frames)
        self.transport.write(data)

    def tls_version(self) -> str | None:
        """The TLS version of this link ("TLSv1.3"), or None for plain TCP."""
        transport = self.transport
        ssl_object = transport.get_extra_info("ssl_object") if transport is not None else None
        return ssl_object.version() if ssl_object is not None else None

    def send_now(self, kind: int, value: Any) -> None:
        if self.transport is not None and not self.closed:
            data = fastbroker_core.encode_frame(kind, value)
            self.count_out(len(data), 1)
            self.transport.write(data)

    def count_out(self, nbytes: int, frames: int) -> None:
        if self.reactor_link is not None:
            # The reactor counts what it writes (`sync_counters`).
            return
        self.bytes_out += nbytes
        self.frames_out += frames
        self.traffic.bytes_out += nbytes
        self.traffic.frames_out += frames

    # -- served by the compiled connection layer ------------------------------------------

    def adopt(self, server: Any, peer: int) -> bool:
        """Hands this data link's socket to the server's reactor (fastbroker_core.Reactor,
        the compiled connection layer): from now on each batch the peer sends is fed to the
        engine, and each batch for it written, in Rust with no Python per batch (issue 15:
        the hop's cost). Only a plain TCP link whose write buffer is empty is handed over
        (TLS links stay on uvloop). What this read brought past the handshake: the frames
        already decoded are delivered by `data_received` as before, a partial frame goes
        with the socket."""
        transport = self.transport
        reactor = getattr(server, "reactor", None)
        if (
            reactor is None
            or transport is None
            or self.closed
            or not self.up
            or self.channel != DATA_CHANNEL
            or transport.get_extra_info("ssl_object") is not None
            or transport.get_write_buffer_size() > 0
            or self.pending
        ):
            return False
        sock = transport.get_extra_info("socket")
        if sock is None:
            return False
        # Imported here: the CLI imports this module from a source tree too, where the
        # compiled connection layer is not built (and no reactor runs).
        from fastbroker._connection import monotonic_ms

        fd = os.dup(sock.fileno())
        initial = self.decoder.take_buffered()
        try:
            # The reactor owns `fd` from here, also when this fails.
            link_id = reactor.adopt_link(
                fd, peer, initial, MAX_FRAME, server.engine, monotonic_ms()
            )
        except OSError as error:
            self.fail(f"the compiled layer cannot serve the data link: {error}")
            return False
        self.reactor_server = server
        self.reactor_link = link_id
        self.transport = cast(asyncio.Transport, ReactorLinkTransport(self))
        self.owner.adopted[link_id] = self
        server.reactor_links += 1
        # uvloop closes its descriptor (the socket stays open on the reactor's); its
        # connection_lost is ignored.
        transport.abort()
        # A malformed partial frame handed over ended the link at once: told soon, not at
        # the reactor's next event.
        self.owner.loop.call_soon(server.check_links)
        return True

    def sync_counters(self) -> None:
        """Adds what the reactor counted since the last call to this link's counters and
        its peer's traffic."""
        if self.reactor_link is None:
            return
        stats = self.reactor_server.reactor.link_stats(self.reactor_link)
        if stats is None:
            return
        bytes_in, bytes_out, frames_in, frames_out, last_read_ms = stats
        c_in, c_out, cf_in, cf_out = self.reactor_counted
        self.reactor_counted = (bytes_in, bytes_out, frames_in, frames_out)
        t = self.traffic
        self.bytes_in += bytes_in - c_in
        t.bytes_in += bytes_in - c_in
        self.bytes_out += bytes_out - c_out
        t.bytes_out += bytes_out - c_out
        self.frames_in += frames_in - cf_in
        t.frames_in += frames_in - cf_in
        self.frames_out += frames_out - cf_out
        t.frames_out += frames_out - cf_out
        # The reactor's clock is monotonic_ms, the loop's time() the same clock in seconds.
        self.last_received = max(self.last_received, last_read_ms / 1000)

    def reactor_ended(self, why: str) -> None:
        """The reactor ended this link (the peer closed it, a malformed frame, a close
        asked here): as uvloop's connection_lost."""
        self.sync_counters()
        self.reactor_server.reactor_links -= 1
        if why and not self.closed:
            peer = self.peer_id or "?"
            logger.warning("link to %s closed: %s", peer, why)
        self.closed = True
        self.lost = True
        self.uncount()
        self.owner.link_lost(self)

    def fail(self, why: str) -> None:
        self.close(why, level=logging.WARNING)

    def close(self, why: str, level: int = logging.INFO, *, abort: bool = False) -> None:
        """Closes the link; `abort` (a peer gone silent) drops what is still buffered, also
        for a link closed before whose buffer has not drained."""
        if self.closed:
            if abort and self.transport is not None and not self.lost:
                self.transport.abort()
            return
        self.closed = True
        peer = self.peer_id or (format_address(self.dialled) if self.dialled else "?")
        logger.log(level, "link to %s closed: %s", peer, why)
        if self.transport is None:
            return
        if abort:
            # A close waits for the write buffer to drain before the link counts as lost,
            # and a split leaves it full: the link would stay registered (and a data link
            # not redialled) until the peer's RST after the heal, seconds later. What was
            # buffered is resent from the engine's unacknowledged batches.
            self.transport.abort()
            return
        self.flush()
        self.transport.close()


class ReactorLinkTransport:
    """What a data link served by the reactor (`Link.adopt`) has of asyncio's transport:
    the few calls Link makes after its handshake (keepalives, close)."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.server = link.reactor_server
        self.link_id = link.reactor_link

    def write(self, data: bytes) -> None:
        # Whole frames, each a 4-byte length and that many bytes (keepalives, rarely more).
        frames, at = 0, 0
        while at + 4 <= len(data):
            at += 4 + int.from_bytes(data[at : at + 4], "big")
            frames += 1
        self.server.reactor.link_write(self.link_id, data, frames, self.server.engine)

    def get_write_buffer_size(self) -> int:
        return int(self.server.reactor.link_buffered(self.link_id))

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def close(self) -> None:
        self.end(abort=False)

    def abort(self) -> None:
        self.end(abort=True)

    def end(self, *, abort: bool) -> None:
        self.server.reactor.link_close(self.link_id, abort, self.server.engine)
        # As uvloop calls connection_lost: soon, not from inside the close.
        self.link.owner.loop.call_soon(self.server.check_links)


class Transport:
    """Every link of this node; `send(node_id, kind, value)` reaches a connected peer."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        *,
        node_id: str,
        cluster_name: str,
        secret: bytes,
        advertise: str,
        on_message: MessageHandler,
        on_peer_up: Callable[[str], None] | None = None,
        on_peer_down: Callable[[str], None] | None = None,
        on_writable: Callable[[str, bool], None] | None = None,
        on_data_up: Callable[[str], None] | None = None,
        on_data_down: Callable[[str], None] | None = None,
        protocol_max: int = PROTOCOL_MAX,
        tls: tuple[ssl.SSLContext, ssl.SSLContext] | None = None,
    ) -> None:
        self.loop = loop
        self.node_id = node_id
        self.cluster_name = cluster_name
        self.secret = secret
        self.advertise = advertise
        self.on_message = on_message
        self.on_peer_up = on_peer_up
        self.on_peer_down = on_peer_down
        self.on_writable = on_writable
        self.on_data_up = on_data_up
        self.on_data_down = on_data_down
        # (accepting, dialling) TLS contexts, or None for plain TCP links.
        self.tls = tls
        # Tests set a higher max to check negotiation between versions.
        self.protocol_max = protocol_max
        self.links: dict[str, Link] = {}
        # The data link of each peer (see the module's doc), and the dialling state of the
        # ones this node dials: peer -> [next attempt time, backoff].
        self.data_links: dict[str, Link] = {}
        self.data_dials: dict[str, list[float]] = {}
        # Peer -> its data link's dial in progress.
        self.data_dialling: dict[str, asyncio.Task[None]] = {}
        # Addresses we keep a link to (members, seeds): address -> next attempt time, backoff.
        self.targets: dict[tuple[str, int], list[float]] = {}
        self.dialling: set[tuple[str, int]] = set()
        # address -> node id learnt at handshake, so we do not dial a connected peer again.
        self.address_ids: dict[tuple[str, int], str] = {}
        self.blocked: set[str] = set()
        # The id of the cluster this node is in (None before it joins one): links to nodes
        # of another cluster are refused. Set by the node that owns the transport.
        self.cluster_id: Callable[[], str | None] = lambda: None
        # Why data links are refused for now, by cause (this node's store fails; it steps
        # aside in a partial split): none, they are not.
        self.data_refusals: dict[str, str] = {}
        # Peers whose data link is closed and refused for now, and why (`cut_data`).
        self.data_cut: dict[str, str] = {}
        self.handshaking = 0
        # Traffic per authenticated peer since this node started, and before authentication.
        self.traffic: dict[str, Traffic] = {}
        self.unauthenticated = Traffic()
        # A link that has received nothing for this long is closed (a half-open connection
        # to a peer that vanished); peers ping far more often. None: never.
        self.idle_timeout_s: float | None = None
        # Per peer: how long its data link had received nothing when it went down.
        self.silent_ms: dict[str, int] = {}
        self.server: asyncio.Server | None = None
        self.closing = False
        self.rng = random.Random()
        # Data links the compiled connection layer serves, by their id there (Link.adopt).
        self.adopted: dict[int, Link] = {}

    def links_ended(self, ended: list[tuple[int, str]]) -> None:
        """The reactor ended these data links (Server.links_ended_handler)."""
        for link_id, why in ended:
            link = self.adopted.pop(link_id, None)
            if link is not None:
                link.reactor_ended(why)

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        self.server = await self.loop.create_server(
            lambda: Link(self, None),
            host,
            port,
            ssl=self.tls[0] if self.tls else None,
            ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S if self.tls else None,
        )
        bound = self.server.sockets[0].getsockname()
        return bound[0], bound[1]

    async def close(self) -> None:
        self.closing = True
        if self.server is not None:
            self.server.close()
        for link in [*self.links.values(), *self.data_links.values()]:
            link.close("node stopping")
        if self.server is not None:
            await self.server.wait_closed()

    # -- dialling --------------------------------------------------------------------------

    def set_targets(self, addresses: set[tuple[str, int]]) -> None:
        """Addresses to stay connected to; others are no longer redialled (their live links
        stay, so a peer reached through a seed is kept)."""
        for address in addresses:
            self.targets.setdefault(address, [0.0, BACKOFF_MIN_S])
        for address in list(self.targets):
            if address not in addresses:
                del self.targets[address]

    def maintain(self) -> None:
        """Dials every target without a live link whose backoff has passed; called each tick."""
        if self.closing:
            return
        now = self.loop.time()
        if self.idle_timeout_s is not None:
            idle = f"nothing received for {self.idle_timeout_s:.1f} s"
            # Control links: the node's pings keep them busy.
            for link in list(self.links.values()):
                if now - link.last_received > self.idle_timeout_s:
                    link.close(idle, level=logging.WARNING, abort=True)
            # Data links: their batches or, when idle, keepalives (a version 2 peer sends
            # none; its data link goes down with its control link).
            keepalive_s = self.idle_timeout_s / 4
            for link in list(self.data_links.values()):
                link.sync_counters()
                if link.version is None or link.version < 3:
                    continue
                if now - link.last_received > self.idle_timeout_s:
                    link.close(f"data link: {idle}", level=logging.WARNING, abort=True)
                elif now - link.keepalive_at >= keepalive_s:
                    if link.bytes_out == link.keepalive_bytes:
                        link.send_now(DATA_KEEPALIVE, None)
                    link.keepalive_at = now
                    link.keepalive_bytes = link.bytes_out
        for address, state in self.targets.items():
            known = self.address_ids.get(address)
            if known is not None and known in self.links:
                continue
            if address in self.dialling or now < state[0]:
                continue
            self.dialling.add(address)
            self.loop.create_task(self.dial(address, state))
        for peer, link in self.links.items():
            # Data links are dialled by the node with the smaller id.
            if peer in self.data_links or peer in self.data_dialling or self.node_id > peer:
                continue
            if self.data_refused is not None or peer in self.data_cut:
                continue
            dial_state = self.data_dials.setdefault(peer, [0.0, BACKOFF_MIN_S])
            address = self.data_address(link)
            if address is None or now < dial_state[0]:
                continue
            self.data_dialling[peer] = self.loop.create_task(
                self.dial_data(peer, address, dial_state)
            )

    def data_address(self, link: Link) -> tuple[str, int] | None:
        """Where to dial the data link of the peer of control link `link`."""
        if link.dialled is not None:
            return link.dialled
        try:
            return parse_address(link.peer_address or "")
        except ValueError:
            return None

    async def dial_data(self, peer: str, address: tuple[str, int], state: list[float]) -> None:
        try:
            await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: Link(self, address, DATA_CHANNEL),
                    *address,
                    ssl=self.tls[1] if self.tls else None,
                ),
                HANDSHAKE_TIMEOUT_S,
            )
        except Exception as error:
            logger.debug("cannot open the data link to %s: %s", peer, error)
            self.back_off(state)
        finally:
            if self.data_dialling.get(peer) is asyncio.current_task():
                del self.data_dialling[peer]

    async def dial(self, address: tuple[str, int], state: list[float]) -> None:
        try:
            await asyncio.wait_for(
                self.loop.create_connection(
                    lambda: Link(self, address),
                    *address,
                    ssl=self.tls[1] if self.tls else None,
                ),
                HANDSHAKE_TIMEOUT_S,
            )
        except Exception as error:
            # Any failure (refused, timeout, a host name IDNA cannot encode) backs off.
            logger.debug("cannot reach %s: %s", format_address(address), error)
            self.back_off(state)
        finally:
            self.dialling.discard(address)

    def back_off(self, state: list[float]) -> None:
        # Jittered exponential backoff, so restarted nodes do not all redial in step.
        delay = state[1]
        state[0] = self.loop.time() + delay * (0.5 + self.rng.random())
        state[1] = min(delay * 2, BACKOFF_MAX_S)

    # -- link events -----------------------------------------------------------------------

    def link_up(self, link: Link) -> None:
        peer = link.peer_id
        assert peer is not None
        if link.dialled is not None:
            self.address_ids[link.dialled] = peer
            state = self.targets.get(link.dialled)
            if state is not None:
                state[:] = [0.0, BACKOFF_MIN_S]
        if link.peer_address:
            # So a peer that dialled us is not dialled back at its advertised address.
            try:
                self.address_ids[parse_address(link.peer_address)] = peer
            except ValueError:
                pass
        existing = self.links.get(peer)
        if existing is not None and not existing.closed:
            # Simultaneous dials: keep the link dialled by the smaller node id.
            keep_new = (link.dialled is not None) == (self.node_id < peer)
            if not keep_new:
                link.close("duplicate link", level=logging.DEBUG)
                return
            existing.close("duplicate link", level=logging.DEBUG)
        self.links[peer] = link
        logger.info(
            "link to %s (%s) up, protocol %d", peer, link.peer_address or "?", link.version or 0
        )
        if self.on_peer_up is not None:
            self.on_peer_up(peer)

    @property
    def data_refused(self) -> str | None:
        """Why data links are refused now (the first cause's reason), or None."""
        return next(iter(self.data_refusals.values()), None)

    def refuse_data(self, reason: str | None, cause: str = "store") -> None:
        """Closes the data links and refuses new ones while a `reason` is set for any
        `cause`; control links (membership) stay."""
        if reason is None:
            self.data_refusals.pop(cause, None)
            return
        self.data_refusals[cause] = reason
        for link in list(self.data_links.values()):
            link.close(f"data link closed: {reason}", level=logging.WARNING)

    def cut_data(self, peer: str, reason: str | None) -> None:
        """Closes the data link to `peer` at once and opens none with it while a `reason`
        is set: a peer this node no longer hears (a partial split). What the link buffered
        is resent from the engine's unacknowledged batches."""
        if reason is None:
            self.data_cut.pop(peer, None)
            return
        self.data_cut[peer] = reason
        link = self.data_links.get(peer)
        if link is not None:
            link.close(f"data link closed: {reason}", level=logging.WARNING, abort=True)
        dialling = self.data_dialling.pop(peer, None)
        if dialling is not None:
            dialling.cancel()

    def data_link_up(self, link: Link) -> None:
        peer = link.peer_id
        assert peer is not None
        refused = self.data_refused or self.data_cut.get(peer)
        if refused is not None:
            link.close(f"data link refused: {refused}", level=logging.DEBUG)
            return
        if peer not in self.links or (link.dialled is None) == (self.node_id < peer):
            # Only with a control link up, and only dialled by the node with the smaller id.
            link.close("data link without its control link", level=logging.DEBUG)
            return
        existing = self.data_links.get(peer)
        self.data_links[peer] = link
        self.data_dials.pop(peer, None)
        if existing is not None:
            # A redial (the old one is dead and not noticed yet): the new one replaces it.
            existing.close("replaced by a new data link", level=logging.DEBUG)
        if self.on_data_up is not None:
            self.on_data_up(peer)

    def link_lost(self, link: Link) -> None:
        if link.channel == DATA_CHANNEL:
            peer = link.peer_id
            if peer is not None and self.data_links.get(peer) is link:
                del self.data_links[peer]
                # How long the peer had been silent: after a split, long enough for it to
                # have taken this node's sessions over (the engine's `cluster_link_lost`).
                silent = self.loop.time() - link.last_received
                self.silent_ms[peer] = max(0, int(silent * 1000))
                if self.on_data_down is not None:
                    self.on_data_down(peer)
            return
        if link.dialled is not None:
            # Also after a link that came up: one that keeps being closed (a duplicate, a
            # peer that drops it) must not be redialled every tick.
            state = self.targets.get(link.dialled)
            if state is not None:
                self.back_off(state)
        peer = link.peer_id
        if peer is not None and self.links.get(peer) is link:
            del self.links[peer]
            if not self.closing:
                logger.info("link to %s down", peer)
            data = self.data_links.get(peer)
            if data is not None:
                data.close("control link down", level=logging.DEBUG, abort=True)
            # A dial of the data link still waiting (its peer went silent as the dial began:
            # a split) would hold up the next one, once the control link is back, until its
            # timeout: the new one goes at once.
            dialling = self.data_dialling.pop(peer, None)
            if dialling is not None:
                dialling.cancel()
            self.data_dials.pop(peer, None)
            if self.on_peer_down is not None:
                self.on_peer_down(peer)

    def link_writable(self, link: Link, writable: bool) -> None:
        peer = link.peer_id
        if peer is not None and self.data_links.get(peer) is link and self.on_writable is not None:
            self.on_writable(peer, writable)

    def deliver(self, link: Link, kind: int, value: Any) -> None:
        peer = link.peer_id
        if peer is None or peer in self.blocked:
            return
        if kind == DATA_KEEPALIVE and link.channel == DATA_CHANNEL:
            return
        if (kind == DATA_FRAME) != (link.channel == DATA_CHANNEL):
            link.fail(f"frame kind {kind} on a {link.channel} link")
            return
        try:
            self.on_message(peer, kind, value)
        except Exception:
            # A bad message from one peer must not take the node down.
            logger.exception("error handling frame kind %d from %s", kind, peer)

    # -- sending ---------------------------------------------------------------------------

    def send(self, node_id: str, kind: int, value: Any) -> bool:
        link = self.links.get(node_id)
        if link is None or node_id in self.blocked:
            return False
        return link.send(kind, value)

    def traffic_of(self, peer: str) -> Traffic:
        traffic = self.traffic.get(peer)
        if traffic is None:
            traffic = self.traffic[peer] = Traffic()
        return traffic

    def connected(self) -> list[str]:
        return sorted(self.links)

    def block(self, node_ids: set[str]) -> None:
        """Fault injection: cut and refuse links to these nodes (an empty set heals)."""
        self.blocked = set(node_ids)
        for links in (self.links, self.data_links):
            for peer in list(links):
                if peer in self.blocked:
                    links[peer].close("link blocked by fault injection", level=logging.WARNING)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per peer with a control link: its traffic, and its data link's (None if down),
        which the compiled connection layer may serve (`compiled`, Link.adopt)."""
        out: dict[str, dict[str, Any]] = {}
        for peer, link in self.links.items():
            data = self.data_links.get(peer)
            if data is not None:
                data.sync_counters()
            out[peer] = {
                "bytes_in": link.bytes_in,
                "bytes_out": link.bytes_out,
                "frames_in": link.frames_in,
                "frames_out": link.frames_out,
                "dropped_frames": link.dropped_frames,
                "protocol": link.version or 0,
                "tls": link.tls_version(),
                "data_link": data is not None,
                "data": None
                if data is None
                else {
                    "bytes_in": data.bytes_in,
                    "bytes_out": data.bytes_out,
                    "frames_in": data.frames_in,
                    "frames_out": data.frames_out,
                    "compiled": data.reactor_link is not None,
                },
            }
        return out
