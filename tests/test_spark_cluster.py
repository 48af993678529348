"""spark/aggregate.py on a real Spark standalone cluster, not only in local mode (issue 21).

A master and two workers (1 core and 512 MB each, each with its own work directory) start on
loopback from the installed PySpark. The job is submitted with `spark-submit --master
spark://127.0.0.1:PORT --py-files spark.zip`, as docs/analytics.md tells a user to, on the data
of tests/test_spark_jobs.py, and every Parquet table must equal the one local mode writes from
the same inputs. The executors' logs in both workers' work directories must show finished
tasks of the app, so a job that silently ran in local mode fails. Every JVM is stopped through
the process group of the PID started here (a worker's executors are its children).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from brokers import free_port

pq = pytest.importorskip("pyarrow.parquet")
pyspark = pytest.importorskip("pyspark")
pd_testing = pytest.importorskip("pandas.testing")

# test_spark_jobs puts the checkout on sys.path, for `spark`.
from test_spark_jobs import FIXTURES, MASTER_VARIABLES, REPO, generate, write_results  # noqa: E402

from spark import aggregate as job  # noqa: E402

pytestmark = pytest.mark.timeout(300)

HOST = "127.0.0.1"
SPARK_HOME = Path(pyspark.__file__).resolve().parent
WORKERS = 2
START_TIMEOUT = 90.0  # s, master and workers up; 15-30 s on the loaded 2-core test machine
JOB_TIMEOUT = 200.0  # s, one run of the job; 80-130 s on the cluster there
# The quick compiler alone (C1), as session.py does for local runs: these runs are short (a
# pair of cluster runs on the loaded 2-core machine: 125 s without, 81 s with).
QUICK_JIT = "-XX:TieredStopAtLevel=1"


def _java_or_skip() -> None:
    if shutil.which("java") or os.environ.get("JAVA_HOME"):
        return
    if os.environ.get("FASTBROKER_REQUIRED") == "1":
        pytest.fail("java not found (scripts/test.sh installs openjdk-17-jre-headless)")
    pytest.skip("java not found")


def _clean_env(tmp: Path) -> dict[str, str]:
    """The environment without the machine's Spark settings, with every Spark directory under
    `tmp` and the venv's Python for the driver and any executor Python worker."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in MASTER_VARIABLES and not k.startswith(("SPARK_", "PYSPARK_"))
    }
    conf = tmp / "conf"  # empty: no spark-defaults.conf or log4j2 file of the machine
    local = tmp / "local"
    for d in (conf, local):
        d.mkdir(parents=True, exist_ok=True)
    env.update(
        SPARK_HOME=str(SPARK_HOME),
        SPARK_CONF_DIR=str(conf),
        SPARK_LOCAL_DIRS=str(local),
        SPARK_LOCAL_IP=HOST,
        PYSPARK_PYTHON=sys.executable,
    )
    return env


def _group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (zombies do not count: an executor left
    to a PID 1 that does not reap would otherwise look alive forever)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _stop_group(proc: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM to the process group started with `proc` (its own session), SIGKILL after
    `grace` seconds if any member is left."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if not _group_alive(proc.pid):
            break
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            proc.poll()  # reaps it once it exits
            time.sleep(0.1)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        pass


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def check_running(self) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"{self.name} exited with {self.proc.returncode}:\n{_tail(self.log)}"
            )


@dataclass
class Cluster:
    url: str  # spark://127.0.0.1:PORT, as the master reports it
    ui: str  # the master's web UI, for its /json/ state
    work_dirs: list[Path]
    env: dict[str, str]

    def state(self) -> dict[str, Any]:
        state = _master_state(self.ui)
        assert state is not None, f"no answer from {self.ui}/json/"
        return state


def _master_state(ui: str) -> dict[str, Any] | None:
    """The master's state (workers, apps) from its web UI; None while it does not answer."""
    try:
        with urllib.request.urlopen(f"{ui}/json/", timeout=5.0) as resp:
            return json.load(resp)
    except (OSError, ValueError):  # URLError is an OSError
        return None


