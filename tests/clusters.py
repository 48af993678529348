"""Real fastbroker cluster nodes for the cluster tests: one process per node, each on its own
loopback address (127.X.0.N, X from the test run's PID so parallel runs do not meet), all
with the same ports, which is what DNS A records and multicast announcements need.

Every node is started by this harness and ended by PID (SIGTERM, then SIGKILL) at teardown.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from brokers import REPO, _die_with_parent, _toml_value

MQTT_PORT = 21883
CLUSTER_PORT = 27883
ADMIN_PORT = 28830
SECRET = "test-cluster-secret"
# Fast timings so the tests converge in seconds; the defaults are 10x slower.
FAST = {
    "heartbeat_ms": 100,
    "election_timeout_ms": 400,
    "failure_timeout_ms": 2000,
    "discovery_interval_ms": 300,
}


def run_subnet() -> int:
    return 20 + os.getpid() % 200


class Node:
    def __init__(self, node_id: str, ip: str, workdir: Path, netns: Any = None) -> None:
        self.node_id = node_id
        # A tests/netns.py Netns the node runs in, or None for the host's own loopback.
        self.netns = netns
        self.ip = ip
        self.workdir = workdir
        self.mqtt_port = MQTT_PORT
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = workdir / "node.log"
        # Another build to run this node with (a directory of its packages, put first on the
        # node's PYTHONPATH: tests/test_rolling_upgrade.py), or None for this one.
        self.build: Path | None = None

    @property
    def cluster_address(self) -> str:
        return f"{self.ip}:{CLUSTER_PORT}"

    @property
    def admin(self) -> str:
        return f"{self.ip}:{ADMIN_PORT}"

    def request(self, method: str, path: str, body: Any = None, timeout: float = 5.0) -> Any:
        if self.netns is not None:
            return self.request_in_netns(method, path, body, timeout)
        data = json.dumps(body).encode() if body is not None else None
        if method == "POST" and data is None:
            data = b""
        request = urllib.request.Request(
            f"http://{self.admin}{path}",
            data=data,
            method=method,
            headers={"X-Fastbroker-Admin": "1"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            return json.loads(error.read())

    def request_in_netns(self, method: str, path: str, body: Any, timeout: float) -> Any:
        """The same request made from inside the node's namespace (its address is not
        reachable from the host's)."""
        script = (
            "import sys, urllib.request, urllib.error\n"
            "data = sys.argv[3].encode() if sys.argv[2] == 'POST' else None\n"
            "req = urllib.request.Request(sys.argv[1], data=data, method=sys.argv[2],\n"
            "                             headers={'X-Fastbroker-Admin': '1'})\n"
            "try:\n"
            "    print(urllib.request.urlopen(req, timeout=float(sys.argv[4])).read().decode())\n"
            "except urllib.error.HTTPError as e:\n"
            "    print(e.read().decode())\n"
        )
        url = f"http://{self.admin}{path}"
        argv = [sys.executable, "-c", script, url, method, json.dumps(body), str(timeout)]
        out = self.netns.run(argv, timeout=timeout + 10)
        return json.loads(out.stdout)

    def status(self) -> dict[str, Any] | None:
        """The node's /cluster/status, or None if it does not answer."""
        try:
            return self.request("GET", "/cluster/status", timeout=2.0)
        except (OSError, ValueError, subprocess.SubprocessError):
            return None

    def block(self, node_ids: Iterable[str]) -> None:
        self.request("POST", "/debug/block", {"nodes": sorted(node_ids)})

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(5)

    def stop(self, timeout: float = 10.0) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc is not None else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


