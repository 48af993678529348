"""One self-contained HTML dashboard from the analytics Parquet tables, readable offline.

    python -m spark.dashboard --input analytics-out --output dashboard.html \\
        [--run RUN_ID] [--baseline RUN_ID]

Reads the tables that `spark.aggregate` writes (throughput, latency, timeseries, comparison,
locust, bench, runs; plain or partitioned Parquet directories) with pyarrow and pandas: no Spark,
so it takes about a second. Writes ONE HTML file with plotly.js inlined: no CDN and no other
file, so it opens from disk on a machine with no network.

The page shows one run (default: the newest) against one baseline (default: the one its
comparison rows name): throughput and latency percentiles per second, load per node, run versus
baseline with regressions in red, and tables of percentiles and error rates, Locust's stats and
the benchmark ratios. A table with no rows gives a "no data" note in place of its chart.
"""

from __future__ import annotations

import argparse
import html
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import pyarrow.dataset as ds
from plotly.colors import qualitative
from plotly.offline import get_plotlyjs
from plotly.subplots import make_subplots

# --------------------------------------------------------------------------- the contract

STRING, LONG, DOUBLE, BOOL, TIMESTAMP = "string", "long", "double", "bool", "timestamp"

# Column types of the tables spark.aggregate writes (issue 6's contract). Reading conforms every
# table to these, so a missing table, an empty one, or a partition column pyarrow typed on its
# own all look the same to the charts.
SCHEMAS: dict[str, dict[str, str]] = {
    "throughput": {
        "run_id": STRING,
        "scenario": STRING,
        "node": STRING,
        "qos": LONG,
        "kind": STRING,
        "messages": LONG,
        "failures": LONG,
        "duration_s": DOUBLE,
        "per_s": DOUBLE,
        "error_rate": DOUBLE,
    },
    "latency": {
        "run_id": STRING,
        "scenario": STRING,
        "node": STRING,
        "qos": LONG,
        "kind": STRING,
        "count": LONG,
        "p50": DOUBLE,
        "p90": DOUBLE,
        "p99": DOUBLE,
        "p999": DOUBLE,
        "max": DOUBLE,
        "mean": DOUBLE,
    },
    "timeseries": {
        "run_id": STRING,
        "scenario": STRING,
        "node": STRING,
        "qos": LONG,
        "kind": STRING,
        "second": TIMESTAMP,
        "messages": LONG,
        "failures": LONG,
        "p50": DOUBLE,
        "p99": DOUBLE,
    },
    "comparison": {
        "run_id": STRING,
        "baseline_run_id": STRING,
        "scenario": STRING,
        "qos": LONG,
        "kind": STRING,
        "metric": STRING,
        "value": DOUBLE,
        "baseline_value": DOUBLE,
        "ratio": DOUBLE,
        "regression": BOOL,
    },
    "locust": {
        "run_id": STRING,
        "name": STRING,
        "type": STRING,
        "requests": LONG,
        "failures": LONG,
        "median_ms": DOUBLE,
        "p95_ms": DOUBLE,
        "p99_ms": DOUBLE,
        "avg_ms": DOUBLE,
        "rps": DOUBLE,
    },
    "bench": {
        "run_id": STRING,
        "scenario": STRING,
        "figure": STRING,
        "fastbroker": DOUBLE,
        "mosquitto": DOUBLE,
        "ratio": DOUBLE,
    },
    "runs": {
        "run_id": STRING,
        "started": TIMESTAMP,
        "ended": TIMESTAMP,
        "host": STRING,
        "users": LONG,
        "processes": LONG,
        "scenarios": STRING,
    },
}

KIND_ORDER = ("e2e", "publish", "connect", "subscribe")
METRIC_ORDER = ("per_s", "p50", "p99", "error_rate")
METRIC_TITLES = {
    "per_s": "throughput, higher is better",
    "p50": "latency p50, lower is better",
    "p99": "latency p99, lower is better",
    "error_rate": "error rate, lower is better",
}
REGRESSION_COLOR = "#d62728"
WITHIN_COLOR = "#1f77b4"
PALETTE = qualitative.Dark24
# No Plotly logo link (the page must not point outside); the rest of the mode bar works offline.
PLOT_CONFIG = {"displaylogo": False, "responsive": True}
# A throughput line is filled with zeros between its first and last second (a second with no
# record is a second in which nothing completed), unless the span is implausibly long.
MAX_FILLED_SECONDS = 86_400


class DashboardError(Exception):
    """A request the data cannot answer (e.g. a run that is in none of the tables)."""


# --------------------------------------------------------------------------- reading


