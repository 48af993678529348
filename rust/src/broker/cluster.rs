//! The cluster part of the engine, beside `router`: which other nodes want which topics
//! (route rows), forwarding publishes to them, and taking in what they forward.
//!
//! - **Route rows are owned by the node whose sessions subscribed.** A node announces each
//!   filter its sessions hold (persistent offline sessions included) once, however many
//!   sessions share it, versioned: every add or remove is one version more, and a snapshot
//!   of all rows goes to a peer whenever its link comes up. Remote rows live in a
//!   `SubscriptionIndex` keyed by peer, like local ones by session: a publish is forwarded
//!   at most once to each node with a matching row, never to a node without one. Rows of a
//!   peer whose link is down stay (its persistent sessions still want their messages) until
//!   the caller removes the peer, and are kept in the store: a node that restarts while a
//!   peer is out of its reach routes by that peer's last rows until its snapshot comes.
//! - **Batches.** What goes to one peer between two `drain_cluster` calls is one batch of
//!   bytes (`crate::cluster::batch`); what comes from a peer is fed the same way. Nothing
//!   per message reaches the caller on either side.
//! - **Nothing acknowledged is lost on a link.** Batches holding QoS 1/2 or retained
//!   messages or route rows are numbered and kept until the peer acknowledges them (the
//!   receiver acknowledges once its store operations for them are written, see
//!   `Server.flush`); after a reconnect the unacknowledged ones are sent again, and the
//!   receiver skips numbers it has already applied, so QoS 2 is never delivered twice.
//!   QoS 0 is sent once, and dropped when the link is down.
//! - **A full link slows its publishers.** Past `HOLD_ABOVE` bytes queued for a peer whose
//!   link is up (not yet written, or not yet acknowledged), a connection whose publish went
//!   to that peer is not read any more (`Conn::link_wait`) until the queue is back under
//!   `RESUME_BELOW`; publishers whose messages go elsewhere are not held. A peer whose link
//!   is down holds no one: its reliable batches wait for it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::cluster_kept::{HANDED_ON_PROTOCOL, KEPT_END_PROTOCOL, TAKEN_IDS_PROTOCOL};
use super::cluster_replicas::{CopyOp, RELEASED_PROTOCOL};
use super::cluster_retained::RetainedStamps;
use super::cluster_took_routed::TOOK_ROUTED_PROTOCOL;
use super::router::{forwarded_props, Scope};
use super::state::{Message, SessionId};
use super::{ConnId, Engine};
use crate::cluster::batch::{
    self, Batch, Header, Item, ItemWriter, Mark, RoutedRange, SessionMessageKind, Stamp,
    WireMessage,
};
use crate::codec::{self, Packet, QoS};
use crate::store::{envelope, records};
use crate::topics::{self, SubOpts, SubscriptionIndex};

/// A peer node, as numbered by the caller's `cluster_add_peer`.
pub type PeerId = u16;

/// Origin of a message forwarded by another node: it is routed here, never forwarded again.
pub const REMOTE_ORIGIN: SessionId = u32::MAX - 1;

/// Reliable batches kept for one peer until it acknowledges them; past this the oldest are
/// dropped (and counted) rather than memory growing without bound.
const MAX_UNACKED_BYTES: usize = 256 << 20;
/// Batches a peer applied but has not said copied (`Peer::uncopied`), at most; the oldest
/// go past it (they only keep order: the peer holds them).
const MAX_UNCOPIED_BYTES: usize = 16 << 20;
/// QoS 0 batches waiting for a full link, at most; older ones are dropped past it. Far
/// above `HOLD_ABOVE`: only many publishers held at once, each with a read's worth of
/// publishes, could reach it.
const MAX_WAITING_QOS0_BYTES: usize = 64 << 20;
/// Bytes queued for a peer whose link is up past which its publishers are not read.
const HOLD_ABOVE: usize = 16 << 20;
/// ...and under which they are read again.
const RESUME_BELOW: usize = 8 << 20;
/// Bytes of a down peer's spilled batches read back from the store at a time.
pub(super) const LOAD_BUDGET: usize = 8 << 20;
/// A batch is closed once its items reach this size, so frames stay small enough to
/// interleave with the control plane's and to decode in one go.
const SEAL_ABOVE: usize = 1 << 20;
/// How long batches written to a peer may go unacknowledged before it counts as lagging
/// (a split or a stall begins; acknowledgements on a link that is up take milliseconds).
const LAGGING_MS: u64 = 100;

/// Counters of one peer's data-plane traffic, for metrics and `cluster status`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerStats {
    pub frames_out: u64,
    pub frames_in: u64,
    pub messages_out: u64,
    pub messages_in: u64,
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// Batches sent again after a reconnect.
    pub resent: u64,
    /// QoS 0 messages dropped because the link was down or full, and reliable batches
    /// dropped past the unacknowledged bound.
    pub dropped: u64,
    /// Route rows held for this peer.
    pub rows: u64,
    /// Bytes of batches not yet acknowledged (sent or waiting for the link).
    pub unacked_bytes: u64,
    /// The peer's whole retained set has arrived since its link came up.
    pub retained_synced: bool,
    /// Times a publisher was held because this peer's queue was full.
    pub holds: u64,
    /// Bytes of the queue only in the store (spilled while the peer was down).
    pub spilled_bytes: u64,
    /// Spilled batches read back from the store.
    pub read_back: u64,
}

/// A closed batch: reliable ones (`seq` > 0) stay until acknowledged, QoS 0 ones until
/// sent.
struct Outgoing {
    seq: u64,
    /// The incarnation of this node that made it: this one's, or an earlier one's for a
    /// batch restored from the store.
    epoch: u64,
    /// Empty while spilled.
    frame: Vec<u8>,
    /// The frame's length, also while spilled.
    len: usize,
    sent: bool,
    /// Its record in the store, once kept there (made or held while the link was down).
    stored: Option<Vec<u8>>,
    /// Only in the store (the queue of a down peer past `cluster_outbox_memory`), and
    /// whether it has been asked for (`cluster_loads`).
    spilled: bool,
    loading: bool,
    /// The version of our route rows the peer holds once it applied this batch (0: none
    /// known, e.g. sealed while its link was down).
    rows: u64,
}

impl Outgoing {
    /// A batch just sealed, neither sent nor stored yet.
    fn unsent(seq: u64, epoch: u64, frame: Vec<u8>, rows: u64) -> Outgoing {
        Outgoing {
            seq,
            epoch,
            len: frame.len(),
            frame,
            sent: false,
            stored: None,
            spilled: false,
            loading: false,
            rows,
        }
    }
}

/// A batch of a down peer's queue: its record in the store (if kept there), and what
/// `each_kept_frame` tells of the batches in memory.
pub(super) struct KeptBatch {
    pub(super) key: Option<Vec<u8>>,
    pub(super) len: usize,
    pub(super) epoch: u64,
    pub(super) seq: u64,
    pub(super) sent: bool,
}

struct Peer {
    name: Arc<str>,
    /// Its key in messages' `also` lists (the hash of its name, as in retained stamps).
    key: u64,
    /// The link is up and may take more bytes now.
    up: bool,
    writable: bool,
    /// The inter-node protocol version of its link (items a version lacks are not sent).
    protocol: u16,
    /// Its link has been up in this run (before that its protocol is not known).
    seen_up: bool,
    /// Since when its link is down (ms; meaningless while up).
    down_since: u64,
    /// The control plane hears it, or a member that hears it (`cluster_peer_alive`): its
    /// data link down is not its death (a partial split, its store failing).
    alive: bool,
    /// Since when nothing had come from it when its link last went down (ms; 0: not down
    /// in this run): a split is found by a silence (`cluster_link_lost`).
    silent_since: u64,
    /// A batch with items has come on its link since it came up: the first one holds what
    /// the peer's sessions took while the two were out of touch (`TakenIds`), if anything.
    heard: bool,
    /// The filters this peer's sessions hold, and which version of them (in the peer's
    /// incarnation `rows_epoch`) is applied here.
    rows: HashSet<Arc<str>>,
    rows_epoch: u64,
    rows_version: u64,
    /// The version of our rows queued for it since its link came up (0 before any), and
    /// the one it is known to hold (an acknowledged batch had it; 0 after its link went
    /// down): a session's old home relays for it until every peer holds its new rows.
    rows_queued: u64,
    rows_held: u64,
    /// Items for the next batch; `reliable` once one of them must not be lost.
    items: ItemWriter,
    item_messages: u64,
    reliable: bool,
    out: VecDeque<Outgoing>,
    unacked_bytes: usize,
    /// Our batches of this incarnation the peer acknowledged (applied) but has not said
    /// copied (`Safe`), in order (their seq and frame): if it is cut off before its copies
    /// reach their owners, a session taken over from such a stale copy gets them from here
    /// as kept, past the copy's mark, before newer ones, not behind them with the peer's
    /// hand-over at the heal (partial splits). In memory only: the peer holds them.
    uncopied: VecDeque<(u64, Vec<u8>)>,
    uncopied_bytes: usize,
    waiting_qos0_bytes: usize,
    next_seq: u64,
    /// The last of our reliable batches the peer has acknowledged, and when an
    /// acknowledgement last came (or the link came up).
    acked_seq: u64,
    acked_at: u64,
    /// Our reliable batch sent when another link went down: until the peer acknowledges
    /// it, it is not known to be in reach (its link may be silent too: a split is found
    /// one link at a time), so it does not count for `cluster_authority`. 0: none.
    probe_seq: u64,
    /// The origin and sequence (`next_message_id`) of the newest message it published that
    /// came here routed (`cluster_relay_order`).
    last_routed: (u64, u64),
    /// The peer's incarnation and the last of its reliable batches applied here.
    recv_epoch: u64,
    recv_seq: u64,
    /// Batches of the peer applied here whose copies are not all acknowledged (their seq,
    /// and the (peer, batch) pairs): the peer's `Safe` stops below the first of them (its
    /// acknowledgement does not: it says applied only).
    recv_held: VecDeque<(u64, Vec<(PeerId, u64)>)>,
    /// The last `Safe` told the peer, and the last it told us (of our incarnation).
    safe_sent: u64,
    safe_seq: u64,
    ack_due: bool,
    /// Connections not read because a publish of theirs waits in this peer's full queue.
    waiters: Vec<ConnId>,
    /// Store records of batches dropped past the bound, to delete.
    dead_records: Vec<Vec<u8>>,
    /// Bytes of `out` only in the store.
    spilled_bytes: usize,
    /// The next batch to send is spilled: its records are to be read back.
    load_due: bool,
    /// Batches may be compressed (the engine's `cluster_compress`).
    compress: bool,
    stats: PeerStats,
}

impl Peer {
    fn new(name: Arc<str>) -> Peer {
        Peer {
            key: super::cluster_retained::node_key(&name),
            name,
            up: false,
            writable: true,
            protocol: 2,
            seen_up: false,
            down_since: 0,
            alive: false,
            silent_since: 0,
            heard: false,
            rows: HashSet::new(),
            rows_epoch: 0,
            rows_version: 0,
            rows_queued: 0,
            rows_held: 0,
            items: ItemWriter::default(),
            item_messages: 0,
            reliable: false,
            out: VecDeque::new(),
            unacked_bytes: 0,
            uncopied: VecDeque::new(),
            uncopied_bytes: 0,
            waiting_qos0_bytes: 0,
            next_seq: 1,
            acked_seq: 0,
            probe_seq: 0,
            acked_at: 0,
            last_routed: (0, 0),
            recv_epoch: 0,
            recv_seq: 0,
            recv_held: VecDeque::new(),
            safe_sent: 0,
            safe_seq: 0,
            ack_due: false,
            waiters: Vec::new(),
            dead_records: Vec::new(),
            spilled_bytes: 0,
            load_due: false,
            compress: true,
            stats: PeerStats::default(),
        }
    }

    fn can_send(&self) -> bool {
        self.up && self.writable
    }

    /// Whether the peer may be cut off from this node (its link down, or batches written
    /// to it unacknowledged for `LAGGING_MS`): it may be making versions of our sessions
    /// meanwhile, so messages for it list the sessions here that took them (protocol 11).
    fn lagging(&self, now: u64) -> bool {
        self.protocol >= 11
            && (!self.up
                || (!self.out.is_empty() && now.saturating_sub(self.acked_at) >= LAGGING_MS))
    }

    /// The last of the peer's batches applied here whose copies are all acknowledged (a
    /// `Safe` item tells the peer; its publishers' acknowledgements wait for it).
    fn safe_to_peer(&self) -> u64 {
        self.recv_held.front().map_or(self.recv_seq, |h| h.0 - 1)
    }

    /// The last of our batches the peer has applied and, from protocol 4 on, copied: what a
    /// publisher's acknowledgement waits for. (Acknowledgements of batches never wait for
    /// copies, so no two nodes can wait on each other.)
    fn confirmed(&self) -> u64 {
        if self.protocol >= 4 {
            self.safe_seq
        } else {
            self.acked_seq
        }
    }

