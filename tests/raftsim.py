"""Deterministic simulation of fastbroker's Raft (src/fastbroker/cluster/raft.py).

One seeded `random.Random` drives everything: a virtual clock, a network that drops, delays,
reorders and duplicates messages and partitions and heals node sets, crashes and restarts from
the last persisted state, and random membership changes over a pool of 7 node ids (clusters of
1 to 5 members). The same seed always gives the same run, so a failure is reproduced by its
seed alone.

Checked after every step (a violation raises `SimulationFailure`, which names the seed):
- election safety: at most one leader per term;
- votes: a node votes at most once per term, and its term never goes back, across restarts;
- log matching: two logs holding an entry of the same index and term hold the same entry and
  agree on the term before it (by induction: the same prefix), snapshots included;
- state machine safety: no two nodes ever commit different entries (or configs) at one index,
  and a node's commit index never goes back, across restarts;
- leader completeness: a new leader of term T holds every entry committed in terms before T;
- one change at a time: each config in a log differs from the one before by at most one
  member, a leader never has two uncommitted configs, and a node's latest config is the last
  one in its log (configs take effect on append);
- PreVote: a node cut off alone (and not a one-member cluster) never raises its term.
At the end (everything restarted and healed, no loss) there must soon be one leader whose
config is committed, with every member following it at the same commit index and config.

Run one seed: ``RAFTSIM_SEED=N pytest tests/test_raft_sim.py``; ``RAFTSIM_TRACE=1`` adds the
last events of a failing run to its message.
"""

from __future__ import annotations

import heapq
import os
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from fastbroker.cluster.raft import LEADER, SNAPSHOT, ClusterConfig, PersistentState, Raft

POOL = tuple(f"n{i}" for i in range(7))
MAX_MEMBERS = 5
# Narrow ranges give split votes; wide ones quick elections. Latencies are up to half the
# minimum timeout, so stale messages of earlier terms are common.
ELECTION_TIMEOUTS_MS = ((100, 200), (100, 120))
HEARTBEAT_MS = 20
QUIET_LIMIT_MS = 6000  # the quiet phase's bound for the cluster to settle

# Event kinds. The fault streams each reschedule themselves at their own random rate.
DELIVER, TICK, CHECK, PROPOSE, CRASH, RESTART, PARTITION, HEAL, NETWORK = range(9)
FAULTS = (PROPOSE, CRASH, RESTART, PARTITION, HEAL, NETWORK)

RaftFactory = Callable[..., Raft]


class SimulationFailure(AssertionError):
    pass


def address(node_id: str) -> str:
    return f"10.0.0.{node_id[1:]}:7000"


def plain(value: Any) -> Any:
    """A copy made of what the Rust codec carries (lists, not tuples); raises otherwise."""
    if value is None or type(value) in (int, str, bool):
        return value
    if type(value) in (list, tuple):
        return [plain(item) for item in value]
    if type(value) is dict:
        return {plain(k): plain(v) for k, v in value.items()}
    raise TypeError(f"a message holds a {type(value).__name__}: {value!r}")


def differs_by_at_most_one_member(a: ClusterConfig, b: ClusterConfig) -> bool:
    return len(set(a.member_ids()) ^ set(b.member_ids())) <= 1


class SimNode:
    __slots__ = ("disk", "incarnation", "led_term", "node_id", "raft", "tick_at", "top_commit")

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.raft: Raft | None = None  # None while crashed
        self.disk: PersistentState | None = None  # the last persisted state
        self.incarnation = 0
        self.tick_at = -1  # the pending tick event's time, -1 if none
        self.led_term = -1  # the last term in which it was seen as leader
        self.top_commit = 0  # the highest commit index ever seen (persisted, so never lower)


