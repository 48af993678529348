"""The store's write path in compiled code: the engine's store operations of one loop
iteration go into a RocksDB write batch here, so no Python bytecode runs per operation
(fastbroker.store.Store.write calls this once per batch)."""


def fill_write_batch(object batch, list ops):
    """Puts each ``(key, value)`` of ``ops`` into ``batch`` (a rocksdict WriteBatch in raw
    mode); value None deletes the key. Raises TypeError if an op is not a pair of bytes and
    bytes or None (the batch is then to be thrown away: it may hold the ops before it)."""
    cdef object put = batch.put
    cdef object delete = batch.delete
    cdef object op
    for op in ops:
        if not isinstance(op, tuple) or len(<tuple>op) != 2:
            raise TypeError("every op must be (bytes key, bytes value or None)")
        key = (<tuple>op)[0]
        value = (<tuple>op)[1]
        if not isinstance(key, bytes):
            raise TypeError("every op must be (bytes key, bytes value or None)")
        if value is None:
            delete(key)
        elif isinstance(value, bytes):
            put(key, value)
        else:
            raise TypeError("every op must be (bytes key, bytes value or None)")
