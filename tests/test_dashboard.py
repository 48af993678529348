"""The offline HTML dashboard (spark/dashboard.py), rendered by a real headless Chromium.

The Parquet inputs are written here with pyarrow, following issue 6's contract, with small data
whose answers are known; `python -m spark.dashboard` turns them into a page, and Chromium (with
every network request sent to a dead proxy and every host name unresolvable) loads it from disk
and dumps the DOM after the scripts ran: each chart must have drawn its SVG and its traces there.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_TIMEOUT = 90  # seconds for one page load and DOM dump (usually 1-3 s)
pytestmark = pytest.mark.timeout(240)

# The contract's tables, spelled here independently of spark/dashboard.py so that a drift
# between the two shows up. s string, l long, d double, b bool, t timestamp.
CONTRACT = {
    "throughput": "run_id:s scenario:s node:s qos:l kind:s messages:l failures:l duration_s:d "
    "per_s:d error_rate:d",
    "latency": "run_id:s scenario:s node:s qos:l kind:s count:l p50:d p90:d p99:d p999:d max:d "
    "mean:d",
    "timeseries": "run_id:s scenario:s node:s qos:l kind:s second:t messages:l failures:l p50:d "
    "p99:d",
    "comparison": "run_id:s baseline_run_id:s scenario:s qos:l kind:s metric:s value:d "
    "baseline_value:d ratio:d regression:b",
    "locust": "run_id:s name:s type:s requests:l failures:l median_ms:d p95_ms:d p99_ms:d "
    "avg_ms:d rps:d",
    "bench": "run_id:s scenario:s figure:s fastbroker:d mosquitto:d ratio:d",
    "runs": "run_id:s started:t ended:t host:s users:l processes:l scenarios:s",
}
ARROW_TYPES = {
    "s": pa.string(),
    "l": pa.int64(),
    "d": pa.float64(),
    "b": pa.bool_(),
    "t": pa.timestamp("us", tz="UTC"),
}
SECTIONS = ("runs", "throughput", "latency", "load", "comparison", "percentiles", "locust", "bench")
CHARTS = ("throughput", "latency", "load", "comparison")

# Two runs whose ids sort the other way round from their start times: the page must pick the
# newest by start time.
RUN, BASELINE = "run-a", "run-b"
NODE_A, NODE_B = "127.0.0.1:1883", "127.0.0.1:1884"
T0 = datetime(2026, 11, 23, 11, 0, 0, tzinfo=UTC)
REGRESSION_RGB = "rgb(214, 39, 40)"  # spark.dashboard's REGRESSION_COLOR, #d62728
WITHIN_RGB = "rgb(31, 119, 180)"  # its WITHIN_COLOR, #1f77b4


def schema(name: str) -> pa.Schema:
    fields = [item.split(":") for item in CONTRACT[name].split()]
    return pa.schema([(column, ARROW_TYPES[kind]) for column, kind in fields])


def write_table(out: Path, name: str, rows: list[dict], partition_by_run: bool = False) -> None:
    """A table as Spark leaves it: a directory of part files and a _SUCCESS marker, or
    hive-style run_id=... subdirectories."""
    table = pa.Table.from_pylist(rows, schema=schema(name))
    directory = out / name
    directory.mkdir(parents=True)
    if partition_by_run:
        pq.write_to_dataset(table, directory, partition_cols=["run_id"])
    else:
        pq.write_table(table, directory / "part-00000-0000.snappy.parquet")
    (directory / "_SUCCESS").touch()


def key(scenario: str, node: str, qos: int, kind: str, run: str = RUN) -> dict:
    return {"run_id": run, "scenario": scenario, "node": node, "qos": qos, "kind": kind}


# Per-second rows of the shown run: (scenario, node, qos, kind) -> [(second, messages,
# failures, p50, p99)].
SERIES = {
    ("fan-in", NODE_A, 1, "e2e"): [
        (s, 100 + s, int(s == 2), 2.0 + s / 10, 10.0 + s) for s in range(5)
    ],
    ("fan-in", NODE_B, 1, "e2e"): [(s, 90 + s, 0, 2.5, 11.0) for s in range(5)],
    ("fan-in", NODE_A, 1, "publish"): [(s, 100 + s, 0, 0.5, 1.5) for s in range(5)],
    ("fan-in", NODE_B, 1, "publish"): [(s, 90 + s, 0, 0.6, 1.7) for s in range(5)],
    ("pairs", NODE_A, 0, "e2e"): [(s, 50, 0, 1.0, 3.0) for s in range(5)],
    ("connect-storm", NODE_A, 0, "connect"): [(0, 200, 0, 5.0, 20.0), (2, 100, 0, 6.0, 25.0)],
}
# The run's regressions (red bars and highlighted rows) and non-regressions (blue bars).
COMPARISON = [
    ("fan-in", 1, "e2e", "per_s", 400.0, 600.0, True),
    ("fan-in", 1, "e2e", "p99", 12.345, 12.0, False),
    ("pairs", 0, "e2e", "p50", 1.0, 0.5, True),
    ("pairs", 0, "e2e", "error_rate", 0.015, 0.01, False),
]


def write_full_output(out: Path) -> None:
    timeseries = []
    throughput = []
    latency = []
    for (scenario, node, qos, kind), seconds in SERIES.items():
        for second, messages, failures, p50, p99 in seconds:
            timeseries.append(
                key(scenario, node, qos, kind)
                | {
                    "second": T0 + timedelta(seconds=second),
                    "messages": messages,
                    "failures": failures,
                    "p50": p50,
                    "p99": p99,
                }
            )
        messages = sum(row[1] for row in seconds)
        failures = sum(row[2] for row in seconds)
        throughput.append(
            key(scenario, node, qos, kind)
            | {
                "messages": messages,
                "failures": failures,
                "duration_s": 5.0,
                "per_s": (messages - failures) / 5.0,
                "error_rate": failures / messages,
            }
        )
        p99 = 12.345 if (scenario, node, kind) == ("fan-in", NODE_A, "e2e") else 9.0
        latency.append(
            key(scenario, node, qos, kind)
            | {
                "count": messages - failures,
                "p50": 2.0,
                "p90": 5.0,
                "p99": p99,
                "p999": 30.0,
                "max": 31.0,
                "mean": 2.5,
            }
        )
    # The baseline run has its own scenario: it must not leak into the shown run's charts.
    old = key("old-only", NODE_A, 0, "e2e", run=BASELINE)
    timeseries.append(old | {"second": T0 - timedelta(hours=1), "messages": 7, "failures": 0,
                             "p50": 1.0, "p99": 2.0})  # fmt: skip
    throughput.append(old | {"messages": 7, "failures": 0, "duration_s": 1.0, "per_s": 7.0,
                             "error_rate": 0.0})  # fmt: skip
    latency.append(old | {"count": 7, "p50": 1.0, "p90": 1.5, "p99": 2.0, "p999": 2.0,
                          "max": 2.0, "mean": 1.1})  # fmt: skip
    write_table(out, "timeseries", timeseries)
    write_table(out, "throughput", throughput, partition_by_run=True)
    write_table(out, "latency", latency, partition_by_run=True)
    write_table(
        out,
        "comparison",
        [
            {
                "run_id": RUN,
                "baseline_run_id": BASELINE,
                "scenario": scenario,
                "qos": qos,
                "kind": kind,
                "metric": metric,
                "value": value,
                "baseline_value": baseline,
                "ratio": value / baseline,
                "regression": regression,
            }
            for scenario, qos, kind, metric, value, baseline, regression in COMPARISON
        ],
    )
    write_table(
        out,
        "locust",
        [
            {"run_id": RUN, "name": name, "type": kind, "requests": requests, "failures": failures,
             "median_ms": 2.0, "p95_ms": 8.0, "p99_ms": 12.0, "avg_ms": 2.6, "rps": rps}
            for name, kind, requests, failures, rps in (
                ("fan-in", "e2e", 960, 1, 192.0),
                ("Aggregated", "", 1910, 1, 382.0),
                ("fan-in", "publish", 950, 0, 190.0),
            )
        ],
    )  # fmt: skip
    write_table(
        out,
        "bench",
        [
            {"run_id": "20261123T020739Z-9dbb0cfe", "scenario": "fan-in", "figure": "old_figure",
             "fastbroker": 1.0, "mosquitto": 2.0, "ratio": 0.5},
            {"run_id": "20261123T044750Z-769a833b", "scenario": "fan-in", "figure": "msgs_per_s",
             "fastbroker": 250000.0, "mosquitto": 200000.0, "ratio": 1.25},
        ],
    )  # fmt: skip
    write_table(
        out,
        "runs",
        [
            {"run_id": RUN, "started": T0, "ended": T0 + timedelta(seconds=5),
             "host": "127.0.0.1:1883", "users": 40, "processes": 2,
             "scenarios": "fan-in,pairs,connect-storm"},
            {"run_id": BASELINE, "started": T0 - timedelta(hours=1),
             "ended": T0 - timedelta(minutes=59), "host": "127.0.0.1:1883", "users": 40,
             "processes": 2, "scenarios": "old-only"},
        ],
    )  # fmt: skip


def write_empty_output(out: Path, layout: str) -> None:
    """Every table with no rows: with its schema (what the contract asks of spark.aggregate),
    as a directory holding only _SUCCESS (Spark's empty partitioned write), or absent."""
    out.mkdir(parents=True, exist_ok=True)
    for name in CONTRACT:
        if layout == "schema":
            write_table(out, name, [])
        elif layout == "success-only":
            (out / name).mkdir()
            (out / name / "_SUCCESS").touch()


# --------------------------------------------------------------------------- running things


@dataclass
class Generated:
    html: str
    stderr: str
    seconds: float


def generate(out: Path, page: Path, *args: str, expect: int = 0) -> Generated:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "spark.dashboard", "--input", str(out), "--output", str(page),
         *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )  # fmt: skip
    seconds = time.monotonic() - started
    assert proc.returncode == expect, proc.stderr
    html = page.read_text(encoding="utf-8") if expect == 0 else ""
    return Generated(html, proc.stderr, seconds)


