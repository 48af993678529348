"""The cluster's data plane, between the engine and the node links: route rows and forwarded
messages, as the engine's batches (rust/src/broker/cluster.rs).

Python's part is per batch, never per message: the connection layer's flush hands over the
frames the engine made for each peer in this loop iteration (`send`), and each DATA frame a
peer sends is fed to the engine whole (`receive`). Link events tell the engine when a peer
can be written to (its data link, see fastbroker.cluster.transport): up (unacknowledged
batches go again, then a snapshot of our routes and our retained set), down, and full or
drained again (backpressure: the engine keeps the batches meanwhile).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from fastbroker._connection import monotonic_ms
from fastbroker.cluster.transport import DATA_FRAME, Transport
from fastbroker.store import StoreError

logger = logging.getLogger("fastbroker.cluster.dataplane")

# The frame kind of a data batch (fastbroker_core's cluster::batch::DATA_FRAME).
DATA = DATA_FRAME


class DataPlane:
    def __init__(self, engine: Any, server: Any, transport: Transport) -> None:
        self.engine = engine
        self.server = server
        self.transport = transport
        # node id -> the engine's peer number, and back.
        self.peer_ids: dict[str, int] = {}
        self.node_ids: dict[int, str] = {}
        # What the engine was last told of each peer (`peers_alive`).
        self.alive: dict[str, bool] = {}
        # A new incarnation per start: peers tell our batches from an earlier run's by it.
        engine.cluster_start(int.from_bytes(os.urandom(8), "big") or 1, transport.node_id)
        # Not a member until the first map (joining, or back after leaving): no sessions.
        engine.cluster_require_map()
        server.cluster_output = self.send
        server.store_state_handler = self.store_failing
        server.links_ended_handler = transport.links_ended

    def peer(self, node_id: str) -> int:
        peer = self.peer_ids.get(node_id)
        if peer is None:
            peer = self.engine.cluster_add_peer(node_id)
            self.peer_ids[node_id] = peer
            self.node_ids[peer] = node_id
        return peer

    def link_up(self, node_id: str) -> None:
        peer = self.peer(node_id)
        link = self.transport.data_links.get(node_id)
        if link is not None:
            # Served by the compiled connection layer from now on, where it can be (plain
            # TCP, the reactor on): before the engine sends anything on it.
            link.adopt(self.server, peer)
        self.engine.cluster_set_protocol(peer, link.version if link and link.version else 2)
        self.engine.cluster_link(peer, True)
        self.server.schedule_flush()

    def link_down(self, node_id: str) -> None:
        peer = self.peer_ids.get(node_id)
        if peer is not None:
            # Acknowledgements held for this peer go out now: a down peer stalls no one.
            silent_ms = self.transport.silent_ms.pop(node_id, 0)
            self.engine.cluster_link_lost(peer, silent_ms)
            self.server.schedule_flush()

    def writable(self, node_id: str, writable: bool) -> None:
        peer = self.peer_ids.get(node_id)
        if peer is not None:
            self.engine.cluster_set_writable(peer, writable)
            if writable:
                self.server.schedule_flush()

    def store_failing(self, failing: bool) -> None:
        """While this node's store fails (disk full) it can take nothing from its peers: its
        data links close, so that they keep what they have for it on their disks and
        acknowledge their publishers without waiting for it (as for a node that is down),
        rather than wait on it or fill its memory. They come back with the store."""
        if failing:
            logger.error("store failing: data links to the other nodes closed until it recovers")
        else:
            logger.warning("store recovered: data links to the other nodes open again")
            # Its peers took it for dead meanwhile: as after a pause, no CONNECT (one held
            # unread while the store failed included) takes a session over until in touch.
            self.engine.cluster_store_recovered(monotonic_ms())
        self.transport.refuse_data("this node's store is failing" if failing else None)

    def step_aside(self, on: bool) -> None:
        """This node stepped aside in a partial split, or no longer (cluster/reach.py): its
        peers live on and serve its clients' sessions, so it resumes none meanwhile, nor
        for the takeover time after (`cluster_step_aside`)."""
        self.engine.cluster_step_aside(on, monotonic_ms())

    def peers_alive(self, alive: set[str]) -> None:
        """The members this node hears, or that a member it hears still hears
        (cluster/reach.py): while a data link to one is down it is not dead, so the engine
        starts no session afresh that it may hold and publishes no will of its connections
        (`cluster_peer_alive`). Told on change only."""
        for node_id, peer in self.peer_ids.items():
            now_alive = node_id in alive
            if self.alive.get(node_id) != now_alive:
                self.alive[node_id] = now_alive
                self.engine.cluster_peer_alive(peer, now_alive)

    def hand_over_all(self) -> None:
        """This node left the cluster and its connections are closed: its sessions go to
        their owners (broker::cluster_leave)."""
        self.engine.cluster_hand_over_all(monotonic_ms())
        self.server.schedule_flush()

    def receive(self, node_id: str, batch: Any) -> None:
        link = self.transport.data_links.get(node_id)
        if not isinstance(batch, bytes):
            if link is not None:
                link.fail("data frame without a batch")
            return
        try:
            self.engine.cluster_feed(self.peer(node_id), batch, monotonic_ms())
        except ValueError as error:
            # Nothing of a malformed batch was applied; the peer is broken or hostile.
            if link is not None:
                link.fail(f"malformed data batch: {error}")
            return
        self.server.schedule_flush()

    def send(self, frames: list[tuple[int, bytes]]) -> None:
        """Called by the connection layer's flush, once its store batch is written: the
        frames of this loop iteration, at most a few per peer."""
        links = self.transport.data_links
        for peer, frame in frames:
            node_id = self.node_ids.get(peer)
            link = links.get(node_id) if node_id is not None else None
            if link is not None:
                link.write_frames(frame, 1)
        if self.engine.has_cluster_loads():
            self.load_spilled()
        if self.engine.has_copy_loads():
            self.load_copies()

    def set_map(
        self, version: int, replicas: tuple[tuple[str, ...], ...], members: tuple[str, ...]
    ) -> None:
        """The partition map, for the copies of sessions: each partition's owners; and the
        members it was made from (which side of a split acts on what both hold)."""
        me = self.transport.node_id
        self.engine.cluster_set_members([-1 if n == me else self.peer(n) for n in members])
        owners = [[-1 if n == me else self.peer(n) for n in nodes] for nodes in replicas]
        self.engine.cluster_set_map(version, owners, monotonic_ms())
        self.server.schedule_flush()

    def load_copies(self) -> None:
        """Reads back session copies the engine needs (a claim for a client whose home is
        down, or a takeover of a dead home's sessions): one multi-get per session."""
        store = self.server.store
        for client_id, keys in self.engine.copy_loads():
            try:
                values = store.get_many(keys) if store is not None else [None] * len(keys)
            except StoreError as error:
                logger.error("%s; the copy of session %r is not read back", error, client_id)
                values = [None] * len(keys)
            records = list(zip(keys, values, strict=True))
            for problem in self.engine.copy_loaded(client_id, records, monotonic_ms()):
                logger.error("%s", problem)
        self.server.schedule_flush()

    def load_spilled(self) -> None:
        """Reads back from the store the next batches of a queue that spilled to disk while
        its peer was down (a few MiB per peer per call), for the next flush to send."""
        store = self.server.store
        loaded = False
        for peer, keys in self.engine.cluster_loads():
            try:
                values = store.get_many(keys) if store is not None else []
            except StoreError as error:
                # Asked for again by a later flush (not at once: no loop on a broken store).
                logger.error("%s; batches for %s wait", error, self.node_ids.get(peer))
                values = []
            loaded |= bool(values)
            records = list(zip(keys, values, strict=False))
            for problem in self.engine.cluster_loaded(peer, records):
                logger.error("%s", problem)
        if loaded:
            self.server.schedule_flush()

    def retained_synced(self) -> set[str]:
        """Peers whose whole retained set has arrived since their link came up."""
        return {e["node_id"] for e in self.engine.cluster_stats() if e["retained_synced"]}

    def stats(self) -> dict[str, dict[str, Any]]:
        stats = {}
        for entry in self.engine.cluster_stats():
            node_id = entry.pop("node_id")
            entry.pop("peer")
            stats[node_id] = entry
        return stats
