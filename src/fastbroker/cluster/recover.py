"""`fastbroker cluster recover`: a survivor of a lost majority forms a new cluster alone.

Membership changes need a majority of the agreed members. When most of them are gone for
good (two of three nodes destroyed), the survivor keeps serving its clients on the last
agreed map, but no node can join or leave. This rewrites the stopped survivor's Raft state
so that it restarts as the only member of a new cluster (a new cluster id, a map version
above every earlier one), keeping all its data: at that map it takes over the sessions it
holds copies of (their homes are no longer members), publishes the wills it holds for
them, and serves the retained set it has. Fresh nodes then join it as usual.

The new cluster id keeps the old members apart: a destroyed node brought back with its old
disk is refused at the link handshake (two of three of the old membership could otherwise
elect a leader of their own), and must join with an empty data directory. What this node
kept for the removed members (batches sent while they were down, notes that their wills
went out, their route rows) has nowhere to go and is deleted.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

from fastbroker.cluster.node import NODE_FILE, STATE_FILE, ClusterStartupError, StateFile
from fastbroker.cluster.raft import ClusterConfig, PersistentState
from fastbroker.store import Store, StoreError

# Store record kinds kept for other nodes by name (fastbroker_core's store/records.rs):
# batches for a peer that was down ('o', keyed by the peer's name), wills this node
# published for a home out of its reach, to tell that home ('p'), and the peers' route rows
# ('n', keyed by the peer's name).
OUTBOX = b"o"
WILL_FIRED = b"p"
ROUTE_ROW = b"n"


class RecoverError(Exception):
    """The data directory cannot be recovered (not a cluster member's, in use, damaged)."""


@dataclass(frozen=True)
class Recovered:
    node_id: str
    old_cluster_id: str
    new_cluster_id: str
    removed: tuple[str, ...]
    map_version: int
    records_dropped: int


def committed_config(state: PersistentState) -> tuple[int, ClusterConfig | None]:
    """(index that introduced it, config) of the last configuration agreed by a majority."""
    commit = max(state.commit_index, state.snapshot_index)
    for offset in range(min(commit - state.snapshot_index, len(state.entries)), 0, -1):
        config = state.entries[offset - 1][1]
        if config is not None:
            return state.snapshot_index + offset, config
    return state.snapshot_config_index, state.snapshot_config


def alone(state: PersistentState, node_id: str) -> tuple[PersistentState, ClusterConfig]:
    """The state of a new cluster whose only member is `node_id`, from its current one."""
    _, config = committed_config(state)
    if config is None or node_id not in config.member_ids():
        raise RecoverError(
            f"node {node_id} is not a member of its last agreed cluster: nothing to recover "
            "(start it with --join to join a cluster)"
        )
    address = config.address_of(node_id)
    assert address is not None
    last_index = state.snapshot_index + len(state.entries)
    last_term = state.entries[-1][0] if state.entries else state.snapshot_term
    # Above every index and term of the old log: the map version only grows, and no vote
    # or entry of the old cluster can count in the new one.
    index = last_index + 1
    term = max(state.term, last_term) + 1
    new = ClusterConfig(
        ((node_id, address),), config.partitions, config.replication_factor, uuid.uuid4().hex
    )
    recovered = PersistentState(
        term=term,
        voted_for=None,
        snapshot_index=index,
        snapshot_term=term,
        snapshot_config=new,
        entries=[],
        commit_index=index,
        snapshot_config_index=index,
    )
    return recovered, config


def recover(data_dir: Path) -> Recovered:
    """Rewrites the stopped node's state in `data_dir` (see the module's docstring)."""
    cluster_dir = data_dir / "cluster"
    state_path = cluster_dir / STATE_FILE
    if not state_path.is_file():
        raise RecoverError(f"{state_path} does not exist: {data_dir} is no cluster node's")
    try:
        node_id = (cluster_dir / NODE_FILE).read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        raise RecoverError(f"cannot read {cluster_dir / NODE_FILE}: {error}") from None
    try:
        # Its lock also tells that the node is stopped.
        store = Store.open(str(data_dir))
    except StoreError as error:
        raise RecoverError(f"{error} (stop the node first)") from None
    with store:
        state_file = StateFile(cluster_dir)
        try:
            state = state_file.load()
        except ClusterStartupError as error:
            raise RecoverError(str(error)) from None
        assert state is not None
        recovered, old = alone(state, node_id)
        # The new state first: a crash after it leaves dead records, never a node of the
        # old cluster without what it kept for its peers.
        state_file.save(recovered)
        dropped = [
            key for prefix in (OUTBOX, WILL_FIRED, ROUTE_ROW) for key, _ in store.load(prefix)
        ]
        store.write([(key, None) for key in dropped])
        store.sync()
    new = recovered.snapshot_config
    assert new is not None
    return Recovered(
        node_id=node_id,
        old_cluster_id=old.cluster_id,
        new_cluster_id=new.cluster_id,
        removed=tuple(m for m in old.member_ids() if m != node_id),
        map_version=recovered.snapshot_config_index,
        records_dropped=len(dropped),
    )
