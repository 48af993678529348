"""Aggregate load-test records, Locust CSVs and benchmark results into Parquet tables.

    python -m spark.aggregate --results loadtest-results [--bench-results bench/results]
                              --out analytics-out [--baseline RUN_ID]
                              [--threshold-throughput 0.10] [--threshold-latency 0.20]
    spark-submit --master spark://HOST:7077 spark/aggregate.py --results ... --out ...

Plain `python` runs Spark in local mode; under spark-submit the master is spark-submit's. On
a cluster, RESULTS and OUT must be paths every executor sees (a shared file system, hdfs://,
s3a://); the executors run no Python of ours. In client mode (the default) the driver imports
spark/readers.py and spark/session.py from beside this file; with --deploy-mode cluster, ship
them too (`--py-files spark.zip`, a zip of the spark/ package). docs/analytics.md has the
commands and settings for standalone, YARN and Kubernetes clusters.

Every table of the issue 6 contract is written under OUT (overwritten, one directory each,
present with its schema even when empty): throughput, latency, timeseries, comparison,
locust, bench, runs.

Definitions:
- messages: records of the group (ok or failed); failures: records with ok = false;
  error_rate = failures / messages; per_s = ok records / the run's duration, where the
  duration is run.json's ended_ms - started_ms, or without a run.json the span of the run's
  records (first to last t_ms).
- Latency percentiles are exact (Spark's `percentile`: linear interpolation between the
  closest ranks, as numpy.percentile's default "linear" method) over all ok records of the
  group, per run x scenario x node x QoS x kind; those of the comparison are recomputed from
  the raw rows over all nodes, never averaged from the per-node ones.
- Comparison: each run against the baseline (--baseline, by default the earliest run when
  there are at least two), by scenario x QoS x kind. Flagged: per_s lower than the baseline's
  by more than --threshold-throughput (relative), p50/p99 higher by more than
  --threshold-latency (relative), error_rate higher by more than --threshold-error-rate
  (absolute, in error-rate units: a relative threshold is meaningless over a baseline of 0).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file (spark-submit spark/aggregate.py): make the `spark` package importable.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    BooleanType,
    DoubleType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from spark import readers
from spark.session import build_session

APP_NAME = "fastbroker-loadtest-aggregate"
GROUP = ("run_id", "scenario", "node", "qos", "kind")
COMPARE_GROUP = ("run_id", "scenario", "qos", "kind")
LATENCY_PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("p999", 0.999))
SERIES_PERCENTILES = (("p50", 0.5), ("p99", 0.99))
TABLES = ("throughput", "latency", "timeseries", "comparison", "locust", "bench", "runs")
SORT_KEYS: dict[str, tuple[str, ...]] = {
    "throughput": GROUP,
    "latency": GROUP,
    "timeseries": (*GROUP, "second"),
    "comparison": (*COMPARE_GROUP, "metric"),
    "locust": ("run_id", "type", "name"),
    "bench": ("run_id", "scenario", "figure"),
    "runs": ("started", "run_id"),
}


@dataclass(frozen=True)
class Thresholds:
    throughput: float = 0.10  # relative drop of per_s
    latency: float = 0.20  # relative rise of p50 / p99
    error_rate: float = 0.01  # absolute rise of the error rate


# --------------------------------------------------------------------------- helpers


def _ok_latency() -> Column:
    # Failures carry no latency (null) by contract; the `ok` guard also keeps a stray value
    # of a failed record out of the percentiles.
    return F.when(F.col("ok"), F.col("latency_ms"))


def _percentile_columns(value: Column, wanted: Sequence[tuple[str, float]]) -> list[Column]:
    """Exact percentiles of `value` (nulls ignored), as one aggregate split into columns."""
    arr = F.percentile(value, [p for _, p in wanted])
    return [arr[i].alias(name) for i, (name, _) in enumerate(wanted)]


def _ratio(num: Column, den: Column) -> Column:
    # Spark 4 runs in ANSI mode, where x / 0 raises: guard every division.
    return F.when(den.isNotNull() & (den != 0), num / den)


def _struct(spec: str) -> StructType:
    """A flat schema from "name type, ..." (DataType.fromDDL needs Spark 4 or a session)."""
    types = {
        "string": StringType(),
        "int": IntegerType(),
        "long": LongType(),
        "double": DoubleType(),
        "boolean": BooleanType(),
        "timestamp": TimestampType(),
    }
    fields = (item.split() for item in spec.split(","))
    return StructType([StructField(name, types[kind]) for name, kind in fields])


def _typed(df: DataFrame, schema: StructType) -> DataFrame:
    return df.select(*(F.col(f.name).cast(f.dataType).alias(f.name) for f in schema.fields))


# --------------------------------------------------------------------------- runs


def run_info(records: DataFrame, run_files: DataFrame) -> DataFrame:
    """One row per run seen in the records or a run.json: run_id, started_ms, ended_ms,
    duration_s (see the module docstring), host, users, processes, scenarios."""
    spans = records.groupBy("run_id").agg(
        F.min("t_ms").alias("first_ms"), F.max("t_ms").alias("last_ms")
    )
    files = run_files.dropDuplicates(["run_id"])
    joined = files.join(spans, "run_id", "full_outer")
    from_file = (
        F.col("started_ms").isNotNull()
        & F.col("ended_ms").isNotNull()
        & (F.col("ended_ms") > F.col("started_ms"))
    )
    duration_ms = F.when(from_file, F.col("ended_ms") - F.col("started_ms")).otherwise(
        F.when(F.col("last_ms") > F.col("first_ms"), F.col("last_ms") - F.col("first_ms"))
    )
    return joined.select(
        "run_id",
        F.coalesce("started_ms", "first_ms").alias("started_ms"),
        F.coalesce("ended_ms", "last_ms").alias("ended_ms"),
        (duration_ms / 1000.0).alias("duration_s"),
        "host",
        "users",
        "processes",
        F.array_join("scenarios", ",").alias("scenarios"),
    )


RUNS_SCHEMA = _struct(
    "run_id string, started timestamp, ended timestamp, host string, users long, "
    "processes long, scenarios string"
)


def runs_table(info: DataFrame) -> DataFrame:
    df = info.select(
        "run_id",
        F.timestamp_seconds(F.col("started_ms") / 1000.0).alias("started"),
        F.timestamp_seconds(F.col("ended_ms") / 1000.0).alias("ended"),
        "host",
        "users",
        "processes",
        "scenarios",
    )
    return _typed(df, RUNS_SCHEMA)


def run_order(info: DataFrame, records: DataFrame) -> list[str]:
    """The runs that have records, oldest first (by start, then run id)."""
    with_records = records.select("run_id").distinct()
    rows = (
        info.join(with_records, "run_id", "left_semi")
        .orderBy(F.col("started_ms").asc_nulls_last(), "run_id")
        .select("run_id")
        .collect()
    )
    return [r.run_id for r in rows]


class BaselineError(ValueError):
    """The requested baseline run has no records."""


def choose_baseline(ordered_runs: Sequence[str], requested: str | None) -> str | None:
    """The requested baseline (which must have records), else the earliest run when there is
    a newer one to compare with it, else None."""
    if requested is not None:
        if requested not in ordered_runs:
            known = ", ".join(ordered_runs) or "none"
            raise BaselineError(f"baseline run {requested!r} has no records (runs: {known})")
        return requested
    return ordered_runs[0] if len(ordered_runs) >= 2 else None


# --------------------------------------------------------------------------- tables


def group_stats(records: DataFrame, keys: Sequence[str]) -> DataFrame:
    """Per group: messages, failures, count (ok latencies), exact percentiles, max, mean."""
    latency = _ok_latency()
    return records.groupBy(*keys).agg(
        F.count(F.lit(1)).alias("messages"),
        F.count(F.when(~F.col("ok"), 1)).alias("failures"),
        F.count(latency).alias("count"),
        *_percentile_columns(latency, LATENCY_PERCENTILES),
        F.max(latency).alias("max"),
        F.avg(latency).alias("mean"),
    )


THROUGHPUT_SCHEMA = _struct(
    "run_id string, scenario string, node string, qos long, kind string, messages long, "
    "failures long, duration_s double, per_s double, error_rate double"
)
LATENCY_SCHEMA = _struct(
    "run_id string, scenario string, node string, qos long, kind string, count long, "
    "p50 double, p90 double, p99 double, p999 double, max double, mean double"
)
TIMESERIES_SCHEMA = _struct(
    "run_id string, scenario string, node string, qos long, kind string, second timestamp, "
    "messages long, failures long, p50 double, p99 double"
)
COMPARISON_SCHEMA = _struct(
    "run_id string, baseline_run_id string, scenario string, qos long, kind string, "
    "metric string, value double, baseline_value double, ratio double, regression boolean"
)


def with_rates(stats: DataFrame, info: DataFrame) -> DataFrame:
    """`stats` plus duration_s, per_s (ok records per second) and error_rate."""
    ok = F.col("messages") - F.col("failures")
    return stats.join(info.select("run_id", "duration_s"), "run_id", "left").select(
        "*",
        _ratio(ok, F.col("duration_s")).alias("per_s"),
        _ratio(F.col("failures"), F.col("messages")).alias("error_rate"),
    )


def throughput_table(stats: DataFrame, info: DataFrame) -> DataFrame:
    return _typed(with_rates(stats, info), THROUGHPUT_SCHEMA)


def latency_table(stats: DataFrame) -> DataFrame:
    # Groups with no successful record have no latency to report.
    return _typed(stats.where(F.col("count") > 0), LATENCY_SCHEMA)


def timeseries_table(records: DataFrame) -> DataFrame:
    """Per group and wall-clock second (t_ms floored, UTC): records, failures, p50, p99."""
    second = F.timestamp_seconds(F.floor(F.col("t_ms") / 1000.0)).alias("second")
    latency = _ok_latency()
    df = records.groupBy(*GROUP, second).agg(
        F.count(F.lit(1)).alias("messages"),
        F.count(F.when(~F.col("ok"), 1)).alias("failures"),
        *_percentile_columns(latency, SERIES_PERCENTILES),
    )
    return _typed(df, TIMESERIES_SCHEMA)


def comparison_table(
    records: DataFrame,
    info: DataFrame,
    baseline: str | None,
    thresholds: Thresholds,
) -> DataFrame:
    """Each run other than `baseline` against it, by scenario x QoS x kind (all nodes)."""
    spark = records.sparkSession
    if baseline is None:
        return spark.createDataFrame([], COMPARISON_SCHEMA)
    stats = with_rates(group_stats(records, COMPARE_GROUP), info)
    metrics = stats.select(
        *COMPARE_GROUP,
        F.explode(
            F.array(
                *(
                    F.struct(F.lit(name).alias("metric"), F.col(name).cast("double").alias("v"))
                    for name in ("per_s", "p50", "p99", "error_rate")
                )
            )
        ).alias("m"),
    ).select(*COMPARE_GROUP, "m.metric", F.col("m.v").alias("value"))
    base = metrics.where(F.col("run_id") == baseline).select(
        F.col("run_id").alias("baseline_run_id"),
        "scenario",
        "qos",
        "kind",
        "metric",
        F.col("value").alias("baseline_value"),
    )
    joined = metrics.where(F.col("run_id") != baseline).join(
        base, ["scenario", "qos", "kind", "metric"], "inner"
    )
    value, base_value, metric = F.col("value"), F.col("baseline_value"), F.col("metric")
    worse = (
        F.when(metric == "per_s", value < base_value * (1.0 - thresholds.throughput))
        .when(metric == "error_rate", value > base_value + thresholds.error_rate)
        .otherwise(value > base_value * (1.0 + thresholds.latency))
    )
    df = joined.select(
        "*",
        _ratio(value, base_value).alias("ratio"),
        F.coalesce(worse, F.lit(False)).alias("regression"),
    )
    return _typed(df, COMPARISON_SCHEMA)


# --------------------------------------------------------------------------- job


@dataclass
class Outcome:
    out: str
    baseline: str | None
    runs: list[str]
    regressions: list[dict[str, object]]


def aggregate(
    spark: SparkSession,
    results: str,
    out: str,
    bench_results: str | None = None,
    baseline: str | None = None,
    thresholds: Thresholds | None = None,
) -> Outcome:
    """Read RESULTS (and BENCH), write every table under OUT; see the module docstring."""
    thresholds = thresholds or Thresholds()
    # Read once, used by every table below.
    records = readers.read_records(spark, results).cache()
    info = run_info(records, readers.read_run_files(spark, results)).cache()
    stats = group_stats(records, GROUP).cache()
    try:
        ordered = run_order(info, records)
        chosen = choose_baseline(ordered, baseline)
        tables: dict[str, DataFrame] = {
            "throughput": throughput_table(stats, info),
            "latency": latency_table(stats),
            "timeseries": timeseries_table(records),
            "comparison": comparison_table(records, info, chosen, thresholds).cache(),
            "locust": readers.read_locust_stats(spark, results),
            "bench": readers.read_bench(spark, bench_results),
            "runs": runs_table(info),
        }
        base = out.rstrip("/")
        for name in TABLES:
            # Small aggregates: one file each, in key order, is simplest to read downstream;
            # sorting within the one partition costs no extra job.
            one = tables[name].coalesce(1).sortWithinPartitions(*SORT_KEYS[name])
            one.write.mode("overwrite").parquet(f"{base}/{name}")
        comparison = tables["comparison"]
        # Flagged rows only (a few per run), in key order: the report reads the same whatever
        # the partitioning (it differed between local mode and a cluster).
        flagged = comparison.where("regression").orderBy(*SORT_KEYS["comparison"])
        regressions = [r.asDict() for r in flagged.collect()]
        comparison.unpersist()
        return Outcome(out=base, baseline=chosen, runs=ordered, regressions=regressions)
    finally:
        for df in (stats, info, records):
            df.unpersist()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m spark.aggregate",
        description="Aggregate load-test results into Parquet tables (local mode with python, "
        "the configured master with spark-submit).",
    )
    p.add_argument("--results", required=True, help="load-test results directory (RESULTS)")
    p.add_argument(
        "--bench-results",
        default=None,
        help="bench/run.py's results directory (e.g. bench/results); default: none",
    )
    p.add_argument("--out", default="analytics-out", help="output directory (default %(default)s)")
    p.add_argument("--baseline", help="baseline run id (default: the earliest of 2+ runs)")
    p.add_argument(
        "--threshold-throughput",
        type=float,
        default=Thresholds.throughput,
        help="flag per_s lower than the baseline's by more than this fraction (default 0.10)",
    )
    p.add_argument(
        "--threshold-latency",
        type=float,
        default=Thresholds.latency,
        help="flag p50/p99 higher than the baseline's by more than this fraction (default 0.20)",
    )
    p.add_argument(
        "--threshold-error-rate",
        type=float,
        default=Thresholds.error_rate,
        help="flag an error rate higher than the baseline's by more than this (absolute, "
        "default 0.01 = 1 percentage point)",
    )
    p.add_argument(
        "--fail-on-regression", action="store_true", help="exit with status 3 on a regression"
    )
    p.add_argument("--log-level", default="ERROR", help="Spark log level (default ERROR)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    ns = parse_args(argv)
    started = time.monotonic()
    spark = build_session(APP_NAME, log_level=ns.log_level)
    print(f"master: {spark.sparkContext.master}")
    try:
        outcome = aggregate(
            spark,
            results=ns.results,
            out=ns.out,
            bench_results=ns.bench_results,
            baseline=ns.baseline,
            thresholds=Thresholds(
                ns.threshold_throughput, ns.threshold_latency, ns.threshold_error_rate
            ),
        )
    except BaselineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        spark.stop()
    print(f"runs with records: {', '.join(outcome.runs) or 'none'}")
    print(f"baseline: {outcome.baseline or 'none'}")
    for r in outcome.regressions:
        print(
            f"REGRESSION {r['run_id']} {r['scenario']} qos{r['qos']} {r['kind']} "
            f"{r['metric']}: {r['value']:.6g} vs {r['baseline_value']:.6g}"
        )
    print(f"wrote {', '.join(TABLES)} under {outcome.out} ({time.monotonic() - started:.1f} s)")
    return 3 if ns.fail_on_regression and outcome.regressions else 0


if __name__ == "__main__":
    sys.exit(main())
