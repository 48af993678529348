"""Readers for the job's inputs, each with an explicit schema, each empty when nothing matches.

Paths are strings, not pathlib objects, and files are found with Spark's own globs, so the same
code reads a local directory in local mode and a shared or HDFS/S3 one on a cluster.

Inputs (the contract of issue 6):
- RESULTS/raw/RUN_ID/records-HOSTNAME-PID.jsonl: one record per message/connect/subscribe;
- RESULTS/raw/RUN_ID/run.json: the run's metadata;
- RESULTS/locust/RUN_ID/locust_stats.csv: Locust's per-request-name statistics;
- BENCH/RUN_ID.summary.json and BENCH/RUN_ID.jsonl: bench/run.py's results.
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DoubleType,
    IntegerType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
)

RECORD_SCHEMA = StructType(
    [
        StructField("run_id", StringType()),
        StructField("scenario", StringType()),
        StructField("node", StringType()),
        StructField("qos", IntegerType()),
        StructField("kind", StringType()),
        StructField("t_ms", DoubleType()),
        StructField("latency_ms", DoubleType()),
        StructField("ok", BooleanType()),
        StructField("error", StringType()),
        StructField("bytes", LongType()),
        StructField("worker", StringType()),
    ]
)

RUN_JSON_SCHEMA = StructType(
    [
        StructField("run_id", StringType()),
        StructField("started_ms", DoubleType()),
        StructField("ended_ms", DoubleType()),
        StructField("scenarios", ArrayType(StringType())),
        StructField("host", StringType()),
        StructField("users", LongType()),
        StructField("processes", LongType()),
        StructField("locust_version", StringType()),
    ]
)

# bench/run.py's summary: only the fields the bench table needs. Each row's "values" maps a
# broker ("fastbroker", "mosquitto", or "none" for the loopback ceiling) to min/median/max/n
# over the rounds; "ratio" is the same spread of the per-round fastbroker/mosquitto ratios.
_SPREAD = StructType([StructField("median", DoubleType())])
BENCH_SUMMARY_SCHEMA = StructType(
    [
        StructField("run_id", StringType()),
        StructField(
            "rows",
            ArrayType(
                StructType(
                    [
                        StructField("scenario", StringType()),
                        StructField("figure", StringType()),
                        StructField("values", MapType(StringType(), _SPREAD)),
                        StructField("ratio", _SPREAD),
                    ]
                )
            ),
        ),
    ]
)

# bench/run.py's JSON lines: one per scenario x broker x round.
BENCH_LINE_SCHEMA = StructType(
    [
        StructField("run_id", StringType()),
        StructField("scenario", StringType()),
        StructField("broker", StringType()),
        StructField("round", IntegerType()),
        StructField("ok", BooleanType()),
        StructField("figures", MapType(StringType(), DoubleType())),
    ]
)

LOCUST_SCHEMA = StructType(
    [
        StructField("run_id", StringType()),
        StructField("name", StringType()),
        StructField("type", StringType()),
        StructField("requests", LongType()),
        StructField("failures", LongType()),
        StructField("median_ms", DoubleType()),
        StructField("p95_ms", DoubleType()),
        StructField("p99_ms", DoubleType()),
        StructField("avg_ms", DoubleType()),
        StructField("rps", DoubleType()),
    ]
)

BENCH_SCHEMA = StructType(
    [
        StructField("run_id", StringType()),
        StructField("scenario", StringType()),
        StructField("figure", StringType()),
        StructField("fastbroker", DoubleType()),
        StructField("mosquitto", DoubleType()),
        StructField("ratio", DoubleType()),
    ]
)


def _join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *parts])


def _or_empty(spark: SparkSession, schema: StructType, read: Callable[[], DataFrame]) -> DataFrame:
    """`read()`, or an empty frame of `schema` when its glob matches no file."""
    try:
        return read()
    except AnalysisException as exc:
        if "PATH_NOT_FOUND" in str(exc) or "Path does not exist" in str(exc):
            return spark.createDataFrame([], schema)
        raise


def read_records(spark: SparkSession, results: str) -> DataFrame:
    """Every raw record under RESULTS/raw/*/; lines that do not parse (a worker killed
    mid-write leaves half a line) and records missing a key field are dropped."""
    path = _join(results, "raw", "*", "records-*.jsonl")
    df = _or_empty(
        spark,
        RECORD_SCHEMA,
        lambda: spark.read.json(path, schema=RECORD_SCHEMA, mode="DROPMALFORMED"),
    )
    return df.where(
        F.col("run_id").isNotNull()
        & F.col("kind").isNotNull()
        & F.col("t_ms").isNotNull()
        & F.col("ok").isNotNull()
    )


def read_run_files(spark: SparkSession, results: str) -> DataFrame:
    """The run.json of every run (RUN_JSON_SCHEMA), one row each."""
    path = _join(results, "raw", "*", "run.json")
    df = _or_empty(
        spark,
        RUN_JSON_SCHEMA,
        lambda: spark.read.json(path, schema=RUN_JSON_SCHEMA, multiLine=True),
    )
    return df.where(F.col("run_id").isNotNull())


def _number(df: DataFrame, column: str, kind: str) -> Column:
    """A Locust CSV column as a number: null for "N/A", an empty cell or a missing column
    (the percentile columns depend on Locust's --percentiles option)."""
    if column not in df.columns:
        return F.lit(None).cast(kind)
    return F.expr(f"try_cast(`{column}` AS {kind})")


def read_locust_stats(spark: SparkSession, results: str) -> DataFrame:
    """RESULTS/locust/RUN_ID/locust_stats.csv as the `locust` table (LOCUST_SCHEMA); the run
    id comes from the directory, the "Aggregated" row (Type empty) is kept with type ""."""
    path = _join(results, "locust", "*", "locust_stats.csv")
    # Every column as a string, then cast by name: Locust's columns vary with its options
    # and "N/A" fills the percentiles of a name with no requests.
    raw = _or_empty(
        spark,
        StructType([]),
        lambda: spark.read.csv(path, header=True, inferSchema=False, escape='"'),
    )
    if not raw.columns:
        return spark.createDataFrame([], LOCUST_SCHEMA)
    run_id = F.regexp_extract(
        F.col("_metadata.file_path"), r"/locust/([^/]+)/locust_stats\.csv$", 1
    )
    return raw.select(
        run_id.alias("run_id"),
        F.col("Name").alias("name"),
        F.coalesce(F.col("Type"), F.lit("")).alias("type"),
        _number(raw, "Request Count", "BIGINT").alias("requests"),
        _number(raw, "Failure Count", "BIGINT").alias("failures"),
        _number(raw, "Median Response Time", "DOUBLE").alias("median_ms"),
        _number(raw, "95%", "DOUBLE").alias("p95_ms"),
        _number(raw, "99%", "DOUBLE").alias("p99_ms"),
        _number(raw, "Average Response Time", "DOUBLE").alias("avg_ms"),
        _number(raw, "Requests/s", "DOUBLE").alias("rps"),
    ).where(F.col("name").isNotNull())


def _bench_from_summaries(spark: SparkSession, bench: str) -> DataFrame:
    path = _join(bench, "*.summary.json")
    df = _or_empty(
        spark,
        BENCH_SUMMARY_SCHEMA,
        lambda: spark.read.json(path, schema=BENCH_SUMMARY_SCHEMA, multiLine=True),
    )
    rows = df.where(F.col("run_id").isNotNull()).select(
        "run_id", F.explode_outer("rows").alias("row")
    )
    return rows.where(F.col("row").isNotNull()).select(
        "run_id",
        F.col("row.scenario").alias("scenario"),
        F.col("row.figure").alias("figure"),
        F.col("row.values")["fastbroker"]["median"].alias("fastbroker"),
        F.col("row.values")["mosquitto"]["median"].alias("mosquitto"),
        F.col("row.ratio.median").alias("ratio"),
    )


def _bench_from_lines(spark: SparkSession, bench: str) -> DataFrame:
    """The same table from the JSON lines alone, for runs without a summary (interrupted):
    every figure, the median over the ok rounds per broker, and the median of the per-round
    fastbroker / mosquitto ratios (as bench/run.py computes them)."""
    path = _join(bench, "*.jsonl")
    lines = _or_empty(
        spark,
        BENCH_LINE_SCHEMA,
        lambda: spark.read.json(path, schema=BENCH_LINE_SCHEMA, mode="DROPMALFORMED"),
    )
    figures = lines.where(F.col("ok") & F.col("run_id").isNotNull()).select(
        "run_id", "scenario", "broker", "round", F.explode("figures").alias("figure", "value")
    )
    per_round = (
        figures.where(F.col("value").isNotNull() & ~F.isnan("value"))
        .groupBy("run_id", "scenario", "figure", "round")
        .agg(
            F.max(F.when(F.col("broker") == "fastbroker", F.col("value"))).alias("fb"),
            F.max(F.when(F.col("broker") == "mosquitto", F.col("value"))).alias("mq"),
        )
    )
    paired = F.when(F.col("mq") > 0, F.col("fb") / F.col("mq"))
    return per_round.groupBy("run_id", "scenario", "figure").agg(
        F.percentile("fb", 0.5).alias("fastbroker"),
        F.percentile("mq", 0.5).alias("mosquitto"),
        F.percentile(paired, 0.5).alias("ratio"),
    )


def read_bench(spark: SparkSession, bench: str | None) -> DataFrame:
    """bench/run.py's results as the `bench` table (BENCH_SCHEMA): from each run's summary,
    or from its JSON lines when the summary is missing."""
    if not bench:
        return spark.createDataFrame([], BENCH_SCHEMA)
    summaries = _bench_from_summaries(spark, bench)
    from_lines = _bench_from_lines(spark, bench).join(
        summaries.select("run_id").distinct(), "run_id", "left_anti"
    )
    return summaries.unionByName(from_lines).select(
        *(F.col(f.name).cast(f.dataType) for f in BENCH_SCHEMA.fields)
    )
