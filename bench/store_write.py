#!/usr/bin/env python3
"""What filling the store's write batch costs per operation: its Python twin
(fastbroker.store.fill_write_batch_python, the same checks; what a source tree without
compiled modules runs) against the compiled fill Store.write uses
(pyx/fastbroker/_store_batch.pyx), side by side in one run, then a whole Store.write per
operation for scale.

    python bench/store_write.py [--rounds 7]

Batches of 1,000 operations shaped like the engine's (one-third deletes, 100-byte values),
medians of the rounds; fsync "never" and a temporary directory for the Store.write figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

from rocksdict import WriteBatch

from fastbroker._store_batch import fill_write_batch
from fastbroker.store import Store, fill_write_batch_python

Ops = list[tuple[bytes, bytes | None]]


def ns_per_op(fill: Callable[[WriteBatch, Ops], None], ops: Ops, batches: int) -> float:
    started = time.perf_counter()
    for _ in range(batches):
        fill(WriteBatch(raw_mode=True), ops)
    return (time.perf_counter() - started) / batches / len(ops) * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    ops: list[tuple[bytes, bytes | None]] = [
        (b"m\x00\x05dev%02d" % (i % 50) + i.to_bytes(8, "big"), os.urandom(100) if i % 3 else None)
        for i in range(1000)
    ]
    python, compiled = [], []
    for _ in range(args.rounds):
        python.append(ns_per_op(fill_write_batch_python, ops, 200))
        compiled.append(ns_per_op(fill_write_batch, ops, 200))
    p, c = statistics.median(python), statistics.median(compiled)
    print(f"fill per op: Python twin {p:.0f} ns, compiled {c:.0f} ns ({p / c:.2f}x)")
    with tempfile.TemporaryDirectory() as tmp:
        with Store.open(os.path.join(tmp, "data"), fsync="never") as store:
            started = time.perf_counter()
            for _ in range(500):
                store.write(ops)
            per_op = (time.perf_counter() - started) / 500 / len(ops) * 1e9
    print(f"Store.write per op (1,000-op batches, fsync never): {per_op:.0f} ns")


if __name__ == "__main__":
    main()
