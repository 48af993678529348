"""System calls counted with strace: whether strace can run here, and the calls a trace holds.

Tests that need it are skipped without strace (or fail when FASTBROKER_REQUIRED=1 says
everything must run)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

STRACE = shutil.which("strace")

# "PID 1700000000.123456 name(" with -f -ttt; "<... name resumed>" lines are not new calls.
CALL = re.compile(r"^(?:\d+\s+)?(\d+\.\d+) (\w+)\(")


def strace_works() -> bool:
    if STRACE is None:
        return False
    try:
        probe = subprocess.run(
            [STRACE, "-qq", "-o", os.devnull, "true"], capture_output=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return probe.returncode == 0


needs_strace = pytest.mark.skipif(
    not strace_works() and os.environ.get("FASTBROKER_REQUIRED") != "1",
    reason="strace missing or not permitted (ptrace)",
)


def calls(trace: Path) -> list[tuple[float, str]]:
    """(wall-clock time, system call name) of each call in an ``strace -f -ttt`` output."""
    found = []
    for line in trace.read_text(errors="replace").splitlines():
        match = CALL.match(line)
        if match:
            found.append((float(match.group(1)), match.group(2)))
    return found