    /// Bytes waiting for this peer: not yet written, or written and not yet acknowledged.
    fn queued(&self) -> usize {
        self.unacked_bytes + self.waiting_qos0_bytes + self.items.len()
    }

    /// Closes the batch being written (if it has items or an acknowledgement is due) into
    /// the outgoing queue.
    fn seal(&mut self, epoch: u64) {
        if self.items.is_empty() && !self.ack_due {
            return;
        }
        let safe = self.safe_to_peer();
        if self.protocol >= 4 && self.seen_up && safe != self.safe_sent {
            self.items.safe(self.recv_epoch, safe);
            self.safe_sent = safe;
        }
        let seq = if self.reliable {
            self.next_seq += 1;
            self.next_seq - 1
        } else {
            0
        };
        // Compressed only when the link is down (kept on disk) or backed up: then bandwidth
        // is short and zstd pays; on a link that keeps up it would only cost CPU on both
        // nodes.
        let compress =
            self.compress && (!self.up || !self.writable || self.out.iter().any(|o| !o.sent));
        let frame = self.items.finish_with(
            Header {
                epoch,
                seq,
                ack_epoch: self.recv_epoch,
                ack_seq: self.recv_seq,
            },
            compress,
        );
        self.ack_due = false;
        self.reliable = false;
        self.stats.messages_out += self.item_messages;
        if seq == 0 {
            self.waiting_qos0_bytes += frame.len();
        } else {
            self.unacked_bytes += frame.len();
        }
        self.out
            .push_back(Outgoing::unsent(seq, epoch, frame, self.rows_queued));
        self.item_messages = 0;
        self.bound_queue();
    }

    /// Drops what must go past the bounds: QoS 0 batches waiting for a full link, then the
    /// oldest reliable ones (both counted).
    fn bound_queue(&mut self) {
        while self.waiting_qos0_bytes > MAX_WAITING_QOS0_BYTES {
            let Some(i) = self.out.iter().position(|o| o.seq == 0 && !o.sent) else {
                break;
            };
            let o = self.out.remove(i).expect("found");
            self.waiting_qos0_bytes -= o.len;
            self.stats.dropped += 1;
        }
        // Only what is in memory counts: a stored queue spills instead (see `spill`).
        while self.unacked_bytes - self.spilled_bytes > MAX_UNACKED_BYTES {
            let Some(i) = self.out.iter().position(|o| o.seq != 0 && !o.spilled) else {
                break;
            };
            let o = self.out.remove(i).expect("found");
            self.unacked_bytes -= o.len;
            self.stats.dropped += 1;
            self.dead_records.extend(o.stored);
        }
        self.stats.unacked_bytes = self.unacked_bytes as u64;
    }

    /// Sends every queued frame not sent yet, in order; QoS 0 ones are then forgotten.
    fn send_queued(&mut self, id: PeerId, f: &mut impl FnMut(PeerId, &[u8])) {
        if !self.can_send() {
            return;
        }
        // Reliable batches of an earlier incarnation (restored) go first, and this one's wait
        // until they are acknowledged: the peer numbers what it applied per incarnation.
        let mut epoch = None;
        for o in self.out.iter_mut() {
            if o.seq != 0 {
                match epoch {
                    None => epoch = Some(o.epoch),
                    Some(e) if e != o.epoch => break,
                    Some(_) => {}
                }
            }
            if o.sent {
                continue;
            }
            if o.spilled {
                // Read back first (`cluster_loads`); what follows waits, in order.
                self.load_due |= !o.loading;
                break;
            }
            o.sent = true;
            self.stats.frames_out += 1;
            self.stats.bytes_out += o.frame.len() as u64;
            f(id, &o.frame);
            if o.seq == 0 {
                self.waiting_qos0_bytes -= o.len;
            }
        }
        self.out.retain(|o| o.seq != 0 || !o.sent);
    }

    /// The peer has applied the reliable batches of our incarnation `epoch` up to `seq`;
    /// the store records of those kept there go to `done`. Those of this incarnation
    /// (`own`) it has not said copied stay as `uncopied`.
    fn acknowledged(&mut self, epoch: u64, seq: u64, own: u64, done: &mut Vec<Vec<u8>>) {
        while self
            .out
            .front()
            .is_some_and(|o| o.seq != 0 && o.epoch == epoch && o.seq <= seq && o.sent)
        {
            let o = self.out.pop_front().expect("checked");
            self.unacked_bytes -= o.len;
            self.rows_held = self.rows_held.max(o.rows);
            done.extend(o.stored);
            if self.protocol >= 4 && o.epoch == own && o.seq > self.safe_seq {
                self.uncopied_bytes += o.frame.len();
                self.uncopied.push_back((o.seq, o.frame));
            }
        }
        while self.uncopied_bytes > MAX_UNCOPIED_BYTES {
            let Some((_, frame)) = self.uncopied.pop_front() else {
                break;
            };
            self.uncopied_bytes -= frame.len();
        }
        self.stats.unacked_bytes = self.unacked_bytes as u64;
    }

    /// The peer says its copies of our batches up to `seq` are acknowledged.
    fn copied(&mut self, seq: u64) {
        self.safe_seq = seq;
        while self.uncopied.front().is_some_and(|u| u.0 <= seq) {
            let (_, frame) = self.uncopied.pop_front().expect("checked");
            self.uncopied_bytes -= frame.len();
        }
    }

    /// Keeps at most `memory` bytes of stored batches in memory: the newest others are left
    /// only in the store.
    fn spill(&mut self, memory: usize) {
        let mut in_memory = self.unacked_bytes - self.spilled_bytes;
        for o in self.out.iter_mut().rev() {
            if in_memory <= memory {
                break;
            }
            if o.stored.is_some() && !o.spilled {
                o.spilled = true;
                o.frame = Vec::new();
                self.spilled_bytes += o.len;
                in_memory -= o.len;
            }
        }
        self.stats.spilled_bytes = self.spilled_bytes as u64;
    }
}

/// A PUBACK or PUBREC held until the peers the message was forwarded to have it.
struct HeldAck {
    conn: ConnId,
    serial: u64,
    packet: Packet,
    /// (peer, batch) pairs still to be acknowledged.
    waits: Vec<(PeerId, u64)>,
}

/// Where the message being routed goes besides this node, worked out by `plan_forward`
/// before local delivery (which may give shared groups away) and sent by `forward`.
#[derive(Default)]
struct Plan {
    /// Peers with a matching plain row (every peer for a retained message).
    plain: Vec<PeerId>,
    /// One of the peers it goes to is lagging: `taken` lists the client ids of the sessions
    /// here that took it (local delivery fills it).
    lagging: bool,
    taken: Vec<Arc<str>>,
    /// Some peer of protocol 11 or later may get it: a QoS 2 delivery here is listed to
    /// every such peer, lagging or not (`Cluster::note_taken`).
    listable: bool,
    /// `taken` goes to every peer of protocol 11 or later, not only to lagging ones.
    taken_everywhere: bool,
    /// Shared subscriptions matched on other nodes: the key, its peers, and whether local
    /// delivery has decided it already.
    groups: Vec<(Box<str>, Vec<PeerId>, bool)>,
    /// Shared subscriptions given to a peer to serve.
    assigned: Vec<(PeerId, Box<str>)>,
}

#[derive(Default)]
pub(super) struct Cluster {
    /// This process's incarnation (0: the cluster part is off).
    epoch: u64,
    /// CONNECTs wait for the first partition map (`cluster_require_map`).
    pub(super) require_map: bool,
    /// This node stepped aside in a partial split, or until when (monotonic ms) it counts
    /// as aside after that (`cluster_step_aside`).
    pub(super) stepped_aside: bool,
    pub(super) aside_until: u64,
    /// The high half of the ids of messages published here (this node and incarnation),
    /// and the counter of the low half.
    message_origin: u64,
    message_seq: u64,
    peers: Vec<Option<Peer>>,
    /// Remote route rows: which peers have subscribers for which filters.
    routes: SubscriptionIndex<PeerId>,
    /// Local sessions per filter: a row is announced when the first subscribes and
    /// withdrawn when the last goes.
    local_filters: HashMap<Arc<str>, u32>,
    route_version: u64,
    /// Some batch or acknowledgement waits for `drain_cluster`.
    has_output: bool,
    scratch_peers: Vec<(PeerId, SubOpts)>,
    scratch_targets: Vec<PeerId>,
    scratch_item: Vec<u8>,
    scratch_props: Vec<u8>,
    scratch_also: Vec<u64>,
    /// The (peer, batch) pairs the last `forward` put a reliable message in, on links up.
    waits: Vec<(PeerId, u64)>,
    held_acks: VecDeque<HeldAck>,
    plan: Plan,
    /// Whether the engine keeps a store (copies for down peers are stored).
    pub(super) durable: bool,
    /// This node's name.
    pub(super) name: Arc<str>,
    /// Round-robin position of each shared subscription over the nodes that hold members.
    shared_cursors: HashMap<Box<str>, u32>,
    pub(super) retained: RetainedStamps,
    /// Peers whose full queue the packet being handled put a message in (see `limits`).
    pub(super) full_links: Vec<PeerId>,
    /// A reliable item went to a peer whose link is down: its batch is closed and stored
    /// before the next store write (so the publish is acknowledged only once kept).
    down_items: bool,
    /// The message being routed went to such a peer.
    routed_to_down: bool,
    /// Wall time this incarnation started, in the keys of its stored batches.
    start_wall: u64,
    /// Batches restored from the store, by peer name, until the peer is added.
    restored: HashMap<Arc<str>, VecDeque<Outgoing>>,
    /// Route rows restored from the store, by peer name, until the peer is added.
    restored_rows: HashMap<Arc<str>, Vec<Arc<str>>>,
}

/// What changed in a peer's rows.
#[derive(Default)]
struct RowChanges {
    added: Vec<Arc<str>>,
    removed: Vec<Arc<str>>,
}

impl Cluster {
    /// Whether the message being routed goes where a peer lags (`Plan::lagging`).
    pub(super) fn lagging_plan(&self) -> bool {
        self.plan.lagging
    }

    /// Whether a QoS 2 delivery of the message being routed is to be listed as taken
    /// (`Plan::listable`).
    pub(super) fn listable_plan(&self) -> bool {
        self.plan.listable
    }

    /// A session here with a copy elsewhere (client `client`) took the message being
    /// routed: listed for lagging peers, or, with `everywhere` (a QoS 2 delivery), for
    /// every peer of protocol 11 or later: a split that begins as the message goes out
    /// is noticed only `LAGGING_MS` later, and a version made meanwhile from a copy on the
    /// other side must not deliver it again. `TAKEN_MAX` at most (past that, a version made
    /// on one of them may get it twice).
    pub(super) fn note_taken(&mut self, client: Arc<str>, everywhere: bool) {
        self.plan.taken_everywhere |= everywhere;
        if self.plan.taken.len() < batch::TAKEN_MAX {
            self.plan.taken.push(client);
        }
    }

    /// Whether some peer lags (`Peer::lagging`).
    pub(super) fn any_lagging(&self, now: u64) -> bool {
        self.peers.iter().flatten().any(|p| p.lagging(now))
    }

    /// Whether the message just routed was queued for a peer whose link is down (and will be
    /// stored with the next store write).
    pub(super) fn to_down_peer(&self) -> bool {
        self.routed_to_down
    }

    fn peer_mut(&mut self, id: PeerId) -> Option<&mut Peer> {
        self.peers.get_mut(usize::from(id)).and_then(Option::as_mut)
    }

    fn each_up_peer(&mut self, mut f: impl FnMut(&mut Peer)) {
        for peer in self.peers.iter_mut().flatten() {
            if peer.up {
                f(peer);
            }
        }
    }

    /// This incarnation (0: the cluster part is off).
    /// A new cluster-wide id for a message published on this node (0 outside a cluster).
    pub(super) fn next_message_id(&mut self) -> u128 {
        if self.epoch == 0 {
            return 0;
        }
        self.message_seq += 1;
        (u128::from(self.message_origin) << 64) | u128::from(self.message_seq)
    }

    pub(super) fn epoch_of(&self) -> u64 {
        self.epoch
    }

    pub(super) fn peer_name(&self, id: PeerId) -> Option<Arc<str>> {
        self.peer_ref(id).map(|p| p.name.clone())
    }

    pub(super) fn peer_id_of(&self, name: &str) -> Option<PeerId> {
        self.peers
            .iter()
            .position(|p| p.as_ref().is_some_and(|p| &*p.name == name))
            .map(|i| i as PeerId)
    }

    /// The peer whose key (the hash of its name) is `key`.
    pub(super) fn peer_by_key(&self, key: u64) -> Option<PeerId> {
        self.peers
            .iter()
            .position(|p| p.as_ref().is_some_and(|p| p.key == key))
            .map(|i| i as PeerId)
    }

