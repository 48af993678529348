"""The Spark aggregation job (spark/) on small data with known answers.

One SparkSession serves the whole module (start-up is the slow part); the generated data set
is aggregated once and every table is checked against numpy / hand computations from the same
Python values that were written as records. The subprocess test runs `python -m
spark.aggregate` on the static fixtures in tests/fixtures/loadtest/.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

np = pytest.importorskip("numpy")
pd = pytest.importorskip("pandas")
pytest.importorskip("pyarrow")
pytest.importorskip("pyspark")

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from spark import aggregate as job  # noqa: E402
from spark import readers  # noqa: E402
from spark.session import (  # noqa: E402
    LOCAL_MASTER,
    build_session,
    master_to_set,
    submit_args_conf,
)

FIXTURES = REPO / "tests" / "fixtures" / "loadtest"
pytestmark = pytest.mark.timeout(300)

BASE_RUN = "20260101T000000Z-base"
NEW_RUN = "20260102T000000Z-new"
BASE_START = 1_767_225_600_000.0  # 2026-01-01T00:00:00Z, ms
NEW_START = BASE_START + 86_400_000.0
RUN_MS = 20_000.0
# Stripped from the environment so that the tests run in local mode whatever the machine says.
MASTER_VARIABLES = ("PYSPARK_SUBMIT_ARGS", "MASTER", "SPARK_MASTER", "PYSPARK_GATEWAY_PORT")
NODE1, NODE2 = "10.0.0.1:1883", "10.0.0.2:1883"


@dataclass
class Record:
    run_id: str
    scenario: str
    node: str
    qos: int
    kind: str
    t_ms: float
    latency_ms: float | None
    ok: bool

    def json(self, worker: str) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "scenario": self.scenario,
            "node": self.node,
            "qos": self.qos,
            "kind": self.kind,
            "t_ms": self.t_ms,
            "latency_ms": self.latency_ms,
            "ok": self.ok,
            "error": None if self.ok else "timeout",
            "bytes": 0 if self.kind == "connect" else 64,
            "worker": worker,
        }


def _group(
    rng: Any,
    run_id: str,
    start: float,
    key: tuple[str, str, int, str],
    latencies: Any,
    failures: int,
    pin: bool = False,
) -> list[Record]:
    """Records of one group: the ok ones with `latencies`, then `failures` timeouts, at
    random times within the run; with `pin`, the first two at its very start and end."""
    scenario, node, qos, kind = key
    n = len(latencies) + failures
    times = start + rng.uniform(0.0, RUN_MS, n)
    if pin:
        times[:2] = (start, start + RUN_MS)
    out = [
        Record(run_id, scenario, node, qos, kind, float(t), float(lat), True)
        for t, lat in zip(times, latencies, strict=False)
    ]
    out += [
        Record(run_id, scenario, node, qos, kind, float(t), None, False)
        for t in times[len(latencies) :]
    ]
    return out


FAN_IN_1 = ("fan-in", NODE1, 0, "e2e")
FAN_IN_2 = ("fan-in", NODE2, 0, "e2e")
QOS1 = ("qos1", NODE1, 1, "publish")
QOS2 = ("qos2", NODE2, 2, "publish")
STORM = ("connect-storm", NODE1, 0, "connect")


def generate() -> list[Record]:
    """Two runs. NEW_RUN against BASE_RUN: fan-in e2e (both nodes together) regresses on every
    metric; qos1 publish is unchanged; qos2 publish is 5% slower in throughput, 10% higher in
    latency and has 1 timeout in 191 (from none), all inside the default thresholds; the
    connect storm is in BASE_RUN only."""
    rng = np.random.default_rng(6)
    qos1 = rng.lognormal(0.0, 0.4, 600)
    pattern = np.array([1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 7.0, 11.0])
    base = [
        *_group(rng, BASE_RUN, BASE_START, FAN_IN_1, rng.lognormal(0.5, 0.6, 980), 20),
        *_group(rng, BASE_RUN, BASE_START, FAN_IN_2, rng.lognormal(0.5, 0.6, 490), 10),
        *_group(rng, BASE_RUN, BASE_START, QOS1, qos1, 0),
        *_group(rng, BASE_RUN, BASE_START, QOS2, np.tile(pattern, 20), 0),
        *_group(rng, BASE_RUN, BASE_START, STORM, rng.uniform(5.0, 50.0, 45), 5),
    ]
    # NEW_RUN has no run.json: its duration is the span of its records, pinned to RUN_MS.
    new = [
        *_group(rng, NEW_RUN, NEW_START, FAN_IN_1, rng.lognormal(1.2, 0.6, 665), 35, pin=True),
        *_group(rng, NEW_RUN, NEW_START, FAN_IN_2, rng.lognormal(1.2, 0.6, 285), 15, pin=True),
        *_group(rng, NEW_RUN, NEW_START, QOS1, rng.permutation(qos1), 0, pin=True),
        *_group(rng, NEW_RUN, NEW_START, QOS2, np.tile(pattern * 1.1, 19), 1, pin=True),
    ]
    return base + new


def write_results(root: Path, records: list[Record]) -> None:
    by_run: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_run[r.run_id].append(r)
    for run_id, rows in by_run.items():
        raw = root / "raw" / run_id
        raw.mkdir(parents=True)
        # Two worker files per run, records interleaved between them.
        for w in range(2):
            worker = f"host{w}-{100 + w}"
            lines = [json.dumps(r.json(worker)) for r in rows[w::2]]
            text = "\n".join(lines) + "\n"
            if w == 1 and run_id == NEW_RUN:
                text += '{"run_id": "' + NEW_RUN + '", "scenario": "fan-'  # killed mid-write
            (raw / f"records-{worker}.jsonl").write_text(text)
    run_json = {
        "run_id": BASE_RUN,
        "started_ms": BASE_START,
        "ended_ms": BASE_START + RUN_MS,
        "scenarios": ["fan-in", "qos1", "qos2", "connect-storm"],
        "host": NODE1,
        "users": 40,
        "processes": 2,
        "locust_version": "2.47.0",
    }
    (root / "raw" / BASE_RUN / "run.json").write_text(json.dumps(run_json, indent=2))


def read_table(out: Path, name: str) -> Any:
    return pd.read_parquet(out / name)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    env = {k: v for k, v in os.environ.items() if k not in MASTER_VARIABLES}
    session = build_session("test-spark-jobs", env=env)
    yield session
    session.stop()


@dataclass
class Aggregated:
    records: list[Record]
    out: Path
    outcome: job.Outcome


@pytest.fixture(scope="module")
def aggregated(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Aggregated:
    root = tmp_path_factory.mktemp("spark-jobs")
    records = generate()
    write_results(root / "results", records)
    out = root / "out"
    outcome = job.aggregate(spark, str(root / "results"), str(out))
    return Aggregated(records, out, outcome)


def groups(records: list[Record], keys: tuple[str, ...]) -> dict[tuple[Any, ...], list[Record]]:
    out: dict[tuple[Any, ...], list[Record]] = defaultdict(list)
    for r in records:
        out[tuple(getattr(r, k) for k in keys)].append(r)
    return out


def ok_latencies(rows: list[Record]) -> Any:
    return np.array([r.latency_ms for r in rows if r.ok], dtype=float)


# --------------------------------------------------------------------------- tests


def test_latency_percentiles_are_exact_per_group(aggregated: Aggregated) -> None:
    table = read_table(aggregated.out, "latency")
    expected = groups(aggregated.records, job.GROUP)
    assert len(table) == len(expected)
    for row in table.itertuples(index=False):
        lat = ok_latencies(expected[(row.run_id, row.scenario, row.node, row.qos, row.kind)])
        assert row.count == len(lat)
        # Spark's exact `percentile` interpolates linearly between the closest ranks.
        want = np.percentile(lat, [50, 90, 99, 99.9], method="linear")
        got = [row.p50, row.p90, row.p99, row.p999]
        assert got == pytest.approx(want, rel=1e-12), row
        assert row.max == lat.max()
        assert row.mean == pytest.approx(lat.mean(), rel=1e-12)


def test_throughput_and_error_rates(aggregated: Aggregated) -> None:
    table = read_table(aggregated.out, "throughput").set_index(list(job.GROUP))
    expected = groups(aggregated.records, job.GROUP)
    assert len(table) == len(expected)
    for key, rows in expected.items():
        row = table.loc[key]
        failures = sum(not r.ok for r in rows)
        assert (row.messages, row.failures) == (len(rows), failures)
        # BASE_RUN from its run.json; NEW_RUN (no run.json) from its records' span: both 20 s.
        assert row.duration_s == pytest.approx(20.0)
        assert row.per_s == pytest.approx((len(rows) - failures) / 20.0)
        assert row.error_rate == pytest.approx(failures / len(rows))
    # Spot check by hand: 980 ok + 20 timeouts on node 1 in the base run.
    row = table.loc[(BASE_RUN, *FAN_IN_1)]
    assert (row.messages, row.failures, row.per_s, row.error_rate) == (1000, 20, 49.0, 0.02)


def test_malformed_line_is_dropped(aggregated: Aggregated) -> None:
    table = read_table(aggregated.out, "throughput")
    new = table[table.run_id == NEW_RUN]
    assert int(new.messages.sum()) == sum(r.run_id == NEW_RUN for r in aggregated.records)


def test_timeseries_buckets_by_second(aggregated: Aggregated) -> None:
    table = read_table(aggregated.out, "timeseries")
    buckets: dict[tuple[Any, ...], list[Record]] = defaultdict(list)
    for r in aggregated.records:
        key = (*(getattr(r, k) for k in job.GROUP), math.floor(r.t_ms / 1000.0))
        buckets[key].append(r)
    assert len(table) == len(buckets)
    for row in table.itertuples(index=False):
        second = int(row.second.timestamp())
        assert row.second == pd.Timestamp(second, unit="s", tz="UTC")
        rows = buckets[(row.run_id, row.scenario, row.node, row.qos, row.kind, second)]
        assert (row.messages, row.failures) == (len(rows), sum(not r.ok for r in rows))
        lat = ok_latencies(rows)
        if len(lat):
            want = np.percentile(lat, [50, 99], method="linear")
            assert [row.p50, row.p99] == pytest.approx(want, rel=1e-12)
        else:
            assert math.isnan(row.p50) and math.isnan(row.p99)
    assert int(table.messages.sum()) == len(aggregated.records)


def test_comparison_flags_regressions_only(aggregated: Aggregated) -> None:
    assert aggregated.outcome.runs == [BASE_RUN, NEW_RUN]
    assert aggregated.outcome.baseline == BASE_RUN
    table = read_table(aggregated.out, "comparison")
    assert set(table.run_id) == {NEW_RUN} and set(table.baseline_run_id) == {BASE_RUN}
    # The connect storm ran in the base run only: nothing to compare.
    assert set(table.scenario) == {"fan-in", "qos1", "qos2"}
    assert len(table) == 3 * 4
    flagged = {(r.scenario, r.metric) for r in table.itertuples() if r.regression}
    assert flagged == {("fan-in", m) for m in ("per_s", "p50", "p99", "error_rate")}
    by = table.set_index(["scenario", "metric"])
    # Across nodes from the raw rows (not an average of the per-node percentiles).
    compare = groups(aggregated.records, job.COMPARE_GROUP)
    for run, column in ((NEW_RUN, "value"), (BASE_RUN, "baseline_value")):
        lat = ok_latencies(compare[(run, "fan-in", 0, "e2e")])
        assert by.loc[("fan-in", "p99"), column] == pytest.approx(
            np.percentile(lat, 99, method="linear"), rel=1e-12
        )
    assert by.loc[("fan-in", "per_s"), "value"] == pytest.approx(950 / 20)
    assert by.loc[("fan-in", "per_s"), "baseline_value"] == pytest.approx(1470 / 20)
    assert by.loc[("fan-in", "error_rate"), "value"] == pytest.approx(50 / 1000)
    # qos2: 5% fewer messages, 10% higher latency, 0.5 points more errors: inside the
    # thresholds (10% and 20% relative, 1 point absolute).
    assert by.loc[("qos2", "per_s"), "ratio"] == pytest.approx(0.95)
    assert by.loc[("qos2", "p50"), "ratio"] == pytest.approx(1.1)
    assert by.loc[("qos1", "p99"), "ratio"] == pytest.approx(1.0)
    assert by.loc[("qos2", "error_rate"), "value"] == pytest.approx(1 / 191)
    assert math.isnan(by.loc[("qos1", "error_rate"), "ratio"])  # 0 / 0: no ratio


def _comparison(spark: Any, aggregated: Aggregated, baseline: str, thresholds: Any) -> list[Any]:
    """The comparison rows from comparison_table alone (no files written)."""
    results = str(aggregated.out.parent / "results")
    records = readers.read_records(spark, results)
    info = job.run_info(records, readers.read_run_files(spark, results))
    return job.comparison_table(records, info, baseline, thresholds).collect()


def test_tighter_thresholds_flag_the_smaller_changes(spark: Any, aggregated: Aggregated) -> None:
    thresholds = job.Thresholds(throughput=0.04, latency=0.05)
    rows = _comparison(spark, aggregated, BASE_RUN, thresholds)
    flagged = {(r.scenario, r.metric) for r in rows if r.regression and r.scenario != "fan-in"}
    assert flagged == {("qos2", "per_s"), ("qos2", "p50"), ("qos2", "p99")}


def test_baseline_choice() -> None:
    assert job.choose_baseline([], None) is None
    assert job.choose_baseline(["a"], None) is None
    assert job.choose_baseline(["a", "b", "c"], None) == "a"
    assert job.choose_baseline(["a", "b", "c"], "b") == "b"
    with pytest.raises(job.BaselineError):
        job.choose_baseline(["a", "b"], "zzz")


def test_explicit_baseline_compares_the_others_with_it(spark: Any, aggregated: Aggregated) -> None:
    rows = _comparison(spark, aggregated, NEW_RUN, job.Thresholds())
    assert {(r.run_id, r.baseline_run_id) for r in rows} == {(BASE_RUN, NEW_RUN)}
    assert len(rows) == 3 * 4
    # Against the slower run with the higher latencies, the base run is better everywhere.
    assert not any(r.regression for r in rows)
    fan_in = {r.metric: r.ratio for r in rows if r.scenario == "fan-in"}
    assert fan_in["per_s"] == pytest.approx(1470 / 950)


def test_empty_inputs_write_every_table_with_its_schema(spark: Any, tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    (tmp_path / "results").mkdir()
    outcome = job.aggregate(
        spark, str(tmp_path / "results"), str(tmp_path / "out"), str(tmp_path / "no-bench")
    )
    assert (outcome.runs, outcome.baseline, outcome.regressions) == ([], None, [])
    expected = {
        "throughput": job.THROUGHPUT_SCHEMA,
        "latency": job.LATENCY_SCHEMA,
        "timeseries": job.TIMESERIES_SCHEMA,
        "comparison": job.COMPARISON_SCHEMA,
        "runs": job.RUNS_SCHEMA,
    }
    for name in job.TABLES:
        table = pq.read_table(tmp_path / "out" / name)
        assert table.num_rows == 0, name
        if name in expected:
            assert table.column_names == expected[name].names, name
    assert pq.read_table(tmp_path / "out" / "locust").column_names == [
        "run_id", "name", "type", "requests", "failures",
        "median_ms", "p95_ms", "p99_ms", "avg_ms", "rps",
    ]  # fmt: skip
    assert pq.read_table(tmp_path / "out" / "bench").column_names == [
        "run_id", "scenario", "figure", "fastbroker", "mosquitto", "ratio",
    ]  # fmt: skip


def test_master_is_local_only_when_none_is_configured(tmp_path: Path) -> None:
    bare = {"SPARK_CONF_DIR": str(tmp_path)}  # no spark-defaults.conf there
    assert master_to_set(env=bare) == LOCAL_MASTER
    assert master_to_set(env={**bare, "PYSPARK_GATEWAY_PORT": "4321"}) is None  # spark-submit
    assert master_to_set(env={**bare, "PYSPARK_SUBMIT_ARGS": "--master yarn pyspark-shell"}) is None
    assert master_to_set(env={**bare, "MASTER": "spark://h:7077"}) is None
    submit_args = "--conf spark.master=yarn --driver-java-options '-Da -Db' pyspark-shell"
    assert master_to_set(env={**bare, "PYSPARK_SUBMIT_ARGS": submit_args}) is None
    assert submit_args_conf({"PYSPARK_SUBMIT_ARGS": submit_args}) == {
        "spark.master": "yarn",
        "spark.driver.extraJavaOptions": "-Da -Db",
    }
    assert master_to_set(env={**bare, "SPARK_MASTER": "spark://h:7077"}) == "spark://h:7077"
    assert master_to_set({"spark.master": "local[2]"}, env=bare) == "local[2]"
    (tmp_path / "spark-defaults.conf").write_text("# cluster\nspark.master  spark://h:7077\n")
    assert master_to_set(env=bare) is None


def test_session_is_local_with_few_shuffle_partitions(spark: Any) -> None:
    assert spark.sparkContext.master == LOCAL_MASTER
    assert spark.conf.get("spark.sql.shuffle.partitions") == "4"
    assert spark.conf.get("spark.sql.session.timeZone") == "UTC"
    # Set on every master, so that the cached aggregates' partitions coalesce on a cluster too.
    assert spark.conf.get("spark.sql.optimizer.canChangeCachedPlanOutputPartitioning") == "true"


def test_cli_on_fixtures(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in MASTER_VARIABLES}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "spark.aggregate",
            "--results",
            str(FIXTURES / "results"),
            "--bench-results",
            str(FIXTURES / "bench"),
            "--out",
            str(out),
            "--fail-on-regression",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "baseline: run-1" in proc.stdout
    flagged = {
        line.split()[5].rstrip(":") for line in proc.stdout.splitlines() if "REGRESSION" in line
    }
    assert flagged == {"per_s", "p50", "p99", "error_rate"}

    # run-1: latencies 1..4 in 4 s; run-2: 2, 4, 6 and a timeout over two nodes in 4 s.
    thr = read_table(out, "throughput").set_index(["run_id", "node"])
    assert thr.loc[("run-1", "127.0.0.1:1883"), "per_s"] == 1.0
    assert thr.loc[("run-2", "127.0.0.2:1883"), "error_rate"] == 0.5
    lat = read_table(out, "latency").set_index(["run_id", "node"])
    assert lat.loc[("run-1", "127.0.0.1:1883"), "p50"] == 2.5
    cmp_ = read_table(out, "comparison").set_index("metric")
    assert cmp_.loc["per_s", "value"] == 0.75 and cmp_.loc["per_s", "baseline_value"] == 1.0
    assert cmp_.loc["p50", "value"] == 4.0 and cmp_.loc["p50", "baseline_value"] == 2.5

    locust = read_table(out, "locust").set_index(["type", "name"])
    assert len(locust) == 4
    agg = locust.loc[("", "Aggregated")]
    assert (agg.run_id, agg.requests, agg.failures, agg.rps) == ("run-1", 8, 1, 2.0)
    assert (agg.median_ms, agg.p95_ms, agg.p99_ms, agg.avg_ms) == (1.0, 4.0, 4.0, 1.875)
    idle = locust.loc[("subscribe", "pairs")]
    assert idle.requests == 0 and math.isnan(idle.p95_ms) and math.isnan(idle.median_ms)

    bench = read_table(out, "bench").set_index(["run_id", "scenario", "figure"])
    assert len(bench) == 3  # the summary's two rows, then the summary-less run's one
    row = bench.loc[("20260101T000000Z-aaaaaaaa", "latency", "p50_us")]
    assert (row.fastbroker, row.mosquitto, row.ratio) == (48.0, 45.5, 1.05)
    assert math.isnan(bench.loc[("20260101T000000Z-aaaaaaaa", "loopback", "mb_per_s")].ratio)
    row = bench.loc[("20260102T000000Z-bbbbbbbb", "fan-in", "delivered_per_s")]
    assert (row.fastbroker, row.mosquitto, row.ratio) == (110.0, 65.0, 1.75)

    runs = read_table(out, "runs").set_index("run_id")
    assert list(runs.index.sort_values()) == ["run-1", "run-2"]
    r1 = runs.loc["run-1"]
    assert r1.started == pd.Timestamp("2026-01-01T00:00:00Z")
    assert r1.ended == pd.Timestamp("2026-01-01T00:00:04Z")
    assert (r1.host, r1.users, r1.processes, r1.scenarios) == ("127.0.0.1:1883", 4, 2, "pairs")


def test_spark_submit_runs_the_same_file_with_its_master(tmp_path: Path) -> None:
    """Unchanged under spark-submit: the master given there is the one used (never local[*])."""
    submit = Path(sys.executable).parent / "spark-submit"
    if not submit.exists():
        submit = Path(shutil.which("spark-submit") or "spark-submit")
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in MASTER_VARIABLES}
    proc = subprocess.run(
        [str(submit), "--master", "local[2]", str(REPO / "spark" / "aggregate.py"),
         "--results", str(FIXTURES / "results"), "--out", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "master: local[2]" in proc.stdout
    assert read_table(out, "throughput").shape[0] > 0
