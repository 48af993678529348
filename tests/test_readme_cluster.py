"""The README's cluster example, run as written: three nodes on one machine, then
`fastbroker cluster status` shows the map, and a subscriber on node 3 receives what a
publisher on node 1 sends. The only change: 127.0.0.1 becomes a loopback address of this test
run's own, so the fixed ports cannot meet another broker."""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from brokers import _die_with_parent
from clusters import run_subnet

pytestmark = pytest.mark.timeout(120)

README = Path(__file__).resolve().parents[1] / "README.md"


def example_lines() -> list[str]:
    text = README.read_text()
    block = re.search(r"<!-- cluster-example.*?```sh\n(.*?)```", text, re.S)
    assert block, "README has no cluster example block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def fastbroker_argv(words: list[str]) -> list[str]:
    # `fastbroker` may not be on PATH in a venv that is not activated.
    assert words[0] == "fastbroker"
    exe = shutil.which("fastbroker")
    return [exe, *words[1:]] if exe else [sys.executable, "-m", "fastbroker", *words[1:]]


def mosquitto_argv(words: list[str]) -> list[str]:
    exe = shutil.which(words[0]) or f"/usr/bin/{words[0]}"
    return [exe, *words[1:]]


def test_readme_cluster_example(tmp_path):
    ip = f"127.{run_subnet()}.1.1"
    lines = [line.replace("127.0.0.1", ip) for line in example_lines()]
    starts = [line for line in lines if line.startswith("fastbroker run")]
    assert len(starts) == 3 and all(line.endswith("&") for line in starts)
    (status_line,) = [line for line in lines if "fastbroker cluster status" in line]
    (sub_line,) = [line for line in lines if line.startswith("mosquitto_sub")]
    (pub_line,) = [line for line in lines if "mosquitto_pub" in line]
    procs = []
    try:
        for line in starts:
            log = open(tmp_path / f"node{len(procs) + 1}.log", "wb")
            procs.append(
                subprocess.Popen(
                    fastbroker_argv(shlex.split(line[:-1])),
                    cwd=tmp_path,
                    stdout=log,
                    stderr=log,
                    preexec_fn=_die_with_parent,
                )
            )
        status_cmd = fastbroker_argv(shlex.split(status_line.split(";")[-1]))
        deadline = time.monotonic() + 60
        out = None
        while time.monotonic() < deadline:
            out = subprocess.run(status_cmd, capture_output=True, text=True, timeout=30)
            rows = [ln for ln in out.stdout.splitlines() if re.match(r"n[123] ", ln)]
            if len(rows) == 3 and all(" alive " in r or " self " in r for r in rows):
                break
            time.sleep(0.5)
        assert out is not None and out.returncode == 0, out and out.stderr
        assert "map version" in out.stdout and "256 partitions" in out.stdout, out.stdout
        rows = [ln for ln in out.stdout.splitlines() if re.match(r"n[123] ", ln)]
        assert len(rows) == 3, out.stdout
        header = next(ln for ln in out.stdout.splitlines() if ln.startswith("NODE "))
        primaries = [int(r.split()[header.split().index("PRIMARY")]) for r in rows]
        assert sum(primaries) == 256 and max(primaries) <= 86 + 2, out.stdout
        assert sum(1 for r in rows if " leader " in r) == 1
        print("\n" + out.stdout)

        # One logical broker: the subscriber on node 3 gets the publish made on node 1.
        assert sub_line.endswith("&")
        sub = subprocess.Popen(
            mosquitto_argv(shlex.split(sub_line[:-1])),
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=_die_with_parent,
        )
        procs.append(sub)
        time.sleep(1.0)
        pub = subprocess.run(
            mosquitto_argv(shlex.split(pub_line.split(";")[-1])),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert pub.returncode == 0, pub.stderr
        got, _ = sub.communicate(timeout=10)
        assert got == "sensors/1/temp 21.5\n"
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
