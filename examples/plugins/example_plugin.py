"""An example fastbroker plugin: device tokens, per-device topics, and a message filter.

Configure it with (paths relative to the broker's working directory)::

    [auth]
    plugins = ["examples/plugins/example_plugin.py:create"]
    [auth.plugin_options."examples/plugins/example_plugin.py:create"]
    secret = "change me"      # the key device tokens are derived from
    max_payload = 1024        # larger publishes are dropped
    deny_prefix = "forbidden/"
    rename_from = "legacy/"   # publishes to legacy/... are routed to v2/...
    rename_to = "v2/"

What it does:

* authenticate: a client whose username is ``device-<id>`` must use that username as its
  client id and the password ``device_token(secret, id)`` (hex HMAC-SHA256). Other usernames
  are left to the password file (the hook answers None).
* enhanced_auth (MQTT 5, method ``FB-HMAC-CHALLENGE``): the broker sends a random nonce, the
  device answers ``HMAC-SHA256(token, nonce)``; its token never crosses the network.
* permissions: an authenticated device may publish, subscribe and receive under
  ``devices/<its client id>/#``.
* on_publish: payloads over max_payload bytes are dropped, topics under deny_prefix are
  denied (MQTT 5 publishers get 0x87), and topics under rename_from are rewritten.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
import secrets

from fastbroker.auth.plugins import (
    BAD_USERNAME_OR_PASSWORD,
    PUBLISH,
    READ,
    SUBSCRIBE,
    AuthResult,
    ConnectRequest,
    Deny,
    Drop,
    Message,
    Plugin,
)

DEVICE_USERNAME = re.compile(r"device-([A-Za-z0-9_-]{1,64})")
CHALLENGE_METHOD = "FB-HMAC-CHALLENGE"


def device_token(secret: str, device_id: str) -> str:
    """The password of device ``device_id`` (what a provisioning tool would hand out)."""
    return hmac.new(secret.encode(), device_id.encode(), hashlib.sha256).hexdigest()


def challenge_answer(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


class DevicePlugin(Plugin):
    auth_methods = (CHALLENGE_METHOD,)

    def __init__(
        self,
        secret: str,
        max_payload: int = 1024,
        deny_prefix: str = "forbidden/",
        rename_from: str = "legacy/",
        rename_to: str = "v2/",
    ) -> None:
        if not secret:
            raise ValueError("secret must not be empty")
        self.secret = secret
        self.max_payload = max_payload
        self.deny_prefix = deny_prefix
        self.rename_from = rename_from
        self.rename_to = rename_to

    def device_id(self, request: ConnectRequest) -> str | None:
        """The device id a request claims, if it is a well-formed device identity."""
        match = DEVICE_USERNAME.fullmatch(request.username or "")
        if match is None or request.client_id != request.username:
            return None
        return match[1]

    async def authenticate(self, request: ConnectRequest) -> AuthResult | None:
        if not (request.username or "").startswith("device-"):
            return None  # not ours: the password file decides
        device = self.device_id(request)
        expected = device_token(self.secret, device or "").encode()
        # Compared even for malformed identities, so the answer takes the same time.
        if hmac.compare_digest(expected, request.password or b"") and device is not None:
            return AuthResult.accept()
        return AuthResult.refuse(BAD_USERNAME_OR_PASSWORD)

    async def enhanced_auth(self, request: ConnectRequest, step: int) -> AuthResult:
        device = self.device_id(request)
        if device is None:
            return AuthResult.refuse(BAD_USERNAME_OR_PASSWORD, "expected device-<id> as both ids")
        if step == 0:
            nonce = secrets.token_bytes(16)
            request.context["nonce"] = nonce
            return AuthResult.continue_(nonce)
        expected = challenge_answer(device_token(self.secret, device), request.context["nonce"])
        if hmac.compare_digest(expected, request.auth_data or b""):
            return AuthResult.accept(data=b"welcome")
        return AuthResult.refuse(BAD_USERNAME_OR_PASSWORD, "wrong answer to the challenge")

    async def permissions(
        self, request: ConnectRequest, username: str | None
    ) -> list[tuple[int, str]] | None:
        if self.device_id(request) is None:
            return None
        # The client id was checked against [A-Za-z0-9_-]: it cannot hold a wildcard.
        return [(PUBLISH | SUBSCRIBE | READ, f"devices/{request.client_id}/#")]

    async def on_publish(self, message: Message) -> Message | Drop | Deny:
        if len(message.payload) > self.max_payload:
            return Drop(f"payload of {len(message.payload)} bytes")
        if message.topic.startswith(self.deny_prefix):
            return Deny("denied prefix")
        if message.topic.startswith(self.rename_from):
            topic = self.rename_to + message.topic[len(self.rename_from) :]
            return dataclasses.replace(message, topic=topic)
        return message


def create(**options: object) -> DevicePlugin:
    """The factory named in [auth] plugins; options come from [auth.plugin_options]."""
    return DevicePlugin(**options)  # type: ignore[arg-type]