class Simulation:
    def __init__(self, seed: int, *, raft_factory: RaftFactory = Raft) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.raft_factory = raft_factory
        self.now = 0
        self.queue: list[tuple[int, int, int, Any, Any, Any]] = []
        self.sequence = 0
        self.nodes = {node_id: SimNode(node_id) for node_id in POOL}
        self.trace: deque[tuple[Any, ...]] = deque(maxlen=400)
        self.steps = 0
        # The network.
        self.group = dict.fromkeys(POOL, 0)  # nodes talk only within their group
        self.isolated_at_term: dict[str, int] = {}  # alone in a group: its term then
        rng = self.rng
        self.election_timeout_ms = rng.choice(ELECTION_TIMEOUTS_MS)
        # Few entries per APPEND: a follower acknowledges a prefix of a new leader's entries
        # (Raft's Figure 8 needs that); a low threshold makes snapshots frequent.
        self.max_entries_per_append = rng.choice((1, 2, 64))
        self.snapshot_threshold = rng.choice((2, 4, 32))
        self._pick_network()
        self.chaos_ms = rng.randint(1000, 4000)
        self.propose_gap_ms = rng.choice((5, 20, 80))
        self.crash_gap_ms = rng.choice((100, 300, 1000))
        self.restart_within_ms = rng.choice((20, 200))
        self.partition_gap_ms = rng.choice((150, 500, 1500))
        # Leaders also crash right after a step (before or after sending its messages): that
        # leaves entries on a minority, the raw material of Raft's dangerous cases.
        self.leader_crash = rng.choice((0.0, 0.003, 0.01, 0.03))
        # What the checks remember across the whole run.
        self.leaders: dict[int, str] = {}
        self.votes: dict[tuple[str, int], str] = {}
        self.terms: dict[str, int] = dict.fromkeys(POOL, 0)
        self.entries: dict[tuple[int, int], tuple[ClusterConfig | None, int, ClusterConfig]] = {}
        self.effective: dict[tuple[int, int], ClusterConfig] = {}  # config in effect at (i, t)
        self.committed: dict[int, tuple[int, ClusterConfig]] = {}  # index: (term, config)
        self.committed_in: dict[int, int] = {}  # index: the term in which it was seen committed
        self.top_committed = 1  # the highest index ever committed (the bootstrap is at 1)
        self.proposals = self.accepted = self.snapshots_sent = 0

    # -- running ---------------------------------------------------------------------------

    def run(self) -> Simulation:
        try:
            self._setup()
            self._run_until(self.chaos_ms)
            self._heal_everything()
            self._push(self.now + 10, CHECK, None, None, None)
            self._run_until(self.now + QUIET_LIMIT_MS)
            problem = self._liveness_problem()
            if problem is not None:
                self.fail(f"liveness: {problem} after a {QUIET_LIMIT_MS} ms quiet period")
        except SimulationFailure:
            raise
        except Exception as error:
            self.fail(f"{type(error).__name__}: {error}", cause=error)
        return self

    def fail(self, what: str, cause: BaseException | None = None) -> None:
        lines = [
            f"raft simulation seed {self.seed} failed at t={self.now} ms (step {self.steps}): "
            f"{what}",
            f"reproduce: RAFTSIM_SEED={self.seed} pytest tests/test_raft_sim.py",
        ]
        if os.environ.get("RAFTSIM_TRACE"):
            lines.append("last events (time, event, node, from/detail, message):")
            lines.extend(f"  {event}" for event in self.trace)
            lines.extend(self._describe_nodes())
        else:
            lines.append("(RAFTSIM_TRACE=1 adds the last events and every node's state)")
        raise SimulationFailure("\n".join(lines)) from cause

    def _describe_nodes(self) -> list[str]:
        lines = []
        for node in self.nodes.values():
            raft = node.raft
            if raft is None:
                lines.append(f"  {node.node_id}: down")
                continue
            latest = raft.latest_config.member_ids() if raft.latest_config else None
            lines.append(f"  {node.node_id}: {raft.status()} latest members {latest}")
        return lines

    def _setup(self) -> None:
        rng = self.rng
        size = rng.choice((1, 2, 3, 3, 4, 5, 5))
        founders = rng.sample(POOL, size)
        config = ClusterConfig(
            tuple((n, address(n)) for n in founders),
            partitions=rng.choice((16, 64)),
            replication_factor=rng.randint(1, 3),
            cluster_id=f"sim-{self.seed}",
        )
        for node in self.nodes.values():
            self._start(node)
        record = self.effective[(1, 0)] = config
        self.committed[1] = (0, record)
        self.committed_in[1] = 0
        for node_id in founders:
            node = self.nodes[node_id]
            assert node.raft is not None
            node.raft.bootstrap(config, self.now)
            self._after_step(node)
        for kind, gap in (
            (PROPOSE, self.propose_gap_ms),
            (CRASH, self.crash_gap_ms),
            (PARTITION, self.partition_gap_ms),
            (NETWORK, 500),
        ):
            self._push(self.now + rng.randint(1, gap), kind, None, None, None)

    def _run_until(self, end: int) -> None:
        queue = self.queue
        nodes = self.nodes
        trace = self.trace.append
        while queue and queue[0][0] <= end:
            when, _, kind, a, b, c = heapq.heappop(queue)
            self.now = when
            if kind == DELIVER:
                node = nodes[a]
                raft = node.raft
                if raft is None or self.group[a] != self.group[b]:
                    continue
                trace((when, "recv", a, b, c))
                self.steps += 1
                raft.receive(b, c, when)
                self._after_step(node)
            elif kind == TICK:
                node = nodes[a]
                if node.raft is None or node.incarnation != b or node.tick_at != when:
                    continue
                node.tick_at = -1
                trace((when, "tick", a))
                self.steps += 1
                node.raft.tick(when)
                self._after_step(node)
            elif kind == CHECK:
                if self._liveness_problem() is None:
                    queue.clear()
                    return
                self._push(when + 10, CHECK, None, None, None)
            else:
                self._fault(kind, a)
        self.now = max(self.now, end)

    def _push(self, when: int, kind: int, a: Any, b: Any, c: Any) -> None:
        self.sequence += 1
        heapq.heappush(self.queue, (when, self.sequence, kind, a, b, c))

    def _start(self, node: SimNode) -> None:
        state = None if node.disk is None else PersistentState.from_wire(node.disk.to_wire())
        node.raft = self.raft_factory(
            node.node_id,
            self.now,
            state=state,
            rng=random.Random(self.rng.getrandbits(32)),
            election_timeout_ms=self.election_timeout_ms,
            heartbeat_ms=HEARTBEAT_MS,
            snapshot_threshold=self.snapshot_threshold,
            max_entries_per_append=self.max_entries_per_append,
        )
        node.incarnation += 1
        node.tick_at = -1
        node.led_term = -1
        self._check_node(node)
        self._schedule_tick(node)

    def _after_step(self, node: SimNode) -> None:
        raft = node.raft
        assert raft is not None
        # As the real caller does: persist first, then send.
        state = raft.take_persistent_state()
        if state is not None:
            self._check_state(node, state)
            node.disk = state
        messages = raft.take_messages()
        self._check_node(node)
        if raft.role == LEADER and self.leader_crash and self.rng.random() < self.leader_crash:
            if self.rng.random() < 0.5:
                messages = messages[: self.rng.randint(0, len(messages))]
            for destination, message in messages:
                self._send(node.node_id, destination, message)
            self._crash(node)
            return
        for destination, message in messages:
            self._send(node.node_id, destination, message)
        self._schedule_tick(node)

    def _crash(self, node: SimNode) -> None:
        self.trace.append((self.now, "crash", node.node_id))
        node.raft = None
        restart = self.now + self.rng.randint(0, self.restart_within_ms)
        self._push(restart, RESTART, node.node_id, None, None)

    def _schedule_tick(self, node: SimNode) -> None:
        raft = node.raft
        assert raft is not None
        # Real callers tick on a timer, a little late: so does this, by a random 0-9 ms.
        when = max(raft.next_deadline_ms(), self.now) + self.rng.randint(0, 9)
        if node.tick_at == -1 or when < node.tick_at:
            node.tick_at = when
            self._push(when, TICK, node.node_id, node.incarnation, None)

    def _send(self, source: str, destination: str, message: list[Any]) -> None:
        rng = self.rng
        if destination not in self.nodes:
            self.fail(f"{source} sent to unknown node {destination!r}")
        if message[0] == SNAPSHOT:
            self.snapshots_sent += 1
        message = plain(message)
        if rng.random() < self.drop:
            return
        copies = 2 if rng.random() < self.duplicate else 1
        for _ in range(copies):
            if rng.random() < self.long_delay:
                delay = rng.randint(20, 400)  # reordered behind many later messages
            else:
                delay = rng.randint(1, self.latency_ms)
            self._push(self.now + delay, DELIVER, destination, source, message)

    # -- faults ----------------------------------------------------------------------------

    def _fault(self, kind: int, node_id: str | None) -> None:
        rng = self.rng
        now = self.now
        if kind == PROPOSE:
            self._propose()
            self._push(now + rng.randint(1, self.propose_gap_ms), PROPOSE, None, None, None)
        elif kind == CRASH:
            up = [n for n in self.nodes.values() if n.raft is not None]
            if len(up) > 1:
                # Leaders crash more often: their half-replicated entries make the hard cases.
                leaders = [n for n in up if n.raft is not None and n.raft.role == LEADER]
                node = rng.choice(leaders) if leaders and rng.random() < 0.5 else rng.choice(up)
                self._crash(node)
            self._push(now + rng.randint(1, self.crash_gap_ms), CRASH, None, None, None)
        elif kind == RESTART:
            assert node_id is not None
            node = self.nodes[node_id]
            if node.raft is None:
                self.trace.append((now, "restart", node_id))
                self._start(node)
        elif kind == PARTITION:
            self._partition()
            self._push(now + rng.randint(20, 400), HEAL, None, None, None)
            self._push(now + rng.randint(1, self.partition_gap_ms), PARTITION, None, None, None)
        elif kind == HEAL:
            self._set_groups(dict.fromkeys(POOL, 0))
        elif kind == NETWORK:
            self._pick_network()
            self._push(now + rng.randint(1, 500), NETWORK, None, None, None)

    def _pick_network(self) -> None:
        rng = self.rng
        self.latency_ms = rng.choice((5, 20, 50))
        self.drop = rng.choice((0.0, 0.02, 0.1, 0.3))
        self.duplicate = rng.choice((0.0, 0.05, 0.2))
        self.long_delay = rng.choice((0.0, 0.05, 0.2))

    def _partition(self) -> None:
        rng = self.rng
        if rng.random() < 0.4:
            alone = rng.choice(POOL)  # cut one node off (often the leader)
            leaders = [n.node_id for n in self.nodes.values() if n.raft and n.raft.role == LEADER]
            if leaders and rng.random() < 0.5:
                alone = rng.choice(leaders)
            groups = {n: (1 if n == alone else 0) for n in POOL}
        else:
            count = rng.randint(2, 3)
            groups = {n: rng.randrange(count) for n in POOL}
        self._set_groups(groups)

    def _set_groups(self, groups: dict[str, int]) -> None:
        self.group = groups
        self.trace.append((self.now, "groups", dict(groups)))
        sizes: dict[int, int] = {}
        for group in groups.values():
            sizes[group] = sizes.get(group, 0) + 1
        self.isolated_at_term = {}
        for node_id, group in groups.items():
            if sizes[group] == 1:
                self.isolated_at_term[node_id] = self.terms[node_id]

    def _propose(self) -> None:
        rng = self.rng
        up = [n for n in self.nodes.values() if n.raft is not None]
        leaders = [n for n in up if n.raft is not None and n.raft.role == LEADER]
        node = rng.choice(leaders) if leaders and rng.random() < 0.85 else rng.choice(up)
        raft = node.raft
        assert raft is not None
        current = raft.latest_config
        if current is None:
            return  # a node that never joined has nothing to change
        was_leader = raft.role == LEADER
        members = current.member_ids()
        outsiders = [n for n in POOL if n not in members]
        kind = rng.random()
        must_refuse = False
        if kind < 0.45 and outsiders and len(members) < MAX_MEMBERS:
            added = rng.choice(outsiders)
            proposal = current.with_member(added, address(added))
        elif kind < 0.85 and len(members) > 1:
            # A leader removing itself steps down (an election follows): now and then only.
            others = [m for m in members if m != node.node_id]
            removed = node.node_id if rng.random() < 0.1 else rng.choice(others)
            proposal = current.without_member(removed)
        elif kind < 0.93 or len(outsiders) < 2:
            # Same members, other settings: allowed like any single change.
            proposal = ClusterConfig(
                current.members,
                current.partitions * 2,
                current.replication_factor,
                current.cluster_id,
            )
        else:
            first, second = rng.sample(outsiders, 2)
            proposal = current.with_member(first, address(first)).with_member(
                second, address(second)
            )
            must_refuse = True
        self.proposals += 1
        reason = raft.propose(proposal, self.now)
        self.trace.append((self.now, "propose", node.node_id, proposal.member_ids(), reason))
        if not was_leader and reason != "not leader":
            self.fail(f"{node.node_id} (not leader) answered a proposal with {reason!r}")
        if must_refuse and reason is None:
            self.fail(f"{node.node_id} accepted a change of two members: {proposal}")
        if reason is None:
            self.accepted += 1
            if raft.latest_config != proposal:
                self.fail(f"{node.node_id}: an accepted config is not in effect at once")
        self._after_step(node)

    def _heal_everything(self) -> None:
        self.trace.append((self.now, "heal everything"))
        self._set_groups(dict.fromkeys(POOL, 0))
        self.drop = self.duplicate = self.long_delay = 0.0
        self.latency_ms = 5
        self.queue[:] = [e for e in self.queue if e[2] not in FAULTS]
        heapq.heapify(self.queue)
        for node in self.nodes.values():
            if node.raft is None:
                self._start(node)

    # -- checks ----------------------------------------------------------------------------

    def _check_state(self, node: SimNode, state: PersistentState) -> None:
        """Runs whenever a node's persistent state changed (its log, term, vote or commit)."""
        node_id = node.node_id
        raft = node.raft
        assert raft is not None
        if state.term < self.terms[node_id]:
            self.fail(f"{node_id}: term went back from {self.terms[node_id]} to {state.term}")
        self.terms[node_id] = state.term
        if node_id in self.isolated_at_term and state.term > self.isolated_at_term[node_id]:
            config = raft.latest_config
            if config is not None and len(config.members) == 1:
                self.isolated_at_term[node_id] = state.term  # a one-member cluster: may elect
            else:
                self.fail(
                    f"{node_id}: term rose from {self.isolated_at_term[node_id]} to "
                    f"{state.term} while cut off alone (PreVote should prevent it)"
                )
        vote_key = (node_id, state.term)
        voted = self.votes.get(vote_key)
        if voted is not None and state.voted_for != voted:
            self.fail(f"{node_id}: voted for {voted} then {state.voted_for} in term {state.term}")
        if state.voted_for is not None:
            self.votes[vote_key] = state.voted_for
        if state.commit_index < node.top_commit:
            self.fail(f"{node_id}: commit index went back to {state.commit_index}")
        node.top_commit = state.commit_index
        if state.commit_index > self.top_committed:
            self._check_new_commit(node, state)

        # Walk the log from the snapshot, checking it against every log ever seen.
        index = state.snapshot_index
        previous_term = state.snapshot_term
        config = state.snapshot_config
        commit = state.commit_index
        if config is not None:
            key = (index, previous_term)
            known = self.effective.get(key)
            if known is None:
                self.effective[key] = config
            elif known != config:
                self.fail(f"{node_id}: snapshot {key} holds {config}, elsewhere {known}")
            self._check_committed(node, index, previous_term, config)
        uncommitted_configs = 0
        for term, entry_config in state.entries:
            index += 1
            if entry_config is not None:
                if config is not None and (
                    not differs_by_at_most_one_member(config, entry_config)
                    or entry_config.cluster_id != config.cluster_id
                ):
                    self.fail(f"{node_id}: config {index} changes more than one member")
                config = entry_config
                if index > commit:
                    uncommitted_configs += 1
            assert config is not None
            key = (index, term)
            record = (entry_config, previous_term, config)
            known_entry = self.entries.get(key)
            if known_entry is None:
                self.entries[key] = record
                self.effective.setdefault(key, config)
            elif known_entry != record:
                self.fail(
                    f"log matching: {node_id} holds {record} at {key}, another log {known_entry}"
                )
            if index <= commit:
                self._check_committed(node, index, term, config)
            previous_term = term
        if raft.latest_config != config:
            self.fail(f"{node_id}: latest config is not the last one in its log")
        if raft.role == LEADER and uncommitted_configs > 1:
            self.fail(f"leader {node_id} has {uncommitted_configs} uncommitted configs")
        if raft.commit_index != commit:
            self.fail(f"{node_id}: persisted commit index differs from the live one")

    def _check_new_commit(self, node: SimNode, state: PersistentState) -> None:
        """``state`` commits indexes for the first time. Only a leader decides that, and only
        by counting replicas of an entry of its own term (Raft's Figure 8): the disks of a
        majority of its config must hold an entry of its term at the commit index or after."""
        raft = node.raft
        assert raft is not None
        index = state.commit_index
        term = raft.term
        if raft.role != LEADER and self.leaders.get(term) != node.node_id:  # (or stepped down)
            self.fail(f"{node.node_id}, not a leader, is the first to commit index {index}")
        config = raft.latest_config
        assert config is not None
        holders = []
        for member in config.member_ids():
            disk = state if member == node.node_id else self.nodes[member].disk
            if disk is None:
                continue
            start = max(0, index - disk.snapshot_index - 1)
            if any(entry[0] == term for entry in disk.entries[start:]) or (
                disk.snapshot_index >= index and disk.snapshot_term == term
            ):
                holders.append(member)
        if len(holders) <= len(config.members) // 2:
            self.fail(
                f"{node.node_id} (term {term}) committed {index} though only {holders} hold "
                f"an entry of its term there or after"
            )
        self.top_committed = index

    def _check_committed(self, node: SimNode, index: int, term: int, config: ClusterConfig) -> None:
        known = self.committed.get(index)
        if known is None:
            self.committed[index] = (term, config)
            assert node.raft is not None
            self.committed_in[index] = node.raft.term
        elif known != (term, config):
            self.fail(
                f"state machine safety: {node.node_id} committed {(term, config)} at {index}, "
                f"another node {known}"
            )

    def _check_node(self, node: SimNode) -> None:
        """Runs after every step: cheap checks of the live state."""
        raft = node.raft
        assert raft is not None
        if raft.role != LEADER:
            return
        term = raft.term
        if node.led_term == term:
            return
        node.led_term = term
        leader = self.leaders.setdefault(term, node.node_id)
        if leader != node.node_id:
            self.fail(f"election safety: {leader} and {node.node_id} both lead term {term}")
        # It was elected by a majority of its config whose votes for it were on disk.
        config = raft.latest_config
        assert config is not None
        voters = [m for m in config.member_ids() if self.votes.get((m, term)) == node.node_id]
        if len(voters) <= len(config.members) // 2:
            self.fail(
                f"{node.node_id} leads term {term} with the recorded votes of only {voters} "
                f"of {config.member_ids()}"
            )
        # Leader completeness: it holds every entry committed in an earlier term.
        disk = node.disk
        assert disk is not None
        first = disk.snapshot_index
        for index, (entry_term, _config) in self.committed.items():
            if index <= first or self.committed_in[index] >= term:
                continue
            offset = index - first - 1
            if offset >= len(disk.entries) or disk.entries[offset][0] != entry_term:
                self.fail(
                    f"leader completeness: {node.node_id}, leader of term {term}, lacks "
                    f"entry {index} (term {entry_term}) committed in term "
                    f"{self.committed_in[index]}"
                )
        latest, committed = raft.latest_config, raft.committed_config
        if not (
            (latest is not None and node.node_id in latest.member_ids())
            or (committed is not None and node.node_id in committed.member_ids())
        ):
            self.fail(f"{node.node_id} leads term {term}, a member of neither of its configs")

    def _liveness_problem(self) -> str | None:
        leaders = [n.raft for n in self.nodes.values() if n.raft and n.raft.role == LEADER]
        if not leaders:
            return "no leader"
        leader = max(leaders, key=lambda r: r.term)
        config = leader.committed_config
        assert config is not None
        if leader.latest_config != config:
            return f"leader {leader.node_id} has an uncommitted config"
        for member in config.member_ids():
            raft = self.nodes[member].raft
            if raft is None:
                return f"member {member} is down"
            if raft.term != leader.term or raft.leader_id != leader.node_id:
                return f"member {member} does not follow {leader.node_id} (term {raft.term})"
            if raft.commit_index != leader.commit_index or raft.committed_config != config:
                return f"member {member} is behind the leader's commit"
        top = max(self.committed)
        if leader.commit_index < top:
            return f"the leader's commit index is below the highest ever committed ({top})"
        return None
