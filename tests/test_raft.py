"""Unit tests of the membership Raft (src/fastbroker/cluster/raft.py).

Each test drives real `Raft` objects through `Cluster`, a tiny synchronous network: messages
are delivered in order, a node's state is persisted (through its wire form) before its
messages are queued, nodes can be cut off, crashed and restarted from their disk. The
randomised, adversarial counterpart is tests/raftsim.py.
"""

from __future__ import annotations

import logging
import random
from collections import deque
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastbroker.cluster.raft import (
    APPEND,
    APPEND_REPLY,
    PRE_VOTE,
    PRE_VOTE_REPLY,
    SNAPSHOT,
    VOTE,
    VOTE_REPLY,
    ClusterConfig,
    PersistentState,
    Raft,
)

ELECTION_TIMEOUT = (100, 200)
HEARTBEAT = 20
TICK = 5

pytestmark = pytest.mark.timeout(60)


def config_of(*ids: str, partitions: int = 16) -> ClusterConfig:
    return ClusterConfig(tuple((i, f"{i}.local:7000") for i in ids), partitions, 2, "cluster-1")


class Cluster:
    """Nodes, their disks, and a FIFO network that can cut nodes off."""

    def __init__(self, ids: list[str], *, snapshot_threshold: int = 32, seed: int = 0) -> None:
        self.now = 0
        self.seed = seed
        self.snapshot_threshold = snapshot_threshold
        self.disks: dict[str, PersistentState | None] = dict.fromkeys(ids)
        self.nodes: dict[str, Raft | None] = {}
        self.queue: deque[tuple[str, str, list[Any]]] = deque()
        self.cut: set[str] = set()
        self.sent: list[tuple[str, str, list[Any]]] = []
        for node_id in ids:
            self.start(node_id)

    def start(self, node_id: str) -> Raft:
        disk = self.disks[node_id]
        raft = Raft(
            node_id,
            self.now,
            state=None if disk is None else PersistentState.from_wire(disk.to_wire()),
            rng=random.Random(f"{self.seed}-{node_id}-{self.now}"),
            election_timeout_ms=ELECTION_TIMEOUT,
            heartbeat_ms=HEARTBEAT,
            snapshot_threshold=self.snapshot_threshold,
        )
        self.nodes[node_id] = raft
        return raft

    def crash(self, node_id: str) -> None:
        self.nodes[node_id] = None

    def node(self, node_id: str) -> Raft:
        raft = self.nodes[node_id]
        assert raft is not None, f"{node_id} is down"
        return raft

    def settle(self, node_id: str) -> None:
        """What the caller does after every call: persist, then send."""
        raft = self.node(node_id)
        state = raft.take_persistent_state()
        if state is not None:
            self.disks[node_id] = state
        for destination, message in raft.take_messages():
            self.sent.append((node_id, destination, message))
            self.queue.append((node_id, destination, message))

    def bootstrap(self, config: ClusterConfig) -> None:
        for node_id in config.member_ids():
            self.node(node_id).bootstrap(config, self.now)
            self.settle(node_id)

    def deliver(self) -> None:
        while self.queue:
            source, destination, message = self.queue.popleft()
            raft = self.nodes.get(destination)
            if raft is None or source in self.cut or destination in self.cut:
                continue
            raft.receive(source, message, self.now)
            self.settle(destination)

    def run(self, ms: int) -> None:
        for _ in range(ms // TICK):
            self.now += TICK
            for node_id, raft in self.nodes.items():
                if raft is not None:
                    raft.tick(self.now)
                    self.settle(node_id)
            self.deliver()

    def run_until(self, condition, limit_ms: int = 5000) -> None:
        for _ in range(limit_ms // TICK):
            if condition():
                return
            self.run(TICK)
        raise AssertionError(f"condition not reached within {limit_ms} ms")

    def leaders(self) -> list[Raft]:
        return [r for r in self.nodes.values() if r is not None and r.role == "leader"]

    def leader(self) -> Raft:
        self.run_until(lambda: len(self.leaders()) == 1 and self._followed())
        return self.leaders()[0]

    def _followed(self) -> bool:
        leader = self.leaders()[0]
        config = leader.committed_config
        assert config is not None
        return all(
            self.node(m).leader_id == leader.node_id
            and self.node(m).commit_index == leader.commit_index
            for m in config.member_ids()
            if m not in self.cut and self.nodes[m] is not None
        )

    def propose(self, config: ClusterConfig) -> str | None:
        leader = self.leader()
        reason = leader.propose(config, self.now)
        self.settle(leader.node_id)
        return reason


def solo(node_id: str, *, state: PersistentState | None = None, now: int = 0) -> Raft:
    """A node driven by hand."""
    return Raft(
        node_id,
        now,
        state=state,
        rng=random.Random(1),
        election_timeout_ms=ELECTION_TIMEOUT,
        heartbeat_ms=HEARTBEAT,
    )


def three_nodes(**options: Any) -> tuple[Cluster, Raft]:
    cluster = Cluster(["a", "b", "c"], **options)
    cluster.bootstrap(config_of("a", "b", "c"))
    return cluster, cluster.leader()


# -- configuration values ----------------------------------------------------------------


def test_cluster_config_is_sorted_and_round_trips():
    config = ClusterConfig((("n2", "h2:1"), ("n1", "h1:1")), 64, 2, "x")
    assert config.members == (("n1", "h1:1"), ("n2", "h2:1"))
    assert config.member_ids() == ("n1", "n2")
    assert config.address_of("n2") == "h2:1" and config.address_of("n9") is None
    bigger = config.with_member("n0", "h0:1")
    assert bigger.member_ids() == ("n0", "n1", "n2")
    assert bigger.with_member("n0", "other:2").address_of("n0") == "other:2"
    assert bigger.without_member("n1").member_ids() == ("n0", "n2")
    assert ClusterConfig.from_wire(bigger.to_wire()) == bigger
    assert ClusterConfig.from_wire(tuple(bigger.to_wire())) == bigger


@pytest.mark.parametrize(
    "wire",
    [
        None,
        [],
        ["x", 16, 1],
        ["x", 0, 1, []],
        ["x", 16, 0, []],
        ["x", True, 1, []],
        [5, 16, 1, []],
        ["x", 16, 1, [["a"]]],
        ["x", 16, 1, [["a", "h:1"], ["a", "h:2"]]],
        ["x", 16, 1, [[1, "h:1"]]],
        ["x", 16, 1, "members"],
    ],
)
def test_cluster_config_from_bad_wire_raises_value_error(wire):
    with pytest.raises(ValueError):
        ClusterConfig.from_wire(wire)


def test_persistent_state_round_trips_and_rejects_contradictions():
    state = PersistentState(
        term=3,
        voted_for="b",
        snapshot_index=4,
        snapshot_term=2,
        snapshot_config=config_of("a", "b"),
        entries=[(2, None), (3, config_of("a", "b", "c"))],
        commit_index=5,
        snapshot_config_index=3,
    )
    assert PersistentState.from_wire(state.to_wire()) == state
    wire = state.to_wire()
    wire[7] = 9  # commit index beyond the log
    with pytest.raises(ValueError):
        PersistentState.from_wire(wire)
    wire = state.to_wire()
    wire[1] = 2  # an entry of term 3 in term 2
    with pytest.raises(ValueError):
        PersistentState.from_wire(wire)
    with pytest.raises(ValueError):
        PersistentState.from_wire([99, *state.to_wire()[1:]])


# -- elections and replication -----------------------------------------------------------


def test_a_one_member_cluster_elects_itself_at_bootstrap():
    cluster = Cluster(["a"])
    config = config_of("a")
    raft = cluster.node("a")
    raft.bootstrap(config, 0)
    assert raft.role == "leader" and raft.term == 1 and raft.leader_id == "a"
    assert raft.commit_index == 2  # the bootstrap config (1) and the leader's no-op (2)
    assert raft.committed_config == config and raft.committed_config_index == 1
    state = raft.take_persistent_state()
    assert state is not None and state.term == 1 and state.voted_for == "a"
    assert raft.take_persistent_state() is None  # nothing changed since
    assert raft.take_messages() == []


def test_bootstrap_refuses_a_node_with_state_or_a_config_without_it():
    raft = Raft("a", 0, rng=random.Random(1))
    with pytest.raises(ValueError):
        raft.bootstrap(config_of("b", "c"), 0)
    raft.bootstrap(config_of("a"), 0)
    with pytest.raises(ValueError):
        raft.bootstrap(config_of("a"), 0)


def test_three_nodes_elect_one_leader_and_replicate_its_entry():
    cluster, leader = three_nodes()
    assert leader.term >= 1
    for node_id in "abc":
        raft = cluster.node(node_id)
        assert raft.leader_id == leader.node_id and raft.term == leader.term
        assert raft.commit_index == leader.commit_index == 2
        assert raft.committed_config == config_of("a", "b", "c")
    # No further persistent changes or elections once settled: heartbeats only.
    term = leader.term
    cluster.run(2000)
    assert cluster.leader() is leader and leader.term == term


def test_a_new_member_receives_a_snapshot_and_the_config_commits():
    cluster = Cluster(["a", "b"])
    cluster.node("a").bootstrap(config_of("a"), 0)
    cluster.settle("a")
    leader = cluster.node("a")
    assert cluster.propose(config_of("a", "b")) is None
    # In effect at once on the leader (config on append), agreed only once b has it.
    assert leader.latest_config == config_of("a", "b")
    assert leader.committed_config == config_of("a")
    cluster.deliver()
    cluster.run(200)
    assert any(d == "b" and m[0] == SNAPSHOT for _, d, m in cluster.sent)
    b = cluster.node("b")
    for raft in (leader, b):
        assert raft.committed_config == config_of("a", "b")
        assert raft.committed_config_index == 3  # bootstrap 1, no-op 2, this config 3
    assert b.leader_id == "a"


def test_a_leader_refuses_changes_it_cannot_make_safely():
    cluster, leader = three_nodes()
    follower = cluster.node("b" if leader.node_id != "b" else "c")
    assert follower.propose(config_of("a", "b"), cluster.now) == "not leader"
    assert leader.propose(config_of("a", "b", "c", "d", "e"), cluster.now) == (
        "more than one member changed"
    )
    other = ClusterConfig(config_of("a", "b", "c").members, 16, 2, "another-cluster")
    assert leader.propose(other, cluster.now) == "cluster id differs"
    assert leader.propose(config_of("a", "b", "c", "d"), cluster.now) is None
    assert leader.propose(config_of("a", "b", "c", "e"), cluster.now) == "change in progress"
    cluster.settle(leader.node_id)
    cluster.deliver()
    assert leader.committed_config == config_of("a", "b", "c", "d")
    # Another change of settings only (same members) is fine once the first is agreed.
    assert leader.propose(config_of("a", "b", "c", "d", partitions=32), cluster.now) is None


def test_a_new_leader_makes_no_change_before_committing_an_entry_of_its_term():
    cluster, leader = three_nodes()
    cluster.cut.add(leader.node_id)
    others = [cluster.node(n) for n in "abc" if n != leader.node_id]
    # Run until one of the others wins its vote, but hold its first APPEND back.
    for _ in range(1000):
        cluster.now += TICK
        for raft in others:
            raft.tick(cluster.now)
            cluster.settle(raft.node_id)
        while cluster.queue and not any(r.role == "leader" for r in others):
            source, destination, message = cluster.queue.popleft()
            target = cluster.nodes[destination]
            if target is not None and destination not in cluster.cut and source not in cluster.cut:
                target.receive(source, message, cluster.now)
                cluster.settle(destination)
        if any(r.role == "leader" for r in others):
            break
    new_leader = next(r for r in others if r.role == "leader")
    assert new_leader.propose(config_of("a", "b", "c", "d"), cluster.now) == (
        "no commit in this term yet"
    )
    cluster.deliver()
    assert new_leader.propose(config_of("a", "b", "c", "d"), cluster.now) is None


def test_removing_a_follower_and_then_the_leader():
    cluster, leader = three_nodes()
    follower = next(n for n in "abc" if n != leader.node_id)
    remaining = [n for n in "abc" if n != follower]
    assert cluster.propose(config_of(*remaining)) is None
    cluster.deliver()
    assert leader.committed_config == config_of(*remaining)
    removed = cluster.node(follower)
    removed_term = removed.term
    # The leader tells it that its removal is committed, although it is no member any more.
    cluster.run(100)
    assert removed.committed_config == config_of(*remaining)
    # The leader removes itself: it commits the change, then steps down.
    old_leader = leader.node_id
    survivor = next(n for n in remaining if n != old_leader)
    assert cluster.propose(config_of(survivor)) is None
    cluster.deliver()
    assert leader.role == "follower"
    assert leader.committed_config == config_of(survivor)
    new_leader = cluster.leader()
    assert new_leader.node_id == survivor
    cluster.run(2000)
    # Neither removed node campaigns: their terms never move.
    assert cluster.node(old_leader).term == leader.term
    assert removed.term == removed_term and removed.role == "follower"
    assert cluster.leader() is new_leader


def test_a_leader_that_removed_itself_and_restarted_completes_its_removal():
    """Its removal is in no other log, and the survivor cannot win without its vote; the
    removed node campaigns (not counting itself) to finish the change."""
    cluster = Cluster(["a", "b"])
    cluster.bootstrap(config_of("a", "b"))
    leader = cluster.leader()
    other = "b" if leader.node_id == "a" else "a"
    assert leader.propose(config_of(other), cluster.now) is None
    cluster.settle(leader.node_id)
    cluster.queue.clear()  # crashed before its APPENDs went out
    cluster.crash(leader.node_id)
    restarted = cluster.start(leader.node_id)
    assert restarted.latest_config == config_of(other)
    cluster.run_until(
        lambda: (
            cluster.node(other).role == "leader"
            and cluster.node(other).committed_config == config_of(other)
        )
    )
    assert restarted.committed_config == config_of(other)
    assert restarted.role == "follower"


def test_prevote_keeps_a_cut_off_node_from_raising_its_term():
    cluster, leader = three_nodes()
    follower = cluster.node(next(n for n in "abc" if n != leader.node_id))
    term = follower.term
    cluster.cut.add(follower.node_id)
    cluster.run(3000)  # 15 to 30 election timeouts
    assert follower.term == term
    assert follower.role == "precandidate"
    assert follower.committed_config == config_of("a", "b", "c")  # still serving the map
    cluster.cut.clear()
    cluster.run(500)
    # It rejoins without disturbing anyone: same leader, same term.
    assert cluster.leader() is leader and leader.term == term
    assert follower.leader_id == leader.node_id


def test_check_quorum_steps_a_cut_off_leader_down_keeping_its_config():
    cluster, leader = three_nodes()
    term = leader.term
    cluster.cut.add(leader.node_id)
    cluster.run(ELECTION_TIMEOUT[0] + 3 * HEARTBEAT)
    assert leader.role == "follower" and leader.leader_id is None
    assert leader.term == term
    assert leader.committed_config == config_of("a", "b", "c")
    assert leader.propose(config_of("a", "b"), cluster.now) == "not leader"
    # The majority elects a new leader meanwhile; the old one follows it once healed.
    new_leader = cluster.leader()
    assert new_leader is not leader and new_leader.term > term
    cluster.cut.clear()
    cluster.run(500)
    assert leader.leader_id == new_leader.node_id and leader.term == new_leader.term


def test_stickiness_a_follower_ignores_votes_while_it_hears_its_leader():
    cluster, leader = three_nodes()
    follower = cluster.node(next(n for n in "abc" if n != leader.node_id))
    candidate = next(n for n in "abc" if n not in (leader.node_id, follower.node_id))
    term = follower.term
    request = [VOTE, term + 5, 100, term + 4]  # a better log and a higher term
    follower.receive(candidate, request, cluster.now)
    assert follower.term == term and follower.take_messages() == []
    follower.receive(candidate, [PRE_VOTE, term + 1, 100, term], cluster.now)
    assert follower.take_messages() == [(candidate, [PRE_VOTE_REPLY, term, False])]
    # Once the leader has been silent for the minimum election timeout, it does vote.
    cluster.crash(leader.node_id)
    later = cluster.now + ELECTION_TIMEOUT[0]
    follower.receive(candidate, request, later)
    assert follower.term == term + 5 and follower.voted_for == candidate
    assert follower.take_messages() == [(candidate, [VOTE_REPLY, term + 5, True])]


def test_snapshot_brings_a_lagging_follower_up_to_date():
    cluster, leader = three_nodes(snapshot_threshold=2)
    lagging = cluster.node(next(n for n in "abc" if n != leader.node_id))
    cluster.cut.add(lagging.node_id)
    for partitions in (32, 64, 128, 256):
        assert cluster.propose(config_of("a", "b", "c", partitions=partitions)) is None
        cluster.deliver()
    assert leader.status()["snapshot_index"] > lagging.status()["last_index"]
    cluster.sent.clear()
    cluster.cut.clear()
    cluster.run(200)
    assert any(d == lagging.node_id and m[0] == SNAPSHOT for _, d, m in cluster.sent)
    assert lagging.committed_config == config_of("a", "b", "c", partitions=256)
    assert lagging.committed_config_index == leader.committed_config_index
    assert lagging.commit_index == leader.commit_index


def test_restart_from_the_persisted_state():
    cluster, leader = three_nodes()
    assert cluster.propose(config_of("a", "b", "c", partitions=64)) is None
    cluster.run(100)  # followers learn the commit with the next heartbeat
    node_id = next(n for n in "abc" if n != leader.node_id)
    before = cluster.node(node_id)
    cluster.crash(node_id)
    after = cluster.start(node_id)
    assert after.term == before.term and after.voted_for == before.voted_for
    assert after.status()["last_index"] == before.status()["last_index"]
    # The commit index is kept too: cut off after a restart, it still knows the agreed map.
    assert after.commit_index == before.commit_index
    assert after.committed_config == config_of("a", "b", "c", partitions=64)
    assert after.role == "follower" and after.leader_id is None


def test_a_vote_survives_a_restart():
    raft = solo("v")
    raft.bootstrap(config_of("v", "x", "y"), 0)
    raft.receive("y", [VOTE, 1, 0, 0], 500)  # term 1 adopted, vote refused (shorter log)
    assert raft.take_messages() == [("y", [VOTE_REPLY, 1, False])]
    raft.take_persistent_state()
    raft.receive("x", [VOTE, 1, 1, 0], 500)
    assert raft.take_messages() == [("x", [VOTE_REPLY, 1, True])]
    state = raft.take_persistent_state()  # the vote alone must be persisted, before the reply
    assert state is not None and state.voted_for == "x" and state.term == 1
    restarted = solo("v", state=PersistentState.from_wire(state.to_wire()), now=600)
    restarted.receive("y", [VOTE, 1, 5, 0], 600)  # y's log is even better: still no
    assert restarted.take_messages() == [("y", [VOTE_REPLY, 1, False])]
    restarted.receive("x", [VOTE, 1, 1, 0], 600)  # a repeated request is granted again
    assert restarted.take_messages() == [("x", [VOTE_REPLY, 1, True])]


def test_a_removed_node_does_not_disrupt_the_cluster():
    cluster = Cluster(["a", "b", "c", "d"])
    cluster.bootstrap(config_of("a", "b", "c", "d"))
    leader = cluster.leader()
    removed = next(n for n in "abcd" if n != leader.node_id)
    cluster.cut.add(removed)  # it never hears of its removal
    remaining = [n for n in "abcd" if n != removed]
    assert cluster.propose(config_of(*remaining)) is None
    cluster.deliver()
    assert leader.committed_config == config_of(*remaining)
    term = leader.term
    cluster.run(1000)  # it campaigns meanwhile (PreVote only: its term stays)
    cluster.cut.clear()
    cluster.run(3000)
    assert cluster.leader() is leader and leader.term == term
    for node_id in remaining:
        assert cluster.node(node_id).term == term


def test_a_lagging_voter_votes_for_a_member_it_has_not_heard_of():
    """A voter whose latest config predates the candidate's addition must still vote for
    it when the candidate's log is better; a non-member with a worse log is ignored."""
    raft = solo("v")
    raft.bootstrap(config_of("v", "x"), 0)
    raft.receive("newcomer", [PRE_VOTE, 1, 5, 0], 500)
    assert raft.take_messages() == [("newcomer", [PRE_VOTE_REPLY, 1, True])]
    raft.receive("newcomer", [VOTE, 1, 5, 0], 500)
    assert raft.take_messages() == [("newcomer", [VOTE_REPLY, 1, True])]
    raft.receive("stranger", [VOTE, 9, 0, 0], 500)
    assert raft.take_messages() == [] and raft.term == 1


def test_last_ack_ms_is_the_send_time_of_the_newest_answered_request():
    cluster, leader = three_nodes()
    follower_id = next(n for n in "abc" if n != leader.node_id)
    follower = cluster.node(follower_id)
    assert follower.last_ack_ms(leader.node_id) is None  # leaders only
    cluster.run(100)
    ack = leader.last_ack_ms(follower_id)
    assert ack is not None and cluster.now - HEARTBEAT - TICK <= ack <= cluster.now
    # A request that reaches the follower late: its answer counts from when it was sent.
    cluster.cut.add(follower_id)
    cluster.run(HEARTBEAT)
    held = next(m for _, d, m in reversed(cluster.sent) if d == follower_id and m[0] == APPEND)
    cluster.run(60)
    assert leader.last_ack_ms(follower_id) == ack
    follower.receive(leader.node_id, held, cluster.now)
    [(_, reply)] = follower.take_messages()
    leader.receive(follower_id, reply, cluster.now)
    assert leader.last_ack_ms(follower_id) == held[6] < cluster.now - 50
    # And an answer older than the newest one changes nothing.
    leader.receive(follower_id, [APPEND_REPLY, leader.term, True, 1, 1, ack - 50], cluster.now)
    assert leader.last_ack_ms(follower_id) == held[6]


def test_a_removed_node_is_told_until_it_answers_and_a_silent_one_is_given_up():
    cluster = Cluster(["a", "b", "c", "d"])
    cluster.bootstrap(config_of("a", "b", "c", "d"))
    leader = cluster.leader()
    silent, told = [n for n in "abcd" if n != leader.node_id][:2]
    cluster.cut.add(silent)
    assert cluster.propose(config_of(*[n for n in "abcd" if n != silent])) is None
    cluster.deliver()
    cluster.run(50)
    assert cluster.propose(config_of(*[n for n in "abcd" if n not in (silent, told)])) is None
    cluster.run(100)
    # Removed and reachable: it learns its removal is committed, then is left alone.
    assert told not in cluster.node(told).committed_config.member_ids()
    cluster.sent.clear()
    cluster.run(500)
    to = {d for s, d, _ in cluster.sent if s == leader.node_id}
    assert told not in to
    # Removed and unreachable: the leader keeps trying for a while, then gives up.
    assert silent in to
    cluster.run(10 * ELECTION_TIMEOUT[1])
    cluster.sent.clear()
    cluster.run(500)
    assert silent not in {d for s, d, _ in cluster.sent if s == leader.node_id}


def candidate_of_term_1() -> Raft:
    """Node "a" of {a, b, c}, made a candidate in term 1 by hand."""
    raft = solo("a")
    raft.bootstrap(config_of("a", "b", "c"), 0)
    raft.tick(raft.next_deadline_ms())
    assert raft.role == "precandidate" and raft.term == 0
    raft.receive("b", [PRE_VOTE_REPLY, 1, True], raft.next_deadline_ms() - 1)
    assert raft.role == "candidate" and raft.term == 1
    raft.take_messages()
    return raft


def test_votes_count_only_in_their_own_term():
    raft = candidate_of_term_1()
    now = raft.next_deadline_ms() - 1
    raft.receive("b", [VOTE_REPLY, 0, True], now)  # a late grant of an earlier election
    assert raft.role == "candidate"
    raft.receive("c", [VOTE_REPLY, 1, False], now)
    assert raft.role == "candidate"
    raft.receive("b", [VOTE_REPLY, 1, True], now)
    assert raft.role == "leader" and raft.term == 1


def test_a_vote_needs_a_log_at_least_as_up_to_date():
    raft = solo("v")
    raft.bootstrap(config_of("v", "x", "y"), 0)
    raft.receive("x", [VOTE, 3, 0, 0], 500)  # shorter log than the bootstrap's index 1
    assert raft.take_messages() == [("x", [VOTE_REPLY, 3, False])]
    assert raft.term == 3 and raft.voted_for is None
    raft.receive("y", [PRE_VOTE, 4, 0, 0], 500)
    assert raft.take_messages() == [("y", [PRE_VOTE_REPLY, 3, False])]
    raft.receive("y", [VOTE, 3, 1, 0], 500)
    assert raft.take_messages() == [("y", [VOTE_REPLY, 3, True])]


def test_entries_of_an_earlier_term_are_not_committed_by_counting_replicas():
    """Raft's Figure 8: index 2 (term 1) is on a majority once b has it, but only the new
    leader's own entry (index 3, term 2) may be committed by counting, and it commits both."""
    state = PersistentState(1, None, 1, 0, config_of("a", "b", "c"), [(1, None)], 1, 1)
    raft = solo("a", state=state)
    now = raft.next_deadline_ms()
    raft.tick(now)
    raft.receive("b", [PRE_VOTE_REPLY, 2, True], now)
    raft.receive("b", [VOTE_REPLY, 2, True], now)
    assert raft.role == "leader" and raft.term == 2 and raft.status()["last_index"] == 3
    raft.receive("b", [APPEND_REPLY, 2, True, 2, 1, now], now)
    assert raft.commit_index == 1
    raft.receive("b", [APPEND_REPLY, 2, True, 3, 1, now], now)
    assert raft.commit_index == 3


def follower_with_two_entries_of_term_1() -> Raft:
    state = PersistentState(1, None, 1, 0, config_of("a", "b", "c"), [(1, None), (1, None)], 1, 1)
    return solo("b", state=state)


def test_a_follower_commits_no_further_than_the_entries_it_was_sent():
    """Its entry 3 (term 1) is not the leader's entry 3: the leader's commit index 3 only
    says that the leader's entry 3 is committed."""
    raft = follower_with_two_entries_of_term_1()
    raft.receive("a", [APPEND, 2, 1, 0, [[1, None]], 3, 100], 100)
    assert raft.take_messages() == [("a", [APPEND_REPLY, 2, True, 2, 2, 100])]
    assert raft.commit_index == 2


def test_a_late_append_does_not_cut_the_log_short():
    raft = follower_with_two_entries_of_term_1()
    raft.receive("a", [APPEND, 1, 1, 0, [[1, None]], 1, 100], 100)  # entry 2 only
    assert raft.status()["last_index"] == 3
    raft.receive("a", [APPEND, 2, 2, 1, [[2, None]], 1, 100], 100)  # entry 3 differs: cut
    assert raft.status()["last_index"] == 3 and raft.take_persistent_state().entries == [
        (1, None),
        (2, None),
    ]


def test_messages_are_plain_data():
    cluster, leader = three_nodes(snapshot_threshold=2)
    cluster.cut.add("c" if leader.node_id != "c" else "b")
    for partitions in (32, 64, 128):
        cluster.propose(config_of("a", "b", "c", partitions=partitions))
        cluster.deliver()
    cluster.cut.clear()
    cluster.run(300)
    kinds = set()

    def check(value: Any) -> None:
        assert value is None or type(value) in (int, str, bool, list), value
        if isinstance(value, list):
            for item in value:
                check(item)

    for _, _, message in cluster.sent:
        kinds.add(message[0])
        check(message)
    assert kinds == {PRE_VOTE, PRE_VOTE_REPLY, VOTE, VOTE_REPLY, APPEND, APPEND_REPLY, SNAPSHOT}


# -- malformed input ---------------------------------------------------------------------

CONFIG_WIRE = config_of("a", "b").to_wire()
MALFORMED: list[Any] = [
    "text",
    None,
    7,
    {},
    [],
    [APPEND],
    [99, 1],
    [PRE_VOTE, -1, 0, 0],
    [PRE_VOTE, True, 0, 0],
    [PRE_VOTE, 1, 0, 2],  # last term beyond the term
    [VOTE, 1, 0],
    [VOTE_REPLY, 5, "yes"],
    [APPEND, 1, 0, 0, "entries", 0, 0],
    [APPEND, 1, 0, 0, [[1, "config"]], 0, 0],
    [APPEND, 1, 0, 0, [[2, None]], 0, 0],  # entry term beyond the message term
    [APPEND, 3, 0, 2, [[1, None]], 0, 0],  # entry terms going down
    [APPEND, 1, 0, 0, [[1, ["c", 16, 1, [["a", "h"], ["a", "h"]]]]], 0, 0],
    [APPEND, 1, 0, 0, [], 0, 1.5],
    [APPEND_REPLY, 1, 1, 0, 0, 0],
    [APPEND_REPLY, 1, True, 0, 0],
    [SNAPSHOT, 1, 0, 0, CONFIG_WIRE, 1, 0],
    [SNAPSHOT, 1, 5, 1, ["c", 0, 1, []], 1, 0],
    [SNAPSHOT, 1, 5, 1, CONFIG_WIRE, 6, 0],  # config index beyond the snapshot
    [SNAPSHOT, 1, 5, 2, CONFIG_WIRE, 1, 0],
]


@pytest.mark.parametrize("message", MALFORMED, ids=range(len(MALFORMED)))
def test_a_malformed_message_is_logged_and_ignored(message, caplog):
    raft = Raft("a", 0, rng=random.Random(1))
    raft.bootstrap(config_of("a", "b"), 0)
    raft.take_persistent_state()
    before = raft.status()
    with caplog.at_level(logging.WARNING, logger="fastbroker.cluster.raft"):
        raft.receive("b", message, 10)
    assert raft.status() == before
    assert raft.take_messages() == [] and raft.take_persistent_state() is None
    assert "malformed" in caplog.text


values = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.text(max_size=3),
    lambda children: st.lists(children, max_size=6),
    max_leaves=25,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.integers(0, 8),
    rest=st.lists(values, max_size=7),
    leader=st.booleans(),
)
def test_receive_never_raises(kind, rest, leader):
    raft = solo("a")
    raft.bootstrap(config_of("a") if leader else config_of("a", "b", "c"), 0)
    raft.receive("b", [kind, *rest], 500)
    raft.tick(1000)
    assert raft.commit_index <= raft.status()["last_index"]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from([APPEND, SNAPSHOT, APPEND_REPLY, VOTE, PRE_VOTE]),
            st.integers(0, 4),
            st.integers(0, 6),
            st.integers(0, 4),
        ),
        max_size=12,
    )
)
def test_well_formed_but_arbitrary_messages_keep_the_state_consistent(messages):
    """Messages a correct peer would never send still leave a consistent state behind."""
    raft = solo("a")
    raft.bootstrap(config_of("a", "b", "c"), 0)
    now = 0
    for kind, term, index, other in messages:
        now += 50
        if kind == APPEND:
            entries = [[term, None]] * (other % 3)
            message = [APPEND, term, index, min(term, other), entries, index + other, now]
        elif kind == SNAPSHOT:
            message = [SNAPSHOT, term, max(1, index), min(term, other), CONFIG_WIRE, 1, now]
        elif kind == APPEND_REPLY:
            message = [APPEND_REPLY, term, bool(other % 2), index, other, now]
        else:
            message = [kind, term, index, min(term, other)]
        raft.receive("b", message, now)
        raft.tick(now)
        state = raft.take_persistent_state()
        if state is not None:
            PersistentState.from_wire(state.to_wire())  # checks its own consistency
        assert raft.commit_index <= raft.status()["last_index"]
        assert raft.latest_config is not None and raft.committed_config is not None
