"""PySpark jobs that turn load-test and benchmark results into Parquet tables (issue 6).

`python -m spark.aggregate --results RESULTS --out OUT` runs in local mode; the same file runs
unchanged with `spark-submit --master spark://... spark/aggregate.py ...` on a cluster.
"""