def _wait(what: str, predicate: Any, daemons: list[Daemon], timeout: float) -> Any:
    """predicate()'s first truthy value; fails at once when a daemon died, or after timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in daemons:
            d.check_running()
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    logs = "\n".join(f"--- {d.name}:\n{_tail(d.log)}" for d in daemons)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{logs}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("spark-standalone")
    env = _clean_env(root)
    logs = root / "logs"
    logs.mkdir()
    env.update(
        SPARK_LOG_DIR=str(logs),
        SPARK_PID_DIR=str(logs),
        # Master and worker JVMs hold little; the REST submission server (fixed port 6066)
        # is not needed by spark-submit in client mode.
        SPARK_DAEMON_MEMORY="256m",
        SPARK_DAEMON_JAVA_OPTS=QUICK_JIT,
        SPARK_MASTER_OPTS="-Dspark.master.rest.enabled=false",
    )
    spark_class = str(SPARK_HOME / "bin" / "spark-class")
    daemons: list[Daemon] = []

    def start(name: str, *args: str, **extra_env: str) -> Daemon:
        log = logs / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [spark_class, *args],
                env={**env, **extra_env},
                cwd=root,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group, executors included
            )
        daemon = Daemon(name, proc, log)
        daemons.append(daemon)
        return daemon

    try:
        ui = f"http://{HOST}:{free_port(HOST)}"
        master = start(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host", HOST,
            "--port", str(free_port(HOST)),
            "--webui-port", ui.rsplit(":", 1)[1],
        )  # fmt: skip
        state = _wait("the master's /json/", lambda: _master_state(ui), [master], START_TIMEOUT)
        url = state["url"]
        work_dirs = []
        for i in range(WORKERS):
            work = root / f"worker{i}"
            work.mkdir()
            work_dirs.append(work)
            start(
                f"worker{i}",
                "org.apache.spark.deploy.worker.Worker",
                "--host", HOST,
                "--cores", "1",
                "--memory", "512m",
                "--work-dir", str(work),
                "--webui-port", "0",  # any free port: only the master's UI is read
                url,
                SPARK_WORKER_DIR=str(work),
            )  # fmt: skip

        def alive_workers() -> bool:
            state = _master_state(ui) or {}
            alive = [w for w in state.get("workers", []) if w.get("state") == "ALIVE"]
            return len(alive) == WORKERS

        _wait(f"{WORKERS} ALIVE workers", alive_workers, daemons, START_TIMEOUT)
        yield Cluster(url=url, ui=ui, work_dirs=work_dirs, env=env)
    finally:
        for daemon in reversed(daemons):
            _stop_group(daemon.proc)
        left = [d.name for d in daemons if _group_alive(d.proc.pid)]
        assert not left, f"still running after SIGKILL: {left}"


@dataclass
class Job:
    """A job's process, in its own process group (stopped whole on timeout or teardown)."""

    name: str
    proc: subprocess.Popen[bytes]
    out: Path  # stdout
    log: Path  # stderr
    deadline: float

    @classmethod
    def start(cls, name: str, cmd: list[str], cwd: Path, env: dict[str, str], logs: Path) -> Job:
        out, log = logs / f"{name}.out", logs / f"{name}.log"
        with out.open("wb") as stdout, log.open("wb") as stderr:
            proc = subprocess.Popen(
                cmd,
                cwd=cwd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=stdout,
                stderr=stderr,
                start_new_session=True,
            )
        return cls(name, proc, out, log, time.monotonic() + JOB_TIMEOUT)

    def finish(self) -> str:
        """Its stdout once it exited with status 0; fails on another status or after
        JOB_TIMEOUT seconds from its start."""
        try:
            self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{self.name} still running after {JOB_TIMEOUT:.0f} s:\n{_tail(self.log)}"
            ) from None
        finally:
            _stop_group(self.proc, grace=5.0)
        if self.proc.returncode != 0:
            raise AssertionError(
                f"{self.name} exited with {self.proc.returncode}:\n{_tail(self.log)}"
            )
        return self.out.read_text()


@dataclass
class Inputs:
    root: Path
    args: list[str]  # the job's input options


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    _java_or_skip()  # first: both runs need it
    root = tmp_path_factory.mktemp("spark-cluster-job")
    # tests/test_spark_jobs.py's generated records (two runs, four record files, a line cut
    # mid-write) with the static fixtures' Locust CSVs and bench results: every table has rows.
    results = root / "results"
    write_results(results, generate())
    shutil.copytree(FIXTURES / "results" / "locust", results / "locust")
    return Inputs(root, ["--results", str(results), "--bench-results", str(FIXTURES / "bench")])


