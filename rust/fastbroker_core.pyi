"""Compiled data plane of fastbroker: MQTT codec and broker engine (Rust, PyO3)."""

from typing import Any, ClassVar, final

__version__: str

class CodecError(ValueError):
    """The byte stream is not valid MQTT; ``reason_code`` is the MQTT 5 reason code.

    0x81 malformed packet, 0x82 protocol error, 0x84 unsupported protocol name or level (a
    CONNECT), 0x90 topic name with a wildcard, 0x95 packet larger than ``max_packet_size``.
    """

    reason_code: int

@final
class Decoder:
    """Incremental MQTT decoder: feed any split of a byte stream, get whole packets.

    Packets are dicts: ``{"type": "publish", "topic": ..., "payload": ..., "properties":
    {...}, ...}`` (see ``encode_packet`` for the keys of each type).
    """

    def __new__(cls, protocol: int = 5, max_packet_size: int = 268435460) -> Decoder:
        """``protocol`` 4 (MQTT 3.1.1) or 5; ``max_packet_size`` bounds a whole packet, fixed
        header included, and is checked as soon as the fixed header has arrived."""
    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Appends ``data`` and returns every whole packet now available (may be empty).

        Raises CodecError when the stream is broken; packets decoded earlier in the same call
        are then lost, and every later call raises the same error. After a CONNECT the
        decoder switches to that CONNECT's protocol level.
        """
    @property
    def buffered(self) -> int:
        """Bytes held waiting for the rest of a packet."""
    @property
    def protocol(self) -> int:
        """The protocol level in use now: 4 or 5."""

def encode_packet(packet: dict[str, Any], protocol: int = 5) -> bytes:
    """Encodes one packet dict (as returned by ``Decoder.feed``) for protocol 4 or 5.

    Raises ValueError for an unknown type or property, a missing required key, a value out of
    range (QoS 3, ...) or a string longer than 65,535 bytes; TypeError or OverflowError for a
    value of the wrong type or size. Missing optional keys and ``None`` take the defaults
    below (in brackets); ``Decoder.feed`` always returns every key.

    ``"type"`` and the other keys per type:

    - ``connect``: protocol (4 or 5) [the ``protocol`` argument: a CONNECT is encoded with its
      own level], clean_start [True], keep_alive [0], client_id [""], will (None or dict:
      topic, payload [b""], qos [0], retain [False], properties [{}]), username (str | None),
      password (bytes | None), properties.
    - ``connack``: session_present [False], reason_code [0], properties. reason_code is the
      MQTT 5 code for both versions: for 3.1.1 it is mapped to return codes 0..5 on encode
      and back (0x84, 0x85, 0x88, 0x86, 0x87 for 1..5) on decode.
    - ``publish``: dup [False], qos [0], retain [False], topic (str; bytes also accepted on
      encode; "" with a topic_alias property in MQTT 5), pkid (required for QoS 1 and 2, 0 for
      QoS 0), properties, payload (bytes) [b""]. DUP is never written for QoS 0.
    - ``puback``, ``pubrec``, ``pubrel``, ``pubcomp``: pkid, reason_code [0], properties. MQTT
      5 uses the short forms when reason_code is 0 and there are no properties.
    - ``subscribe``: pkid, filters (list of dicts: filter, qos [0], no_local [False],
      retain_as_published [False], retain_handling 0..2 [0]), properties.
    - ``suback``: pkid, reason_codes (list of int), properties. For 3.1.1 every code >= 0x80
      is written as 0x80.
    - ``unsubscribe``: pkid, filters (list of str), properties.
    - ``unsuback``: pkid, reason_codes (list of int, MQTT 5 only) [[]], properties.
    - ``pingreq``, ``pingresp``: no other key.
    - ``disconnect``, ``auth``: reason_code [0], properties. ``auth`` is MQTT 5 only.

    ``properties`` [{}] is a dict keyed by MQTT 5 property name, written only for MQTT 5
    (always ``{}`` when decoding 3.1.1); absent properties are left out. Ints:
    payload_format_indicator, message_expiry_interval, session_expiry_interval,
    server_keep_alive, request_problem_information, will_delay_interval,
    request_response_information, receive_maximum, topic_alias_maximum, topic_alias,
    maximum_qos, retain_available, maximum_packet_size, wildcard_subscription_available,
    subscription_identifier_available, shared_subscription_available. Strings: content_type,
    response_topic, assigned_client_identifier, authentication_method,
    response_information, server_reference, reason_string. Bytes: correlation_data,
    authentication_data. Lists: subscription_identifiers (list of int), user_properties
    (list of ``[key, value]`` string pairs, in order, repeats allowed).
    """

FEED_HOLD: int
"""``Engine.feed`` result bit (1): stop reading the connection until ``take_resumed`` lists
it."""
FEED_PUBLISHER: int
"""``Engine.feed`` result bit (2): the connection has sent at least one PUBLISH."""

@final
class Permissions:
    """What a connection may do: allow-only rules ``(rights, topic filter)``; whatever no rule
    grants is denied. Immutable; one object may serve many connections.

    Rights are a mask of ``PUBLISH`` (1: publish to topics the filter matches), ``SUBSCRIBE``
    (2: subscribe to filters inside the filter: ``a/#`` covers ``a/b/+``, ``a/+`` does not
    cover ``a/#``; a ``$share/g/f`` subscription is judged by ``f``) and ``READ`` (4: receive
    messages on topics the filter matches). Filters are plain (no ``$share/``); a filter
    starting with a wildcard grants no ``$`` topic. Substitutions such as ``%c`` are the
    caller's to make.
    """

    PUBLISH: ClassVar[int]
    SUBSCRIBE: ClassVar[int]
    READ: ClassVar[int]

    def __new__(cls, rules: list[tuple[int, str]]) -> Permissions:
        """Raises ValueError naming the first bad rule (invalid or shared filter, rights
        outside 0..7)."""
    @property
    def rules(self) -> list[tuple[int, str]]:
        """The rules as given."""
    def allows(self, right: int, topic: str) -> bool:
        """Whether ``right`` (one of PUBLISH, SUBSCRIBE, READ) is granted on topic ``topic``."""
    def covers(self, right: int, filter: str) -> bool:
        """Whether every topic ``filter`` can match is granted ``right``."""

@final
class Engine:
    """The broker: sessions, subscriptions, retained messages, QoS flows, all in Rust.

    Sans-I/O: the caller owns the sockets. It reports new connections (``open``), bytes read
    (``feed``), closed connections (``closed``) and time (``tick``); it takes the bytes to
    write and the connections to close from ``drain``. One ``feed`` handles every packet in
    the bytes given, however many PUBLISH packets they hold.
    """

    def __new__(cls, config: dict[str, Any] | None = None) -> Engine:
        """``config`` keys (all optional): max_packet_size, max_keepalive, receive_maximum,
        max_inflight, max_queued_messages, max_queued_bytes, topic_alias_maximum,
        outgoing_topic_aliases, maximum_qos, retain_available, max_session_expiry,
        connect_timeout_ms, denied_subscriptions (list of filters), max_client_id_len,
        version (str, for $SYS), max_retained_messages, max_retained_size, durable,
        compress_above, and these, all off by default:

        - ``auth_required`` (bool): every CONNECT waits for ``auth_done`` (see
          ``auth_requests``).
        - ``max_connections`` (int, 0 = no limit): a CONNECT when this many connections are
          up is refused, MQTT 5 0x97, 3.1.1 return code 3 (a takeover does not count twice).
        - ``max_publish_rate`` (int, PUBLISH per second per connection, 0 = no limit; burst =
          the rate): past it the connection is held (``FEED_HOLD``), nothing is dropped.
        - ``max_conn_buffer`` (int, bytes, default 1 MiB): a connection waiting for its
          authentication decision is held past this much buffered input.
        - ``intercept`` (bool): client publishes wait in ``take_intercepted`` for
          ``release``.
        - ``max_intercepted`` (int, default 64): a connection with this many publishes
          pending release is held.

        Unknown keys or bad values raise ValueError."""
    def open(self, now_ms: int) -> int:
        """A new network connection; returns its connection id."""
    def feed(self, conn: int, data: bytes, now_ms: int) -> int:
        """Bytes read from connection ``conn``; returns ``FEED_HOLD`` | ``FEED_PUBLISHER``
        bits. After ``FEED_HOLD`` the caller stops reading ``conn`` until ``take_resumed``
        lists it (its bytes stay buffered in the engine; a held connection is not timed out
        by its keepalive). Without limits configured the result is 0 or FEED_PUBLISHER."""
    def closed(self, conn: int, now_ms: int, reason: str | None = None) -> None:
        """The connection is gone (by the peer or after ``drain`` asked to close it);
        ``reason`` is the access log's reason when the engine did not ask for it (default
        "connection lost")."""
    def close_all(self, detail: str, now_ms: int, server_reference: str | None = None) -> None:
        """The broker is stopping: every connection is asked to close (see ``drain``), MQTT 5
        clients first getting DISCONNECT 0x8B, or 0x9C "use another server" with
        ``server_reference`` when one is given; wills are published."""
    def cluster_start(self, epoch: int, node: str) -> None:
        """Turns the cluster part on; ``epoch`` is this process's incarnation (random,
        non-zero), so peers tell its batches from those of an earlier run; ``node`` is the
        node's id, the same on every start (it orders concurrent retained writes)."""
    def cluster_require_map(self) -> None:
        """CONNECTs are refused (0x88; 3.1.1: 0x03) until the first partition map is set: a
        node that has not joined its cluster yet would make fresh sessions for clients
        whose sessions live on in the cluster."""
    def cluster_step_aside(self, on: bool, now_ms: int) -> None:
        """This node stepped aside in a partial split (``on``), or no longer: meanwhile, and
        for the takeover time after, a CONNECT that resumes a session is refused (0x88), so
        that no stale or fresh version here wins over the one its peers serve."""
    def cluster_peer_alive(self, peer: int, alive: bool) -> None:
        """The control plane hears ``peer`` (directly, or through a member that hears it),
        or no longer: while its data link is down it is not taken for dead, so no session it
        may hold is started afresh here and no will of its connections is published here."""
    def cluster_store_recovered(self, now_ms: int) -> None:
        """This node's store works again after failing (a full disk): CONNECTs are refused
        (0x88) until the map changes or the failure timeout passes, as after a pause: its
        peers took it for dead meanwhile, and a CONNECT held unread must not take a
        session over from where it lives on now."""
    def cluster_add_peer(self, name: str) -> int:
        """The number of peer node ``name`` (the same for the same name), added if new."""
    def cluster_remove_peer(self, peer: int) -> None:
        """Forgets a peer that left the cluster: its route rows and what is queued for it."""
    def cluster_link(self, peer: int, up: bool) -> None:
        """The link to ``peer`` came up or went down. Up: unacknowledged batches are sent
        again, then a snapshot of this node's route rows."""
    def cluster_link_lost(self, peer: int, silent_ms: int) -> None:
        """The link to ``peer`` went down after nothing came on it for ``silent_ms``: as
        ``cluster_link(peer, False)``; back after a silence of half the failure timeout, the
        sessions here that ``peer`` may have taken over wait for its word."""
    def cluster_hand_over_all(self, now_ms: int) -> int:
        """This node left the cluster and closed its connections: every session it holds
        goes to the first owner of its partition that is up. Returns how many."""
    def cluster_relays(self) -> int:
        """Sessions this node still relays for after handing them over."""
    def cluster_set_writable(self, peer: int, writable: bool) -> None:
        """The link's write buffer went over (False) or back under (True) its high mark."""
    def claim_stats(self) -> dict[str, int]:
        """Claims of client ids between nodes: made, timed_out, sessions_in, sessions_out."""
    def will_stats(self) -> dict[str, int]:
        """Wills of other nodes' connections held here: held, published, refused."""
    def cluster_set_protocol(self, peer: int, version: int) -> None:
        """The inter-node protocol version agreed on the peer's link (2 until told)."""
    def kick(self, client_id: str, cluster: bool, now_ms: int) -> bool:
        """Ends the client's connection (MQTT 5: DISCONNECT 0x98) and session here and, with
        ``cluster``, on every reachable peer of protocol 3; True if this node held it."""
    def session_state(self, client_id: str) -> str | None:
        """ "connected" or "disconnected" if this node holds a session of the client (one
        that moved to another node and only relays there does not count), else None."""
    def has_cluster_output(self) -> bool:
        """Whether ``drain_cluster`` has anything to hand out."""
    def drain_cluster(self) -> list[tuple[int, bytes]]:
        """(peer, frame) for every frame due to a peer whose link can take it now: whole
        frames of the inter-node protocol, written to the link as they are."""
    def cluster_feed(self, peer: int, data: bytes, now_ms: int) -> None:
        """A data-plane batch from ``peer`` (the value of its DATA frame): routes its
        messages here, applies its route rows. ValueError for a malformed batch, which then
        changes nothing (drop the link)."""
    def has_cluster_loads(self) -> bool:
        """Whether spilled batches of a peer whose link is up are to be read back."""
    def cluster_loads(self) -> list[tuple[int, list[bytes]]]:
        """Per peer, the store keys of its spilled batches to read back next, in order."""
    def cluster_loaded(self, peer: int, records: list[tuple[bytes, bytes | None]]) -> list[str]:
        """The records read for ``cluster_loads`` (None: missing); returns problems (batches
        lost: missing or damaged records)."""
    def cluster_set_map(self, version: int, owners: list[list[int]], now_ms: int) -> None:
        """The partition map: per partition its owners (primary first) as peer numbers, -1 for
        this node. Sessions are copied to the other owners of their client id's partition."""
    def cluster_set_members(self, members: list[int]) -> None:
        """The cluster's agreed members as peer numbers, -1 for this node: the side of a split
        that reaches more than half of them (or half, with the first by name) acts on what
        both sides hold; the other waits (docs/cluster-sessions.md)."""
    def has_copy_loads(self) -> bool:
        """Whether session copies are to be read back from the store (``copy_loads``)."""
    def copy_loads(self) -> list[tuple[str, list[bytes]]]:
        """Per client id, the store keys of its copy to read back (to answer a claim, or to
        take the session over from a dead home)."""
    def copy_loaded(
        self, client_id: str, records: list[tuple[bytes, bytes | None]], now_ms: int
    ) -> list[str]:
        """The records read for ``copy_loads`` (None: missing); returns problems."""
    def replica_stats(self) -> dict[str, int]:
        """Session copies: copies, ops_out, ops_in, degraded_acks, stale_refused, fenced,
        claims_served, takeovers, streamed, stream_backlog, taken_elsewhere,
        released_taken, handed_on, checks_out."""
    def cluster_stats(self) -> list[dict[str, Any]]:
        """Per peer: node_id, up, frames/messages/bytes in and out, resent, dropped,
        route_rows, unacked_bytes, retained_synced (its retained set has arrived since its
        link came up), publisher_holds (publishers held because its queue was full),
        spilled_bytes (of its queue, only in the store) and read_back (spilled batches read
        back from the store)."""
    def cluster_local_rows(self) -> int:
        """Route rows this node announces (distinct filters of its sessions)."""
    def take_resumed(self) -> list[int]:
        """Held connections that may be read again, since the last call."""
    def has_resumed(self) -> bool:
        """Whether ``take_resumed`` has anything to return."""
    def has_auth_requests(self) -> bool:
        """Whether ``auth_requests`` has anything to return."""
    def auth_requests(
        self,
    ) -> list[tuple[int, str, str, str | None, bytes | None, int, str | None, bytes | None]]:
        """Authentication questions since the last call: ``(conn, kind, client_id, username,
        password, protocol_level, auth_method, auth_data)``. ``kind`` is "connect" (a
        CONNECT; ``client_id`` is the one the engine assigns when it was empty), "auth" (the
        client's AUTH 0x18 answer after ``auth_continue``) or "reauth" (MQTT 5 AUTH 0x19 on
        an established connection). Each is answered by ``auth_done`` or ``auth_continue``;
        until then a connecting client's input is buffered and the connect timeout runs. A
        closed connection's id is not reused before its answer (or 60 s)."""
    def auth_done(
        self,
        conn: int,
        reason_code: int,
        permissions: Permissions | None = None,
        now_ms: int = 0,
        auth_method: str | None = None,
        auth_data: bytes | None = None,
        reason: str | None = None,
    ) -> None:
        """The decision on ``conn``'s request. 0 accepts: the CONNECT goes on (takeover,
        session, CONNACK carrying ``auth_method``/``auth_data`` for MQTT 5) and input buffered
        meanwhile is handled; for "reauth", AUTH 0x00 is sent. Any other code refuses with
        that MQTT 5 reason code (3.1.1: 0x86 -> 4, 0x87 -> 5, 0x84 -> 1, 0x85 -> 2, others ->
        3), ``reason`` as reason string if the client allows it, then closes; for "reauth",
        DISCONNECT with the code. ``permissions`` replaces the connection's (None = all
        allowed); a will whose topic they do not let the client publish refuses the CONNECT
        with 0x87. Unknown or closed connections are ignored. Check ``has_output`` after."""
    def auth_continue(
        self, conn: int, auth_method: str, auth_data: bytes | None, now_ms: int
    ) -> None:
        """Sends AUTH 0x18 (continue authentication) with ``auth_method`` and ``auth_data``;
        the client's AUTH answer becomes an "auth" request (another method: refused with
        0x8C). Refuses with 0x8C a CONNECT that had no Authentication Method."""
    def set_permissions(self, conn: int, permissions: Permissions | None) -> None:
        """Replaces ``conn``'s permissions for its next publishes, subscribes and
        deliveries."""
    def has_intercepted(self) -> bool:
        """Whether ``take_intercepted`` has anything to return."""
    def take_intercepted(
        self,
    ) -> list[tuple[int, int, str, str | None, str, bytes, int, bool]]:
        """Client publishes intercepted since the last call (config ``intercept``), in
        arrival order: ``(ticket, conn, client_id, username, topic, payload, qos, retain)``.
        Tickets increase. None is routed or acknowledged before its ``release``."""
    def release(
        self,
        ticket: int,
        action: int,
        topic: str | None = None,
        payload: bytes | None = None,
        now_ms: int = 0,
    ) -> None:
        """Decides an intercepted publish: ``action`` 0 routes it (``topic``/``payload``
        replace the message's when given; an invalid topic makes it 2), 1 drops it
        (acknowledged as a success), 2 denies it (MQTT 5 PUBACK/PUBREC 0x87, 3.1.1 positive).
        The PUBACK / PUBREC goes out now. A message whose publisher has gone is still routed
        on 0. Unknown tickets are ignored; another action raises ValueError."""
    def has_access_events(self) -> bool:
        """Whether ``take_access_events`` has anything to return."""
    def take_access_events(self) -> list[tuple[str, int, str, str | None, int, int, str]]:
        """Access log since the last call: ``(kind, conn, client_id, username,
        protocol_level, reason_code, reason)``. ``kind``: "connect" (accepted, code 0);
        "refused" (CONNACK with an error code, or closed before CONNACK: malformed CONNECT,
        connect timeout, gone during authentication; code 0 when no code was sent);
        "disconnect" (every end of an accepted connection: the client's DISCONNECT code,
        0x8D keepalive timeout, 0x8E takeover, a protocol error's code, 0 for "connection
        lost"). Every accepted connection gets one "connect" and one "disconnect". Protocol
        level 0: no CONNECT was read. At most 100,000 are kept (the oldest dropped, counted
        in stats ``access_events_dropped``)."""
    def set_writable(self, conn: int, writable: bool, now_ms: int) -> None:
        """Transport write buffer above (False) or back below (True) its high-water mark."""
    def tick(self, now_ms: int) -> None:
        """Time passes: keepalive and connect timeouts, will delays, session and message
        expiry."""
    def publish(self, topic: str, payload: bytes, qos: int, retain: bool, now_ms: int) -> None:
        """Publishes a message from the broker itself (for example ``$SYS`` topics)."""
    def has_output(self) -> bool:
        """Whether ``drain`` has anything to return."""
    def drain(self) -> list[tuple[int, bytes, int]]:
        """Output since the last call: ``(conn, data, close)`` per connection, ``data``
        possibly empty; ``close`` is 0 (keep it open), 1 (close after writing ``data``: the
        client asked) or 2 (the broker ends it: write ``data``, half-close, and read until
        the client closes or a short linger passes)."""
    def set_wall_clock(self, wall_ms: int, now_ms: int) -> None:
        """Pairs the wall-clock time (ms since the epoch) with the monotonic ``now_ms``: stored
        times are wall-clock. Call at start and now and then (the clocks drift)."""
    def has_store_ops(self) -> bool:
        """Whether ``take_store_ops`` has anything to return."""
    def take_store_ops(self) -> list[tuple[bytes, bytes | None]]:
        """Store operations since the last call (``None`` deletes the key), for one atomic
        write that must complete before the next ``drain``: the output may depend on it."""
    def store_failed(self, now_ms: int) -> list[int]:
        """The batch last taken could not be written: clears the output of the connections
        whose QoS 1/2 publishes were in it (no acknowledgement goes out) and returns them
        for the caller to disconnect."""
    def restore(self, records: list[tuple[bytes, bytes]]) -> list[tuple[bytes, str]]:
        """Takes stored records at start-up, before any connection; returns the damaged ones
        with the reason (skipped: reported, never delivered)."""
    def finish_restore(self, now_ms: int) -> dict[str, int]:
        """Rebuilds the state ``restore`` took; returns counts: sessions, messages, inflight,
        retained, orphans, expired_sessions."""
    def events(self) -> list[tuple[str, str, str]]:
        """Log events since the last call: ``(kind, client_id, detail)``, kind one of
        ``connect``, ``disconnect``, ``takeover``, ``protocol_error``, ``connect_refused``,
        ``retained_refused``, ``publish_denied`` (detail: the topic), ``subscribe_denied``
        (detail: the filter)."""
    def stats(self) -> dict[str, int]:
        """Counters: clients_connected, sessions, subscriptions, retained, messages_received,
        messages_sent, bytes_received, bytes_sent, publish_dropped, inflight, queued,
        queued_bytes, publish_denied, subscribe_denied, connections_refused,
        access_events_dropped, held_connections, intercepted_pending, auth_pending."""