    /// The batches kept for peer `id` from the first that lives only in the store on, in
    /// queue order (some of them may be in memory: each spill takes the newest batches, so
    /// those queued after an earlier spill stay in memory while there is room).
    pub(super) fn batches_from_store(&self, id: PeerId) -> Vec<KeptBatch> {
        let Some(peer) = self.peer_ref(id) else {
            return Vec::new();
        };
        let first = peer.out.iter().position(|o| o.spilled);
        let from = first.unwrap_or(peer.out.len());
        peer.out
            .iter()
            .skip(from)
            .map(|o| KeptBatch {
                key: o.stored.clone(),
                len: o.len,
                epoch: o.epoch,
                seq: o.seq,
                sent: o.sent,
            })
            .collect()
    }

    /// The frame of each of `batches` (of peer `id`'s queue) that is in memory now.
    pub(super) fn kept_in_memory(&self, id: PeerId, batches: &[KeptBatch]) -> Vec<Option<&[u8]>> {
        let mut frames = vec![None; batches.len()];
        let Some(peer) = self.peer_ref(id) else {
            return frames;
        };
        let index: HashMap<(u64, u64), usize> = batches
            .iter()
            .enumerate()
            .map(|(i, b)| ((b.epoch, b.seq), i))
            .collect();
        for o in peer.out.iter().filter(|o| !o.spilled) {
            if let Some(&i) = index.get(&(o.epoch, o.seq)) {
                frames[i] = Some(&o.frame[..]);
            }
        }
        frames
    }

    /// Calls `f(incarnation, number, written to the link, frame)` with each batch kept for
    /// peer `id` before the first that lives only in the store, oldest first (what was
    /// queued for it is closed first). Returns the batches from that one on.
    pub(super) fn each_kept_frame(
        &mut self,
        id: PeerId,
        mut f: impl FnMut(u64, u64, bool, &[u8]),
    ) -> Vec<KeptBatch> {
        let epoch = self.epoch;
        let Some(peer) = self.peer_mut(id) else {
            return Vec::new();
        };
        peer.seal(epoch);
        for (seq, frame) in &peer.uncopied {
            f(epoch, *seq, true, frame);
        }
        for o in peer.out.iter().take_while(|o| !o.spilled) {
            f(o.epoch, o.seq, o.sent, &o.frame);
        }
        self.batches_from_store(id)
    }

    /// An item that must not be lost, for peer `id` if it speaks protocol `min` or later.
    fn queue_reliable(&mut self, id: PeerId, min: u16, write: impl FnOnce(&mut ItemWriter)) {
        if let Some(peer) = self.peer_mut(id).filter(|p| p.protocol >= min) {
            write(&mut peer.items);
            peer.reliable = true;
            self.has_output = true;
        }
    }

    /// Writes items for peer `id` (of protocol `min` or later) into a batch of their own,
    /// not numbered, that goes ahead of every batch waiting for it: what the peer must know
    /// before it reads those. Made again each time the link comes up.
    pub(super) fn queue_first(
        &mut self,
        id: PeerId,
        min: u16,
        write: impl FnOnce(&mut ItemWriter),
    ) {
        let epoch = self.epoch;
        let Some(peer) = self.peer_mut(id).filter(|p| p.protocol >= min) else {
            return;
        };
        let mut items = ItemWriter::default();
        write(&mut items);
        if items.is_empty() {
            return;
        }
        let header = Header {
            epoch,
            seq: 0,
            ack_epoch: peer.recv_epoch,
            ack_seq: peer.recv_seq,
        };
        let frame = items.finish_with(header, false);
        peer.waiting_qos0_bytes += frame.len();
        peer.out.push_front(Outgoing::unsent(0, epoch, frame, 0));
        self.has_output = true;
    }

    /// Tells peer `id` (a node the session `client_id` moved to from here) which messages
    /// another version of it (`stamp`), on the node with key `node`, delivered (`TakenIds`).
    pub(super) fn queue_taken_ids(
        &mut self,
        id: PeerId,
        client_id: &str,
        stamp: Stamp,
        node: u64,
        ids: &[u128],
    ) {
        self.queue_reliable(id, TAKEN_IDS_PROTOCOL, |items| {
            items.taken_ids(client_id, stamp, node, ids.iter().copied());
        });
    }

    /// Tells peer `id` (an owner this node copied to) that it applied `mark`.
    pub(super) fn queue_applied(&mut self, id: PeerId, mark: Mark) {
        self.queue_reliable(id, 7, |items| items.applied(mark));
    }

    /// The keys of the peers that lag (`Peer::lagging`) and tell what their sessions took
    /// when their links come up (protocol `min` or later).
    pub(super) fn lagging_keys(&self, min: u16, now: u64) -> Vec<u64> {
        let peers = self.peers.iter().flatten();
        peers
            .filter(|p| p.protocol >= min && p.lagging(now))
            .map(|p| p.key)
            .collect()
    }

    /// Whether every peer is in touch: its link up, heard from since it came up, and
    /// acknowledging what this node sends (`Peer::lagging`).
    pub(super) fn all_in_touch(&self, now: u64) -> bool {
        let mut peers = self.peers.iter().flatten();
        peers.all(|p| p.up && p.heard && !p.lagging(now))
    }

    /// Whether the node with key `key` has been heard from since its link came up (what it
    /// took is known), or is no longer a peer.
    pub(super) fn heard_or_gone(&self, key: u64) -> bool {
        self.peer_by_key(key)
            .and_then(|id| self.peer_ref(id))
            .is_none_or(|p| p.up && p.heard)
    }

    /// Peers up that speak protocol `min` or later.
    pub(super) fn up_peers_from(&self, min: u16) -> Vec<PeerId> {
        self.peers
            .iter()
            .enumerate()
            .filter(|(_, p)| p.as_ref().is_some_and(|p| p.up && p.protocol >= min))
            .map(|(i, _)| i as PeerId)
            .collect()
    }

    pub(super) fn queue_kept_ask(
        &mut self,
        id: PeerId,
        client_id: &str,
        home: u64,
        again: bool,
        applied: Option<(u64, u64)>,
        subs: &[batch::KeptSub<'_>],
    ) {
        self.queue_reliable(id, 0, |items| {
            items.kept_ask(client_id, home, again, applied, subs)
        });
    }

    /// Tells peer `id` that the answer to its `KeptAsk` for `client_id` ends here.
    pub(super) fn queue_kept_end(&mut self, id: PeerId, client_id: &str) {
        self.queue_reliable(id, KEPT_END_PROTOCOL, |items| items.kept_end(client_id, 0));
    }

    /// Passes on to peer `id` the `KeptEnd` the node with key `origin` sent here for a
    /// session that moved on to `id` (only to a peer of protocol 15: to another it would
    /// end the wait for this node instead).
    pub(super) fn queue_kept_end_from(&mut self, id: PeerId, client_id: &str, origin: u64) {
        self.queue_reliable(id, HANDED_ON_PROTOCOL, |items| {
            items.kept_end(client_id, origin)
        });
    }

    /// Whether peer `id`'s link has been up in this run (its protocol is known).
    pub(super) fn peer_seen_up(&self, id: PeerId) -> bool {
        self.peer_ref(id).is_some_and(|p| p.seen_up)
    }

    pub(super) fn peer_up(&self, id: PeerId) -> bool {
        self.peer_ref(id).is_some_and(|p| p.up)
    }

    /// The origin of the messages peer `id` published that came here routed (0: none yet).
    pub(super) fn routed_origin(&self, id: PeerId) -> u64 {
        self.peer_ref(id).map_or(0, |p| p.last_routed.0)
    }

    /// Each peer's `routed_origin` with the sequence of its newest message come here
    /// routed (peers none have come from yet left out).
    pub(super) fn routed_marks(&self) -> Vec<(u64, u64)> {
        let peers = self.peers.iter().flatten();
        peers
            .filter(|p| p.last_routed.0 != 0)
            .map(|p| p.last_routed)
            .collect()
    }

    /// Tells peer `id` which of its peers' routed messages came here while session
    /// `client_id`, just handed over to it, lived here (`cluster_took_routed`).
    pub(super) fn queue_took_routed(
        &mut self,
        id: PeerId,
        client_id: &str,
        ranges: &[RoutedRange],
    ) {
        self.queue_reliable(id, TOOK_ROUTED_PROTOCOL, |items| {
            items.took_routed(client_id, ranges)
        });
    }

    /// Whether message `id` came here routed from the node that published it (it sends in
    /// order): None when no peer's routed messages carry its origin.
    pub(super) fn routed_here(&self, id: u128) -> Option<bool> {
        let origin = (id >> 64) as u64;
        self.peers
            .iter()
            .flatten()
            .find(|p| p.last_routed.0 == origin)
            .map(|p| p.last_routed.1 >= id as u64)
    }

    /// Whether our reliable batch `seq` (of this incarnation) still waits for peer `id`'s
    /// acknowledgement (it goes again when the link comes up).
    pub(super) fn holds_batch(&self, id: PeerId, seq: u64) -> bool {
        let epoch = self.epoch;
        self.peer_ref(id)
            .is_some_and(|p| p.out.iter().any(|o| o.seq == seq && o.epoch == epoch))
    }

    /// The last of our reliable batches queued for peer `id` (0: none).
    pub(super) fn last_reliable(&self, id: PeerId) -> u64 {
        self.peer_ref(id).map_or(0, |p| p.next_seq - 1)
    }

    /// Up, and has acknowledged the batch sent it when another link last went down.
    pub(super) fn peer_in_reach(&self, id: PeerId) -> bool {
        self.peer_ref(id)
            .is_some_and(|p| p.up && p.acked_seq >= p.probe_seq)
    }

    /// Another link went down: every peer still up is sent a reliable batch (empty if
    /// nothing else goes), and counts as in reach again once it acknowledges it.
    fn probe_up_peers(&mut self) {
        for peer in self.peers.iter_mut().flatten().filter(|p| p.up) {
            peer.probe_seq = peer.next_seq;
            peer.reliable = true;
            peer.ack_due = true;
        }
        self.has_output = true;
    }

    /// Whether every peer besides `except` is linked and has sent its route rows and
    /// retained set since (`RetainedSent` comes after the rows on a link), or is in `gone`:
    /// what is published here now reaches every subscriber on the nodes that can be reached.
    pub(super) fn routes_known(&self, gone: &[PeerId], except: Option<PeerId>) -> bool {
        self.peers.iter().enumerate().all(|(i, p)| {
            let i = i as PeerId;
            p.as_ref().is_none_or(|p| {
                (p.up && p.stats.retained_synced) || gone.contains(&i) || Some(i) == except
            })
        })
    }

    /// Peers whose link has been down for `ms` or more. A peer whose link has not come up
    /// yet in this run counts from the first time it is asked about: a node that just
    /// started (its links still connecting) does not take its peers for dead.
    pub(super) fn down_longer_than(&mut self, ms: u64, now: u64) -> Vec<PeerId> {
        self.peers
            .iter_mut()
            .enumerate()
            .filter_map(|(i, p)| {
                let p = p.as_mut()?;
                if !p.up && p.down_since == 0 {
                    p.down_since = now;
                }
                (!p.up && now.saturating_sub(p.down_since) >= ms).then_some(i as PeerId)
            })
            .collect()
    }

    /// Peers down for `ms` or more (`down_longer_than`) that the control plane does not
    /// know to be alive (`cluster_peer_alive`): those whose connections have ended, and
    /// that hold no session a fresh one here could replace.
    pub(super) fn dead_longer_than(&mut self, ms: u64, now: u64) -> Vec<PeerId> {
        let mut down = self.down_longer_than(ms, now);
        down.retain(|&p| !self.peer_ref(p).is_some_and(|p| p.alive));
        down
    }

    /// A copy operation for peer `id` (a protocol 4 peer, or one not heard from yet in this
    /// run): `(link up, the batch it goes in)`, or None if it cannot take copies.
    pub(super) fn queue_copy(
        &mut self,
        id: PeerId,
        map: u64,
        stamp: Stamp,
        key: &[u8],
        value: Option<&[u8]>,
        at: u64,
    ) -> Option<(bool, u64)> {
        let durable = self.durable;
        let peer = self.peer_mut(id)?;
        if peer.seen_up && peer.protocol < 4 {
            return None;
        }
        // Only a peer known to speak protocol 6 reads the moment.
        let at = (peer.seen_up && peer.protocol >= 6).then_some(at);
        peer.items.copy(map, stamp, key, value, at);
        peer.reliable = true;
        let at = (peer.up, peer.next_seq);
        if !peer.up && durable {
            // Kept in the store with the next write, before the acknowledgement it allows.
            self.down_items = true;
            self.routed_to_down = true;
        }
        self.has_output = true;
        Some(at)
    }

    /// Tells every peer that can hear it (protocol 4, or not heard from yet in this run:
    /// kept for it while down) that `client_id` is installed here.
    pub(super) fn queue_installed(&mut self, client_id: &str) {
        let durable = self.durable;
        let mut any = false;
        let mut down = false;
        for peer in self.peers.iter_mut().flatten() {
            if peer.seen_up && peer.protocol < 4 {
                continue;
            }
            peer.items.installed(client_id);
            peer.reliable = true;
            any = true;
            down |= !peer.up;
        }
        self.has_output |= any;
        self.down_items |= down && durable;
    }

    /// Whether peer `id` is up with less than `max` bytes waiting for it (a session may be
    /// streamed to it now).
    pub(super) fn stream_room(&self, id: PeerId, max: usize) -> bool {
        self.peer_ref(id).is_some_and(|p| p.up && p.queued() < max)
    }

    /// Whether peer `id` has applied and copied our batch `seq` (and every one before it).
    pub(super) fn copied_through(&self, id: PeerId, seq: u64) -> bool {
        self.peer_ref(id).is_some_and(|p| p.confirmed() >= seq)
    }

    /// Whether something waits for peer `id` to confirm our batch `seq`: it is up and has
    /// not (a peer that is down is not waited for: the wait is degraded).
    pub(super) fn awaits(&self, id: PeerId, seq: u64) -> bool {
        self.peer_ref(id)
            .is_some_and(|peer| peer.up && peer.confirmed() < seq)
    }

    /// As `awaits`, but a peer out of reach is waited for too (until the map drops it):
    /// output to a client on the side of a split that does not act (`cluster_authority`).
    pub(super) fn awaits_even_down(&self, id: PeerId, seq: u64) -> bool {
        self.peer_ref(id).is_some_and(|peer| peer.confirmed() < seq)
    }

    pub(super) fn peer_protocol(&self, id: PeerId) -> u16 {
        self.peer_ref(id).map_or(0, |p| p.protocol)
    }

    pub(super) fn queue_copy_check(&mut self, id: PeerId, client_id: &str, stamp: Stamp) {
        self.queue_reliable(id, 4, |items| items.copy_check(client_id, stamp));
    }

    pub(super) fn queue_fence(&mut self, id: PeerId, client_id: &str, stamp: Stamp, home: &str) {
        self.queue_reliable(id, 4, |items| items.fence(client_id, stamp, home));
    }

    /// Peers a claim of a client id goes to: those reachable that speak protocol 3.
    pub(super) fn claim_peers(&self) -> Vec<PeerId> {
        if self.epoch == 0 {
            return Vec::new();
        }
        self.peers
            .iter()
            .enumerate()
            .filter(|(_, p)| p.as_ref().is_some_and(|p| p.up && p.protocol >= 3))
            .map(|(i, _)| i as PeerId)
            .collect()
    }

    pub(super) fn queue_claim(&mut self, id: PeerId, client_id: &str, stamp: Stamp, discard: bool) {
        self.queue_reliable(id, 0, |items| items.claim(client_id, stamp, discard));
    }

    /// `copy_at`: answered from a copy current as of then (told to peers of protocol 6).
    pub(super) fn queue_claim_answer(
        &mut self,
        id: PeerId,
        client_id: &str,
        stamp: Stamp,
        records: &[(Vec<u8>, Vec<u8>)],
        copy_at: Option<u64>,
        marks: &[Mark],
    ) {
        if let Some(peer) = self.peer_mut(id) {
            let copy_at = copy_at.filter(|_| peer.protocol >= 6);
            let marks = (peer.protocol >= 7).then_some(marks);
            peer.items
                .claim_answer(client_id, stamp, records, copy_at, marks);
            peer.reliable = true;
            self.has_output = true;
        }
    }

    /// The version of this node's route rows now.
    pub(super) fn rows_now(&self) -> u64 {
        self.route_version
    }

    /// The version of our route rows every peer is known to hold (or a later one).
    pub(super) fn rows_held_by_all(&self) -> u64 {
        let held = self.peers.iter().flatten().map(|p| p.rows_held).min();
        held.unwrap_or(self.route_version)
    }

    /// Copies the will of connection `client_id` (version `stamp`) to peer `id`, an owner of
    /// its partition (protocol 9).
    pub(super) fn queue_will_copy(
        &mut self,
        id: PeerId,
        client_id: &str,
        stamp: Stamp,
        will: &[u8],
    ) {
        self.queue_reliable(id, 9, |items| items.will_copy(client_id, stamp, will));
    }

    /// Tells peer `id` that this node published the will of its connection `client_id`
    /// (version `stamp`) while it was out of reach.
    pub(super) fn queue_will_fired(&mut self, id: PeerId, client_id: &str, stamp: Stamp) {
        self.queue_reliable(id, 9, |items| items.will_fired(client_id, stamp));
    }

    /// Tells peer `id` that the connection whose will it holds a copy of ended here.
    pub(super) fn queue_will_gone(&mut self, id: PeerId, client_id: &str, stamp: Stamp) {
        self.queue_reliable(id, 9, |items| items.will_gone(client_id, stamp));
    }

    /// Registry items (protocol 10, `cluster_registry`).
    pub(super) fn queue_homes<'c>(
        &mut self,
        id: PeerId,
        map: u64,
        first: bool,
        last: bool,
        clients: impl ExactSizeIterator<Item = &'c str>,
    ) {
        self.queue_reliable(id, 10, |items| items.homes(map, first, last, clients));
    }