def _conform_column(values: pd.Series, kind: str) -> pd.Series:
    if kind == STRING:
        # Plain objects, not pandas' string dtype: comparisons then give plain booleans.
        return values.astype(object).map(lambda v: None if _missing(v) else str(v))
    if kind == LONG:
        return pd.to_numeric(values, errors="coerce").round().astype("Int64")
    if kind == DOUBLE:
        return pd.to_numeric(values, errors="coerce").astype("float64")
    if kind == BOOL:
        return values.astype(object).map(lambda v: None if _missing(v) else bool(v))
    # Spark writes UTC instants (INT96 or tz-aware): shown as naive UTC, labelled so.
    return pd.to_datetime(values, utc=True, errors="coerce").dt.tz_localize(None)


def conform(frame: pd.DataFrame, schema: dict[str, str]) -> pd.DataFrame:
    """The contract's columns with the contract's types, in order; missing ones all null."""
    columns = {}
    for column, kind in schema.items():
        values = (
            frame[column]
            if column in frame.columns
            else pd.Series([None] * len(frame), index=frame.index, dtype=object)
        )
        columns[column] = _conform_column(values, kind)
    return pd.DataFrame(columns, index=frame.index).reset_index(drop=True)


def read_table(out_dir: Path, name: str) -> pd.DataFrame:
    """One contract table from OUT/NAME (Spark's directory of part files, partitioned by any
    column hive-style or not; `_SUCCESS` and dot files are skipped). A missing table reads as
    an empty one."""
    schema = SCHEMAS[name]
    path = out_dir / name
    if not path.exists():
        return conform(pd.DataFrame(), schema)
    dataset = ds.dataset(path, format="parquet", partitioning="hive")
    return conform(dataset.to_table().to_pandas(), schema)


def load_tables(out_dir: Path) -> dict[str, pd.DataFrame]:
    if not out_dir.is_dir():
        raise DashboardError(f"{out_dir} is not a directory (run spark.aggregate first)")
    return {name: read_table(out_dir, name) for name in SCHEMAS}


# --------------------------------------------------------------------------- choosing runs


def run_ids(tables: dict[str, pd.DataFrame]) -> list[str]:
    """Every run in the tables, oldest first: by start time where run.json gave one, else (and
    before those) by id, which starts with a timestamp."""
    runs = tables["runs"].dropna(subset=["run_id"])
    timed = runs.sort_values(["started", "run_id"], na_position="first")["run_id"].tolist()
    seen: set[str] = set()
    for name in ("throughput", "latency", "timeseries", "comparison", "locust"):
        seen.update(tables[name]["run_id"].dropna())
    untimed = sorted(seen - set(timed))
    return list(dict.fromkeys([*untimed, *timed]))


def choose_run(tables: dict[str, pd.DataFrame], requested: str | None) -> str | None:
    known = run_ids(tables)
    if requested is None:
        return known[-1] if known else None
    if requested not in known:
        listed = ", ".join(known[-10:]) or "none"
        raise DashboardError(f"run {requested!r} is in no table (runs: {listed})")
    return requested


def choose_baseline(
    tables: dict[str, pd.DataFrame], run: str | None, requested: str | None
) -> str | None:
    """The requested baseline, else the one the run's comparison rows name."""
    if requested is not None or run is None:
        return requested
    comparison = tables["comparison"]
    named = sorted(set(comparison.loc[comparison["run_id"] == run, "baseline_run_id"].dropna()))
    return named[0] if named else None


def for_run(frame: pd.DataFrame, run: str | None) -> pd.DataFrame:
    return frame[frame["run_id"] == run].reset_index(drop=True)


# --------------------------------------------------------------------------- formatting


MISSING = "\u2013"  # an en dash in an empty cell
TIMES = "\u00d7"  # the multiplication sign after a ratio


def _missing(value: Any) -> bool:
    try:
        return bool(pd.isna(value))
    except (TypeError, ValueError):
        return False


def fmt_text(value: Any) -> str:
    return MISSING if _missing(value) else str(value)


def fmt_int(value: Any) -> str:
    return MISSING if _missing(value) else f"{int(value):,}"


def fmt_num(value: Any) -> str:
    if _missing(value):
        return MISSING
    number = float(value)
    if math.isinf(number):
        return "∞" if number > 0 else "-∞"
    magnitude = abs(number)
    if magnitude >= 1000:
        return f"{number:,.0f}"
    if magnitude >= 1:
        return f"{number:,.2f}"
    return f"{number:.3g}"


def fmt_ms(value: Any) -> str:
    if _missing(value):
        return MISSING
    number = float(value)
    return f"{number:,.3f}" if abs(number) < 100 else f"{number:,.1f}"


def fmt_rate(value: Any) -> str:
    return MISSING if _missing(value) else f"{100 * float(value):.2f}%"


def fmt_ratio(value: Any) -> str:
    if _missing(value):
        return MISSING
    number = float(value)
    return "∞" if math.isinf(number) else f"{number:.3f}{TIMES}"


