"""A small sans-I/O Raft that agrees on the cluster configuration (membership and partition count).

The replicated state is one `ClusterConfig`; every log entry is either a no-op (a new leader's
first entry) or a whole config. Raft (Ongaro & Ousterhout) with PreVote, CheckQuorum, leader
stickiness, single-server membership changes that take effect on append, and snapshots (the
state is tiny, so a snapshot is just the last committed config). docs/consensus.md gives the
argument and the invariants; tests/raftsim.py checks them on thousands of random schedules.

The object does no I/O and keeps no clock: the caller passes ``now_ms`` (a monotonic clock) to
every call, delivers the messages from `Raft.take_messages`, and after every call writes
`Raft.take_persistent_state` (when not None) to disk BEFORE sending that call's messages.

Messages are plain lists ``[KIND, term, ...]`` of ints, strings, bools, None and lists:

    [PRE_VOTE, term, last_index, last_term]          term = the sender's term + 1 (not adopted)
    [PRE_VOTE_REPLY, term, granted]
    [VOTE, term, last_index, last_term]
    [VOTE_REPLY, term, granted]
    [APPEND, term, prev_index, prev_term, entries, leader_commit, sent_ms]
        entries = [[term, config wire or None], ...]
    [APPEND_REPLY, term, success, index, commit_index, sent_ms]
        index = the last index known to match (success) or the next index to try (failure);
        commit_index = the follower's; sent_ms echoes the request's, so the leader knows how
        recent the answer is
    [SNAPSHOT, term, index, index_term, config wire, config_index, sent_ms]
        answered with an APPEND_REPLY
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("fastbroker.cluster.raft")

PRE_VOTE = 1
PRE_VOTE_REPLY = 2
VOTE = 3
VOTE_REPLY = 4
APPEND = 5
APPEND_REPLY = 6
SNAPSHOT = 7

FOLLOWER = "follower"
PRECANDIDATE = "precandidate"
CANDIDATE = "candidate"
LEADER = "leader"

# Compact the log once it holds more committed entries than this.
DEFAULT_SNAPSHOT_THRESHOLD = 32
# Bounds one APPEND's size; a follower further behind gets the rest on the answer.
MAX_ENTRIES_PER_APPEND = 64
# How many (maximum) election timeouts a leader keeps telling a removed node that its removal
# is committed, until that node acknowledges it.
DEPARTED_NOTICE_TIMEOUTS = 10
STATE_FORMAT = 1


class _Malformed(Exception):
    """A message or a wire value that does not have the expected shape."""


def _is_int(value: object) -> bool:
    return type(value) is int  # bool is an int subclass and is not accepted here


def _int(value: object, what: str, minimum: int = 0) -> int:
    if type(value) is not int or value < minimum:
        raise _Malformed(f"{what} must be an int >= {minimum}, not {value!r}")
    return value


@dataclass(frozen=True)
class ClusterConfig:
    """The agreed cluster configuration. ``members`` is kept sorted by node id (normalised on
    construction), so equal configurations compare and serialise equal."""

    members: tuple[tuple[str, str], ...]  # (node id, cluster address "host:port")
    partitions: int
    replication_factor: int
    cluster_id: str
    _ids: tuple[str, ...] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        members = tuple(sorted((m[0], m[1]) for m in self.members))
        for node_id, address in members:
            if not isinstance(node_id, str) or not node_id or not isinstance(address, str):
                raise ValueError(f"a member must be (node id, address) strings: {node_id!r}")
        ids = tuple(m[0] for m in members)
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate member ids in {ids}")
        if not _is_int(self.partitions) or self.partitions < 1:
            raise ValueError(f"partitions must be an int >= 1, not {self.partitions!r}")
        if not _is_int(self.replication_factor) or self.replication_factor < 1:
            raise ValueError(f"replication_factor must be an int >= 1: {self.replication_factor!r}")
        if not isinstance(self.cluster_id, str):
            raise ValueError(f"cluster_id must be a string, not {self.cluster_id!r}")
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "_ids", ids)

    def member_ids(self) -> tuple[str, ...]:
        return self._ids

    def address_of(self, node_id: str) -> str | None:
        for member, address in self.members:
            if member == node_id:
                return address
        return None

    def with_member(self, node_id: str, address: str) -> ClusterConfig:
        """This config with ``node_id`` added, or its address replaced."""
        others = tuple(m for m in self.members if m[0] != node_id)
        return ClusterConfig(
            (*others, (node_id, address)),
            self.partitions,
            self.replication_factor,
            self.cluster_id,
        )

    def without_member(self, node_id: str) -> ClusterConfig:
        return ClusterConfig(
            tuple(m for m in self.members if m[0] != node_id),
            self.partitions,
            self.replication_factor,
            self.cluster_id,
        )

    def to_wire(self) -> list[Any]:
        return [
            self.cluster_id,
            self.partitions,
            self.replication_factor,
            [[node_id, address] for node_id, address in self.members],
        ]

    @classmethod
    def from_wire(cls, data: Any) -> ClusterConfig:
        """Raises ValueError unless ``data`` is what `to_wire` makes (lists or tuples)."""
        if not isinstance(data, list | tuple) or len(data) != 4:
            raise ValueError(f"a config is a list of 4 items, not {data!r}")
        cluster_id, partitions, replication_factor, members = data
        if not isinstance(members, list | tuple):
            raise ValueError(f"config members must be a list, not {members!r}")
        pairs = []
        for member in members:
            if not isinstance(member, list | tuple) or len(member) != 2:
                raise ValueError(f"a config member is [node id, address], not {member!r}")
            pairs.append((member[0], member[1]))
        return cls(tuple(pairs), partitions, replication_factor, cluster_id)


def _config_from_wire(data: Any) -> ClusterConfig:
    try:
        return ClusterConfig.from_wire(data)
    except (ValueError, TypeError) as error:
        raise _Malformed(str(error)) from None


def _config_or_none_from_wire(data: Any) -> ClusterConfig | None:
    return None if data is None else _config_from_wire(data)


def _entries_to_wire(entries: list[tuple[int, ClusterConfig | None]]) -> list[list[Any]]:
    return [[term, None if config is None else config.to_wire()] for term, config in entries]


def _entries_from_wire(data: Any) -> list[tuple[int, ClusterConfig | None]]:
    if not isinstance(data, list | tuple):
        raise _Malformed(f"entries must be a list, not {data!r}")
    entries: list[tuple[int, ClusterConfig | None]] = []
    for item in data:
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise _Malformed(f"an entry is [term, config or None], not {item!r}")
        entries.append((_int(item[0], "entry term"), _config_or_none_from_wire(item[1])))
    return entries


@dataclass
class PersistentState:
    """What must be on disk before a step's messages are sent. ``entries`` are (term, config or
    None for a no-op), the first at index ``snapshot_index + 1``. ``commit_index`` is not
    required by Raft, but keeping it means a restarted node cut off from the majority still
    knows (and serves) the last agreed map; ``snapshot_config_index`` is the index of the entry
    that introduced ``snapshot_config`` (the map version)."""

    term: int
    voted_for: str | None
    snapshot_index: int
    snapshot_term: int
    snapshot_config: ClusterConfig | None
    entries: list[tuple[int, ClusterConfig | None]]
    commit_index: int = 0
    snapshot_config_index: int = 0

    def to_wire(self) -> list[Any]:
        return [
            STATE_FORMAT,
            self.term,
            self.voted_for,
            self.snapshot_index,
            self.snapshot_term,
            None if self.snapshot_config is None else self.snapshot_config.to_wire(),
            self.snapshot_config_index,
            self.commit_index,
            _entries_to_wire(self.entries),
        ]

    @classmethod
    def from_wire(cls, data: Any) -> PersistentState:
        """Raises ValueError unless ``data`` is what `to_wire` makes."""
        try:
            if not isinstance(data, list | tuple) or len(data) != 9:
                raise _Malformed("the Raft state is a list of 9 items")
            if data[0] != STATE_FORMAT:
                raise _Malformed(f"unknown Raft state format {data[0]!r}")
            voted_for = data[2]
            if voted_for is not None and not isinstance(voted_for, str):
                raise _Malformed(f"voted_for must be a string or None, not {voted_for!r}")
            state = cls(
                term=_int(data[1], "term"),
                voted_for=voted_for,
                snapshot_index=_int(data[3], "snapshot index"),
                snapshot_term=_int(data[4], "snapshot term"),
                snapshot_config=_config_or_none_from_wire(data[5]),
                snapshot_config_index=_int(data[6], "snapshot config index"),
                commit_index=_int(data[7], "commit index"),
                entries=_entries_from_wire(data[8]),
            )
        except _Malformed as error:
            raise ValueError(str(error)) from None
        state.check()
        return state

    def check(self) -> None:
        """Raises ValueError if the fields contradict each other (a damaged or foreign file)."""
        if (self.snapshot_config is None) != (self.snapshot_index == 0):
            raise ValueError("a snapshot needs a config, and only a snapshot has one")
        if self.snapshot_config_index > self.snapshot_index:
            raise ValueError("the snapshot's config index is beyond the snapshot")
        last_term = self.snapshot_term
        for term, _config in self.entries:
            if term < last_term:
                raise ValueError("entry terms decrease")
            last_term = term
        if last_term > self.term:
            raise ValueError("an entry has a term beyond the current term")
        if self.commit_index > self.snapshot_index + len(self.entries):
            raise ValueError("the commit index is beyond the log")


class _Progress:
    """The leader's view of one follower (or of a node it removed, see `Raft._notify_departed`)."""

    __slots__ = ("acked_ms", "departed", "match", "next", "notice_until_ms", "since_ms")

    def __init__(self, next_index: int, now_ms: int) -> None:
        self.next = next_index  # the next entry to send
        self.match = 0  # the highest entry known to be in the follower's log
        self.acked_ms: int | None = None  # send time of the newest request it answered
        self.since_ms = now_ms  # CheckQuorum's grace: when this leader started tracking it
        self.departed = 0  # for a removed node: the index of the config that removed it
        self.notice_until_ms: int | None = None  # ... and until when it is told of it


