"""The load-test pipeline end to end, as a user runs it (README, "Load tests and dashboards"):
a 20-second Locust run against a real fastbroker (two worker processes, several scenarios),
then the Spark job in local mode, then the dashboard, opened in headless Chromium."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from brokers import start_fastbroker
from test_dashboard import CHARTS, assert_self_contained, render, scan
from test_loadtest import REPO, run_locust

pytestmark = pytest.mark.timeout(300)

SCENARIOS = "pairs,fanin,retained,persistent,connect"


def read(out: Path, table: str) -> list[dict]:
    return pq.read_table(out / table).to_pylist()


def test_locust_then_spark_then_dashboard(tmp_path):
    broker = start_fastbroker(tmp_path)
    try:
        run = run_locust(
            tmp_path,
            f"mqtt://{broker.host}:{broker.port}",
            "-u", "20", "-r", "20", "-t", "20s", "--processes", "2",
            "--scenario", SCENARIOS, "--qos", "1", "--rate", "20",
            run_id="ci-pipeline",
            timeout=120,
        )  # fmt: skip
    finally:
        broker.stop()
    assert run.rc == 0, run.output[-3000:]
    results = run.results
    assert len(list((results / "raw" / "ci-pipeline").glob("records-*.jsonl"))) == 2

    out = tmp_path / "analytics-out"
    spark = subprocess.run(
        [sys.executable, "-m", "spark.aggregate", "--results", str(results), "--out", str(out),
         "--bench-results", str(REPO / "tests" / "fixtures" / "loadtest" / "bench")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )  # fmt: skip
    assert spark.returncode == 0, spark.stderr[-3000:]

    throughput = read(out, "throughput")
    scenarios = {row["scenario"] for row in throughput}
    assert {"pairs", "fanin", "retained", "persistent", "connect"} <= scenarios, scenarios
    e2e = [r for r in throughput if r["kind"] == "e2e"]
    assert e2e and all(r["messages"] > 0 and r["error_rate"] == 0 for r in e2e), e2e
    latency = read(out, "latency")
    for row in latency:
        assert 0 < row["p50"] <= row["p99"] <= row["max"], row
    seconds = [
        r for r in read(out, "timeseries") if r["scenario"] == "pairs" and r["kind"] == "e2e"
    ]
    assert len(seconds) >= 15  # a row per second of a 20 s run
    locust_rows = read(out, "locust")
    assert any(r["name"] == "Aggregated" and r["requests"] > 0 for r in locust_rows)

    page = tmp_path / "dashboard.html"
    dashboard = subprocess.run(
        [sys.executable, "-m", "spark.dashboard", "--input", str(out), "--output", str(page)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dashboard.returncode == 0, dashboard.stderr
    rendered = render(page, tmp_path)
    dom = scan(rendered.dom)
    assert_self_contained(dom)
    assert rendered.script_errors() == []
    # One run: no baseline, so the comparison chart says "no data"; the others draw.
    for chart in (c for c in CHARTS if c != "comparison"):
        plot = dom.plots[f"chart-{chart}"]
        assert plot.main_svgs >= 1 and plot.traces >= 1, chart
    print(
        "\npipeline:",
        json.dumps({"locust_s": round(run.seconds, 1), "rows": len(throughput)}),
    )