def fmt_time(value: Any) -> str:
    return MISSING if _missing(value) else pd.Timestamp(value).strftime("%Y-%m-%d %H:%M:%S")


def fmt_bool(value: Any) -> str:
    return MISSING if _missing(value) else ("yes" if value else "no")


def fmt_qos(value: Any) -> str:
    return "QoS ?" if _missing(value) else f"QoS {int(value)}"


def fmt_preformatted(value: Any) -> str:
    """A number formatted beforehand (its format depends on the row), right-aligned."""
    return fmt_text(value)


Column = tuple[str, str, Callable[[Any], str]]  # frame column, header, formatter


def html_table(
    frame: pd.DataFrame,
    columns: Sequence[Column],
    row_class: Callable[[pd.Series], str | None] | None = None,
) -> str:
    head = "".join(f"<th>{html.escape(header)}</th>" for _, header, _ in columns)
    rows = []
    for _, row in frame.iterrows():
        cls = row_class(row) if row_class else None
        attr = f' class="{cls}"' if cls else ""
        cells = "".join(
            f'<td class="{"num" if fmt is not fmt_text else "text"}">'
            f"{html.escape(fmt(row[column]))}</td>"
            for column, _, fmt in columns
        )
        rows.append(f"<tr{attr}>{cells}</tr>")
    return (
        f'<div class="table-wrap"><table><thead><tr>{head}</tr></thead>'
        f"<tbody>{''.join(rows)}</tbody></table></div>"
    )


def no_data(text: str) -> str:
    return f'<p class="no-data">No data: {html.escape(text)}</p>'


# --------------------------------------------------------------------------- charts


def _labelled(frame: pd.DataFrame) -> pd.DataFrame:
    """Null grouping keys get a visible placeholder (groupby would drop their rows)."""
    fills = {c: "(none)" for c in ("scenario", "node", "kind") if c in frame.columns}
    out = frame.copy()
    for column, fill in fills.items():
        out[column] = out[column].map(lambda v, f=fill: f if v is None else v)
    if "qos" in out.columns:
        out["qos"] = out["qos"].fillna(-1)
    return out


def _kind_key(kind: str) -> tuple[int, str]:
    return (KIND_ORDER.index(kind) if kind in KIND_ORDER else len(KIND_ORDER), kind)


def _colors(keys: Iterable[Any]) -> dict[Any, str]:
    return {key: PALETTE[i % len(PALETTE)] for i, key in enumerate(keys)}


def _base_layout(fig: go.Figure, height: int) -> None:
    fig.update_layout(
        template="plotly_white",
        height=height,
        margin={"l": 70, "r": 20, "t": 40, "b": 50},
        legend={"orientation": "v", "font": {"size": 11}},
        hovermode="closest",
    )


def _filled_seconds(series: pd.DataFrame) -> pd.DataFrame:
    series = series.set_index("second").sort_index()
    span = (series.index.max() - series.index.min()).total_seconds()
    if len(series) < 2 or span > MAX_FILLED_SECONDS:
        return series.reset_index()
    full = pd.date_range(series.index.min(), series.index.max(), freq="1s")
    if not series.index.isin(full).all():  # not whole seconds: leave the points as they are
        return series.reset_index()
    return series.reindex(full, fill_value=0).rename_axis("second").reset_index()


def throughput_chart(timeseries: pd.DataFrame) -> go.Figure | None:
    """Completed (ok) records per second, one line per scenario and kind, summed over nodes
    and QoS; failures per second dotted where there are any."""
    rows = _labelled(timeseries.dropna(subset=["second"]))
    if rows.empty:
        return None
    rows["ok"] = rows["messages"].fillna(0) - rows["failures"].fillna(0)
    rows["failed"] = rows["failures"].fillna(0)
    sums = rows.groupby(["scenario", "kind", "second"])[["ok", "failed"]].sum().reset_index()
    keys = sorted(
        {(s, k) for s, k in zip(sums["scenario"], sums["kind"], strict=True)},
        key=lambda sk: (sk[0], _kind_key(sk[1])),
    )
    colors = _colors(keys)
    fig = go.Figure()
    for scenario, kind in keys:
        one = sums[(sums["scenario"] == scenario) & (sums["kind"] == kind)]
        one = _filled_seconds(one[["second", "ok", "failed"]])
        name = f"{scenario} · {kind}"
        fig.add_trace(
            go.Scatter(
                x=one["second"],
                y=one["ok"].astype(float),
                mode="lines+markers",
                marker={"size": 4},
                name=name,
                legendgroup=name,
                line={"color": colors[(scenario, kind)]},
                hovertemplate=f"{html.escape(name)}<br>%{{x}}<br>%{{y:,}} ok/s<extra></extra>",
            )
        )
        if one["failed"].sum() > 0:
            fig.add_trace(
                go.Scatter(
                    x=one["second"],
                    y=one["failed"].astype(float),
                    mode="lines",
                    name=f"{name} failed",
                    legendgroup=name,
                    line={"color": colors[(scenario, kind)], "dash": "dot"},
                    hovertemplate=(
                        f"{html.escape(name)}<br>%{{x}}<br>%{{y:,}} failed/s<extra></extra>"
                    ),
                )
            )
    _base_layout(fig, 440)
    fig.update_xaxes(title_text="time (UTC)")
    fig.update_yaxes(title_text="records completed per second", rangemode="tozero")
    return fig


