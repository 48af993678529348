"""A cluster node in-process, on real sockets and a real disk: what a node does when its Raft
state cannot be saved (a full disk)."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvloop
from tmpfs import mounted_tmpfs

from fastbroker.cluster import node as node_module
from fastbroker.cluster.node import ClusterNode, StateFile
from fastbroker.config import load_config

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 1 MiB tmpfs: the Raft state file alone lives there."""
    with mounted_tmpfs(tmp_path, "1m") as mount_point:
        yield mount_point


def fill_up(path: Path) -> None:
    with open(path, "wb") as filler:
        try:
            while True:
                filler.write(b"\0" * 65536)
                filler.flush()
        except OSError as error:
            assert error.errno == errno.ENOSPC


def test_raft_state_that_cannot_be_saved_is_saved_once_space_returns(small_fs, monkeypatch):
    monkeypatch.setattr(node_module, "BOOTSTRAP_GRACE_S", 0)
    settings = load_config(
        None,
        {"cluster": {"node_id": "a", "listen": "127.0.0.1:0", "heartbeat_ms": 50,
                     "election_timeout_ms": 200, "failure_timeout_ms": 1000}},
    ).cluster  # fmt: skip

    async def main() -> None:
        node = ClusterNode(settings, str(small_fs), asyncio.get_running_loop())
        await node.start()
        try:
            for _ in range(100):
                if node.is_member():
                    break
                await asyncio.sleep(0.05)
            raft = node.raft
            assert raft is not None and raft.role == "leader"
            state_file = StateFile(small_fs / "cluster")
            saved = state_file.load()
            assert saved is not None

            fill_up(small_fs / "filler")
            config = raft.committed_config
            assert config is not None
            now = node_module.monotonic_ms()
            assert raft.propose(config.with_member("a", "127.0.0.1:1"), now) is None
            node.after_raft_step(now)
            # Not saved: kept, and the file on disk is the old state, whole.
            assert node.unsaved is not None
            await asyncio.sleep(0.3)
            assert node.unsaved is not None
            assert state_file.load() == saved

            (small_fs / "filler").unlink()
            for _ in range(100):
                if node.unsaved is None:
                    break
                await asyncio.sleep(0.05)
            assert node.unsaved is None
            reloaded = state_file.load()
            assert reloaded is not None and reloaded != saved
            assert any(
                entry_config is not None and entry_config.address_of("a") == "127.0.0.1:1"
                for _, entry_config in reloaded.entries
            ) or (
                reloaded.snapshot_config is not None
                and reloaded.snapshot_config.address_of("a") == "127.0.0.1:1"
            )
        finally:
            await node.stop()

    uvloop.run(main())
