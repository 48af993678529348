"""fastbroker.store on a real RocksDB on disk: round trips, crash safety (kill -9 at random
moments), refusals (format, marker, damaged files, locks) that leave the directory
byte-for-byte unchanged, the fsync policies (syscalls counted with strace when available) and a
full disk (a small tmpfs). No mocks."""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rocksdict import WriteBatch
from syscalls import STRACE, needs_strace
from tmpfs import mounted_tmpfs

import fastbroker.store
from fastbroker._store_batch import fill_write_batch
from fastbroker.store import Store, StoreError, StoreWriteError, fill_write_batch_python

# The directory holding the fastbroker package under test, for the child processes.
PACKAGE_ROOT = str(Path(fastbroker.store.__file__).resolve().parents[1])
CHILD_TIMEOUT_S = 20.0


# --------------------------------------------------------------------------- helpers


def tree(path: Path) -> dict[str, str]:
    """Every file and directory under ``path``, with each file's SHA-256."""
    entries: dict[str, str] = {}
    for root, dirs, files in os.walk(path):
        for name in dirs:
            entries[os.path.relpath(os.path.join(root, name), path) + "/"] = "dir"
        for name in files:
            full = os.path.join(root, name)
            digest = hashlib.sha256(Path(full).read_bytes()).hexdigest()
            entries[os.path.relpath(full, path)] = digest
    return entries


def assert_refused(data_dir: Path, *fragments: str) -> str:
    """Store.open must refuse with a one-line StoreError naming the directory and containing
    ``fragments``, and leave every file as it was."""
    before = tree(data_dir)
    with pytest.raises(StoreError) as caught:
        Store.open(str(data_dir))
    message = str(caught.value)
    assert "\n" not in message, message
    assert str(data_dir) in message, message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    assert tree(data_dir) == before, "a refused open changed the directory"
    return message


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return env