def _varying_label(row: pd.Series, parts: Sequence[str]) -> str:
    labels = {
        "scenario": str(row["scenario"]),
        "kind": str(row["kind"]),
        "node": str(row["node"]),
        "qos": fmt_qos(None if row["qos"] < 0 else row["qos"]),
    }
    return " · ".join(labels[p] for p in parts)


def _log_toggle() -> list[dict[str, Any]]:
    # Latency tails span decades: a log axis at one click, computed by plotly.js in the page.
    return [
        {
            "type": "buttons",
            "direction": "left",
            "x": 0,
            "y": 1.12,
            "xanchor": "left",
            "showactive": True,
            "buttons": [
                {"label": "linear", "method": "relayout", "args": [{"yaxis.type": "linear"}]},
                {"label": "log", "method": "relayout", "args": [{"yaxis.type": "log"}]},
            ],
        }
    ]


def latency_chart(timeseries: pd.DataFrame) -> go.Figure | None:
    """p50 (solid) and p99 (dashed) per second for each scenario x kind x node x QoS group:
    percentiles of different groups cannot be merged, so each group keeps its own line."""
    rows = _labelled(timeseries.dropna(subset=["second"]))
    rows = rows[rows["p50"].notna() | rows["p99"].notna()]
    if rows.empty:
        return None
    group_cols = ["scenario", "kind", "node", "qos"]
    # Only the parts that tell groups apart go into the names.
    parts = ["scenario", "kind"] + [c for c in ("node", "qos") if rows[c].nunique() > 1]
    groups = dict(list(rows.groupby(group_cols, sort=False)))
    keys = sorted(groups, key=lambda g: (g[0], _kind_key(g[1]), g[2], g[3]))
    colors = _colors(keys)
    fig = go.Figure()
    for key in keys:
        one = groups[key].sort_values("second")
        name = _varying_label(one.iloc[0], parts)
        for column, dash in (("p50", "solid"), ("p99", "dash")):
            fig.add_trace(
                go.Scatter(
                    x=one["second"],
                    y=one[column],
                    mode="lines",
                    name=f"{name} {column}",
                    legendgroup=name,
                    line={"color": colors[key], "dash": dash},
                    connectgaps=False,
                    hovertemplate=(
                        f"{html.escape(name)} {column}<br>%{{x}}<br>%{{y:.3f}} ms<extra></extra>"
                    ),
                )
            )
    _base_layout(fig, 460)
    fig.update_layout(updatemenus=_log_toggle(), margin={"t": 70})
    fig.update_xaxes(title_text="time (UTC)")
    fig.update_yaxes(title_text="latency (ms)")
    return fig


def load_chart(throughput: pd.DataFrame) -> go.Figure | None:
    """Records per broker node, stacked by scenario: one panel per kind, since a received
    message, a publish and a connection are different units."""
    rows = _labelled(throughput)
    if rows.empty:
        return None
    kinds = sorted(rows["kind"].unique(), key=_kind_key)
    scenarios = sorted(rows["scenario"].unique())
    colors = _colors(scenarios)
    fig = make_subplots(
        rows=len(kinds),
        cols=1,
        subplot_titles=[f"{kind}: records per node" for kind in kinds],
        vertical_spacing=min(0.12, 0.3 / len(kinds)),
    )
    shown: set[str] = set()
    for index, kind in enumerate(kinds, start=1):
        of_kind = rows[rows["kind"] == kind]
        sums = of_kind.groupby(["scenario", "node"])[["messages", "failures"]].sum().reset_index()
        for scenario in scenarios:
            one = sums[sums["scenario"] == scenario].sort_values("node")
            if one.empty:
                continue
            fig.add_trace(
                go.Bar(
                    x=one["node"],
                    y=one["messages"].astype(float),
                    customdata=one["failures"].astype(float),
                    name=scenario,
                    legendgroup=scenario,
                    showlegend=scenario not in shown,
                    marker={"color": colors[scenario]},
                    hovertemplate=(
                        f"{html.escape(scenario)} · {html.escape(kind)}<br>%{{x}}<br>"
                        "%{y:,} records (%{customdata:,} failed)<extra></extra>"
                    ),
                ),
                row=index,
                col=1,
            )
            shown.add(scenario)
        fig.update_yaxes(title_text="records", row=index, col=1)
    _base_layout(fig, 120 + 260 * len(kinds))
    fig.update_layout(barmode="stack")
    return fig