# ---- cluster wire format: frames between nodes ----------------------------------------------
#
# A frame is a u32 big-endian length of what follows, a u8 kind, then one value. Values are
# self-describing: None, bool, int (-2**63 .. 2**63-1), float (bits kept: NaN payloads, -0.0),
# str, bytes, list, dict (keys of any of these types, in order). Tuples are encoded as lists;
# decoding gives lists, except inside dict keys, where lists become tuples (so that they can be
# keys again). bytearray is encoded as bytes. Lists and dicts nest at most 64 deep. Every
# value has exactly one encoding.

class FrameError(ValueError):
    """Bytes from a peer are not a valid frame or value: drop the connection."""

def encode_value(value: object) -> bytes:
    """The encoding of ``value``.

    Raises ValueError for an unsupported type (set, object(), ...), an int outside the i64
    range, a str with a lone surrogate, or nesting deeper than 64 (a list holding itself
    included).
    """

def decode_value(data: bytes | bytearray) -> object:
    """The value encoded in all of ``data``.

    Raises FrameError when ``data`` is malformed: unknown tag, truncated, invalid UTF-8, a
    varint over 64 bits or not minimal, bytes after the value, nesting deeper than 64, or a
    dict key that Python cannot hash (a dict).
    """

def encode_frame(kind: int, value: object) -> bytes:
    """One whole frame of ``kind`` (0..255) and ``value``.

    Raises ValueError when ``kind`` is not in 0..255, and as ``encode_value`` does.
    """

