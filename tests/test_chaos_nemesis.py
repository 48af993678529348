"""What the fault-injection suite's nemesis cuts (issue 17): a `split` cuts one node off
from the others, a `bridge` (partial split) cuts the others apart in two halves while the
node keeps reaching both. The network test makes real namespaces (root)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fastbroker.chaos.network import Network
from fastbroker.chaos.runner import split_sides


def test_a_split_cuts_one_node_off_and_a_bridge_cuts_the_others_apart():
    assert split_sides("split", 2, 3) == [[2], [1, 3]]
    assert split_sides("bridge", 2, 3) == [[1], [3]]
    assert split_sides("bridge", 1, 3) == [[2], [3]]
    # Five nodes: the bridge on neither side, the other four two against two.
    assert split_sides("bridge", 3, 5) == [[1, 4], [2, 5]]


PORT = 7000
LISTEN = (
    "import socket, time\n"
    "s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('0.0.0.0', {PORT})); s.listen(16); print('up', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept(); c.close()\n"
)
CONNECT = (
    "import socket, sys\n"
    "try:\n"
    "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=0.5).close()\n"
    "except OSError:\n"
    "    sys.exit(1)\n"
)


@pytest.mark.skipif(
    bool(Network.unavailable()) and os.environ.get("FASTBROKER_REQUIRED") != "1",
    reason=Network.unavailable() or "",
)
@pytest.mark.timeout(60)
def test_during_a_bridge_the_bridge_reaches_both_halves_and_they_do_not_reach_each_other():
    network = Network(3, subnet=200 + os.getpid() % 20)
    network.create()
    listeners = []
    try:
        for index in (1, 2, 3):
            argv = network.command(network.namespace(index), [sys.executable, "-c", LISTEN])
            p = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
            listeners.append(p)
            assert p.stdout is not None and p.stdout.readline().strip() == "up"

        def reaches(src: int, dst: int) -> bool:
            argv = [sys.executable, "-c", CONNECT, network.ip(dst), str(PORT)]
            return subprocess.run(network.command(network.namespace(src), argv)).returncode == 0

        pairs = [(a, b) for a in (1, 2, 3) for b in (1, 2, 3) if a != b]
        assert all(reaches(a, b) for a, b in pairs)
        network.split(split_sides("bridge", 1, 3))
        cut = {(2, 3), (3, 2)}
        assert {(a, b) for a, b in pairs if not reaches(a, b)} == cut
        network.heal()
        deadline = time.monotonic() + 5
        while not all(reaches(a, b) for a, b in cut) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(reaches(a, b) for a, b in pairs)
    finally:
        for p in listeners:
            p.kill()
            p.wait()
        network.delete()