    pub(super) fn queue_home(&mut self, id: PeerId, client_id: &str, here: bool) {
        self.queue_reliable(id, 10, |items| items.home(client_id, here));
    }

    pub(super) fn queue_claim_route(&mut self, id: PeerId, client_id: &str, req: u64) {
        self.queue_reliable(id, 10, |items| items.claim_route(client_id, req));
    }

    pub(super) fn queue_claim_routed(
        &mut self,
        id: PeerId,
        client_id: &str,
        req: u64,
        stamp: Stamp,
        ask: &[u64],
    ) {
        self.queue_reliable(id, 10, |items| {
            items.claim_routed(client_id, req, stamp, ask)
        });
    }

    /// Peers known (up or not), with their keys.
    pub(super) fn peer_keys(&self) -> Vec<(PeerId, u64)> {
        let peers = self.peers.iter().enumerate();
        peers
            .filter_map(|(i, p)| p.as_ref().map(|p| (i as PeerId, p.key)))
            .collect()
    }

    /// Tells peer `id` (protocol 8) that every node has our rows for `client_id`, which
    /// came here from it.
    pub(super) fn queue_relay_end(&mut self, id: PeerId, client_id: &str) {
        self.queue_reliable(id, 8, |items| items.relay_end(client_id));
    }

    /// Tells peer `id` (protocol 8), after the claim answer handing it `client_id`, what
    /// the session got that other nodes kept for its dead home `home`.
    pub(super) fn queue_kept_state(
        &mut self,
        id: PeerId,
        client_id: &str,
        home: u64,
        marks: &[Mark],
        ids: impl ExactSizeIterator<Item = u128>,
    ) {
        self.queue_reliable(id, 8, |items| items.kept_state(client_id, home, marks, ids));
    }

    /// Peer `id`'s key in messages' `also` lists.
    pub(super) fn peer_key(&self, id: PeerId) -> u64 {
        self.peers
            .get(usize::from(id))
            .and_then(Option::as_ref)
            .map_or(0, |p| p.key)
    }

    /// Whether the message being routed goes to peer `id` for its plain subscriptions.
    pub(super) fn plans_plain(&self, id: PeerId) -> bool {
        self.plan.plain.binary_search(&id).is_ok()
    }

    /// A message for session `client_id`, which moved to peer `id` (see cluster_sessions).
    /// What `kind` adds goes only to a peer that speaks it (else the message alone).
    /// `also`: the keys of the other nodes its publishing node sent it to, for a relayed
    /// one (`cluster_relay_order`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn queue_session_message(
        &mut self,
        id: PeerId,
        client_id: &str,
        msg: &Message,
        qos: QoS,
        retain: bool,
        sub_ids: &[u32],
        kind: SessionMessageKind,
        also: &[u64],
        origin: u64,
        now: u64,
    ) {
        let mut props = Vec::new();
        if let Some(p) = msg.props.as_deref() {
            codec::encode_properties(p, &mut props).expect("routed properties encode");
        }
        let with_id = self.peer_ref(id).is_some_and(|p| p.protocol >= 5);
        let protocol = self.peer_ref(id).map_or(0, |p| p.protocol);
        let kind = match kind {
            SessionMessageKind::Kept if protocol < 7 => SessionMessageKind::Relayed,
            SessionMessageKind::Released(_) if protocol < RELEASED_PROTOCOL => {
                SessionMessageKind::Relayed
            }
            kind => kind,
        };
        let origin = if protocol >= HANDED_ON_PROTOCOL {
            origin
        } else {
            0
        };
        let mut message = Vec::new();
        // Not a retained write (that went to every node already): the delivery's retain
        // flag travels beside it.
        batch::encode_message(
            &WireMessage {
                topic: &msg.topic,
                payload: &msg.payload,
                qos: msg.qos as u8,
                retain: false,
                expires_in_ms: msg.expires_at.map(|t| t.saturating_sub(now)),
                props: &props,
                plain: true,
                groups: Vec::new(),
                stamp: None,
                also: if with_id { also.to_vec() } else { Vec::new() },
                id: if with_id { msg.id } else { 0 },
                taken: Vec::new(),
            },
            &mut message,
        );
        let mut item = Vec::new();
        batch::encode_session_message(
            client_id, qos as u8, retain, sub_ids, &message, kind, origin, &mut item,
        );
        if let Some(peer) = self.peer_mut(id) {
            peer.items.raw_item(&item);
            peer.item_messages += 1;
            peer.reliable |= qos != QoS::AtMostOnce;
            self.has_output = true;
        }
    }

    /// Closes peer `id`'s batch now (what was queued so far is kept or sent as one).
    pub(super) fn seal_for(&mut self, id: PeerId) {
        let epoch = self.epoch;
        if let Some(peer) = self.peer_mut(id) {
            peer.seal(epoch);
        }
    }

    /// Encoded items for peer `id`'s next batches (closed every `SEAL_ABOVE`), reliable;
    /// then `RetainedSent` if `retained_set`.
    pub(super) fn queue_items(&mut self, id: PeerId, items: &[Vec<u8>], retained_set: bool) {
        let epoch = self.epoch;
        let Some(peer) = self.peer_mut(id) else {
            return;
        };
        for item in items {
            peer.items.raw_item(item);
            peer.reliable = true;
            if peer.items.len() >= SEAL_ABOVE {
                peer.seal(epoch);
            }
        }
        if retained_set {
            peer.items.retained_sent();
            peer.reliable = true;
        }
        self.has_output = true;
    }

    fn queue_snapshot(&mut self, id: PeerId) {
        let version = self.route_version;
        let filters: Vec<Arc<str>> = self.local_filters.keys().cloned().collect();
        if let Some(peer) = self.peers.get_mut(usize::from(id)).and_then(Option::as_mut) {
            peer.items
                .route_snapshot(version, filters.iter().map(|f| &**f));
            peer.rows_queued = version;
            peer.reliable = true;
            self.has_output = true;
        }
    }

    /// A filter of a local session was added (`added`) or its last one removed: tells every
    /// connected peer. Peers not connected get a snapshot when they are.
    fn local_row_changed(&mut self, filter: &str, added: bool) {
        self.route_version += 1;
        let version = self.route_version;
        let mut any = false;
        self.each_up_peer(|peer| {
            if added {
                peer.items.route_add(version, filter);
            } else {
                peer.items.route_remove(version, filter);
            }
            peer.rows_queued = version;
            peer.reliable = true;
            any = true;
        });
        self.has_output |= any;
    }

    /// Local delivery met shared subscription `key`: true if one of the other nodes with
    /// members takes this message instead (round robin over this node and those).
    pub(super) fn give_group_away(&mut self, key: &str) -> bool {
        let Some(i) = self.plan.groups.iter().position(|g| &*g.0 == key) else {
            return false;
        };
        self.plan.groups[i].2 = true;
        let peers = std::mem::take(&mut self.plan.groups[i].1);
        let choice = self.pick_node(key, &peers, true);
        self.plan.groups[i].1 = peers;
        match choice {
            Some(peer) => {
                self.plan.assigned.push((peer, key.into()));
                true
            }
            None => false,
        }
    }

    /// Shared subscriptions with members on other nodes only: each is given to one of them.
    pub(super) fn assign_remote_groups(&mut self) {
        let groups = std::mem::take(&mut self.plan.groups);
        for (key, peers, decided) in &groups {
            if !decided {
                if let Some(peer) = self.pick_node(key, peers, false) {
                    self.plan.assigned.push((peer, key.clone()));
                }
            }
        }
        self.plan.groups = groups;
    }

    /// The next node for shared subscription `key`: None for this node (when `local`), or a
    /// peer, preferring peers whose link is up.
    fn pick_node(&mut self, key: &str, peers: &[PeerId], local: bool) -> Option<PeerId> {
        let up: Vec<PeerId> = peers
            .iter()
            .copied()
            .filter(|&p| self.peer_ref(p).is_some_and(|peer| peer.up))
            .collect();
        let candidates = if up.is_empty() && !local {
            peers.to_vec()
        } else {
            up
        };
        let n = candidates.len() + usize::from(local);
        if n == 0 {
            return None;
        }
        let cursor = match self.shared_cursors.get_mut(key) {
            Some(c) => c,
            None => self.shared_cursors.entry(key.into()).or_insert(0),
        };
        let pick = *cursor as usize % n;
        *cursor = cursor.wrapping_add(1);
        match (local, pick) {
            (true, 0) => None,
            (true, i) => Some(candidates[i - 1]),
            (false, i) => Some(candidates[i]),
        }
    }

    fn peer_ref(&self, id: PeerId) -> Option<&Peer> {
        self.peers.get(usize::from(id)).and_then(Option::as_ref)
    }

    /// Peer `id`'s rows become `filters`; returns the rows added and those removed.
    fn set_rows(&mut self, id: PeerId, filters: &[&str]) -> RowChanges {
        let mut changes = RowChanges::default();
        let Some(peer) = self.peers.get_mut(usize::from(id)).and_then(Option::as_mut) else {
            return changes;
        };
        let mut rows = HashSet::with_capacity(filters.len());
        for &f in filters {
            let f: Arc<str> = peer.rows.get(f).cloned().unwrap_or_else(|| Arc::from(f));
            rows.insert(f);
        }
        let old = std::mem::replace(&mut peer.rows, rows);
        peer.stats.rows = peer.rows.len() as u64;
        let peer = self.peers[usize::from(id)].as_ref().expect("checked");
        for f in old.iter().filter(|f| !peer.rows.contains(*f)) {
            self.routes.remove(f, id);
            changes.removed.push(f.clone());
        }
        for f in peer.rows.iter().filter(|f| !old.contains(*f)) {
            self.routes.insert(f, id, route_opts());
            changes.added.push(f.clone());
        }
        changes
    }

    /// Whether the row was not there before.
    fn add_row(&mut self, id: PeerId, filter: &str) -> bool {
        let Some(peer) = self.peer_mut(id) else {
            return false;
        };
        if peer.rows.insert(Arc::from(filter)) {
            peer.stats.rows += 1;
            self.routes.insert(filter, id, route_opts());
            return true;
        }
        false
    }

    /// Whether the row was there.
    fn remove_row(&mut self, id: PeerId, filter: &str) -> bool {
        let Some(peer) = self.peer_mut(id) else {
            return false;
        };
        if peer.rows.remove(filter) {
            peer.stats.rows -= 1;
            self.routes.remove(filter, id);
            return true;
        }
        false
    }
}

