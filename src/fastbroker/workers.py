"""Workers: one node served by several processes ([node] workers, `--workers N|auto`).

A supervisor forks N workers and does nothing else: it restarts a worker that dies, passes
SIGTERM, SIGINT and SIGHUP on to every worker, and ends when they have ended. Every worker
is a whole broker on one core:
- it binds every listener itself with SO_REUSEPORT, so the kernel spreads connections;
- the workers are linked by the cluster's own machinery (fastbroker.cluster) over loopback:
  an internal cluster with one replica per partition (the workers share one disk, so a
  second copy on it would protect nothing a restarted worker does not already recover),
  which routes publishes, moves sessions to the worker a client reconnects to, and keeps
  the retained set on every worker;
- each has its own store under ``<data_dir>/workers/<name>``: a worker killed by SIGKILL is
  restarted on its own data, and what it acknowledged is there (as for a single process).
The first worker serves the admin endpoint; each publishes $SYS to its own clients. The
loopback ports of the links are chosen on the first start and kept in
``<data_dir>/workers/links.json``: Raft remembers its members by address, so they must not
change between starts.

The supervisor must not start threads: it forks again whenever a worker is restarted.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import errno
import json
import logging
import math
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastbroker.config import Config, ConfigError
from fastbroker.overload import high_water_bytes

logger = logging.getLogger("fastbroker.workers")

# What the workers call their internal cluster (never shown to other nodes).
WORKERS_CLUSTER_NAME = "fastbroker-workers"
WORKERS_DIR = "workers"
LINKS_FILE = "links.json"
LINK_HOST = "127.0.0.1"
# Faster than a cluster across machines: the workers share a host, so a silent one is dead
# (or stopped), not cut off.
WORKER_HEARTBEAT_MS = 100
WORKER_ELECTION_TIMEOUT_MS = 500
# A dead worker is being restarted: its place in the map is kept this long (a restart
# that restores a large store takes seconds), so that its partitions do not move away and
# back. Its sessions have no copies to take over from (one replica) and wait for it anyway.
WORKER_FAILURE_TIMEOUT_MS = 10_000
# A worker that dies this soon after its start, this many times in a row, is not restarted
# again: the whole node stops (exit 1) instead of restarting in a loop.
CRASH_LOOP_S = 10.0
CRASH_LOOP_LIMIT = 5
# How long the workers get to stop after SIGTERM before they are killed.
STOP_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCHLD)


def usable_cores() -> int:
    """The cores this process may run on: its affinity mask, capped by the cgroup's CPU
    quota (cgroup v2 cpu.max, or v1 cfs_quota_us / cfs_period_us), rounded up."""
    cores = len(os.sched_getaffinity(0))
    quota = cgroup_cpu_quota()
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return cores


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", own: str = "/proc/self/cgroup") -> float | None:
    """CPUs' worth of time this process's cgroup allows (the tightest limit on its path up
    to the root), or None for no limit. cgroup v2 (cpu.max) or v1 (the cpu controller's
    cfs_quota_us / cfs_period_us)."""
    try:
        with open(own, encoding="utf-8") as file:
            lines = [line.strip().split(":", 2) for line in file if line.count(":") >= 2]
    except OSError:
        lines = []
    v2 = next((path for hierarchy, _, path in lines if hierarchy == "0"), "/")
    v1 = next((path for _, names, path in lines if "cpu" in names.split(",")), "/")
    limits = [quota_v2(directory) for directory in ancestors(root, v2)]
    if not any(limit is not None for limit in limits):
        for mount in ("cpu", "cpu,cpuacct"):
            limits += [quota_v1(directory) for directory in ancestors(f"{root}/{mount}", v1)]
    found = [limit for limit in limits if limit is not None]
    return min(found) if found else None


def ancestors(root: str, path: str) -> list[str]:
    """`root` joined with `path` and each of its parents, down to `root` itself."""
    parts = [part for part in path.split("/") if part and part != ".."]
    return [os.path.join(root, *parts[:depth]) for depth in range(len(parts), -1, -1)]


def quota_v2(directory: str) -> float | None:
    try:
        with open(f"{directory}/cpu.max", encoding="ascii") as file:
            quota, period = file.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def quota_v1(directory: str) -> float | None:
    try:
        with open(f"{directory}/cpu.cfs_quota_us", encoding="ascii") as file:
            quota_us = int(file.read())
        with open(f"{directory}/cpu.cfs_period_us", encoding="ascii") as file:
            period_us = int(file.read())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 or period_us <= 0 else quota_us / period_us


def worker_count(config: Config) -> int:
    workers = config.node.workers
    return usable_cores() if workers == "auto" else int(workers)


def link_ports(directory: Path, count: int) -> list[int]:
    """The loopback ports of the workers' links: kept from earlier starts, new ones picked for
    workers added since (free at the time they are picked). Raises ConfigError when the
    data directory holds more workers than asked for (their data would not be served)."""
    path = directory / LINKS_FILE
    ports: list[int] = []
    if path.exists():
        try:
            ports = [int(p) for p in json.loads(path.read_text())["ports"]]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(f"{path}: unreadable ({error})") from None
    if len(ports) > count:
        raise ConfigError(
            f"[node] workers: the data directory holds the data of {len(ports)} workers; "
            f"start with at least {len(ports)} (fewer would leave some sessions unserved)"
        )
    if len(ports) < count:
        held = []
        for _ in range(count - len(ports)):
            sock = socket.socket()
            sock.bind((LINK_HOST, 0))
            held.append(sock)
            ports.append(sock.getsockname()[1])
        for sock in held:
            sock.close()
        directory.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(".tmp")
        temporary.write_text(json.dumps({"ports": ports}))
        os.replace(temporary, path)
    return ports


def reserve_listener_ports(config: Config) -> tuple[Config, list[socket.socket]]:
    """Listeners on port 0 get one port for every worker: the supervisor binds it (with
    SO_REUSEPORT, never listening, so it takes no connections) and holds it while it runs."""
    held: list[socket.socket] = []
    specs = []
    for spec in config.listeners:
        if spec.port == 0:
            family = socket.AF_INET6 if ":" in spec.host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((spec.host, 0))
            held.append(sock)
            spec = dataclasses.replace(spec, port=sock.getsockname()[1])
        specs.append(dataclasses.replace(spec, reuse_port=True))
    return dataclasses.replace(config, listeners=tuple(specs)), held


def worker_name(index: int) -> str:
    return f"w{index + 1}"


def metrics_socket(run_id: str, index: int) -> str:
    """Worker `index`'s /metrics socket for the first worker: in Linux's abstract namespace
    (no file to clean up, no path length limit), named per supervisor run."""
    return f"\0fastbroker-{run_id}-{worker_name(index)}"


def worker_config(
    config: Config, index: int, ports: list[int], secret: str, run_id: str = ""
) -> Config:
    """Worker `index`'s config: the node's, in its own data directory, linked to the others."""
    own = f"{LINK_HOST}:{ports[index]}"
    first = index == 0
    cluster = dataclasses.replace(
        config.cluster,
        node_id=worker_name(index),
        listen=own,
        advertise=own,
        name=WORKERS_CLUSTER_NAME,
        secret=secret,
        secret_file="",
        join=tuple(f"{LINK_HOST}:{port}" for i, port in enumerate(ports) if i != index),
        discovery="",
        bootstrap_expect=len(ports),
        workers_of_node=True,
        replication_factor=1,
        ack_replicas=1,
        heartbeat_ms=WORKER_HEARTBEAT_MS,
        election_timeout_ms=WORKER_ELECTION_TIMEOUT_MS,
        failure_timeout_ms=WORKER_FAILURE_TIMEOUT_MS,
        restart_timeout_ms=0,
        # Loopback has bandwidth to spare: compressing would only cost CPU.
        link_compression=False,
    )
    admin = dataclasses.replace(config.admin, enabled=bool(config.admin.enabled) and first)
    node = config.node
    if config.admin.enabled and run_id:
        # The first worker serves the node's /metrics, gathered from every worker.
        if first:
            peers = tuple(metrics_socket(run_id, i) for i in range(1, len(ports)))
            node = dataclasses.replace(node, peer_metrics_sockets=peers)
        else:
            node = dataclasses.replace(node, metrics_socket=metrics_socket(run_id, index))
    limits = config.limits
    share = len(ports)
    # The node's limits, shared out: each worker enforces its part.
    memory = limits.memory_high_water_mb
    if memory == "auto":
        memory = high_water_bytes("auto") >> 20
    limits = dataclasses.replace(
        limits,
        max_connections=-(-limits.max_connections // share),
        max_connection_rate=limits.max_connection_rate / share,
        memory_high_water_mb=max(1, int(memory) // share) if memory else 0,
    )
    data_dir = os.path.join(config.storage.data_dir, WORKERS_DIR, worker_name(index))
    return dataclasses.replace(
        config,
        cluster=cluster,
        admin=admin,
        node=node,
        limits=limits,
        storage=dataclasses.replace(config.storage, data_dir=data_dir),
    )


@dataclasses.dataclass
class Worker:
    index: int
    pid: int = 0
    started: float = 0.0
    ready_fd: int = -1
    ready: bool = False
    # Served once since the supervisor started: a failure after that is restarted, one
    # before it (a port in use, a bad data directory) stops the node.
    served: bool = False
    # Deaths soon after a start, in a row.
    quick_deaths: int = 0


class Supervisor:
    """Forks the workers and keeps them running (see the module's docstring)."""

    def __init__(
        self, config: Config, count: int, run_worker: Callable[[Config, object], int]
    ) -> None:
        self.config = config
        self.count = count
        self.run_worker = run_worker
        self.workers = [Worker(i) for i in range(count)]
        self.secret = secrets.token_hex(16)
        self.run_id = secrets.token_hex(6)
        self.ports: list[int] = []
        self.stopping = False
        self.stop_deadline = math.inf
        self.exit_code = 0

    def run(self) -> int:
        directory = Path(self.config.storage.data_dir) / WORKERS_DIR
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ConfigError(f"cannot create {directory}: {error.strerror}") from None
        self.ports = link_ports(directory, self.count)
        self.config, held = reserve_listener_ports(self.config)
        # Blocked before the first fork: the supervisor takes them with sigtimedwait, and a
        # signal that comes between two forks waits instead of being lost.
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        try:
            for worker in self.workers:
                self.start(worker)
            self.supervise()
        finally:
            for sock in held:
                sock.close()
        return self.exit_code

    def start(self, worker: Worker) -> None:
        from fastbroker.server import WorkerSeat

        read_fd, write_fd = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            for other in self.workers:
                if other.ready_fd >= 0:
                    os.close(other.ready_fd)
            code = 1
            try:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
                # No worker outlives its supervisor: the kernel sends it SIGTERM (a planned
                # stop) when the supervisor ends, even by SIGKILL.
                libc = ctypes.CDLL(None, use_errno=True)
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
                if os.getppid() == parent:
                    config = worker_config(
                        self.config, worker.index, self.ports, self.secret, self.run_id
                    )
                    code = self.run_worker(config, WorkerSeat(worker_name(worker.index), write_fd))
            except SystemExit as exit:
                code = exit.code if isinstance(exit.code, int) else 1
            except BaseException:
                logger.exception("worker %s failed", worker_name(worker.index))
            finally:
                sys.stderr.flush()
                os._exit(code)
        os.close(write_fd)
        os.set_blocking(read_fd, False)
        worker.pid, worker.started = pid, time.monotonic()
        worker.ready_fd, worker.ready = read_fd, False

    def supervise(self) -> None:
        while True:
            if self.stopping and not any(w.pid for w in self.workers):
                return
            info = signal.sigtimedwait(SIGNALS, 0.2)
            self.poll_ready()
            if info is None:
                if self.stopping and time.monotonic() > self.stop_deadline:
                    self.signal_all(signal.SIGKILL)
                continue
            if info.si_signo == signal.SIGCHLD:
                self.reap()
            elif info.si_signo == signal.SIGHUP:
                self.signal_all(signal.SIGHUP)
            else:
                self.stop(0)

    def poll_ready(self) -> None:
        for worker in self.workers:
            if worker.pid and not worker.ready:
                try:
                    worker.ready = bool(os.read(worker.ready_fd, 1))
                except BlockingIOError:
                    continue
                if worker.ready:
                    worker.served = True
                    os.close(worker.ready_fd)
                    worker.ready_fd = -1
                    if all(w.ready for w in self.workers):
                        logger.info("%d workers serving", self.count)

    def stop(self, code: int) -> None:
        if not self.stopping:
            self.stopping = True
            self.exit_code = self.exit_code or code
            self.stop_deadline = time.monotonic() + STOP_TIMEOUT_S
            self.signal_all(signal.SIGTERM)

    def signal_all(self, signum: int) -> None:
        for worker in self.workers:
            if worker.pid:
                try:
                    os.kill(worker.pid, signum)
                except ProcessLookupError:
                    pass

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            worker = next((w for w in self.workers if w.pid == pid), None)
            if worker is None:
                continue
            self.ended(worker, os.waitstatus_to_exitcode(status))

    def ended(self, worker: Worker, code: int) -> None:
        name = worker_name(worker.index)
        worker.pid = 0
        if worker.ready_fd >= 0:
            os.close(worker.ready_fd)
            worker.ready_fd = -1
        if self.stopping:
            return
        if not worker.served and code > 0:
            # Failed at startup (its error is on stderr): so would a restart.
            self.stop(code)
            return
        how = f"signal {-code}" if code < 0 else f"exit code {code}"
        quick = time.monotonic() - worker.started < CRASH_LOOP_S
        worker.quick_deaths = worker.quick_deaths + 1 if quick else 0
        if worker.quick_deaths >= CRASH_LOOP_LIMIT:
            logger.error(
                "worker %s ended (%s) %d times within %.0f s of its start: stopping",
                name,
                how,
                worker.quick_deaths,
                CRASH_LOOP_S,
            )
            self.stop(1)
            return
        logger.error("worker %s ended (%s): restarting it", name, how)
        if quick:
            time.sleep(min(0.1 * 2**worker.quick_deaths, 2.0))
        self.start(worker)


# How long the first worker waits for another's /metrics; one that does not answer (it is
# restarting) is left out of that scrape.
METRICS_TIMEOUT_S = 2.0


async def fetch_metrics(path: str, timeout: float = METRICS_TIMEOUT_S) -> bytes | None:
    """A worker's own /metrics document, from its socket; None if it does not answer."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        # Connected by hand: uvloop's open_unix_connection takes no abstract names.
        await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, path), timeout)
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        try:
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: worker\r\n\r\n")
            data = await asyncio.wait_for(reader.read(), timeout)
        finally:
            writer.close()
    except (OSError, TimeoutError):
        sock.close()
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    return body if head.startswith(b"HTTP/1.1 200") else None


def node_metrics(
    own: Callable[[], bytes], peers: tuple[str, ...]
) -> Callable[[], Awaitable[bytes]]:
    """The first worker's /metrics: its own document and the other workers', merged."""

    async def render() -> bytes:
        documents = [(worker_name(0), own())]
        fetched = await asyncio.gather(*(fetch_metrics(path) for path in peers))
        for path, document in zip(peers, fetched, strict=True):
            if document is not None:
                documents.append((path.rsplit("-", 1)[1], document))
        return merge_metrics(documents)

    return render


def merge_metrics(documents: list[tuple[str, bytes]]) -> bytes:
    """One Prometheus text document from each worker's: every sample gets a `worker` label,
    and each metric family (its HELP and TYPE lines, then every worker's samples) stays in
    one piece, as the format requires."""
    headers: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for worker, document in documents:
        family = ""
        for line in document.decode().splitlines():
            if not line:
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    seen = headers.setdefault(family, [])
                    samples.setdefault(family, [])
                    if not any(h.split(None, 2)[1] == parts[1] for h in seen):
                        seen.append(line)
                continue
            headers.setdefault(family, [])
            samples.setdefault(family, []).append(with_worker_label(line, worker))
    out = []
    for family, lines in headers.items():
        out += lines
        out += samples[family]
    return ("\n".join(out) + "\n").encode()


def with_worker_label(sample: str, worker: str) -> str:
    """`name{a="b"} 1` -> `name{worker="w2",a="b"} 1`; `name 1` -> `name{worker="w2"} 1`."""
    ends = [i for i in (sample.find("{"), sample.find(" ")) if i >= 0]
    if not ends:
        return sample
    end = min(ends)
    label = f'worker="{worker}"'
    if sample[end] == "{":
        rest = sample[end + 1 :]
        return f"{sample[: end + 1]}{label}{'' if rest.startswith('}') else ','}{rest}"
    return f"{sample[:end]}{{{label}}}{sample[end:]}"


def run_workers(config: Config, run_worker: Callable[[Config, object], int]) -> int:
    """Runs the node as `[node] workers` processes until SIGTERM or SIGINT; the exit code."""
    from fastbroker.server import configure_logging

    configure_logging(config.log.level, "supervisor")
    count = worker_count(config)
    logger.info("starting %d workers", count)
    try:
        return Supervisor(config, count, run_worker).run()
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(f"cannot reserve a port for the workers: {error}") from None
        raise