@final
class FrameDecoder:
    """Incremental frame decoder over one connection: feed any split of the byte stream, get
    whole frames."""

    def __new__(cls, max_frame: int = 16777216) -> FrameDecoder:
        """``max_frame`` (at least 1) bounds a frame's announced length (kind and value, not
        the 4-byte length itself); a longer frame is refused as soon as its length arrives."""
    def feed(self, data: bytes | bytearray) -> list[tuple[int, object]]:
        """Appends ``data`` and returns every whole frame now available as ``(kind, value)``,
        in order (may be empty); a partial frame stays buffered.

        Raises FrameError on a malformed or oversized frame; frames decoded earlier in the
        same call are then lost, and every later call raises the same error (the caller drops
        the connection).
        """
    @property
    def buffered(self) -> int:
        """Bytes held waiting for the rest of a frame."""
    def take_buffered(self) -> bytes:
        """Takes the bytes held (a partial frame), leaving the decoder empty: what another
        decoder of the stream (a link handed to ``Reactor.adopt_link``) starts from."""

# --- WebSocket ---------------------------------------------------------------------------
# Server-side framing of MQTT over WebSocket (RFC 6455). The opening handshake is done in
# Python (fastbroker.websocket); every frame after it goes through this codec.

@final
class WebSocketCodec:
    """The frames of one WebSocket connection, server side.

    Client frames are decoded as a stream: the payload of binary and continuation frames is
    returned as soon as its bytes arrive, whatever the frame and read boundaries; only a
    partial frame header or control frame is held between calls.
    """

    def __new__(cls, max_message_size: int = 268435460) -> WebSocketCodec:
        """``max_message_size`` (at least 1) bounds one frame's payload and one fragmented
        message's total; past it the connection is closed with status 1009."""
    def decode(self, data: bytes | bytearray) -> tuple[bytes, bytes, int | None]:
        """Decodes ``data``, the next bytes from the client: returns ``(payload, replies,
        close_code)``.

        ``payload``: the application bytes (the MQTT stream) in ``data``. ``replies``: frames
        to send back (a pong per ping, a close frame). ``close_code``: None while the
        connection stays open; else the status code of the close that ends it, after
        ``replies`` is written: the client's own (echoed; 1005 when its close frame had no
        code) or the one for the violation found: 1002 protocol error (an unmasked frame,
        reserved bits, unknown opcode, a fragmented or over-125-byte control frame, a
        continuation outside a message, an invalid close code), 1003 a text frame (MQTT is
        binary), 1007 a close reason that is not UTF-8, 1009 too big. Once closed, every
        later call returns ``(b"", b"", code)`` with the same code.
        """
    def encode(self, data: bytes | bytearray) -> bytes:
        """``data`` as one unmasked binary frame with FIN set (minimal length encoding)."""
    def close_frame(self, code: int = 1000, reason: str = "") -> bytes:
        """A close frame with ``code`` and ``reason`` (cut to fit 123 bytes on a character
        boundary). Raises ValueError for a code that may not be sent: only 1000-1003, 1007-1014
        and 3000-4999 may."""
    @property
    def closed(self) -> int | None:
        """The close code once decoding has ended (as ``decode`` returned it), else None."""
    @property
    def buffered(self) -> int:
        """Bytes held from a partial frame header or control frame."""