def comparison_rows(
    comparison: pd.DataFrame, run: str | None, baseline: str | None
) -> pd.DataFrame:
    rows = comparison[(comparison["run_id"] == run) & (comparison["baseline_run_id"] == baseline)]
    return _labelled(rows).reset_index(drop=True)


def comparison_chart(rows: pd.DataFrame) -> go.Figure | None:
    """Run against baseline per scenario x QoS x kind, one panel per metric: run / baseline for
    throughput and latency (dashed line at 1), run - baseline in percentage points for the
    error rate (a ratio to a zero baseline says nothing). Red bars: the rows spark.aggregate
    flagged as regressions, by its thresholds."""
    if rows.empty:
        return None
    metrics = sorted(
        rows["metric"].unique(),
        key=lambda m: (METRIC_ORDER.index(m) if m in METRIC_ORDER else len(METRIC_ORDER), m),
    )
    fig = make_subplots(
        rows=len(metrics),
        cols=1,
        subplot_titles=[f"{METRIC_TITLES.get(m, m)} ({m})" for m in metrics],
        vertical_spacing=min(0.12, 0.35 / len(metrics)),
    )
    shown: set[bool] = set()
    for index, metric in enumerate(metrics, start=1):
        of_metric = rows[rows["metric"] == metric].copy()
        of_metric["label"] = [
            f"{s} · {fmt_qos(None if q < 0 else q)} · {k}"
            for s, q, k in zip(
                of_metric["scenario"], of_metric["qos"], of_metric["kind"], strict=True
            )
        ]
        of_metric = of_metric.sort_values("label")
        order = of_metric["label"].tolist()  # one category order for both traces of the panel
        as_points = metric == "error_rate"
        if as_points:
            shown_value = 100 * (of_metric["value"] - of_metric["baseline_value"])
            axis_title, reference, y_format = "run - baseline (points)", 0.0, "+.2f"
        else:
            shown_value = of_metric["ratio"]
            axis_title, reference, y_format = "run / baseline", 1.0, ".3f"
        of_metric["shown"] = shown_value.where(~shown_value.isin([math.inf, -math.inf]))
        flagged = of_metric["regression"].map(lambda v: bool(v) if v is not None else False)
        for regression in (False, True):
            part = of_metric[flagged == regression]
            if part.empty:
                continue
            fig.add_trace(
                go.Bar(
                    x=part["label"],
                    y=part["shown"],
                    customdata=part[["value", "baseline_value"]].to_numpy(dtype=float),
                    name="regression" if regression else "within threshold",
                    legendgroup=str(regression),
                    showlegend=regression not in shown,
                    marker={"color": REGRESSION_COLOR if regression else WITHIN_COLOR},
                    hovertemplate=(
                        f"{html.escape(metric)} · %{{x}}<br>{axis_title} %{{y:{y_format}}}<br>"
                        "run %{customdata[0]:.4g}, baseline %{customdata[1]:.4g}<extra></extra>"
                    ),
                ),
                row=index,
                col=1,
            )
            shown.add(regression)
        fig.update_xaxes(categoryorder="array", categoryarray=order, row=index, col=1)
        fig.update_yaxes(
            title_text=axis_title, rangemode="normal" if as_points else "tozero", row=index, col=1
        )
        fig.add_hline(y=reference, line_dash="dash", line_color="#555", row=index, col=1)
    _base_layout(fig, 120 + 280 * len(metrics))
    fig.update_layout(barmode="overlay")
    return fig


# --------------------------------------------------------------------------- tables