def spawn_child(script: str, *args: str, stdout: object = subprocess.PIPE) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env=child_env(),
        stdin=subprocess.PIPE,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for_file_line(path: Path, text: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text().splitlines():
            return
        if process.poll() is not None:
            pytest.fail(f"child exited ({process.returncode}): {kill(process)}")
        time.sleep(0.005)
    pytest.fail(f"no {text!r} from the child in {CHILD_TIMEOUT_S}s")


def kill(process: subprocess.Popen) -> str:
    """SIGKILLs the process if still running; returns what is left of its stderr."""
    if process.poll() is None:
        process.kill()
    _, stderr = process.communicate(timeout=CHILD_TIMEOUT_S)
    return stderr or ""


# Batches of a known shape: batch n puts BATCH_RECORDS records m<n>-<i>, sets the counter
# record to n, puts t<n> and deletes t<n-1>. After any crash the store must hold batches
# 0..last (each whole), counter = last, and exactly one t record, t<last>.
BATCH_RECORDS = 32
BATCH_VALUE = bytes(range(256)) * 16  # 4 KiB

BATCH_CODE = f"""
def batch(n, records={BATCH_RECORDS}, value=bytes(range(256)) * 16):
    ops = [(b"m%08d-%03d" % (n, i), value) for i in range(records)]
    ops.append((b"scounter", b"%d" % n))
    ops.append((b"t%08d" % n, b""))
    if n:
        ops.append((b"t%08d" % (n - 1), None))
    return ops
"""


_namespace: dict[str, Callable[..., list[tuple[bytes, bytes | None]]]] = {}
exec(BATCH_CODE, _namespace)
batch = _namespace["batch"]


def check_batches(records: dict[bytes, bytes], batch_records: int = BATCH_RECORDS) -> int:
    """Checks the invariants above; returns the last batch number (-1 for none)."""
    if b"scounter" not in records:
        assert not records, f"records without a counter: {sorted(records)[:5]}"
        return -1
    last = int(records[b"scounter"])
    per_batch: dict[int, int] = {}
    for key, value in records.items():
        if key.startswith(b"m"):
            assert value == BATCH_VALUE, key
            number = int(key[1:9])
            per_batch[number] = per_batch.get(number, 0) + 1
    wrong = {n: count for n, count in per_batch.items() if count != batch_records or n > last}
    assert not wrong and len(per_batch) == last + 1, (
        f"batches not whole or not a prefix up to {last}: {wrong}"
    )
    assert [key for key in records if key.startswith(b"t")] == [b"t%08d" % last]
    return last


def load_all(data_dir: Path, **open_args: object) -> dict[bytes, bytes]:
    with Store.open(str(data_dir), **open_args) as store:  # type: ignore[arg-type]
        return dict(store.load())


# --------------------------------------------------------------------------- basics


@pytest.mark.timeout(30)
def test_round_trip_delete_and_reopen(tmp_path: Path) -> None:
    data_dir = tmp_path / "data" / "nested"
    with Store.open(str(data_dir)) as store:
        assert list(store.load()) == []
        store.write([(b"sa", b"session a"), (b"sb", b"session b"), (b"mq", b"")])
        store.write([(b"sb", None), (b"sa", b"session a, v2"), (b"gone", None)])
        store.write([])
        assert list(store.load()) == [(b"mq", b""), (b"sa", b"session a, v2")]
        assert store.approximate_size() > 0
    assert store.closed
    store.close()  # idempotent
    assert json.loads((data_dir / "FORMAT").read_text()) == {
        "format": "fastbroker-store",
        "version": 1,
    }
    assert sorted(os.listdir(data_dir)) == ["FORMAT", "store"]
    with Store.open(str(data_dir)) as store:
        assert list(store.load()) == [(b"mq", b""), (b"sa", b"session a, v2")]
        store.write([(b"mq", None)])
    assert load_all(data_dir) == {b"sa": b"session a, v2"}


@pytest.mark.timeout(30)
def test_load_is_in_key_order_and_by_prefix(tmp_path: Path) -> None:
    rng = random.Random(7)

    def random_key() -> bytes:
        return bytes([rng.choice(b"imrs\x00\xff")]) + rng.randbytes(rng.randrange(0, 12))

    records = {random_key(): rng.randbytes(rng.randrange(0, 100)) for _ in range(3000)}
    # Enough under one prefix to span several of load()'s chunks.
    records.update({b"m\xff" + b"%06d" % i: b"v%d" % i for i in range(10_000)})
    records[b"m\xff\xff\xff"] = b"last of m\xff"
    records[b"n"] = b"after m"
    with Store.open(str(tmp_path / "data")) as store:
        items = list(records.items())
        for start in range(0, len(items), 1000):
            store.write(items[start : start + 1000])
        everything = list(store.load())
        assert everything == sorted(records.items())
        for prefix in (b"m", b"m\xff", b"m\xff\xff", b"\xff", b"\x00", b"s", b"zz", b""):
            expected = [(k, v) for k, v in sorted(records.items()) if k.startswith(prefix)]
            assert list(store.load(prefix)) == expected, prefix
    assert load_all(tmp_path / "data") == records


@pytest.mark.timeout(30)
def test_large_values_and_many_ops(tmp_path: Path) -> None:
    big = os.urandom(4 << 20)
    ops: list[tuple[bytes, bytes | None]] = [(b"m%06d" % i, b"x" * 64) for i in range(50_000)]
    ops.append((b"rbig", big))
    with Store.open(str(tmp_path / "data")) as store:
        store.write(ops)
        assert dict(store.load(b"r")) == {b"rbig": big}
        store.write([(b"m%06d" % i, None) for i in range(0, 50_000, 2)])
    records = load_all(tmp_path / "data")
    assert len(records) == 25_001 and records[b"rbig"] == big


@pytest.mark.timeout(30)
def test_bad_ops_write_nothing(tmp_path: Path) -> None:
    with Store.open(str(tmp_path / "data")) as store:
        store.write([(b"a", b"1")])
        bad_batches: list[object] = [
            [(b"b", b"2"), ("c", b"3")],
            [(b"b", b"2"), (b"c", "3")],
            [(b"b", b"2"), (b"c", bytearray(b"3"))],
            [(b"b", b"2"), (b"c",)],
            [(b"b", b"2"), 5],
            5,
        ]
        for ops in bad_batches:
            with pytest.raises(TypeError, match="bytes"):
                store.write(ops)  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            store.load("a")  # type: ignore[arg-type]
        assert list(store.load()) == [(b"a", b"1")]


@pytest.mark.parametrize("fill", [fill_write_batch, fill_write_batch_python])
def test_the_compiled_and_python_batch_fills_agree(fill, tmp_path: Path) -> None:
    """Store.write's compiled fill and its Python twin (a source tree without compiled
    modules) write the same records and refuse the same bad ops."""
    with Store.open(str(tmp_path / "data")) as store:
        store.write([(b"a", b"1"), (b"b", b"2")])
        batch = WriteBatch(raw_mode=True)
        fill(batch, [(b"c", b"3"), (b"a", None)])
        store._db.write(batch)
        assert list(store.load()) == [(b"b", b"2"), (b"c", b"3")]
        for bad in ([("c", b"3")], [(b"c", "3")], [(b"c",)], [5], [(b"c", bytearray(b"3"))]):
            with pytest.raises(TypeError, match="bytes"):
                fill(WriteBatch(raw_mode=True), bad)


@pytest.mark.timeout(30)
def test_closed_store_refuses_use(tmp_path: Path) -> None:
    store = Store.open(str(tmp_path / "data"))
    store.close()
    for call in (lambda: store.write([(b"a", b"b")]), store.sync, store.load, store.recover):
        with pytest.raises(StoreError, match="closed"):
            call()
    # A generator still being read when the store closes fails instead of reading a closed DB.
    with Store.open(str(tmp_path / "data")) as store:
        store.write([(b"k%05d" % i, b"") for i in range(10_000)])
        records = store.load()
        next(records)
    with pytest.raises(StoreError, match="closed"):
        list(records)
    # ... and did not keep the database open.
    assert len(load_all(tmp_path / "data")) == 10_000


@pytest.mark.parametrize("policy", ["always", "interval", "never"])
@pytest.mark.timeout(30)
def test_each_policy_writes_and_reopens(tmp_path: Path, policy: str) -> None:
    with Store.open(str(tmp_path / "data"), fsync=policy, fsync_interval_ms=250) as store:
        assert (store.fsync, store.fsync_interval_ms) == (policy, 250)
        # The one WriteOptions every write() passes to RocksDB: synced only with "always".
        assert store._write_options.sync is (policy == "always")
        for n in range(20):
            store.write(batch(n, records=4))
            store.sync()
        store.sync()
        assert store.recover() is True  # nothing to recover: a no-op
    records = load_all(tmp_path / "data")
    assert int(records[b"scounter"]) == 19 and len(records) == 20 * 4 + 2


def test_bad_policy_arguments(tmp_path: Path) -> None:
    for args in ({"fsync": "sometimes"}, {"fsync_interval_ms": 0}, {"fsync_interval_ms": 1.5}):
        with pytest.raises(ValueError):
            Store.open(str(tmp_path / "data"), **args)  # type: ignore[arg-type]
    assert not (tmp_path / "data").exists()


# --------------------------------------------------------------------------- fsync, counted

SYNC_COUNT_CHILD = """
import sys
from fastbroker.store import Store
data_dir, policy, writes, call_sync = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
store = Store.open(data_dir, fsync=policy)
for n in range(writes):
    store.write([(b"m%06d" % n, b"x" * 100)])
    if call_sync == "yes":
        store.sync()
store.close()
"""


def count_syncs(tmp_path: Path, policy: str, writes: int, call_sync: bool) -> int:
    """fsync + fdatasync calls made by a child process writing ``writes`` batches."""
    summary = tmp_path / f"strace-{policy}-{call_sync}.txt"
    data_dir = tmp_path / f"data-{policy}-{call_sync}"
    command = [STRACE or "strace", "-f", "-qq", "-c", "-e", "trace=fsync,fdatasync"]
    command += ["-o", str(summary), sys.executable, "-c", SYNC_COUNT_CHILD]
    command += [str(data_dir), policy, str(writes), "yes" if call_sync else "no"]
    subprocess.run(command, env=child_env(), check=True, timeout=60, capture_output=True)
    calls = 0
    for line in summary.read_text().splitlines():
        fields = line.split()
        if fields and fields[-1] in ("fsync", "fdatasync"):
            calls += int(fields[3])
    return calls


@needs_strace
@pytest.mark.timeout(120)
def test_fsync_policies_by_syscall_count(tmp_path: Path) -> None:
    writes = 200
    # Opening and closing a store syncs a dozen or two files (MANIFEST, SST, directories):
    # far below `writes`, whatever the policy.
    background = writes // 4
    assert count_syncs(tmp_path, "always", writes, call_sync=False) >= writes
    assert count_syncs(tmp_path, "interval", writes, call_sync=False) < background
    assert count_syncs(tmp_path, "interval", writes, call_sync=True) >= writes
    assert count_syncs(tmp_path, "never", writes, call_sync=True) < background


# --------------------------------------------------------------------------- kill -9

WRITER_CHILD = (
    BATCH_CODE
    + """
import sys
from fastbroker.store import Store
data_dir, policy, first, records = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = Store.open(data_dir, fsync=policy)
print("ready", flush=True)
n = first
while True:
    store.write(batch(n, records))
    print(n, flush=True)
    if n % 8 == 0:
        store.sync()
    n += 1
"""
)


# 1 MiB batches: RocksDB writes each as one WAL record, and a SIGKILL landing during its
# write() can leave a torn record, which recovery must drop whole (seen in a few kills in 20;
# test_damaged_wal_recovers_to_a_consistent_prefix tears one on purpose).
KILL_BATCH_RECORDS = 256


@pytest.mark.parametrize("policy", ["interval", "always"])
@pytest.mark.timeout(120)
def test_kill_9_loses_no_acknowledged_batch_and_splits_none(tmp_path: Path, policy: str) -> None:
    """A writer is SIGKILLed at random moments (sometimes during its start-up, i.e. during
    RocksDB's recovery of the previous kill); every batch it printed as written must be there
    after the reopen, and no batch may be half there."""
    rng = random.Random(20240611)
    data_dir = tmp_path / "data"
    last = -1
    for iteration in range(10):
        output = tmp_path / f"out-{iteration}.txt"
        first = last + 1
        args = (str(data_dir), policy, str(first), str(KILL_BATCH_RECORDS))
        with output.open("w") as stdout:
            process = spawn_child(WRITER_CHILD, *args, stdout=stdout)
        try:
            if rng.random() < 0.25:
                time.sleep(rng.uniform(0.0, 0.4))  # maybe still opening (recovering)
            else:
                wait_for_file_line(output, "ready", process)
                time.sleep(rng.uniform(0.0, 0.1))
        finally:
            stderr = kill(process)
        assert process.returncode == -signal.SIGKILL, stderr
        printed = [int(line) for line in output.read_text().split() if line.isdigit()]
        last = check_batches(load_all(data_dir), KILL_BATCH_RECORDS)
        if printed:
            assert printed == list(range(first, printed[-1] + 1))
            # Everything printed is there; at most the batch being written when killed more.
            assert printed[-1] <= last <= printed[-1] + 1, (printed[-1], last)
    assert last > 0, "the writers wrote nothing: the test proved nothing"
    shutil.rmtree(data_dir)  # a few hundred MB; kept only when the test fails


# --------------------------------------------------------------------------- refusals


@pytest.mark.timeout(30)
def test_refuses_newer_or_unknown_format(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with Store.open(str(data_dir)) as store:
        store.write([(b"s1", b"x")])
    marker = data_dir / "FORMAT"
    marker.write_text(json.dumps({"format": "fastbroker-store", "version": 7}))
    message = assert_refused(data_dir, "newer fastbroker")
    assert message == (
        f"data directory {data_dir} was written by a newer fastbroker "
        "(store format 7; this version reads 1): refusing to open it"
    )
    for content in (
        json.dumps({"format": "other-store", "version": 1}),
        json.dumps({"format": "fastbroker-store", "version": "1"}),
        json.dumps({"format": "fastbroker-store", "version": 0}),
        json.dumps({"format": "fastbroker-store"}),
        json.dumps(["fastbroker-store", 1]),
        "",
        "\xff\xfe garbage",
        "x" * 10_000,
    ):
        marker.write_text(content)
        assert_refused(data_dir, "not a fastbroker store marker")
    marker.unlink()
    assert_refused(data_dir, "has a store/ but no FORMAT marker")
    marker.mkdir()
    assert_refused(data_dir, "FORMAT")


@pytest.mark.timeout(30)
def test_refuses_foreign_directory_and_file(tmp_path: Path) -> None:
    (tmp_path / "data" / "store").mkdir(parents=True)
    (tmp_path / "data" / "store" / "CURRENT").write_text("something else\n")
    assert_refused(tmp_path / "data", "has a store/ but no FORMAT marker")
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(StoreError, match=r"cannot create data directory .*file"):
        Store.open(str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "not a directory"


@pytest.mark.timeout(30)
def test_creation_interrupted_after_the_marker_is_redone(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    (data_dir / "unrelated.txt").write_text("kept")  # a non-empty data dir without a store
    (data_dir / "FORMAT").write_text('{"format": "fastbroker-store", "version": 1}\n')
    # A crashed creation: marker written, database half made in store.creating/.
    (data_dir / "store.creating").mkdir()
    (data_dir / "store.creating" / "LOCK").write_bytes(b"")
    with Store.open(str(data_dir)) as store:
        store.write([(b"s", b"1")])
    assert sorted(os.listdir(data_dir)) == ["FORMAT", "store", "unrelated.txt"]
    assert load_all(data_dir) == {b"s": b"1"}


def damaged_store(tmp_path: Path) -> Path:
    """A store with batches 0..19 in an SST file (a clean close flushes) and 20..39 only in
    the WAL (the writer was killed)."""
    data_dir = tmp_path / "data"
    with Store.open(str(data_dir)) as store:
        for n in range(20):
            store.write(batch(n))
    script = (
        BATCH_CODE
        + """
import sys
from fastbroker.store import Store
store = Store.open(sys.argv[1])
for n in range(20, 40):
    store.write(batch(n))
print("written", flush=True)
sys.stdin.read()
"""
    )
    process = spawn_child(script, str(data_dir))
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
    finally:
        stderr = kill(process)
    assert line == "written", stderr
    store_dir = data_dir / "store"
    assert len(list(store_dir.glob("*.sst"))) == 1
    assert len([p for p in store_dir.glob("*.log") if p.stat().st_size > 0]) == 1
    return data_dir


def damage(data_dir: Path, pattern: str, how: str) -> None:
    (path,) = [p for p in (data_dir / "store").glob(pattern) if p.stat().st_size]
    data = path.read_bytes()
    size = len(data)
    garbage = random.Random(size).randbytes(64)
    if how == "rm":
        path.unlink()
        return
    data = {
        "empty": b"",
        "half": data[: size // 2],
        "torn-tail": data[: size - 100],
        "garbage": (garbage * (size // 64 + 1))[:size],
        "garbage-middle": data[: size // 2] + garbage + data[size // 2 + 64 :],
        "garbage-end": data[:-64] + garbage,
        "names-missing-manifest": b"MANIFEST-999999\n",
    }[how]
    path.write_bytes(data)


@pytest.mark.parametrize(
    ("pattern", "how", "fragment"),
    [
        ("CURRENT", "empty", "CURRENT file does not end with newline"),
        ("CURRENT", "garbage", "CURRENT file does not end with newline"),
        ("CURRENT", "rm", "CURRENT: No such file"),
        ("CURRENT", "names-missing-manifest", "MANIFEST-999999: No such file"),
        ("MANIFEST-*", "empty", "may be corrupted"),
        ("MANIFEST-*", "half", "may be corrupted"),
        ("MANIFEST-*", "garbage-middle", "checksum mismatch"),
        ("MANIFEST-*", "garbage-end", "checksum mismatch"),
        ("MANIFEST-*", "rm", "No such file"),
        ("*.sst", "half", "Sst file size mismatch"),
        ("*.sst", "garbage-middle", "block checksum mismatch"),
        ("*.sst", "garbage-end", "Bad table magic number"),
        ("*.sst", "garbage", "Bad table magic number"),
        ("*.sst", "rm", "No such file"),
    ],
)
@pytest.mark.timeout(60)
def test_refuses_damaged_database(tmp_path: Path, pattern: str, how: str, fragment: str) -> None:
    data_dir = damaged_store(tmp_path)
    damage(data_dir, pattern, how)
    message = assert_refused(data_dir, "the store is damaged or incomplete", fragment)
    assert message.endswith("restore it from a backup or move the directory away")


@pytest.mark.parametrize(
    ("how", "recovered"),
    [
        # Torn last record (a write cut short by kill -9 or a power loss): the batches before it.
        ("torn-tail", range(39)),
        # An unsynced tail that a power loss left as stale bytes: the same.
        ("garbage-end", range(39)),
        # Point-in-time recovery stops at the first damaged record wherever it is: the batches
        # before it (about half of the WAL's). Silently, but for store/LOG.
        ("garbage-middle", None),
        ("half", None),
        ("empty", range(20)),
        # RocksDB cannot tell a deleted WAL from none: the data flushed to SST files.
        ("rm", range(20)),
    ],
)
@pytest.mark.timeout(60)
def test_damaged_wal_recovers_to_a_consistent_prefix(
    tmp_path: Path, how: str, recovered: range | None
) -> None:
    data_dir = damaged_store(tmp_path)
    damage(data_dir, "*.log", how)
    last = check_batches(load_all(data_dir))
    if recovered is None:
        assert 20 <= last < 39
    else:
        assert last == recovered[-1]


# --------------------------------------------------------------------------- locks

HOLDER_CHILD = """
import sys
from fastbroker.store import Store
store = Store.open(sys.argv[1])
print("open", flush=True)
sys.stdin.read()
store.close()
"""


@pytest.mark.timeout(30)
def test_locked_by_the_same_process(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with Store.open(str(data_dir)) as store:
        store.write([(b"s", b"1")])
        message = assert_refused(data_dir, "is already open in this process")
        assert message == f"data directory {data_dir} is already open in this process " + (
            f"(pid {os.getpid()})"
        )
        store.write([(b"s", b"2")])  # the first one is unaffected
    assert load_all(data_dir) == {b"s": b"2"}


@pytest.mark.timeout(30)
def test_locked_by_another_process(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    with Store.open(str(data_dir)) as store:
        store.write([(b"s", b"1")])
    process = spawn_child(HOLDER_CHILD, str(data_dir))
    try:
        assert process.stdout is not None and process.stdin is not None
        assert process.stdout.readline().strip() == "open"
        message = assert_refused(data_dir, "is in use by another fastbroker")
        assert re.fullmatch(
            f"data directory {re.escape(str(data_dir))} is in use by another fastbroker "
            r"\(pid (\d+|unknown)\): stop it or choose another data directory",
            message,
        ), message
        # /proc/locks names the holder when the pid is visible here.
        assert f"(pid {process.pid})" in message or "(pid unknown)" in message
        process.stdin.close()
        process.stdin = None  # communicate() in kill() must not flush it
        assert process.wait(timeout=CHILD_TIMEOUT_S) == 0
    finally:
        kill(process)
    assert load_all(data_dir) == {b"s": b"1"}


@pytest.mark.timeout(30)
def test_lock_of_a_killed_process_does_not_outlive_it(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    process = spawn_child(HOLDER_CHILD, str(data_dir))
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
    finally:
        stderr = kill(process)
    assert line == "open", stderr
    assert load_all(data_dir) == {}


# --------------------------------------------------------------------------- disk full


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs."""
    with mounted_tmpfs(tmp_path, "8m") as mount_point:
        yield mount_point


def fill(store: Store, first: int) -> tuple[int, StoreWriteError]:
    """Writes batches from ``first`` on until one fails; returns the failed batch number."""
    for n in range(first, first + 10_000):
        try:
            store.write(batch(n))
        except StoreWriteError as error:
            return n, error
    pytest.fail("the disk never filled up")


def check_full_error(error: StoreWriteError, data_dir: Path) -> None:
    message = str(error)
    assert message == f"cannot write to data directory {data_dir}: no space left on device"


@pytest.mark.timeout(60)
def test_disk_full_then_recover(small_fs: Path) -> None:
    data_dir = small_fs / "data"
    filler = small_fs / "filler"
    store = Store.open(str(data_dir))
    try:
        filler.write_bytes(b"\0" * (5 << 20))
        failed, error = fill(store, 0)
        check_full_error(error, data_dir)
        assert failed > 0
        # Everything written before is still readable, nothing of the failed batch.
        assert check_batches(dict(store.load())) == failed - 1
        # Still full: writes keep failing with the first cause; reopening needs space too.
        with pytest.raises(StoreWriteError) as again:
            store.write(batch(failed))
        check_full_error(again.value, data_dir)
        with pytest.raises(StoreWriteError):
            store.sync()
        assert store.recover() is False
        with pytest.raises(StoreWriteError, match="no space left on device"):
            store.write(batch(failed))
        with pytest.raises(StoreError, match="call recover"):
            store.load()

        filler.unlink()
        assert store.recover() is True
        assert check_batches(dict(store.load())) == failed - 1
        for n in range(failed, failed + 5):
            store.write(batch(n))
        store.sync()
        assert check_batches(dict(store.load())) == failed + 4
    finally:
        store.close()
    assert check_batches(load_all(data_dir)) == failed + 4


@pytest.mark.timeout(60)
def test_disk_full_then_restart(small_fs: Path) -> None:
    """The other way back: the broker stops after the error and starts again."""
    data_dir = small_fs / "data"
    filler = small_fs / "filler"
    store = Store.open(str(data_dir), fsync="always")
    try:
        filler.write_bytes(b"\0" * (5 << 20))
        failed, error = fill(store, 0)
        check_full_error(error, data_dir)
    finally:
        store.close()  # the flush at close fails too; the error was reported already
    # Opening while the disk is still full: RocksDB must flush the WAL it replays.
    with pytest.raises(StoreError) as caught:
        Store.open(str(data_dir))
    assert str(caught.value) == (
        f"cannot open the store in data directory {data_dir}: no space left on device"
    )
    filler.unlink()
    with Store.open(str(data_dir)) as store:
        assert check_batches(dict(store.load())) == failed - 1
        store.write(batch(failed))
    assert check_batches(load_all(data_dir)) == failed