/// Options of a remote row: only the peer matters, delivery options are the subscriber's,
/// applied where it is.
fn route_opts() -> SubOpts {
    SubOpts {
        qos: QoS::ExactlyOnce,
        no_local: false,
        retain_as_published: true,
        retain_handling: 0,
        identifier: 0,
    }
}

impl Engine {
    /// Turns the cluster part on with this process's incarnation (non-zero, random per
    /// start): peers tell batches of an earlier run of this node from this one's by it.
    /// `node` is the node's name, the same on every start (it orders retained writes).
    pub fn cluster_start(&mut self, epoch: u64, node: &str) {
        self.cluster.epoch = epoch.max(1);
        self.cluster.durable = self.cfg.durable;
        self.cluster.name = Arc::from(node);
        // The incarnation is random per start: ids never repeat across restarts.
        let key = super::cluster_retained::node_key(node);
        self.cluster.message_origin = (key ^ self.cluster.epoch.rotate_left(29)).max(1);
        self.cluster.start_wall = self.wall(self.last_now);
        self.retained_stamping(node);
    }

    /// CONNECTs are refused (0x88) until the first partition map: a node that has not
    /// joined its cluster yet (a new one, or one that left and comes back) would otherwise
    /// make a fresh session for a client whose session lives on in the cluster.
    pub fn cluster_require_map(&mut self) {
        self.cluster.require_map = true;
    }

    /// This node stepped aside in a partial split (its data links closed by choice, while
    /// its peers live on and serve: `fastbroker.cluster.reach`), or no longer. Meanwhile,
    /// and for the takeover time after, a CONNECT that resumes a session is refused (0x88):
    /// the client goes through its load balancer to a node in reach of the rest. Its peers
    /// took this node for dead, so a version of the session here may be stale (another node
    /// took it over from a copy), and one not here would be started afresh after a claim's
    /// wait (a node alone in a clean split does that, to stay available): the fault suite
    /// lost 816 and 1,754 acknowledged messages so, the fresh or stale version winning over
    /// the live one. The time after covers the links coming back, until the versions here
    /// wait for their peers' word (`cut_off_sessions`). Clean starts are served.
    pub fn cluster_step_aside(&mut self, on: bool, now: u64) {
        let c = &mut self.cluster;
        if c.stepped_aside && !on {
            c.aside_until = now + self.cfg.cluster_takeover_ms;
        }
        c.stepped_aside = on;
    }

    /// The control plane hears peer `peer` (directly, or through a member that hears it:
    /// `fastbroker.cluster.reach`), or no longer. While its data link is down that is not
    /// its death: in a partial split the node that stepped aside serves its own clients,
    /// and holds a session that moved to it as it stepped aside, of which no copy may be
    /// in reach. So a claim here refuses to start such a session afresh (the fault suite
    /// lost 1,887 acknowledged messages when one was, after a claim's wait), and the wills
    /// of its connections are not published here as a dead node's (they live on). Its
    /// sessions with copies in reach are still taken over from those by the side that acts.
    pub fn cluster_peer_alive(&mut self, peer: PeerId, alive: bool) {
        if let Some(p) = self.cluster.peer_mut(peer) {
            p.alive = alive;
        }
    }

    /// Whether this node counts as stepped aside (`cluster_step_aside`).
    pub(super) fn aside(&self, now: u64) -> bool {
        self.cluster.stepped_aside || now < self.cluster.aside_until
    }

    /// The number of peer `name`, added if new (the same number for the same name).
    pub fn cluster_add_peer(&mut self, name: &str) -> PeerId {
        let c = &mut self.cluster;
        if let Some(i) = c
            .peers
            .iter()
            .position(|p| p.as_ref().is_some_and(|p| &*p.name == name))
        {
            return i as PeerId;
        }
        let mut peer = Peer::new(Arc::from(name));
        peer.compress = self.cfg.cluster_compress;
        if let Some(out) = c.restored.remove(name) {
            // Kept for it by an earlier run of this node, while its link was down.
            peer.unacked_bytes = out.iter().map(|o| o.len).sum();
            peer.stats.unacked_bytes = peer.unacked_bytes as u64;
            peer.out = out;
            peer.spill(self.cfg.cluster_outbox_memory);
        }
        let id = match c.peers.iter().position(Option::is_none) {
            Some(i) => {
                c.peers[i] = Some(peer);
                i as PeerId
            }
            None => {
                c.peers.push(Some(peer));
                (c.peers.len() - 1) as PeerId
            }
        };
        if let Some(rows) = c.restored_rows.remove(name) {
            // Its rows as an earlier run of this node last knew them: publishes made here
            // before its link is back (it may be out of reach) are kept for its sessions.
            // Its snapshot replaces them when the link comes up (version 0 of no epoch).
            let rows: Vec<&str> = rows.iter().map(|f| &**f).collect();
            c.set_rows(id, &rows);
        }
        id
    }

    /// A route row of peer `name` kept in the store by an earlier run of this node.
    pub(super) fn restore_route_row(&mut self, name: &str, filter: &str) -> Result<(), String> {
        if !topics::valid_filter(filter) {
            return Err(format!("invalid route filter {filter:?}"));
        }
        let rows = self
            .cluster
            .restored_rows
            .entry(Arc::from(name))
            .or_default();
        rows.push(Arc::from(filter));
        Ok(())
    }

    /// Keeps what changed in peer `id`'s rows in the store: a restart of this node routes
    /// by them until the peer's link brings its snapshot, so that a publish made here
    /// while the peer is out of reach is kept for its sessions, not dropped for want of a
    /// row. Rows change per subscribe and unsubscribe, never per message.
    fn store_rows(&mut self, id: PeerId, changes: RowChanges) {
        if !self.cfg.durable || (changes.added.is_empty() && changes.removed.is_empty()) {
            return;
        }
        let Some(name) = self.cluster.peer_ref(id).map(|p| p.name.clone()) else {
            return;
        };
        for f in changes.added {
            self.put(records::route_row_key(&name, &f), &[]);
        }
        for f in changes.removed {
            self.delete(records::route_row_key(&name, &f));
        }
    }

    /// A batch kept in the store for peer `name` by an earlier run of this node, restored
    /// in the order made; sent before anything new once the peer's link is up.
    pub(super) fn restore_outgoing(
        &mut self,
        name: &str,
        epoch: u64,
        seq: u64,
        key: Vec<u8>,
        frame: Vec<u8>,
    ) {
        let c = &mut self.cluster;
        let out = c.restored.entry(Arc::from(name)).or_default();
        out.push_back(Outgoing {
            seq,
            epoch,
            len: frame.len(),
            frame,
            sent: false,
            stored: Some(key),
            spilled: false,
            loading: false,
            rows: 0,
        });
    }

    /// Forgets a peer that left the cluster: its rows and everything queued for it.
    pub fn cluster_remove_peer(&mut self, id: PeerId) {
        if let Some(peer) = self.cluster.peer_mut(id) {
            // Like a down link: publishers waiting for it are read again.
            peer.up = false;
        }
        self.release_link_waiters();
        // What was kept for it goes: it left the cluster.
        let records: Vec<Vec<u8>> = self
            .cluster
            .peer_mut(id)
            .map(|p| p.out.iter_mut().filter_map(|o| o.stored.take()).collect())
            .unwrap_or_default();
        if self.cfg.durable {
            for key in records {
                self.delete(key);
            }
        }
        self.registry_peer_removed(id);
        let changes = self.cluster.set_rows(id, &[]);
        self.store_rows(id, changes);
        let c = &mut self.cluster;
        if let Some(slot) = c.peers.get_mut(usize::from(id)) {
            *slot = None;
        }
        self.release_acks();
    }

    /// The link to `id` went down after nothing had come on it for `silent_ms` (the link
    /// layer closes a link found silent for the failure timeout): as `cluster_link`, and
    /// the peer counts as out of touch since then (`cut_off_sessions`).
    pub fn cluster_link_lost(&mut self, id: PeerId, silent_ms: u64) {
        let was_up = self.cluster.peer_up(id);
        self.cluster_link(id, false);
        if let Some(peer) = self.cluster.peer_mut(id).filter(|_| was_up) {
            peer.silent_since = self.last_now.saturating_sub(silent_ms);
        }
    }

    /// The link to `id` came up (`up`) or went down. Up: batches not acknowledged are sent
    /// again, then a snapshot of our rows and our retained set.
    pub fn cluster_link(&mut self, id: PeerId, up: bool) {
        let now = self.last_now;
        self.forget_fences_told(id);
        // Half the failure timeout: the two ends of a link find a silence at moments apart.
        let takeover_after = self.cfg.cluster_takeover_ms / 2;
        let c = &mut self.cluster;
        let Some(peer) = c.peer_mut(id) else { return };
        // Back after a silence long enough that the peer may have taken this node's
        // sessions over meanwhile (a split: each side took the other for dead).
        let cut_off = up
            && !peer.up
            && peer.silent_since != 0
            && takeover_after > 0
            && now.saturating_sub(peer.silent_since) >= takeover_after;
        if peer.up && !up {
            peer.down_since = now;
            peer.silent_since = now;
        }
        if !up {
            peer.rows_queued = 0;
            peer.rows_held = 0;
        }
        peer.up = up;
        peer.writable = true;
        peer.heard = false;
        peer.stats.retained_synced = false;
        if up {
            peer.seen_up = true;
            peer.acked_at = now;
            // Told again on the new link.
            peer.safe_sent = 0;
            for o in &mut peer.out {
                if o.sent {
                    o.sent = false;
                    peer.stats.resent += 1;
                }
                // The peer may have restarted since: its rows come with the snapshot.
                o.rows = 0;
            }
            c.queue_snapshot(id);
            self.send_taken_ids(id, now);
            self.wait_for_untold(id, now);
            // Before the retained set, whose end tells the peer that it is in touch again:
            // which of its sessions live on elsewhere now and which of its wills went out
            // meanwhile (it publishes the wills it kept only then).
            if cut_off {
                // Their versions wait for the peer's answer to the checks below.
                self.cut_off_sessions(id, now);
            }
            self.queue_copy_checks(id, cut_off);
            self.ask_kept_on_link_up(id, now);
            self.wills_link_up(id);
            self.registry_link(id, true);
            self.queue_retained_set(id, now);
            self.give_up_deferred(id, now);
        } else {
            let c = &mut self.cluster;
            let peer = c.peer_mut(id).expect("checked");
            // QoS 0 is not kept for a link that is down.
            let before = peer.out.len();
            peer.out.retain(|o| o.seq != 0);
            peer.stats.dropped += (before - peer.out.len()) as u64;
            peer.waiting_qos0_bytes = 0;
            // The acknowledgements held for it go out now: what they wait for is stored
            // first (the caller writes the store before sending them).
            c.down_items |= peer.reliable;
            self.store_outgoing(id);
            // Their publishers are disconnected, not acknowledged, if that write fails.
            if self.cfg.durable {
                let waiting: Vec<ConnId> = self
                    .cluster
                    .held_acks
                    .iter()
                    .filter(|h| h.waits.iter().any(|&(p, _)| p == id))
                    .map(|h| h.conn)
                    .collect();
                self.batch_publishers.extend(waiting);
            }
        }
        self.cluster.has_output = true;
        if !up {
            // Before anything counts the peers in reach (`cluster_authority`).
            self.cluster.probe_up_peers();
            self.registry_link(id, false);
            // A down peer never stalls publishers: its messages wait in the queue for it.
            self.release_acks();
            self.release_link_waiters();
            // Nor a connect claiming a client id.
            self.claims_peer_down(id, now);
            self.kept_asks_peer_down(id, now);
            self.ask_kept_for_relaying_home(id, now);
            self.direct_caught_up_no_more(id);
        } else {
            // In reach again, this node may be on the side that acts (`cluster_authority`).
            self.release_gates();
        }
    }

