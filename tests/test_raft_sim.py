"""Seeded random schedules of the Raft simulation (tests/raftsim.py).

``RAFTSIM_SCHEDULES`` (default 2000) seeds are run, from ``RAFTSIM_FIRST_SEED`` (default 0),
split into chunks so progress shows and each test stays short. ``RAFTSIM_SEED=N`` runs that
one seed only (to reproduce a failure; add ``RAFTSIM_TRACE=1`` for its last events).
"""

from __future__ import annotations

import logging
import os

import pytest
from raftsim import Simulation, SimulationFailure

CHUNKS = 20
SCHEDULES = int(os.environ.get("RAFTSIM_SCHEDULES", "2000"))
FIRST_SEED = int(os.environ.get("RAFTSIM_FIRST_SEED", "0"))
ONE_SEED = os.environ.get("RAFTSIM_SEED")


@pytest.fixture(autouse=True)
def quiet_raft_logs():
    # A run logs every election at INFO; only failures matter here.
    logger = logging.getLogger("fastbroker.cluster.raft")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("chunk", range(CHUNKS))
def test_random_schedules(chunk):
    if ONE_SEED is not None:
        if chunk:
            pytest.skip("RAFTSIM_SEED runs one seed")
        seeds = [int(ONE_SEED)]
    else:
        seeds = list(range(FIRST_SEED + chunk, FIRST_SEED + SCHEDULES, CHUNKS))
    for seed in seeds:
        failure = None
        try:
            Simulation(seed).run()
        except SimulationFailure as error:
            failure = str(error)  # names the seed and how to reproduce it
        if failure is not None:
            pytest.fail(failure, pytrace=False)


def test_a_schedule_is_reproducible():
    """The same seed gives the same run, event for event: a failing seed reproduces."""
    first, second = Simulation(7).run(), Simulation(7).run()
    assert first.steps == second.steps > 100
    assert list(first.trace) == list(second.trace)
    assert first.committed == second.committed


def test_schedules_exercise_what_they_claim():
    """Across a few seeds: changes are made, snapshots sent, leaders elected many times."""
    runs = [Simulation(seed).run() for seed in range(30)]
    assert sum(r.accepted for r in runs) > 100
    assert sum(r.snapshots_sent for r in runs) > 50
    assert sum(len(r.leaders) for r in runs) > 150
    assert max(max(r.committed) for r in runs) > 20