class Cluster:
    """Nodes n1, n2, ... on 127.X.0.1, 127.X.0.2, ..."""

    def __init__(
        self,
        tmp_path: Path,
        settings: dict[str, Any] | None = None,
        netns: Any = None,
        sys_interval: float = 0,
        connection_layer: str | None = None,
    ) -> None:
        self.tmp_path = tmp_path
        self.netns = netns
        # [listener] connection_layer of every node (None: the default, the compiled one,
        # which also serves the data links between nodes).
        self.connection_layer = connection_layer
        # [sys] interval of every node (0: no $SYS messages).
        self.sys_interval = sys_interval
        self.settings = {**FAST, **(settings or {})}
        self.subnet = run_subnet()
        self.nodes: dict[str, Node] = {}

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def ip(self, index: int) -> str:
        return f"127.{self.subnet}.0.{index}"

    def node(self, index: int) -> Node:
        node_id = f"n{index}"
        if node_id not in self.nodes:
            workdir = self.tmp_path / node_id
            workdir.mkdir(parents=True, exist_ok=True)
            self.nodes[node_id] = Node(node_id, self.ip(index), workdir, self.netns)
        return self.nodes[node_id]

    def config_text(self, node: Node, cluster: dict[str, Any]) -> str:
        lines = [
            "[listener]",
            f"host = {_toml_value(node.ip)}",
            f"port = {MQTT_PORT}",
            *(
                [f"connection_layer = {_toml_value(self.connection_layer)}"]
                if self.connection_layer
                else []
            ),
            "[storage]",
            f"data_dir = {_toml_value(str(node.workdir / 'data'))}",
            "[log]",
            'level = "info"',
            "[sys]",
            f"interval = {_toml_value(self.sys_interval)}",
            "[admin]",
            "enabled = true",
            f"host = {_toml_value(node.ip)}",
            f"port = {ADMIN_PORT}",
            "[cluster]",
        ]
        base = {
            "node_id": node.node_id,
            "listen": node.cluster_address,
            "secret": SECRET,
            "fault_injection": True,
        }
        for key, value in {**base, **self.settings, **cluster}.items():
            lines.append(f"{key} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"

    def start(self, index: int, *, wait: bool = True, **cluster: Any) -> Node:
        """Starts node n{index}; `cluster` adds [cluster] keys (join=[...], discovery=...)."""
        node = self.node(index)
        assert not node.alive(), f"{node.node_id} is running"
        config = node.workdir / "node.toml"
        config.write_text(self.config_text(node, cluster))
        env = dict(os.environ)
        if importlib.util.find_spec("fastbroker") is None:
            env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
        if node.build is not None:
            env["PYTHONPATH"] = str(node.build) + os.pathsep + env.get("PYTHONPATH", "")
        with open(node.log_path, "ab") as log:
            argv = [sys.executable, "-m", "fastbroker", "run", "--config", str(config)]
            if self.netns is not None:
                # `ip netns exec` execs the command: the PID is still the node's own.
                argv = self.netns.command(argv)
            node.proc = subprocess.Popen(
                argv,
                cwd=node.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                preexec_fn=_die_with_parent,
            )
        if wait:
            wait_for(lambda: node.status() is not None, 15, f"{node.node_id} to answer", node)
        return node

    def seeds(self, *indexes: int) -> list[str]:
        return [self.node(i).cluster_address for i in indexes]

    def running(self) -> list[Node]:
        return [n for n in self.nodes.values() if n.alive()]

    def stop_all(self) -> None:
        for node in self.nodes.values():
            if node.alive():
                try:
                    node.stop(10)
                except subprocess.TimeoutExpired:
                    pass

    def converged(self, members: Iterable[str], on: Iterable[Node] | None = None) -> bool:
        """Every given (default: running) node agrees: the same map version, exactly these
        members, no change in progress, and a leader."""
        expected = sorted(members)
        versions = set()
        for node in on if on is not None else self.running():
            status = node.status()
            if status is None or status.get("pending_change") or not status.get("leader"):
                return False
            if sorted(m["node_id"] for m in status["members"]) != expected:
                return False
            versions.add(status["map_version"])
        return len(versions) == 1

    def wait_converged(
        self, members: Iterable[str], timeout: float, on: Iterable[Node] | None = None
    ) -> float:
        """Seconds until converged (fails the test after timeout)."""
        members = sorted(members)
        on = list(on) if on is not None else None
        return wait_for(
            lambda: self.converged(members, on),
            timeout,
            f"the map to converge on {members}",
            *(on or self.running()),
        )


def wait_for(
    predicate: Callable[[], bool], timeout: float, what: str, *nodes: Node, poll: float = 0.1
) -> float:
    """Seconds until predicate() holds; on timeout, fails with the nodes' statuses and logs."""
    started = time.monotonic()
    deadline = started + timeout
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic() - started
        time.sleep(poll)
    details = []
    for node in nodes:
        details.append(f"--- {node.node_id} status: {json.dumps(node.status())[:3000]}")
        details.append(f"--- {node.node_id} log tail:\n{node.log()[-3000:]}")
    raise AssertionError(f"timed out after {timeout} s waiting for {what}\n" + "\n".join(details))