    /// The protocol version agreed on peer `id`'s link (2 until told).
    pub fn cluster_set_protocol(&mut self, id: PeerId, version: u16) {
        if let Some(peer) = self.cluster.peer_mut(id) {
            peer.protocol = version;
        }
    }

    /// Tells every reachable peer that speaks protocol 3 to kick `client_id` (a peer that is
    /// down does not hear of it: the client may connect there anew meanwhile).
    pub(super) fn cluster_kick(&mut self, client_id: &str) {
        let c = &mut self.cluster;
        let mut any = false;
        c.each_up_peer(|peer| {
            if peer.protocol >= 3 {
                peer.items.kick(client_id);
                peer.reliable = true;
                any = true;
            }
        });
        c.has_output |= any;
    }

    /// The link's write buffer went over (false) or back under (true) its high mark.
    pub fn cluster_set_writable(&mut self, id: PeerId, writable: bool) {
        if let Some(peer) = self.cluster.peer_mut(id) {
            peer.writable = writable;
            if writable {
                self.cluster.has_output = true;
            }
        }
    }

    /// Whether `drain_cluster` has frames to give, or session copies wait to be read back
    /// (the data plane reads them when it sends: `copy_loads`).
    pub fn has_cluster_output(&self) -> bool {
        self.cluster.has_output || self.has_copy_loads() || self.kept_scans.due()
    }

    /// Calls `f(peer, frame)` with every frame due to a peer whose link can take it, in
    /// order: batches waiting since the link was down or full, then this iteration's.
    pub fn drain_cluster(&mut self, mut f: impl FnMut(PeerId, &[u8])) {
        let c = &mut self.cluster;
        c.has_output = false;
        let epoch = c.epoch;
        for (i, slot) in c.peers.iter_mut().enumerate() {
            let Some(peer) = slot.as_mut() else { continue };
            if !peer.up {
                // A down link's QoS 0 is dropped; its reliable batches wait for it.
                peer.stats.dropped += if peer.reliable { 0 } else { peer.item_messages };
                if !peer.reliable {
                    peer.items = ItemWriter::default();
                    peer.item_messages = 0;
                    peer.ack_due = false;
                }
            }
            peer.seal(epoch);
            peer.send_queued(i as PeerId, &mut f);
        }
        self.release_link_waiters();
    }

    /// Keeps peer `id`'s reliable batches in the store (its link is down): they survive a
    /// restart of this node, and are sent when the link is back.
    pub(super) fn store_outgoing(&mut self, id: PeerId) {
        if !self.cfg.durable {
            return;
        }
        let start = self.cluster.start_wall;
        let mut puts = Vec::new();
        if let Some(peer) = self.cluster.peer_mut(id) {
            for o in peer.out.iter_mut() {
                if o.seq != 0 && o.stored.is_none() {
                    let key = records::outbox_key(&peer.name, start, o.epoch, o.seq);
                    puts.push((key.clone(), o.frame.clone()));
                    o.stored = Some(key);
                }
            }
        }
        for (key, frame) in puts {
            self.put(key, &frame);
        }
        let memory = self.cfg.cluster_outbox_memory;
        if let Some(peer) = self.cluster.peer_mut(id) {
            if !peer.up {
                peer.spill(memory);
            }
        }
    }

    /// Whether spilled batches of a peer whose link is up are to be read back.
    /// Also: whether batches of a down peer kept only in the store are to be looked through
    /// for sessions taken over from it (`cluster_kept_store`).
    pub fn has_cluster_loads(&self) -> bool {
        self.cluster.peers.iter().flatten().any(|p| p.load_due) || self.kept_scans.due()
    }

    /// The store records to read back for each peer (about `LOAD_BUDGET` bytes each, in
    /// order); the caller hands them to `cluster_loaded`.
    pub fn cluster_loads(&mut self) -> Vec<(PeerId, Vec<Vec<u8>>)> {
        let mut loads = self.queue_loads();
        self.kept_loads(&mut loads);
        loads
    }

    fn queue_loads(&mut self) -> Vec<(PeerId, Vec<Vec<u8>>)> {
        let mut loads = Vec::new();
        for (i, peer) in self.cluster.peers.iter_mut().enumerate() {
            let Some(peer) = peer.as_mut() else { continue };
            if !std::mem::take(&mut peer.load_due) || !peer.up {
                continue;
            }
            let mut keys = Vec::new();
            let mut bytes = 0;
            for o in peer.out.iter_mut().filter(|o| o.spilled) {
                if bytes >= LOAD_BUDGET {
                    break;
                }
                if !o.loading {
                    o.loading = true;
                    bytes += o.len;
                    keys.push(o.stored.clone().expect("a spilled batch is stored"));
                }
            }
            if !keys.is_empty() {
                loads.push((i as PeerId, keys));
            }
        }
        loads
    }

    /// Records read back for peer `id` (`None`: missing). A batch asked for but not given
    /// is asked for again later; one missing or damaged is dropped (counted) and reported.
    pub fn cluster_loaded(
        &mut self,
        id: PeerId,
        records: &[(&[u8], Option<&[u8]>)],
    ) -> Vec<String> {
        if let Some(problems) = self.kept_loaded(id, records) {
            return problems;
        }
        let mut problems = Vec::new();
        let mut gone = Vec::new();
        let Some(peer) = self.cluster.peer_mut(id) else {
            return problems;
        };
        // Records come back in queue order: one forward scan matches them.
        let mut at = 0;
        for &(key, value) in records {
            let Some(i) =
                (at..peer.out.len()).find(|&i| peer.out[i].stored.as_deref() == Some(key))
            else {
                continue;
            };
            at = i;
            let opened = value.ok_or_else(|| "missing".to_string()).and_then(|v| {
                envelope::open(key, v)
                    .map(|b| b.to_vec())
                    .map_err(|e| e.to_string())
            });
            let o = &mut peer.out[i];
            match opened {
                Ok(frame) if frame.len() == o.len => {
                    o.frame = frame;
                    o.spilled = false;
                    o.loading = false;
                    peer.spilled_bytes -= o.len;
                    peer.stats.read_back += 1;
                }
                other => {
                    let why = other.err().unwrap_or_else(|| "wrong length".into());
                    problems.push(format!("a stored batch for {} is lost: {why}", peer.name));
                    let o = peer.out.remove(i).expect("found");
                    peer.unacked_bytes -= o.len;
                    peer.spilled_bytes -= o.len;
                    peer.stats.dropped += 1;
                    gone.extend(o.stored);
                }
            }
        }
        for o in peer.out.iter_mut() {
            o.loading = false;
        }
        peer.stats.unacked_bytes = peer.unacked_bytes as u64;
        peer.stats.spilled_bytes = peer.spilled_bytes as u64;
        // Nothing given (the store failed): asked for again by a later flush, not at once.
        self.cluster.has_output |= !records.is_empty();
        for key in gone {
            self.delete(key);
        }
        problems
    }

    /// Whether the store has work from the cluster part: batches for down peers to close
    /// and keep, records of dropped batches to delete.
    pub(super) fn cluster_store_due(&self) -> bool {
        let c = &self.cluster;
        c.down_items || c.peers.iter().flatten().any(|p| !p.dead_records.is_empty())
    }

    /// Before the store write: closes and keeps the batches of peers whose link is down.
    pub(super) fn store_cluster_batches(&mut self) {
        let epoch = self.cluster.epoch;
        let mut down = Vec::new();
        let mut dead = Vec::new();
        for (i, peer) in self.cluster.peers.iter_mut().enumerate() {
            let Some(peer) = peer.as_mut() else { continue };
            dead.append(&mut peer.dead_records);
            if self.cluster.down_items && !peer.up && peer.reliable {
                peer.seal(epoch);
                dead.append(&mut peer.dead_records);
                down.push(i as PeerId);
            }
        }
        self.cluster.down_items = false;
        for id in down {
            self.store_outgoing(id);
        }
        if self.cfg.durable {
            for key in dead {
                self.delete(key);
            }
        }
    }

    /// `id`'s publish went to peers whose link is full (`full_links`): it is not read until
    /// they drain.
    pub(super) fn wait_for_links(&mut self, id: ConnId) {
        let full = std::mem::take(&mut self.cluster.full_links);
        for &p in &full {
            if let Some(peer) = self.cluster.peer_mut(p) {
                if !peer.waiters.contains(&id) {
                    peer.waiters.push(id);
                    peer.stats.holds += 1;
                }
            }
        }
        self.cluster.full_links = full;
        if let Some(conn) = self.conn_mut(id) {
            conn.link_wait = true;
        }
        self.regate(id);
    }

    /// Reads again the connections waiting for a peer whose queue is back under
    /// `RESUME_BELOW` (or whose link went down: a down peer holds no one).
    fn release_link_waiters(&mut self) {
        let mut released = Vec::new();
        for peer in self.cluster.peers.iter_mut().flatten() {
            if !peer.waiters.is_empty() && (!peer.up || peer.queued() < RESUME_BELOW) {
                released.append(&mut peer.waiters);
            }
        }
        if released.is_empty() {
            return;
        }
        for id in released {
            if let Some(conn) = self.conn_mut(id) {
                conn.link_wait = false;
            }
            self.regate(id);
        }
        self.retry_held(self.last_now);
    }

