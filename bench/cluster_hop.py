#!/usr/bin/env python3
"""What a hop between nodes costs: the same load on one fastbroker node, across a 3-node
fastbroker cluster, and across two Mosquitto brokers bridged to each other (the nearest thing
Mosquitto offers), side by side in one run.

    python bench/cluster_hop.py [--rounds 3] [--duration 5] [--warmup 1] [--tls]
                                [--nodes 3] [--scenarios pairs,fan-out,latency]
                                [--layer compiled|uvloop]

Every measurement gets freshly started brokers. Scenarios (bench/loadgen, QoS 0, 64-byte
payloads):
- pairs: 50 publisher/subscriber pairs; on the cluster every publisher is on node 1 and every
  subscriber on node 2, so every message crosses a link; on the bridge, publishers on A and
  subscribers on B.
- fan-out: 1 publisher on node 1, 48 subscribers of its topic spread over the 3 nodes (the
  bridge: over A and B).
- latency: 1 publisher at a fixed 5,000 msg/s on node 1, its subscriber on node 2 (bridge: A,
  B); p50 and p99 in microseconds.

For each: delivered msg/s and broker CPU per delivered message (user + system time of every
broker process of the setup, summed, over the loadgen's measured window), and the ratios the
cluster issue sets targets for. With --tls the cluster's links are TLS (throwaway
certificates made with openssl). Only processes this script starts are stopped, by PID.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import run as bench  # noqa: E402  (bench/run.py, found through the path set above)

HOST = bench.HOST
SECRET = "bench-cluster-secret"


@dataclass
class Setup:
    """Broker processes started for one measurement, and where clients connect."""

    name: str
    procs: list[subprocess.Popen]
    addrs: list[str]  # MQTT "host:port" of each broker (node)
    admins: list[int] = field(default_factory=list)  # admin ports of cluster nodes

    def cpu_seconds(self) -> float:
        total = 0.0
        for proc in self.procs:
            cpu = bench.proc_cpu_seconds(proc.pid)
            if cpu is not None:
                total += cpu
        return total

    def stop(self) -> None:
        for proc in self.procs:
            bench.stop_process(proc)


def wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    import socket

    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")


def start_single(base: Path) -> Setup:
    broker = bench.start_broker("fastbroker", base)
    return Setup("one node", [broker.proc], [f"{HOST}:{broker.port}"])


def make_link_certs(directory: Path) -> dict[str, dict[str, str]]:
    from certs import make_ca, make_leaf

    directory.mkdir(parents=True, exist_ok=True)
    ca = make_ca(directory, "ca")
    usage = (
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
    )
    out = {}
    for i in (1, 2, 3):
        pair = make_leaf(directory, ca, f"n{i}", f"n{i}", usage)
        out[f"n{i}"] = {
            "tls_certfile": str(pair.cert),
            "tls_keyfile": str(pair.key),
            "tls_cafile": str(ca.cert),
        }
    return out


def start_cluster(
    base: Path,
    tls: dict[str, dict[str, str]] | None,
    nodes: int = 3,
    settings: dict[str, Any] | None = None,
    mqtt_settings: dict[str, Any] | None = None,
    layer: str | None = None,
) -> Setup:
    """`nodes` nodes on 127.0.0.1, started at once, with these extra [cluster] `settings`
    (and these [mqtt] `mqtt_settings`); returns once every data link is up and every node has
    every node in its partition map with nothing streaming: a measurement made while the map
    still forms would time copies streamed to the owners a partition just gained."""
    ports = [(bench.free_port(), bench.free_port(), bench.free_port()) for _ in range(nodes)]
    seed = f"{HOST}:{ports[0][1]}"
    procs, addrs, admins = [], [], []
    for i, (mqtt, link, admin) in enumerate(ports, start=1):
        workdir = Path(tempfile.mkdtemp(prefix=f"node{i}-", dir=base))
        cluster = [
            # The base config text ends in its [mqtt] table.
            *(f"{k} = {json.dumps(v)}" for k, v in (mqtt_settings or {}).items()),
            "[cluster]",
            f'node_id = "n{i}"',
            f'listen = "{HOST}:{link}"',
            f'secret = "{SECRET}"',
            *([f'join = ["{seed}"]'] if i > 1 else []),
            *(f"{k} = {json.dumps(v)}" for k, v in (tls or {}).get(f"n{i}", {}).items()),
            *(f"{k} = {json.dumps(v)}" for k, v in (settings or {}).items()),
            "[admin]",
            "enabled = true",
            f'host = "{HOST}"',
            f"port = {admin}",
        ]
        config = workdir / "fastbroker.toml"
        text = bench.fastbroker_config_text(mqtt, str(workdir / "data"))
        if layer is not None:
            # [listener] connection_layer: the compiled one (the default) also serves the
            # data links between the nodes.
            port_line = f"port = {mqtt}\n"
            text = text.replace(
                port_line, port_line + f"connection_layer = {json.dumps(layer)}\n", 1
            )
        text += "\n".join(cluster)
        config.write_text(text + "\n")
        cmd = [*bench.fastbroker_command(), "run", "--config", str(config)]
        procs.append(bench.launch("fastbroker", mqtt, workdir, cmd).proc)
        addrs.append(f"{HOST}:{mqtt}")
        admins.append(admin)
    setup = Setup(f"{nodes}-node cluster" + (" (TLS links)" if tls else ""), procs, addrs, admins)
    try:
        for (mqtt, _, _), proc in zip(ports, procs, strict=True):
            wait_port(mqtt, proc, "a cluster node")
        deadline = time.monotonic() + 60
        while not all(links_up(admin, nodes - 1) for admin in admins):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's data links did not come up")
            time.sleep(0.2)
        while not all(map_settled(admin, nodes) for admin in admins):
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster's partition map did not settle")
            time.sleep(0.2)
    except BaseException:
        setup.stop()
        raise
    return setup


def cluster_status(admin_port: int) -> dict[str, Any] | None:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://{HOST}:{admin_port}/cluster/status", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return None


def links_up(admin_port: int, peers: int) -> bool:
    status = cluster_status(admin_port) or {}
    plane = status.get("data_plane") or {}
    return sum(1 for p in plane.values() if p.get("up")) >= peers


def map_settled(admin_port: int, nodes: int) -> bool:
    """Whether the node's map has `nodes` live members, each primary for some partition,
    with no copies streaming."""
    status = cluster_status(admin_port) or {}
    members = status.get("members") or []
    live = [m for m in members if m.get("state") in ("alive", "self") and m.get("primary")]
    settled = len(live) == nodes and not status.get("pending_change", True)
    return settled and not any(m.get("streaming") for m in members)


def start_bridge(base: Path) -> Setup:
    """Mosquitto B, then Mosquitto A bridged to it (bench/# both ways, QoS 0)."""
    b = bench.start_broker("mosquitto", base)
    exe = bench.mosquitto_executable()
    assert exe is not None
    port = bench.free_port()
    workdir = Path(tempfile.mkdtemp(prefix="mosquitto-bridge-", dir=base))
    import os

    text = bench.mosquitto_config_text(port, os.geteuid() == 0) + "\n".join(
        [
            "connection to-b",
            f"address {HOST}:{b.port}",
            "topic bench/# both 0",
            "cleansession true",
            "bridge_protocol_version mqttv311",
        ]
    )
    config = workdir / "mosquitto.conf"
    config.write_text(text + "\n")
    a = bench.launch("mosquitto", port, workdir, [exe, "-c", str(config)])
    setup = Setup("2 Mosquittos bridged", [a.proc, b.proc], [f"{HOST}:{port}", f"{HOST}:{b.port}"])
    try:
        wait_port(port, a.proc, "the bridged mosquitto")
        time.sleep(1.0)  # the bridge connects
    except BaseException:
        setup.stop()
        raise
    return setup


# (name, loadgen scenario, options, where publishers go, where subscribers go): placement as
# indexes into the setup's addresses; None = the one broker.
SCENARIOS = [
    ("pairs", "pairs", ["--pairs", "50", "--payload", "64"], [0], [1]),
    ("fan-out", "fan-out", ["--subscribers", "48", "--payload", "64"], [0], [0, 1, 2]),
    ("latency", "latency", ["--rate", "5000", "--payload", "64"], [0], [1]),
]


def measure(loadgen: Path, setup: Setup, scenario: tuple, settings: argparse.Namespace) -> dict:
    _, command, options, pubs, subs = scenario
    n = len(setup.addrs)
    pub_addrs = ",".join(setup.addrs[i % n] for i in pubs)
    sub_addrs = ",".join(setup.addrs[i % n] for i in subs)
    host, port = setup.addrs[0].rsplit(":", 1)
    args = [
        command,
        "--host",
        host,
        "--port",
        port,
        "--duration",
        str(settings.duration),
        "--warmup",
        str(settings.warmup),
        "--pub-addrs",
        pub_addrs,
        "--sub-addrs",
        sub_addrs,
        *options,
    ]
    samples: list[tuple[float, float]] = []
    run = bench.run_loadgen(
        loadgen,
        args,
        timeout=settings.duration + settings.warmup + 60,
        on_sample=lambda now: samples.append((now, setup.cpu_seconds())),
    )
    result, _ = bench.parse_loadgen_output(run.stdout)
    bench.check_loadgen_result(run, result)
    assert result is not None
    start, end = bench.measured_window(run, settings.warmup, settings.duration)
    inside = [(t, c) for t, c in samples if start <= t <= end]
    figures: dict[str, Any] = {
        k: result[k] for k in ("delivered_per_s", "p50_us", "p99_us") if k in result
    }
    if len(inside) >= 2 and result.get("delivered_per_s"):
        cpu_s = inside[-1][1] - inside[0][1]
        seconds = inside[-1][0] - inside[0][0]
        figures["cpu_us_per_msg"] = cpu_s / seconds / result["delivered_per_s"] * 1e6
    return figures


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--tls", action="store_true", help="TLS on the cluster's links")
    parser.add_argument("--nodes", type=int, default=3, help="nodes of the cluster (2 or 3)")
    parser.add_argument(
        "--layer",
        choices=("compiled", "uvloop"),
        default=None,
        help="the cluster nodes' connection layer (default: the broker's, compiled)",
    )
    parser.add_argument(
        "--scenarios", default=",".join(s[0] for s in SCENARIOS), help="comma-separated"
    )
    parser.add_argument("--loadgen", default=None)
    parser.add_argument("--results", default=str(HERE / "results"))
    settings = parser.parse_args()
    loadgen = bench.find_loadgen(settings.loadgen)
    base = Path(tempfile.mkdtemp(prefix="fastbroker-hop-"))
    tls = make_link_certs(base / "certs") if settings.tls else None
    starters = [
        ("one node", start_single),
        ("cluster", lambda b: start_cluster(b, tls, settings.nodes, layer=settings.layer)),
        ("bridge", start_bridge),
    ]
    # figures[setup][scenario][figure] -> one value per round
    figures: dict[str, dict[str, dict[str, list[float]]]] = {}
    try:
        for round_no in range(1, settings.rounds + 1):
            order = starters if round_no % 2 else list(reversed(starters))
            for scenario in [s for s in SCENARIOS if s[0] in settings.scenarios.split(",")]:
                for key, start in order:
                    # Fresh brokers for every measurement: a bridge's backlog from a flood
                    # must not show up as the next scenario's latency.
                    setup = start(base)
                    try:
                        got = measure(loadgen, setup, scenario, settings)
                    finally:
                        setup.stop()
                    print(f"round {round_no} {setup.name:>22} {scenario[0]:>8}: {got}")
                    per = figures.setdefault(key, {}).setdefault(scenario[0], {})
                    for k, v in got.items():
                        per.setdefault(k, []).append(v)
    finally:
        bench.stop_all_started()
        shutil.rmtree(base, ignore_errors=True)

    def med(setup: str, scenario: str, key: str) -> float | None:
        return median(figures.get(setup, {}).get(scenario, {}).get(key, []))

    rows = []
    for scenario, *_ in SCENARIOS:
        keys = ["p50_us", "p99_us"] if scenario == "latency" else ["delivered_per_s"]
        keys.append("cpu_us_per_msg")
        for key in keys:
            values = [med(s, scenario, key) for s in ("one node", "cluster", "bridge")]
            rows.append((scenario, key, *values))
    print()
    header = ("scenario", "figure", "one node", "cluster", "2 mosquittos bridged")
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(str(round(x, 2)) if isinstance(x, float) else str(x) for x in row))
    ratios = {
        "cluster CPU per msg / one node (pairs, target <= 2.5)": ratio(
            med("cluster", "pairs", "cpu_us_per_msg"), med("one node", "pairs", "cpu_us_per_msg")
        ),
        "cluster pairs msg/s / bridge (target >= 3)": ratio(
            med("cluster", "pairs", "delivered_per_s"), med("bridge", "pairs", "delivered_per_s")
        ),
        "cluster p50 / bridge p50 (target <= 1)": ratio(
            med("cluster", "latency", "p50_us"), med("bridge", "latency", "p50_us")
        ),
        "cluster p99 / bridge p99 (target <= 1)": ratio(
            med("cluster", "latency", "p99_us"), med("bridge", "latency", "p99_us")
        ),
    }
    print()
    for what, value in ratios.items():
        print(f"{what}: {'n/a' if value is None else round(value, 2)}")
    out = Path(settings.results)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"cluster-hop-{time.strftime('%Y%m%dT%H%M%S')}.json"
    path.write_text(
        json.dumps(
            {"tls": settings.tls, "nodes": settings.nodes, "figures": figures, "ratios": ratios}
        )
    )
    print(f"\nwritten to {path}")
    return 0


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


if __name__ == "__main__":
    sys.exit(main())
