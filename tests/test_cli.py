"""The `fastbroker` command, run as a real subprocess."""

from __future__ import annotations

import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import fastbroker
from fastbroker.config import ConfigError, load_config

STARTUP_TIMEOUT_S = 15.0
SHUTDOWN_TIMEOUT_S = 5.0


def fastbroker_command() -> str:
    """The installed console script; next to this interpreter when in an unactivated venv."""
    beside_python = Path(sys.executable).with_name("fastbroker")
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("fastbroker")
    if found is None:
        pytest.fail("the fastbroker command is not installed (pip install ./rust .)")
    return found


def run_fastbroker(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [fastbroker_command(), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=STARTUP_TIMEOUT_S,
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class Broker:
    """A running `fastbroker run`, with its stderr collected line by line."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process = process
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self.read_stderr, daemon=True).start()

    def read_stderr(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.put(line)
        self.lines.put(None)

    def wait_for_line(self, text: str, timeout: float = STARTUP_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=remaining)
            except queue.Empty:
                break
            if line is None:
                pytest.fail(f"fastbroker exited before {text!r}; stderr:\n{''.join(self.stderr)}")
            self.stderr.append(line)
            if text in line:
                return line
        pytest.fail(f"no {text!r} from fastbroker in {timeout}s; stderr:\n{''.join(self.stderr)}")


@contextmanager
def running_broker(*args: str, cwd: Path) -> Iterator[Broker]:
    process = subprocess.Popen(
        [fastbroker_command(), "run", *args],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        yield Broker(process)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    lines = result.stderr.splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{result.stderr}"
    assert lines[0].startswith("fastbroker: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


def test_version(tmp_path: Path) -> None:
    result = run_fastbroker("--version", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"fastbroker, version {fastbroker.__version__}"


def test_python_dash_m_version(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "fastbroker", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=STARTUP_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"fastbroker, version {fastbroker.__version__}"


@pytest.mark.parametrize(
    ("toml", "fragments"),
    [
        pytest.param(
            "[listener]\nprot = 1883\n", ["[listener] prot", "unknown key"], id="unknown-key"
        ),
        pytest.param("[bogus]\nx = 1\n", ["[bogus]", "unknown table"], id="unknown-table"),
        pytest.param(
            '[listener]\nport = "1883"\n', ["[listener] port", "integer"], id="wrong-type"
        ),
        pytest.param("[listener]\nport = 70000\n", ["[listener] port", "70000"], id="out-of-range"),
        pytest.param("[sys]\ninterval = true\n", ["[sys] interval"], id="bool-for-number"),
        pytest.param("[mqtt]\nmaximum_qos = 3\n", ["[mqtt] maximum_qos"], id="mqtt-bad-value"),
        pytest.param("[mqtt]\nmax_inflight = 1.5\n", ["[mqtt] max_inflight"], id="mqtt-wrong-type"),
        pytest.param("[mqtt]\nmax_inflght = 10\n", ["[mqtt] max_inflght"], id="mqtt-unknown-key"),
        pytest.param(
            '[mqtt]\ndenied_subscriptions = ["a/#/b"]\n',
            ["[mqtt] denied_subscriptions"],
            id="mqtt-bad-filter",
        ),
        pytest.param(
            '[storage]\nfsync = "sometimes"\n',
            ["[storage] fsync", "always, interval, never", "'sometimes'"],
            id="fsync-unknown",
        ),
        pytest.param('[storage]\nfsync = "Always"\n', ["[storage] fsync"], id="fsync-case"),
        pytest.param(
            '[cluster]\nsplit_delivery = "minority"\n',
            ["[cluster] split_delivery", "majority, both", "'minority'"],
            id="split-delivery-unknown",
        ),
        pytest.param("[storage]\nfsync = true\n", ["[storage] fsync"], id="fsync-bool"),
        pytest.param(
            "[storage]\nfsync_interval_ms = 0\n",
            ["[storage] fsync_interval_ms", "1 to 60000", "got 0"],
            id="fsync-interval-zero",
        ),
        pytest.param(
            "[storage]\nfsync_interval_ms = 60001\n",
            ["[storage] fsync_interval_ms", "got 60001"],
            id="fsync-interval-too-big",
        ),
        pytest.param(
            "[storage]\nfsync_interval_ms = 10.0\n",
            ["[storage] fsync_interval_ms", "integer"],
            id="fsync-interval-float",
        ),
        pytest.param("[listener\nport = 1\n", ["invalid TOML"], id="unparseable"),
        pytest.param("port = = 1\n", ["invalid TOML"], id="unparseable-value"),
    ],
)
def test_bad_config_fails_with_one_line(tmp_path: Path, toml: str, fragments: list[str]) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(toml)
    result = run_fastbroker(
        "run", "--config", str(config), "--port", str(free_port()), cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result, str(config), *fragments)
    assert not (tmp_path / "fastbroker-data").exists(), "must fail before starting anything"


def test_storage_fsync_keys(tmp_path: Path) -> None:
    defaults = load_config().storage
    assert (defaults.fsync, defaults.fsync_interval_ms) == ("interval", 10)
    config = tmp_path / "fastbroker.toml"
    for policy in ("always", "interval", "never"):
        config.write_text(f'[storage]\nfsync = "{policy}"\nfsync_interval_ms = 60000\n')
        storage = load_config(config).storage
        assert (storage.fsync, storage.fsync_interval_ms) == (policy, 60000)
    config.write_text("[storage]\nfsync_interval_ms = 1\n")
    assert load_config(config).storage.fsync_interval_ms == 1
    config.write_text("[storage]\nfsync_interval_ms = -5\n")
    with pytest.raises(ConfigError, match=r"\[storage\] fsync_interval_ms: .* got -5$"):
        load_config(config)


def test_missing_config_file_fails_with_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "missing.toml"
    result = run_fastbroker("run", "--config", str(missing), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert_one_line_error(result, str(missing))


def test_port_in_use_fails_with_one_line(tmp_path: Path) -> None:
    with socket.socket() as occupier:
        occupier.bind(("127.0.0.1", 0))
        occupier.listen()
        port = occupier.getsockname()[1]
        result = run_fastbroker("run", "--port", str(port), cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    line = assert_one_line_error(result)
    assert line == f"fastbroker: cannot listen on 127.0.0.1:{port}: address already in use"


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_shuts_down_cleanly(tmp_path: Path, signum: signal.Signals) -> None:
    port = free_port()
    with running_broker("--port", str(port), cwd=tmp_path) as broker:
        broker.wait_for_line("listening on")
        with socket.create_connection(("127.0.0.1", port), timeout=SHUTDOWN_TIMEOUT_S) as client:
            broker.process.send_signal(signum)
            # Shutdown closes open connections: the client sees end of stream.
            assert client.recv(1) == b""
        assert broker.process.wait(timeout=SHUTDOWN_TIMEOUT_S) == 0


def test_runs_with_defaults_and_creates_data_dir(tmp_path: Path) -> None:
    port = free_port()
    with running_broker("--port", str(port), cwd=tmp_path) as broker:
        line = broker.wait_for_line("listening on")
        assert f"fastbroker {fastbroker.__version__} listening on 127.0.0.1:{port}" in line
        assert (tmp_path / "fastbroker-data").is_dir()
        with socket.create_connection(("127.0.0.1", port), timeout=SHUTDOWN_TIMEOUT_S):
            pass
        broker.process.send_signal(signal.SIGTERM)
        assert broker.process.wait(timeout=SHUTDOWN_TIMEOUT_S) == 0


def test_flags_override_config_file(tmp_path: Path) -> None:
    config = tmp_path / "fastbroker.toml"
    config.write_text('[listener]\nport = 1\n[storage]\ndata_dir = "from-file"\n')
    port = free_port()
    with running_broker(
        "--config", str(config), "--port", str(port), "--data-dir", "from-flag", cwd=tmp_path
    ) as broker:
        broker.wait_for_line(f"listening on 127.0.0.1:{port}")
        assert (tmp_path / "from-flag").is_dir()
        assert not (tmp_path / "from-file").exists()
        broker.process.send_signal(signal.SIGTERM)
        assert broker.process.wait(timeout=SHUTDOWN_TIMEOUT_S) == 0


def test_example_config_is_valid(tmp_path: Path) -> None:
    """fastbroker.example.toml sets every key: the broker and its engine must accept it."""
    example = Path(__file__).resolve().parents[1] / "fastbroker.example.toml"
    port = free_port()
    with running_broker(
        "--config", str(example), "--port", str(port), "--data-dir", "data", cwd=tmp_path
    ) as broker:
        broker.wait_for_line(f"listening on 127.0.0.1:{port}")
        assert (tmp_path / "data").is_dir()
        broker.process.send_signal(signal.SIGTERM)
        assert broker.process.wait(timeout=SHUTDOWN_TIMEOUT_S) == 0
