#!/usr/bin/env python3
"""Perf-regression gate: a short fastbroker-vs-Mosquitto benchmark against a committed baseline.

    python ci/perf_gate.py                      # run, compare, exit 1 on a regression
    python ci/perf_gate.py --update-baseline    # run, then rewrite ci/perf-baseline.json

Runs `bench/run.py --quick` (3 rounds of 2 s per scenario and broker, 3,000 connections;
a few minutes on 2 cores) and compares each gated figure's median ratio fastbroker / Mosquitto
with ci/perf-baseline.json. A ratio fails when it is worse than the baseline by more than the
entry's relative tolerance: below ratio x (1 - tolerance) where higher is better, above
ratio x (1 + tolerance) where lower is better. The machine is shared and noisy, so the
scenarios that fail are run once more (again 3 rounds) and only a failure that the re-run
confirms fails the gate.

Rows whose id starts with "w2/" are measured with fastbroker run with two workers
(`bench/run.py --workers 2`), against the same Mosquitto; they are set by hand (an
--update-baseline run keeps them as they are).

Exit codes: 0 pass, 1 regression (confirmed), 2 the benchmark could not run.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RUN_PY = REPO / "bench" / "run.py"
DEFAULT_BASELINE = REPO / "ci" / "perf-baseline.json"
DEFAULT_RESULTS = REPO / "build" / "perf-gate"
DEFAULT_TOLERANCE = 0.25
# Rows of bench/run.py's table that the gate does not check unless the baseline says so:
# the loopback ceiling has no ratio.
UNGATED_SCENARIOS = {"loopback"}


def limit_for(entry: dict[str, Any]) -> float:
    """The worst median ratio that still passes."""
    ratio = float(entry["ratio"])
    tol = float(entry.get("tolerance", DEFAULT_TOLERANCE))
    if entry.get("direction", "higher") == "lower":
        return ratio * (1 + tol)
    return ratio * (1 - tol)


def check_row(entry: dict[str, Any], measured: float | None) -> str:
    """PASS, FAIL (worse than the limit) or MISSING (no ratio measured)."""
    if measured is None:
        return "MISSING"
    limit = limit_for(entry)
    if entry.get("direction", "higher") == "lower":
        return "PASS" if measured <= limit else "FAIL"
    return "PASS" if measured >= limit else "FAIL"


def measured_ratios(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Row id -> the summary row, for rows with a ratio."""
    out = {}
    for row in summary.get("rows", []):
        if row.get("ratio"):
            out[row["id"]] = row
    return out


def median_of(row: dict[str, Any] | None) -> float | None:
    if not row or not row.get("ratio"):
        return None
    return float(row["ratio"]["median"])


def compare(
    baseline: dict[str, Any], rows: dict[str, dict[str, Any]]
) -> list[tuple[str, dict[str, Any], float | None, str]]:
    """(row id, baseline entry, measured median ratio, status) for each gated entry."""
    out = []
    for rid, entry in baseline["ratios"].items():
        if not entry.get("gate", True):
            continue
        measured = median_of(rows.get(rid))
        out.append((rid, entry, measured, check_row(entry, measured)))
    return out


def workers_of(row_id: str) -> int:
    """1, or N for a row measured with N workers ("wN/scenario:figure")."""
    head = row_id.split("/", 1)[0] if "/" in row_id.split(":", 1)[0] else ""
    return int(head[1:]) if head.startswith("w") and head[1:].isdigit() else 1


def scenario_of(row_id: str) -> str:
    return row_id.split(":", 1)[0].rsplit("/", 1)[-1]


def run_groups(
    results: Path, tag: str, row_ids: Sequence[str], extra: Sequence[str]
) -> dict[str, dict[str, Any]] | None:
    """Runs the scenarios of `row_ids`, once per number of workers they need; the measured
    rows by id (prefixed "wN/" for N workers)."""
    rows: dict[str, dict[str, Any]] = {}
    for workers in sorted({workers_of(rid) for rid in row_ids}):
        scenarios = list(
            dict.fromkeys(scenario_of(rid) for rid in row_ids if workers_of(rid) == workers)
        )
        flags = [*extra, "--workers", str(workers)] if workers != 1 else list(extra)
        summary = run_bench(results, f"{tag}-w{workers}", scenarios, flags)
        if summary is None:
            return None
        prefix = f"w{workers}/" if workers != 1 else ""
        rows.update({prefix + rid: row for rid, row in measured_ratios(summary).items()})
    return rows


