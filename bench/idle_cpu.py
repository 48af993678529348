"""What an idle broker costs: CPU used by fastbroker and Mosquitto while nothing happens, with
no client and with idle connections held open, side by side in one run.

    python bench/idle_cpu.py                       # 3 rounds, 10 s windows, 0 and 10,000 held
    python bench/idle_cpu.py --rounds 5 --window 20 --connections 0,1000,15000

Each round starts both brokers fresh (the same settings as bench/run.py, order alternating),
opens the connections with bench/loadgen, waits 1 s and reads utime + stime from /proc over the
window. /proc counts in clock ticks (10 ms): use windows of 10 s or more. Prints CPU ms per
10 s, per broker, as min-median-max over the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# run.py is a script next to this one, not a package.
from run import (
    CONNECTION_SOURCES,
    HOST,
    find_loadgen,
    proc_cpu_seconds,
    raise_nofile_limit,
    start_broker,
    stop_process,
)

SETTLE_S = 1.0
BROKERS = ("fastbroker", "mosquitto")


def idle_cpu_ms(kind: str, base: Path, loadgen: Path, connections: int, window: float) -> float:
    """CPU ms per 10 s of a fresh broker holding ``connections`` idle connections."""
    broker = start_broker(kind, base)
    holder = None
    try:
        if connections:
            args = [str(loadgen), "connections", "--host", HOST, "--port", str(broker.port)]
            args += ["--count", str(connections), "--sources", CONNECTION_SOURCES]
            args += ["--concurrency", "256", "--hold", str(SETTLE_S + window + 5)]
            holder = subprocess.Popen(
                args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
            )
            assert holder.stdout is not None
            line = holder.stdout.readline()
            if '"ready": true' not in line:
                raise RuntimeError(f"{kind}: the connections were not opened: {line.strip()}")
        time.sleep(SETTLE_S)
        before = proc_cpu_seconds(broker.pid)
        time.sleep(window)
        after = proc_cpu_seconds(broker.pid)
        if before is None or after is None:
            raise RuntimeError(f"{kind} exited during the window: {broker.stderr_tail()}")
        return (after - before) * 1000 * 10 / window
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
        stop_process(broker.proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=float, default=10.0, help="seconds measured (default 10)")
    p.add_argument(
        "--connections", default="0,10000", help="comma-separated counts (default 0,10000)"
    )
    p.add_argument("--loadgen", help="the loadgen binary (default: build bench/loadgen)")
    ns = p.parse_args()
    counts = [int(c) for c in ns.connections.split(",")]
    raise_nofile_limit()
    loadgen = find_loadgen(ns.loadgen)
    results: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="fastbroker-idle-") as tmp:
        for round_no in range(ns.rounds):
            order = BROKERS if round_no % 2 == 0 else BROKERS[::-1]
            for count in counts:
                for kind in order:
                    ms = idle_cpu_ms(kind, Path(tmp), loadgen, count, ns.window)
                    results.setdefault((kind, count), []).append(ms)
                    print(f"round {round_no + 1}: {kind}, {count} connections: {ms:.0f} ms / 10 s")
    print(
        f"\nidle CPU, ms per 10 s (min-median-max of {ns.rounds} rounds, {ns.window:g} s windows)"
    )
    print(f"{'connections':>12} | {'fastbroker':>18} | {'mosquitto':>18}")
    for count in counts:
        cells = []
        for kind in BROKERS:
            v = results[(kind, count)]
            cells.append(f"{min(v):.0f}-{statistics.median(v):.0f}-{max(v):.0f}")
        print(f"{count:>12,} | {cells[0]:>18} | {cells[1]:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
