"""A cluster node's control plane: Raft on membership, joining and leaving, failure detection,
discovery, and the partition map every node derives from the agreed membership.

It runs beside the MQTT engine and never blocks it: consensus traffic happens only when the
membership changes, plus small heartbeats. A node that loses the majority keeps its last
agreed map and keeps serving its clients; changes wait until a majority is back.

How a node finds its cluster (`tick_membership`):
- it has no agreed config yet (a fresh data directory): if a linked peer is in a cluster, it
  asks that cluster's leader to add it (JOIN); if no peer is, and at least `bootstrap_expect`
  fresh nodes see each other, the smallest node id founds a one-member cluster and the others
  then join it one at a time (single-server changes, see docs/consensus.md);
- it has one, but a peer of the same cluster reports a newer map without it (it was removed
  while cut off, or it left): it asks to join again.
The leader removes members it has not heard from for `failure_timeout_ms`, one at a time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import reprlib
import time
import uuid
from pathlib import Path
from typing import Any

import fastbroker_core
import xxhash

from fastbroker.cluster.dataplane import DATA, DataPlane
from fastbroker.cluster.discovery import DiscoveryProvider, LocalNode, parse_discovery
from fastbroker.cluster.partitions import PartitionMap, compute_map, moved
from fastbroker.cluster.raft import ClusterConfig, PersistentState, Raft
from fastbroker.cluster.reach import (
    alive_members,
    confirm_after_ms,
    cut_apart,
    heard_through,
    note_ping,
    parse_reach,
    parse_relayed,
    ping_fields,
    suspect_after_ms,
)
from fastbroker.cluster.transport import (
    Transport,
    format_address,
    link_tls_contexts,
    parse_address,
)

logger = logging.getLogger("fastbroker.cluster")

# Frame kinds of the node's messages (the transport's own are below 16).
RAFT = 16
PING = 17
JOIN = 18
JOIN_REPLY = 19
LEAVE = 20
# A member stopping for a restart (SIGTERM): {"back_within_ms": n}. Nodes that do not know
# the kind ignore it.
STOPPING = 21
# Why data links are refused while this node steps aside in a partial split.
PARTIAL = "partial split"
# The longest stay away a stop notice may ask for (as `[cluster] restart_timeout_ms`).
MAX_RESTART_MS = 86_400_000

TICK_S = 0.05
# How long a planned stop (SIGTERM) waits for its peers to acknowledge its last batches.
PLANNED_STOP_SETTLE_S = 3.0
# How long a node that left waits for the relays of the sessions it handed on to end (5 s
# after the new homes are known to every node: the engine's RELAY_MS).
LEAVE_RELAY_S = 8.0
# A fresh node waits this long for its peers' pings before it may found a cluster, so a node
# joining a running cluster learns of it first.
BOOTSTRAP_GRACE_S = 2.0
JOIN_RETRY_S = 0.5
# How long a leader address learnt from a peer stays a dial target.
HINT_TTL_MS = 30_000

STATE_FILE = "raft-state"
NODE_FILE = "node-id"


class ClusterStartupError(Exception):
    """The node cannot take part in a cluster (bad data directory, node id mismatch)."""


def monotonic_ms() -> int:
    return time.monotonic_ns() // 1_000_000


class StateFile:
    """The Raft state on disk: [xxh3-64 of body][body], replaced atomically (write, fsync,
    rename, fsync dir) so a crash leaves the old or the new state, never a mix."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path = directory / STATE_FILE

    def load(self) -> PersistentState | None:
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            raise ClusterStartupError(f"cannot read {self.path}: {error.strerror}") from None
        body = data[8:]
        if len(data) < 8 or xxhash.xxh3_64_digest(body) != data[:8]:
            raise ClusterStartupError(
                f"{self.path} is damaged (checksum mismatch); to bring this node back, move "
                "the data directory away and start it with a new node id (an id must never "
                "come back without its state: its old votes could be counted twice)"
            )
        try:
            return PersistentState.from_wire(fastbroker_core.decode_value(body))
        except (ValueError, TypeError, KeyError, IndexError) as error:
            raise ClusterStartupError(f"{self.path} is damaged: {error}") from None

    def save(self, state: PersistentState) -> None:
        body = fastbroker_core.encode_value(state.to_wire())
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, xxhash.xxh3_64_digest(body) + body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)
        dir_fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def check_node_id(directory: Path, node_id: str) -> None:
    """A data directory belongs to one node id for life: its Raft state is that node's."""
    path = directory / NODE_FILE
    try:
        stored = path.read_text().strip()
    except FileNotFoundError:
        try:
            path.write_text(node_id + "\n")
        except OSError as error:
            raise ClusterStartupError(f"cannot write {path}: {error.strerror}") from None
        return
    except (OSError, UnicodeDecodeError) as error:
        raise ClusterStartupError(f"cannot read {path}: {error}") from None
    if stored != node_id:
        raise ClusterStartupError(
            f"the data directory belongs to node {stored!r}, not {node_id!r}: use --node-id "
            f"{stored} or another --data-dir"
        )


