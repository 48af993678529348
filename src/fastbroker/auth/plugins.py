"""The plugin interface: async Python hooks for authentication, authorization and message
interception.

A plugin subclasses ``Plugin`` and overrides only what it needs; configure it in ``[auth]``::

    [auth]
    plugins = ["mypackage.myplugin:create"]          # or "path/to/file.py:create"
    [auth.plugin_options."mypackage.myplugin:create"]
    secret = "..."                                   # passed to create(**options)

Every hook runs on the broker's event loop, so it must not block (use ``asyncio.to_thread`` for
blocking work). Each call is bounded by ``plugin_timeout_ms``; a hook that raises or times out
refuses the connection (or denies the message), is logged with the plugin's name, and never
stops the broker. See docs/auth.md for the full reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from fastbroker.config import ConfigError

# MQTT 5 reason codes a plugin typically refuses with (3.1.1 clients get the mapped code).
BAD_USERNAME_OR_PASSWORD = 0x86
NOT_AUTHORIZED = 0x87
SERVER_BUSY = 0x89
BAD_AUTHENTICATION_METHOD = 0x8C
UNSPECIFIED_ERROR = 0x80

PUBLISH = 1
SUBSCRIBE = 2
READ = 4


@dataclass(slots=True)
class ConnectRequest:
    """What a client presented: a CONNECT, or one step of an MQTT 5 AUTH exchange."""

    # The engine's connection id (reused after the connection closes).
    conn: int
    client_id: str
    # With use_identity_as_username on a TLS listener: the certificate's CN, not what the
    # client sent.
    username: str | None
    password: bytes | None
    # 3 (3.1), 4 (3.1.1) or 5.
    protocol_level: int
    # (host, port) of the client (after PROXY protocol), when the listener knows it.
    peer: tuple[str, int] | None = None
    listener: str | None = None
    cert_cn: str | None = None
    # MQTT 5 enhanced authentication; auth_data is the client's latest data.
    auth_method: str | None = None
    auth_data: bytes | None = None
    # "connect", or "reauth" for an MQTT 5 re-authentication of a connected client.
    kind: str = "connect"
    # Kept across the steps of one enhanced-authentication exchange (e.g. a server nonce).
    context: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AuthResult:
    """A plugin's answer; build it with ``accept``, ``refuse`` or ``continue_``."""

    reason_code: int = 0
    # accept: the identity ACL rules see (user blocks, %u) instead of the CONNECT's username.
    username: str | None = None
    # accept / continue_: Authentication Data sent to the client (CONNACK or AUTH).
    data: bytes | None = None
    # refuse: Reason String, sent only to MQTT 5 clients that asked for problem information.
    reason: str | None = None
    continues: bool = False

    @classmethod
    def accept(cls, *, username: str | None = None, data: bytes | None = None) -> AuthResult:
        return cls(0, username=username, data=data)

    @classmethod
    def refuse(cls, reason_code: int = NOT_AUTHORIZED, reason: str | None = None) -> AuthResult:
        if not 0x80 <= reason_code <= 0xFF:
            raise ValueError("a refusal needs an MQTT 5 error reason code (0x80-0xFF)")
        return cls(reason_code, reason=reason)

    @classmethod
    def continue_(cls, data: bytes | None = None) -> AuthResult:
        """MQTT 5 enhanced authentication: send AUTH 0x18 with ``data``, wait for the client's
        next AUTH (then ``enhanced_auth`` is called with the next step)."""
        return cls(0x18, data=data, continues=True)

    @property
    def accepted(self) -> bool:
        return self.reason_code == 0


@dataclass(frozen=True, slots=True)
class Message:
    """A client's PUBLISH on its way in. Return it changed (``dataclasses.replace``) to rewrite
    the topic or payload; qos and retain cannot be changed."""

    client_id: str
    username: str | None
    topic: str
    payload: bytes
    qos: int
    retain: bool


