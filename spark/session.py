"""The SparkSession for the jobs: local mode only when no master is configured anywhere.

`spark-submit` (its --master, a spark-defaults.conf, the MASTER variable) and
PYSPARK_SUBMIT_ARGS all decide the master before this code runs; overriding them with a
hard-coded one would break cluster runs, so `.master("local[*]")` is only the fallback.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path

from pyspark.sql import SparkSession

LOCAL_MASTER = "local[*]"

# Set on every session: timestamps in UTC whatever the machine's zone, and Parquet timestamps
# as int64 microseconds (pandas/pyarrow read them natively; Spark's default is legacy INT96).
SESSION_CONF: dict[str, str] = {
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.parquet.outputTimestampType": "TIMESTAMP_MICROS",
}

LOG4J2_CONFIG = Path(__file__).with_name("log4j2.properties")

# Only for the local fallback, and only keys not configured elsewhere (spark-defaults.conf,
# PYSPARK_SUBMIT_ARGS, `conf`): a modest driver, no web UI or progress bars, quiet start-up
# logs, and the JVM's quick compiler alone (C1). Measured on 2 cores: 20 s instead of 32 s on
# the test fixtures, 29 s instead of 43 s on 200k records, even (54 s / 51 s) at 1M; beyond
# that, pass --driver-java-options in PYSPARK_SUBMIT_ARGS to get the full JIT back.
LOCAL_CONF: dict[str, str] = {
    "spark.driver.memory": "1g",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 "
    f"-Dlog4j2.configurationFile={LOG4J2_CONFIG.as_uri()}",
}
# Any local master, unless configured: one machine does all the work on small aggregates, so
# Spark's default of 200 shuffle partitions would be 200 tiny tasks per aggregation.
LOCAL_SHUFFLE_PARTITIONS = "4"
# Any master, unless configured: lets adaptive execution coalesce the shuffle partitions of a
# cached plan too. The job caches its aggregates (stats, comparison), which otherwise keep
# spark.sql.shuffle.partitions each (200 by default on a cluster). On a standalone cluster of
# two 1-core workers: 41 tasks instead of 1832 on the test fixtures, 91-134 s instead of
# 162-173 s on 200k records.
CACHED_PLAN_CONF: dict[str, str] = {
    "spark.sql.optimizer.canChangeCachedPlanOutputPartitioning": "true",
}


def spark_defaults(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The properties of the spark-defaults.conf that spark-submit would read, if any."""
    conf_dir = env.get("SPARK_CONF_DIR")
    if not conf_dir:
        home = env.get("SPARK_HOME")
        if not home:
            import pyspark

            home = str(Path(pyspark.__file__).parent)
        conf_dir = str(Path(home) / "conf")
    path = Path(conf_dir) / "spark-defaults.conf"
    props: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError:
        return props
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.replace("=", " ", 1).partition(" ")
        props[key.strip()] = value.strip()
    return props


# spark-submit options that stand for a property.
_SUBMIT_OPTIONS = {
    "--master": "spark.master",
    "--driver-memory": "spark.driver.memory",
    "--driver-java-options": "spark.driver.extraJavaOptions",
}


def submit_args_conf(env: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The properties set in PYSPARK_SUBMIT_ARGS (--conf K=V and the options above), which
    pyspark hands to the spark-submit that starts its JVM."""
    try:
        args = shlex.split(env.get("PYSPARK_SUBMIT_ARGS", ""))
    except ValueError:
        return {}
    props: dict[str, str] = {}
    for i, arg in enumerate(args):
        option, has_value, value = arg.partition("=")
        if not has_value:
            value = args[i + 1] if i + 1 < len(args) else ""
        if option in _SUBMIT_OPTIONS:
            props[_SUBMIT_OPTIONS[option]] = value
        elif option == "--conf" and not has_value:
            key, _, prop = value.partition("=")
            props[key] = prop
    return props


def master_to_set(
    conf: Mapping[str, str] | None = None, env: Mapping[str, str] = os.environ
) -> str | None:
    """The master the builder must set, or None when one is already configured.

    In order: a JVM started by spark-submit (PYSPARK_GATEWAY_PORT: its master is decided),
    spark.master in `conf`, PYSPARK_SUBMIT_ARGS, SPARK_MASTER, MASTER (read by spark-submit),
    spark-defaults.conf; otherwise local[*].
    """
    if env.get("PYSPARK_GATEWAY_PORT"):
        return None
    if conf and conf.get("spark.master"):
        return conf["spark.master"]
    if submit_args_conf(env).get("spark.master"):
        return None
    if env.get("SPARK_MASTER"):
        return env["SPARK_MASTER"]
    if env.get("MASTER") or spark_defaults(env).get("spark.master"):
        return None
    return LOCAL_MASTER


def build_session(
    app_name: str,
    conf: Mapping[str, str] | None = None,
    log_level: str = "ERROR",
    env: Mapping[str, str] = os.environ,
) -> SparkSession:
    """A SparkSession named `app_name`; `conf` adds or overrides properties."""
    builder = SparkSession.builder.appName(app_name)
    master = master_to_set(conf, env)
    if master == LOCAL_MASTER:
        elsewhere = {**spark_defaults(env), **submit_args_conf(env), **(conf or {})}
        for key, value in LOCAL_CONF.items():
            if key not in elsewhere:
                builder = builder.config(key, value)
    if master is not None:
        builder = builder.master(master)
    for key, value in {**SESSION_CONF, **(conf or {})}.items():
        if key != "spark.master":
            builder = builder.config(key, value)
    spark = builder.getOrCreate()
    sc = spark.sparkContext
    sc.setLogLevel(log_level)

    def configured(key: str) -> bool:
        return key in (conf or {}) or sc.getConf().contains(key)

    partitions = "spark.sql.shuffle.partitions"
    if (sc.master or "").startswith("local") and not configured(partitions):
        spark.conf.set(partitions, LOCAL_SHUFFLE_PARTITIONS)
    for key, value in CACHED_PLAN_CONF.items():
        if not configured(key):
            spark.conf.set(key, value)
    return spark
