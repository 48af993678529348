"""Compiled data plane of fastbroker: MQTT codec and broker engine (Rust, PyO3)."""

from typing import Any

__version__: str

class CodecError(ValueError):
    """The byte stream is not valid MQTT; ``reason_code`` is the MQTT 5 reason code."""

    reason_code: int

class Decoder:
    """Incremental MQTT decoder: feed any split of a byte stream, get whole packets.

    Packets are dicts: ``{"type": "publish", "topic": ..., "payload": ..., "properties":
    {...}, ...}`` (see ``encode_packet`` for the keys of each type).
    """

    def __init__(self, protocol: int = 5, max_packet_size: int = 268435460) -> None: ...
    def feed(self, data: bytes) -> list[dict[str, Any]]:
        """Appends ``data`` and returns every whole packet now available (may be empty).

        Raises CodecError when the stream is broken. After a CONNECT the decoder switches to
        that CONNECT's protocol level.
        """
    @property
    def buffered(self) -> int:
        """Bytes held waiting for the rest of a packet."""

def encode_packet(packet: dict[str, Any], protocol: int = 5) -> bytes:
    """Encodes one packet dict (as returned by ``Decoder.feed``) for protocol 4 or 5."""

class Engine:
    """The broker: sessions, subscriptions, retained messages, QoS flows, all in Rust.

    Sans-I/O: the caller owns the sockets. It reports new connections (``open``), bytes read
    (``feed``), closed connections (``closed``) and time (``tick``); it takes the bytes to
    write and the connections to close from ``drain``. One ``feed`` handles every packet in
    the bytes given, however many PUBLISH packets they hold.
    """

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        """``config`` keys (all optional): max_packet_size, max_keepalive, receive_maximum,
        max_inflight, max_queued_messages, max_queued_bytes, topic_alias_maximum,
        outgoing_topic_aliases, maximum_qos, retain_available, max_session_expiry,
        connect_timeout_ms, denied_subscriptions (list of filters), max_client_id_len,
        version (str, for $SYS). Unknown keys or bad values raise ValueError."""
    def open(self, now_ms: int) -> int:
        """A new network connection; returns its connection id."""
    def feed(self, conn: int, data: bytes, now_ms: int) -> None:
        """Bytes read from connection ``conn``."""
    def closed(self, conn: int, now_ms: int) -> None:
        """The connection is gone (by the peer or after ``drain`` asked to close it)."""
    def set_writable(self, conn: int, writable: bool, now_ms: int) -> None:
        """Transport write buffer above (False) or back below (True) its high-water mark."""
    def tick(self, now_ms: int) -> None:
        """Time passes: keepalive and connect timeouts, will delays, session and message
        expiry."""
    def publish(
        self, topic: str, payload: bytes, qos: int, retain: bool, now_ms: int
    ) -> None:
        """Publishes a message from the broker itself (for example ``$SYS`` topics)."""
    def has_output(self) -> bool:
        """Whether ``drain`` has anything to return."""
    def drain(self) -> list[tuple[int, bytes, bool]]:
        """Output since the last call: ``(conn, data, close)`` per connection, ``data``
        possibly empty; ``close`` asks the caller to close after writing ``data``."""
    def events(self) -> list[tuple[str, str, str]]:
        """Log events since the last call: ``(kind, client_id, detail)``, kind one of
        ``connect``, ``disconnect``, ``takeover``, ``protocol_error``, ``drop``."""
    def stats(self) -> dict[str, int]:
        """Counters: clients_connected, sessions, subscriptions, retained, messages_received,
        messages_sent, bytes_received, bytes_sent, publish_dropped, inflight, queued."""
