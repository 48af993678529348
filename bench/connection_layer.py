#!/usr/bin/env python3
"""The two connection layers side by side (issue 18): fastbroker on uvloop's transports, on
the compiled one (`[listener] connection_layer = "compiled"`, fastbroker_core.Reactor), and
Mosquitto, in one run, fresh brokers for every measurement, the order rotated per round.

    python bench/connection_layer.py [--rounds 3] [--duration 5]
        [--scenarios connect-one,connections,latency,pairs] [--setups uvloop,compiled,mosquitto]

Scenarios (bench/loadgen, QoS 0, 64-byte payloads):
- connect-one: 10,000 connects made one at a time (each waits for its CONNACK), held 3 s:
  connects/s and broker RSS per idle connection (what issue 18 compares with Mosquitto).
- connections: the same with 256 connecting at a time (bench/run.py's scenario).
- latency: 1 publisher at 5,000 msg/s, 1 subscriber: p50 / p99 in microseconds.
- pairs: 50 publisher/subscriber pairs: delivered msg/s.
Broker CPU per delivered message is printed for latency and pairs. Ratios are per round
(compiled / uvloop and compiled / Mosquitto), then the median. Only processes this script
starts are stopped, by PID.
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

import run as bench  # noqa: E402  (bench/run.py)

SETUPS = ("uvloop", "compiled", "mosquitto")
SOURCES = "127.0.0.2-127.0.0.16"
HOLD_S = 3  # how long the connections are held open and idle
SCENARIOS: dict[str, tuple[str, list[str], tuple[str, ...]]] = {
    "connect-one": (
        "connections",
        ["--count", "10000", "--sources", SOURCES, "--hold", str(HOLD_S), "--concurrency", "1"],
        ("connects_per_s", "rss_per_conn_bytes"),
    ),
    "connections": (
        "connections",
        ["--count", "15000", "--sources", SOURCES, "--hold", str(HOLD_S), "--concurrency", "256"],
        ("connects_per_s", "rss_per_conn_bytes"),
    ),
    "latency": ("latency", ["--rate", "5000", "--payload", "64"], ("p50_us", "p99_us", "cpu_us")),
    "pairs": ("pairs", ["--pairs", "50", "--payload", "64"], ("delivered_per_s", "cpu_us")),
}
LOWER_IS_BETTER = {"rss_per_conn_bytes", "p50_us", "p99_us", "cpu_us"}


def fmt(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.2f}"


def start(setup: str, base: Path) -> bench.Broker:
    kind = "mosquitto" if setup == "mosquitto" else "fastbroker"
    port = bench.free_port()
    workdir = Path(tempfile.mkdtemp(prefix=f"{setup}-{port}-", dir=base))
    cmd = bench.broker_command(kind, port, workdir)
    if kind == "fastbroker":
        config = workdir / "fastbroker.toml"
        text = config.read_text()
        listener = f"port = {port}\n"
        layer = f"connection_layer = {json.dumps(setup)}\n"
        config.write_text(text.replace(listener, listener + layer, 1))
    broker = bench.launch(kind, port, workdir, cmd)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if broker.proc.poll() is not None:
            break
        try:
            import socket

            with socket.create_connection((bench.HOST, port), timeout=0.5):
                return broker
        except OSError:
            time.sleep(0.05)
    bench.stop_process(broker.proc)
    raise RuntimeError(f"{setup} did not start: {broker.stderr_tail()}")


def measure(setup: str, scenario: str, loadgen: Path, base: Path, seconds: float) -> dict:
    command, options, _ = SCENARIOS[scenario]
    broker = start(setup, base)
    try:
        args = [command, "--host", bench.HOST, "--port", str(broker.port), *options]
        if command != "connections":
            args += ["--duration", str(seconds), "--warmup", "1"]
        samples: list[tuple[float, float]] = []
        rss_hold: list[int] = []
        ready: list[float] = []
        rss_before = bench.proc_status_kb(broker.pid)

        def on_sample(now: float) -> None:
            cpu = bench.proc_cpu_seconds(broker.pid)
            if cpu is not None:
                samples.append((now, cpu))
            rss = bench.proc_status_kb(broker.pid)
            # Held and idle: from 1 s after the last connect until the loadgen closes them.
            if rss is not None and ready and ready[0] + 1.0 <= now < ready[0] + HOLD_S:
                rss_hold.append(rss)

        run = bench.run_loadgen(loadgen, args, 600, on_sample=on_sample, on_ready=ready.append)
        result, _ = bench.parse_loadgen_output(run.stdout)
        bench.check_loadgen_result(run, result)
        assert result is not None
        figures: dict[str, Any] = {}
        if command == "connections":
            connected = int(result.get("connected") or 0)
            figures["connects_per_s"] = result.get("connects_per_s")
            if rss_hold and rss_before and connected:
                figures["rss_per_conn_bytes"] = (max(rss_hold) - rss_before) * 1024 / connected
        else:
            for key in ("p50_us", "p99_us", "delivered_per_s"):
                if key in result:
                    figures[key] = result[key]
            lo, hi = bench.measured_window(run, 1, seconds)
            inside = [(t, c) for t, c in samples if lo <= t <= hi]
            if len(inside) >= 2 and result.get("delivered_per_s"):
                cpu = (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])
                figures["cpu_us"] = cpu / result["delivered_per_s"] * 1e6
        return figures
    finally:
        bench.stop_process(broker.proc)
        shutil.rmtree(broker.workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--setups", default=",".join(SETUPS))
    parser.add_argument("--loadgen", default=None)
    settings = parser.parse_args()
    scenarios = [s for s in settings.scenarios.split(",") if s]
    setups = [s for s in settings.setups.split(",") if s]
    if unknown := set(scenarios) - set(SCENARIOS) | set(setups) - set(SETUPS):
        parser.error(f"unknown: {', '.join(sorted(unknown))}")
    bench.raise_nofile_limit()
    loadgen = bench.find_loadgen(settings.loadgen)
    base = Path(tempfile.mkdtemp(prefix="fb-layers-"))
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        for round_no in range(settings.rounds):
            for scenario in scenarios:
                order = setups[round_no % len(setups) :] + setups[: round_no % len(setups)]
                for setup in order:
                    try:
                        figures = measure(setup, scenario, loadgen, base, settings.duration)
                    except Exception as error:  # one failed run must not end the benchmark
                        figures = {"error": f"{type(error).__name__}: {error}"}
                    results.setdefault((scenario, setup), []).append(figures)
                    print(f"round {round_no + 1} {scenario:12} {setup:10} {figures}", flush=True)
    finally:
        bench.stop_all_started()
        shutil.rmtree(base, ignore_errors=True)
    print()
    print(
        "| scenario | figure | " + " | ".join(setups) + " | compiled/uvloop | compiled/mosquitto |"
    )
    print("|---|---|" + "---|" * (len(setups) + 2))
    for scenario in scenarios:
        for key in SCENARIOS[scenario][2]:
            cells, ratios = [], {}
            for setup in setups:
                values = [f[key] for f in results.get((scenario, setup), []) if key in f]
                cells.append(fmt(statistics.median(values)) if values else "-")
            for other in ("uvloop", "mosquitto"):
                pairs = [
                    (a.get(key), b.get(key))
                    for a, b in zip(
                        results.get((scenario, "compiled"), []),
                        results.get((scenario, other), []),
                        strict=False,
                    )
                ]
                per_round = [a / b for a, b in pairs if a and b]
                ratios[other] = f"{statistics.median(per_round):.2f}" if per_round else "-"
            better = "lower" if key in LOWER_IS_BETTER else "higher"
            print(
                f"| {scenario} | {key} ({better} is better) | "
                + " | ".join(cells)
                + f" | {ratios['uvloop']} | {ratios['mosquitto']} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
