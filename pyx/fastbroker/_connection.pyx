"""Connection layer: asyncio protocols that hand bytes to the Rust engine and write its output.

The engine does all MQTT work. Per read, Python only calls ``engine.feed`` and, at most once per
loop iteration, schedules a flush that writes everything ``engine.drain`` returns.
"""

import logging
import time

cimport cython
from libc.stdint cimport uint64_t
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from fastbroker.store import StoreWriteError

logger = logging.getLogger("fastbroker.connection")
event_logger = logging.getLogger("fastbroker.engine")

# Connects and disconnects are routine and frequent under load; the rest merit an operator's eye.
EVENT_LOG_LEVELS = {
    "connect": logging.DEBUG,
    "disconnect": logging.DEBUG,
    "takeover": logging.INFO,
    "protocol_error": logging.INFO,
    "drop": logging.INFO,
}

DEFAULT_TICK_INTERVAL = 0.1
# One uvloop read is at most 256 KiB.
DEFAULT_READ_BUDGET = 256 * 1024
# How often a failed store write is retried (after trying to make the store writable).
STORE_RETRY_INTERVAL = 1.0
# How long a connection the broker closes is still read, so the client gets its last packet.
DEFAULT_CLOSE_LINGER = 1.0
# Engine.drain's close value for a close on the broker's initiative (fastbroker_core).
cdef int CLOSE_LINGER = 2


