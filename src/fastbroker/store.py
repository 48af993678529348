"""Durable broker state on RocksDB (through rocksdict, in raw bytes mode).

The engine hands over its records as opaque bytes, once per event-loop iteration, as a list of
``(key, value)`` operations (``value`` None deletes the key); `Store.write` applies each list as
one atomic RocksDB write batch (filled in compiled code, pyx/fastbroker/_store_batch.pyx: no
Python bytecode per operation), and `Store.load` gives every record back, in key order, at
start-up. A key's first byte is the record kind (b"s" session, b"m" queued message, ...), which
is all anyone outside the engine may rely on; this layer interprets neither keys nor values.

Layout of the data directory::

    DATA_DIR/FORMAT   JSON marker {"format": "fastbroker-store", "version": 1}, written once,
                      before the database, and never changed; also the lock of the directory
                      (flock, held while a Store is open)
    DATA_DIR/store/   the RocksDB database

A new database is created in ``store.creating/`` and renamed to ``store/`` once complete, so a
``store/`` always holds a database that was once complete, and a crash at any point of the
creation is recognisable (marker present, no ``store/``) and simply redone by the next open.

Every problem at start-up is a `StoreError` described in one line naming the directory. An open
that refuses a directory (unknown or newer format, no marker, damaged database, in use) leaves
every file in it byte-for-byte unchanged: the checks that RocksDB makes happen on a read-only
open first, which writes nothing, and only a store that passed them is opened for writing.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from bisect import bisect_left
from collections.abc import Iterator
from typing import cast

from rocksdict import (
    AccessType,
    DBCompressionType,
    DBRecoveryMode,
    Options,
    Rdict,
    WriteBatch,
    WriteOptions,
)

logger = logging.getLogger("fastbroker.store")


def fill_write_batch_python(batch: WriteBatch, ops: list[tuple[bytes, bytes | None]]) -> None:
    """What pyx/fastbroker/_store_batch.pyx does, in Python: for a source tree without its
    compiled modules (tools run from src/, such as `fastbroker passwd`), and as the
    reference the compiled one is tested and measured against."""
    put, delete = batch.put, batch.delete
    for op in ops:
        if not (isinstance(op, tuple) and len(op) == 2 and isinstance(op[0], bytes)):
            raise TypeError("every op must be (bytes key, bytes value or None)")
        key, value = op
        if value is None:
            delete(key)
        elif isinstance(value, bytes):
            put(key, value)
        else:
            raise TypeError("every op must be (bytes key, bytes value or None)")


try:
    # Compiled: no Python bytecode per operation on the store path.
    from fastbroker._store_batch import fill_write_batch
except ImportError:
    fill_write_batch = fill_write_batch_python

FORMAT_NAME = "fastbroker-store"
FORMAT_VERSION = 1
MARKER_FILE = "FORMAT"
DB_DIR = "store"
CREATING_DIR = "store.creating"

FSYNC_POLICIES = ("always", "interval", "never")
FSYNC_INTERVAL_MS_MIN = 1
FSYNC_INTERVAL_MS_MAX = 60_000

# Records per native iterator in load(): no RocksDB iterator stays alive while the caller holds
# the generator (a live iterator would keep the database open after close()).
LOAD_CHUNK = 4096
# A marker is a few dozen bytes; anything much bigger is not one.
MARKER_MAX_BYTES = 4096


# Upper bounds (nanoseconds) of the buckets of the write and sync latency histograms (the
# /metrics endpoint reports them in seconds): 100 us to 1 s; slower ones count as +Inf.
LATENCY_BUCKETS_NS = (
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
)


class LatencyHistogram:
    """Counts of durations per bucket of LATENCY_BUCKETS_NS (the last count: slower than all),
    and their sum; a bisect and two additions per observation."""

    __slots__ = ("counts", "sum_ns")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS_NS) + 1)
        self.sum_ns = 0

    def observe(self, duration_ns: int) -> None:
        # bisect_left: a duration equal to a bound belongs to that bound's bucket (le).
        self.counts[bisect_left(LATENCY_BUCKETS_NS, duration_ns)] += 1
        self.sum_ns += duration_ns

    @property
    def count(self) -> int:
        return sum(self.counts)


class StoreError(Exception):
    """The store cannot be opened or used; described in one line naming the data directory."""


class StoreWriteError(StoreError):
    """A write (or sync) failed, e.g. on a full disk. The database stays consistent and
    nothing stored before is damaged. The failed batch is never half applied: it is absent,
    or entirely present if only its confirmation failed (e.g. the sync after it was written).
    Writes keep failing until `Store.recover` succeeds."""


def db_options(*, create: bool) -> Options:
    options = Options(raw_mode=True)
    options.create_if_missing(create)
    options.set_error_if_exists(create)
    # RocksDB stops at the first inconsistency it meets instead of carrying on: the open fails
    # with a Corruption error, and after a failed write (WAL, flush) the database refuses all
    # writes until reopened (recover()). RocksDB's default, set so that it stays so.
    options.set_paranoid_checks(True)
    # Point-in-time recovery replays the WAL up to the first damaged record and stops there,
    # which always yields a consistent prefix of the acknowledged batches (never half of one).
    # That covers a torn last write after kill -9 and, with fsync = "interval" or "never", an
    # unsynced WAL tail that a power loss left truncated, zero-filled or holding stale bytes,
    # where tolerate-corrupted-tail refuses to open (measured: a zeroed or garbled last record
    # is a "checksum mismatch" to it). The price: damage in the middle of the WAL also ends the
    # replay there, silently but for a warning in store/LOG ("dropping N bytes").
    options.set_wal_recovery_mode(DBRecoveryMode.point_in_time())
    # Values arrive compressed (and checksummed) by the engine: RocksDB's default Snappy would
    # spend CPU on every flush and compaction to gain next to nothing.
    options.set_compression_type(DBCompressionType.none())
    # Everything else is RocksDB's default: a 64 MiB memtable, level compaction, every SST
    # file opened (footer and index read) at open.
    return options


def read_everything(db: Rdict) -> None:
    """Reads every record, verifying block checksums; raises what RocksDB reports."""
    iterator = db.iter()
    try:
        iterator.seek_to_first()
        valid, advance = iterator.valid, iterator.next
        while valid():
            advance()
        # A read error ends the iteration as if at the end; status() raises it.
        iterator.status()
    finally:
        # A live iterator keeps the database open, past close(); an exception's traceback
        # would keep this frame's locals alive.
        iterator = valid = advance = None  # type: ignore[assignment]


def read_chunk(db: Rdict, start: bytes, prefix: bytes, chunk: list[tuple[bytes, bytes]]) -> None:
    """Appends to ``chunk`` up to LOAD_CHUNK records from ``start`` on whose keys start with
    ``prefix``; raises what RocksDB reports."""
    iterator = db.iter()
    try:
        iterator.seek(start)
        valid, key, value, advance = iterator.valid, iterator.key, iterator.value, iterator.next
        append = chunk.append
        remaining = LOAD_CHUNK
        while remaining and valid():
            record_key = key()
            if not record_key.startswith(prefix):
                break
            append((record_key, value()))
            advance()
            remaining -= 1
        iterator.status()
    finally:
        iterator = valid = key = value = advance = None  # type: ignore[assignment]


def one_line(text: str) -> str:
    return " ".join(text.split())


def failure_reason(error: BaseException) -> str:
    """The cause of a RocksDB error, short and plain for the errors an operator can fix."""
    message = one_line(str(error))
    if "No space left on device" in message:
        return "no space left on device"
    if "Disk quota exceeded" in message:
        return "disk quota exceeded"
    if "Read-only file system" in message:
        return "read-only file system"
    if "Permission denied" in message:
        return "permission denied"
    return f"RocksDB: {message}"


def os_reason(error: OSError) -> str:
    if error.errno is not None and error.errno > 0:
        return os.strerror(error.errno).lower()
    return str(error)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def flock_holder(path: str) -> int | None:
    """The pid holding a lock on ``path`` according to /proc/locks (Linux), if it shows one."""
    try:
        stat = os.stat(path)
        device_inode = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
        with open("/proc/locks", encoding="ascii", errors="replace") as locks:
            for line in locks:
                # "1: FLOCK  ADVISORY  WRITE 1234 00:2d:5678 0 EOF"; waiters have "->".
                fields = line.split()
                if len(fields) >= 6 and fields[1] != "->" and fields[5] == device_inode:
                    pid = int(fields[4])
                    return pid if pid > 0 else None
    except (OSError, ValueError):
        pass
    return None


class Store:
    """An open data directory. Create with `Store.open`; not thread-safe (the event loop's)."""

    def __init__(self, data_dir: str, lock_fd: int, fsync: str, fsync_interval_ms: int) -> None:
        self.data_dir = data_dir
        self.fsync = fsync
        # How often the broker is to call sync() (meaningful with fsync = "interval").
        self.fsync_interval_ms = fsync_interval_ms
        self._db_path = os.path.join(data_dir, DB_DIR)
        self._lock_fd: int | None = lock_fd
        self._db: Rdict | None = None
        self._write_options = WriteOptions()
        # "always": RocksDB syncs the WAL before write() returns; otherwise the batch is only
        # handed to the OS (a write() syscall), which survives a crash of the process.
        self._write_options.sync = fsync == "always"
        self._unsynced = False
        # Why writes fail (the first error since the last successful recover()), or None.
        self._failure: str | None = None
        # For /metrics (fastbroker.metrics), counted per batch, never per record: successful
        # write() batches and sync() flushes, RocksDB errors of either, and records written.
        self.write_latency = LatencyHistogram()
        self.sync_latency = LatencyHistogram()
        self.write_errors = 0
        self.records_written = 0

    # ------------------------------------------------------------------ opening

    @classmethod
    def open(cls, data_dir: str, fsync: str = "interval", fsync_interval_ms: int = 10) -> Store:
        """Opens (creating if need be) the store in ``data_dir``. Raises StoreError."""
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync: expected one of {', '.join(FSYNC_POLICIES)}, got {fsync!r}")
        if (
            type(fsync_interval_ms) is not int
            or not FSYNC_INTERVAL_MS_MIN <= fsync_interval_ms <= FSYNC_INTERVAL_MS_MAX
        ):
            raise ValueError(
                f"fsync_interval_ms: expected an integer from {FSYNC_INTERVAL_MS_MIN} to "
                f"{FSYNC_INTERVAL_MS_MAX}, got {fsync_interval_ms!r}"
            )
        data_dir = os.fspath(data_dir)
        lock_fd = lock_data_dir(data_dir)
        store = cls(data_dir, lock_fd, fsync, fsync_interval_ms)
        try:
            if not os.path.isdir(store._db_path):
                store._create_db()
            store._verify_read_only()
            store._db = store._open_db()
        except BaseException:
            store._release_lock()
            raise
        return store

    def _create_db(self) -> None:
        """Creates an empty database in store.creating/ and renames it to store/."""
        creating = os.path.join(self.data_dir, CREATING_DIR)
        try:
            # Left by a creation that crashed (we hold the lock: nobody else is creating).
            if os.path.lexists(creating):
                shutil.rmtree(creating)
            db = Rdict(creating, db_options(create=True))
            db.close()
            os.rename(creating, self._db_path)
            fsync_dir(self.data_dir)
        except OSError as error:
            raise StoreError(
                f"cannot create the store in data directory {self.data_dir}: {os_reason(error)}"
            ) from None
        except Exception as error:  # rocksdict raises plain Exception
            raise StoreError(
                f"cannot create the store in data directory {self.data_dir}: "
                f"{failure_reason(error)}"
            ) from None
        logger.info("created a new store in %s", self._db_path)

    def _verify_read_only(self) -> None:
        """Opens the database read-only and reads every record with its checksums, so that a
        damaged database is refused before anything is written to the directory (an open for
        writing rolls the info LOG and starts recovery before it can report corruption, and
        RocksDB reports a damaged data block only when it is read)."""
        try:
            db = Rdict(
                self._db_path,
                db_options(create=False),
                access_type=AccessType.read_only(False),
            )
        except Exception as error:
            raise self._open_failed(error) from None
        try:
            read_everything(db)
        except Exception as error:
            raise self._open_failed(error) from None
        finally:
            db.close()

    def _open_db(self) -> Rdict:
        try:
            return Rdict(self._db_path, db_options(create=False))
        except Exception as error:
            raise self._open_failed(error) from None

    def _open_failed(self, error: BaseException) -> StoreError:
        message = one_line(str(error))
        where = f"data directory {self.data_dir}"
        if "lock hold by current process" in message:
            return StoreError(f"{where} is already open in this process (pid {os.getpid()})")
        if "lock file" in message.lower():
            pid = flock_holder(os.path.join(self._db_path, "LOCK"))
            return StoreError(f"{where} is in use by another process (pid {pid or 'unknown'})")
        reason = failure_reason(error)
        if not reason.startswith("RocksDB: "):
            return StoreError(f"cannot open the store in {where}: {reason}")
        return StoreError(
            f"{where}: the store is damaged or incomplete ({reason}): refusing to open it; "
            "restore it from a backup or move the directory away"
        )

    # ------------------------------------------------------------------ writing

    def write(self, ops: list[tuple[bytes, bytes | None]]) -> None:
        """Applies ``ops`` as one atomic batch (value None deletes the key), synced first with
        fsync = "always". Raises StoreWriteError if it fails, TypeError if an op is not
        ``(bytes, bytes | None)`` (then nothing is written)."""
        db = self._db
        if db is None:
            raise self._unavailable()
        if not ops:
            return
        batch = WriteBatch(raw_mode=True)
        try:
            fill_write_batch(batch, ops)
        except (ValueError, KeyError, TypeError):
            raise TypeError(
                "Store.write: every op must be (bytes key, bytes value or None)"
            ) from None
        started = time.perf_counter_ns()
        try:
            db.write(batch, self._write_options)
        except Exception as error:
            self.write_errors += 1
            raise self._write_failed(error) from None
        self.write_latency.observe(time.perf_counter_ns() - started)
        self.records_written += len(ops)
        self._unsynced = True

    def sync(self) -> None:
        """With fsync = "interval": flushes the WAL to disk (fsync) if anything was written
        since the last sync. Nothing to do with "always" (every write is synced) or "never"."""
        db = self._db
        if db is None:
            raise self._unavailable()
        if self._failure is not None:
            raise self._write_error()
        if self.fsync != "interval" or not self._unsynced:
            return
        started = time.perf_counter_ns()
        try:
            db.flush_wal(True)
        except Exception as error:
            self.write_errors += 1
            raise self._write_failed(error) from None
        self.sync_latency.observe(time.perf_counter_ns() - started)
        self._unsynced = False

    def _write_failed(self, error: BaseException) -> StoreWriteError:
        if self._failure is None:
            # Later errors say less ("Writer has previous error"): keep the first cause.
            self._failure = failure_reason(error)
        return self._write_error()

    def _write_error(self) -> StoreWriteError:
        return StoreWriteError(f"cannot write to data directory {self.data_dir}: {self._failure}")

    def _unavailable(self) -> StoreError:
        if self._lock_fd is None:
            return StoreWriteError(f"the store in data directory {self.data_dir} is closed")
        return StoreWriteError(
            f"cannot write to data directory {self.data_dir}: {self._failure} "
            "(the store stays closed until recover() succeeds)"
        )

    def recover(self) -> bool:
        """Makes the store writable again after a StoreWriteError, once its cause is gone
        (e.g. space freed). rocksdict has no DB::Resume(), so this closes the database and
        opens the same directory again: RocksDB replays the WAL (everything written before the
        failure; the failed batch's torn record, if any, is dropped whole) and flushes it,
        which needs about as much free space as the WAL holds. Returns True when the store is
        open and writable, False when reopening failed (the store then stays closed for
        writing and reading; call recover() again later). Nothing stored is lost either way."""
        if self._lock_fd is None:
            raise self._unavailable()
        if self._db is not None and self._failure is None:
            return True
        db, self._db = self._db, None
        if db is not None:
            try:
                db.close()
            except Exception as error:
                # Closing flushes the memtable, which fails like the write did; the database
                # is closed all the same and the WAL still holds the data.
                logger.debug("closing the failed store: %s", one_line(str(error)))
        try:
            self._db = Rdict(self._db_path, db_options(create=False))
        except Exception as error:
            self._failure = failure_reason(error)
            logger.warning("store in %s not writable yet: %s", self.data_dir, self._failure)
            return False
        self._failure = None
        self._unsynced = False
        logger.info("store in %s is writable again", self.data_dir)
        return True

    # ------------------------------------------------------------------ reading

    def load(self, prefix: bytes = b"") -> Iterator[tuple[bytes, bytes]]:
        """Every record whose key starts with ``prefix`` (all of them by default), in key
        order. Raises StoreError (when iterated) if RocksDB finds a damaged block."""
        if type(prefix) is not bytes:
            raise TypeError("Store.load: prefix must be bytes")
        if self._db is None:
            raise self._unreadable()
        return self._load(prefix)

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """The values of these keys (None where absent), in one read. StoreError if the
        store cannot be read."""
        db = self._db
        if db is None:
            raise self._unreadable()
        try:
            return cast(list[bytes | None], db.get(keys))
        except Exception as error:
            raise StoreError(
                f"cannot read the store in data directory {self.data_dir}: {failure_reason(error)}"
            ) from None

    def _load(self, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        start = prefix
        while True:
            chunk = self._read_chunk(start, prefix)
            yield from chunk
            if len(chunk) < LOAD_CHUNK:
                return
            # The smallest key after the last one read.
            start = chunk[-1][0] + b"\x00"

    def _read_chunk(self, start: bytes, prefix: bytes) -> list[tuple[bytes, bytes]]:
        db = self._db
        if db is None:
            raise self._unreadable()
        chunk: list[tuple[bytes, bytes]] = []
        try:
            read_chunk(db, start, prefix, chunk)
        except Exception as error:
            raise StoreError(
                f"cannot read the store in data directory {self.data_dir}: {failure_reason(error)}"
            ) from None
        return chunk

    def _unreadable(self) -> StoreError:
        if self._lock_fd is None:
            return StoreError(f"the store in data directory {self.data_dir} is closed")
        return StoreError(
            f"cannot read the store in data directory {self.data_dir}: it failed to reopen "
            f"({self._failure}); call recover()"
        )

    def approximate_size(self) -> int:
        """Bytes of live data, roughly: the live SST files plus the memtables (the WAL, a
        second copy of the memtables' contents, is not counted)."""
        db = self._db
        if db is None:
            raise self._unreadable()
        sst = db.property_int_value("rocksdb.live-sst-files-size") or 0
        memtables = db.property_int_value("rocksdb.size-all-mem-tables") or 0
        return sst + memtables

    # ------------------------------------------------------------------ closing

    @property
    def closed(self) -> bool:
        return self._lock_fd is None

    def close(self) -> None:
        """Syncs (with fsync = "interval"), closes the database and unlocks the directory.
        Idempotent. Raises StoreWriteError if the final sync or flush fails; the directory is
        closed and unlocked all the same."""
        if self._lock_fd is None:
            return
        db, self._db = self._db, None
        error: BaseException | None = None
        if db is not None:
            try:
                if self.fsync == "interval" and self._unsynced and self._failure is None:
                    db.flush_wal(True)
            except Exception as sync_error:
                error = sync_error
            try:
                db.close()
            except Exception as close_error:
                error = error or close_error
        self._release_lock()
        if error is not None and self._failure is None:
            raise self._write_failed(error)

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def __del__(self) -> None:
        # A store dropped unclosed (a bug) must not keep its directory locked for the rest of
        # the process's life.
        if getattr(self, "_lock_fd", None) is not None:
            try:
                self.close()
            except Exception:
                pass

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<Store {self.data_dir!r} fsync={self.fsync} {state}>"


# ---------------------------------------------------------------------- the marker and the lock


def lock_data_dir(data_dir: str) -> int:
    """Checks the data directory's marker (writing it if the directory holds no store yet)
    and locks the directory. Returns the locked file descriptor. Writes nothing when it
    refuses."""
    try:
        os.makedirs(data_dir, exist_ok=True)
    except OSError as error:
        raise StoreError(f"cannot create data directory {data_dir}: {os_reason(error)}") from None
    marker = os.path.join(data_dir, MARKER_FILE)
    if not os.path.lexists(marker):
        for name in (DB_DIR, CREATING_DIR):
            if os.path.lexists(os.path.join(data_dir, name)):
                raise StoreError(
                    f"data directory {data_dir} has a {name}/ but no {MARKER_FILE} marker "
                    "(not created by fastbroker, or damaged): refusing to open it"
                )
        write_marker(data_dir, marker)
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as error:
        raise StoreError(f"cannot read {marker}: {os_reason(error)}") from None
    try:
        check_marker(data_dir, marker, fd)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = flock_holder(marker)
            if pid == os.getpid():
                raise StoreError(
                    f"data directory {data_dir} is already open in this process (pid {pid})"
                ) from None
            raise StoreError(
                f"data directory {data_dir} is in use by another fastbroker "
                f"(pid {pid or 'unknown'}): stop it or choose another data directory"
            ) from None
        except OSError as error:
            raise StoreError(f"cannot lock {marker}: {os_reason(error)}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def write_marker(data_dir: str, marker: str) -> None:
    """Writes the marker atomically: a complete, synced file appears under its name or none
    does; an existing marker (another process's, a moment ago) is left alone."""
    temporary = f"{marker}.{os.getpid()}.tmp"
    content = json.dumps({"format": FORMAT_NAME, "version": FORMAT_VERSION}) + "\n"
    try:
        with open(temporary, "w", encoding="utf-8") as file:
            file.write(content)
            file.flush()
            os.fsync(file.fileno())
        try:
            os.link(temporary, marker)
        except FileExistsError:
            pass
        fsync_dir(data_dir)
    except OSError as error:
        raise StoreError(f"cannot write {marker}: {os_reason(error)}") from None
    finally:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass


def check_marker(data_dir: str, marker: str, fd: int) -> None:
    try:
        raw = os.read(fd, MARKER_MAX_BYTES + 1)
    except OSError as error:
        raise StoreError(f"cannot read {marker}: {os_reason(error)}") from None
    try:
        content = json.loads(raw.decode("utf-8")) if len(raw) <= MARKER_MAX_BYTES else None
    except (UnicodeDecodeError, ValueError):
        content = None
    version = content.get("version") if isinstance(content, dict) else None
    if (
        not isinstance(content, dict)
        or content.get("format") != FORMAT_NAME
        or type(version) is not int
        or version < 1
    ):
        raise StoreError(
            f"data directory {data_dir} has a {MARKER_FILE} file that is not a fastbroker store "
            "marker: refusing to open it"
        )
    if version > FORMAT_VERSION:
        raise StoreError(
            f"data directory {data_dir} was written by a newer fastbroker (store format "
            f"{version}; this version reads {FORMAT_VERSION}): refusing to open it"
        )
