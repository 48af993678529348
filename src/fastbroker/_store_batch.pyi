"""Types of the Cython module built from pyx/fastbroker/_store_batch.pyx."""

from rocksdict import WriteBatch

def fill_write_batch(batch: WriteBatch, ops: list[tuple[bytes, bytes | None]]) -> None: ...