def fmt_ratio_spread(row: dict[str, Any] | None) -> str:
    if not row or not row.get("ratio"):
        return "-"
    r = row["ratio"]
    return f"{r['min']:.2f}-{r['median']:.2f}-{r['max']:.2f}"


def render(
    results: Sequence[tuple[str, dict[str, Any], float | None, str]],
    rows: dict[str, dict[str, Any]],
    notes: dict[str, str],
) -> str:
    header = ["row", "better", "baseline", "tolerance", "limit", "measured min-med-max", "status"]
    body = []
    for rid, entry, _measured, status in results:
        direction = entry.get("direction", "higher")
        body.append(
            [
                rid,
                direction,
                f"{float(entry['ratio']):.2f}",
                f"{100 * float(entry.get('tolerance', DEFAULT_TOLERANCE)):.0f}%",
                ("<= " if direction == "lower" else ">= ") + f"{limit_for(entry):.2f}",
                fmt_ratio_spread(rows.get(rid)),
                status + (f" ({notes[rid]})" if rid in notes else ""),
            ]
        )
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)
    ]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join(
        [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)]
    )


def new_baseline(
    summaries: Sequence[dict[str, Any]], old: dict[str, Any] | None, command: Sequence[str]
) -> dict[str, Any]:
    """The baseline from these runs: each ratio is the median of the runs' median ratios.
    The old entries' tolerance, gate flag and why are kept."""
    old_ratios = (old or {}).get("ratios", {})
    medians: dict[str, list[float]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for summary in summaries:
        for row in summary.get("rows", []):
            rid = row["id"]
            if scenario_of(rid) in UNGATED_SCENARIOS or not row.get("ratio"):
                continue
            medians.setdefault(rid, []).append(float(row["ratio"]["median"]))
            meta[rid] = row
    ratios: dict[str, Any] = {}
    for rid, values in medians.items():
        prev = old_ratios.get(rid, {})
        entry = {
            "ratio": round(statistics.median(values), 3),
            "tolerance": prev.get("tolerance", DEFAULT_TOLERANCE),
            "direction": meta[rid]["direction"],
            "label": meta[rid]["label"],
            "run_medians": [round(x, 3) for x in values],
        }
        for key in ("gate", "why"):
            if key in prev:
                entry[key] = prev[key]
        ratios[rid] = entry
    last = summaries[-1] if summaries else {}
    return {
        "comment": (
            "Median ratios fastbroker / mosquitto from `python ci/perf_gate.py "
            "--update-baseline` (bench/run.py --quick, several runs). tolerance is relative; "
            "direction says which way is better; gate false: recorded, not checked. "
            "Refresh: README, Benchmarks."
        ),
        "command": " ".join(command),
        "updated": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "run_ids": [s.get("run_id") for s in summaries],
        "git_sha": last.get("git_sha"),
        "hostname": last.get("hostname"),
        "cpu_count": last.get("cpu_count"),
        "broker_versions": last.get("broker_versions"),
        "ratios": ratios,
    }


def run_bench(
    results: Path, tag: str, scenarios: Sequence[str] | None, extra: Sequence[str]
) -> dict[str, Any] | None:
    summary_path = results / f"gate-{tag}.summary.json"
    summary_path.unlink(missing_ok=True)
    cmd = [sys.executable, str(RUN_PY), "--quick", "--results", str(results)]
    cmd += ["--summary-out", str(summary_path), *extra]
    if scenarios:
        cmd += ["--scenarios", ",".join(scenarios)]
    print("$ " + " ".join(cmd), flush=True)
    code = subprocess.run(cmd, cwd=REPO, stdin=subprocess.DEVNULL).returncode
    if code != 0 or not summary_path.is_file():
        print(f"perf gate: bench/run.py exited with code {code}", file=sys.stderr)
        return None
    return json.loads(summary_path.read_text())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", type=Path, default=DEFAULT_BASELINE)
    p.add_argument("--update-baseline", action="store_true", help="rewrite the baseline")
    p.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="results directory")
    p.add_argument(
        "--runs",
        type=int,
        default=3,
        help="with --update-baseline: benchmark runs whose median ratios are combined (3)",
    )
    p.add_argument("--no-confirm", action="store_true", help="do not re-run failing scenarios")
    p.add_argument("--loadgen", help="loadgen binary (passed to bench/run.py)")
    ns = p.parse_args(argv)
    # SIGTERM ends the benchmark too: subprocess.run kills bench/run.py on the way out, and
    # its brokers and loadgen die with it (PR_SET_PDEATHSIG).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    extra = ["--loadgen", ns.loadgen] if ns.loadgen else []
    t0 = time.monotonic()

    baseline: dict[str, Any] | None = None
    if ns.baseline.is_file():
        baseline = json.loads(ns.baseline.read_text())
    elif not ns.update_baseline:
        print(f"perf gate: no baseline at {ns.baseline} (create it with --update-baseline)")
        return 2

    if ns.update_baseline:
        summaries = []
        for n in range(1, ns.runs + 1):
            summary = run_bench(ns.results, f"baseline-{n}", None, extra)
            if summary is None:
                return 2
            summaries.append(summary)
        command = ["python", "ci/perf_gate.py", "--update-baseline", "--runs", str(ns.runs)]
        data = new_baseline(summaries, baseline, command)
        # The rows measured with workers are set by hand (see the docstring): kept.
        for rid, entry in (baseline or {}).get("ratios", {}).items():
            if workers_of(rid) != 1:
                data["ratios"][rid] = entry
        ns.baseline.write_text(json.dumps(data, indent=2) + "\n")
        print(f"\nperf gate: wrote {ns.baseline} ({len(data['ratios'])} ratios)")
        for rid, e in data["ratios"].items():
            runs = " ".join(f"{x:.2f}" for x in e["run_medians"])
            gated = "" if e.get("gate", True) else ", not gated"
            print(
                f"  {rid:32} {e['ratio']:7.3f}  runs {runs}  "
                f"(tolerance {100 * e['tolerance']:.0f}%{gated})"
            )
        print(f"perf gate: {time.monotonic() - t0:.0f} s")
        return 0

    assert baseline is not None
    gated = [rid for rid, e in baseline["ratios"].items() if e.get("gate", True)]
    # Only the scenarios the baseline checks (bench/run.py keeps its own order).
    measured = run_groups(ns.results, "run", gated, extra)
    if measured is None:
        return 2
    rows = measured

    assert baseline is not None
    results = compare(baseline, rows)
    notes: dict[str, str] = {}
    failing = [rid for rid, _, _, status in results if status != "PASS"]
    if failing and not ns.no_confirm:
        again = list(dict.fromkeys(scenario_of(rid) for rid in failing))
        print(f"\nperf gate: {', '.join(failing)} failed; re-running {', '.join(again)} once")
        rows2 = run_groups(ns.results, "confirm", failing, extra) or {}
        confirmed = []
        for i, (rid, entry, measured, status) in enumerate(results):
            if rid not in failing:
                continue
            measured2 = median_of(rows2.get(rid))
            status2 = check_row(entry, measured2)
            first = "-" if measured is None else f"{measured:.2f}"
            if status2 == "PASS":
                notes[rid] = f"first run {first} {status}, passed on re-run"
                rows[rid] = rows2[rid]
                results[i] = (rid, entry, measured2, "PASS")
            else:
                notes[rid] = f"confirmed by re-run, first run {first}"
                if rid in rows2:
                    rows[rid] = rows2[rid]
                results[i] = (rid, entry, measured2, status2)
                confirmed.append(rid)
    print()
    print(render(results, rows, notes))
    bad = [rid for rid, _, _, status in results if status != "PASS"]
    elapsed = time.monotonic() - t0
    if bad:
        print(
            f"\nperf gate: FAIL ({len(bad)} of {len(results)}: {', '.join(bad)}) in {elapsed:.0f} s"
        )
        print("A ratio fastbroker / mosquitto fell beyond its tolerance of the baseline in")
        print(f"{ns.baseline}. If the change is intended, refresh the baseline (README).")
        return 1
    print(f"\nperf gate: PASS ({len(results)} ratios) in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
