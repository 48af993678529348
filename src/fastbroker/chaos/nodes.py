"""The cluster a fault-injection run breaks: real `fastbroker run` processes, each in its own
network namespace (chaos/network.py) with its own data directory, behind HAProxy
(chaos/front.py); started, killed, paused and resumed by PID. Only processes started here are
signalled."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastbroker.chaos.front import Front, admin_get, admin_request
from fastbroker.chaos.network import Network

MQTT_PORT = 21883
CLUSTER_PORT = 27883
ADMIN_PORT = 28830
# Each node's data directory is on a tmpfs of this size (the disk fault fills it).
DISK_SIZE = "512m"


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


class NodeProcess:
    """One node: its addresses, its process (None while it is not running)."""

    def __init__(
        self,
        node_id: str,
        ip: str,
        workdir: Path,
        cluster: dict[str, Any],
        command: Callable[[list[str]], list[str]],
        admin_socket: str,
    ) -> None:
        self.node_id = node_id
        self.ip = ip
        self.workdir = workdir
        self.cluster = cluster
        # Wraps argv to run in the node's namespace.
        self.command = command
        self.admin_socket = admin_socket
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        workdir.mkdir(parents=True, exist_ok=True)
        # The data directory lives on a tmpfs of its own, so that the nemesis can fill it
        # (`fill_disk`) without touching the host's disks.
        self.disk = workdir / "disk"
        self.mounted = False

    @property
    def data_dir(self) -> Path:
        return self.disk / "data"

    @property
    def ballast(self) -> Path:
        return self.disk / "ballast"

    def mount_disk(self) -> None:
        self.disk.mkdir(exist_ok=True)
        argv = ["mount", "-t", "tmpfs", "-o", f"size={DISK_SIZE}", "tmpfs", str(self.disk)]
        subprocess.run(argv, check=True, capture_output=True, timeout=10)
        self.mounted = True

    def unmount_disk(self) -> None:
        """Unmounts its tmpfs (the node's log stays in its work directory)."""
        if not self.mounted:
            return
        done = subprocess.run(["umount", str(self.disk)], capture_output=True, timeout=10)
        if done.returncode != 0:
            subprocess.run(["umount", "-l", str(self.disk)], capture_output=True, timeout=10)
        self.mounted = False

    def fill_disk(self) -> None:
        """Takes every free byte of its data directory's file system: the node's writes
        fail with ENOSPC until `empty_disk`."""
        stat = os.statvfs(self.disk)
        chunk = stat.f_bavail * stat.f_frsize
        size = 0
        fd = os.open(self.ballast, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            # What statvfs calls free is not all allocatable (tmpfs keeps some back), and
            # the node writes meanwhile: take chunks, halving on ENOSPC, down to a page.
            while chunk >= 4096:
                try:
                    os.posix_fallocate(fd, size, chunk)
                    size += chunk
                except OSError as error:
                    if error.errno != errno.ENOSPC:
                        raise
                    chunk //= 2
        finally:
            os.close(fd)

    def empty_disk(self) -> None:
        self.ballast.unlink(missing_ok=True)

    @property
    def cluster_address(self) -> str:
        return f"{self.ip}:{CLUSTER_PORT}"

    def config_text(self) -> str:
        lines = [
            # Clients reach it through HAProxy only.
            "[[listeners]]",
            'name = "behind-haproxy"',
            f"host = {toml_value(self.ip)}",
            f"port = {MQTT_PORT}",
            'proxy_protocol = "v2"',
            "[storage]",
            f"data_dir = {toml_value(str(self.data_dir))}",
            "[log]",
            'level = "info"',
            "[admin]",
            "enabled = true",
            f"host = {toml_value(self.ip)}",
            f"port = {ADMIN_PORT}",
            "[cluster]",
            f"node_id = {toml_value(self.node_id)}",
            f"listen = {toml_value(self.cluster_address)}",
        ]
        lines += [f"{key} = {toml_value(value)}" for key, value in self.cluster.items()]
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        config = self.workdir / "node.toml"
        config.write_text(self.config_text())
        with open(self.workdir / "node.log", "ab") as log:
            self.proc = subprocess.Popen(
                self.command([sys.executable, "-m", "fastbroker", "run", "--config", str(config)]),
                cwd=self.workdir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                preexec_fn=die_with_parent,
            )
        self.paused = False

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.paused = False

    def pause(self) -> None:
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            self.proc.send_signal(signal.SIGCONT)
        self.paused = False

    def terminate(self) -> None:
        """SIGTERM (a planned stop), without waiting."""
        if self.proc is not None and self.proc.poll() is None:
            self.resume()
            self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        """SIGTERM (a planned stop), SIGKILL after 15 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def leave(self) -> None:
        """`POST /cluster/leave` (scaling in: the node leaves the cluster, then stops by
        itself), waited for; stopped if it did not leave within 15 s."""
        if not self.running():
            return
        admin_request(self.admin_socket, "POST", "/cluster/leave", 15.0)
        assert self.proc is not None
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.stop()

    def join_afresh(self) -> None:
        """Starts again with an empty data directory: a new node joins (scaling out)."""
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.start()

    def status(self) -> dict[str, Any] | None:
        """Its /cluster/status, or None if it does not answer within a second."""
        if not self.running() or self.paused:
            return None
        status: dict[str, Any] | None = admin_get(self.admin_socket, "/cluster/status")
        return status


class Nodes:
    """Nodes n1..nN at 10.`subnet`.0.1..N, each in its namespace; n1 founds the cluster, the
    others join it; HAProxy in front."""

    def __init__(self, count: int, workdir: Path, subnet: int, settings: dict[str, Any]) -> None:
        secret = os.urandom(16).hex()
        self.network = Network(count, subnet)
        # Unix socket paths are limited to 108 bytes: a short directory of its own.
        self.sockets = Path(tempfile.mkdtemp(prefix="fbc"))
        names = [(f"n{i}", self.network.ip(i)) for i in range(1, count + 1)]
        self.front = Front(
            names,
            MQTT_PORT,
            ADMIN_PORT,
            self.sockets,
            workdir,
            lambda argv: self.network.command(self.network.switch, argv),
        )
        self.nodes: list[NodeProcess] = []
        first = f"{self.network.ip(1)}:{CLUSTER_PORT}"
        for i, (name, ip) in enumerate(names, 1):
            cluster = {"secret": secret, **settings}
            if i > 1:
                cluster["join"] = [first]
            ns = self.network.namespace(i)
            self.nodes.append(
                NodeProcess(
                    name,
                    ip,
                    workdir / name,
                    cluster,
                    lambda argv, ns=ns: self.network.command(ns, argv),
                    self.front.node_admin(name),
                )
            )

    def start(self, timeout: float) -> None:
        self.network.create()
        self.front.start(die_with_parent)
        for node in self.nodes:
            node.mount_disk()
            node.start()
        self.wait_converged(timeout)

    def converged(self) -> bool:
        """Every node answers, with all nodes as members, the same map, and every data
        link up."""
        ids = sorted(n.node_id for n in self.nodes)
        versions = set()
        for node in self.nodes:
            status = node.status()
            if status is None or status.get("pending_change") or not status.get("leader"):
                return False
            if sorted(m["node_id"] for m in status["members"]) != ids:
                return False
            plane = status.get("data_plane", {})
            if not all(plane.get(p, {}).get("up") for p in ids if p != node.node_id):
                return False
            versions.add(status["map_version"])
        return len(versions) == 1

    def wait_converged(self, timeout: float) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if self.converged():
                return time.monotonic() - started
            time.sleep(0.2)
        raise TimeoutError(f"the cluster did not converge within {timeout} s")

    def stop(self) -> None:
        """Stops every node (in parallel: SIGTERM to all, then waits), HAProxy, and deletes
        the namespaces and the sockets' directory."""
        try:
            self.network.heal()
            for node in self.nodes:
                node.terminate()
            for node in self.nodes:
                node.stop()
            self.front.stop()
        finally:
            for node in self.nodes:
                node.unmount_disk()
            self.network.delete()
            for path in self.sockets.iterdir():
                path.unlink()
            self.sockets.rmdir()


def die_with_parent() -> None:  # runs in the child between fork and exec
    """Linux: the node gets SIGKILL if the run's process dies."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass
