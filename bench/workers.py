#!/usr/bin/env python3
"""Workers side by side: fastbroker with `--workers 1`, with `--workers 2` (or --many), and
Mosquitto, in one run, with bench/run.py's scenarios, broker setup and measurements.

    python bench/workers.py [--rounds 3] [--duration 5] [--warmup 1] [--many 2]
                            [--scenarios fan-in,fan-out,pairs,qos1,latency,connections,
                                         connect-serial]

Every measurement gets a freshly started broker; the order of the three rotates per round.
The broker's CPU is that of every process (supervisor and workers) over the loadgen's
measured window; with workers, each worker's share is printed too. connect-serial makes
10,000 connects one at a time (each waits for its CONNACK; --serial-connections) and
reports connects/s and RSS per idle connection. For each scenario the table shows the
medians and the ratios the workers issue sets targets for: N workers / 1 worker in delivered
msg/s and in broker CPU per delivered message, and each against Mosquitto.
Only processes this script starts are stopped, by PID.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import run as bench  # noqa: E402  (bench/run.py, found through the path set above)

STANDARD = ("fan-in", "fan-out", "pairs", "qos1", "latency", "connections")
SERIAL_CONNECTIONS = 10_000


def serial_scenario(count: int, hold: float) -> bench.Scenario:
    return bench.Scenario(
        "connect-serial",
        "connections",
        (
            ("count", str(count)),
            ("sources", bench.CONNECTION_SOURCES),
            ("hold", bench.fmt_num(hold)),
            ("concurrency", "1"),
        ),
        f"{count:,} connects one at a time, each waiting for its CONNACK, then held idle",
        (
            bench.Figure("connects_per_s", "connects/s", unit="conn/s"),
            bench.Figure("rss_per_conn_bytes", "broker RSS bytes/conn", "lower", "B"),
        ),
    )


def per_message_cpu(m: bench.Measurement) -> float | None:
    delivered = m.figures.get("delivered_per_s")
    if m.broker_cpu_percent is None or not delivered:
        return None
    return m.broker_cpu_percent / 100 / delivered * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--many", type=int, default=2, help="workers of the second setup")
    parser.add_argument("--connections", type=int, default=15_000)
    parser.add_argument("--serial-connections", type=int, default=SERIAL_CONNECTIONS)
    parser.add_argument("--hold", type=float, default=3.0)
    parser.add_argument("--scenarios", default=",".join((*STANDARD, "connect-serial")))
    parser.add_argument("--loadgen", default=None)
    parser.add_argument("--results", default=str(HERE / "results"))
    ns = parser.parse_args()
    settings = bench.Settings(
        rounds=ns.rounds,
        duration=ns.duration,
        warmup=ns.warmup,
        connections=ns.connections,
        hold=ns.hold,
        payloads=(),
    )
    wanted = ns.scenarios.split(",")
    scenarios = [s for s in bench.build_scenarios(settings) if s.name in wanted]
    if "connect-serial" in wanted:
        scenarios.append(serial_scenario(ns.serial_connections, ns.hold))
    bench.raise_nofile_limit()
    loadgen = bench.find_loadgen(ns.loadgen)
    setups = [("1 worker", "fastbroker", 1), (f"{ns.many} workers", "fastbroker", ns.many)]
    setups.append(("mosquitto", "mosquitto", 1))
    base = Path(tempfile.mkdtemp(prefix="fastbroker-workers-"))
    results: dict[str, dict[str, list[bench.Measurement]]] = {}
    try:
        for round_no in range(1, ns.rounds + 1):
            for scenario in scenarios:
                shift = (round_no - 1) % len(setups)
                for position, (name, kind, workers) in enumerate(
                    setups[shift:] + setups[:shift], 1
                ):
                    bench.FASTBROKER_WORKERS = workers
                    m = bench.measure(scenario, kind, round_no, position, settings, loadgen, base)
                    results.setdefault(scenario.name, {}).setdefault(name, []).append(m)
                    shares = m.params.get("worker_cpu_percent")
                    extra = f" per worker {[round(x or 0) for x in shares]}%" if shares else ""
                    print(f"[r{round_no}] {scenario.name:14} {name:10} {progress(m)}{extra}")
    finally:
        bench.FASTBROKER_WORKERS = 1
        bench.stop_all_started()
        shutil.rmtree(base, ignore_errors=True)

    many = f"{ns.many} workers"
    table: list[dict[str, Any]] = []
    for scenario in scenarios:
        per = results.get(scenario.name, {})
        keys = [f.key for f in scenario.figures]
        if "delivered_per_s" in keys:
            keys.append("cpu_us_per_msg")
        keys.append("broker_cpu_percent")
        for key in keys:
            row: dict[str, Any] = {"scenario": scenario.name, "figure": key}
            for name, _, _ in setups:
                row[name] = median([value(m, key) for m in per.get(name, [])])
            row[f"{many} / 1 worker"] = ratio(row[many], row["1 worker"])
            row["1 worker / mosquitto"] = ratio(row["1 worker"], row["mosquitto"])
            row[f"{many} / mosquitto"] = ratio(row[many], row["mosquitto"])
            table.append(row)
    columns = list(table[0]) if table else []
    print()
    print(" | ".join(columns))
    for row in table:
        print(" | ".join(fmt(row[c]) for c in columns))
    out = Path(ns.results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"workers-{time.strftime('%Y%m%dT%H%M%S')}.json"
    runs = [
        {
            "scenario": m.scenario,
            "setup": name,
            "round": m.round,
            "figures": m.figures,
            "broker_cpu_percent": m.broker_cpu_percent,
            "worker_cpu_percent": m.params.get("worker_cpu_percent"),
            "error": m.error,
        }
        for per in results.values()
        for name, ms in per.items()
        for m in ms
    ]
    path.write_text(json.dumps({"many": ns.many, "table": table, "runs": runs}, indent=1))
    print(f"\nwritten to {path}")
    return 0


def progress(m: bench.Measurement) -> str:
    if not m.ok:
        return f"FAILED: {m.error}"
    figures = " ".join(f"{k}={bench.fmt_num(v)}" for k, v in m.figures.items() if k[0] != "r")
    return f"{figures} cpu={bench.fmt_num(m.broker_cpu_percent)}%"


def value(m: bench.Measurement, key: str) -> float | None:
    if not m.ok:
        return None
    if key == "cpu_us_per_msg":
        return per_message_cpu(m)
    if key == "broker_cpu_percent":
        return m.broker_cpu_percent
    got = m.figures.get(key)
    return float(got) if bench.valid_number(got) else None


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.3g}" if abs(x) < 100 else f"{x:,.0f}"
    return "n/a" if x is None else str(x)


if __name__ == "__main__":
    sys.exit(main())
