"""loadtest/: our Locust MQTT users, run for real (headless Locust subprocesses against a
fastbroker), plus the pure helpers (host parsing, payloads, the record contract)."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
from brokers import free_port, start_fastbroker

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loadtest.context import Settings, parse_scenarios  # noqa: E402
from loadtest.records import RUN_FIELDS, read_records, validate_record  # noqa: E402
from loadtest.targets import Node, parse_hosts  # noqa: E402
from loadtest.tracking import make_payload, parse_payload  # noqa: E402

# Not pytest.importorskip: importing locust monkey-patches the whole pytest process with gevent
# (sockets, threads, time), which breaks every later test. Locust only ever runs in subprocesses.
if importlib.util.find_spec("locust") is None:
    pytest.skip("locust is not installed (pip install .[loadtest])", allow_module_level=True)

LOCUSTFILE = REPO / "loadtest" / "locustfile.py"
TIMEOUT_S = 2.0  # --mqtt-timeout in these runs: bounds the drain at the end


# --------------------------------------------------------------------------- helpers


def locust_cmd(results: Path, run_id: str | None, host: str, *args: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "locust",
        "-f",
        str(LOCUSTFILE),
        "--host",
        host,
        "--results-dir",
        str(results),
        "--mqtt-timeout",
        str(TIMEOUT_S),
        "--loglevel",
        "INFO",
        *args,
    ]
    if run_id:
        cmd += ["--run-id", run_id]
    return cmd


def _kill_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the group of the process we started
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def run_locust(
    tmp_path: Path, host: str, *args: str, run_id: str | None = "r1", timeout: float = 50
) -> SimpleNamespace:
    results = tmp_path / "results"
    csv_prefix = results / "locust" / (run_id or "x") / "locust"
    cmd = locust_cmd(results, run_id, host, "--headless", "--csv", str(csv_prefix), *args)
    out_path = tmp_path / "locust.out"
    t0 = time.monotonic()
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            proc.wait(timeout=timeout)
        finally:
            _kill_group(proc)
    return SimpleNamespace(
        rc=proc.returncode,
        output=out_path.read_text(errors="replace"),
        results=results,
        csv_prefix=csv_prefix,
        seconds=time.monotonic() - t0,
    )


def raw_files(results: Path) -> dict[str, list[Path]]:
    """run_id -> its records files."""
    raw = results / "raw"
    return {d.name: sorted(d.glob("records-*.jsonl")) for d in raw.iterdir() if d.is_dir()}


def load_run(results: Path, run_id: str, expect_files: int) -> list[dict]:
    files = raw_files(results)[run_id]
    assert len(files) == expect_files, files
    records: list[dict] = []
    for path in files:
        worker = path.name[len("records-") : -len(".jsonl")]
        recs = read_records(path)
        for rec in recs:
            assert validate_record(rec) == [], rec
            assert rec["run_id"] == run_id
            assert rec["worker"] == worker  # one file per worker process, named after it
        records += recs
    return records


def stats_rows(csv_prefix: Path) -> list[dict]:
    with open(f"{csv_prefix}_stats.csv", newline="") as f:
        return list(csv.DictReader(f))


def exception_rows(csv_prefix: Path) -> list[dict]:
    with open(f"{csv_prefix}_exceptions.csv", newline="") as f:
        return list(csv.DictReader(f))


def check_run_json(results: Path, run_id: str, scenarios: list[str], processes: int) -> dict:
    doc = json.loads((results / "raw" / run_id / "run.json").read_text())
    assert tuple(doc) == RUN_FIELDS
    assert doc["run_id"] == run_id
    assert doc["scenarios"] == scenarios
    assert doc["processes"] == processes
    assert 1e12 < doc["started_ms"] < doc["ended_ms"]
    assert isinstance(doc["locust_version"], str) and doc["locust_version"]
    return doc


def by(records: list[dict], **match) -> list[dict]:
    return [r for r in records if all(r[k] == v for k, v in match.items())]


def assert_no_crash(run: SimpleNamespace) -> None:
    assert "Traceback" not in run.output, run.output[-4000:]
    assert exception_rows(run.csv_prefix) == [], run.output[-4000:]


def assert_all_ok(records: list[dict], run: SimpleNamespace) -> None:
    failed = [r for r in records if not r["ok"]]
    assert failed == [], (failed[:5], run.output[-3000:])
    assert run.rc == 0, run.output[-4000:]


def assert_plausible_e2e(records: list[dict]) -> None:
    lat = sorted(r["latency_ms"] for r in records if r["kind"] == "e2e")
    assert lat, "no e2e records"
    assert lat[0] >= 0
    assert lat[len(lat) // 2] > 0  # a real network round trip is never 0 ms on the median
    assert lat[-1] < TIMEOUT_S * 1000 * 2  # persistent e2e may include the offline time


# --------------------------------------------------------------------------- pure helpers


def test_parse_hosts_accepts_urls_lists_and_defaults():
    assert parse_hosts("mqtt://10.0.0.1:1884") == [Node("10.0.0.1", 1884)]
    assert parse_hosts("mqtt://a:1,b:2, c") == [Node("a", 1), Node("b", 2), Node("c", 1883)]
    assert parse_hosts("mqtts://a,b") == [Node("a", 8883, True), Node("b", 8883, True)]
    assert parse_hosts("[::1]:1885")[0].name == "[::1]:1885"
    assert parse_hosts(None) == [Node("127.0.0.1", 1883)]
    with pytest.raises(ValueError):
        parse_hosts("http://a:1")
    with pytest.raises(ValueError):
        parse_hosts("a:0")


def test_payload_round_trip_and_foreign_payloads():
    payload = make_payload(1700000000123.456, "ab12.3.7", 64)
    assert len(payload) == 64
    assert parse_payload(payload) == (1700000000123.456, "ab12.3.7")
    big = make_payload(1.5, "x" * 100, 16)  # never truncated: the id must survive
    assert parse_payload(big) == (1.5, "x" * 100)
    assert parse_payload(b"") is None
    assert parse_payload(b"hello|world") is None
    assert parse_payload(b"nan-ish|id|") is None


def test_scenarios_and_settings_validation():
    assert parse_scenarios(["pairs,retained", "connect", "pairs"]) == [
        "pairs",
        "retained",
        "connect",
    ]
    assert parse_scenarios(None) == ["pairs"]
    with pytest.raises(ValueError):
        parse_scenarios(["pairz"])
    opts = SimpleNamespace(qos=2, mqtt_version="3.1.1", scenario=["fanin"], mqtt_timeout=3)
    s = Settings.from_options(opts, "mqtt://h:1")
    assert (s.qos, s.protocol, s.scenarios, s.timeout_s, s.host) == (
        2,
        4,
        ["fanin"],
        3.0,
        "mqtt://h:1",
    )
    with pytest.raises(ValueError):
        Settings.from_options(SimpleNamespace(qos=3), None)


def test_validate_record_rejects_contract_violations():
    good = {
        "run_id": "r",
        "scenario": "pairs",
        "node": "127.0.0.1:1883",
        "qos": 1,
        "kind": "e2e",
        "t_ms": 1.7e12,
        "latency_ms": 1.5,
        "ok": True,
        "error": None,
        "bytes": 64,
        "worker": "host-1",
    }
    assert validate_record(good) == []
    bad_variants = [
        {**good, "latency_ms": None},  # a success needs a latency
        {**good, "ok": False},  # a failure has no latency and needs an error
        {**good, "ok": False, "latency_ms": None, "error": None},
        {**good, "kind": "e2e-qos1"},
        {**good, "qos": 3},
        {**good, "qos": True},
        {**good, "node": "127.0.0.1"},
        {**good, "t_ms": 12.0},  # not ms since the epoch
        {**good, "kind": "connect"},  # connect records carry no payload bytes
        {k: v for k, v in good.items() if k != "worker"},
        {**good, "extra": 1},
    ]
    for bad in bad_variants:
        assert validate_record(bad) != [], bad


# --------------------------------------------------------------------------- real runs


@pytest.mark.timeout(60)
def test_pairs_qos1_two_processes(tmp_path):
    bp = start_fastbroker(tmp_path)
    try:
        run = run_locust(
            tmp_path,
            f"mqtt://{bp.host}:{bp.port}",
            "-u", "6", "-r", "6", "-t", "8s", "--processes", "2",
            "--scenario", "pairs", "--qos", "1", "--rate", "20",
        )  # fmt: skip
    finally:
        bp.stop()
    records = load_run(run.results, "r1", expect_files=2)
    assert_all_ok(records, run)
    assert_no_crash(run)
    node = f"{bp.host}:{bp.port}"
    assert {r["node"] for r in records} == {node}
    kinds = Counter((r["kind"], r["qos"]) for r in records)
    # 6 users x 20 msg/s x ~8 s; each message has one publish and one e2e record.
    assert kinds[("publish", 1)] > 300, kinds
    assert kinds[("e2e", 1)] == kinds[("publish", 1)], kinds
    assert kinds[("connect", 0)] == 12 and kinds[("subscribe", 1)] == 6, kinds
    assert {r["bytes"] for r in by(records, kind="e2e")} == {64}
    assert_plausible_e2e(records)
    t_first = min(r["t_ms"] for r in records)
    doc = check_run_json(run.results, "r1", ["pairs"], processes=2)
    assert doc["users"] == 6 and doc["host"] == f"mqtt://{node}"
    assert doc["started_ms"] <= t_first
    # Locust's CSV has our request types, and the master got every worker's final stats.
    rows = {(r["Type"], r["Name"]): r for r in stats_rows(run.csv_prefix)}
    for key in [("e2e-qos1", "pairs"), ("publish-qos1", "pairs"), ("connect", "pairs")]:
        assert key in rows, sorted(rows)
    assert int(rows[("e2e-qos1", "pairs")]["Request Count"]) == kinds[("e2e", 1)]
    assert int(rows[("e2e-qos1", "pairs")]["Failure Count"]) == 0


@pytest.mark.timeout(60)
def test_retained_persistent_connect_fanin_fanout(tmp_path):
    bp = start_fastbroker(tmp_path)
    scenarios = ["retained", "persistent", "connect", "fanin", "fanout"]
    try:
        run = run_locust(
            tmp_path,
            f"mqtt://{bp.host}:{bp.port}",
            "-u", "20", "-r", "20", "-t", "8s", "--processes", "2",
            "--scenario", "retained,persistent", "--scenario", "connect,fanin,fanout",
            "--qos", "1", "--rate", "5", "--batch", "5",
        )  # fmt: skip
    finally:
        bp.stop()
    records = load_run(run.results, "r1", expect_files=2)
    assert_all_ok(records, run)
    assert_no_crash(run)
    check_run_json(run.results, "r1", scenarios, processes=2)
    for scenario in ("retained", "persistent", "fanin"):
        e2e = by(records, scenario=scenario, kind="e2e")
        published = by(records, scenario=scenario, kind="publish")
        assert len(published) > 10, (scenario, len(published))
        assert len(e2e) == len(published), scenario  # every message received exactly once
    # persistent: every cycle reconnected with its session (no "session not present").
    persistent_connects = by(records, scenario="persistent", kind="connect")
    assert len(persistent_connects) > 8
    # fanout: each message reaches every subscriber of its worker (4 users -> 2 per worker).
    fanout_pub = by(records, scenario="fanout", kind="publish")
    fanout_e2e = by(records, scenario="fanout", kind="e2e")
    assert len(fanout_pub) > 20 and len(fanout_e2e) >= len(fanout_pub)
    storms = by(records, scenario="connect", kind="connect")
    assert len(storms) > 40, len(storms)  # 4 users x 5 cycles/s x ~8 s
    assert all(0 < r["latency_ms"] < 1000 for r in storms)
    assert_plausible_e2e(records)
    types = {(r["Type"], r["Name"]) for r in stats_rows(run.csv_prefix)}
    assert {("e2e-qos1", s) for s in ("retained", "persistent", "fanin", "fanout")} <= types
    assert ("connect", "connect") in types


@pytest.mark.timeout(60)
def test_qos2_mqtt311_single_process_two_nodes(tmp_path):
    """No --processes: the local runner writes the records and run.json itself. MQTT 3.1.1,
    QoS 2, and two nodes in --host (two independent brokers: each pair stays on its node,
    users alternate between the nodes, and the records say which)."""
    a = start_fastbroker(tmp_path / "a")
    b = start_fastbroker(tmp_path / "b")
    try:
        run = run_locust(
            tmp_path,
            f"mqtt://{a.host}:{a.port},{b.host}:{b.port}",
            "-u", "4", "-r", "4", "-t", "6s",
            "--scenario", "pairs,persistent", "--qos", "2", "--mqtt-version", "3.1.1",
            "--rate", "20", "--batch", "3",
        )  # fmt: skip
    finally:
        a.stop()
        b.stop()
    records = load_run(run.results, "r1", expect_files=1)
    assert_all_ok(records, run)
    assert_no_crash(run)
    assert {r["node"] for r in records} == {f"{a.host}:{a.port}", f"{b.host}:{b.port}"}
    pairs_pub = by(records, scenario="pairs", kind="publish", qos=2)
    assert len(pairs_pub) > 50
    assert len(by(records, scenario="pairs", kind="e2e", qos=2)) == len(pairs_pub)
    assert len(by(records, scenario="persistent", kind="e2e", qos=2)) == len(
        by(records, scenario="persistent", kind="publish", qos=2)
    )
    check_run_json(run.results, "r1", ["pairs", "persistent"], processes=1)


@pytest.mark.timeout(60)
def test_nothing_listening_records_failures_without_crashing(tmp_path):
    port = free_port()
    run = run_locust(
        tmp_path,
        f"mqtt://127.0.0.1:{port}",
        "-u", "4", "-r", "4", "-t", "4s", "--processes", "2", "--scenario", "pairs,connect",
    )  # fmt: skip
    assert run.rc == 1, run.output[-3000:]  # Locust's exit code when requests failed
    assert_no_crash(run)
    records = load_run(run.results, "r1", expect_files=2)
    assert records and all(not r["ok"] and r["kind"] == "connect" for r in records)
    assert all("ConnectionRefused" in r["error"] for r in records), records[0]
    # back-off: 4 users x 4 s / 0.5 s, not thousands of refused connects
    assert 8 <= len(records) <= 60, len(records)
    with open(f"{run.csv_prefix}_failures.csv", newline="") as f:
        failures = list(csv.DictReader(f))
    assert failures and all(row["Method"] == "connect" for row in failures)


@pytest.mark.timeout(60)
def test_broker_stopped_mid_run(tmp_path):
    bp = start_fastbroker(tmp_path)
    results = tmp_path / "results"
    csv_prefix = results / "locust" / "r1" / "locust"
    cmd = locust_cmd(
        results, "r1", f"mqtt://{bp.host}:{bp.port}",
        "--headless", "--csv", str(csv_prefix), "-u", "4", "-r", "4", "-t", "9s",
        "--scenario", "pairs", "--qos", "1", "--rate", "20",
    )  # fmt: skip
    out_path = tmp_path / "locust.out"
    with open(out_path, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            time.sleep(4.5)
            bp.stop()
            proc.wait(timeout=40)
        finally:
            _kill_group(proc)
            bp.stop()
    output = out_path.read_text(errors="replace")
    run = SimpleNamespace(rc=proc.returncode, output=output, csv_prefix=csv_prefix)
    assert run.rc == 1, output[-3000:]
    assert_no_crash(run)
    records = load_run(results, "r1", expect_files=1)
    ok_e2e = by(records, kind="e2e", ok=True)
    assert len(ok_e2e) > 50  # before the stop
    failed = [r for r in records if not r["ok"]]
    assert failed, "the stop must show as failures"
    errors = Counter(r["kind"] for r in failed)
    assert errors["connect"] > 0, errors  # reconnect attempts after the stop
    stop_ms = max(r["t_ms"] for r in ok_e2e)
    assert all(r["t_ms"] >= stop_ms - 1000 for r in failed)  # nothing failed while it was up


@pytest.mark.timeout(90)
def test_distributed_master_and_two_workers(tmp_path):
    """Separate master and worker processes; the workers get every custom argument (and the
    generated run id) from the master, so they are started with none of them."""
    bp = start_fastbroker(tmp_path)
    master_port = free_port()
    results = tmp_path / "results"
    csv_prefix = results / "locust" / "dist" / "locust"
    master_cmd = locust_cmd(
        results, None, f"mqtt://{bp.host}:{bp.port}",
        "--headless", "--master", "--master-bind-host", "127.0.0.1",
        "--master-bind-port", str(master_port), "--expect-workers", "2",
        "--csv", str(csv_prefix), "-u", "4", "-r", "4", "-t", "6s",
        "--scenario", "pairs", "--qos", "1", "--rate", "20",
    )  # fmt: skip
    worker_cmd = [
        sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--worker",
        "--master-host", "127.0.0.1", "--master-port", str(master_port),
    ]  # fmt: skip
    procs: list[subprocess.Popen] = []
    try:
        with open(tmp_path / "master.out", "wb") as out:
            master = subprocess.Popen(
                master_cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        procs.append(master)
        for i in range(2):
            with open(tmp_path / f"worker{i}.out", "wb") as out:
                worker = subprocess.Popen(
                    worker_cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            procs.append(worker)
        master.wait(timeout=60)
        for worker in procs[1:]:
            worker.wait(timeout=20)
    finally:
        for proc in procs:
            _kill_group(proc)
        bp.stop()
    output = (tmp_path / "master.out").read_text(errors="replace")
    worker_pids = {p.pid for p in procs[1:]}
    files = raw_files(results)
    assert len(files) == 1, files  # one run id, generated by the master, used by both workers
    (run_id,) = files
    records = load_run(results, run_id, expect_files=2)
    assert {int(r["worker"].rsplit("-", 1)[1]) for r in records} == worker_pids
    run = SimpleNamespace(rc=master.returncode, output=output, csv_prefix=csv_prefix)
    assert_all_ok(records, run)
    assert_no_crash(run)
    assert len(by(records, kind="e2e")) == len(by(records, kind="publish")) > 100
    assert_plausible_e2e(records)
    check_run_json(results, run_id, ["pairs"], processes=2)