def chromium_binary() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    why = "no chromium binary on PATH (Debian: apt-get install chromium)"
    if os.environ.get("FASTBROKER_REQUIRED") == "1":
        pytest.fail(why)
    pytest.skip(why)


@dataclass
class Rendered:
    dom: str
    log: str
    seconds: float

    def script_errors(self) -> list[str]:
        """The page's uncaught JavaScript errors, from Chromium's console log."""
        return [line for line in self.log.splitlines() if "CONSOLE" in line and "Uncaught" in line]


def render(page: Path, scratch: Path) -> Rendered:
    """Chromium loads the page from disk, runs its scripts (virtual time, so timers finish at
    once) and prints the resulting DOM. No request can leave: every URL goes to a proxy on a
    closed port and no host name resolves."""
    profile = scratch / "chromium-profile"
    profile.mkdir(parents=True, exist_ok=True)
    command = [
        chromium_binary(),
        "--headless",
        "--no-sandbox",  # we are root in CI
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-extensions",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--proxy-server=http://127.0.0.1:9",
        "--proxy-bypass-list=<-loopback>",
        "--host-resolver-rules=MAP * ~NOTFOUND",
        "--enable-logging=stderr",
        "--v=0",
        "--window-size=1280,1024",
        "--virtual-time-budget=10000",
        "--dump-dom",
        page.as_uri(),
    ]
    env = dict(os.environ, HOME=str(scratch))  # nothing lands in the real home
    started = time.monotonic()
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # its own process group: Chromium's helpers go with it
    )
    try:
        dom, log = proc.communicate(timeout=CHROMIUM_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not print the DOM within {CHROMIUM_TIMEOUT} s")
    finally:
        try:  # helpers of ours that outlived the browser process
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    seconds = time.monotonic() - started
    assert proc.returncode == 0, log[-3000:]
    assert "</html>" in dom, log[-3000:]
    return Rendered(dom, log, seconds)


# --------------------------------------------------------------------------- reading HTML

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}  # fmt: skip


