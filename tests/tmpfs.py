"""A small tmpfs mounted for a disk-full test and unmounted afterwards whatever happens (needs
root; skipped without it, or failed when FASTBROKER_REQUIRED=1 says everything must run)."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def mounted_tmpfs(tmp_path: Path, size: str) -> Iterator[Path]:
    mount_point = tmp_path / "fs"
    mount_point.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
            check=True,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError) as error:
        if os.environ.get("FASTBROKER_REQUIRED") == "1":
            pytest.fail(f"cannot mount a tmpfs for the disk-full test: {error}")
        pytest.skip(f"cannot mount a tmpfs here (needs root): {error}")
    try:
        yield mount_point
    finally:
        result = subprocess.run(["umount", str(mount_point)], capture_output=True, timeout=10)
        if result.returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, timeout=10)
