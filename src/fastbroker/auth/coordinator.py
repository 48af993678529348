"""Decides on connects and intercepted publishes for the engine, off the data path.

The engine (with ``auth_required``) parks every CONNECT until ``auth_done``; the connection
layer hands the parked requests to ``on_auth_requests`` once per loop iteration, and each one
becomes a task here: plugins, then the password file (scrypt in a small thread pool, so the
event loop never hashes), then the anonymous rule; the ACL file and plugins give the accepted
client's permissions, which the engine enforces without calling back. With ``intercept``, every
client PUBLISH comes through ``on_intercepted`` and is released after the plugins' on_publish.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import fastbroker_core

from fastbroker.auth.acl import Acl
from fastbroker.auth.passwords import PasswordFile
from fastbroker.auth.plugins import (
    BAD_AUTHENTICATION_METHOD,
    BAD_USERNAME_OR_PASSWORD,
    NOT_AUTHORIZED,
    SERVER_BUSY,
    UNSPECIFIED_ERROR,
    AuthResult,
    ConnectRequest,
    Deny,
    Drop,
    Message,
    Plugin,
    authenticates,
    intercepts,
    load_plugins,
    overrides,
    plugin_name,
)
from fastbroker.config import AuthConfig, ConfigError

logger = logging.getLogger("fastbroker.auth")

PROTOCOL_ERROR = 0x82
# Password checks waiting or running; beyond it a connect is refused at once with 0x89, so a
# flood of connects with passwords costs a bounded amount of memory and CPU.
MAX_PENDING_VERIFICATIONS = 256
# Authentication tasks of any kind (plugins included) in progress.
MAX_PENDING_REQUESTS = 4096
# An MQTT 5 AUTH exchange longer than this is refused (a client could otherwise keep one going).
MAX_AUTH_STEPS = 32
# Distinct rule sets whose compiled Permissions are kept for reuse.
PERMISSIONS_CACHE_SIZE = 4096
# Release actions of Engine.release.
ROUTE, DROP, DENY = 0, 1, 2

T = TypeVar("T")


class PluginFailure(Exception):
    """A plugin hook raised, timed out or answered nonsense (already logged)."""


def monotonic_ms() -> int:
    # CLOCK_MONOTONIC, the clock the connection layer feeds the engine with.
    return time.monotonic_ns() // 1_000_000


def verify_workers() -> int:
    # scrypt releases the GIL: with two threads on a two-core machine the event loop would
    # compete with both for the CPU, so one core is always left to it.
    return max(1, min(2, (os.cpu_count() or 1) - 1))


@dataclass
class AuthSetup:
    """The loaded files and plugin instances of one [auth] config."""

    config: AuthConfig
    passwords: PasswordFile | None
    acl: Acl | None
    plugins: list[Plugin]

    @classmethod
    def load(cls, config: AuthConfig) -> AuthSetup:
        passwords = PasswordFile.load(config.password_file) if config.password_file else None
        acl = Acl.load(config.acl_file) if config.acl_file else None
        plugins = load_plugins(config.plugins, config.plugin_options)
        return cls(config, passwords, acl, plugins)

    @property
    def intercepts(self) -> bool:
        return any(intercepts(p) for p in self.plugins)

    @property
    def allow_anonymous(self) -> bool:
        if self.config.allow_anonymous is not None:
            return self.config.allow_anonymous
        return not self.verifies

    @property
    def verifies(self) -> bool:
        """Whether something checks who clients are (then an unchecked username counts for
        nothing)."""
        return self.passwords is not None or any(authenticates(p) for p in self.plugins)


_setups: dict[int, tuple[AuthConfig, AuthSetup]] = {}


def load_auth(config: AuthConfig) -> AuthSetup:
    """The setup of ``config``, loaded once: the engine's config (whether to intercept) and the
    coordinator need the same plugin instances. ConfigError if a file or plugin is bad."""
    cached = _setups.get(id(config))
    if cached is not None and cached[0] is config:
        return cached[1]
    setup = AuthSetup.load(config)
    _setups[id(config)] = (config, setup)
    return setup


def engine_keys(config: AuthConfig) -> dict[str, Any]:
    """The engine settings [auth] needs; none (no cost at all) when [auth] is not used."""
    if not config.enabled:
        return {}
    return {"auth_required": True, "intercept": load_auth(config).intercepts}


@dataclass
class Exchange:
    """An MQTT 5 enhanced-authentication exchange waiting for the client's next AUTH."""

    plugin: Plugin
    request: ConnectRequest
    token: object
    step: int = 0