    /// A batch from peer `id` (the value of its DATA frame). The whole batch is checked
    /// before any of it is applied: a malformed one is an error and changes nothing (the
    /// caller drops the link).
    pub fn cluster_feed(&mut self, id: PeerId, data: &[u8], now: u64) -> Result<(), String> {
        self.last_now = now;
        let batch = Batch::decode(data).map_err(|e| e.0)?;
        let items = batch.items().map_err(|e| e.0)?;
        let mut messages = Vec::new();
        for item in &items {
            match item {
                Item::RouteSnapshot { filters, .. } => {
                    if let Some(f) = filters.iter().find(|f| !topics::valid_filter(f)) {
                        return Err(format!("invalid route filter {f:?}"));
                    }
                }
                Item::RouteAdd { filter, .. } | Item::RouteRemove { filter, .. } => {
                    if !topics::valid_filter(filter) {
                        return Err(format!("invalid route filter {filter:?}"));
                    }
                }
                Item::Message(m) => {
                    if let Some(g) = m
                        .groups
                        .iter()
                        .find(|g| topics::split_shared(g).is_none() || !topics::valid_filter(g))
                    {
                        return Err(format!("invalid shared subscription {g:?}"));
                    }
                    messages.push(message_from_wire(m, now)?);
                }
                Item::SessionMessage { message, qos, .. } => {
                    if *qos > message.qos {
                        return Err("relayed message above its QoS".into());
                    }
                    messages.push(message_from_wire(message, now)?);
                }
                Item::ClaimAnswer {
                    client_id, records, ..
                } => {
                    // Only records of the client claimed: a peer cannot slip in others.
                    for (key, _) in records {
                        let owner = match records::parse_key(key) {
                            Some(
                                records::Key::Session(owner)
                                | records::Key::Message(owner, _)
                                | records::Key::Flight(owner, _)
                                | records::Key::Inbound(owner, _),
                            ) => Some(owner),
                            _ => None,
                        };
                        if owner.as_deref() != Some(*client_id) {
                            return Err(format!("claim answer for {client_id:?} with another key"));
                        }
                    }
                }
                Item::KeptAsk { subs, .. } => {
                    if let Some(s) = subs.iter().find(|s| {
                        !topics::valid_filter(s.filter) || topics::split_shared(s.filter).is_some()
                    }) {
                        return Err(format!("invalid filter in a kept ask {:?}", s.filter));
                    }
                }
                Item::Copy { key, .. } => {
                    if records::session_client(key).is_none() {
                        return Err("copy of a record that is not a session's".into());
                    }
                }
                Item::Resync
                | Item::RetainedSent
                | Item::Kick { .. }
                | Item::Claim { .. }
                | Item::CopyCheck { .. }
                | Item::Fence { .. }
                | Item::Installed { .. }
                | Item::RelayEnd { .. }
                | Item::KeptEnd { .. }
                | Item::WillCopy { .. }
                | Item::WillGone { .. }
                | Item::WillFired { .. }
                | Item::Homes { .. }
                | Item::TookRouted { .. }
                | Item::Home { .. }
                | Item::ClaimRoute { .. }
                | Item::ClaimRouted { .. }
                | Item::KeptState { .. }
                | Item::TakenIds { .. }
                | Item::Applied(_)
                | Item::Safe { .. } => {}
            }
        }
        let h = batch.header;
        let c = &mut self.cluster;
        let own_epoch = c.epoch;
        let Some(peer) = c.peer_mut(id) else {
            return Err(format!("unknown peer {id}"));
        };
        peer.stats.frames_in += 1;
        peer.stats.bytes_in += data.len() as u64;
        if h.ack_seq != 0 {
            let mut done = Vec::new();
            let before = peer.out.len();
            peer.acknowledged(h.ack_epoch, h.ack_seq, own_epoch, &mut done);
            // Batches held behind the acknowledged ones (another incarnation's) may go.
            let unblocked = peer.out.len() < before && peer.out.iter().any(|o| !o.sent);
            let newer = h.ack_epoch == own_epoch && h.ack_seq > peer.acked_seq;
            if newer {
                peer.acked_seq = h.ack_seq;
                peer.acked_at = now;
            }
            let waiting = !peer.waiters.is_empty();
            self.cluster.has_output |= unblocked;
            for key in done {
                self.delete(key);
            }
            if newer {
                self.release_acks();
            }
            if waiting {
                self.release_link_waiters();
            }
        }
        if h.seq != 0 {
            let peer = self.cluster.peer_mut(id).expect("checked");
            if h.epoch != peer.recv_epoch {
                // The peer restarted: its numbering starts again.
                peer.recv_epoch = h.epoch;
                peer.recv_seq = 0;
                peer.recv_held.clear();
                peer.safe_sent = 0;
                self.wills_home_restarted(id, h.epoch, now);
            }
            let c = &mut self.cluster;
            let peer = c.peer_mut(id).expect("checked");
            peer.ack_due = true;
            c.has_output = true;
            let peer = c.peer_mut(id).expect("checked");
            if h.seq <= peer.recv_seq {
                // Sent again after a reconnect, and applied before: acknowledged again only.
                return Ok(());
            }
            peer.recv_seq = h.seq;
        }
        // Copies this batch makes (messages stored for persistent sessions) hold its `Safe`,
        // and tell their owners how far this node applied the sender's batches.
        self.replicas.start();
        self.replicas.copied_to.clear();
        let c = &mut self.cluster;
        let peer = c.peer_mut(id).expect("checked");
        peer.stats.messages_in += messages.len() as u64;
        let mut messages = messages.into_iter();
        for item in items {
            let c = &mut self.cluster;
            match item {
                Item::RouteSnapshot { version, filters } => {
                    let peer = c.peer_mut(id).expect("checked");
                    if h.epoch != peer.rows_epoch || version >= peer.rows_version {
                        peer.rows_epoch = h.epoch;
                        peer.rows_version = version;
                        let changes = c.set_rows(id, &filters);
                        self.store_rows(id, changes);
                    }
                    // Sent after what the link held for this node: that is all in now.
                    self.relay_caught_up(id);
                    self.heard_from(id, now);
                }
                Item::RouteAdd { version, filter } | Item::RouteRemove { version, filter } => {
                    let add = matches!(item, Item::RouteAdd { .. });
                    let peer = c.peer_mut(id).expect("checked");
                    if h.epoch != peer.rows_epoch || version > peer.rows_version + 1 {
                        // A gap: rows of this peer were missed. Ask for all of them.
                        peer.items.resync();
                        peer.reliable = true;
                        c.has_output = true;
                    } else if version == peer.rows_version + 1 {
                        peer.rows_version = version;
                        let mut changes = RowChanges::default();
                        if add && c.add_row(id, filter) {
                            changes.added.push(Arc::from(filter));
                        } else if !add && c.remove_row(id, filter) {
                            changes.removed.push(Arc::from(filter));
                        }
                        self.store_rows(id, changes);
                    }
                    // Older versions are stale: never applied, so a late update cannot
                    // bring back a removed row.
                }
                Item::Resync => c.queue_snapshot(id),
                Item::RetainedSent => {
                    c.peer_mut(id).expect("checked").stats.retained_synced = true;
                }
                Item::Kick { client_id } => {
                    self.kick_local(client_id, now);
                }
                Item::Claim {
                    client_id,
                    stamp,
                    discard,
                } => self.claim_received(id, client_id, stamp, discard, now),
                Item::SessionMessage {
                    client_id,
                    qos,
                    retain,
                    sub_ids,
                    kept,
                    released,
                    message,
                    origin,
                } => {
                    let msg = messages.next().expect("one per message item");
                    let msg = Arc::new(msg);
                    let kind = match (kept, released) {
                        (true, _) => SessionMessageKind::Kept,
                        (_, Some(pkid)) => SessionMessageKind::Released(pkid),
                        _ => SessionMessageKind::Relayed,
                    };
                    let also = &message.also;
                    let from = (id, origin);
                    self.relayed(from, client_id, msg, qos, retain, sub_ids, kind, also, now);
                }
                Item::KeptAsk {
                    client_id,
                    home,
                    again,
                    applied,
                    subs,
                } => self.kept_asked(id, client_id, home, again, applied, &subs, now),
                Item::ClaimAnswer {
                    client_id,
                    stamp,
                    records,
                    copy_at,
                    marks,
                } => {
                    let copy = copy_at.map(|at| (at, &marks[..]));
                    self.claim_answered(id, client_id, stamp, &records, copy, now);
                }
                Item::Applied(mark) => self.applied_received(id, mark),
                Item::Message(m) => {
                    let msg = messages.next().expect("one per message item");
                    if m.id != 0 {
                        if let Some(p) = self.cluster.peer_mut(id) {
                            p.last_routed = ((m.id >> 64) as u64, m.id as u64);
                        }
                    }
                    let scope = Scope::Forwarded {
                        plain: m.plain,
                        groups: &m.groups,
                        stamp: m.stamp,
                        from: id,
                        also: &m.also,
                        taken: &m.taken,
                    };
                    self.route_local(Arc::new(msg), now, scope);
                }
                Item::Copy {
                    map,
                    stamp,
                    key,
                    value,
                    at,
                } => {
                    let op = CopyOp {
                        map,
                        stamp,
                        key,
                        value,
                        at,
                    };
                    self.copy_received(id, op, now);
                }
                Item::CopyCheck { client_id, stamp } => {
                    self.copy_check_received(id, client_id, stamp);
                }
                Item::Fence {
                    client_id,
                    stamp,
                    home,
                } => self.fence_received(id, client_id, stamp, home, now),
                Item::Installed { client_id } => self.installed_received(id, client_id),
                Item::TookRouted { client_id, ranges } => {
                    self.took_routed_received(id, client_id, &ranges);
                }
                Item::RelayEnd { client_id } => self.relay_end_received(id, client_id, now),
                Item::KeptEnd { client_id, origin } => {
                    self.kept_end_received((id, origin), client_id, now)
                }
                Item::TakenIds {
                    client_id,
                    stamp,
                    node,
                    ids,
                } => self.taken_ids_received(id, client_id, stamp, node, &ids, now),
                Item::WillCopy {
                    client_id,
                    stamp,
                    will,
                } => self.will_copy_received(id, h.epoch, client_id, stamp, will, now),
                Item::WillGone { client_id, stamp } => {
                    self.will_gone_received(id, client_id, stamp);
                }
                Item::WillFired { client_id, stamp } => {
                    self.will_fired_received(client_id, stamp, now);
                }
                Item::Homes {
                    map,
                    first,
                    last,
                    clients,
                } => self.homes_received(id, map, first, last, &clients),
                Item::Home { client_id, here } => self.home_received(id, client_id, here),
                Item::ClaimRoute { client_id, req } => {
                    self.claim_route_received(id, client_id, req, now);
                }
                Item::ClaimRouted {
                    client_id,
                    req,
                    stamp,
                    ask,
                } => self.claim_routed(id, client_id, req, stamp, &ask, now),
                Item::KeptState {
                    client_id,
                    home,
                    marks,
                    ids,
                } => self.kept_state_received(id, client_id, home, &marks, &ids, now),
                Item::Safe { epoch, seq } => {
                    let c = &mut self.cluster;
                    let own = c.epoch;
                    let peer = c.peer_mut(id).expect("checked");
                    if epoch == own && seq > peer.safe_seq {
                        peer.copied(seq);
                        self.release_acks();
                    }
                }
            }
        }
        self.deliver_released_later(now);
        if h.seq != 0 && !self.replicas.copied_to.is_empty() {
            let mark = Mark {
                node: self.cluster.peer_key(id),
                epoch: h.epoch,
                seq: h.seq,
            };
            for to in std::mem::take(&mut self.replicas.copied_to) {
                self.cluster.queue_applied(to, mark);
            }
        }
        // A copy handed over or replaced by this batch answers the claims that waited on it.
        self.watch_copies(now);
        let waits = std::mem::take(&mut self.replicas.waits);
        self.replicas.gate_waits.clear();
        if h.seq != 0 && !waits.is_empty() {
            let peer = self.cluster.peer_mut(id).expect("checked");
            peer.recv_held.push_back((h.seq, waits));
        }
        if std::mem::take(&mut self.replicas.degraded) {
            self.replicas_degraded_ack();
        }
        Ok(())
    }

    /// Peer `id` sent its rows, after what its link held for this node: what its sessions
    /// took (`TakenIds`, sent first) and the batches it kept for this node are all in, so
    /// the sessions here that waited for its word send on. (Its first batch says what its
    /// sessions took, but messages it kept for this node come after: a session that sent
    /// on then would send newer ones that another node relayed before them.)
    fn heard_from(&mut self, id: PeerId, now: u64) {
        let Some(peer) = self.cluster.peer_mut(id) else {
            return;
        };
        if peer.heard || !peer.up {
            return;
        }
        peer.heard = true;
        let key = peer.key;
        self.told_by(key, now);
    }

    /// Works out which peers `msg` goes to: those with a matching plain row (every peer for
    /// a retained message: each node holds the full retained set) and the shared
    /// subscriptions matched on other nodes. False when it goes to none.
    pub(super) fn plan_forward(&mut self, msg: &Message) -> bool {
        let c = &mut self.cluster;
        c.waits.clear();
        c.routed_to_down = false;
        c.plan.plain.clear();
        c.plan.groups.clear();
        c.plan.assigned.clear();
        c.plan.lagging = false;
        c.plan.listable = false;
        c.plan.taken_everywhere = false;
        c.plan.taken.clear();
        if c.epoch == 0
            || c.peers.is_empty()
            || msg.origin == REMOTE_ORIGIN
            || msg.topic.starts_with(b"$SYS")
        {
            return false;
        }
        let mut matched = std::mem::take(&mut c.scratch_peers);
        matched.clear();
        let mut shared = Vec::new();
        c.routes.lookup(&msg.topic, &mut matched, &mut shared);
        for g in &shared {
            let peers = g.members.iter().map(|(p, _)| *p).collect();
            c.plan.groups.push((g.key.into(), peers, false));
        }
        drop(shared);
        if msg.retain {
            let all = c.peers.iter().enumerate().filter(|(_, p)| p.is_some());
            c.plan.plain.extend(all.map(|(i, _)| i as PeerId));
        } else {
            c.plan.plain.extend(matched.iter().map(|(p, _)| *p));
            c.plan.plain.sort_unstable();
            c.plan.plain.dedup();
        }
        c.scratch_peers = matched;
        let remote = !c.plan.plain.is_empty() || !c.plan.groups.is_empty();
        let now = self.last_now;
        let c = &mut self.cluster;
        // Any peer it may go to (a shared group's member is picked later).
        c.plan.lagging = remote && c.peers.iter().flatten().any(|p| p.lagging(now));
        c.plan.listable = remote && c.peers.iter().flatten().any(|p| p.protocol >= 11);
        remote
    }

