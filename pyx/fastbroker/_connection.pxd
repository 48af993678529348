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
    cdef list connections
    cdef bint flush_scheduled
    cdef readonly Py_ssize_t write_buffer_high
    cdef readonly double tick_interval
    cdef object tick_handle
    # Bound methods looked up once: the per-read path must not pay attribute lookups.
    cdef object engine_feed
    cdef object engine_drain
    cdef object loop_call_soon
    cdef object flush_callback

    cpdef schedule_flush(self)
    cpdef flush(self)
    cdef register(self, Connection connection)
    cdef unregister(self, Py_ssize_t conn_id)
    cdef log_engine_events(self)


@cython.final
cdef class Connection:
    cdef readonly Py_ssize_t conn_id
    cdef readonly object transport
    cdef Server server
