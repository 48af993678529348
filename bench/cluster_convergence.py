"""How long a cluster takes to agree a new partition map after a join, a leave and a crash.

Starts real nodes on loopback (tests/clusters.py), with the default timings unless --fast:

    python bench/cluster_convergence.py [--rounds 3] [--nodes 3] [--fast]

Per round: N nodes form a cluster; one more joins (time from its process start to every node
agreeing the map with it); it leaves with `fastbroker cluster leave` (time from the command to
every node agreeing the map without it); one member is SIGKILLed (time from the kill to the
others agreeing the map without it; the failure timeout is most of this); the leader is
SIGKILLed (the same, plus an election). Prints min / median / max per event.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from clusters import FAST, Cluster

DEFAULTS = {"heartbeat_ms": 150, "election_timeout_ms": 1000, "failure_timeout_ms": 5000}


def one_round(tmp: Path, nodes: int, settings: dict) -> dict[str, float]:
    times: dict[str, float] = {}
    with Cluster(tmp, settings) as cluster:
        ids = [f"n{i}" for i in range(1, nodes + 1)]
        started = time.monotonic()
        cluster.start(1)
        for i in range(2, nodes + 1):
            cluster.start(i, join=cluster.seeds(1))
        cluster.wait_converged(ids, 120)
        times["form"] = time.monotonic() - started

        extra = nodes + 1
        started = time.monotonic()
        cluster.start(extra, join=cluster.seeds(1), wait=False)
        cluster.wait_converged([*ids, f"n{extra}"], 120)
        times["join"] = time.monotonic() - started

        node = cluster.node(extra)
        started = time.monotonic()
        subprocess.run(
            [sys.executable, "-m", "fastbroker", "cluster", "leave", "--admin", node.admin],
            check=True,
            capture_output=True,
            timeout=60,
        )
        cluster.wait_converged(ids, 120)
        times["leave"] = time.monotonic() - started
        assert node.proc is not None
        node.proc.wait(30)

        leader = cluster.node(1).status()["leader"]
        victim = next(i for i in ids if i != leader)
        cluster.nodes[victim].kill()
        ids.remove(victim)
        started = time.monotonic()
        cluster.wait_converged(ids, 120)
        times["crash (follower)"] = time.monotonic() - started

        if len(ids) >= 3:
            cluster.nodes[leader].kill()
            ids.remove(leader)
            started = time.monotonic()
            cluster.wait_converged(ids, 120)
            times["crash (leader)"] = time.monotonic() - started
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=5)
    parser.add_argument("--fast", action="store_true", help="the test suite's fast timings")
    args = parser.parse_args()
    settings = FAST if args.fast else {**DEFAULTS, "discovery_interval_ms": 1000}
    results: dict[str, list[float]] = {}
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="fb-converge-") as tmp:
            for event, seconds in one_round(Path(tmp), args.nodes, settings).items():
                results.setdefault(event, []).append(seconds)
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    timing = ", ".join(f"{k} {v}" for k, v in settings.items())
    print(f"{args.nodes} nodes (+1 joining), {args.rounds} rounds; {timing}")
    print(f"{'event':<18} {'min s':>7} {'median s':>9} {'max s':>7}")
    for event, values in results.items():
        print(
            f"{event:<18} {min(values):>7.2f} {statistics.median(values):>9.2f} {max(values):>7.2f}"
        )


if __name__ == "__main__":
    main()