@final
class Reactor:
    """The compiled connection layer (issue 18): plain TCP client sockets on one epoll set,
    accepted, read into an Engine and written in Rust. The event loop watches ``fileno()``
    and calls ``poll``; the connection layer's flush calls ``drain`` once per iteration.
    Connection ids are the engine's; sockets of the other layer share the engine."""

    def __new__(
        cls,
        read_budget: int,
        write_high: int,
        linger_ms: int,
        max_sockets: int = 0,
        connection_rate: float = 0.0,
    ) -> Reactor:
        """``read_budget``: bytes read from one socket per poll; ``write_high``: buffered
        bytes past which the engine is told a socket is not writable (again writable at a
        quarter); ``linger_ms``: how long a socket the broker ends is read after its last
        packet; ``max_sockets`` (0: none) and ``connection_rate`` (accepts per second, 0:
        none) are checked at accept, counting the other layer's sockets too."""
    def fileno(self) -> int:
        """The epoll set's descriptor."""
    def add_listener(self, fd: int) -> int:
        """Accepts on a bound, listening socket (a duplicate is kept); returns its index."""
    def close_listener(self, index: int) -> None: ...
    def poll(self, engine: Engine, now_ms: int, external: int) -> bool:
        """Accepts, reads into ``engine``, writes buffered output, ends sockets; ``external``:
        the other layer's open sockets. Returns whether the engine may have output."""
    def drain(self, engine: Engine, now_ms: int) -> tuple[list[tuple[int, bytes, int]], bool]:
        """Writes the engine's output for the sockets here; returns the rest (as
        ``Engine.drain`` gives it) and whether to flush again."""
    def adopt_link(
        self, fd: int, peer: int, initial: bytes, max_frame: int, engine: Engine, now_ms: int
    ) -> int:
        """Serves an established cluster data link to engine peer ``peer`` from now on:
        ``fd`` becomes the reactor's; ``initial`` is what was read past the handshake.
        Each DATA frame read is fed to the engine (``Engine.cluster_feed``), each frame the
        engine makes for the peer is written by ``drain_cluster``. Returns the link's id."""
    def link_write(self, link: int, data: bytes, frames: int, engine: Engine) -> bool:
        """Queues ``frames`` whole frames on a link (keepalives); False if it is gone."""
    def link_close(self, link: int, abort: bool, engine: Engine) -> None:
        """Ends a link at once (``abort``) or once its buffer is sent."""
    def link_buffered(self, link: int) -> int:
        """Bytes the link holds that its socket did not take yet."""
    def link_stats(self, link: int) -> tuple[int, int, int, int, int] | None:
        """(bytes_in, bytes_out, frames_in, frames_out, last read in ms) since adoption,
        or None for an ended link."""
    def take_ended_links(self) -> list[tuple[int, str]]:
        """Links ended since the last call and why (empty: the peer closed it)."""
    def drain_cluster(self, engine: Engine) -> list[tuple[int, bytes]]:
        """``Engine.drain_cluster``: frames for peers whose link is served here are written;
        the rest are returned."""
    def owns(self, conn: int) -> bool: ...
    def peer(self, conn: int) -> tuple[tuple[str, int], int, int] | None:
        """((host, port), listener index, serial) of a socket open here, or ended since
        ``take_closed``; the serial tells sockets that had the same id apart."""
    def take_closed(self) -> list[int]:
        """The ids of the sockets ended since the last call."""
    def resume(self, conn: int) -> None:
        """A socket the engine held (``Engine.take_resumed``) is read again."""
    def set_memory_pressure(self, pressure: bool) -> int:
        """Publishers are not read under pressure; returns how many are read again."""
    def memory_held(self) -> int: ...
    def set_reading(self, reading: bool) -> None:
        """False: no socket is read (the store fails)."""
    def tick(self, engine: Engine, now_ms: int) -> bool:
        """Ends the sockets whose linger passed; returns whether any ended."""
    def linger_all(self, engine: Engine, now_ms: int) -> None:
        """The broker stops: every open socket lingers after its output."""
    def abort_all(self, engine: Engine, now_ms: int) -> None: ...
    def abort(self, conn: int, engine: Engine, now_ms: int) -> None: ...
    def admit_external(self, now_ms: int, external: int) -> bool:
        """Whether a socket of the other layer may be served (the shared cap and rate)."""
    def listener_counts(self) -> list[int]: ...
    @property
    def count(self) -> int: ...
    @property
    def refused(self) -> int: ...