@dataclass
class Accepted:
    """What an accepted connection's permissions were made of, to remake them on reload."""

    token: object
    client_id: str
    username: str | None
    plugin_rules: list[tuple[int, str]] | None = field(default=None)


@dataclass(frozen=True)
class Decision:
    result: AuthResult
    # The identity ACL rules see.
    username: str | None
    # The plugin of an enhanced-authentication exchange.
    plugin: Plugin | None = None


class AuthCoordinator:
    def __init__(
        self,
        config: AuthConfig,
        engine: Any,
        loop: asyncio.AbstractEventLoop,
        conn_info: Callable[[int], Mapping[str, Any] | None],
        schedule_flush: Callable[[], None],
        *,
        max_pending_verifications: int = MAX_PENDING_VERIFICATIONS,
        max_pending_requests: int = MAX_PENDING_REQUESTS,
    ) -> None:
        self.setup = load_auth(config)
        self.engine = engine
        self.loop = loop
        self.conn_info = conn_info
        self.schedule_flush = schedule_flush
        self.timeout = config.plugin_timeout_ms / 1000
        self.passwords = self.setup.passwords
        self.acl = self.setup.acl
        plugins = self.setup.plugins
        self.authenticators = [p for p in plugins if overrides(p, "authenticate")]
        self.permission_plugins = [p for p in plugins if overrides(p, "permissions")]
        self.interceptors = [p for p in plugins if intercepts(p)]
        self.methods: dict[str, Plugin] = {}
        for plugin in plugins:
            for method in plugin.auth_methods:
                self.methods.setdefault(method, plugin)
        self.max_pending_verifications = max_pending_verifications
        self.max_pending_requests = max_pending_requests
        workers = verify_workers()
        self.executor = ThreadPoolExecutor(workers, thread_name_prefix="fastbroker-auth")
        # Gates the executor so that a queued check can be skipped if its client went away.
        self.verify_slots = asyncio.Semaphore(workers)
        self.pending_verifications = 0
        # Slow checks under way, by (username, keyed digest of the password): the same
        # credentials arriving meanwhile wait for that verdict instead of hashing again (a
        # fleet sharing one login, reconnecting at once). None = no verdict (its client left).
        self.checks_in_flight: dict[tuple[str, bytes], asyncio.Future[bool | None]] = {}
        # Password checks by how they were decided, for /metrics.
        self.password_checks = {"slow": 0, "recalled": 0, "shared": 0}
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.exchanges: dict[int, Exchange] = {}
        self.accepted: dict[int, Accepted] = {}
        self.publish_queues: dict[int, deque[tuple[Any, ...]]] = {}
        self.publish_tasks: set[asyncio.Task[None]] = set()
        self.permissions_cache: dict[tuple[tuple[int, str], ...], Any] = {}
        self.stopping = False

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Starts the plugins; ConfigError names the one that failed."""
        for plugin in self.setup.plugins:
            try:
                async with asyncio.timeout(max(self.timeout, 30.0)):
                    await plugin.start()
            except Exception as error:
                name, kind = plugin_name(plugin), type(error).__name__
                raise ConfigError(
                    f"[auth] plugin {name} failed to start: {kind}: {error}"
                ) from None

    async def stop(self) -> None:
        """Cancels what is in progress and stops the plugins. Intercepted publishes not yet
        released stay unacknowledged, so their publishers send them again (at least once)."""
        self.stopping = True
        tasks = [*self.tasks.values(), *self.publish_tasks]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for plugin in self.setup.plugins:
            try:
                async with asyncio.timeout(self.timeout):
                    await plugin.stop()
            except Exception:
                logger.exception("auth plugin %s failed to stop", plugin_name(plugin))
        self.executor.shutdown(wait=False, cancel_futures=True)

    def reload(self) -> bool:
        """Re-reads the password and ACL files (SIGHUP); a bad file is logged and the old one
        kept. Connected clients get the new ACL rules at once."""
        config = self.setup.config
        try:
            passwords = PasswordFile.load(config.password_file) if config.password_file else None
            acl = Acl.load(config.acl_file) if config.acl_file else None
        except ConfigError as error:
            logger.error("not reloaded, keeping the previous files: %s", error)
            return False
        self.passwords, self.acl = passwords, acl
        updated = 0
        for conn, accepted in list(self.accepted.items()):
            if not self.is_current(conn, accepted.token):
                del self.accepted[conn]
                continue
            rules = self.acl_rules(accepted.username, accepted.client_id)
            try:
                permissions = self.permissions(merge(rules, accepted.plugin_rules))
            except ValueError as error:
                logger.error("conn %d keeps its permissions: %s", conn, error)
                continue
            self.engine.set_permissions(conn, permissions)
            updated += 1
        logger.info(
            "reloaded %s (%d users), %s; permissions of %d connections updated",
            config.password_file or "no password file",
            len(passwords.users) if passwords else 0,
            config.acl_file or "no ACL file",
            updated,
        )
        return True

    # ------------------------------------------------------------------ from the engine

    def on_auth_requests(self, requests: list[tuple[Any, ...]]) -> None:
        """The engine's parked CONNECTs and AUTHs; starts a task for each, never blocks."""
        refused = False
        for request in requests:
            conn, kind = request[0], request[1]
            previous = self.tasks.pop(conn, None)
            if previous is not None:
                # Connection ids are reused: whatever was pending for this id is stale now.
                previous.cancel()
            if kind == "connect":
                self.exchanges.pop(conn, None)
                self.accepted.pop(conn, None)
            if self.stopping or len(self.tasks) >= self.max_pending_requests:
                self.engine.auth_done(conn, SERVER_BUSY, None, monotonic_ms())
                refused = True
                continue
            if kind == "auth":
                handler = self.handle_auth_step(request)
            elif kind == "reauth":
                handler = self.handle_reauth(request)
            else:
                handler = self.handle_connect(request)
            task = self.loop.create_task(handler)
            self.tasks[conn] = task
            task.add_done_callback(functools.partial(self.task_done, conn))
        if refused:
            self.schedule_flush()

    def task_done(self, conn: int, task: asyncio.Task[None]) -> None:
        current = self.tasks.get(conn) is task
        if current:
            del self.tasks[conn]
        if not task.cancelled() and task.exception() is not None:
            logger.error("authentication of conn %d failed", conn, exc_info=task.exception())
            if current:
                # Not left waiting for the connect timeout (a re-authentication has none).
                self.finish(conn, UNSPECIFIED_ERROR)

    def on_intercepted(self, items: list[tuple[Any, ...]]) -> None:
        """Intercepted publishes: handled in order per connection, connections concurrently."""
        for item in items:
            conn = item[1]
            queue = self.publish_queues.get(conn)
            if queue is None:
                queue = self.publish_queues[conn] = deque()
                task = self.loop.create_task(self.drain_publishes(conn, queue))
                self.publish_tasks.add(task)
                task.add_done_callback(self.publish_tasks.discard)
            queue.append(item)

    # ------------------------------------------------------------------ authentication

    def capture(self, conn: int) -> tuple[Mapping[str, Any], object]:
        """The connection's info and a token that tells this connection from a later one with
        the same id (None when conn_info cannot tell them apart)."""
        info = self.conn_info(conn)
        if info is None:
            return {}, None
        return info, (info if self.conn_info(conn) is info else None)

    def is_current(self, conn: int, token: object) -> bool:
        return token is None or self.conn_info(conn) is token

    def new_request(self, raw: tuple[Any, ...], info: Mapping[str, Any]) -> ConnectRequest:
        conn, kind, client_id, username, password, protocol_level, method, data = raw
        peer = info.get("peer")
        return ConnectRequest(
            conn=conn,
            client_id=client_id,
            username=username,
            password=password,
            protocol_level=protocol_level,
            peer=tuple(peer) if peer else None,  # type: ignore[arg-type]
            listener=info.get("listener"),
            cert_cn=info.get("cert_cn"),
            auth_method=method,
            auth_data=data,
            kind=kind,
        )

    async def handle_connect(self, raw: tuple[Any, ...]) -> None:
        conn = raw[0]
        info, token = self.capture(conn)
        request = self.new_request(raw, info)
        identity = bool(info.get("use_identity_as_username"))
        if identity:
            # On such a listener the certificate says who the client is, whatever it sent.
            request.username = request.cert_cn
        decision = await self.decide(request, identity, token)
        await self.conclude(request, decision, token)

    async def handle_reauth(self, raw: tuple[Any, ...]) -> None:
        """MQTT 5 re-authentication of a connected client (AUTH 0x19)."""
        conn = raw[0]
        info, token = self.capture(conn)
        request = self.new_request(raw, info)
        plugin = self.methods.get(request.auth_method) if request.auth_method else None
        if plugin is None:
            self.finish(conn, BAD_AUTHENTICATION_METHOD)
            return
        result = await self.enhanced(plugin, request, 0)
        decision = Decision(result, result.username or request.username, plugin)
        await self.conclude(request, decision, token)

    async def handle_auth_step(self, raw: tuple[Any, ...]) -> None:
        conn = raw[0]
        exchange = self.exchanges.pop(conn, None)
        if exchange is None or not self.is_current(conn, exchange.token):
            self.finish(conn, PROTOCOL_ERROR, reason="no authentication exchange in progress")
            return
        request = exchange.request
        request.auth_data = raw[7]
        exchange.step += 1
        if exchange.step > MAX_AUTH_STEPS:
            self.finish(conn, NOT_AUTHORIZED, reason="authentication exchange too long")
            return
        result = await self.enhanced(exchange.plugin, request, exchange.step)
        decision = Decision(result, result.username or request.username, exchange.plugin)
        await self.conclude(request, decision, exchange.token, exchange)

    async def decide(self, request: ConnectRequest, identity: bool, token: object) -> Decision:
        if request.auth_method is not None:
            plugin = self.methods.get(request.auth_method)
            if plugin is None:
                return refusal(BAD_AUTHENTICATION_METHOD)
            result = await self.enhanced(plugin, request, 0)
            return Decision(result, result.username or request.username, plugin)
        for plugin in self.authenticators:
            try:
                answer = await self.call(plugin, "authenticate", plugin.authenticate(request))
            except PluginFailure:
                return refusal(UNSPECIFIED_ERROR)
            if answer is None:
                continue
            if not isinstance(answer, AuthResult) or answer.continues:
                name = plugin_name(plugin)
                logger.error("auth plugin %s: authenticate returned %r", name, answer)
                return refusal(UNSPECIFIED_ERROR)
            return Decision(answer, answer.username or request.username)
        if identity:
            if request.cert_cn:
                return Decision(AuthResult.accept(), request.cert_cn)
            return refusal(NOT_AUTHORIZED, "a client certificate is required")
        if self.passwords is not None and request.username is not None:
            return await self.check_password(request, token)
        if self.setup.allow_anonymous:
            # Where something checks identities, a name nothing checked grants no user rules.
            return Decision(AuthResult.accept(), None if self.setup.verifies else request.username)
        return refusal(NOT_AUTHORIZED)

    async def check_password(self, request: ConnectRequest, token: object) -> Decision:
        passwords = self.passwords
        if passwords is not None and passwords.recall(request.username, request.password):
            self.password_checks["recalled"] += 1
            return Decision(AuthResult.accept(), request.username)
        key = None
        if passwords is not None and request.username is not None and request.password is not None:
            key = (request.username, passwords.recall_digest(request.password))
            shared = self.checks_in_flight.get(key)
            if shared is not None:
                # Shielded: this client leaving must not cancel the check the others wait on.
                ok = await asyncio.shield(shared)
                if ok is not None:
                    self.password_checks["shared"] += 1
                    return password_decision(request, ok)
                # That check was never made: make ours.
        if key is None or key in self.checks_in_flight:
            outcome = await self.slow_check(request, token)
        else:
            future: asyncio.Future[bool | None] = self.loop.create_future()
            self.checks_in_flight[key] = future
            outcome = None
            try:
                outcome = await self.slow_check(request, token)
            finally:
                del self.checks_in_flight[key]
                future.set_result(outcome if isinstance(outcome, bool) else None)
        if isinstance(outcome, bool):
            return password_decision(request, outcome)
        return outcome

    async def slow_check(self, request: ConnectRequest, token: object) -> bool | Decision:
        """One scrypt (or argon2) on the verification threads, when there is room: the
        verdict, or the refusal of a check that was not made."""
        if self.pending_verifications >= self.max_pending_verifications:
            return refusal(SERVER_BUSY)
        self.pending_verifications += 1
        try:
            async with self.verify_slots:
                if not self.is_current(request.conn, token):
                    # The client left while queued: no hashing for nobody.
                    return refusal(UNSPECIFIED_ERROR)
                passwords = self.passwords
                if passwords is None:  # removed by a reload meanwhile
                    return refusal(BAD_USERNAME_OR_PASSWORD)
                self.password_checks["slow"] += 1
                return await self.loop.run_in_executor(
                    self.executor, passwords.verify, request.username, request.password
                )
        finally:
            self.pending_verifications -= 1

    async def enhanced(self, plugin: Plugin, request: ConnectRequest, step: int) -> AuthResult:
        try:
            result = await self.call(plugin, "enhanced_auth", plugin.enhanced_auth(request, step))
        except PluginFailure:
            return AuthResult.refuse(UNSPECIFIED_ERROR)
        if not isinstance(result, AuthResult):
            logger.error("auth plugin %s: enhanced_auth returned %r", plugin_name(plugin), result)
            return AuthResult.refuse(UNSPECIFIED_ERROR)
        return result

    async def conclude(
        self,
        request: ConnectRequest,
        decision: Decision,
        token: object,
        exchange: Exchange | None = None,
    ) -> None:
        conn, result = request.conn, decision.result
        if not self.is_current(conn, token):
            return
        if result.continues:
            if exchange is None:
                assert decision.plugin is not None
                exchange = Exchange(decision.plugin, request, token)
            self.exchanges[conn] = exchange
            self.engine.auth_continue(conn, request.auth_method, result.data, monotonic_ms())
            self.schedule_flush()
            return
        if not result.accepted:
            self.finish(conn, result.reason_code, reason=result.reason)
            return
        try:
            plugin_rules = await self.plugin_rules(request, decision.username)
            acl_rules = self.acl_rules(decision.username, request.client_id)
            permissions = self.permissions(merge(acl_rules, plugin_rules))
        except (PluginFailure, ValueError) as error:
            if isinstance(error, ValueError):
                logger.error("conn %d: bad permissions: %s", conn, error)
            self.finish(conn, UNSPECIFIED_ERROR)
            return
        if not self.is_current(conn, token):
            return
        self.accepted[conn] = Accepted(token, request.client_id, decision.username, plugin_rules)
        self.engine.auth_done(
            conn, 0, permissions, monotonic_ms(), request.auth_method, result.data, None
        )
        self.schedule_flush()

    def finish(self, conn: int, code: int, reason: str | None = None) -> None:
        self.engine.auth_done(conn, code, None, monotonic_ms(), None, None, reason)
        self.schedule_flush()

    # ------------------------------------------------------------------ authorization

    def acl_rules(self, username: str | None, client_id: str) -> list[tuple[int, str]] | None:
        return self.acl.permissions_for(username, client_id) if self.acl is not None else None

    async def plugin_rules(
        self, request: ConnectRequest, username: str | None
    ) -> list[tuple[int, str]] | None:
        rules: list[tuple[int, str]] | None = None
        for plugin in self.permission_plugins:
            extra = await self.call(plugin, "permissions", plugin.permissions(request, username))
            if extra is None:
                continue
            try:
                checked = [(int(mask), str(topic_filter)) for mask, topic_filter in extra]
            except (TypeError, ValueError):
                logger.error("auth plugin %s: permissions returned %r", plugin_name(plugin), extra)
                raise PluginFailure from None
            rules = [*(rules or []), *checked]
        return rules

    def permissions(self, rules: list[tuple[int, str]] | None) -> Any:
        """The engine's compiled Permissions for ``rules`` (None: everything allowed); shared
        by every connection with the same rules."""
        if rules is None:
            return None
        key = tuple(rules)
        compiled = self.permissions_cache.get(key)
        if compiled is None:
            compiled = fastbroker_core.Permissions(list(key))
            if len(self.permissions_cache) >= PERMISSIONS_CACHE_SIZE:
                self.permissions_cache.clear()
            self.permissions_cache[key] = compiled
        return compiled

    # ------------------------------------------------------------------ interception

    async def drain_publishes(self, conn: int, queue: deque[tuple[Any, ...]]) -> None:
        # Releases happen in ticket order per connection, as the engine requires.
        try:
            while queue:
                ticket, _, client_id, username, topic, payload, qos, retain = queue.popleft()
                message = Message(client_id, username, topic, payload, qos, retain)
                action, new_topic, new_payload = await self.intercept(message)
                try:
                    self.engine.release(ticket, action, new_topic, new_payload, monotonic_ms())
                except Exception:
                    logger.exception("release of ticket %d failed", ticket)
                self.schedule_flush()
        finally:
            if self.publish_queues.get(conn) is queue:
                del self.publish_queues[conn]

    async def intercept(self, original: Message) -> tuple[int, str | None, bytes | None]:
        message = original
        for plugin in self.interceptors:
            try:
                result = await self.call(plugin, "on_publish", plugin.on_publish(message))
            except PluginFailure:
                return DENY, None, None
            if isinstance(result, Drop):
                return DROP, None, None
            if isinstance(result, Deny):
                return DENY, None, None
            if not isinstance(result, Message) or not isinstance(
                result.payload, bytes | bytearray | memoryview
            ):
                logger.error("auth plugin %s: on_publish returned %r", plugin_name(plugin), result)
                return DENY, None, None
            message = result
        topic = message.topic if message.topic != original.topic else None
        payload = None
        if message.payload is not original.payload and message.payload != original.payload:
            payload = bytes(message.payload)
        return ROUTE, topic, payload

    # ------------------------------------------------------------------ plugin calls

    async def call(self, plugin: Plugin, hook: str, call: Awaitable[T]) -> T:
        """Awaits a plugin hook within the timeout; PluginFailure (logged) if it fails."""
        try:
            async with asyncio.timeout(self.timeout):
                return await call
        except TimeoutError:
            logger.error(
                "auth plugin %s: %s took longer than %d ms",
                plugin_name(plugin),
                hook,
                self.setup.config.plugin_timeout_ms,
            )
        except Exception:
            logger.exception("auth plugin %s: %s raised", plugin_name(plugin), hook)
        raise PluginFailure


def password_decision(request: ConnectRequest, ok: bool) -> Decision:
    if ok:
        return Decision(AuthResult.accept(), request.username)
    return refusal(BAD_USERNAME_OR_PASSWORD)


def refusal(code: int, reason: str | None = None) -> Decision:
    return Decision(AuthResult(code, reason=reason), None)


def merge(
    first: list[tuple[int, str]] | None, second: list[tuple[int, str]] | None
) -> list[tuple[int, str]] | None:
    if first is None and second is None:
        return None
    return [*(first or []), *(second or [])]