LATENCY_COLUMNS: list[Column] = [
    ("scenario", "scenario", fmt_text),
    ("node", "node", fmt_text),
    ("qos", "QoS", fmt_int),
    ("kind", "kind", fmt_text),
    ("count", "latencies", fmt_int),
    ("p50", "p50 ms", fmt_ms),
    ("p90", "p90 ms", fmt_ms),
    ("p99", "p99 ms", fmt_ms),
    ("p999", "p99.9 ms", fmt_ms),
    ("max", "max ms", fmt_ms),
    ("mean", "mean ms", fmt_ms),
    ("messages", "records", fmt_int),
    ("failures", "failures", fmt_int),
    ("per_s", "ok/s", fmt_num),
    ("error_rate", "error rate", fmt_rate),
]
COMPARISON_COLUMNS: list[Column] = [
    ("scenario", "scenario", fmt_text),
    ("qos", "QoS", fmt_int),
    ("kind", "kind", fmt_text),
    ("metric", "metric", fmt_text),
    ("baseline_shown", "baseline", fmt_preformatted),
    ("value_shown", "run", fmt_preformatted),
    ("ratio", "run / baseline", fmt_ratio),
    ("regression", "regression", fmt_bool),
]
LOCUST_COLUMNS: list[Column] = [
    ("type", "type", fmt_text),
    ("name", "name", fmt_text),
    ("requests", "requests", fmt_int),
    ("failures", "failures", fmt_int),
    ("median_ms", "median ms", fmt_ms),
    ("p95_ms", "p95 ms", fmt_ms),
    ("p99_ms", "p99 ms", fmt_ms),
    ("avg_ms", "mean ms", fmt_ms),
    ("rps", "requests/s", fmt_num),
]
BENCH_COLUMNS: list[Column] = [
    ("scenario", "scenario", fmt_text),
    ("figure", "figure", fmt_text),
    ("fastbroker", "fastbroker", fmt_num),
    ("mosquitto", "Mosquitto", fmt_num),
    ("ratio", "fastbroker / Mosquitto", fmt_ratio),
]
METRIC_FORMATS = {"per_s": fmt_num, "p50": fmt_ms, "p99": fmt_ms, "error_rate": fmt_rate}
BENCH_TITLE = "Benchmark: fastbroker versus Mosquitto"
RUNS_COLUMNS: list[Column] = [
    ("run_id", "run", fmt_text),
    ("role", "", fmt_text),
    ("started", "started (UTC)", fmt_time),
    ("duration", "seconds", fmt_num),
    ("host", "target", fmt_text),
    ("users", "users", fmt_int),
    ("processes", "processes", fmt_int),
    ("scenarios", "scenarios", fmt_text),
]


def latency_table(latency: pd.DataFrame, throughput: pd.DataFrame) -> pd.DataFrame:
    keys = ["scenario", "node", "qos", "kind"]
    pct = latency.drop(columns=["run_id"])
    rates = throughput[[*keys, "messages", "failures", "per_s", "error_rate"]]
    merged = pct.merge(rates, on=keys, how="outer")
    merged["_kind"] = merged["kind"].map(lambda k: _kind_key(k or "")[0])
    return merged.sort_values(["scenario", "_kind", "node", "qos"], na_position="last")


# --------------------------------------------------------------------------- the page

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0;
       color: #222; background: #f6f7f9; }
