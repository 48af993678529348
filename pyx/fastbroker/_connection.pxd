# Declarations of the connection layer, split from the .pyx as uvloop does, so other Cython
# modules can cimport these classes and call their cdef members without Python dispatch.

cimport cython
from libc.stdint cimport uint64_t


cdef uint64_t monotonic_now_ms() noexcept nogil


@cython.final
cdef class Server:
    cdef readonly object engine
    cdef object loop
    # Index = engine connection id; None where no connection is open.
    cdef readonly list connections
    cdef bint flush_scheduled
    cdef readonly Py_ssize_t write_buffer_high
    cdef readonly Py_ssize_t write_buffer_low
    # Connections the engine was told not to write to; re-checked on every flush and tick.
    cdef set paused
    # Bytes a connection may feed per loop iteration before its reading pauses until the
    # flush: libuv reads a busy socket up to 32 times per iteration, so without this one
    # iteration can swallow hundreds of MB from fast publishers before anything is written.
    cdef readonly Py_ssize_t read_budget
    cdef list fed_connections
    cdef readonly double tick_interval
    cdef object tick_handle
    # Bound methods looked up once: the per-read path must not pay attribute lookups.
    cdef object engine_feed
    cdef object engine_drain
    cdef object engine_has_output
    cdef object loop_call_soon
    cdef object flush_callback
    # Durable state (fastbroker.store.Store) or None; see flush().
    cdef readonly object store
    cdef object engine_has_store_ops
    cdef object engine_take_store_ops
    # The batch a failed store write left: retried before anything else is written.
    cdef object failed_ops
    cdef object store_retry_handle
    cdef object sync_handle
    # fsync = "interval": seconds between a write and its sync; 0 = not syncing.
    cdef double sync_interval
    # Control-plane hooks (fastbroker.auth, fastbroker.access_log); None when unused. Each is
    # called with a batch the engine produced, at most once per flush.
    cdef public object auth_handler
    cdef public object intercept_handler
    cdef public object access_handler
    # Overload protection (fastbroker.overload): while memory_pressure is set, connections
    # that publish are not read (backpressure); they wait in memory_held.
    cdef readonly bint memory_pressure
    cdef set memory_held
    # Sockets beyond this many are dropped on accept (0 = no cap), and at most connection_rate
    # accepted per second (0 = no limit; a token bucket with a one-second burst).
    cdef public Py_ssize_t max_sockets
    cdef public double connection_rate
    cdef double accept_tokens
    cdef uint64_t accept_refill_ms
    cdef readonly uint64_t sockets_refused
    cdef Py_ssize_t socket_count
    # Set by close_connections: connections ending now are logged as a server shutdown.
    cdef bint shutting_down
    # After the broker's last packet a connection is half-closed and read (and what it sends
    # discarded) until the client closes or this many seconds pass; 0 closes at once.
    cdef public double close_linger
    # The cluster's data plane (fastbroker.cluster.dataplane.DataPlane.send), or None: called
    # by flush with the frames the engine made for other nodes, after the store batch.
    cdef public object cluster_output
    # Called with True when the store starts failing (disk full) and False once it takes
    # writes again (the cluster's data plane: peers must not wait on this node meanwhile).
    cdef public object store_state_handler
    # Connection -> the timer that cuts it off at the end of its linger.
    cdef dict lingering
    # The compiled connection layer (fastbroker_core.Reactor) or None: plain TCP sockets it
    # serves are fed and written in Rust; its listeners' info dicts by index, and the dicts
    # conn_info gave its connections to keep (by connection id).
    cdef readonly object reactor
    cdef readonly list reactor_infos
    cdef dict reactor_kept
    # Cluster data links the reactor serves (Reactor.adopt_link), and what is told of
    # their ends: called with Reactor.take_ended_links' list (the cluster's transport).
    cdef public Py_ssize_t reactor_links
    cdef public object links_ended_handler

    cpdef schedule_flush(self)
    cpdef check_links(self)
    cpdef flush(self)
    cdef register(self, Connection connection)
    cdef unregister(self, Py_ssize_t conn_id)
    cdef log_engine_events(self)
    cdef recheck_paused(self)
    cdef reset_read_budgets(self)
    cdef arm_sync(self)
    cdef bint write_store_ops(self) except -1
    cdef set_reading_all(self, bint reading)
    cdef run_hooks(self)
    cdef take_resumed(self)
    cdef bint admit(self)
    cdef forget_reactor_closed(self)


@cython.final
cdef class Connection:
    cdef readonly Py_ssize_t conn_id
    cdef readonly object transport
    cdef Server server
    cdef bint paused
    cdef bint reading_paused
    cdef Py_ssize_t fed_bytes
    # The engine asked not to be fed (publish rate, interception backlog, pending auth), and
    # memory pressure stopped reading this publisher: reading resumes only when neither holds.
    cdef bint held
    cdef bint memory_held
    # Already let in by a listener adapter at accept, before its handshake (TLS, WebSocket,
    # PROXY): the connection limits are not applied twice.
    cdef public bint admitted
    # Set by the listener (fastbroker.listeners) before connection_made: "listener", "peer",
    # "cert_cn", "use_identity_as_username", "transport", "proxy"; None if not from one.
    cdef public object info
    # Half-closed after the broker's last packet, waiting for the client to close (linger).
    # (Its timer is in Server.lingering: no field per connection for the rare case.)
    cdef readonly bint lingering

    cdef linger(self)
    cdef pause(self)
    cdef resume(self)
    cdef bint may_read(self)