class PeerView:
    """What this node last heard from another node's ping."""

    __slots__ = (
        "address",
        "clients",
        "cluster_id",
        "config_index",
        "copies",
        "heard_since",
        "last_seen",
        "leader",
        "member_ids",
        "reach",
        "relayed",
        "sessions",
        "streaming",
    )

    def __init__(self) -> None:
        self.last_seen = 0
        self.heard_since = 0
        self.clients: int | None = None
        self.sessions: int | None = None
        self.copies: int | None = None
        self.streaming: int | None = None
        self.address: str | None = None
        self.cluster_id: str | None = None
        self.config_index = 0
        self.leader: str | None = None
        self.member_ids: tuple[str, ...] = ()
        # Whom it hears (cluster/reach.py): member -> (ms before its ping, ms heard without
        # a break); and whom each of those hears.
        self.reach: dict[str, tuple[int, int]] = {}
        self.relayed: dict[str, frozenset[str]] = {}


class ClusterNode:
    def __init__(
        self,
        settings: Any,
        data_dir: str,
        loop: asyncio.AbstractEventLoop,
        engine: Any = None,
        server: Any = None,
    ) -> None:
        """`settings` is fastbroker.config.ClusterConfig. With the MQTT `engine` and its
        connection-layer `server`, the node also carries the data plane (routes and
        forwarded messages); without, only membership."""
        self.settings = settings
        self.loop = loop
        self.node_id: str = settings.node_id
        self.listen = parse_address(settings.listen, allow_any_port=True)
        self.advertise = settings.advertise or settings.listen
        self.directory = Path(data_dir) / "cluster"
        self.state_file = StateFile(self.directory)
        self.secret = settings.secret.encode()
        self.seeds = {parse_address(s, self.listen[1]) for s in settings.join}
        self.discovery: DiscoveryProvider | None = None
        self.discovered: set[tuple[str, int]] = set()
        self.peers: dict[str, PeerView] = {}
        self.raft: Raft | None = None
        self.map: PartitionMap = compute_map([], settings.partitions, settings.replication_factor)
        self.map_changed_at = 0
        self.started_ms = monotonic_ms()
        self.last_join_attempt = 0
        self.last_ping = 0
        self.leaving = False
        # Raft state whose save failed: saved before anything else is sent.
        self.unsaved: PersistentState | None = None
        # Addresses named as leaders by peers (address -> expiry), dialled to join.
        self.hints: dict[tuple[str, int], int] = {}
        # member -> (address, when) of the last address change accepted for it.
        self.address_changes: dict[str, tuple[str, int]] = {}
        self.leader_term = -1
        self.last_seed_warning = 0
        self.last_join_refusal = ""
        self.leader_started = 0
        self.warned_clusters: set[str] = set()
        # member -> until when (ms) it is kept in the map while away: it stopped for a
        # restart, and removing it would move its partitions away and back (two rebalances).
        self.planned_stops: dict[str, int] = {}
        # In a partial split, (the member this node is cut off from, a node that still hears
        # it, since when): its data links stay closed meanwhile (cluster/reach.py).
        self.stepped_aside: tuple[str, str, int] | None = None
        # Since when the pings have shown a partial split that this node has not yet
        # stepped aside for: it must show in pings of two heartbeats (cluster/reach.py).
        self.partial_seen_at: int | None = None
        # Members this node is cut apart from in a partial split, whichever of the two steps
        # aside: since when the pings show it, and since when their data link is cut.
        self.cut_seen_at: dict[str, int] = {}
        self.data_cut: dict[str, int] = {}
        self.suspect_ms = suspect_after_ms(settings.failure_timeout_ms, settings.heartbeat_ms)
        self.left = asyncio.Event()
        self.tick_task: asyncio.Task[None] | None = None
        self.discovery_task: asyncio.Task[None] | None = None
        tls = None
        if settings.tls_certfile:
            try:
                tls = link_tls_contexts(
                    settings.tls_certfile, settings.tls_keyfile, settings.tls_cafile
                )
            except ValueError as error:
                raise ClusterStartupError(f"[cluster] TLS: {error}") from None
        self.transport = Transport(
            loop,
            node_id=self.node_id,
            cluster_name=settings.name,
            secret=self.secret,
            advertise=self.advertise,
            on_message=self.on_message,
            tls=tls,
        )
        self.transport.cluster_id = self.cluster_id
        # Peers ping every heartbeat: a link silent this long is half-open (peer gone).
        self.transport.idle_timeout_s = settings.failure_timeout_ms / 1000
        self.dataplane: DataPlane | None = None
        # (clients connected, sessions held, copies held, when) at the last count.
        self.clients_counted = (0, 0, 0, 0, -1_000_000)
        if engine is not None and server is not None:
            self.dataplane = DataPlane(engine, server, self.transport)
            self.transport.on_data_up = self.dataplane.link_up
            self.transport.on_data_down = self.dataplane.link_down
            self.transport.on_writable = self.dataplane.writable

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ClusterStartupError(f"cannot create {self.directory}: {error.strerror}") from None
        check_node_id(self.directory, self.node_id)
        state = self.state_file.load()
        now = monotonic_ms()
        # Seeded from the node id and the clock: election timeouts differ between nodes.
        rng = random.Random(f"{self.node_id}-{time.time_ns()}")
        timeout = self.settings.election_timeout_ms
        self.raft = Raft(
            self.node_id,
            now,
            state=state,
            rng=rng,
            election_timeout_ms=(timeout, 2 * timeout),
            heartbeat_ms=self.settings.heartbeat_ms,
        )
        self.update_map(now)
        if self.settings.discovery:
            try:
                self.discovery = parse_discovery(
                    self.settings.discovery, default_port=self.listen[1], secret=self.secret
                )
            except ValueError as error:
                raise ClusterStartupError(f"[cluster] discovery: {error}") from None
        host, port = self.listen
        try:
            bound = await self.transport.listen(host, port)
        except OSError as error:
            raise ClusterStartupError(
                f"cannot listen for cluster links on {format_address(self.listen)}: "
                f"{os.strerror(error.errno) if error.errno else error}"
            ) from None
        if not self.settings.advertise and port == 0:
            # An ephemeral port: tell peers the one we got.
            self.listen = (host, bound[1])
            self.advertise = format_address(self.listen)
            self.transport.advertise = self.advertise
        if self.discovery is not None:
            advertised = parse_address(self.advertise)
            try:
                await self.discovery.start(LocalNode(self.node_id, self.settings.name, advertised))
            except OSError as error:
                await self.transport.close()
                raise ClusterStartupError(str(error)) from None
            self.discovery_task = self.loop.create_task(self.poll_discovery())
        logger.info(
            "cluster node %s listening on %s (advertised as %s)%s",
            self.node_id,
            format_address(self.listen),
            self.advertise,
            f", member of cluster {self.cluster_id()} with map version {self.map.version}"
            if self.raft.committed_config
            else "",
        )
        self.tick_task = self.loop.create_task(self.run_ticks())

    async def stop(self, planned: bool = False) -> None:
        """`planned`: a stop for a restart (SIGTERM), which the other members are told of,
        so that they keep this node in the map for `restart_timeout_ms` rather than the
        failure timeout."""
        for task in (self.tick_task, self.discovery_task):
            if task is not None:
                task.cancel()
        if planned and self.is_member() and self.settings.restart_timeout_ms:
            # After the last ping (the ticks are stopped): a ping clears the notice.
            notice = {"back_within_ms": self.settings.restart_timeout_ms}
            for peer in list(self.transport.links):
                self.transport.send(peer, STOPPING, notice)
            await asyncio.sleep(0.05)  # written before the links close
        if self.discovery is not None:
            await self.discovery.stop()
        await self.transport.close()

    async def hand_over_sessions(self, timeout_s: float = LEAVE_RELAY_S) -> None:
        """A node that left the cluster, once its clients are gone: hands the sessions it
        still holds to their owners, then waits (at most `timeout_s`) until the new homes
        are known to every node and the relays that send on what reached this node meanwhile
        have ended, so that its peers keep nothing for it once it is gone."""
        if self.dataplane is None or not self.left.is_set():
            return
        engine = self.dataplane.engine
        self.dataplane.hand_over_all()  # the engine logs how many
        deadline = self.loop.time() + timeout_s
        while engine.cluster_relays():
            if self.loop.time() >= deadline:
                logger.warning(
                    "stopping while relaying for %d sessions handed on after %.1f s",
                    engine.cluster_relays(),
                    timeout_s,
                )
                return
            await asyncio.sleep(0.05)

    async def settle_peers(self, timeout_s: float = PLANNED_STOP_SETTLE_S) -> bool:
        """A planned stop, once the clients are gone: waits (at most `timeout_s`) until
        every peer in reach has acknowledged what this node sent it, the last changes to the
        copies of its sessions among it. The owners that take those sessions over then have
        them as they were at the end: no message a client acknowledged here is delivered to
        it again. True if every peer did."""
        if self.dataplane is None:
            return True
        engine = self.dataplane.engine
        deadline = self.loop.time() + timeout_s
        while True:
            pending = [
                e["node_id"] for e in engine.cluster_stats() if e["up"] and e["unacked_bytes"]
            ]
            if not pending:
                return True
            if self.loop.time() >= deadline:
                logger.warning(
                    "stopping with batches not acknowledged by %s after %.1f s: they get them "
                    "when this node is back",
                    ", ".join(sorted(pending)),
                    timeout_s,
                )
                return False
            await asyncio.sleep(0.01)

    async def run_ticks(self) -> None:
        while True:
            try:
                self.tick(monotonic_ms())
            except Exception:
                # The control plane must survive its own bugs: the MQTT side keeps serving.
                logger.exception("cluster tick failed")
            await asyncio.sleep(TICK_S)

    async def poll_discovery(self) -> None:
        assert self.discovery is not None
        interval = self.settings.discovery_interval_ms / 1000
        while True:
            try:
                self.discovered = set(await self.discovery.peers())
            except Exception:
                logger.exception("discovery provider failed")
            await asyncio.sleep(interval)

    # -- the tick --------------------------------------------------------------------------

    def tick(self, now: int) -> None:
        raft = self.raft
        assert raft is not None
        raft.tick(now)
        self.after_raft_step(now)
        self.tick_membership(now)
        if now - self.last_ping >= self.settings.heartbeat_ms:
            self.last_ping = now
            self.send_pings(now)
        self.check_partial_split(now)
        self.transport.set_targets(self.link_targets())
        self.transport.maintain()

    def link_targets(self) -> set[tuple[str, int]]:
        now = monotonic_ms()
        for hint, expiry in list(self.hints.items()):
            if expiry < now:
                del self.hints[hint]
        targets = set(self.seeds) | self.discovered | set(self.hints)
        raft = self.raft
        assert raft is not None
        config = raft.latest_config
        if config is not None:
            for member, address in config.members:
                if member != self.node_id:
                    try:
                        targets.add(parse_address(address))
                    except ValueError:
                        logger.warning("member %s has a bad address %r", member, address)
        targets.discard(parse_address(self.advertise))
        targets.discard(self.listen)
        return targets

    def after_raft_step(self, now: int) -> None:
        """Persists Raft's state, then sends its messages (never the other way round: a vote
        or an acknowledgement must survive a crash once it has been sent)."""
        raft = self.raft
        assert raft is not None
        state = raft.take_persistent_state() or self.unsaved
        if state is not None:
            try:
                self.state_file.save(state)
            except OSError as error:
                # Without durable state, sending would break Raft's promises: stay silent
                # (Raft retries what it sends) and save again at the next step.
                if self.unsaved is None:
                    logger.error("cannot save the cluster state: %s; retrying", error)
                self.unsaved = state
                raft.take_messages()
                return
            if self.unsaved is not None:
                logger.info("cluster state saved again")
                self.unsaved = None
        for destination, message in raft.take_messages():
            self.transport.send(destination, RAFT, message)
        if raft.committed_config_index != self.map.version:
            self.update_map(now)

    def update_map(self, now: int) -> None:
        raft = self.raft
        assert raft is not None
        config = raft.committed_config
        if config is None:
            return
        new = compute_map(
            config.member_ids(),
            config.partitions,
            config.replication_factor,
            version=raft.committed_config_index,
        )
        old = self.map
        self.map = new
        self.map_changed_at = now
        changed = old.version != new.version or old.members != new.members
        if self.dataplane is not None and changed:
            self.dataplane.set_map(new.version, new.replicas, new.members)
        if old.members != new.members:
            logger.info(
                "partition map version %d: members %s (%s)",
                new.version,
                ", ".join(new.members),
                ", ".join(f"{k} {v}" for k, v in moved(old, new).items()) if old.members else "new",
            )
        if self.leaving and self.node_id not in new.members:
            self.left.set()

    # -- membership ------------------------------------------------------------------------

    def cluster_id(self) -> str | None:
        raft = self.raft
        config = raft.latest_config if raft is not None else None
        return config.cluster_id if config is not None else None

    def is_member(self) -> bool:
        raft = self.raft
        assert raft is not None
        config = raft.latest_config
        return config is not None and self.node_id in config.member_ids()

    def tick_membership(self, now: int) -> None:
        raft = self.raft
        assert raft is not None
        if raft.role == "leader":
            self.detect_failures(now)
            return
        if self.leaving:
            return
        if now - self.last_join_attempt < JOIN_RETRY_S * 1000:
            return
        config = raft.latest_config
        if config is None:
            in_cluster = [
                p
                for p in self.transport.connected()
                if p in self.peers
                and self.peers[p].cluster_id is not None
                and self.heard_lately(self.peers[p], now)
            ]
            if in_cluster:
                self.last_join_attempt = now
                self.ask_to_join(in_cluster)
            else:
                self.maybe_bootstrap(now)
            return
        live = self.live_peers(now)
        if not self.is_member() or config.address_of(self.node_id) != self.advertise:
            # Restarted after leaving, removed while running, or back at a new address.
            candidates = live
        else:
            # Removed while cut off: peers of our cluster know a newer map without us.
            candidates = self.removed_by(live)
        if candidates:
            self.last_join_attempt = now
            self.ask_to_join(candidates)

    def heard_lately(self, view: PeerView, now: int) -> bool:
        # A few missed pings are normal; a second more covers a busy event loop.
        return now - view.last_seen < 3 * self.settings.heartbeat_ms + 1000

    def live_peers(self, now: int) -> list[str]:
        """Peers of our cluster heard from lately."""
        own = self.cluster_id()
        return [
            p
            for p, v in self.peers.items()
            if own is not None and v.cluster_id == own and self.heard_lately(v, now)
        ]

    def removed_by(self, peers: list[str]) -> list[str]:
        """Those of `peers` whose agreed map is newer than ours and lacks this node. (A removed
        node never hears of its removal through Raft: the leader stops replicating to it.)"""
        raft = self.raft
        assert raft is not None
        return [
            p
            for p in peers
            if self.peers[p].config_index > raft.committed_config_index
            and self.node_id not in self.peers[p].member_ids
        ]

    def ask_to_join(self, candidates: list[str]) -> None:
        # The leader they name if we have a link to it, else any of them (which answers with
        # the leader's address).
        leaders = {self.peers[p].leader for p in candidates} - {None}
        target = next((leader for leader in leaders if leader in self.transport.links), None)
        target = target or candidates[0]
        logger.info("asking %s to add this node to the cluster", target)
        self.transport.send(target, JOIN, {"node": self.node_id, "address": self.advertise})

    def maybe_bootstrap(self, now: int) -> None:
        grace_s = 0 if self.settings.workers_of_node else BOOTSTRAP_GRACE_S
        if now - self.started_ms < grace_s * 1000:
            return
        # A node given seeds founds nothing while a seed is out of reach: that seed may be
        # the cluster it is meant to join (started later, or restarting).
        links = self.transport.links
        own = {parse_address(self.advertise), self.listen}
        # Discovered addresses count like seeds: one of them may be in a cluster already.
        expected = (self.seeds | self.discovered) - own
        unreached = [a for a in expected if self.transport.address_ids.get(a) not in links]
        if unreached:
            if now - self.last_seed_warning > 10_000:
                self.last_seed_warning = now
                logger.info(
                    "waiting for %s to answer before forming a cluster",
                    ", ".join(format_address(a) for a in unreached),
                )
            return
        linked = self.transport.connected()
        if any(p not in self.peers for p in linked):
            # A peer we have not heard from yet may be in a cluster already.
            return
        fresh = {p for p in linked if self.peers[p].cluster_id is None}
        fresh.add(self.node_id)
        if len(fresh) < self.settings.bootstrap_expect or min(fresh) != self.node_id:
            return
        raft = self.raft
        assert raft is not None
        config = ClusterConfig(
            members=((self.node_id, self.advertise),),
            partitions=self.settings.partitions,
            replication_factor=self.settings.replication_factor,
            cluster_id=uuid.uuid4().hex,
        )
        logger.info(
            "founding cluster %s (%d partitions, replication factor %d); %d fresh nodes in view",
            config.cluster_id,
            config.partitions,
            config.replication_factor,
            len(fresh),
        )
        raft.bootstrap(config, now)
        self.after_raft_step(now)

    def detect_failures(self, now: int) -> None:
        raft = self.raft
        assert raft is not None
        config = raft.latest_config
        if config is None:
            return
        timeout = self.settings.failure_timeout_ms
        for member in config.member_ids():
            if member == self.node_id:
                continue
            view = self.peers.get(member)
            heard = max(raft.last_ack_ms(member) or 0, view.last_seen if view else 0)
            # Counted from when this node became leader at the earliest: it cannot know more.
            heard = max(heard, self.leader_since(now))
            if now < self.planned_stops.get(member, 0):
                continue
            if now - heard <= timeout:
                continue
            through = heard_through(member, self.peers, self.node_id, now, timeout // 2, heard)
            if set(through) & set(config.member_ids()):
                # A partial split: another member still hears it (cluster/reach.py).
                continue
            reason = raft.propose(config.without_member(member), now)
            if reason is None:
                logger.warning(
                    "removing member %s: not heard from for %.1f s",
                    member,
                    (now - heard) / 1000,
                )
                self.after_raft_step(now)
            return

    def check_partial_split(self, now: int) -> None:
        """Steps aside in a partial split (its data links closed), and back once the member
        it was cut off from is heard again, or is heard by no node (cluster/reach.py)."""
        raft = self.raft
        config = raft.committed_config if raft is not None else None
        cuts: list[tuple[str, str, bool]] = []
        if self.dataplane is not None and config is not None and not self.leaving:
            since = max(self.started_ms, self.map_changed_at)
            cuts = cut_apart(
                self.node_id, config.member_ids(), self.peers, now, since, self.suspect_ms
            )
        self.cut_data_links({member for member, _, _ in cuts}, now)
        if self.dataplane is not None and config is not None:
            alive = alive_members(
                self.node_id, config.member_ids(), self.peers, now, self.suspect_ms
            )
            self.dataplane.peers_alive(alive)
        found = next(((member, through) for member, through, aside in cuts if aside), None)
        current = self.stepped_aside
        if found is None or current is not None:
            self.partial_seen_at = None
        elif self.partial_seen_at is None:
            self.partial_seen_at = now
        seen = self.partial_seen_at
        confirmed = seen is not None and now - seen >= confirm_after_ms(self.settings.heartbeat_ms)
        if found is not None and current is None and confirmed:
            member, through = found
            logger.warning(
                "partial split: cut off from %s, which %s still hears; this node steps "
                "aside (data links closed) until it hears %s again",
                member,
                through,
                member,
            )
            self.stepped_aside = (member, through, now)
            self.transport.refuse_data(f"partial split: cut off from {member}", cause=PARTIAL)
            if self.dataplane is not None:
                self.dataplane.step_aside(True)
        elif found is None and current is not None and now - current[2] >= self.suspect_ms:
            member = current[0]
            view = self.peers.get(member)
            heard = view is not None and now - view.last_seen <= self.suspect_ms
            logger.warning(
                "partial split over: %s; data links open again",
                f"{member} heard again" if heard else f"no node hears {member} any more",
            )
            self.stepped_aside = None
            self.transport.refuse_data(None, cause=PARTIAL)
            if self.dataplane is not None:
                self.dataplane.step_aside(False)

    def cut_data_links(self, members: set[str], now: int) -> None:
        """Closes the data link to each member this node is cut apart from in a partial
        split, whichever of the two steps aside, once two heartbeats of pings agree; opens
        it again as a step aside ends. The link is silent anyway, but its engine would find
        it down only at the failure timeout, and until then holds what a session that moved
        away from that member asks it for (the engine's `ask_kept_for_relaying_home`): the
        older messages it wrote to that member's link."""
        confirm = confirm_after_ms(self.settings.heartbeat_ms)
        for member in members:
            seen = self.cut_seen_at.setdefault(member, now)
            if member not in self.data_cut and now - seen >= confirm:
                logger.warning("partial split: cut off from %s; data link to it closed", member)
                self.data_cut[member] = now
                self.transport.cut_data(member, f"partial split: cut off from {member}")
        for member in [m for m in self.cut_seen_at if m not in members]:
            del self.cut_seen_at[member]
        for member, since in list(self.data_cut.items()):
            if member not in members and now - since >= self.suspect_ms:
                del self.data_cut[member]
                self.transport.cut_data(member, None)

    def leader_since(self, now: int) -> int:
        raft = self.raft
        assert raft is not None
        if self.leader_term != raft.term:
            self.leader_term = raft.term
            self.leader_started = now
        return self.leader_started

    def handle_join(self, sender: str, request: Any, now: int) -> None:
        raft = self.raft
        assert raft is not None
        node = request.get("node") if isinstance(request, dict) else None
        address = request.get("address") if isinstance(request, dict) else None
        if not isinstance(node, str) or not isinstance(address, str) or node != sender:
            return
        try:
            parse_address(address)
        except ValueError as error:
            self.transport.send(sender, JOIN_REPLY, {"ok": False, "reason": str(error)})
            return
        config = raft.latest_config
        if raft.role != "leader" or config is None:
            self.transport.send(sender, JOIN_REPLY, self.leader_hint("not the leader"))
            return
        old_address = config.address_of(node)
        if old_address == address:
            self.transport.send(sender, JOIN_REPLY, {"ok": True})
            return
        if old_address is not None:
            # A member back at a new address: one change, no partition moves. Two live
            # processes with one node id would swap it back and forth: refuse that.
            previous = self.address_changes.get(node)
            if previous and previous[0] == address and now - previous[1] < 30_000:
                logger.error(
                    "node id %s is announced from %s and %s: are two nodes using one id?",
                    node,
                    old_address,
                    address,
                )
                self.transport.send(
                    sender, JOIN_REPLY, {"ok": False, "reason": f"node id {node} is in use"}
                )
                return
        reason = raft.propose(config.with_member(node, address), now)
        if reason is None:
            if old_address is not None:
                self.address_changes[node] = (old_address, now)
                logger.info("member %s moved from %s to %s", node, old_address, address)
            else:
                logger.info("adding %s (%s) to the cluster", node, address)
            self.after_raft_step(now)
        self.transport.send(
            sender, JOIN_REPLY, {"ok": reason is None, "reason": reason or "", "retry": True}
        )

    def handle_leave(self, sender: str, request: Any, now: int) -> None:
        raft = self.raft
        assert raft is not None
        config = raft.latest_config
        if raft.role != "leader" or config is None or sender not in config.member_ids():
            return
        reason = raft.propose(config.without_member(sender), now)
        if reason is None:
            logger.info("removing %s from the cluster at its request", sender)
            self.after_raft_step(now)

    def leader_hint(self, reason: str) -> dict[str, Any]:
        raft = self.raft
        assert raft is not None
        leader = raft.leader_id
        config = raft.latest_config
        address = config.address_of(leader) if config is not None and leader else None
        return {"ok": False, "reason": reason, "leader": leader, "leader_address": address}

    def leave_blocker(self) -> str | None:
        """Why this node must not leave now, if it must not: a member whose data link is
        down would lose what this node keeps for it (messages acknowledged to publishers
        here) and the copies of its sessions held here."""
        if self.settings.workers_of_node:
            return "a worker does not leave its node's workers: stop the node (SIGTERM)"
        raft = self.raft
        config = raft.committed_config if raft is not None else None
        if config is None or self.dataplane is None:
            return None
        up = {e["node_id"]: e["up"] for e in self.dataplane.engine.cluster_stats()}
        out = sorted(m for m in config.member_ids() if m != self.node_id and not up.get(m))
        if not out:
            return None
        return (
            f"member {', '.join(out)} out of reach: what this node keeps for it would be "
            "lost; leave once it is back, or removed after the failure timeout"
        )

    async def leave(self, timeout_s: float = 10.0) -> bool:
        """Asks the leader to remove this node; True once the agreed map no longer has it."""
        # Its routes stay with its peers until it stops: its sessions get their messages
        # until they are handed on (`hand_over_sessions`).
        self.leaving = True
        deadline = self.loop.time() + timeout_s
        while self.loop.time() < deadline and not self.left.is_set():
            raft = self.raft
            assert raft is not None
            committed = raft.committed_config
            now = monotonic_ms()
            if (
                committed is None
                or self.node_id not in committed.member_ids()
                or self.removed_by(self.live_peers(now))
            ):
                self.left.set()
                break
            if raft.role == "leader":
                # Raft lets a leader commit its own removal; it steps down once committed.
                if raft.propose(committed.without_member(self.node_id), now) is None:
                    logger.info("leaving the cluster")
                    self.after_raft_step(now)
            elif raft.leader_id is not None:
                logger.info("asking the leader %s to remove this node", raft.leader_id)
                self.transport.send(raft.leader_id, LEAVE, {"node": self.node_id})
            try:
                await asyncio.wait_for(self.left.wait(), 0.5)
            except TimeoutError:
                pass
        if not self.left.is_set():
            # Not left (no majority): the node stays a normal member and may rejoin.
            self.leaving = False
        return self.left.is_set()

    # -- messages --------------------------------------------------------------------------

    def on_message(self, sender: str, kind: int, value: Any) -> None:
        if kind == DATA:
            if self.dataplane is not None:
                self.dataplane.receive(sender, value)
            return
        now = monotonic_ms()
        raft = self.raft
        if raft is None:
            return
        if kind == RAFT:
            raft.receive(sender, value, now)
            self.after_raft_step(now)
        elif kind == PING:
            self.handle_ping(sender, value, now)
        elif kind == JOIN:
            self.handle_join(sender, value, now)
        elif kind == JOIN_REPLY:
            self.handle_join_reply(sender, value)
        elif kind == LEAVE:
            self.handle_leave(sender, value, now)
        elif kind == STOPPING:
            self.handle_stopping(sender, value, now)
        # Unknown kinds come from newer nodes; ignoring them keeps mixed versions working.

    def send_pings(self, now: int) -> None:
        raft = self.raft
        assert raft is not None
        committed = raft.committed_config
        leader = raft.leader_id
        latest = raft.latest_config
        ping = {
            "cluster_id": committed.cluster_id if committed is not None else None,
            "config_index": raft.committed_config_index,
            "members": list(committed.member_ids()) if committed is not None else [],
            "leader": leader,
            "leader_address": latest.address_of(leader) if latest is not None and leader else None,
            "address": self.advertise,
            "clients": self.clients(),
            "sessions": self.sessions(),
            "copies": self.count_clients()[2],
            "streaming": self.count_clients()[3],
        }
        if committed is not None:
            members = committed.member_ids()
            ping.update(ping_fields(self.peers, members, self.node_id, now, self.suspect_ms))
        for peer in self.transport.connected():
            self.transport.send(peer, PING, ping)

    def handle_stopping(self, sender: str, notice: Any, now: int) -> None:
        within = notice.get("back_within_ms") if isinstance(notice, dict) else None
        if type(within) is not int or not 0 < within <= MAX_RESTART_MS:
            logger.warning("malformed stop notice from %s: %s", sender, reprlib.repr(notice))
            return
        self.planned_stops[sender] = now + within
        logger.info(
            "%s is stopping for a restart: it stays a member for up to %.0f s",
            sender,
            within / 1000,
        )

    def handle_ping(self, sender: str, ping: Any, now: int) -> None:
        if not isinstance(ping, dict):
            return
        # Back from its restart (or it never went).
        self.planned_stops.pop(sender, None)
        view = self.peers.setdefault(sender, PeerView())
        note_ping(view, now, self.suspect_ms)
        address = ping.get("address")
        view.address = address if isinstance(address, str) else None
        cluster_id = ping.get("cluster_id")
        view.cluster_id = cluster_id if isinstance(cluster_id, str) else None
        index = ping.get("config_index")
        view.config_index = index if type(index) is int else 0
        leader = ping.get("leader")
        view.leader = leader if isinstance(leader, str) else None
        clients = ping.get("clients")
        view.clients = clients if type(clients) is int else None
        sessions = ping.get("sessions")
        view.sessions = sessions if type(sessions) is int else None
        copies = ping.get("copies")
        view.copies = copies if type(copies) is int else None
        streaming = ping.get("streaming")
        view.streaming = streaming if type(streaming) is int else None
        members = ping.get("members")
        view.member_ids = (
            tuple(m for m in members if isinstance(m, str)) if isinstance(members, list) else ()
        )
        view.reach = parse_reach(ping.get("reach"))
        view.relayed = parse_relayed(ping.get("relayed"))
        own = self.cluster_id()
        if own is not None and view.cluster_id is not None and view.cluster_id != own:
            if view.cluster_id not in self.warned_clusters:
                self.warned_clusters.add(view.cluster_id)
                logger.error(
                    "node %s belongs to another cluster (%s, ours %s); clusters never merge",
                    sender,
                    view.cluster_id,
                    own,
                )
        leader_address = ping.get("leader_address")
        if isinstance(leader_address, str) and view.leader and view.leader != self.node_id:
            self.note_address(leader_address)

    def handle_join_reply(self, sender: str, reply: Any) -> None:
        if not isinstance(reply, dict) or reply.get("ok"):
            return
        address = reply.get("leader_address")
        if isinstance(address, str):
            self.note_address(address)
        reason = reply.get("reason")
        if isinstance(reason, str) and reason != self.last_join_refusal:
            # Said once per reason: the join is retried every JOIN_RETRY_S.
            self.last_join_refusal = reason
            logger.warning("%s did not add this node: %.200s", sender, reason)

    def note_address(self, address: str) -> None:
        try:
            parsed = parse_address(address)
        except ValueError:
            return
        if parsed != parse_address(self.advertise):
            self.hints[parsed] = monotonic_ms() + HINT_TTL_MS

    # -- admin -----------------------------------------------------------------------------

    def clients(self) -> int | None:
        """MQTT clients connected to this node (None without the data plane), counted at most
        once a second: the count walks every session, and pings go out every heartbeat."""
        return self.count_clients()[0]

    def sessions(self) -> int | None:
        """Sessions this node holds, connected or not (None without the data plane)."""
        return self.count_clients()[1]

    def member_clients(self) -> dict[str, int | None]:
        """Clients connected to each member of the map: ours counted, the others' from their
        last ping (None: not heard from)."""
        counts: dict[str, int | None] = {}
        for member in self.map.members:
            if member == self.node_id:
                counts[member] = self.clients()
            else:
                view = self.peers.get(member)
                counts[member] = view.clients if view is not None else None
        return counts

    def link_stats(self) -> dict[str, dict[str, Any]]:
        """The data plane's counters of each peer link, by node id."""
        return self.dataplane.stats() if self.dataplane is not None else {}

    def count_clients(self) -> tuple[int | None, int | None, int | None, int | None]:
        """(clients connected, sessions held, sessions of other nodes copied here, sessions
        whose copies still stream to new owners: the replication lag of a rebalance)."""
        if self.dataplane is None:
            return None, None, None, None
        now = monotonic_ms()
        if now - self.clients_counted[4] >= 1000:
            engine = self.dataplane.engine
            stats = engine.stats()
            replicas = engine.replica_stats()
            self.clients_counted = (
                int(stats["clients_connected"]),
                int(stats["sessions"]),
                int(replicas["copies"]),
                int(replicas["stream_backlog"]),
                now,
            )
        counted = self.clients_counted
        return counted[0], counted[1], counted[2], counted[3]

    def retained_pending(self, reachable_only: bool) -> list[str]:
        """Other nodes whose retained set has not arrived since their link came up: members
        of the map, and any node linked to us (a first-time joiner has no map yet, only the
        links to the nodes it joins through); all of them, or only the reachable ones."""
        if self.dataplane is None:
            return []
        synced = self.dataplane.retained_synced()
        linked = self.transport.links
        peers = set(self.map.members) | set(linked)
        peers.discard(self.node_id)
        return sorted(
            peer for peer in peers if peer not in synced and (not reachable_only or peer in linked)
        )

    def has_cluster_to_join(self) -> bool:
        """A node that is in no map yet but has somewhere to look for a cluster."""
        return not self.map.members and bool(self.seeds or self.discovery is not None)

    async def wait_member(self) -> None:
        """Until this node is a member of its cluster (a fresh one founds or joins it)."""
        while not self.is_member():
            await asyncio.sleep(0.02)

    async def wait_retained(self) -> None:
        """Before clients are served: waits until every other member has sent its retained
        set, so a node that comes back answers subscribes with the cluster's retained
        messages; a first-time joiner waits for a link to the cluster and the sets of the
        nodes it links to. A member still unreachable after the failure timeout counts as
        failed: the node serves without it (and gets its set once its link comes up)."""
        deadline = monotonic_ms() + self.settings.failure_timeout_ms
        while monotonic_ms() < deadline and (self.retained_pending(False) or self.unlinked()):
            await asyncio.sleep(0.02)
        missing = self.retained_pending(False)
        if missing:
            logger.warning(
                "serving clients before the retained messages of %s arrived (unreachable)",
                ", ".join(missing),
            )
        elif self.unlinked():
            logger.warning("serving clients before any node of the cluster was reachable")

    def unlinked(self) -> bool:
        """A first-time joiner that has no link to the cluster yet."""
        return self.has_cluster_to_join() and not self.transport.links

    def status(self) -> dict[str, Any]:
        raft = self.raft
        assert raft is not None
        now = monotonic_ms()
        config = raft.committed_config
        latest = raft.latest_config
        members = []
        if config is not None:
            for member, address in config.members:
                view = self.peers.get(member)
                seen: int | None = None
                clients = view.clients if view is not None else None
                sessions = view.sessions if view is not None else None
                copies = view.copies if view is not None else None
                streaming = view.streaming if view is not None else None
                if member == self.node_id:
                    state = "self"
                    seen = 0
                    clients, sessions, copies, streaming = self.count_clients()
                elif member in self.transport.links and view is not None:
                    seen = now - view.last_seen
                    state = "alive" if seen < self.settings.failure_timeout_ms else "suspect"
                else:
                    seen = now - view.last_seen if view is not None and view.last_seen else None
                    state = "unreachable"
                members.append(
                    {
                        "node_id": member,
                        "address": address,
                        "state": state,
                        "last_seen_ms": seen,
                        "leader": member == raft.leader_id,
                        "clients": clients,
                        "sessions": sessions,
                        "copies": copies,
                        "streaming": streaming,
                        "primary": self.map.primaries_of(member),
                        "follower": self.map.followers_of(member),
                    }
                )
        return {
            "node_id": self.node_id,
            "cluster_name": self.settings.name,
            "cluster_id": config.cluster_id if config is not None else None,
            "member": self.is_member(),
            "raft": raft.status(),
            "leader": raft.leader_id,
            "map_version": self.map.version if config is not None else None,
            "map_age_ms": now - self.map_changed_at if config is not None else None,
            "partitions": config.partitions if config is not None else self.settings.partitions,
            "replication_factor": (
                config.replication_factor
                if config is not None
                else self.settings.replication_factor
            ),
            "pending_change": latest != config,
            # This node stepped aside in a partial split (cluster/reach.py), or None.
            "partial_split": (
                {"cut_off_from": self.stepped_aside[0], "heard_through": self.stepped_aside[1]}
                if self.stepped_aside is not None
                else None
            ),
            # Members whose data link this node keeps closed in a partial split.
            "data_links_cut": sorted(self.data_cut),
            "members": members,
            "links": self.transport.stats(),
            "data_plane": self.dataplane.stats() if self.dataplane is not None else {},
        }