header { background: #20252b; color: #fff; padding: 16px 28px; }
header h1 { margin: 0 0 6px; font-size: 1.4em; }
header p { margin: 2px 0; color: #c9d1d9; }
nav a { color: #8cc4ff; margin-right: 14px; text-decoration: none; }
main { padding: 8px 28px 28px; }
section { background: #fff; border: 1px solid #dde1e6; border-radius: 6px;
          margin: 18px 0; padding: 12px 18px; }
section h2 { font-size: 1.15em; margin: 4px 0 6px; }
p.hint { color: #555; margin: 0 0 8px; font-size: 0.92em; }
p.no-data { color: #7a5d00; background: #fff8db; border: 1px solid #f0e0a0;
            padding: 8px 12px; border-radius: 4px; }
.table-wrap { overflow-x: auto; }
table { border-collapse: collapse; font-size: 0.88em; margin: 6px 0; }
th, td { padding: 4px 9px; border-bottom: 1px solid #e6e8eb; white-space: nowrap; }
th { background: #f0f2f5; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.regression td { background: #fde2e2; color: #8b1111; font-weight: 600; }
tr.selected td { background: #e3f0ff; font-weight: 600; }
tr.baseline td { background: #eef6e9; }
footer { color: #666; font-size: 0.85em; padding: 0 28px 20px; }
"""


@dataclass
class Dashboard:
    """The page and what it holds (for the CLI's report and for tests)."""

    html: str
    run: str | None
    baseline: str | None
    charts: list[str] = field(default_factory=list)
    empty_sections: list[str] = field(default_factory=list)


@dataclass
class _Section:
    key: str
    title: str
    hint: str
    body: list[str]


def _chart_html(fig: go.Figure, key: str) -> str:
    height = int(fig.layout.height or 450)
    return fig.to_html(
        full_html=False,
        include_plotlyjs=False,  # inlined once in <head>, shared by every chart
        div_id=f"chart-{key}",
        config=PLOT_CONFIG,
        default_width="100%",
        default_height=f"{height}px",
    )


def _runs_table(
    tables: dict[str, pd.DataFrame], run: str | None, baseline: str | None
) -> pd.DataFrame:
    runs = tables["runs"].copy()
    known = run_ids(tables)
    missing = [r for r in known if r not in set(runs["run_id"])]
    if missing:
        runs = pd.concat(
            [runs, conform(pd.DataFrame({"run_id": missing}), SCHEMAS["runs"])],
            ignore_index=True,
        )
    runs["duration"] = (runs["ended"] - runs["started"]).dt.total_seconds()
    runs["role"] = runs["run_id"].map(
        lambda r: "shown" if r == run else ("baseline" if r == baseline else "")
    )
    order = {r: i for i, r in enumerate(known)}
    runs["_order"] = runs["run_id"].map(lambda r: order.get(r, -1))
    return runs.sort_values("_order", ascending=False)


def build_dashboard(
    tables: dict[str, pd.DataFrame],
    run: str | None = None,
    baseline: str | None = None,
    source: str = "",
) -> Dashboard:
    """The whole page for `run` (default: the newest) against `baseline` (default: the one
    the run's comparison rows name)."""
    run = choose_run(tables, run)
    baseline = choose_baseline(tables, run, baseline)
    result = Dashboard(html="", run=run, baseline=baseline)
    sections: list[_Section] = []

    def chart(key: str, title: str, hint: str, fig: go.Figure | None, empty: str) -> _Section:
        section = _Section(key, title, hint, [])
        if fig is None:
            section.body.append(no_data(empty))
            result.empty_sections.append(key)
        else:
            section.body.append(_chart_html(fig, key))
            result.charts.append(key)
        sections.append(section)
        return section

    def table(key: str, title: str, hint: str, body: str | None, empty: str) -> _Section:
        section = _Section(key, title, hint, [body if body is not None else no_data(empty)])
        if body is None:
            result.empty_sections.append(key)
        sections.append(section)
        return section

    runs = _runs_table(tables, run, baseline)
    table(
        "runs",
        "Runs",
        "Every run in the tables, newest first; the page shows the highlighted one.",
        html_table(
            runs,
            RUNS_COLUMNS,
            lambda r: {"shown": "selected", "baseline": "baseline"}.get(r["role"]),
        )
        if not runs.empty
        else None,
        "no run in the runs, throughput, latency or timeseries tables",
    )

    timeseries = for_run(tables["timeseries"], run)
    chart(
        "throughput",
        "Throughput over time",
        "Records completed per second (received messages for e2e, acknowledged publishes, "
        "CONNACKs), summed over nodes and QoS; dotted: failures per second.",
        throughput_chart(timeseries),
        "no per-second series for this run (OUT/timeseries)",
    )
    chart(
        "latency",
        "Latency percentiles over time",
        "p50 (solid) and p99 (dashed) of each second, in milliseconds, per scenario, kind, "
        "node and QoS (percentiles of different groups are never merged).",
        latency_chart(timeseries),
        "no latencies per second for this run (OUT/timeseries)",
    )
    throughput = for_run(tables["throughput"], run)
    chart(
        "load",
        "Load per node",
        "Records per broker node the clients used, stacked by scenario, one panel per kind.",
        load_chart(throughput),
        "no throughput rows for this run (OUT/throughput)",
    )

    compared = comparison_rows(tables["comparison"], run, baseline)
    vs = f"{run} against baseline {baseline}" if baseline else "against a baseline"
    section = chart(
        "comparison",
        "Run versus baseline",
        f"{vs}, per scenario, QoS and kind: run / baseline (error rate: the difference); red "
        "where spark.aggregate flagged a regression (throughput lower, or latency or error "
        "rate higher, than its thresholds).",
        comparison_chart(compared),
        f"no comparison of run {run} with baseline {baseline} (OUT/comparison)"
        if baseline
        else "no baseline run for this run (OUT/comparison; spark.aggregate --baseline RUN_ID)",
    )
    if not compared.empty:
        ordered = compared.assign(
            _flag=compared["regression"].map(lambda v: not v),
            _kind=compared["kind"].map(lambda k: _kind_key(k)[0]),
        ).sort_values(["_flag", "scenario", "qos", "_kind", "metric"])
        formats = [METRIC_FORMATS.get(m, fmt_num) for m in ordered["metric"]]
        ordered["value_shown"] = [f(v) for f, v in zip(formats, ordered["value"], strict=True)]
        ordered["baseline_shown"] = [
            f(v) for f, v in zip(formats, ordered["baseline_value"], strict=True)
        ]
        section.body.append(
            html_table(
                ordered, COMPARISON_COLUMNS, lambda r: "regression" if r["regression"] else None
            )
        )

    latency = for_run(tables["latency"], run)
    merged = (
        latency_table(latency, throughput) if not (latency.empty and throughput.empty) else None
    )
    table(
        "percentiles",
        "Latency percentiles and error rates",
        "Exact percentiles over every record of each group (whole run), in milliseconds; "
        "records include failures; ok/s = completed records per second of the run.",
        html_table(merged, LATENCY_COLUMNS) if merged is not None else None,
        "no latency or throughput rows for this run (OUT/latency, OUT/throughput)",
    )

    locust = for_run(tables["locust"], run)
    if not locust.empty:
        locust = locust.assign(_last=locust["name"] == "Aggregated").sort_values(
            ["_last", "type", "name"]
        )
    table(
        "locust",
        "Locust statistics",
        "Locust's own request statistics (locust_stats.csv), the Aggregated row last.",
        html_table(locust, LOCUST_COLUMNS) if not locust.empty else None,
        "no Locust stats for this run (OUT/locust)",
    )

    bench = tables["bench"].dropna(subset=["run_id"])
    bench_ids = sorted(bench["run_id"].unique())
    if bench_ids:
        newest = bench_ids[-1]
        rows = bench[bench["run_id"] == newest].sort_values(["scenario", "figure"])
        others = len(bench_ids) - 1
        hint = f"bench/run.py results of bench run {newest}" + (
            f" (the newest of {others + 1})" if others else ""
        )
        table(
            "bench",
            "Benchmark: fastbroker versus Mosquitto",
            hint,
            html_table(rows, BENCH_COLUMNS),
            "",
        )
    else:
        table(
            "bench",
            BENCH_TITLE,
            "bench/run.py results: medians and fastbroker / Mosquitto ratios.",
            None,
            "no benchmark results (OUT/bench)",
        )

    result.html = _page(sections, tables, run, baseline, source)
    return result


def _page(
    sections: list[_Section],
    tables: dict[str, pd.DataFrame],
    run: str | None,
    baseline: str | None,
    source: str,
) -> str:
    esc = html.escape
    title = f"fastbroker load test {run}" if run else "fastbroker load test: no data"
    meta = []
    runs = tables["runs"]
    info = runs[runs["run_id"] == run]
    if not info.empty:
        row = info.iloc[0]
        meta.append(
            f"target {fmt_text(row['host'])}, {fmt_int(row['users'])} users in "
            f"{fmt_int(row['processes'])} processes, started {fmt_time(row['started'])} UTC, "
            f"scenarios: {fmt_text(row['scenarios'])}"
        )
    meta.append(f"baseline: {baseline}" if baseline else "no baseline")
    nav = "".join(f'<a href="#{s.key}">{esc(s.title)}</a>' for s in sections)
    body = "\n".join(
        f'<section id="{s.key}"><h2>{esc(s.title)}</h2>'
        f'<p class="hint">{esc(s.hint)}</p>{"".join(s.body)}</section>'
        for s in sections
    )
    generated = datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{esc(title)}</title>\n<style>{STYLE}</style>\n"
        # Plotly's own offline preamble: MathJax, if ever asked for, is looked for locally.
        "<script>window.PlotlyConfig = {MathJaxConfig: 'local'};</script>\n"
        f"<script>{get_plotlyjs()}</script>\n"
        "</head>\n<body>\n"
        f"<header><h1>{esc(title)}</h1>"
        + "".join(f"<p>{esc(m)}</p>" for m in meta)
        + f"<nav>{nav}</nav></header>\n<main>\n{body}\n</main>\n"
        f"<footer>Generated {generated} by spark.dashboard from {esc(source)}.</footer>\n"
        "</body>\n</html>\n"
    )


def write_dashboard(
    input_dir: Path, output: Path, run: str | None = None, baseline: str | None = None
) -> Dashboard:
    dashboard = build_dashboard(load_tables(input_dir), run, baseline, source=str(input_dir))
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    partial.write_text(dashboard.html, encoding="utf-8")
    partial.replace(output)  # a reader never sees half a page
    return dashboard


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m spark.dashboard",
        description="Turn spark.aggregate's Parquet tables into one offline HTML dashboard.",
    )
    parser.add_argument("--input", type=Path, default=Path("analytics-out"), help="OUT directory")
    parser.add_argument("--output", type=Path, default=Path("dashboard.html"))
    parser.add_argument("--run", default=None, help="run to show (default: the newest)")
    parser.add_argument(
        "--baseline", default=None, help="baseline run (default: the one its comparison names)"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        dashboard = write_dashboard(args.input, args.output, args.run, args.baseline)
    except DashboardError as error:
        print(f"spark.dashboard: {error}", file=sys.stderr)
        return 2
    size = args.output.stat().st_size
    charts = ", ".join(dashboard.charts) or "none"
    print(
        f"wrote {args.output}: {size / 1e6:.1f} MB, {len(dashboard.charts)} charts ({charts}), "
        f"run {dashboard.run or '-'} vs baseline {dashboard.baseline or '-'}, "
        f"{time.monotonic() - started:.2f} s",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
