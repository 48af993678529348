"""Raw load-test records: the contract between loadtest/ and spark/.

One JSON Lines file per worker process, ``RESULTS/raw/RUN_ID/records-HOSTNAME-PID.jsonl``,
and one ``run.json`` per run (written by the master or the single process).
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path
from typing import IO, Any

KINDS = ("e2e", "publish", "connect", "subscribe")
RECORD_FIELDS = (
    "run_id",
    "scenario",
    "node",
    "qos",
    "kind",
    "t_ms",
    "latency_ms",
    "ok",
    "error",
    "bytes",
    "worker",
)
RUN_FIELDS = (
    "run_id",
    "started_ms",
    "ended_ms",
    "scenarios",
    "host",
    "users",
    "processes",
    "locust_version",
)
DEFAULT_RESULTS_DIR = "loadtest-results"
WRITE_BUFFER = 1 << 20  # records are flushed at test stop; a big buffer keeps writes rare


def now_ms() -> float:
    return time.time() * 1000.0


def new_run_id() -> str:
    """Sortable by start time, unique enough for concurrent runs (random suffix)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def worker_name() -> str:
    """``HOSTNAME-PID``; computed on demand because --processes forks after import."""
    return f"{socket.gethostname()}-{os.getpid()}"


def run_dir(results_dir: str | os.PathLike[str], run_id: str) -> Path:
    return Path(results_dir) / "raw" / run_id


def records_path(results_dir: str | os.PathLike[str], run_id: str, worker: str) -> Path:
    return run_dir(results_dir, run_id) / f"records-{worker}.jsonl"


class RecordWriter:
    """Buffered JSON Lines writer for this process's records."""

    def __init__(self, results_dir: str | os.PathLike[str], run_id: str) -> None:
        self.run_id = run_id
        self.worker = worker_name()
        self.path = records_path(results_dir, run_id, self.worker)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Append: a web-UI user may start several tests with the same run id in one process.
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8", buffering=WRITE_BUFFER)
        self.count = 0
        self._dumps = json.JSONEncoder(separators=(",", ":")).encode

    def write(
        self,
        *,
        scenario: str,
        node: str,
        qos: int,
        kind: str,
        t_ms: float,
        latency_ms: float | None,
        ok: bool,
        error: str | None,
        nbytes: int,
    ) -> None:
        if self._file is None:
            return  # a late callback after the test stopped: nothing to attach it to
        record = {
            "run_id": self.run_id,
            "scenario": scenario,
            "node": node,
            "qos": qos,
            "kind": kind,
            "t_ms": round(t_ms, 3),
            "latency_ms": None if latency_ms is None else round(latency_ms, 3),
            "ok": ok,
            "error": error,
            "bytes": nbytes,
            "worker": self.worker,
        }
        self._file.write(self._dumps(record) + "\n")
        self.count += 1

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def write_run_json(
    results_dir: str | os.PathLike[str],
    run_id: str,
    *,
    started_ms: float,
    ended_ms: float,
    scenarios: list[str],
    host: str,
    users: int,
    processes: int,
    locust_version: str,
) -> Path:
    path = run_dir(results_dir, run_id) / "run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "run_id": run_id,
        "started_ms": started_ms,
        "ended_ms": ended_ms,
        "scenarios": scenarios,
        "host": host,
        "users": users,
        "processes": processes,
        "locust_version": locust_version,
    }
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)  # readers never see half a file
    return path


def write_settings_json(
    results_dir: str | os.PathLike[str], run_id: str, settings: dict[str, Any]
) -> Path:
    """The load-test parameters (qos, payload size, ...): not in the contract, kept for humans."""
    path = run_dir(results_dir, run_id) / "settings.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def validate_record(rec: dict[str, Any]) -> list[str]:
    """Contract violations of one parsed record (empty list: valid)."""
    problems: list[str] = []
    if set(rec) != set(RECORD_FIELDS):
        problems.append(f"fields {sorted(rec)} != {sorted(RECORD_FIELDS)}")
        return problems

    def check(cond: bool, what: str) -> None:
        if not cond:
            problems.append(f"{what}: {rec!r}")

    check(isinstance(rec["run_id"], str) and rec["run_id"] != "", "run_id")
    check(isinstance(rec["scenario"], str) and rec["scenario"] != "", "scenario")
    node = rec["node"]
    check(isinstance(node, str) and ":" in node and node.rsplit(":", 1)[1].isdigit(), "node")
    check(type(rec["qos"]) is int and rec["qos"] in (0, 1, 2), "qos")
    check(rec["kind"] in KINDS, "kind")
    check(isinstance(rec["t_ms"], (int, float)) and rec["t_ms"] > 1e12, "t_ms")
    check(type(rec["ok"]) is bool, "ok")
    check(type(rec["bytes"]) is int and rec["bytes"] >= 0, "bytes")
    check(isinstance(rec["worker"], str) and "-" in rec["worker"], "worker")
    if rec["ok"]:
        lat = rec["latency_ms"]
        check(isinstance(lat, (int, float)) and lat >= 0, "latency_ms of a success")
        check(rec["error"] is None, "error of a success")
    else:
        check(rec["latency_ms"] is None, "latency_ms of a failure")
        check(isinstance(rec["error"], str) and rec["error"] != "", "error of a failure")
    if rec["kind"] in ("connect", "subscribe"):
        check(rec["bytes"] == 0, "bytes of connect/subscribe")
    return problems


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
