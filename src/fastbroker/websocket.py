"""Sans-I/O WebSocket opening handshake (RFC 6455 section 4) for MQTT over WebSocket.

The client's HTTP Upgrade request is parsed once per connection, here in Python; the frames
that follow are the compiled codec's work (``fastbroker_core.WebSocketCodec``). MQTT requires
the ``mqtt`` subprotocol (MQTT 5.0 section 6); ``mqttv3.1`` is what some MQTT 3.1 clients
ask for, accepted too, and the answer names the one the client asked for.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass, field
from http import HTTPStatus

# Bytes of request line and headers accepted; more gets 431.
MAX_REQUEST_SIZE = 8192
SUBPROTOCOLS = ("mqtt", "mqttv3.1")
WEBSOCKET_GUID = "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
# RFC 9110 token characters: header names and Upgrade/Connection values.
TOKEN = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")


class HandshakeError(Exception):
    """The request cannot be upgraded; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, reason: str, headers: tuple[tuple[str, str], ...] = ()):
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.headers = headers


@dataclass(frozen=True)
class UpgradeRequest:
    path: str
    key: str
    subprotocol: str
    # Lower-case names; repeated headers joined with ", ".
    headers: dict[str, str] = field(default_factory=dict)


def request_end(buffer: bytes | bytearray) -> int | None:
    """The length of the request head (through the blank line) once ``buffer`` holds it;
    None while it does not. Raises HandshakeError 431 when the head is too long."""
    end = buffer.find(b"\r\n\r\n", 0, MAX_REQUEST_SIZE)
    if end >= 0:
        return end + 4
    if len(buffer) >= MAX_REQUEST_SIZE:
        raise HandshakeError(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "request head too long")
    return None


def parse_request(head: bytes | bytearray, path: str = "/mqtt") -> UpgradeRequest:
    """Checks an Upgrade request head (as delimited by ``request_end``); ``path`` is the
    path to accept ("" accepts any)."""
    try:
        text = bytes(head).decode("ascii")
    except UnicodeDecodeError:
        raise HandshakeError(HTTPStatus.BAD_REQUEST, "request head is not ASCII") from None
    lines = text.split("\r\n")
    while lines and lines[-1] == "":
        lines.pop()
    if not lines:
        raise HandshakeError(HTTPStatus.BAD_REQUEST, "empty request")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise HandshakeError(HTTPStatus.BAD_REQUEST, "malformed request line")
    method, target, version = parts
    numbers = re.fullmatch(r"HTTP/(\d)\.(\d)", version)
    if numbers is None or (int(numbers[1]), int(numbers[2])) < (1, 1):
        raise HandshakeError(HTTPStatus.BAD_REQUEST, f"WebSocket needs HTTP/1.1, got {version}")
    headers = parse_headers(lines[1:])
    if method != "GET":
        raise HandshakeError(
            HTTPStatus.METHOD_NOT_ALLOWED, f"method {method} not allowed", (("Allow", "GET"),)
        )
    request_path = target.split("?", 1)[0]
    if path and request_path != path:
        raise HandshakeError(HTTPStatus.NOT_FOUND, f"no WebSocket endpoint at {request_path}")
    if "host" not in headers:
        raise HandshakeError(HTTPStatus.BAD_REQUEST, "no Host header")
    if "websocket" not in tokens(headers.get("upgrade", "")):
        raise HandshakeError(HTTPStatus.BAD_REQUEST, "not a WebSocket upgrade (Upgrade header)")
    if "upgrade" not in tokens(headers.get("connection", "")):
        raise HandshakeError(HTTPStatus.BAD_REQUEST, "Connection header does not say Upgrade")
    if headers.get("sec-websocket-version", "").strip() != "13":
        # RFC 6455 4.4: say which version the server speaks.
        raise HandshakeError(
            HTTPStatus.UPGRADE_REQUIRED,
            "unsupported Sec-WebSocket-Version (13 needed)",
            (("Sec-WebSocket-Version", "13"),),
        )
    key = headers.get("sec-websocket-key", "").strip()
    try:
        valid_key = len(base64.b64decode(key, validate=True)) == 16
    except (binascii.Error, ValueError):
        valid_key = False
    if not valid_key:
        raise HandshakeError(HTTPStatus.BAD_REQUEST, "missing or invalid Sec-WebSocket-Key")
    offered = [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",")]
    chosen = next((p for p in offered if p in SUBPROTOCOLS), None)
    if chosen is None:
        raise HandshakeError(
            HTTPStatus.BAD_REQUEST, "Sec-WebSocket-Protocol must offer mqtt (MQTT over WebSocket)"
        )
    return UpgradeRequest(target, key, chosen, headers)


def parse_headers(lines: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for line in lines:
        name, colon, value = line.partition(":")
        # Obsolete line folding (a line starting with whitespace) is refused, as RFC 9112
        # allows; so is anything that is not "name: value".
        if not colon or not TOKEN.match(name):
            raise HandshakeError(HTTPStatus.BAD_REQUEST, f"malformed header line {line[:60]!r}")
        name = name.lower()
        value = value.strip(" \t")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return headers


def tokens(value: str) -> set[str]:
    """The lower-cased comma-separated tokens of a header value."""
    return {item.strip().lower() for item in value.split(",") if item.strip()}


def accept_key(key: str) -> str:
    """Sec-WebSocket-Accept for a Sec-WebSocket-Key (RFC 6455 4.2.2)."""
    digest = hashlib.sha1((key + WEBSOCKET_GUID).encode("ascii")).digest()
    return base64.b64encode(digest).decode("ascii")


def switching_protocols(request: UpgradeRequest) -> bytes:
    """The 101 response completing the handshake."""
    return (
        "HTTP/1.1 101 Switching Protocols\r\n"
        "Upgrade: websocket\r\n"
        "Connection: Upgrade\r\n"
        f"Sec-WebSocket-Accept: {accept_key(request.key)}\r\n"
        f"Sec-WebSocket-Protocol: {request.subprotocol}\r\n"
        "\r\n"
    ).encode("ascii")


def error_response(status: int, reason: str, headers: tuple[tuple[str, str], ...] = ()) -> bytes:
    """A complete HTTP error response that closes the connection."""
    phrase = HTTPStatus(status).phrase
    body = f"{status} {phrase}: {reason}\n".encode("ascii", "replace")
    extra = "".join(f"{name}: {value}\r\n" for name, value in headers)
    return (
        f"HTTP/1.1 {status} {phrase}\r\n"
        "Content-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
        f"{extra}\r\n"
    ).encode("ascii") + body
