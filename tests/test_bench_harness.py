"""The benchmark harness (bench/run.py) and perf gate (ci/perf_gate.py), without brokers:
configs, /proc parsing, ratio math, the table, the JSON line schema, the baseline."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import os
import shutil
import ssl
import sys
import time
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


bench = load("fastbroker_bench_run", REPO / "bench" / "run.py")
gate = load("fastbroker_perf_gate", REPO / "ci" / "perf_gate.py")


def measurement(scenario, broker, rnd, figures, cpu=50.0, lg_cpu=30.0, error=None):
    m = bench.Measurement(scenario, broker, rnd, 1, {"payload": 64})
    m.figures = figures
    m.loadgen = {**figures, "loadgen_cpu_percent": lg_cpu, "loadgen_cores_busy": lg_cpu / 100}
    m.broker_cpu_percent = cpu
    m.broker_rss_kb = 1000
    m.error = error
    return m


# --------------------------------------------------------------------------- configs


def test_mosquitto_config_lifts_limits_and_disables_persistence():
    text = bench.mosquitto_config_text(18830, as_root=False)
    lines = set(text.splitlines())
    assert "listener 18830 127.0.0.1" in lines
    for line in (
        "allow_anonymous true",
        "max_queued_messages 0",
        "max_inflight_messages 0",
        "max_queued_bytes 0",
        "max_connections -1",
        "persistence false",
        "set_tcp_nodelay true",
        "sys_interval 0",
    ):
        assert line in lines
    assert "user root" not in lines
    assert "user root" in bench.mosquitto_config_text(18830, as_root=True).splitlines()


def test_fastbroker_config_uses_defaults_except_for_persistence(tmp_path):
    text = bench.fastbroker_config_text(18831, str(tmp_path / "data"))
    config = tomllib.loads(text)
    assert config["listener"] == {"host": "127.0.0.1", "port": 18831}
    assert config["sys"]["interval"] == 0
    # The targets are for fastbroker's default settings.
    assert config["mqtt"] == {}
    durable_text = bench.fastbroker_config_text(18831, str(tmp_path / "data"), fsync="always")
    durable = tomllib.loads(durable_text)
    assert durable["storage"]["fsync"] == "always"
    assert durable["mqtt"]["max_queued_messages"] == 1_000_000
    assert durable["mqtt"]["max_inflight"] == 65535
    assert durable["mqtt"]["receive_maximum"] == 65535
    # fastbroker's own loader accepts both (unknown keys or bad values would raise).
    fb_config = pytest.importorskip("fastbroker.config")
    for i, t in enumerate((text, durable_text)):
        path = tmp_path / f"fb{i}.toml"
        path.write_text(t)
        fb_config.load_config(path, {})
    assert fb_config.load_config(path, {}).mqtt["max_inflight"] == 65535


# --------------------------------------------------------------------------- scenarios


def test_scenarios_follow_the_loadgen_contract():
    scenarios = {s.name: s for s in bench.build_scenarios(bench.Settings())}
    assert list(scenarios) == [
        "fan-in",
        "fan-out",
        "pairs",
        "qos1",
        "latency",
        "connections",
        "payload-16",
        "payload-1k",
        "payload-64k",
        "loopback",
    ]
    settings = bench.Settings(duration=5, warmup=1)
    args = scenarios["fan-in"].loadgen_args(settings)
    assert args[:5] == ["fan-in", "--host", "127.0.0.1", "--port", "{port}"]
    assert " ".join(args[5:]) == "--duration 5 --warmup 1 --publishers 8 --payload 64 --qos 0"
    conn = " ".join(scenarios["connections"].loadgen_args(settings))
    assert "--count 15000 --sources 127.0.0.2-127.0.0.16 --hold 3 --concurrency 256" in conn
    assert " ".join(scenarios["qos1"].loadgen_args(settings)).endswith(
        "--publishers 8 --inflight 64 --payload 64"
    )
    assert "--rate 5000" in " ".join(scenarios["latency"].loadgen_args(settings))
    assert scenarios["payload-64k"].loadgen_args(settings)[0] == "throughput"
    loop = scenarios["loopback"].loadgen_args(settings)
    assert loop[0] == "loopback" and "--port" not in loop
    quick = {s.name: s for s in bench.build_scenarios(bench.QUICK)}
    params = quick["connections"].params(bench.QUICK)
    assert (params["count"], params["hold"], params["duration_s"]) == (3000, 1.5, 2.0)


def test_select_scenarios():
    all_ = bench.build_scenarios(bench.Settings())
    names = [s.name for s in bench.select_scenarios(all_, "payload,fan-in")]
    assert names == ["fan-in", "payload-16", "payload-1k", "payload-64k", "loopback"]
    assert [s.name for s in bench.select_scenarios(all_, "qos1")] == ["qos1"]
    assert [s.name for s in bench.select_scenarios(all_, "payload-1k")] == [
        "payload-1k",
        "loopback",
    ]
    with pytest.raises(SystemExit):
        bench.select_scenarios(all_, "fan-in,nope")


def test_broker_order_alternates():
    assert bench.broker_order(1) == ("fastbroker", "mosquitto")
    assert bench.broker_order(2) == ("mosquitto", "fastbroker")
    assert bench.broker_order(3) == ("fastbroker", "mosquitto")


# --------------------------------------------------------------------------- /proc, loadgen


def test_proc_parsing():
    stat = "1234 (my (odd) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 4 0"
    assert bench.parse_proc_stat_cpu(stat) == pytest.approx(300 / bench.CLK_TCK)
    status = "Name:\tmosquitto\nVmHWM:\t   20480 kB\nVmRSS:\t    8192 kB\n"
    assert bench.parse_proc_status_kb(status, "VmRSS") == 8192
    assert bench.parse_proc_status_kb(status, "VmHWM") == 20480
    assert bench.parse_proc_status_kb(status, "VmSwap") is None


def test_cpu_percent_interpolates_over_the_window():
    samples = [(0.0, 0.0), (1.0, 0.5), (2.0, 1.5), (3.0, 1.5)]
    assert bench.cpu_percent(samples, 1.0, 2.0) == pytest.approx(100.0)
    assert bench.cpu_percent(samples, 0.5, 1.5) == pytest.approx(75.0)
    assert bench.cpu_percent(samples, 2.0, 3.0) == pytest.approx(0.0)
    assert bench.cpu_percent(samples, -5.0, 10.0) == pytest.approx(50.0)  # clipped
    assert bench.cpu_percent(samples[:1], 0.0, 1.0) is None
    assert bench.cpu_percent(samples, 2.0, 1.0) is None


def test_parse_loadgen_output():
    out = (
        "building...\n"
        '{"ready": true, "connected": 15000}\n'
        "not json {\n"
        '{"scenario": "connections", "connects_per_s": 9000.5, "connected": 15000}\n'
    )
    final, ready = bench.parse_loadgen_output(out)
    assert ready
    assert final == {"scenario": "connections", "connects_per_s": 9000.5, "connected": 15000}
    final, ready = bench.parse_loadgen_output('{"scenario": "fan-in"}')
    assert final == {"scenario": "fan-in"} and not ready
    assert bench.parse_loadgen_output("") == (None, False)


# --------------------------------------------------------------------------- ratios, table


def test_round_ratios_pair_rounds():
    fast = {1: 200.0, 2: 300.0, 3: 100.0}
    mosq = {1: 100.0, 2: 100.0, 4: 50.0}
    assert bench.round_ratios(fast, mosq) == [2.0, 3.0]
    assert bench.round_ratios({1: 5.0}, {1: 0.0}) == []
    assert bench.spread([2.0, 3.0, 1.0]) == {"min": 1.0, "median": 2.0, "max": 3.0, "n": 3}
    assert bench.spread([]) is None
    assert bench.fmt_ratio([1.0, 2.0, 4.0]) == "1.00-2.00-4.00"
    assert bench.fmt_ratio([0.0026, 0.0031, 0.06]) == "0.0026-0.0031-0.06"


def test_rows_and_table():
    settings = bench.Settings(payloads=(1024,))
    scenarios = bench.select_scenarios(bench.build_scenarios(settings), "fan-in,latency,payload-1k")
    ms = []
    for rnd, (fb, mq) in enumerate([(200, 100), (300, 100), (210, 100)], 1):
        ms.append(measurement("fan-in", "fastbroker", rnd, {"delivered_per_s": fb}))
        ms.append(measurement("fan-in", "mosquitto", rnd, {"delivered_per_s": mq}))
        lat_fb = {"p50_us": 50, "p99_us": 100 * rnd, "p999_us": 400}
        lat_mq = {"p50_us": 100, "p99_us": 200, "p999_us": 400}
        ms.append(measurement("latency", "fastbroker", rnd, lat_fb))
        ms.append(measurement("latency", "mosquitto", rnd, lat_mq))
        ms.append(measurement("payload-1k", "fastbroker", rnd, {"mb_per_s": 500.0}))
        ms.append(measurement("payload-1k", "mosquitto", rnd, {"mb_per_s": 250.0}))
        ms.append(measurement("loopback", "none", rnd, {"mb_per_s": 5000.0}))
    ms.append(measurement("fan-in", "mosquitto", 4, {}, error="RuntimeError: boom"))
    rows = {r.row_id: r for r in bench.build_rows(scenarios, ms)}
    assert rows["fan-in:delivered_per_s"].ratios == [2.0, 3.0, 2.1]
    assert rows["fan-in:delivered_per_s"].failures == 1
    assert rows["latency:p99_us"].ratios == [0.5, 1.0, 1.5]
    assert rows["latency:p99_us"].figure.direction == "lower"
    assert not rows["latency:p99_us"].first and rows["latency:p50_us"].first
    assert rows["loopback:mb_per_s"].ratios == []
    table = bench.render_table(list(rows.values()), ceiling=5000.0)
    lines = table.splitlines()
    assert "ratio fb/mosq min-median-max" in lines[0]
    fan_in = next(line for line in lines if line.startswith("| fan-in"))
    assert "2.00-2.10-3.00" in fan_in and "210" in fan_in and "1 failed run" in fan_in
    p99 = next(line for line in lines if "p99 latency" in line)
    assert "(lower is better)" in p99 and "0.50-1.00-1.50" in p99
    assert "10% / 5% of ceiling" in table
    assert "(ceiling, no broker)" in table
    assert len({len(line) for line in lines}) == 1  # aligned
    json.dumps([r.to_json() for r in rows.values()])


def test_json_line_schema():
    m = measurement("qos1", "mosquitto", 2, {"acked_per_s": 1000.0, "delivered_per_s": 990.0})
    run = {
        "run_id": "r1",
        "git_sha": "abc",
        "git_dirty": False,
        "hostname": "h",
        "cpu_count": 2,
        "broker_versions": {"mosquitto": "2.0.11"},
    }
    line = json.loads(json.dumps(bench.json_line(m, run)))
    for key in (
        "schema",
        "run_id",
        "git_sha",
        "hostname",
        "timestamp",
        "broker",
        "broker_version",
        "round",
        "scenario",
        "params",
        "figures",
        "broker_cpu_percent",
        "broker_rss_kb",
        "loadgen_cpu_percent",
        "ok",
        "error",
    ):
        assert key in line, key
    assert line["schema"] == bench.SCHEMA
    assert line["broker"] == "mosquitto" and line["broker_version"] == "2.0.11"
    assert line["round"] == 2 and line["scenario"] == "qos1" and line["ok"] is True
    assert line["figures"]["acked_per_s"] == 1000.0
    assert line["timestamp"].endswith("Z")


# --------------------------------------------------------------------------- perf gate


def test_gate_limits():
    up = {"ratio": 2.0, "tolerance": 0.25, "direction": "higher"}
    assert gate.limit_for(up) == pytest.approx(1.5)
    assert gate.check_row(up, 1.6) == "PASS"
    assert gate.check_row(up, 1.4) == "FAIL"
    assert gate.check_row(up, None) == "MISSING"
    down = {"ratio": 0.5, "tolerance": 0.5, "direction": "lower"}
    assert gate.limit_for(down) == pytest.approx(0.75)
    assert gate.check_row(down, 0.7) == "PASS"
    assert gate.check_row(down, 0.8) == "FAIL"


def test_gate_rows_measured_with_workers():
    assert gate.workers_of("pairs:delivered_per_s") == 1
    assert gate.workers_of("w2/pairs:delivered_per_s") == 2
    assert gate.scenario_of("w2/pairs:delivered_per_s") == "pairs"
    assert gate.scenario_of("connections:rss_per_conn_bytes") == "connections"


def test_gate_compare_and_new_baseline():
    summary = {
        "run_id": "r",
        "rows": [
            {
                "id": "fan-in:delivered_per_s",
                "direction": "higher",
                "label": "delivered msg/s",
                "ratio": {"min": 1.8, "median": 2.0, "max": 2.2, "n": 3},
                "ratios": [1.8, 2.0, 2.2],
            },
            {
                "id": "latency:p99_us",
                "direction": "lower",
                "label": "p99",
                "ratio": {"min": 0.4, "median": 0.5, "max": 0.6, "n": 3},
                "ratios": [0.4, 0.5, 0.6],
            },
            {"id": "loopback:mb_per_s", "direction": "higher", "label": "x", "ratio": None},
        ],
    }
    old = {"ratios": {"latency:p99_us": {"ratio": 1, "tolerance": 0.6, "gate": False}}}
    other = json.loads(json.dumps(summary))
    other["rows"][0]["ratio"]["median"] = 3.0
    third = json.loads(json.dumps(summary))
    third["rows"][0]["ratio"]["median"] = 1.0
    new = gate.new_baseline([summary, other, third], old, ["x"])
    assert set(new["ratios"]) == {"fan-in:delivered_per_s", "latency:p99_us"}
    fan_in = new["ratios"]["fan-in:delivered_per_s"]
    assert fan_in["ratio"] == 2.0 and fan_in["run_medians"] == [2.0, 3.0, 1.0]
    assert fan_in["tolerance"] == gate.DEFAULT_TOLERANCE
    assert new["ratios"]["latency:p99_us"] == {
        "ratio": 0.5,
        "tolerance": 0.6,
        "direction": "lower",
        "label": "p99",
        "run_medians": [0.5, 0.5, 0.5],
        "gate": False,
    }
    baseline = {
        "ratios": {
            "fan-in:delivered_per_s": {"ratio": 2.8, "tolerance": 0.25, "direction": "higher"},
            "qos1:acked_per_s": {"ratio": 1.0, "tolerance": 0.25, "direction": "higher"},
            "latency:p99_us": {"ratio": 0.5, "gate": False},
        }
    }
    results = gate.compare(baseline, gate.measured_ratios(summary))
    assert [(rid, status) for rid, _, _, status in results] == [
        ("fan-in:delivered_per_s", "FAIL"),  # 2.0 < 2.8 * 0.75
        ("qos1:acked_per_s", "MISSING"),
    ]
    assert "FAIL" in gate.render(results, gate.measured_ratios(summary), {})


def test_committed_baseline_matches_the_harness():
    path = REPO / "ci" / "perf-baseline.json"
    baseline = json.loads(path.read_text())
    ids = {
        bench.row_id(s.name, f.key): f.direction
        for s in bench.build_scenarios(bench.QUICK)
        for f in s.figures
    }
    assert baseline["ratios"]
    for rid, entry in baseline["ratios"].items():
        # "w2/..." rows: the same rows, measured with two workers.
        row = rid.split("/", 1)[1] if gate.workers_of(rid) != 1 else rid
        assert row in ids, f"{rid} is not a row of bench/run.py --quick"
        assert entry["direction"] == ids[row]
        assert entry["ratio"] > 0
        assert 0 < entry["tolerance"] < 1


def test_measured_window():
    run = bench.LoadgenRun(0, "", start=100.0, end=104.0, publishing_at=100.5)
    assert bench.measured_window(run, warmup=1.0, duration=2.0) == pytest.approx((101.7, 103.7))
    run.publishing_at = None  # no marker: the last `duration` s before exit, less the grace
    assert bench.measured_window(run, warmup=1.0, duration=2.0) == pytest.approx((101.0, 103.0))


def test_check_loadgen_result():
    ok = bench.LoadgenRun(0, "", 0.0, 1.0)
    bench.check_loadgen_result(ok, {"scenario": "fan-in"})
    partial = bench.LoadgenRun(3, "", 0.0, 1.0)  # some connections failed: figures kept
    bench.check_loadgen_result(partial, {"scenario": "connections", "errors": 2})
    with pytest.raises(RuntimeError, match="refused"):
        bench.check_loadgen_result(
            bench.LoadgenRun(1, "", 0.0, 1.0), {"scenario": "qos1", "error": "refused"}
        )
    with pytest.raises(RuntimeError, match="exit code 2"):
        bench.check_loadgen_result(bench.LoadgenRun(2, "", 0.0, 1.0), None)
    with pytest.raises(RuntimeError, match="timed out"):
        bench.check_loadgen_result(bench.LoadgenRun(None, "", 0.0, 1.0, timed_out=True), None)


def test_run_notes():
    ms = [
        measurement("fan-in", "fastbroker", r, {"delivered_per_s": 1.0, "delivery_ratio": 0.3})
        for r in (1, 2, 3)
    ]
    ms.append(measurement("fan-in", "mosquitto", 1, {"delivery_ratio": 1.0}, lg_cpu=95.0))
    ms.append(measurement("connections", "mosquitto", 1, {"errors": 4}))
    ms.append(measurement("pairs", "mosquitto", 2, {}, error="RuntimeError: boom"))
    notes = bench.run_notes(ms)
    assert any(n.startswith("fastbroker fan-in: delivered 30%") for n in notes)
    assert not any(n.startswith("mosquitto fan-in: delivered") for n in notes)
    assert any("loadgen used 95%" in n and "mosquitto" in n for n in notes)
    assert any("4 errors in connections mosquitto round 1" in n for n in notes)
    assert "FAILED run: pairs mosquitto round 2: RuntimeError: boom" in notes
    loopback = [measurement("loopback", "none", 1, {"mb_per_s": 900.0}, lg_cpu=150.0)]
    assert bench.run_notes(loopback) == []  # the loopback copy is all loadgen, by design


# --------------------------------------------------------------------------- security scenarios


def test_security_scenarios_are_opt_in_and_follow_the_loadgen_contract():
    settings = bench.Settings(duration=5, warmup=1)
    security = {s.name: s for s in bench.security_scenarios(settings)}
    assert tuple(security) == bench.SECURITY_NAMES
    for default in (bench.default_scenarios(settings), bench.default_scenarios(bench.QUICK)):
        assert not set(security) & {s.name for s in default}
    picked = bench.select_scenarios(
        bench.default_scenarios(settings), "security", extra=list(security.values())
    )
    assert [s.name for s in picked] == list(bench.SECURITY_NAMES)
    picked = bench.select_scenarios(
        bench.default_scenarios(settings), "fan-in,pairs-tls", extra=list(security.values())
    )
    assert [s.name for s in picked] == ["fan-in", "pairs-tls"]
    with pytest.raises(SystemExit):  # not known without the extra pool
        bench.select_scenarios(bench.default_scenarios(settings), "security")

    standard = {s.name: s for s in bench.build_scenarios(settings)}
    # Each at the load of a standard scenario, plus only its security options.
    acl_args = security["fan-in-acl"].loadgen_args(settings)
    assert acl_args == [*standard["fan-in"].loadgen_args(settings), "--username", "bench"]
    tls_args = security["pairs-tls"].loadgen_args(settings)
    assert tls_args == [*standard["pairs"].loadgen_args(settings), "--tls-ca", "{tls_ca}"]
    ws_args = security["pairs-ws"].loadgen_args(settings)
    assert ws_args == [*standard["pairs"].loadgen_args(settings), "--ws-path", "/mqtt"]
    auth = " ".join(security["connect-auth"].loadgen_args(settings))
    plain = " ".join(security["connect-plain"].loadgen_args(settings))
    assert auth == plain + f" --username bench --password {bench.BENCH_PASSWORD}"
    assert "--count 300 --hold 0.5 --concurrency 32" in plain
    assert security["connect-auth"].params(settings)["security"]["passwords"] is True
    assert security["connect-plain"].security is None


def test_acl_files_say_the_same_rules_in_each_brokers_words():
    assert 18 <= len(bench.ACL_RULES) <= 25
    fb = bench.acl_text("fastbroker")
    mq = bench.acl_text("mosquitto")
    for text in (fb, mq):
        rules = [line for line in text.splitlines() if line.startswith(("topic ", "pattern "))]
        assert len(rules) == len(bench.ACL_RULES)
        assert any("%c" in r for r in rules) and any("%u" in r for r in rules)
        assert "user bench" in text.splitlines()
    # The two rules that allow fan-in's traffic.
    assert "pattern publish %u/in/+" in fb.splitlines()
    assert "pattern write %u/in/+" in mq.splitlines()
    assert "topic subscribe,read bench/in/+" in fb.splitlines()
    assert "topic read bench/in/+" in mq.splitlines()
    assert "subscribe" not in mq and "publish" not in mq
    # Nothing before the first user line but patterns (mosquitto's topic lines there would
    # apply to anonymous clients only).
    head = fb.split("\nuser ", 1)[0]
    assert "\ntopic " not in head
    acl = pytest.importorskip("fastbroker.auth.acl")
    parsed = acl.Acl.parse(fb)
    granted = dict((f, m) for m, f in parsed.permissions_for("bench", "c1"))
    assert "bench/in/+" in granted and "users/bench/#" in granted
    assert "mallory/in/+" in dict((f, m) for m, f in parsed.permissions_for("mallory", "c1"))


def test_security_configs(tmp_path):
    assets = bench.SecurityAssets(
        tmp_path,
        *(tmp_path / n for n in ("ca.pem", "s.pem", "s.key", "fb.pw", "mq.pw", "fb.acl", "mq.acl")),
    )
    acl, pw = bench.Security(acl=True), bench.Security(passwords=True)
    tls, ws = bench.Security(transport="tls"), bench.Security(transport="ws")

    def mosq(sec, **kw):
        return bench.mosquitto_config_text(18830, False, None, "", sec, assets, **kw).splitlines()

    lines = mosq(acl)
    assert f"acl_file {assets.mosquitto_acl}" in lines and "allow_anonymous true" in lines
    lines = mosq(pw)
    assert f"password_file {assets.mosquitto_passwords}" in lines
    assert "allow_anonymous false" in lines and "allow_anonymous true" not in lines
    lines = mosq(tls)
    assert lines[:3] == [
        "listener 18830 127.0.0.1",
        f"certfile {assets.cert}",
        f"keyfile {assets.key}",
    ]
    assert mosq(ws, aux_port=18831)[:3] == [
        "listener 18831 127.0.0.1",
        "listener 18830 127.0.0.1",
        "protocol websockets",
    ]
    with pytest.raises(ValueError):
        mosq(ws)
    for line in ("max_queued_messages 0", "set_tcp_nodelay true"):  # limits still lifted
        assert line in mosq(tls)

    def fb(sec):
        return tomllib.loads(
            bench.fastbroker_config_text(18830, str(tmp_path / "d"), None, sec, assets)
        )

    assert fb(acl)["auth"] == {"acl_file": str(assets.fastbroker_acl)}
    assert fb(acl)["listener"] == {"host": "127.0.0.1", "port": 18830}
    assert fb(pw)["auth"] == {"password_file": str(assets.fastbroker_passwords)}
    config = fb(tls)
    assert "listener" not in config and "auth" not in config
    assert config["listeners"] == [
        {
            "type": "tls",
            "host": "127.0.0.1",
            "port": 18830,
            "certfile": str(assets.cert),
            "keyfile": str(assets.key),
        }
    ]
    assert fb(ws)["listeners"] == [
        {"type": "ws", "host": "127.0.0.1", "port": 18830, "path": "/mqtt"}
    ]
    assert fb(None)["mqtt"] == {}  # the targets are for default settings
    # No --host/--port on a TLS or WebSocket broker's command line (it would open TCP too).
    work = tmp_path / "w"
    work.mkdir()
    assert "--port" not in bench.broker_command("fastbroker", 18830, work, None, tls, assets)
    assert "--port" in bench.broker_command("fastbroker", 18830, work, None, acl, assets)


# --------------------------------------------------------------------------- security, live
# Each broker started briefly with the generated config and files, then one client that the
# feature lets in and one that it keeps out: the config is valid and the feature is on.

from tests import rawmqtt  # noqa: E402


def need_broker_tools(kind: str) -> None:
    if kind == "mosquitto" and bench.mosquitto_executable() is None:
        pytest.skip("mosquitto is not installed")
    if shutil.which("openssl") is None or shutil.which("mosquitto_passwd") is None:
        pytest.skip("needs openssl and mosquitto_passwd")


@pytest.fixture(scope="module")
def security_base(tmp_path_factory):
    if shutil.which("openssl") is None or shutil.which("mosquitto_passwd") is None:
        pytest.skip("needs openssl and mosquitto_passwd")
    base = tmp_path_factory.mktemp("bench-security")
    assets = bench.security_assets(base)  # made once, reused by every broker below
    yield base, assets
    bench._assets.pop(base, None)


@contextlib.contextmanager
def running(kind: str, base: Path, security):
    broker = bench.start_broker(kind, base, None, security)
    try:
        yield broker
    finally:
        bench.stop_process(broker.proc)
        shutil.rmtree(broker.workdir, ignore_errors=True)


def connack(sock, **connect_kw) -> int:
    sock.sendall(rawmqtt.connect(connect_kw.pop("client_id", "c"), **connect_kw))
    return rawmqtt.parse_connack(rawmqtt.read_packet(sock, 5.0)).reason


BROKER_KINDS = ["fastbroker", "mosquitto"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", BROKER_KINDS)
def test_live_acl_allows_the_fan_in_traffic_and_nothing_else(kind, security_base):
    need_broker_tools(kind)
    base, _ = security_base
    with running(kind, base, bench.Security(acl=True)) as b:
        sub, _ = rawmqtt.connect_client(bench.HOST, b.port, "sub", username="bench", timeout=5)
        good, _ = rawmqtt.connect_client(bench.HOST, b.port, "p1", username="bench", timeout=5)
        bad, _ = rawmqtt.connect_client(bench.HOST, b.port, "p2", username="mallory", timeout=5)
        with sub, good, bad:
            sub.sendall(rawmqtt.subscribe(1, [("bench/in/+", 0)]))
            assert rawmqtt.parse_suback(rawmqtt.read_packet(sub, 5.0)).reasons == [0]
            # mallory's %u pattern is mallory/in/+: not allowed to publish here.
            bad.sendall(rawmqtt.publish("bench/in/02", b"denied"))
            good.sendall(rawmqtt.publish("bench/in/01", b"allowed"))
            got = rawmqtt.parse_publish(rawmqtt.read_packet(sub, 5.0))
            assert (got.topic, got.payload) == ("bench/in/01", b"allowed")
            bad.sendall(rawmqtt.publish("bench/in/03", b"denied"))
            with pytest.raises(TimeoutError):
                rawmqtt.read_packet(sub, 0.5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", BROKER_KINDS)
def test_live_password_file_checks_the_bench_password(kind, security_base):
    need_broker_tools(kind)
    base, _ = security_base
    with running(kind, base, bench.Security(passwords=True)) as b:
        pw = bench.BENCH_PASSWORD.encode()
        for user, password, accepted in [
            ("bench", pw, True),
            ("bench", b"wrong", False),
            (None, None, False),  # anonymous: refused once a password file is there
        ]:
            with rawmqtt.open_socket(bench.HOST, b.port, 5.0) as sock:
                code = connack(sock, username=user, password=password)
                assert (code == 0) is accepted, (user, password, code)
                if not accepted:
                    assert code in (4, 5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", BROKER_KINDS)
def test_live_tls_listener(kind, security_base):
    need_broker_tools(kind)
    base, assets = security_base
    context = ssl.create_default_context(cafile=str(assets.ca))  # checks the name too
    with running(kind, base, bench.Security(transport="tls")) as b:
        raw = rawmqtt.open_socket(bench.HOST, b.port, 5.0)
        with context.wrap_socket(raw, server_hostname=bench.HOST) as sock:
            assert sock.version() in ("TLSv1.2", "TLSv1.3")
            assert connack(sock) == 0
        with rawmqtt.open_socket(bench.HOST, b.port, 5.0) as sock:  # MQTT without TLS
            sock.sendall(rawmqtt.connect("plain"))
            with pytest.raises((rawmqtt.Closed, TimeoutError)):
                rawmqtt.read_packet(sock, 3.0)


def ws_recv_frame(sock) -> tuple[int, bytes]:
    deadline = time.monotonic() + 5.0
    head = rawmqtt._recv_exact(sock, 2, deadline)
    length = head[1] & 0x7F
    if length == 126:
        length = int.from_bytes(rawmqtt._recv_exact(sock, 2, deadline), "big")
    return head[0] & 0x0F, rawmqtt._recv_exact(sock, length, deadline)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", BROKER_KINDS)
def test_live_websocket_listener(kind, security_base):
    need_broker_tools(kind)
    base, _ = security_base
    with running(kind, base, bench.Security(transport="ws")) as b:
        key = base64.b64encode(os.urandom(16)).decode()
        with rawmqtt.open_socket(bench.HOST, b.port, 5.0) as sock:
            sock.sendall(
                (
                    f"GET {bench.WS_PATH} HTTP/1.1\r\nHost: {bench.HOST}:{b.port}\r\n"
                    "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                    f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                    "Sec-WebSocket-Protocol: mqtt\r\n\r\n"
                ).encode()
            )
            head = b""
            while b"\r\n\r\n" not in head:
                head += rawmqtt._recv_exact(sock, 1, time.monotonic() + 5.0)
            assert head.startswith(b"HTTP/1.1 101"), head
            accept = base64.b64encode(
                hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()
            )
            assert accept in head
            mask = os.urandom(4)
            data = rawmqtt.connect("ws-client")
            masked = bytes(c ^ mask[i % 4] for i, c in enumerate(data))
            sock.sendall(bytes([0x82, 0x80 | len(data)]) + mask + masked)
            opcode, payload = ws_recv_frame(sock)
            assert opcode == 2 and payload[:1] == b"\x20" and payload[3] == 0  # CONNACK 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["fan-in-acl", "connect-auth", "pairs-tls", "pairs-ws"])
def test_live_loadgen_runs_each_security_scenario(name, security_base):
    """The harness's own path (broker start, loadgen options, {tls_ca}) with the real loadgen,
    at a light load: every client gets through the feature and messages arrive."""
    for kind in BROKER_KINDS:
        need_broker_tools(kind)
    try:
        loadgen = bench.find_loadgen(None, build=False)
    except SystemExit:
        pytest.skip("the loadgen is not built (cargo build --release in bench/loadgen)")
    base, _ = security_base
    settings = bench.Settings(rounds=1, duration=0.4, warmup=0.2, hold=0.2, auth_connections=6)
    sc = {s.name: s for s in bench.security_scenarios(settings)}[name]
    if sc.command == "connections":
        sc = dataclasses.replace(sc, options=(*sc.options, ("concurrency", "3")))
    else:  # light: 2 publishers/pairs at 500 msg/s in all
        light = {"publishers": "2", "pairs": "2"}
        options = tuple((k, light.get(k, v)) for k, v in sc.options)
        sc = dataclasses.replace(sc, options=(*options, ("rate", "500")))
    for kind in BROKER_KINDS:
        m = bench.measure(sc, kind, 1, 1, settings, loadgen, base)
        assert m.ok, m.error
        lg = m.loadgen or {}
        if sc.command == "connections":
            assert m.figures["connected"] == 6 and m.figures["errors"] == 0
            assert lg["params"]["username"] == "bench" and lg["params"]["password"] is True
        else:
            assert m.figures["delivered_per_s"] > 0
            assert m.figures["delivery_ratio"] > 0.5
            assert lg["params"]["transport"] == sc.security.transport
            if sc.security.transport == "tls":
                assert lg["params"]["tls"].startswith("TLSv1_")


def test_hash_costs_are_measured_on_the_brokers_own_files(security_base):
    _, assets = security_base
    costs = bench.measure_hash_costs(assets)
    fb, mq = costs["fastbroker"], costs["mosquitto"]
    assert fb["verified"] and mq["verified"]  # the same computation as the brokers'
    assert fb["hash"].startswith("scrypt ln=14 r=8 p=1")
    assert mq["hash"].startswith("PBKDF2-SHA512")
    assert fb["ms_per_check"] > mq["ms_per_check"] > 0
    with pytest.raises(RuntimeError):
        bench.password_line(assets.mosquitto_passwords, "nobody")