cdef uint64_t monotonic_now_ms() noexcept nogil:
    cdef timespec now
    clock_gettime(CLOCK_MONOTONIC, &now)
    return <uint64_t>now.tv_sec * 1000 + <uint64_t>(now.tv_nsec // 1000000)


def monotonic_ms():
    """Milliseconds on the clock the engine is fed with (CLOCK_MONOTONIC)."""
    return monotonic_now_ms()


@cython.final
cdef class Server:
    """Owns the engine's connections on one event loop and moves the engine's output to them."""

    def __init__(self, engine, loop, Py_ssize_t write_buffer_high,
                 double tick_interval=DEFAULT_TICK_INTERVAL,
                 Py_ssize_t read_budget=DEFAULT_READ_BUDGET, store=None):
        self.engine = engine
        self.loop = loop
        self.connections = []
        self.flush_scheduled = False
        self.write_buffer_high = write_buffer_high
        # asyncio's default low mark is a quarter of the high one.
        self.write_buffer_low = write_buffer_high // 4
        self.paused = set()
        self.read_budget = read_budget
        self.fed_connections = []
        self.store = store
        self.engine_has_store_ops = engine.has_store_ops
        self.engine_take_store_ops = engine.take_store_ops
        self.failed_ops = None
        self.store_retry_handle = None
        self.sync_handle = None
        self.sync_interval = 0.0
        self.tick_interval = tick_interval
        self.tick_handle = None
        self.engine_feed = engine.feed
        self.engine_drain = engine.drain
        self.engine_has_output = engine.has_output
        self.loop_call_soon = loop.call_soon
        self.flush_callback = self.flush
        self.auth_handler = None
        self.intercept_handler = None
        self.access_handler = None
        self.memory_pressure = False
        self.memory_held = set()
        self.max_sockets = 0
        self.connection_rate = 0.0
        self.accept_tokens = 0.0
        self.accept_refill_ms = 0
        self.sockets_refused = 0
        self.socket_count = 0
        self.shutting_down = False
        self.close_linger = DEFAULT_CLOSE_LINGER
        self.cluster_output = None
        self.store_state_handler = None
        self.reactor_links = 0
        self.links_ended_handler = None
        self.lingering = {}
        self.reactor = None
        self.reactor_infos = []
        self.reactor_kept = {}

    def attach_reactor(self, reactor, list infos):
        """Serves ``reactor``'s sockets (fastbroker_core.Reactor): the loop watches its epoll
        set and each readiness is one call into it, whatever the number of sockets.
        ``infos``: the info dict of each of its listeners, by index."""
        self.reactor = reactor
        self.reactor_infos = infos
        self.loop.add_reader(reactor.fileno(), self.on_reactor_ready)

    def detach_reactor(self):
        if self.reactor is not None:
            self.loop.remove_reader(self.reactor.fileno())

    def on_reactor_ready(self):
        # Flushed at once, not at the next loop iteration: the reactor's sockets were all
        # read in this call, so there is nothing to gather first, and a message read here is
        # written one iteration sooner (latency at low rates).
        if self.reactor.poll(self.engine, monotonic_now_ms(), self.socket_count):
            self.flush()
        if self.reactor_links:
            self.check_links()

    cpdef check_links(self):
        """Tells the cluster's transport of the data links the reactor ended."""
        if self.reactor is not None and self.links_ended_handler is not None:
            ended = self.reactor.take_ended_links()
            if ended:
                self.links_ended_handler(ended)

    def new_connection(self):
        """Protocol factory for ``loop.create_server``."""
        return Connection(self)

    def conn_info(self, Py_ssize_t conn_id, bint keep=True):
        """The listener's details of connection ``conn_id`` (Connection.info), or None.

        Plain TCP connections share their listener's dict (no peer in it), so idle
        connections cost no dict each; the peer is looked up when asked for. With ``keep``
        the connection gets its own dict from then on, the same object at every call (the
        authentication step tells connections apart by it); without, a passing copy (the
        access log, which only reads it)."""
        if self.reactor is not None and conn_id >= 0:
            found = self.reactor.peer(conn_id)
            if found is not None:
                peer, listener, serial = found
                kept = self.reactor_kept.get(conn_id)
                # The serial tells a kept dict from one of an earlier socket with this id.
                if kept is not None and kept[0] == serial:
                    return kept[1]
                info = dict(self.reactor_infos[listener])
                info["peer"] = peer
                if keep:
                    self.reactor_kept[conn_id] = (serial, info)
                return info
        if conn_id < 0 or conn_id >= len(self.connections):
            return None
        entry = self.connections[conn_id]
        if entry is None:
            return None
        connection = <Connection>entry
        info = connection.info
        if info is not None and info.get("peer") is None and connection.transport is not None:
            info = dict(info)
            peer = connection.transport.get_extra_info("peername")
            if isinstance(peer, tuple) and len(peer) >= 2:
                info["peer"] = (peer[0], peer[1])
            if keep:
                connection.info = info
        return info

    @property
    def open_connections(self):
        cdef Py_ssize_t count = 0
        for connection in self.connections:
            if connection is not None:
                count += 1
        if self.reactor is not None:
            count += self.reactor.count
        return count

    cpdef schedule_flush(self):
        """Flushes once at the end of this loop iteration, however many reads happen in it."""
        if not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop_call_soon(self.flush_callback)

    cpdef flush(self):
        """Writes the engine's output and closes the connections it asks to close."""
        cdef list connections = self.connections
        cdef Py_ssize_t conn_id
        cdef Connection connection
        self.flush_scheduled = False
        if self.fed_connections:
            self.reset_read_budgets()
        if self.paused:
            self.recheck_paused()
        self.run_hooks()
        if self.reactor is not None:
            self.forget_reactor_closed()
        if self.store is not None and not self.write_store_ops():
            # Nothing goes out while state it depends on is not stored.
            return
        again = False
        if self.reactor is not None:
            # The reactor writes its sockets' output; the rest is this layer's.
            output, again = self.reactor.drain(self.engine, monotonic_now_ms())
        else:
            output = self.engine_drain()
        for conn_id, data, close in output:
            if conn_id < 0 or conn_id >= len(connections):
                continue
            entry = connections[conn_id]
            if entry is None:
                # Already gone; the engine has been told via connection_lost.
                continue
            connection = <Connection>entry
            if connection.lingering:
                continue
            try:
                if data:
                    connection.transport.write(data)
                    if (not connection.paused and connection.transport is not None
                            and connection.transport.get_write_buffer_size()
                            > self.write_buffer_high):
                        connection.pause()
                if close == CLOSE_LINGER:
                    connection.linger()
                elif close:
                    # The client asked (DISCONNECT): close() still sends what write() buffered.
                    connection.transport.close()
            except Exception:
                logger.exception("writing to connection %d failed; aborting it", conn_id)
                connection.transport.abort()
        if self.cluster_output is not None and self.engine.has_cluster_output():
            # After the store batch: an acknowledgement to a peer says its messages are kept.
            # The reactor writes the frames of the links it serves; the rest go to Python's.
            if self.reactor_links:
                self.cluster_output(self.reactor.drain_cluster(self.engine))
            else:
                self.cluster_output(self.engine.drain_cluster())
        # A long queue is sent a slice per loop iteration: go on in the next one.
        if again or self.engine_has_output():
            self.schedule_flush()

    def start_ticking(self):
        """Starts the periodic ``engine.tick`` (timeouts, expiry) and event logging."""
        if self.tick_handle is None:
            self.tick_handle = self.loop.call_later(self.tick_interval, self.on_tick)

    def stop_ticking(self):
        if self.tick_handle is not None:
            self.tick_handle.cancel()
            self.tick_handle = None

    def on_tick(self):
        # Rescheduled first so one failing tick does not stop timeouts for good.
        self.tick_handle = self.loop.call_later(self.tick_interval, self.on_tick)
        if self.paused:
            self.recheck_paused()
        if self.failed_ops is not None:
            # Clients are not read while the store fails: their keepalives cannot count.
            return
        now = monotonic_now_ms()
        if self.reactor is not None and self.reactor.tick(self.engine, now):
            self.schedule_flush()
        # Stored times are wall-clock; the two clocks drift apart, so re-pair them.
        self.engine.set_wall_clock(<uint64_t>(time.time() * 1000), now)
        self.engine.tick(now)
        self.log_engine_events()
        self.run_hooks()
        # A tick also makes store writes of its own (a will copy that lived a second,
        # expiries): they go now, not at whatever read comes next.
        if self.engine.has_output() or (self.store is not None and self.engine_has_store_ops()):
            self.flush()

    def close_connections(self, server_reference=None):
        """Sends pending output and DISCONNECT 0x8B to MQTT 5 clients (0x9C "use another
        server" with ``server_reference`` when one is given), then closes every connection
        (each still gets connection_lost)."""
        self.shutting_down = True
        self.engine.close_all("server shutting down", monotonic_now_ms(), server_reference)
        self.flush()
        for connection in list(self.connections):
            if connection is not None and (<Connection>connection).transport is not None:
                (<Connection>connection).linger()
        if self.reactor is not None:
            self.reactor.linger_all(self.engine, monotonic_now_ms())

    def abort_connections(self):
        """Drops every connection without waiting for its write buffer to drain."""
        for connection in list(self.connections):
            if connection is not None and (<Connection>connection).transport is not None:
                (<Connection>connection).transport.abort()
        if self.reactor is not None:
            self.reactor.abort_all(self.engine, monotonic_now_ms())

    cdef run_hooks(self):
        """Hands what the engine produced for the control plane to its handlers, and reads
        again the connections the engine no longer holds. A few cheap checks when idle."""
        engine = self.engine
        if engine.has_resumed():
            self.take_resumed()
        if self.auth_handler is not None and engine.has_auth_requests():
            self.auth_handler(engine.auth_requests())
        if self.intercept_handler is not None and engine.has_intercepted():
            self.intercept_handler(engine.take_intercepted())
        if engine.has_access_events():
            events = engine.take_access_events()
            if self.access_handler is not None:
                self.access_handler(events)

    cdef forget_reactor_closed(self):
        # After run_hooks: the access log has read the details of what ended.
        closed = self.reactor.take_closed()
        if closed and self.reactor_kept:
            for conn_id in closed:
                self.reactor_kept.pop(conn_id, None)

    cdef take_resumed(self):
        cdef Connection connection
        cdef list connections = self.connections
        reactor = self.reactor
        for conn_id in self.engine.take_resumed():
            if reactor is not None and reactor.owns(conn_id):
                reactor.resume(conn_id)
                continue
            if conn_id < 0 or conn_id >= len(connections) or connections[conn_id] is None:
                continue
            connection = <Connection>connections[conn_id]
            if connection.held:
                connection.held = False
                if connection.may_read() and connection.transport is not None:
                    connection.transport.resume_reading()

    def set_memory_pressure(self, bint pressure):
        """Past the memory high-water mark, publishers are not read; below it again, they
        are. Subscribers are always read: their acknowledgements are what frees memory.
        Returns how many connections are read again."""
        cdef Connection connection
        cdef Py_ssize_t resumed = 0
        if pressure == self.memory_pressure:
            return 0
        self.memory_pressure = pressure
        if self.reactor is not None:
            resumed = self.reactor.set_memory_pressure(pressure)
        if pressure:
            return 0
        held = self.memory_held
        self.memory_held = set()
        for connection in held:
            connection.memory_held = False
            if connection.may_read() and connection.transport is not None:
                connection.transport.resume_reading()
                resumed += 1
        return resumed

    @property
    def store_failing(self):
        """Whether a store write is failing (output held, reading paused until it works)."""
        return self.failed_ops is not None

    @property
    def memory_held_connections(self):
        if self.reactor is not None:
            return len(self.memory_held) + self.reactor.memory_held()
        return len(self.memory_held)

    def admit_socket(self):
        """For listener adapters, at accept: whether the socket may be served (the socket cap
        and accept rate), so a TLS or WebSocket flood is refused before its handshakes."""
        if self.admit():
            return True
        self.sockets_refused += 1
        return False

    cdef bint admit(self):
        """Whether a new socket may be served: under the socket cap and the accept rate."""
        cdef uint64_t now
        if self.reactor is not None:
            # One cap and one accept rate for both layers.
            return self.reactor.admit_external(monotonic_now_ms(), self.socket_count)
        if self.max_sockets > 0 and self.socket_count >= self.max_sockets:
            return False
        if self.connection_rate > 0:
            now = monotonic_now_ms()
            self.accept_tokens = min(
                self.connection_rate,
                self.accept_tokens + (now - self.accept_refill_ms) * self.connection_rate / 1000.0)
            self.accept_refill_ms = now
            if self.accept_tokens < 1.0:
                return False
            self.accept_tokens -= 1.0
        return True

    cdef register(self, Connection connection):
        cdef list connections = self.connections
        cdef Py_ssize_t conn_id = connection.conn_id
        while len(connections) <= conn_id:
            connections.append(None)
        if connections[conn_id] is not None:
            logger.error("engine reused live connection id %d", conn_id)
        connections[conn_id] = connection

    cdef unregister(self, Py_ssize_t conn_id):
        if 0 <= conn_id < len(self.connections):
            self.connections[conn_id] = None

    cdef recheck_paused(self):
        # uvloop 0.23 sometimes never calls resume_writing after pause_writing although the
        # buffer has drained (seen under 50 paused subscribers at once); without this check
        # such a subscriber gets nothing more, ever. Only paused connections are looked at.
        cdef Connection connection
        for connection in list(self.paused):
            if connection.transport is None:
                self.paused.discard(connection)
            elif connection.transport.get_write_buffer_size() <= self.write_buffer_low:
                connection.resume()

    cdef reset_read_budgets(self):
        cdef Connection connection
        cdef list fed = self.fed_connections
        self.fed_connections = []
        for connection in fed:
            connection.fed_bytes = 0
            if connection.reading_paused:
                connection.reading_paused = False
                if connection.may_read() and connection.transport is not None:
                    connection.transport.resume_reading()

    cdef bint write_store_ops(self) except -1:
        """Writes the engine's store operations as one batch; False while the store fails.

        Every acknowledgement or PUBLISH in the coming drain may depend on these records (a
        PUBACK on the message being stored, a QoS 2 PUBLISH on its packet id being stored),
        so they are written first. If the write fails (e.g. disk full): the publishers of
        the batch are disconnected before their acknowledgements go out, every connection
        stops being read (so no new state piles up), output is held, and the batch is
        retried every STORE_RETRY_INTERVAL until the store takes it; then all resumes."""
        if self.failed_ops is not None:
            return False
        if not self.engine_has_store_ops():
            return True
        ops = self.engine_take_store_ops()
        try:
            self.store.write(ops)
            self.arm_sync()
        except StoreWriteError as error:
            self.failed_ops = ops
            publishers = self.engine.store_failed(monotonic_now_ms())
            logger.error("%s; %d publishers of the failed batch are disconnected, reading is "
                         "paused until it is stored", error, len(publishers))
            for conn_id in publishers:
                if self.reactor is not None and self.reactor.owns(conn_id):
                    self.reactor.abort(conn_id, self.engine, monotonic_now_ms())
                    continue
                entry = self.connections[conn_id] if conn_id < len(self.connections) else None
                if entry is not None and (<Connection>entry).transport is not None:
                    (<Connection>entry).transport.abort()
            self.set_reading_all(False)
            self.store_retry_handle = self.loop.call_later(STORE_RETRY_INTERVAL,
                                                           self.retry_store)
            if self.store_state_handler is not None:
                self.store_state_handler(True)
            return False
        return True

    def retry_store(self):
        self.store_retry_handle = None
        ops = self.failed_ops
        if ops is None:
            return
        try:
            if self.store.recover():
                self.store.write(ops)
                self.failed_ops = None
                self.arm_sync()
        except StoreWriteError as error:
            logger.warning("store still failing: %s", error)
        if self.failed_ops is not None:
            self.store_retry_handle = self.loop.call_later(STORE_RETRY_INTERVAL,
                                                           self.retry_store)
            return
        logger.warning("store writable again; the held batch is stored, resuming")
        self.set_reading_all(True)
        if self.store_state_handler is not None:
            self.store_state_handler(False)
        self.flush()

    def start_syncing(self, double interval):
        """Group commit for fsync = "interval": the WAL is synced at most ``interval`` s after
        a write. The timer runs only while something written is not yet synced, so an idle
        broker is not woken 1/interval times a second."""
        self.sync_interval = interval
        # Whatever was written before (the restore's clean-up) gets its sync too.
        self.arm_sync()

    def stop_syncing(self):
        self.sync_interval = 0.0
        if self.sync_handle is not None:
            self.sync_handle.cancel()
            self.sync_handle = None

    def close_store(self):
        """The broker stops and its store closes next: what the engine has to store now is
        written, and no flush after this one writes (links closing as the loop ends change
        nothing that must survive; writing then failed with "the store is closed")."""
        if self.store is not None and self.failed_ops is None:
            self.write_store_ops()
        if self.store_retry_handle is not None:
            self.store_retry_handle.cancel()
            self.store_retry_handle = None
        self.store = None

    cdef arm_sync(self):
        if self.sync_interval > 0.0 and self.sync_handle is None:
            self.sync_handle = self.loop.call_later(self.sync_interval, self.on_sync)

    def on_sync(self):
        self.sync_handle = None
        if self.failed_ops is not None:
            # retry_store arms the timer again once the held batch is written.
            return
        try:
            self.store.sync()
        except StoreWriteError as error:
            # The next write fails the same way and takes the failure path.
            logger.error("%s", error)

    cdef set_reading_all(self, bint reading):
        cdef Connection connection
        if self.reactor is not None:
            self.reactor.set_reading(reading)
        for entry in self.connections:
            if entry is None:
                continue
            connection = <Connection>entry
            if connection.transport is None or connection.transport.is_closing():
                continue
            if reading:
                if connection.may_read():
                    connection.transport.resume_reading()
            else:
                connection.transport.pause_reading()

    cdef log_engine_events(self):
        # Drained even when nothing is logged, so the engine's event buffer stays bounded.
        events = self.engine.events()
        for kind, client_id, detail in events:
            level = EVENT_LOG_LEVELS.get(kind, logging.INFO)
            if event_logger.isEnabledFor(level):
                event_logger.log(level, "%s client_id=%r %s", kind, client_id, detail)


@cython.final
cdef class Connection:
    """asyncio.Protocol for one MQTT network connection."""

    def __cinit__(self, Server server):
        self.server = server
        self.conn_id = -1
        self.transport = None
        self.paused = False
        self.reading_paused = False
        self.fed_bytes = 0
        self.held = False
        self.memory_held = False
        self.admitted = False
        self.info = None
        self.lingering = False

    cdef bint may_read(self):
        return not (self.reading_paused or self.held or self.memory_held)

    def connection_made(self, transport):
        cdef Server server = self.server
        if not self.admitted and not server.admit():
            # Refused before the engine sees it: a flood costs an accept and a close.
            server.sockets_refused += 1
            transport.abort()
            return
        server.socket_count += 1
        self.transport = transport
        transport.set_write_buffer_limits(high=self.server.write_buffer_high)
        # No TCP_NODELAY here: uvloop's and asyncio's TCP transports set it, and asking for
        # the socket would cost every connection a socket object and a system call.
        self.conn_id = self.server.engine.open(monotonic_now_ms())
        self.server.register(self)
        # A connect timeout or similar may already have output; cheap when there is none.
        self.server.schedule_flush()

    def data_received(self, data):
        cdef Server server = self.server
        if self.lingering:
            # The broker has said its last word: the rest is read only so the client is not
            # reset before it has read that.
            return
        cdef int flags = server.engine_feed(self.conn_id, data, monotonic_now_ms())
        if flags:
            # 1: the engine holds this connection (rate limit, interception, authentication);
            # 2: it publishes, and is not read while memory is under pressure.
            if flags & 1 and not self.held:
                self.held = True
                if self.transport is not None:
                    self.transport.pause_reading()
            if flags & 2 and server.memory_pressure and not self.memory_held:
                self.memory_held = True
                server.memory_held.add(self)
                if self.transport is not None:
                    self.transport.pause_reading()
        if self.fed_bytes == 0:
            server.fed_connections.append(self)
        self.fed_bytes += len(data)
        if self.fed_bytes >= server.read_budget and self.transport is not None:
            # Resumed by the next flush, once this iteration's output is written.
            self.reading_paused = True
            self.transport.pause_reading()
        if not server.flush_scheduled:
            server.flush_scheduled = True
            server.loop_call_soon(server.flush_callback)

    def eof_received(self):
        # MQTT has no use for half-open connections: let the transport close.
        return False

    cdef linger(self):
        """Closes on the broker's initiative without resetting the connection.

        Closing a socket whose receive buffer holds unread bytes makes the kernel send a reset,
        and a reset discards what the client has not read yet: often the DISCONNECT that says
        why. So the write side is shut once the output is sent (the client reads an orderly
        end of stream), and the socket is read and the bytes discarded until the client
        closes, or the linger passes and it is cut off. It stays counted against the socket
        limits meanwhile."""
        cdef Server server = self.server
        transport = self.transport
        if self.lingering or transport is None:
            return
        self.lingering = True
        if server.close_linger <= 0 or not transport.can_write_eof():
            # TLS has its own closing handshake; close() still sends what write() buffered.
            transport.close()
            return
        transport.write_eof()
        if self.memory_held:
            self.memory_held = False
            server.memory_held.discard(self)
        self.held = False
        self.reading_paused = False
        transport.resume_reading()
        server.lingering[self] = server.loop.call_later(server.close_linger, self.linger_expired)

    def linger_expired(self):
        self.server.lingering.pop(self, None)
        if self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc):
        cdef Server server = self.server
        cdef Py_ssize_t conn_id = self.conn_id
        if self.transport is None:
            # Refused by admit(): never counted, never registered.
            return
        self.transport = None
        server.socket_count -= 1
        if self.lingering:
            handle = server.lingering.pop(self, None)
            if handle is not None:
                handle.cancel()
        if self.paused:
            self.paused = False
            server.paused.discard(self)
        if self.memory_held:
            self.memory_held = False
            server.memory_held.discard(self)
        if conn_id < 0:
            return
        self.conn_id = -1
        server.engine.closed(conn_id, monotonic_now_ms(),
                             "server shutdown" if server.shutting_down else None)
        # The access log reads the connection's details, so they go before it is forgotten.
        server.run_hooks()
        server.unregister(conn_id)
        # Closing may publish a will message or end a takeover: others may have output now.
        server.schedule_flush()

    def pause_writing(self):
        self.pause()

    def resume_writing(self):
        self.resume()

    cdef pause(self):
        if self.paused or self.conn_id < 0:
            return
        self.paused = True
        self.server.paused.add(self)
        self.server.engine.set_writable(self.conn_id, False, monotonic_now_ms())

    cdef resume(self):
        if not self.paused:
            return
        self.paused = False
        self.server.paused.discard(self)
        if self.conn_id >= 0:
            self.server.engine.set_writable(self.conn_id, True, monotonic_now_ms())
            # The engine held this connection's output back; send it now.
            self.server.schedule_flush()