    /// Sends `msg` where `plan_forward` and local delivery decided: one item per peer, in
    /// its next batch. Returns how many peers.
    pub(super) fn forward(&mut self, msg: &Message, now: u64) -> usize {
        let c = &mut self.cluster;
        let mut props = std::mem::take(&mut c.scratch_props);
        props.clear();
        if let Some(p) = msg.props.as_deref() {
            codec::encode_properties(p, &mut props).expect("routed properties encode");
        }
        let mut targets = std::mem::take(&mut c.scratch_targets);
        targets.clear();
        targets.extend_from_slice(&c.plan.plain);
        if !c.plan.assigned.is_empty() {
            targets.extend(c.plan.assigned.iter().map(|(p, _)| *p));
            targets.sort_unstable();
            targets.dedup();
        }
        let reliable = msg.qos != QoS::AtMostOnce || msg.retain;
        let durable = self.cfg.durable;
        let c = &mut self.cluster;
        let epoch = c.epoch;
        let mut item = std::mem::take(&mut c.scratch_item);
        // Most messages go to no shared group: one encoding then serves every peer with the
        // same plain flag.
        let mut cached: Option<(bool, bool, bool)> = None;
        // Sent plain to several nodes: each learns the others (a relay skips them). Kept
        // between calls: no allocation per message.
        let mut also = std::mem::take(&mut c.scratch_also);
        also.clear();
        if c.plan.plain.len() > 1 {
            also.extend(
                c.plan
                    .plain
                    .iter()
                    .filter_map(|&p| c.peers.get(usize::from(p)).and_then(Option::as_ref))
                    .map(|p| p.key),
            );
        }
        let mut none = Vec::new();
        for &id in &targets {
            let plain = c.plan.plain.binary_search(&id).is_ok();
            let groups: Vec<&str> = c
                .plan
                .assigned
                .iter()
                .filter(|(p, _)| *p == id)
                .map(|(_, k)| &**k)
                .collect();
            // Message ids are for peers of protocol 5 (older ones refuse the flag).
            let with_id = msg.id != 0 && c.peer_ref(id).is_some_and(|p| p.protocol >= 5);
            let everywhere = c.plan.taken_everywhere;
            let taken = !c.plan.taken.is_empty()
                && c.peer_ref(id)
                    .is_some_and(|p| p.lagging(now) || (everywhere && p.protocol >= 11));
            if !groups.is_empty() || cached != Some((plain, with_id, taken)) {
                cached = groups.is_empty().then_some((plain, with_id, taken));
                item.clear();
                let stamp = msg.retain.then(|| c.retained.routing.unwrap_or_default());
                let list = if plain { &mut also } else { &mut none };
                let mid = if with_id { msg.id } else { 0 };
                let taken: Vec<&str> = if taken {
                    c.plan.taken.iter().map(|t| &**t).collect()
                } else {
                    Vec::new()
                };
                encode_routed(
                    msg, &props, now, plain, groups, stamp, list, mid, taken, &mut item,
                );
            }
            let Some(peer) = c.peers.get_mut(usize::from(id)).and_then(Option::as_mut) else {
                continue;
            };
            peer.items.raw_item(&item);
            peer.item_messages += 1;
            peer.reliable |= reliable;
            if peer.up && peer.queued() >= HOLD_ABOVE {
                c.full_links.push(id);
            }
            if reliable && peer.up {
                // The batch being written gets this number when it is sealed.
                c.waits.push((id, peer.next_seq));
            }
            if reliable && !peer.up && durable {
                c.down_items = true;
                c.routed_to_down = true;
            }
            if peer.items.len() >= SEAL_ABOVE {
                peer.seal(epoch);
            }
        }
        c.has_output |= !targets.is_empty();
        c.scratch_also = also;
        c.scratch_item = item;
        c.scratch_props = props;
        let n = targets.len();
        c.scratch_targets = targets;
        n
    }

    /// Sends the PUBACK or PUBREC of a publish just routed, or, if `forward` put it in
    /// batches to peers that are up, holds it until they have it: acknowledged means kept
    /// on every node that must deliver it (and a retained message readable there).
    pub(super) fn ack_publish(&mut self, id: ConnId, packet: Packet) {
        if std::mem::take(&mut self.replicas.degraded) {
            self.replicas_degraded_ack();
        }
        self.replicas.gate_waits.clear();
        if !self.replicas.waits.is_empty() {
            let copies = std::mem::take(&mut self.replicas.waits);
            self.cluster.waits.extend(copies);
        }
        if self.cluster.waits.is_empty() {
            self.send(id, &packet);
            return;
        }
        let Some(serial) = self.conn(id).map(|c| c.serial) else {
            return;
        };
        let waits = self.cluster.waits.clone();
        self.cluster.waits.clear();
        self.cluster.held_acks.push_back(HeldAck {
            conn: id,
            serial,
            packet,
            waits,
        });
    }

    /// Sends the held acknowledgements whose peers all have their messages (or are down).
    fn release_acks(&mut self) {
        let mut held_acks = std::mem::take(&mut self.cluster.held_acks);
        let c = &self.cluster;
        let mut ready = Vec::new();
        held_acks.retain_mut(|held| {
            held.waits.retain(|&(p, seq)| c.awaits(p, seq));
            if held.waits.is_empty() {
                ready.push((
                    held.conn,
                    held.serial,
                    std::mem::replace(&mut held.packet, Packet::PingResp),
                ));
                false
            } else {
                true
            }
        });
        self.cluster.held_acks = held_acks;
        for (conn, serial, packet) in ready {
            if self.conn(conn).is_some_and(|c| c.serial == serial) {
                self.send(conn, &packet);
            }
        }
        self.release_gates();
        self.release_held_batches();
    }

    /// Peers' batches whose copies are now acknowledged (or whose copy peers went down) may
    /// be acknowledged to them.
    fn release_held_batches(&mut self) {
        let c = &mut self.cluster;
        if !c.peers.iter().flatten().any(|p| !p.recv_held.is_empty()) {
            return;
        }
        let acked: Vec<Option<u64>> = c
            .peers
            .iter()
            .map(|p| p.as_ref().filter(|p| p.up).map(|p| p.acked_seq))
            .collect();
        let mut any = false;
        for peer in c.peers.iter_mut().flatten() {
            let before = peer.safe_to_peer();
            for (_, waits) in peer.recv_held.iter_mut() {
                waits.retain(|&(p, seq)| acked[usize::from(p)].is_some_and(|a| a < seq));
            }
            while peer.recv_held.front().is_some_and(|h| h.1.is_empty()) {
                peer.recv_held.pop_front();
            }
            if peer.safe_to_peer() != before {
                peer.ack_due = true;
                any = true;
            }
        }
        c.has_output |= any;
    }

    /// Adds `sid`'s subscription to the index; a filter no local session held before
    /// becomes a route row. Returns whether the subscription is new.
    pub(super) fn index_subscribe(&mut self, filter: &str, sid: SessionId, opts: SubOpts) -> bool {
        let new = self.subs.insert(filter, sid, opts);
        if new {
            let count = self
                .cluster
                .local_filters
                .entry(Arc::from(filter))
                .or_insert(0);
            *count += 1;
            if *count == 1 && self.cluster.epoch != 0 {
                self.cluster.local_row_changed(filter, true);
            }
        }
        new
    }

    /// Removes `sid`'s subscription; the last one of a filter withdraws its route row.
    pub(super) fn index_unsubscribe(&mut self, filter: &str, sid: SessionId) -> bool {
        let existed = self.subs.remove(filter, sid);
        if existed {
            if let Some(count) = self.cluster.local_filters.get_mut(filter) {
                *count -= 1;
                if *count == 0 {
                    self.cluster.local_filters.remove(filter);
                    if self.cluster.epoch != 0 {
                        self.cluster.local_row_changed(filter, false);
                    }
                }
            }
        }
        existed
    }

    /// Each peer's name and counters.
    pub fn cluster_stats(&self) -> Vec<(PeerId, Arc<str>, bool, PeerStats)> {
        self.cluster
            .peers
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                p.as_ref()
                    .map(|p| (i as PeerId, p.name.clone(), p.up, p.stats.clone()))
            })
            .collect()
    }

    /// Route rows announced by this node.
    pub fn cluster_local_rows(&self) -> usize {
        self.cluster.local_filters.len()
    }
}

/// `msg` as an item of a batch (`props` already encoded), its expiry counted down to `now`.
#[allow(clippy::too_many_arguments)]
pub(super) fn encode_routed(
    msg: &Message,
    props: &[u8],
    now: u64,
    plain: bool,
    groups: Vec<&str>,
    stamp: Option<Stamp>,
    also: &mut Vec<u64>,
    id: u128,
    taken: Vec<&str>,
    out: &mut Vec<u8>,
) {
    let wire = WireMessage {
        topic: &msg.topic,
        payload: &msg.payload,
        qos: msg.qos as u8,
        retain: msg.retain,
        expires_in_ms: msg.expires_at.map(|t| t.saturating_sub(now)),
        props,
        plain,
        groups,
        stamp,
        // Borrowed for the encoding and given back: the caller's buffer is reused.
        also: std::mem::take(also),
        id,
        taken,
    };
    batch::encode_message(&wire, out);
    *also = wire.also;
}

/// A forwarded message as this node routes it. Checked like a client's publish would be:
/// a peer cannot make us hold an invalid topic or properties.
pub(super) fn message_from_wire(m: &WireMessage<'_>, now: u64) -> Result<Message, String> {
    if !topics::valid_topic_name(m.topic) {
        return Err("forwarded message with an invalid topic".into());
    }
    let props = if m.props.is_empty() {
        None
    } else {
        let p = codec::decode_properties(m.props, false)
            .map_err(|e| format!("forwarded message with bad properties: {e:?}"))?;
        p.into_boxed().and_then(forwarded_props)
    };
    // Topic and payload in one allocation of their own, as for a client's publish.
    let mut buf = bytes::BytesMut::with_capacity(m.topic.len() + m.payload.len());
    buf.extend_from_slice(m.topic);
    buf.extend_from_slice(m.payload);
    let buf = buf.freeze();
    Ok(Message {
        topic: buf.slice(..m.topic.len()),
        payload: buf.slice(m.topic.len()..),
        qos: QoS::from_u8(m.qos).ok_or("forwarded message with a bad QoS")?,
        retain: m.retain,
        props,
        expires_at: m.expires_in_ms.map(|ms| now.saturating_add(ms)),
        origin: REMOTE_ORIGIN,
        id: m.id,
    })
}

#[cfg(test)]
mod uncopied_tests {
    use super::{Outgoing, Peer, MAX_UNCOPIED_BYTES};

    fn sent(seq: u64, epoch: u64, len: usize) -> Outgoing {
        let mut o = Outgoing::unsent(seq, epoch, vec![0; len], 0);
        o.sent = true;
        o
    }

    fn peer_with(batches: impl IntoIterator<Item = Outgoing>) -> Peer {
        let mut p = Peer::new("n2".into());
        p.protocol = 16;
        for o in batches {
            p.unacked_bytes += o.len;
            p.out.push_back(o);
        }
        p
    }

    #[test]
    fn an_applied_batch_stays_until_the_peer_says_it_is_copied() {
        let mut p = peer_with([sent(1, 7, 10), sent(2, 7, 20), sent(3, 7, 30)]);
        let mut done = Vec::new();
        p.acknowledged(7, 2, 7, &mut done);
        assert_eq!(p.out.len(), 1);
        assert_eq!(p.uncopied.iter().map(|u| u.0).collect::<Vec<_>>(), [1, 2]);
        assert_eq!(p.uncopied_bytes, 30);
        p.copied(1);
        assert_eq!(p.uncopied.iter().map(|u| u.0).collect::<Vec<_>>(), [2]);
        p.acknowledged(7, 3, 7, &mut done);
        p.copied(3);
        assert!(p.uncopied.is_empty());
        assert_eq!(p.uncopied_bytes, 0);
    }

    #[test]
    fn batches_of_an_earlier_incarnation_or_already_copied_are_not_kept() {
        // Restored from the store (incarnation 6): the peer's `Safe` names this one's only.
        let mut p = peer_with([sent(4, 6, 10)]);
        p.acknowledged(6, 4, 7, &mut Vec::new());
        assert!(p.uncopied.is_empty());
        // Said copied before the acknowledgement came.
        let mut p = peer_with([sent(1, 7, 10)]);
        p.copied(1);
        p.acknowledged(7, 1, 7, &mut Vec::new());
        assert!(p.uncopied.is_empty());
        // A peer of protocol 3 says nothing of copies.
        let mut p = peer_with([sent(1, 7, 10)]);
        p.protocol = 3;
        p.acknowledged(7, 1, 7, &mut Vec::new());
        assert!(p.uncopied.is_empty());
    }

    #[test]
    fn batches_for_a_down_peer_are_compressed_unless_compression_is_off() {
        for compress in [true, false] {
            let mut p = peer_with([]);
            p.compress = compress;
            p.up = false;
            for _ in 0..64 {
                p.items.route_add(1, &"a/".repeat(300));
            }
            p.seal(7);
            let frame = &p.out.back().expect("a batch").frame;
            // 64 items of 600 bytes: far smaller compressed, at least as large if not.
            assert_eq!(
                frame.len() < 4096,
                compress,
                "compress {compress}: {}",
                frame.len()
            );
        }
    }

    #[test]
    fn uncopied_batches_past_the_bound_go_oldest_first() {
        let big = MAX_UNCOPIED_BYTES / 2;
        let mut p = peer_with([sent(1, 7, big), sent(2, 7, big), sent(3, 7, 1)]);
        p.acknowledged(7, 3, 7, &mut Vec::new());
        assert_eq!(p.uncopied.iter().map(|u| u.0).collect::<Vec<_>>(), [2, 3]);
        assert_eq!(p.uncopied_bytes, big + 1);
    }
}