@pytest.fixture(scope="module")
def local_job(inputs: Inputs) -> Iterator[Job]:
    """The same job in local mode (plain python), started before the cluster: the two
    start-ups overlap."""
    root = inputs.root
    cmd = [sys.executable, "-m", "spark.aggregate", *inputs.args, "--out", str(root / "local")]
    local = Job.start("local", cmd, cwd=REPO, env=_clean_env(root / "local-run"), logs=root)
    yield local
    _stop_group(local.proc, grace=5.0)


@dataclass
class Runs:
    cluster: Cluster
    local_out: Path
    local_stdout: str
    cluster_out: Path
    cluster_stdout: str
    app_id: str


def _spark_zip(dest: Path) -> Path:
    """The `spark` package as --py-files wants it (spark/ at the root of the zip)."""
    with zipfile.ZipFile(dest, "w") as zf:
        for path in sorted((REPO / "spark").glob("*.py")):
            zf.write(path, f"spark/{path.name}")
    return dest


@pytest.fixture(scope="module")
def runs(inputs: Inputs, local_job: Job, cluster: Cluster) -> Runs:
    root = inputs.root
    before = {a["id"] for a in cluster.state()["completedapps"]}
    submit = Job.start(
        "cluster",
        [
            str(SPARK_HOME / "bin" / "spark-submit"),
            "--master", cluster.url,
            "--py-files", str(_spark_zip(root / "spark.zip")),
            "--conf", "spark.ui.enabled=false",
            "--conf", "spark.executor.memory=512m",
            "--conf", "spark.executor.cores=1",
            "--conf", f"spark.cores.max={WORKERS}",
            # Start only with both executors, so that both workers get tasks.
            "--conf", "spark.scheduler.minRegisteredResourcesRatio=1.0",
            "--conf", "spark.scheduler.maxRegisteredResourcesWaitingTime=60s",
            "--driver-java-options", QUICK_JIT,
            "--conf", f"spark.executor.extraJavaOptions={QUICK_JIT}",
            str(REPO / "spark" / "aggregate.py"),
            *inputs.args,
            "--out", str(root / "cluster"),
        ],
        cwd=root,  # not the checkout: nothing may depend on the driver's directory
        env=cluster.env,
        logs=root,
    )  # fmt: skip
    cluster_stdout = submit.finish()
    local_stdout = local_job.finish()
    assert "master: local[" in local_stdout
    # The master saw the app through: a run that fell back to local mode leaves no app here.
    apps = [a for a in cluster.state()["completedapps"] if a["id"] not in before]
    assert [(a["name"], a["state"]) for a in apps] == [(job.APP_NAME, "FINISHED")], apps
    return Runs(
        cluster, root / "local", local_stdout, root / "cluster", cluster_stdout, apps[0]["id"]
    )


def test_job_ran_on_the_standalone_cluster(runs: Runs) -> None:
    cluster = runs.cluster
    assert f"master: {cluster.url}\n" in runs.cluster_stdout
    # Each worker started an executor for the app and its log shows finished tasks.
    for work in cluster.work_dirs:
        logs = list((work / runs.app_id).glob("*/stderr"))
        assert logs, f"no executor of {runs.app_id} in {work}"
        finished = sum(log.read_text(errors="replace").count("Finished task") for log in logs)
        assert finished > 0, f"no task finished in {work}"


def _summary(stdout: str) -> list[str]:
    """The job's report minus the lines that differ by design (master, elapsed time)."""
    return [line for line in stdout.splitlines() if not line.startswith(("master:", "wrote "))]


def test_cluster_tables_equal_local_mode(runs: Runs) -> None:
    assert _summary(runs.cluster_stdout) == _summary(runs.local_stdout)
    for name in job.TABLES:
        parts = sorted((runs.cluster_out / name).glob("part-*.parquet"))
        assert len(parts) == 1, (name, parts)  # one file per table, as in local mode
        local = pq.read_table(runs.local_out / name)
        remote = pq.read_table(runs.cluster_out / name)
        assert remote.schema == local.schema, name
        assert local.num_rows > 0, name  # the inputs give every table rows to compare
        # Same rows in the same (key) order. Floats to 1e-12: a mean sums in partition order.
        pd_testing.assert_frame_equal(
            remote.to_pandas(),
            local.to_pandas(),
            check_exact=False,
            rtol=1e-12,
            atol=0.0,
            obj=name,
        )