@dataclass
class Plot:
    """What Plotly drew inside one chart's div."""

    main_svgs: int = 0
    traces: int = 0
    legend: list[str] = field(default_factory=list)
    bar_fills: list[str] = field(default_factory=list)


class PageScanner(HTMLParser):
    """Plots by div id, external references, rows by class and section notes of a page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[tuple[str, list[str], Plot | None]] = []
        self.plots: dict[str, Plot] = {}
        self.external: list[str] = []
        self.scripts: list[dict[str, str | None]] = []
        self.row_classes: list[str] = []
        self.no_data_sections: list[str] = []
        self.section: str | None = None
        self.main_svgs = 0  # anywhere on the page
        self.text: list[str] = []  # outside scripts and styles

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attributes = dict(attrs)
        classes = (attributes.get("class") or "").split()
        plot = self.stack[-1][2] if self.stack else None
        if "plotly-graph-div" in classes:
            plot = self.plots.setdefault(attributes.get("id") or "", Plot())
        for name in ("src", "href", "data", "srcset", "action"):
            value = (attributes.get(name) or "").strip().lower()
            if value.startswith(("http:", "https:", "//", "ftp:")):
                self.external.append(f"<{tag} {name}={value}>")
        if tag == "link" and "stylesheet" in (attributes.get("rel") or ""):
            self.external.append(f"<link stylesheet {attributes.get('href')}>")
        if tag == "script":
            self.scripts.append(attributes)
        if tag == "section":
            self.section = attributes.get("id")
        if tag == "p" and "no-data" in classes:
            self.no_data_sections.append(self.section or "")
        if tag == "tr":
            self.row_classes.append(attributes.get("class") or "")
        if tag == "svg" and "main-svg" in classes:
            self.main_svgs += 1
        if plot is not None:
            if tag == "svg" and "main-svg" in classes:
                plot.main_svgs += 1
            if tag == "g" and "trace" in classes:
                plot.traces += 1
            parent_classes = self.stack[-1][1] if self.stack else []
            if tag == "path" and "point" in parent_classes:  # a bar of a bar trace
                style = attributes.get("style") or ""
                fill = re.search(r"fill:\s*(rgb\([^)]*\))", style)
                plot.bar_fills.append(fill.group(1) if fill else "")
        if tag not in VOID:
            self.stack.append((tag, classes, plot))

    def handle_endtag(self, tag: str) -> None:
        if tag in VOID:
            return
        for depth in range(len(self.stack) - 1, -1, -1):
            if self.stack[depth][0] == tag:
                del self.stack[depth:]
                return

    def handle_data(self, data: str) -> None:
        if self.stack and "legendtext" in self.stack[-1][1] and self.stack[-1][2] is not None:
            self.stack[-1][2].legend.append(data)
        if self.stack and self.stack[-1][0] == "style":
            # Plotly's injected CSS has url(data:...) icons: only a fetched URL counts.
            for url in re.findall(r"url\(\s*['\"]?([^'\")\s]*)", data):
                if not url.startswith(("data:", "#")):
                    self.external.append(f"css url({url})")
            if "@import" in data:
                self.external.append("css @import")
        if not self.stack or self.stack[-1][0] not in ("script", "style"):
            self.text.append(data)


def scan(text: str) -> PageScanner:
    scanner = PageScanner()
    scanner.feed(text)
    scanner.close()
    return scanner


def assert_self_contained(page: PageScanner) -> None:
    assert page.external == [], f"external references: {page.external}"
    assert all(s.get("src") is None for s in page.scripts), "a <script src=...>: not inline"


# --------------------------------------------------------------------------- tests


def test_every_chart_renders_offline_in_chromium(tmp_path: Path) -> None:
    out = tmp_path / "analytics-out"
    write_full_output(out)
    page_path = tmp_path / "dashboard.html"
    generated = generate(out, page_path)
    size_mb = page_path.stat().st_size / 1e6
    print(f"\ndashboard: {size_mb:.2f} MB, generated in {generated.seconds:.2f} s")

    static = scan(generated.html)
    assert_self_contained(static)
    assert len(static.scripts) >= 1 + len(CHARTS)  # plotly.js inline, then one per chart
    assert set(static.plots) == {f"chart-{c}" for c in CHARTS}
    assert static.no_data_sections == []

    rendered = render(page_path, tmp_path)
    print(f"chromium: DOM dumped in {rendered.seconds:.2f} s")
    dom = scan(rendered.dom)
    assert_self_contained(dom)  # nor did a script add a reference while it ran
    assert rendered.script_errors() == []
    assert set(dom.plots) == {f"chart-{c}" for c in CHARTS}
    for chart, plot in dom.plots.items():
        # Plotly draws a main SVG and a hover layer per chart: none if plotly.js did not run.
        assert plot.main_svgs >= 1, f"{chart} drew no SVG"
        assert plot.traces >= 1, f"{chart} drew no trace"
    assert sum(p.main_svgs for p in dom.plots.values()) >= 2 * len(CHARTS)

    throughput = dom.plots["chart-throughput"]
    assert set(throughput.legend) == {
        "fan-in · e2e",
        "fan-in · e2e failed",  # the one group with a failure
        "fan-in · publish",
        "pairs · e2e",
        "connect-storm · connect",
    }
    assert throughput.traces == 5

    latency = dom.plots["chart-latency"]
    assert latency.traces == 2 * len(SERIES)  # p50 and p99 of each group
    assert f"fan-in · e2e · {NODE_B} · QoS 1 p99" in latency.legend
    assert not any("old-only" in name for name in latency.legend)

    load = dom.plots["chart-load"]
    # Panels e2e (fan-in, pairs), publish (fan-in), connect (connect-storm): 4 bar traces.
    assert load.traces == 4
    assert sorted(load.legend) == ["connect-storm", "fan-in", "pairs"]

    comparison = dom.plots["chart-comparison"]
    regressions = sum(1 for c in COMPARISON if c[-1])
    assert comparison.bar_fills.count(REGRESSION_RGB) == regressions
    assert comparison.bar_fills.count(WITHIN_RGB) == len(COMPARISON) - regressions
    assert dom.row_classes.count("regression") == regressions

    # Tables: the known p99, the newest bench run only, Locust's Aggregated row.
    text = " ".join(dom.text)
    assert "12.345" in text
    assert "1.250\u00d7" in text and "old_figure" not in text
    assert "Aggregated" in text
    assert dom.row_classes.count("selected") == 1


def test_newest_run_by_start_time_and_a_chosen_run_and_baseline(tmp_path: Path) -> None:
    out = tmp_path / "analytics-out"
    write_full_output(out)

    newest = generate(out, tmp_path / "newest.html")
    assert f"<title>fastbroker load test {RUN}</title>" in newest.html
    assert f"baseline: {BASELINE}" in newest.html  # named by the run's comparison rows

    older = generate(out, tmp_path / "older.html", "--run", BASELINE)
    page = scan(older.html)
    assert f"<title>fastbroker load test {BASELINE}</title>" in older.html
    # The baseline run has series of its own and no comparison.
    assert set(page.plots) == {"chart-throughput", "chart-latency", "chart-load"}
    assert page.no_data_sections == ["comparison", "locust"]

    other = generate(out, tmp_path / "other.html", "--run", RUN, "--baseline", "run-z")
    assert "no comparison of run run-a with baseline run-z" in other.html
    assert "chart-comparison" not in scan(other.html).plots

    unknown = generate(out, tmp_path / "unknown.html", "--run", "run-nope", expect=2)
    assert "run-nope" in unknown.stderr and not (tmp_path / "unknown.html").exists()


@pytest.mark.parametrize("layout", ["schema", "success-only", "missing"])
def test_empty_tables_give_a_valid_page_of_notes(tmp_path: Path, layout: str) -> None:
    out = tmp_path / "analytics-out"
    write_empty_output(out, layout)
    page_path = tmp_path / "dashboard.html"
    generated = generate(out, page_path)

    static = scan(generated.html)
    assert_self_contained(static)
    assert static.plots == {}
    assert static.no_data_sections == list(SECTIONS)
    assert "<title>fastbroker load test: no data</title>" in generated.html

    if layout == "schema":  # the same page whatever the layout: Chromium once is enough
        rendered = render(page_path, tmp_path)
        dom = scan(rendered.dom)
        assert rendered.script_errors() == []
        assert dom.plots == {}
        assert dom.no_data_sections == list(SECTIONS)
        assert dom.main_svgs == 0


def test_a_missing_input_directory_is_an_error(tmp_path: Path) -> None:
    result = generate(tmp_path / "nothing-here", tmp_path / "dashboard.html", expect=2)
    assert "nothing-here" in result.stderr and "spark.aggregate" in result.stderr