class Raft:
    """One node's Raft state machine. Not thread-safe; every call takes the current time."""

    def __init__(
        self,
        node_id: str,
        now_ms: int,
        *,
        state: PersistentState | None = None,
        rng: random.Random,
        election_timeout_ms: tuple[int, int] = (1000, 2000),
        heartbeat_ms: int = 150,
        snapshot_threshold: int = DEFAULT_SNAPSHOT_THRESHOLD,
        max_entries_per_append: int = MAX_ENTRIES_PER_APPEND,
    ) -> None:
        low, high = election_timeout_ms
        if not 0 < heartbeat_ms < low <= high:
            raise ValueError("need 0 < heartbeat_ms < election timeout min <= max")
        self.node_id = node_id
        self._rng = rng
        self._timeout_min = low
        self._timeout_max = high
        self._heartbeat_ms = heartbeat_ms
        self._snapshot_threshold = max(1, snapshot_threshold)
        self._max_entries = max(1, max_entries_per_append)

        state = state or PersistentState(0, None, 0, 0, None, [])
        state.check()
        self.term = state.term
        self.voted_for = state.voted_for
        self._snapshot_index = state.snapshot_index
        self._snapshot_term = state.snapshot_term
        self._snapshot_config = state.snapshot_config
        self._snapshot_config_index = state.snapshot_config_index or state.snapshot_index
        self._entries = list(state.entries)
        self.commit_index = max(state.commit_index, state.snapshot_index)

        self.role = FOLLOWER
        self.leader_id: str | None = None
        self._leader_contact_ms: int | None = None
        self._votes: set[str] = set()
        self._progress: dict[str, _Progress] = {}
        self._heartbeat_due = now_ms
        self._election_deadline = now_ms
        self._outbox: list[tuple[str, list[Any]]] = []
        self._dirty = False

        self.latest_config: ClusterConfig | None = None
        self._latest_config_index = 0
        self.committed_config: ClusterConfig | None = None
        self.committed_config_index = 0
        self._refresh_latest_config()
        self._refresh_committed_config()
        self._reset_election_timer(now_ms)

    # -- the caller's interface ------------------------------------------------------------

    def bootstrap(self, config: ClusterConfig, now_ms: int) -> None:
        """Founds a cluster: ``config`` becomes the committed state at index 1 (as a snapshot,
        so a node added later receives it like any snapshot). Only on a node that has never
        had any state; several nodes may be bootstrapped, but only with the identical config.
        A one-member cluster elects itself at once."""
        if self.term != 0 or self._snapshot_index != 0 or self._entries:
            raise ValueError("bootstrap needs a node that has never had any Raft state")
        if self.node_id not in config.member_ids():
            raise ValueError(f"the bootstrap config must contain this node ({self.node_id})")
        self._snapshot_index = 1
        self._snapshot_term = 0
        self._snapshot_config = config
        self._snapshot_config_index = 1
        self.commit_index = 1
        self._dirty = True
        self._refresh_latest_config()
        self._refresh_committed_config()
        self._reset_election_timer(now_ms)
        if len(config.members) == 1:
            self._start_prevote(now_ms)

    def tick(self, now_ms: int) -> None:
        if self.role == LEADER:
            if not self._has_quorum_contact(now_ms):
                logger.info(
                    "%s: leader of term %d lost contact with the majority; stepping down",
                    self.node_id,
                    self.term,
                )
                self._become_follower(self.term, now_ms, None)
                return
            if now_ms >= self._heartbeat_due:
                self._notify_departed(now_ms)
                self._broadcast_append(now_ms)
        elif now_ms >= self._election_deadline:
            if self._may_campaign():
                self._start_prevote(now_ms)
            else:
                self._reset_election_timer(now_ms)

    def next_deadline_ms(self) -> int:
        """The earliest time at which `tick` has something to do (ticking more often is
        harmless): a caller may sleep until then, or until a message arrives."""
        return self._heartbeat_due if self.role == LEADER else self._election_deadline

    def receive(self, sender: str, message: list[Any], now_ms: int) -> None:
        """Handles one message. A malformed one is logged and ignored, never raises."""
        if not isinstance(sender, str) or sender == self.node_id:
            logger.warning("%s: ignoring a Raft message from %r", self.node_id, sender)
            return
        try:
            if not isinstance(message, list | tuple) or len(message) < 2:
                raise _Malformed("not a list [kind, term, ...]")
            kind = message[0]
            term = _int(message[1], "term")
            if kind == PRE_VOTE or kind == VOTE:
                _expect_length(message, 4)
                last_index = _int(message[2], "last index")
                last_term = _int(message[3], "last term")
                if last_term > term:
                    raise _Malformed("last term beyond the term")
                if kind == PRE_VOTE:
                    self._on_pre_vote(sender, term, last_index, last_term, now_ms)
                else:
                    self._on_vote(sender, term, last_index, last_term, now_ms)
            elif kind == PRE_VOTE_REPLY or kind == VOTE_REPLY:
                _expect_length(message, 3)
                granted = message[2]
                if type(granted) is not bool:
                    raise _Malformed("granted must be a bool")
                if kind == PRE_VOTE_REPLY:
                    self._on_pre_vote_reply(sender, term, granted, now_ms)
                else:
                    self._on_vote_reply(sender, term, granted, now_ms)
            elif kind == APPEND:
                _expect_length(message, 7)
                prev_index = _int(message[2], "prev index")
                prev_term = _int(message[3], "prev term")
                entries = _entries_from_wire(message[4])
                leader_commit = _int(message[5], "leader commit")
                sent_ms = _int(message[6], "sent_ms", minimum=-(2**63))
                last_term = prev_term
                for entry_term, _config in entries:
                    if entry_term < last_term:
                        raise _Malformed("entry terms decrease")
                    last_term = entry_term
                if last_term > term:
                    raise _Malformed("an entry's term is beyond the message's")
                self._on_append(
                    sender, term, prev_index, prev_term, entries, leader_commit, sent_ms, now_ms
                )
            elif kind == APPEND_REPLY:
                _expect_length(message, 6)
                success = message[2]
                if type(success) is not bool:
                    raise _Malformed("success must be a bool")
                index = _int(message[3], "index")
                commit = _int(message[4], "commit index")
                sent_ms = _int(message[5], "sent_ms", minimum=-(2**63))
                self._on_append_reply(sender, term, success, index, commit, sent_ms, now_ms)
            elif kind == SNAPSHOT:
                _expect_length(message, 7)
                index = _int(message[2], "snapshot index", minimum=1)
                index_term = _int(message[3], "snapshot term")
                config = _config_from_wire(message[4])
                config_index = _int(message[5], "snapshot config index", minimum=1)
                sent_ms = _int(message[6], "sent_ms", minimum=-(2**63))
                if index_term > term or config_index > index:
                    raise _Malformed("snapshot term or config index out of range")
                self._on_snapshot(
                    sender, term, index, index_term, config, config_index, sent_ms, now_ms
                )
            else:
                raise _Malformed(f"unknown kind {kind!r}")
        except _Malformed as error:
            logger.warning(
                "%s: ignoring a malformed Raft message from %s: %s", self.node_id, sender, error
            )

    def propose(self, config: ClusterConfig, now_ms: int) -> str | None:
        """Appends ``config`` as the next configuration. Returns None when appended (it takes
        effect at once and is agreed once committed), else why it was refused."""
        if self.role != LEADER:
            return "not leader"
        if self._term_at(self.commit_index) != self.term:
            # A change may only follow an entry of this term being committed (Ongaro's fix
            # for single-server changes across leader changes).
            return "no commit in this term yet"
        if self._latest_config_index > self.commit_index:
            return "change in progress"
        current = self.latest_config
        assert current is not None  # a leader is a member of some config
        if config.cluster_id != current.cluster_id:
            return "cluster id differs"
        if not config.members:
            return "no members left"
        if len(set(config.member_ids()) ^ set(current.member_ids())) > 1:
            return "more than one member changed"
        self._append(config)
        self._sync_progress(now_ms)
        self._advance_commit(now_ms)  # a one-member cluster commits at once
        if self.role == LEADER:
            self._broadcast_append(now_ms)
        return None

    def take_messages(self) -> list[tuple[str, list[Any]]]:
        messages, self._outbox = self._outbox, []
        return messages

    def take_persistent_state(self) -> PersistentState | None:
        if not self._dirty:
            return None
        self._dirty = False
        return PersistentState(
            term=self.term,
            voted_for=self.voted_for,
            snapshot_index=self._snapshot_index,
            snapshot_term=self._snapshot_term,
            snapshot_config=self._snapshot_config,
            entries=list(self._entries),
            commit_index=self.commit_index,
            snapshot_config_index=self._snapshot_config_index,
        )

    def last_ack_ms(self, node_id: str) -> int | None:
        """Leader only: the send time of the newest request ``node_id`` has answered in this
        term (so a late answer never makes a dead follower look alive), or None."""
        if self.role != LEADER:
            return None
        progress = self._progress.get(node_id)
        return None if progress is None else progress.acked_ms

    def status(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "term": self.term,
            "leader": self.leader_id,
            "commit_index": self.commit_index,
            "config_index": self.committed_config_index,
            "latest_config_index": self._latest_config_index,
            "snapshot_index": self._snapshot_index,
            "last_index": self.last_index,
            "log_length": len(self._entries),
        }

    @property
    def last_index(self) -> int:
        return self._snapshot_index + len(self._entries)

    # -- log -------------------------------------------------------------------------------

    def _term_at(self, index: int) -> int | None:
        """The entry's term, or None when it is compacted away or beyond the log."""
        offset = index - self._snapshot_index
        if offset == 0:
            return self._snapshot_term
        if 0 < offset <= len(self._entries):
            return self._entries[offset - 1][0]
        return None

    def _last_term(self) -> int:
        return self._entries[-1][0] if self._entries else self._snapshot_term

    def _config_at(self, index: int) -> tuple[int, ClusterConfig | None]:
        """(index of the entry that introduced it, config) in effect at ``index``."""
        for offset in range(index - self._snapshot_index, 0, -1):
            config = self._entries[offset - 1][1]
            if config is not None:
                return self._snapshot_index + offset, config
        return self._snapshot_config_index, self._snapshot_config

    def _refresh_latest_config(self) -> None:
        self._latest_config_index, self.latest_config = self._config_at(self.last_index)

    def _refresh_committed_config(self) -> None:
        self.committed_config_index, self.committed_config = self._config_at(self.commit_index)

    def _append(self, config: ClusterConfig | None) -> None:
        self._entries.append((self.term, config))
        self._dirty = True
        if config is not None:
            self._latest_config_index = self.last_index
            self.latest_config = config

    def _set_commit(self, index: int, now_ms: int) -> None:
        if index <= self.commit_index:
            return
        self.commit_index = index
        self._dirty = True
        self._refresh_committed_config()
        if self.commit_index - self._snapshot_index > self._snapshot_threshold:
            self._compact()
        if self.role == LEADER:
            self._notify_departed(now_ms)
        if (
            self.role == LEADER
            and self._latest_config_index <= self.commit_index
            and not self._is_member()
        ):
            # Its own removal is committed: tell the others at once, then step aside.
            self._broadcast_append(now_ms)
            logger.info("%s: removed from the cluster; stepping down", self.node_id)
            self._become_follower(self.term, now_ms, None)

    def _compact(self) -> None:
        index = self.commit_index
        term = self._term_at(index)
        assert term is not None
        self._snapshot_config_index, self._snapshot_config = self._config_at(index)
        del self._entries[: index - self._snapshot_index]
        self._snapshot_index = index
        self._snapshot_term = term
        self._dirty = True

    # -- roles and elections ---------------------------------------------------------------

    def _is_member(self) -> bool:
        config = self.latest_config
        return config is not None and self.node_id in config.member_ids()

    def _may_campaign(self) -> bool:
        """A node outside its latest config never campaigns (it would only disturb the
        others), unless that config is its own removal, not yet committed as far as it knows:
        it may be the only node holding that entry (a leader that removed itself, then
        restarted), and the change can then only complete if it leads (as a non-member, not
        counting its own vote). Nodes that know of the removal ignore it (`_ignores_candidate`)
        and the leader tells it once the removal is committed (`_notify_departed`)."""
        if self._is_member():
            return True
        committed = self.committed_config
        return (
            self._latest_config_index > self.commit_index
            and committed is not None
            and self.node_id in committed.member_ids()
        )

    def _members(self) -> tuple[str, ...]:
        config = self.latest_config
        return () if config is None else config.member_ids()

    def _has_quorum(self, voters: set[str]) -> bool:
        members = self._members()
        return sum(1 for m in members if m in voters) > len(members) // 2

    def _reset_election_timer(self, now_ms: int) -> None:
        self._election_deadline = now_ms + self._rng.randint(self._timeout_min, self._timeout_max)

    def _in_lease(self, now_ms: int) -> bool:
        """Whether this node believes in a live leader (stickiness: it then refuses votes)."""
        if self.role == LEADER:
            return True
        return (
            self.leader_id is not None
            and self._leader_contact_ms is not None
            and now_ms - self._leader_contact_ms < self._timeout_min
        )

    def _become_follower(self, term: int, now_ms: int, leader: str | None) -> None:
        if term > self.term:
            self.term = term
            self.voted_for = None
            self._dirty = True
        was = self.role
        self.role = FOLLOWER
        self.leader_id = leader
        self._progress.clear()
        self._votes.clear()
        if was != FOLLOWER or leader is None:
            self._reset_election_timer(now_ms)

    def _start_prevote(self, now_ms: int) -> None:
        """PreVote: ask whether we could win before bumping the term, so a node that cannot
        win (cut off, or behind) never disturbs the others with ever-growing terms."""
        self.role = PRECANDIDATE
        self.leader_id = None
        self._votes = {self.node_id}
        self._reset_election_timer(now_ms)
        if self._has_quorum(self._votes):
            self._start_election(now_ms)
            return
        message = [PRE_VOTE, self.term + 1, self.last_index, self._last_term()]
        for member in self._members():
            if member != self.node_id:
                self._outbox.append((member, message))

    def _start_election(self, now_ms: int) -> None:
        self.role = CANDIDATE
        self.term += 1
        self.voted_for = self.node_id
        self._dirty = True
        self.leader_id = None
        self._votes = {self.node_id}
        self._reset_election_timer(now_ms)
        if self._has_quorum(self._votes):
            self._become_leader(now_ms)
            return
        message = [VOTE, self.term, self.last_index, self._last_term()]
        for member in self._members():
            if member != self.node_id:
                self._outbox.append((member, message))

    def _become_leader(self, now_ms: int) -> None:
        logger.info("%s: leader of term %d", self.node_id, self.term)
        self.role = LEADER
        self.leader_id = self.node_id
        self._votes.clear()
        self._progress = {}
        self._append(None)  # committing an entry of its own term commits all before it
        self._sync_progress(now_ms)
        self._advance_commit(now_ms)
        if self.role == LEADER:
            self._broadcast_append(now_ms)

    def _log_ok(self, last_index: int, last_term: int) -> bool:
        """Whether a candidate's log is at least as up to date as ours."""
        our_term = self._last_term()
        return last_term > our_term or (last_term == our_term and last_index >= self.last_index)

    def _ignores_candidate(self, sender: str, log_ok: bool) -> bool:
        """A (pre)vote request from a node outside our latest config is ignored (its term is
        not even adopted) when its log is behind ours: a removed node lacks the entry that
        removed it, which every node that knows of the removal holds. A sender whose log is
        at least as up to date may be a member we have not heard of yet (we are behind): it
        is answered like any other, or a lagging voter could block every election."""
        config = self.latest_config
        return not log_ok and config is not None and sender not in config.member_ids()

    def _on_pre_vote(
        self, sender: str, term: int, last_index: int, last_term: int, now_ms: int
    ) -> None:
        log_ok = self._log_ok(last_index, last_term)
        if self._ignores_candidate(sender, log_ok):
            return
        # A pre-vote changes nothing here: no term, no vote, no timer.
        granted = term > self.term and not self._in_lease(now_ms) and log_ok
        self._outbox.append((sender, [PRE_VOTE_REPLY, term if granted else self.term, granted]))

    def _on_pre_vote_reply(self, sender: str, term: int, granted: bool, now_ms: int) -> None:
        if not granted:
            if term > self.term:
                self._become_follower(term, now_ms, None)
            return
        if self.role == PRECANDIDATE and term == self.term + 1:
            self._votes.add(sender)
            if self._has_quorum(self._votes):
                self._start_election(now_ms)

    def _on_vote(
        self, sender: str, term: int, last_index: int, last_term: int, now_ms: int
    ) -> None:
        log_ok = self._log_ok(last_index, last_term)
        if self._ignores_candidate(sender, log_ok) or self._in_lease(now_ms):
            # Stickiness: while a leader is heard from, a candidate's higher term is not
            # even adopted, so a returning node cannot depose a healthy leader.
            return
        if term > self.term:
            self._become_follower(term, now_ms, None)
        granted = term == self.term and self.voted_for in (None, sender) and log_ok
        if granted:
            if self.voted_for is None:
                self.voted_for = sender
                self._dirty = True
            self._reset_election_timer(now_ms)
        self._outbox.append((sender, [VOTE_REPLY, self.term, granted]))

    def _on_vote_reply(self, sender: str, term: int, granted: bool, now_ms: int) -> None:
        if term > self.term:
            self._become_follower(term, now_ms, None)
            return
        if granted and term == self.term and self.role == CANDIDATE:
            self._votes.add(sender)
            if self._has_quorum(self._votes):
                self._become_leader(now_ms)

    # -- replication: follower side --------------------------------------------------------

    def _accept_leader(self, sender: str, term: int, now_ms: int) -> bool:
        """Common handling of a leader's request of term >= ours; False if it must be ignored."""
        if term == self.term and self.role == LEADER:
            logger.error("%s: another leader %s in term %d; ignoring", self.node_id, sender, term)
            return False
        if term > self.term or self.role != FOLLOWER or self.leader_id != sender:
            self._become_follower(term, now_ms, sender)
        self._leader_contact_ms = now_ms
        self._reset_election_timer(now_ms)
        return True

    def _on_append(
        self,
        sender: str,
        term: int,
        prev_index: int,
        prev_term: int,
        entries: list[tuple[int, ClusterConfig | None]],
        leader_commit: int,
        sent_ms: int,
        now_ms: int,
    ) -> None:
        if term < self.term:
            self._outbox.append((sender, [APPEND_REPLY, self.term, False, 0, 0, sent_ms]))
            return
        if not self._accept_leader(sender, term, now_ms):
            return
        end = prev_index + len(entries)  # the last index this request speaks for
        if prev_index > self.last_index:
            self._reply(sender, False, self.last_index + 1, sent_ms)
            return
        if prev_index < self._snapshot_index:
            # The part up to our snapshot is committed, hence the same as the leader's.
            skip = self._snapshot_index - prev_index
            if skip > len(entries):
                self._reply(sender, True, end, sent_ms)
                return
            if skip and entries[skip - 1][0] != self._snapshot_term:
                logger.error("%s: %s's entries contradict our snapshot", self.node_id, sender)
                return
            entries = entries[skip:]
            prev_index, prev_term = self._snapshot_index, self._snapshot_term
        elif self._term_at(prev_index) != prev_term:
            if prev_index <= self.commit_index:
                logger.error("%s: %s contradicts a committed entry", self.node_id, sender)
                return
            # Skip back over the whole conflicting term (one round trip per term, not entry).
            conflict_term = self._term_at(prev_index)
            hint = prev_index
            while hint - 1 > self.commit_index and self._term_at(hint - 1) == conflict_term:
                hint -= 1
            self._reply(sender, False, hint, sent_ms)
            return
        for offset, (entry_term, _config) in enumerate(entries):
            index = prev_index + 1 + offset
            if index <= self.last_index:
                if self._term_at(index) == entry_term:
                    continue
                if index <= self.commit_index:
                    logger.error("%s: %s contradicts a committed entry", self.node_id, sender)
                    return
                del self._entries[index - self._snapshot_index - 1 :]
            self._entries.extend(entries[offset:])
            self._dirty = True
            self._refresh_latest_config()
            break
        self._set_commit(min(leader_commit, end), now_ms)
        self._reply(sender, True, end, sent_ms)

    def _on_snapshot(
        self,
        sender: str,
        term: int,
        index: int,
        index_term: int,
        config: ClusterConfig,
        config_index: int,
        sent_ms: int,
        now_ms: int,
    ) -> None:
        if term < self.term:
            self._outbox.append((sender, [APPEND_REPLY, self.term, False, 0, 0, sent_ms]))
            return
        if not self._accept_leader(sender, term, now_ms):
            return
        if index > self.commit_index:
            if self._term_at(index) == index_term:
                del self._entries[: index - self._snapshot_index]  # keep what follows it
            else:
                self._entries = []
            self._snapshot_index = index
            self._snapshot_term = index_term
            self._snapshot_config = config
            self._snapshot_config_index = config_index
            self.commit_index = index
            self._dirty = True
            self._refresh_latest_config()
            self._refresh_committed_config()
        self._reply(sender, True, index, sent_ms)

    def _reply(self, leader: str, success: bool, index: int, sent_ms: int) -> None:
        message = [APPEND_REPLY, self.term, success, index, self.commit_index, sent_ms]
        self._outbox.append((leader, message))

    # -- replication: leader side ----------------------------------------------------------

    def _sync_progress(self, now_ms: int) -> None:
        """Tracks the other members of the latest config, and the nodes it removed."""
        members = self._members()
        for member in members:
            progress = self._progress.get(member)
            if member == self.node_id:
                continue
            if progress is None:
                self._progress[member] = _Progress(self.last_index, now_ms)
            elif progress.departed:
                progress.departed = 0  # added back
                progress.notice_until_ms = None
                progress.since_ms = now_ms
        for member, progress in self._progress.items():
            if member not in members and not progress.departed:
                progress.departed = self._latest_config_index

    def _notify_departed(self, now_ms: int) -> None:
        """A removed node no longer counts, so nothing would tell it that its removal is
        committed: it would not know it is out, and would go on campaigning (harmlessly,
        with PreVotes, see `_may_campaign`). So it keeps getting APPENDs until it answers
        that it has committed its removal, or for a bounded time if it never answers."""
        for member, progress in list(self._progress.items()):
            if not progress.departed or progress.departed > self.commit_index:
                continue
            if progress.notice_until_ms is None:
                timeout = DEPARTED_NOTICE_TIMEOUTS * self._timeout_max
                progress.notice_until_ms = now_ms + timeout
                self._send_append(member, now_ms)
            elif now_ms >= progress.notice_until_ms:
                del self._progress[member]

    def _has_quorum_contact(self, now_ms: int) -> bool:
        """CheckQuorum: has a majority answered within the last election timeout?"""
        horizon = now_ms - self._timeout_min
        alive = {self.node_id}
        for member, progress in self._progress.items():
            heard = progress.since_ms if progress.acked_ms is None else progress.acked_ms
            if max(heard, progress.since_ms) >= horizon:
                alive.add(member)
        return self._has_quorum(alive)

    def _broadcast_append(self, now_ms: int) -> None:
        for member in self._progress:
            self._send_append(member, now_ms)
        self._heartbeat_due = now_ms + self._heartbeat_ms

    def _send_append(self, member: str, now_ms: int) -> None:
        progress = self._progress[member]
        prev_index = progress.next - 1
        if prev_index < self._snapshot_index:
            assert self._snapshot_config is not None
            message = [
                SNAPSHOT,
                self.term,
                self._snapshot_index,
                self._snapshot_term,
                self._snapshot_config.to_wire(),
                self._snapshot_config_index,
                now_ms,
            ]
        else:
            start = prev_index - self._snapshot_index
            entries = self._entries[start : start + self._max_entries]
            message = [
                APPEND,
                self.term,
                prev_index,
                self._term_at(prev_index),
                _entries_to_wire(entries),
                self.commit_index,
                now_ms,
            ]
        self._outbox.append((member, message))

    def _on_append_reply(
        self,
        sender: str,
        term: int,
        success: bool,
        index: int,
        commit: int,
        sent_ms: int,
        now_ms: int,
    ) -> None:
        if term > self.term:
            self._become_follower(term, now_ms, None)
            return
        if term < self.term or self.role != LEADER:
            return
        progress = self._progress.get(sender)
        if progress is None:
            return
        sent_ms = min(sent_ms, now_ms)
        if progress.acked_ms is None or sent_ms > progress.acked_ms:
            progress.acked_ms = sent_ms
        if progress.departed and success and commit >= progress.departed:
            del self._progress[sender]  # it knows it is out
            return
        if success:
            if index > self.last_index:
                logger.warning("%s: %s claims entries we never had", self.node_id, sender)
                return
            if index > progress.match:
                progress.match = index
                progress.next = max(progress.next, index + 1)
                self._advance_commit(now_ms)
                if self.role == LEADER and sender in self._progress:
                    if progress.next <= self.last_index:
                        self._send_append(sender, now_ms)  # catching up: keep it busy
        else:
            # Moves back (a late answer may not undo newer progress), then retries at once.
            progress.next = max(progress.match + 1, min(progress.next, index))
            self._send_append(sender, now_ms)

    def _advance_commit(self, now_ms: int) -> None:
        members = self._members()
        if not members:
            return
        matches = sorted(
            (
                self.last_index
                if m == self.node_id
                else (self._progress[m].match if m in self._progress else 0)
            )
            for m in members
        )
        # The highest index a majority holds (the leader counts only if it is a member).
        candidate = matches[(len(matches) - 1) // 2]
        # Only entries of the current term are committed by counting (Raft's Figure 8).
        if candidate > self.commit_index and self._term_at(candidate) == self.term:
            self._set_commit(candidate, now_ms)


def _expect_length(message: list[Any] | tuple[Any, ...], length: int) -> None:
    if len(message) != length:
        raise _Malformed(f"kind {message[0]!r} has {length} items, not {len(message)}")