@dataclass(frozen=True, slots=True)
class Drop:
    """Discard the message; the client is told it was handled (success)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Deny:
    """Refuse the message: MQTT 5 QoS 1/2 publishers get 0x87 Not authorized."""

    reason: str = ""


class Plugin:
    """Base class of plugins; every method is optional. The broker calls a method only if the
    plugin overrides it (on_publish in particular: only then does interception turn on)."""

    # MQTT 5 Authentication Methods this plugin handles through ``enhanced_auth``.
    auth_methods: ClassVar[tuple[str, ...]] = ()

    async def start(self) -> None:
        """Called once before the broker accepts clients; raise to stop the startup."""

    async def stop(self) -> None:
        """Called once at shutdown."""

    async def authenticate(self, request: ConnectRequest) -> AuthResult | None:
        """A CONNECT without an Authentication Method. None: no opinion (the next plugin, then
        the password file and the anonymous rule decide)."""
        return None

    async def enhanced_auth(self, request: ConnectRequest, step: int) -> AuthResult:
        """MQTT 5 enhanced authentication for a method in ``auth_methods``: step 0 is the
        CONNECT (or the client's re-authentication AUTH), step 1 the client's first answer..."""
        return AuthResult.refuse(BAD_AUTHENTICATION_METHOD)

    async def permissions(
        self, request: ConnectRequest, username: str | None
    ) -> list[tuple[int, str]] | None:
        """Extra (rights mask, topic filter) rules for an accepted client, added to the ACL
        file's (masks: PUBLISH 1, SUBSCRIBE 2, READ 4). None: no opinion."""
        return None

    async def on_publish(self, message: Message) -> Message | Drop | Deny:
        """Every client PUBLISH, once overridden (the ack waits for the answer)."""
        return message


def plugin_name(plugin: Plugin) -> str:
    """For log lines: the plugin's own ``name`` attribute if it has one, else its class."""
    name = getattr(plugin, "name", None)
    return name if isinstance(name, str) and name else type(plugin).__qualname__


def overrides(plugin: Plugin, method: str) -> bool:
    return getattr(type(plugin), method) is not getattr(Plugin, method)


def authenticates(plugin: Plugin) -> bool:
    return overrides(plugin, "authenticate") or bool(plugin.auth_methods)


def intercepts(plugin: Plugin) -> bool:
    return overrides(plugin, "on_publish")


def load_factory(spec: str) -> Callable[..., Any]:
    """``module.path:factory`` or ``path/to/file.py:factory``; ConfigError if it fails."""
    target, sep, attribute = spec.rpartition(":")
    if not sep or not target or not attribute.isidentifier():
        raise ConfigError(f"[auth] plugins: {spec!r}: expected MODULE:FACTORY or FILE.py:FACTORY")
    try:
        if target.endswith(".py") or "/" in target:
            module = load_file(Path(target))
        else:
            module = importlib.import_module(target)
        factory = getattr(module, attribute)
    except ConfigError:
        raise
    except Exception as error:
        raise ConfigError(
            f"[auth] plugins: cannot load {spec!r}: {type(error).__name__}: {error}"
        ) from None
    if not callable(factory):
        raise ConfigError(f"[auth] plugins: {spec!r} is not callable")
    return factory


def load_file(path: Path) -> Any:
    if not path.is_file():
        raise ConfigError(f"[auth] plugins: no plugin file {path}")
    name = f"fastbroker_plugin_{path.stem}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ConfigError(f"[auth] plugins: cannot load {path}")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running it, as dataclasses and pickling look modules up by name.
    sys.modules[name] = module
    module_spec.loader.exec_module(module)
    return module


def load_plugins(specs: tuple[str, ...], options: Mapping[str, Mapping[str, Any]]) -> list[Plugin]:
    """One instance per spec, made by its factory with its ``[auth.plugin_options]`` table."""
    unknown = set(options) - set(specs)
    if unknown:
        raise ConfigError(
            f"[auth] plugin_options: {sorted(unknown)[0]!r} is not one of [auth] plugins"
        )
    plugins = []
    for spec in specs:
        factory = load_factory(spec)
        try:
            plugin = factory(**dict(options.get(spec, {})))
            if inspect.isawaitable(plugin):
                raise TypeError("the factory must return the plugin, not a coroutine")
        except Exception as error:
            raise ConfigError(
                f"[auth] plugins: {spec!r} failed: {type(error).__name__}: {error}"
            ) from None
        if not isinstance(plugin, Plugin):
            raise ConfigError(f"[auth] plugins: {spec!r} did not return a fastbroker Plugin")
        plugins.append(plugin)
    return plugins
