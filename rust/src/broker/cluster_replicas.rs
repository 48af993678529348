//! Copies of persistent sessions on the replicas of their partition, so a session outlives
//! the SIGKILL of its home node (docs/cluster-sessions.md, issue 16).
//!
//! - **The store batch is the replication unit.** Every store operation on a record of a
//!   persistent session (`s`, `m`, `f`, `q` keys: the session, its queued and in-flight
//!   messages, its inbound QoS 2 ids) is also queued, as sealed for the store, in a reliable
//!   `Copy` item to each other owner of the client id's partition. The owner keeps it under
//!   a copy key (`c`), and acknowledges the batch only once it is written, like any batch.
//! - **Acknowledged means copied.** A QoS 1/2 publish whose message was stored for a
//!   persistent session gets its PUBACK/PUBREC once `ack_replicas - 1` owners that are up
//!   have the copy (`waits`, held like forwarded messages' acknowledgements). A batch
//!   forwarded by another node is acknowledged as soon as it is applied (acknowledgements
//!   never wait for copies, or two owners copying to each other would wait on each other
//!   for good); a `Safe` item tells that node once its copies are acknowledged too, and its
//!   publishers' PUBACKs wait for that. With no owner up, the copy waits in this node's
//!   stored queue for them and the acknowledgement is counted as degraded.
//! - **Versions.** A session carries a stamp (the hybrid clock of the node that made it live
//!   there), stored in its record and moved with it; every copy item carries it. An owner
//!   keeps the copy of the newest version only: a newer one replaces the copy, an older one
//!   is refused and its sender told (`Fence`), and a node holding an older live session drops
//!   it without a will. When a link comes up, each node tells the owners the versions of its
//!   sessions (`CopyCheck`), so a node back from the dead learns which of its sessions live
//!   elsewhere now.
//! - **A dead home.** A claim for a client whose home is down is answered from the copy
//!   (read back from the store), also the claimant's own copy; the claimant takes the most
//!   current of the copies it gets (`Copy::at`: two owners besides the home can differ by
//!   what was acknowledged with the first one only). An owner that still sees the
//!   home up holds its answer until the home hands the session over or goes down (a killed
//!   home's claimant may notice first), unless a newer claim of the client came to it: that
//!   claimant takes over from this one, and the home may be waiting for this one. A home down for the takeover time (the failure
//!   timeout) has its sessions taken over by the first owner that is up: it installs the
//!   copy as a disconnected session, so the will of a connection that died with its node is
//!   published (after its delay) and expiry is counted, once.
//! - **A map change** streams copies to the owners a partition gained, and the former owners
//!   keep theirs until then: `cluster_streams`.

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use super::cluster::PeerId;
use super::cluster_kept::{TAKEN_IDS_MAX, TAKEN_IDS_PROTOCOL};
use super::cluster_sessions::FOUND_DOWN_MS;
use super::cluster_streams::Streams;
use super::router::Scope;
use super::state::{AwaitingAck, ConnState, Delivery, Inflight, Message, SessionId};
use super::Engine;
use crate::cluster::batch::{Mark, SessionMessageKind, Stamp};
use crate::codec::{Packet, QoS};
use crate::store::envelope;
use crate::store::records;
use crate::store::wire::{Reader, Writer};

/// A `Copy` item as received (see `batch::Item::Copy`).
pub(super) struct CopyOp<'a> {
    pub(super) map: u64,
    pub(super) stamp: Stamp,
    pub(super) key: &'a [u8],
    pub(super) value: Option<&'a [u8]>,
    pub(super) at: u64,
}

/// This node in a partition's owner list (`cluster_set_map`).
pub const THIS_NODE: PeerId = PeerId::MAX;

/// From this protocol on, a version of a session that gives way hands the QoS 2 messages it
/// sent PUBREL for over with their packet ids (`SessionMessageKind::Released`).
pub(super) const RELEASED_PROTOCOL: u16 = 14;

/// Who holds each partition, as the control plane computed it.
struct SessionMap {
    version: u64,
    owners: Vec<Vec<PeerId>>,
}

impl SessionMap {
    fn owners(&self, client_id: &str) -> &[PeerId] {
        if self.owners.is_empty() {
            return &[];
        }
        // The partition function of fastbroker.cluster.partitions.partition_of.
        let p = xxhash_rust::xxh3::xxh3_64(client_id.as_bytes()) % self.owners.len() as u64;
        &self.owners[p as usize]
    }
}

/// The copy of one session of another node.
struct Copy {
    home: Arc<str>,
    stamp: Stamp,
    /// The home's moment of the last operation applied (0: unknown, as after a restart):
    /// how current this copy is, against another owner's.
    at: u64,
    /// The session's own keys held (the store keys are `copy_key(client, key)`).
    keys: HashSet<Box<[u8]>>,
}

/// A delivery to a session not confirmed yet, with what tells whether its newer home got
/// the message itself.
pub(super) struct HeldMessage {
    pub(super) msg: Arc<Message>,
    pub(super) qos: QoS,
    pub(super) retain: bool,
    pub(super) sub_ids: Vec<u32>,
    plain: bool,
    from: Option<PeerId>,
    /// `from` had the session installed when it routed this (see `Item::Installed`).
    from_home: bool,
    also: Vec<u64>,
}

/// A session restored at start-up that the owners have not confirmed yet.
struct Unconfirmed {
    /// Owners that answered its check with nothing newer.
    answered: Vec<PeerId>,
    held: Vec<HeldMessage>,
    /// Confirmed anyway then (owners that stay down cannot answer).
    until: u64,
    /// A newer version lives on this peer, at this stamp, whose link has not been up in
    /// this run: the session goes to it once the link is up (its protocol is known then,
    /// so what is sent on carries the message ids it needs to take each once).
    give_up_to: Option<(PeerId, Stamp)>,
    /// Not restored: this node was cut off from an owner for long enough that the owner's
    /// side may have made a newer version (`cut_off_sessions`). Its client's CONNECTs are
    /// refused meanwhile: the version here would hand it what the newer one delivered.
    cut_off: bool,
}

/// A claim for a client whose copy this node holds while its home is still up here: its
/// answer waits until the home hands the session over (the copy goes or is replaced: none),
/// the home goes down (answered from the copy), or `WATCH_MS` passed (none). A claimant
/// may see a killed home go down before this node does; answering "none" at once would
/// lose the session.
struct Watch {
    peer: PeerId,
    client: Arc<str>,
    stamp: Stamp,
    copy: Stamp,
    until: u64,
}

/// Shorter than the claimant's own wait for a silent peer (`CLAIM_TIMEOUT_MS`, 3 s), and
/// at least until a stalled home is found down (`watch_ms`).
const WATCH_MS: u64 = 2_000;

/// How recent (wall-clock ms) a session's newer version must be for a node that gives its
/// older one up to send on its own messages: well within the 30 s the newer home remembers
/// the ids it took (`cluster_sessions::RECENT_MS`), for clocks a little apart.
const OWN_RELAY_MS: u64 = 20_000;
/// How many clients a refused copy is logged for per map version (`copy_refused`).
const REFUSED_LOGGED_MAX: usize = 32;

/// How long a QoS 2 delivery listed to peers that did not lag (`Listing::Qos2`) is
/// remembered, in case one of them turns out to have been cut off as it went: well past
/// `LAGGING_MS` and the 100 ms tick that notices. At most `LISTED_MAX` of them.
const LISTED_KEEP_MS: u64 = 2_000;
const LISTED_MAX: usize = 65_536;

/// Why a delivery of the message being routed is listed as taken to peers.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Listing {
    No,
    /// A peer lags: the session's messages from here on are ones only it may have.
    Lagging,
    /// A QoS 2 delivery, listed whether or not a peer lags.
    Qos2,
}

/// What a copy is being read back from the store for.
enum Use {
    /// Answer the claim of `peer` with `stamp`.
    Claim { peer: PeerId, stamp: Stamp },
    /// Install it here: its home is dead.
    Takeover,
    /// Answer this node's own claim: its home is dead, and this node an owner.
    Own,
}

#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReplicaStats {
    /// Sessions of other nodes copied here.
    pub copies: u64,
    /// Copy operations sent to other nodes, and taken from them.
    pub ops_out: u64,
    pub ops_in: u64,
    /// Acknowledgements given with fewer than `ack_replicas` copies (no owner up).
    pub degraded_acks: u64,
    /// Copy operations refused: an older version of the session than the one held.
    pub stale_refused: u64,
    /// Sessions here dropped because a newer version lives on another node.
    pub fenced: u64,
    /// Claims answered from a copy (the home was down).
    pub claims_served: u64,
    /// Sessions of a dead home installed here.
    pub takeovers: u64,
    /// Sessions sent in full to an owner their partition gained (`cluster_streams`).
    pub streamed: u64,
    /// Sessions of this node whose copies are still moving to new owners.
    pub stream_backlog: u64,
    /// Messages from a peer not delivered to a session here because that peer's version
    /// of it took them while the two were cut off (`WireMessage::taken`).
    pub taken_elsewhere: u64,
    /// QoS 2 messages released to the client by a version of its session that gave way to
    /// the one here, taken in flight here under their packet id (`take_released`).
    pub released_taken: u64,
    /// Messages for a session that had moved on from here, passed on to where it went with
    /// the node they came from (`SessionMessage::origin`, protocol 15).
    pub handed_on: u64,
    /// Versions of sessions and copies told to a peer whose link came up (`CopyCheck`).
    pub checks_out: u64,
}

#[derive(Default)]
pub(super) struct Replicas {
    map: Option<SessionMap>,
    /// The members the map was made from (`cluster_authority`).
    members: Option<Vec<PeerId>>,
    /// A tick found this side not acting, and when one found it acting again since
    /// (`cluster_authority`: copies wait the takeover time after that).
    pub(super) acting_lost: bool,
    pub(super) acting_since: u64,
    copies: HashMap<Arc<str>, Copy>,
    /// The peer that last said it installed a session that relays or waits here.
    installed: HashMap<Arc<str>, PeerId>,
    /// Sessions restored at start-up, waiting for the owners' answers.
    unconfirmed: HashMap<SessionId, Unconfirmed>,
    /// Copies being read back, and what for.
    wanted: HashMap<Arc<str>, Use>,
    loads: Vec<Arc<str>>,
    watching: Vec<Watch>,
    /// The (peer, batch) pairs copies of the publish being handled went in: its
    /// acknowledgement waits for them.
    pub(super) waits: Vec<(PeerId, u64)>,
    /// Those of the other owners in reach past `ack_replicas - 1`: output gates
    /// (`cluster_gates`) wait for them too, acknowledgements do not.
    pub(super) gate_waits: Vec<(PeerId, u64)>,
    /// Released messages this batch brought that `take_released` could not take by their
    /// packet id: delivered as new ones once the batch is in (`deliver_released_later`).
    released_later: Vec<(SessionId, Delivery)>,
    /// The publish being handled was copied to no owner that is up.
    pub(super) degraded: bool,
    /// Down peers whose sessions were looked at for a takeover (until their link is up).
    swept: HashSet<PeerId>,
    sweep_due: bool,
    scratch: Vec<PeerId>,
    /// Sessions of this node being copied to new owners after a map change.
    pub(super) streams: Streams,
    /// The owners the batch being applied made copies for (they are told how far this
    /// node applied the sender's batches: `Item::Applied`).
    pub(super) copied_to: Vec<PeerId>,
    /// By home (its key): how far it applied each node's batches, as it told this node
    /// with the copies (in memory; none after a restart).
    marks: HashMap<u64, Vec<Mark>>,
    /// The map version `copy_refused` was last logged for, and the clients it was logged
    /// for: once per client and version (a rebalance sends dozens of operations for each
    /// session, those of many sessions interleaved), for `REFUSED_LOGGED_MAX` at most.
    refused_logged: (u64, HashSet<Arc<str>>),
    /// Recent QoS 2 deliveries listed to peers that did not lag: (when, session, client
    /// id, its store number). Should a peer turn out to lag, their sessions count as
    /// taken from there on (`promote_listed`).
    listed: VecDeque<(u64, SessionId, Arc<str>, u64)>,
    /// By peer: the checks told it at its last link-ups (client id, version, the batch
    /// they went in). One whose batch the peer has not acknowledged goes again with that
    /// batch when the link comes up, so it is not queued once more: a peer that keeps
    /// closing its link unacknowledged (its store failing) would get one more per link-up.
    checks_sent: HashMap<PeerId, HashMap<Arc<str>, (Stamp, u64)>>,
    /// The newer versions told to peers whose copy operations of an older one were refused,
    /// since their links last came up or went down: a node back from a split sends every
    /// operation its older version queued meanwhile (hundreds), and one fence per session
    /// tells it all.
    fences_told: HashMap<(PeerId, Arc<str>), Stamp>,
    pub(super) stats: ReplicaStats,
}

impl Replicas {
    /// Session `sid` is gone.
    pub(super) fn forget(&mut self, sid: SessionId) {
        if !self.unconfirmed.is_empty() {
            self.unconfirmed.remove(&sid);
        }
    }

    pub(super) fn forget_installed(&mut self, client_id: &str) {
        if !self.installed.is_empty() {
            self.installed.remove(client_id);
        }
    }

    /// Forgets the waits of what was handled before the publish or batch starting now.
    pub(super) fn start(&mut self) {
        self.waits.clear();
        self.degraded = false;
    }

    pub(super) fn map_version(&self) -> u64 {
        self.map.as_ref().map_or(0, |m| m.version)
    }

    /// The owners of `client_id`'s partition other than this node (none before a map).
    pub(super) fn other_owners(&self, client_id: &str) -> Vec<PeerId> {
        self.map.as_ref().map_or_else(Vec::new, |m| {
            m.owners(client_id)
                .iter()
                .copied()
                .filter(|&p| p != THIS_NODE)
                .collect()
        })
    }

    /// The owners of `client_id`'s partition, primary first (this node as `THIS_NODE`).
    pub(super) fn owners_of(&self, client_id: &str) -> Vec<PeerId> {
        self.map
            .as_ref()
            .map_or_else(Vec::new, |m| m.owners(client_id).to_vec())
    }

    /// The members the map was made from, as told (`cluster_set_members`).
    pub(super) fn members(&self) -> Option<&[PeerId]> {
        self.members.as_deref()
    }

    /// Every node that owns a partition in the map (this one as `THIS_NODE`).
    pub(super) fn map_owners(&self) -> BTreeSet<PeerId> {
        self.map
            .as_ref()
            .map(|m| m.owners.iter().flatten().copied().collect())
            .unwrap_or_default()
    }

    /// Whether this node knows the partition map (in this run).
    pub(super) fn has_map(&self) -> bool {
        self.map.is_some()
    }

    pub(super) fn is_owner(&self, client_id: &str) -> bool {
        self.map
            .as_ref()
            .is_none_or(|m| m.owners(client_id).contains(&THIS_NODE))
    }
}

fn encode_meta(stamp: Stamp, home: &str) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(stamp.clock).u64(stamp.node).bytes(home.as_bytes());
    w.buf
}

fn decode_meta(body: &[u8]) -> Result<(Stamp, String), String> {
    let mut r = Reader::new(body);
    let stamp = Stamp {
        clock: r.u64().map_err(|e| e.0)?,
        node: r.u64().map_err(|e| e.0)?,
    };
    let home = std::str::from_utf8(r.bytes().map_err(|e| e.0)?)
        .map_err(|_| "copy home is not UTF-8")?
        .to_owned();
    r.finish().map_err(|e| e.0)?;
    Ok((stamp, home))
}

impl Engine {
    /// The cluster's agreed members (this node as `THIS_NODE`), told before each map.
    pub fn cluster_set_members(&mut self, members: Vec<PeerId>) {
        self.replicas.members = Some(members);
        self.release_gates();
    }

    /// The partition map (`owners[p]`: partition p's primary then followers, this node as
    /// `THIS_NODE`). Sessions whose partition gained an owner are streamed to it in full
    /// (`cluster_streams`); sessions from before copies existed get a version and are copied.
    pub fn cluster_set_map(&mut self, version: u64, owners: Vec<Vec<PeerId>>, now: u64) {
        let old = self.replicas.map.replace(SessionMap { version, owners });
        self.replicas.sweep_due = true;
        // Owners the map dropped are waited for no longer (`cluster_authority`).
        self.release_gates();
        if version != self.out_of_touch_map && self.out_of_touch_until != u64::MAX {
            // In touch again: the cluster's membership changed since the pause (not while
            // the store still fails: `store_failed`).
            self.out_of_touch_until = 0;
        }
        if self.cluster.epoch_of() == 0 {
            return;
        }
        self.drop_copies_not_owned();
        self.ask_owners_named_anew(now);
        self.wills_map_changed(now);
        self.registry_map_changed();
        let sids: Vec<SessionId> = self.by_client.values().copied().collect();
        for sid in sids {
            let Some(session) = self.session(sid) else {
                continue;
            };
            if !session.stored {
                continue;
            }
            if session.stamp.is_none() {
                let stamp = self.cluster.retained.next(self.wall(now));
                self.session_mut(sid).expect("exists").stamp = Some(stamp);
                self.copy_session(sid, None, now);
                continue;
            }
            // At the first map after a start, the owners had their copies already.
            let Some(old) = old.as_ref() else { continue };
            let client = session.client_id.clone();
            let owners = self.replicas.other_owners(&client);
            let before = old.owners(&client);
            let gained: Vec<PeerId> = owners
                .iter()
                .copied()
                .filter(|p| !before.contains(p))
                .collect();
            // Former owners of protocol 6 keep their copies until released; older ones drop
            // theirs at once.
            let left: Vec<PeerId> = before
                .iter()
                .copied()
                .filter(|&p| p != THIS_NODE && !owners.contains(&p))
                .filter(|&p| self.cluster.peer_protocol(p) >= 6)
                .collect();
            self.replicas.streams.add(&client, &gained, &left, &owners);
        }
    }

    /// Copies of partitions this node no longer owns go, if their home is up and older than
    /// protocol 6: it sends the new owners theirs (a stale copy here could otherwise answer
    /// a claim one day). A home of protocol 6 says when its new owners have theirs
    /// (`cluster_streams`). A copy of a home that is down stays until the home is back or
    /// its session is taken over.
    fn drop_copies_not_owned(&mut self) {
        let stale: Vec<Arc<str>> = self
            .replicas
            .copies
            .iter()
            .filter(|(client, copy)| {
                !self.replicas.is_owner(client)
                    && !self.replicas.wanted.contains_key(*client)
                    && self.cluster.peer_id_of(&copy.home).is_some_and(|h| {
                        self.cluster.peer_up(h) && self.cluster.peer_protocol(h) < 6
                    })
            })
            .map(|(client, _)| client.clone())
            .collect();
        for client in stale {
            self.drop_copy(&client);
        }
    }

    pub(super) fn replicas_degraded_ack(&mut self) {
        self.replicas.stats.degraded_acks += 1;
    }

    pub fn replica_stats(&self) -> ReplicaStats {
        let mut s = self.replicas.stats;
        s.copies = self.replicas.copies.len() as u64;
        s.streamed = self.replicas.streams.streamed;
        s.stream_backlog = self.replicas.streams.backlog();
        s
    }

    /// Gives a session that becomes durable here its version (the stamp its copies carry).
    /// (Before the first map it gets none: the map gives it one and copies it in full.)
    pub(super) fn stamp_session(&mut self, sid: SessionId, now: u64) {
        if self.replicas.map.is_none() || self.session(sid).is_none_or(|s| s.stamp.is_some()) {
            return;
        }
        let stamp = self.cluster.retained.next(self.wall(now));
        self.session_mut(sid).expect("checked").stamp = Some(stamp);
    }

    /// A store operation on `key`: copied to the other owners if it is a record of a
    /// persistent session homed here (see the module comment).
    pub(super) fn copy_op(&mut self, key: &[u8], value: Option<&[u8]>) {
        let Some(map) = self.replicas.map.as_ref() else {
            return;
        };
        let Some(client) = records::session_client(key) else {
            return;
        };
        let Some(stamp) = self
            .by_client
            .get(client)
            .and_then(|&sid| self.session(sid))
            .and_then(|s| s.stamp)
        else {
            return;
        };
        let version = map.version;
        let mut targets = std::mem::take(&mut self.replicas.scratch);
        targets.clear();
        targets.extend(map.owners(client).iter().filter(|&&p| p != THIS_NODE));
        self.replicas.streams.adjust_targets(client, &mut targets);
        let wall = self.wall(self.last_now);
        let at = self.cluster.retained.next(wall).clock;
        let need = usize::from(self.cfg.cluster_ack_replicas.saturating_sub(1));
        let mut waited = 0;
        let mut queued = false;
        for &t in &targets {
            let Some((up, seq)) = self.cluster.queue_copy(t, version, stamp, key, value, at) else {
                continue;
            };
            queued = true;
            self.replicas.stats.ops_out += 1;
            if !self.replicas.copied_to.contains(&t) {
                self.replicas.copied_to.push(t);
            }
            if up && waited < need {
                self.replicas.waits.push((t, seq));
                waited += 1;
            } else if up {
                self.replicas.gate_waits.push((t, seq));
            }
        }
        if queued && waited < need {
            self.replicas.degraded = true;
        }
        self.replicas.scratch = targets;
    }

    /// Sends every record of session `sid` to the owners `to` (all of them if None): a
    /// copy made anew there (its version is new to them). Returns the bytes of the records,
    /// and the batch each peer's copy ends in.
    pub(super) fn copy_session(
        &mut self,
        sid: SessionId,
        to: Option<&[PeerId]>,
        now: u64,
    ) -> (usize, Vec<(PeerId, u64)>) {
        let mut ends = Vec::new();
        let Some(session) = self.session(sid) else {
            return (0, ends);
        };
        let Some(stamp) = session.stamp else {
            return (0, ends);
        };
        let client = session.client_id.clone();
        // Its record with the version first: it is what a restart reads back.
        self.persist_session(sid, now);
        let Some(map) = self.replicas.map.as_ref() else {
            return (0, ends);
        };
        let version = map.version;
        let targets: Vec<PeerId> = match to {
            Some(t) => t.to_vec(),
            None => self.replicas.other_owners(&client),
        };
        let records = self.session_records(sid, false, now);
        let at = self.cluster.retained.next(self.wall(now)).clock;
        for &t in &targets {
            let mut end = None;
            for (key, value) in &records {
                let value = Some(&value[..]);
                if let Some((_, seq)) = self.cluster.queue_copy(t, version, stamp, key, value, at) {
                    self.replicas.stats.ops_out += 1;
                    end = Some(seq);
                }
            }
            ends.extend(end.map(|seq| (t, seq)));
        }
        let bytes = records.iter().map(|(k, v)| k.len() + v.len()).sum();
        (bytes, ends)
    }

    /// A copy operation from peer `peer` (the session's home). Errors are a hostile or
    /// broken peer's (the link is dropped); an older version is refused with a `Fence`.
    pub(super) fn copy_received(&mut self, peer: PeerId, op: CopyOp<'_>, now: u64) {
        let CopyOp {
            map,
            stamp,
            key,
            value,
            at,
        } = op;
        let Some(client) = records::session_client(key) else {
            return;
        };
        let client: Arc<str> = Arc::from(client);
        self.cluster.retained.observe(stamp);
        self.replicas.stats.ops_in += 1;
        if map <= self.replicas.map_version()
            && !self.replicas.is_owner(&client)
            && !self.replicas.copies.contains_key(&client)
        {
            // Sent under this map or an older one to a node that does not hold the partition
            // (a former owner keeps its copy current until the home releases it; one that
            // dropped it gets no new one).
            if map == self.replicas.map_version() {
                return;
            }
            let logged = &mut self.replicas.refused_logged;
            if logged.0 != map {
                *logged = (map, HashSet::new());
            }
            if logged.1.len() >= REFUSED_LOGGED_MAX || !logged.1.insert(client.clone()) {
                return;
            }
            self.event(
                "copy_refused",
                client,
                format!("copy for map version {map}, not an owner at this one"),
            );
            return;
        }
        if let Some(&sid) = self.by_client.get(&client) {
            match self.version_of(sid) {
                Some(ours) if ours > stamp => {
                    self.replicas.stats.stale_refused += 1;
                    let me = self.cluster.name.clone();
                    self.fence_once(peer, &client, ours, &me);
                    return;
                }
                // A live connection of unknown version stays (a split merges in issue 11).
                None if self.session(sid).is_some_and(|s| s.conn.is_some()) => {
                    self.replicas.stats.stale_refused += 1;
                    return;
                }
                _ => self.give_up(sid, peer, stamp, now),
            }
        }
        let home = self.cluster.peer_name(peer);
        let Some(home) = home else { return };
        if value.is_none() {
            // Nothing to delete in a copy not held. The session record goes only when the
            // session ends or leaves here (or its home releases a former owner's copy): the
            // copy goes whole, as does an older version's.
            let held = self.replicas.copies.get(&client).map(|c| c.stamp);
            let whole = key.first() == Some(&records::SESSION);
            match held {
                None => return,
                Some(c) if c < stamp || (c == stamp && whole) => {
                    self.drop_copy(&client);
                    return;
                }
                _ => {}
            }
        }
        let reset = match self.replicas.copies.get(&client) {
            None => true,
            Some(c) if stamp > c.stamp => true,
            Some(c) if stamp < c.stamp => {
                let (newer, home) = (c.stamp, c.home.clone());
                self.replicas.stats.stale_refused += 1;
                self.fence_once(peer, &client, newer, &home);
                return;
            }
            Some(_) => false,
        };
        if reset {
            self.drop_copy(&client);
            self.put(records::copy_key(&client, b""), &encode_meta(stamp, &home));
            self.replicas.copies.insert(
                client.clone(),
                Copy {
                    home,
                    stamp,
                    at: 0,
                    keys: HashSet::new(),
                },
            );
            self.registry_note(&client);
        }
        let store_key = records::copy_key(&client, key);
        let copy = self.replicas.copies.get_mut(&client).expect("made above");
        copy.at = copy.at.max(at);
        match value {
            Some(v) => {
                copy.keys.insert(key.into());
                self.store_ops.push((store_key, Some(v.to_vec())));
            }
            None => {
                copy.keys.remove(key);
                let empty = copy.keys.is_empty();
                self.store_ops.push((store_key, None));
                if empty {
                    // The session ended there (or moved, and its new home copies anew).
                    self.drop_copy(&client);
                }
            }
        }
    }

    /// Deletes the copy of `client_id` held here, if any.
    pub(super) fn drop_copy(&mut self, client_id: &str) {
        let Some(copy) = self.replicas.copies.remove(client_id) else {
            return;
        };
        self.replicas.wanted.remove(client_id);
        for key in copy.keys {
            self.delete(records::copy_key(client_id, &key));
        }
        self.delete(records::copy_key(client_id, b""));
        self.registry_note(client_id);
    }

    /// Whether sessions of dead homes are being installed here (their copies read back).
    pub(super) fn taking_over(&self) -> bool {
        self.replicas
            .wanted
            .values()
            .any(|u| matches!(u, Use::Takeover))
    }

    /// The home of the copy of `client_id` held here, if it is a peer.
    pub(super) fn copy_home(&self, client_id: &str) -> Option<PeerId> {
        let copy = self.replicas.copies.get(client_id)?;
        self.cluster.peer_id_of(&copy.home)
    }

    /// Whether this node holds a copy of `client_id`'s session.
    pub(super) fn holds_copy(&self, client_id: &str) -> bool {
        self.replicas.copies.contains_key(client_id)
    }

    /// Client ids whose copies this node holds.
    pub(super) fn copied_clients(&self) -> impl Iterator<Item = &Arc<str>> {
        self.replicas.copies.keys()
    }

    /// A copy record read back at start-up.
    pub(super) fn restore_copy(
        &mut self,
        client: String,
        inner: Vec<u8>,
        body: &[u8],
    ) -> Result<(), String> {
        let client: Arc<str> = Arc::from(client);
        if inner.is_empty() {
            let (stamp, home) = decode_meta(body)?;
            self.cluster.retained.observe(stamp);
            let copy = self.replicas.copies.entry(client).or_insert_with(|| Copy {
                home: Arc::from(""),
                stamp,
                at: 0,
                keys: HashSet::new(),
            });
            copy.home = Arc::from(home);
            copy.stamp = stamp;
            return Ok(());
        }
        match self.replicas.copies.get_mut(&client) {
            Some(copy) => {
                copy.keys.insert(inner.into());
                Ok(())
            }
            // The meta record sorts first: a copy without one is torn.
            None => Err("copy record without its meta record".into()),
        }
    }

    /// The version of session `sid` here: its stamp, or that of the claim it won.
    pub(super) fn version_of(&self, sid: SessionId) -> Option<Stamp> {
        let won = self.claims.won.get(&sid).copied();
        self.session(sid).and_then(|s| s.stamp).max(won)
    }

    /// Peer `peer` installed `client_id`: kept if the session relays or waits here (a node
    /// that relays for it tells what `peer` routed itself from what it did not).
    pub(super) fn installed_received(&mut self, peer: PeerId, client_id: &str) {
        let waiting = self
            .by_client
            .get(client_id)
            .is_some_and(|&sid| self.unconfirmed(sid));
        if waiting || self.relays_client(client_id) {
            self.replicas.installed.insert(Arc::from(client_id), peer);
        }
    }

    /// Whether `peer` routes to session `client_id` itself (it said it installed it; a peer
    /// of protocol 3, which cannot say, is taken to).
    pub(super) fn routes_itself(&self, peer: PeerId, client_id: &str) -> bool {
        self.cluster.peer_protocol(peer) < 4
            || self.replicas.installed.get(client_id) == Some(&peer)
    }

    /// Tells peer `peer`, whose copy operation of an older version of `client_id` was
    /// refused, where version `newer` lives, unless it was told so on this link already.
    fn fence_once(&mut self, peer: PeerId, client_id: &Arc<str>, newer: Stamp, home: &str) {
        let told = &mut self.replicas.fences_told;
        if told.insert((peer, client_id.clone()), newer) != Some(newer) {
            self.cluster.queue_fence(peer, client_id, newer, home);
        }
    }

    /// Peer `peer`'s link came up or went down: what it was told may be lost with it.
    pub(super) fn forget_fences_told(&mut self, peer: PeerId) {
        if !self.replicas.fences_told.is_empty() {
            self.replicas.fences_told.retain(|(p, _), _| *p != peer);
        }
    }

    /// Peer `peer` holds `client_id` at `stamp` (its link just came up): it is told the
    /// newest version known here, if newer, and where that lives.
    pub(super) fn copy_check_received(&mut self, peer: PeerId, client_id: &str, stamp: Stamp) {
        self.cluster.retained.observe(stamp);
        let local = self
            .by_client
            .get(client_id)
            .and_then(|&sid| self.version_of(sid));
        if local.is_some_and(|l| l >= stamp)
            && !self.replicas.other_owners(client_id).contains(&peer)
            && !self.replicas.streams.keeps(client_id, peer)
        {
            // A former owner's copy of a session here, no longer needed (its release was
            // lost with a restart of this node, or it was down then).
            self.release_copy(peer, client_id);
            return;
        }
        let copied = self
            .replicas
            .copies
            .get(client_id)
            .map(|c| (c.stamp, c.home.clone()));
        let me = self.cluster.name.clone();
        let newest = match (local, copied) {
            (Some(l), Some((c, home))) if c > l => Some((c, home)),
            (Some(l), _) => Some((l, me.clone())),
            (None, c) => c,
        };
        // Nothing newer: the asker's version stands. From protocol 6, an owner holding no
        // copy of it names itself, and the asker streams it one (`cluster_streams`).
        let none_here = newest.is_none()
            && self.replicas.is_owner(client_id)
            && self.cluster.peer_protocol(peer) >= 6;
        match newest.filter(|(n, _)| *n > stamp) {
            Some((newer, home)) => self.cluster.queue_fence(peer, client_id, newer, &home),
            None if none_here => self
                .cluster
                .queue_fence(peer, client_id, Stamp::default(), &me),
            None => self
                .cluster
                .queue_fence(peer, client_id, Stamp::default(), ""),
        }
    }

    /// Peer `peer` answers about `client_id`: `stamp` is the newest version it knows, living
    /// on `home`. An older session here goes to `home` (as in a hand-over, with what reached
    /// it since this node started); a copy here of an older one goes.
    pub(super) fn fence_received(
        &mut self,
        peer: PeerId,
        client_id: &str,
        stamp: Stamp,
        home: &str,
        now: u64,
    ) {
        self.cluster.retained.observe(stamp);
        if stamp == Stamp::default() && !home.is_empty() {
            // An owner without a copy of ours (see `copy_check_received`).
            self.stream_to_owner(peer, client_id);
        }
        if let Some(&sid) = self.by_client.get(client_id) {
            if self.version_of(sid).is_some_and(|ours| ours < stamp) {
                let to = self.cluster.peer_id_of(home);
                match to {
                    Some(to) if !self.cluster.peer_seen_up(to) && self.unconfirmed(sid) => {
                        let u = self.replicas.unconfirmed.get_mut(&sid).expect("checked");
                        u.give_up_to = Some((to, stamp));
                    }
                    Some(to) => self.give_up(sid, to, stamp, now),
                    None => self.fence_session(sid, now),
                }
            } else if let Some(u) = self.replicas.unconfirmed.get_mut(&sid) {
                u.answered.push(peer);
                self.confirm_if_answered(sid, now);
            }
        }
        if self
            .replicas
            .copies
            .get(client_id)
            .is_some_and(|c| c.stamp < stamp)
        {
            self.drop_copy(client_id);
        }
    }

    /// Routing a message to session `sid`: true if the peer it came from lists the
    /// session's client id as `taken` (its version of the session took it while the two
    /// nodes were cut off: it lives on there, or merges into this one or the one this relays
    /// to with what its client did not get, `give_up`). Else, with `listing` (published
    /// here, at QoS 1/2 while a peer lags, or at QoS 2), a persistent session here is
    /// listed as taken; while a peer lags, its messages from here on are ones only it may
    /// have (`taken_from_seq`).
    pub(super) fn taken_elsewhere(
        &mut self,
        sid: SessionId,
        taken: &[&str],
        listing: Listing,
        now: u64,
    ) -> bool {
        let relaying = self.claims.relaying(sid);
        let Some(s) = self.session_mut(sid) else {
            return false;
        };
        if taken.contains(&&*s.client_id) {
            self.replicas.stats.taken_elsewhere += 1;
            return true;
        }
        if listing != Listing::No && s.stamp.is_some() && !relaying {
            let seq = s.next_seq + 1;
            let client = s.client_id.clone();
            if listing == Listing::Lagging {
                if s.taken_from_seq() == 0 {
                    s.rare_mut().taken_from_seq = seq;
                }
            } else {
                let listed = &mut self.replicas.listed;
                while listed
                    .front()
                    .is_some_and(|l| l.0 + LISTED_KEEP_MS < now || listed.len() >= LISTED_MAX)
                {
                    listed.pop_front();
                }
                listed.push_back((now, sid, client.clone(), seq));
            }
            self.cluster.note_taken(client, listing == Listing::Qos2);
        }
        false
    }

    /// A peer lags: the QoS 2 deliveries listed lately may have gone to it just as it was
    /// cut off, so their sessions' messages from those on are ones only they may have, as
    /// if listed while it lagged (`taken_elsewhere`). Each tick.
    fn promote_listed(&mut self, now: u64) {
        if self.replicas.listed.is_empty() || !self.cluster.any_lagging(now) {
            return;
        }
        for (_, sid, client, seq) in std::mem::take(&mut self.replicas.listed) {
            if let Some(s) = self.session_mut(sid).filter(|s| s.client_id == client) {
                if s.taken_from_seq() == 0 || s.taken_from_seq() > seq {
                    s.rare_mut().taken_from_seq = seq;
                }
            }
        }
    }

    /// Hands session `sid` to `to`, where version `newer` of it lives, if that version is
    /// recent enough for `to` to remember the ids it took: its own messages (with ids, to a
    /// node of protocol 5) and what reached it since this node started (and `to` did not
    /// get itself) go there, then its subscriptions relay there for a while. Else the
    /// session is only dropped. No will either way: the session lives on there.
    pub(super) fn give_up(&mut self, sid: SessionId, to: PeerId, newer: Stamp, now: u64) {
        // Past that, `to` no longer tells them from what it delivered already (twice is
        // worse than the rare message only this node held, and what other nodes kept for
        // this one while it was away went to `to` when it asked them: `cluster_kept`) --
        // but for those taken while `to` lagged (`WireMessage::taken`): only this version
        // has them, whatever its age; nor for those this node told `to` it took (`TakenIds`):
        // the newer version skipped them.
        let age = self.wall(now).saturating_sub(newer.clock >> 16);
        let taken_from = self.session(sid).map_or(0, |s| s.taken_from_seq());
        let told = self.told_taken(sid, now);
        let old = age >= OWN_RELAY_MS;
        if old && taken_from == 0 && told.is_empty() {
            if let Some(client) = self.session(sid).map(|s| s.client_id.clone()) {
                self.replicas.installed.remove(&client);
                // The newer version may wait for what this one held (`wait_for_twin`).
                self.cluster.queue_kept_end(to, &client);
            }
            self.fence_session(sid, now);
            return;
        }
        let held = self
            .replicas
            .unconfirmed
            .remove(&sid)
            .map(|u| u.held)
            .unwrap_or_default();
        // Its own messages, in flight then queued: one applied here just before this node
        // died may be missing from the copy the newer version was made from (its copy
        // operation was lost with the node, and the publisher's acknowledgement counted the
        // batch kept for this node). Those with an id only: the newer home takes each id
        // once. QoS 2 ones past PUBREC too, with their packet id: a client that delivers a
        // QoS 2 message on PUBREL (paho, libmosquitto) either did, its PUBCOMP lost with the
        // connection, or holds it for that PUBREL, which the newer version sends again
        // (`take_released`).
        let own: Vec<(Delivery, SessionMessageKind)> = self
            .session(sid)
            .map(|s| {
                let flying = s.inflight.iter().map(|f| match f.state {
                    AwaitingAck::PubComp => (&f.delivery, SessionMessageKind::Released(f.pkid)),
                    _ => (&f.delivery, SessionMessageKind::Relayed),
                });
                flying
                    .chain(s.queue.iter().map(|d| (d, SessionMessageKind::Relayed)))
                    .filter(|(d, _)| {
                        let id = d.msg.id;
                        let taken = d.seq != 0 && taken_from != 0 && d.seq >= taken_from;
                        id != 0 && (!old || taken || told.contains(&id))
                    })
                    .map(|(d, kind)| (d.clone(), kind))
                    .collect()
            })
            .unwrap_or_default();
        // What this version took, as it would tell `to` when their link comes up
        // (`send_taken_ids`): it may give way before that (told of the newer version by a
        // third node), and the newer one, holding what came for it meanwhile until this
        // one's word, would then deliver those again.
        let taken = self.version_of(sid).filter(|_| self.moved_lately(sid, now));
        let Some(client) = self.retire(sid, now) else {
            return;
        };
        if let Some(stamp) = taken {
            // Ahead of what waited for `to` (as at a link-up): its version's wait for this
            // node's word ends with the first batch it gets from here.
            let node = super::cluster_retained::node_key(&self.cluster.name);
            let ids = told.iter().copied().take(TAKEN_IDS_MAX);
            self.cluster.queue_first(to, TAKEN_IDS_PROTOCOL, |items| {
                items.taken_ids(&client, stamp, node, ids);
            });
        }
        let key = self.cluster.peer_key(to);
        self.replicas.installed.remove(&client);
        if self.cluster.peer_protocol(to) >= 5 {
            for (d, kind) in own {
                let (msg, qos, retain) = (&d.msg, d.qos, d.retain);
                self.cluster.queue_session_message(
                    to,
                    &client,
                    msg,
                    qos,
                    retain,
                    &d.sub_ids,
                    kind,
                    &[],
                    0,
                    now,
                );
            }
        }
        for h in held {
            if (h.from == Some(to) && h.from_home) || (h.plain && h.also.contains(&key)) {
                continue;
            }
            let kind = SessionMessageKind::Relayed;
            self.cluster.queue_session_message(
                to,
                &client,
                &h.msg,
                h.qos,
                h.retain,
                &h.sub_ids,
                kind,
                &[],
                0,
                now,
            );
        }
        // What this version held has gone: the newer one may send on (it waits for this
        // once it skipped what this one took, `cluster_kept::wait_for_twin`).
        self.cluster.queue_kept_end(to, &client);
        self.cluster.seal_for(to);
        self.store_outgoing(to);
        self.hand_over(sid, to, false, now);
        let home = self.cluster.peer_name(to).unwrap_or_else(|| Arc::from("?"));
        self.event(
            "session_fenced",
            client,
            format!("a newer version of the session lives on {home}: handed to it"),
        );
    }

    /// A QoS 2 message the version of session `sid` that gave way to this one had sent
    /// PUBREL for under `pkid` (`give_up`). Its client passed it on already (and the PUBCOMP
    /// was lost with the connection) or holds it for that PUBREL: either way it takes the
    /// PUBREL, not the message again. So it is taken in flight here under the same id, and
    /// the PUBREL goes out now or at the next resume. Where this version uses that id (the
    /// client got another message under it here, and holds that one now) or the client's
    /// window here is full, it goes as a new message once the batch is in, and so does what
    /// follows it for the session in the batch (`put_off_after_released`): a client that
    /// passed it on may do so twice, rather than one that did not never do.
    pub(super) fn take_released(
        &mut self,
        sid: SessionId,
        msg: &Arc<Message>,
        retain: bool,
        sub_ids: &[u32],
        pkid: u16,
        now: u64,
    ) {
        let Some(session) = self.session(sid) else {
            return;
        };
        let conn = session
            .conn
            .and_then(|c| self.conn(c).map(|conn| (c, conn)))
            .filter(|(_, conn)| conn.state == ConnState::Active);
        let full = conn.is_some_and(|(_, conn)| {
            let cap = usize::from(conn.client_receive_max.min(self.cfg.max_inflight));
            session.inflight.len() >= cap
        });
        let busy = full || session.inflight.iter().any(|f| f.pkid == pkid);
        let mut d = Delivery {
            msg: msg.clone(),
            qos: QoS::ExactlyOnce,
            retain,
            sub_ids: sub_ids.to_vec(),
            seq: 0,
        };
        if busy {
            // Once the batch is in, with what comes after it for the session: sent now, it
            // would take an id a later released message needs.
            self.replicas.released_later.push((sid, d));
            return;
        }
        let conn = conn.map(|(c, _)| c);
        if msg.id != 0 && self.seen_since_move(sid, msg.id, now) {
            // This version delivered it already.
            return;
        }
        self.replicas.stats.released_taken += 1;
        let mark = self.wait_mark();
        let from = conn.and_then(|c| self.conn(c)).map_or(0, |c| c.out.len());
        self.store_delivery(sid, &mut d, now);
        self.store_flight(sid, d.seq, pkid, AwaitingAck::PubComp);
        self.session_mut(sid)
            .expect("checked")
            .push_inflight(Inflight {
                pkid,
                state: AwaitingAck::PubComp,
                delivery: d,
            });
        if let Some(c) = conn {
            self.send(c, &Packet::PubRel(Engine::ack(pkid, 0)));
            self.gate_output(c, from, mark);
        }
    }

    /// Once `take_released` put a message of session `sid` off, what comes for it after in
    /// the same batch (the rest of a hand-over) is put off too, to keep its order: true if
    /// this one was. A released one then goes as a new message as well.
    pub(super) fn put_off_after_released(
        &mut self,
        sid: SessionId,
        msg: &Arc<Message>,
        qos: QoS,
        retain: bool,
        sub_ids: &[u32],
        kind: SessionMessageKind,
    ) -> bool {
        let later = &mut self.replicas.released_later;
        if kind == SessionMessageKind::Kept || !later.iter().any(|(s, _)| *s == sid) {
            return false;
        }
        let d = Delivery {
            msg: msg.clone(),
            qos,
            retain,
            sub_ids: sub_ids.to_vec(),
            seq: 0,
        };
        later.push((sid, d));
        true
    }

    /// What `take_released` put off, delivered as new messages.
    pub(super) fn deliver_released_later(&mut self, now: u64) {
        for (sid, d) in std::mem::take(&mut self.replicas.released_later) {
            self.deliver(sid, &d.msg, d.qos, d.retain, d.sub_ids, now);
        }
    }

    /// Peer `peer`'s link is up (its protocol known): the sessions restored here that wait
    /// to go to it go.
    pub(super) fn give_up_deferred(&mut self, peer: PeerId, now: u64) {
        let due: Vec<(SessionId, Stamp)> = self
            .replicas
            .unconfirmed
            .iter()
            .filter_map(|(&sid, u)| match u.give_up_to {
                Some((to, stamp)) if to == peer => Some((sid, stamp)),
                _ => None,
            })
            .collect();
        for (sid, stamp) in due {
            self.give_up(sid, peer, stamp, now);
        }
    }

    /// Drops session `sid` here, without a will: a newer version of it lives elsewhere.
    fn fence_session(&mut self, sid: SessionId, now: u64) {
        self.replicas.unconfirmed.remove(&sid);
        let Some(client) = self.retire(sid, now) else {
            return;
        };
        self.unpersist_session(sid);
        self.remove_session(sid);
        self.event(
            "session_fenced",
            client,
            "a newer version of the session lives on another node".into(),
        );
    }

    /// Session `sid` stops being this node's version of its client: no stamp (its store
    /// operations are not copied any more), no will, its connection closed with 0x8E.
    fn retire(&mut self, sid: SessionId, now: u64) -> Option<Arc<str>> {
        self.replicas.stats.fenced += 1;
        self.claims.won.remove(&sid);
        let session = self.session(sid)?;
        let client = session.client_id.clone();
        if let Some(conn) = session.conn {
            // Before the stamp goes: the close stores the session, and one without a stamp
            // would get a new one, newer than the version it gives way to (each of two
            // nodes could then hand its session to the other, and neither keep one).
            self.close_for_another_node(conn, "session lives on another node", now);
        }
        let session = self.session_mut(sid)?;
        session.stamp = None;
        session.take_pending_will();
        Some(client)
    }

    /// A session restored at start-up in a cluster: until the owners of its partition
    /// confirm that no newer version lives elsewhere (or the takeover time passes), what is
    /// delivered to it waits.
    pub(super) fn restored_unconfirmed(&mut self, sid: SessionId, now: u64) {
        let until = now + self.cfg.cluster_takeover_ms;
        self.replicas.unconfirmed.insert(
            sid,
            Unconfirmed {
                answered: Vec::new(),
                held: Vec::new(),
                until,
                give_up_to: None,
                cut_off: false,
            },
        );
    }

    /// The link to `peer`, an owner of some sessions' partitions here, is back after a
    /// silence long enough for its side to have taken them over (a split): as restored
    /// ones, they hold what is delivered to them until it answers their checks
    /// (`queue_copy_checks`, sent next): nothing newer (confirmed), or where the newer
    /// version lives (`give_up`); the takeover time at most.
    pub(super) fn cut_off_sessions(&mut self, peer: PeerId, now: u64) {
        if self.cluster.peer_protocol(peer) < 4 || self.cfg.cluster_takeover_ms == 0 {
            // It would not answer.
            return;
        }
        let until = now + self.cfg.cluster_takeover_ms;
        let Some(map) = self.replicas.map.as_ref() else {
            return;
        };
        let sessions: Vec<(SessionId, Vec<PeerId>)> = self
            .checked_sessions(peer)
            .into_iter()
            .map(|(client, sid, _)| (sid, map.owners(&client).to_vec()))
            .collect();
        if sessions.is_empty() {
            return;
        }
        let count = sessions.len();
        for (sid, owners) in sessions {
            let u = self
                .replicas
                .unconfirmed
                .entry(sid)
                .or_insert_with(|| Unconfirmed {
                    // Only the peer back in touch is asked.
                    answered: owners.iter().copied().filter(|&p| p != peer).collect(),
                    held: Vec::new(),
                    until,
                    give_up_to: None,
                    cut_off: true,
                });
            u.answered.retain(|&p| p != peer);
            u.until = u.until.max(until);
            u.cut_off = true;
        }
        let name = self
            .cluster
            .peer_name(peer)
            .unwrap_or_else(|| Arc::from("?"));
        self.event(
            "cut_off_sessions",
            Arc::from(""),
            format!(
                "back in touch with {name} after a silence: {count} sessions it may have \
                 taken over wait for its word"
            ),
        );
    }

    /// A new map may name owners that the unconfirmed sessions here did not ask (they were
    /// not owners when their links came up): those that are up are asked now, and a session
    /// every owner has answered is confirmed. Else it would hold its deliveries for an
    /// answer never asked for, until the takeover time.
    fn ask_owners_named_anew(&mut self, now: u64) {
        if self.replicas.unconfirmed.is_empty() {
            return;
        }
        let Some(map) = self.replicas.map.as_ref() else {
            return;
        };
        let mut asks = Vec::new();
        let mut sids = Vec::new();
        for (&sid, u) in &self.replicas.unconfirmed {
            let Some((client, stamp)) = self
                .session(sid)
                .and_then(|s| s.stamp.map(|stamp| (s.client_id.clone(), stamp)))
            else {
                continue;
            };
            for &p in map.owners(&client) {
                if p != THIS_NODE && !u.answered.contains(&p) && self.cluster.peer_up(p) {
                    asks.push((p, client.clone(), stamp));
                }
            }
            sids.push(sid);
        }
        for (p, client, stamp) in asks {
            self.cluster.queue_copy_check(p, &client, stamp);
        }
        for sid in sids {
            self.confirm_if_answered(sid, now);
        }
    }

    /// Whether `sid` waits for an owner this node was cut off from (`cut_off_sessions`).
    pub(super) fn cut_off_unconfirmed(&self, sid: SessionId) -> bool {
        !self.replicas.unconfirmed.is_empty()
            && self
                .replicas
                .unconfirmed
                .get(&sid)
                .is_some_and(|u| u.cut_off)
    }

    /// Whether any session waits for its confirmation.
    pub(super) fn any_unconfirmed(&self) -> bool {
        !self.replicas.unconfirmed.is_empty()
    }

    /// Whether deliveries to `sid` wait for its confirmation.
    pub(super) fn unconfirmed(&self, sid: SessionId) -> bool {
        !self.replicas.unconfirmed.is_empty() && self.replicas.unconfirmed.contains_key(&sid)
    }

    /// Keeps a delivery to an unconfirmed session (see `restored_unconfirmed`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn hold_for_confirm(
        &mut self,
        sid: SessionId,
        msg: &Arc<Message>,
        qos: QoS,
        retain: bool,
        sub_ids: Vec<u32>,
        plain: bool,
        scope: Scope<'_>,
    ) {
        let (from, also) = match scope {
            Scope::Forwarded { from, also, .. } => (Some(from), also.to_vec()),
            Scope::Origin => (None, Vec::new()),
        };
        let from_home = from.is_some()
            && self
                .session(sid)
                .and_then(|s| self.replicas.installed.get(&s.client_id))
                .copied()
                == from;
        if let Some(u) = self.replicas.unconfirmed.get_mut(&sid) {
            u.held.push(HeldMessage {
                msg: msg.clone(),
                qos,
                retain,
                sub_ids,
                plain,
                from,
                from_home,
                also,
            });
        }
    }

    /// Confirms `sid` if every other owner of its partition answered.
    fn confirm_if_answered(&mut self, sid: SessionId, now: u64) {
        let Some(map) = self.replicas.map.as_ref() else {
            return;
        };
        let (Some(u), Some(s)) = (self.replicas.unconfirmed.get(&sid), self.session(sid)) else {
            return;
        };
        if u.give_up_to.is_some() {
            return;
        }
        let all = map
            .owners(&s.client_id)
            .iter()
            .all(|&p| p == THIS_NODE || u.answered.contains(&p));
        if all {
            self.confirm(sid, now);
        }
    }

    /// `sid` is the newest version of its session: what waited for it is delivered.
    pub(super) fn confirm(&mut self, sid: SessionId, now: u64) {
        let Some(mut u) = self.replicas.unconfirmed.remove(&sid) else {
            return;
        };
        // What each node kept for this one while cut off and what came since (relayed by
        // another node, say) can arrive interleaved: each publishing node's messages go in
        // its order, among themselves and with what reached the queue before the wait (a
        // node whose link came back first relayed newer ones).
        in_origin_order(&mut u.held, |h| h.msg.id);
        self.deliver_held(sid, u.held, now);
        self.queue_in_origin_order(sid, now);
        self.pump(sid, now);
        self.release_gates();
    }

    /// Delivers to session `sid` what an unconfirmed version of it held, but for what
    /// another version took meanwhile: that version's word (`TakenIds`) can come after the
    /// hold, with the session moved here (`send_session`).
    pub(super) fn deliver_held(&mut self, sid: SessionId, held: Vec<HeldMessage>, now: u64) {
        for h in held {
            if !self.twin_took(sid, h.msg.id, 0, now) {
                self.deliver(sid, &h.msg, h.qos, h.retain, h.sub_ids, now);
            }
        }
    }

    /// A claim of this node brings session `client_id` from `peer` while an unconfirmed
    /// version of it is here: the one brought wins (it is newer), and what waited here goes
    /// to it unless `peer` had it. Returns those messages, to deliver once installed.
    pub(super) fn replace_unconfirmed(
        &mut self,
        client_id: &str,
        peer: PeerId,
        now: u64,
    ) -> Vec<HeldMessage> {
        let Some(&sid) = self.by_client.get(client_id) else {
            return Vec::new();
        };
        if !self.unconfirmed(sid) {
            return Vec::new();
        }
        let held = self
            .replicas
            .unconfirmed
            .get_mut(&sid)
            .map(|u| std::mem::take(&mut u.held))
            .unwrap_or_default();
        self.fence_session(sid, now);
        let key = self.cluster.peer_key(peer);
        self.replicas.installed.remove(client_id);
        held.into_iter()
            .filter(|h| {
                !((h.from == Some(peer) && h.from_home) || (h.plain && h.also.contains(&key)))
            })
            .collect()
    }

    /// Tells peer `peer` (its link just came up) the versions of the sessions here whose
    /// partition it owns, and of the copies here of its sessions that this node no longer
    /// owns (it releases them unless it still streams them to their new owners). A check
    /// that goes again in a batch not acknowledged yet is not queued once more, unless
    /// the link was down long enough (`cut_off`) for the peer to have made a newer version
    /// since it read that check (its answer, not yet acknowledged either, could be older).
    pub(super) fn queue_copy_checks(&mut self, peer: PeerId, cut_off: bool) {
        let Some(map) = self.replicas.map.as_ref() else {
            return;
        };
        let mut checks: Vec<(Arc<str>, Stamp)> = self
            .checked_sessions(peer)
            .into_iter()
            .map(|(client, _, stamp)| (client, stamp))
            .collect();
        if self.cluster.peer_protocol(peer) >= 6 {
            let name = self.cluster.peer_name(peer);
            for (client, copy) in &self.replicas.copies {
                if Some(&copy.home) == name.as_ref() && !map.owners(client).contains(&THIS_NODE) {
                    checks.push((client.clone(), copy.stamp));
                }
            }
        }
        let sent = self.replicas.checks_sent.entry(peer).or_default();
        let c = &self.cluster;
        sent.retain(|_, &mut (_, seq)| !cut_off && c.holds_batch(peer, seq));
        checks.retain(|(client, stamp)| sent.get(client).is_none_or(|&(s, _)| s != *stamp));
        if checks.is_empty() {
            return;
        }
        for (client, stamp) in &checks {
            self.cluster.queue_copy_check(peer, client, *stamp);
        }
        self.replicas.stats.checks_out += checks.len() as u64;
        self.cluster.seal_for(peer);
        let seq = self.cluster.last_reliable(peer);
        let sent = self.replicas.checks_sent.entry(peer).or_default();
        for (client, stamp) in checks {
            sent.insert(client, (stamp, seq));
        }
    }

    /// The stored, versioned sessions here whose partition `peer` owns.
    fn checked_sessions(&self, peer: PeerId) -> Vec<(Arc<str>, SessionId, Stamp)> {
        let Some(map) = self.replicas.map.as_ref() else {
            return Vec::new();
        };
        let mut sessions = Vec::new();
        for (client, &sid) in &self.by_client {
            let Some(stamp) = self.session(sid).filter(|s| s.stored).and_then(|s| s.stamp) else {
                continue;
            };
            if map.owners(client).contains(&peer) {
                sessions.push((client.clone(), sid, stamp));
            }
        }
        sessions
    }

    /// A claim for `client_id`, which has no session here: if this node holds its copy, the
    /// copy is read back to answer it once the home is down, or the answer waits while the
    /// home is up (`Watch`). True: the answer will follow.
    pub(super) fn claim_from_copy(
        &mut self,
        peer: PeerId,
        client_id: &str,
        stamp: Stamp,
        discard: bool,
        now: u64,
    ) -> bool {
        let Some(copy) = self.replicas.copies.get(client_id) else {
            return false;
        };
        let copy_stamp = copy.stamp;
        let home_up = self
            .cluster
            .peer_id_of(&copy.home)
            .is_some_and(|h| self.cluster.peer_up(h));
        if home_up && discard {
            // Its home ends it (and the copy with it), unless the session won a newer claim.
            return false;
        }
        if discard {
            // A clean start ends the session: the copy goes with it.
            self.drop_copy(client_id);
            return false;
        }
        let client: Arc<str> = Arc::from(client_id);
        if home_up && self.newer_claim_seen(client_id, stamp) {
            // The newer claimant takes over from this one: none, at once. (Watching, the
            // answer could wait for a home whose own, newer claim waits for this claimant.)
            return false;
        }
        if home_up {
            // One per peer and client id (its newest claim): a peer cannot grow the list.
            self.replicas
                .watching
                .retain(|w| !(w.peer == peer && w.client == client));
            self.replicas.watching.push(Watch {
                peer,
                client,
                stamp,
                copy: copy_stamp,
                until: now + WATCH_MS.max(self.cfg.cluster_takeover_ms + FOUND_DOWN_MS),
            });
            return true;
        }
        if !self.acts_on_copies() {
            // The home may live on across a split, serving from the session itself, or
            // this copy may be stale (back from one): none (`cluster_authority`). The
            // claimant starts afresh, or gets the session from where it lives.
            return false;
        }
        if self
            .replicas
            .wanted
            .insert(client.clone(), Use::Claim { peer, stamp })
            .is_none()
        {
            self.replicas.loads.push(client);
        }
        true
    }

    /// Whether this node holds a copy of `client_id` whose home is down (or is `gone`), and
    /// no session of it: a CONNECT resumes from that copy.
    pub(super) fn own_copy_usable(&self, client_id: &str, gone: Option<PeerId>) -> bool {
        let Some(copy) = self.replicas.copies.get(client_id) else {
            return false;
        };
        let home = self.cluster.peer_id_of(&copy.home);
        let down = match gone {
            Some(g) => home == Some(g),
            None => home.is_none_or(|h| !self.cluster.peer_up(h)),
        };
        down && !self.by_client.contains_key(client_id) && self.acts_on_copies()
    }

    /// Whether this node holds a copy of `client_id` whose home is down.
    pub(super) fn copy_home_down(&self, client_id: &str) -> bool {
        self.replicas.copies.get(client_id).is_some_and(|copy| {
            self.cluster
                .peer_id_of(&copy.home)
                .is_none_or(|h| !self.cluster.peer_up(h))
        })
    }

    /// This node claims `client_id` and holds its copy: if the copy's home is down (or is
    /// `gone`), the copy is read back to answer the claim as a peer would. True: it will.
    pub(super) fn claim_own_copy(&mut self, client_id: &str, gone: Option<PeerId>) -> bool {
        if !self.own_copy_usable(client_id, gone) {
            return false;
        }
        let client: Arc<str> = Arc::from(client_id);
        if self.replicas.wanted.contains_key(&client) {
            // Read back for a peer's claim already.
            return false;
        }
        self.replicas.wanted.insert(client.clone(), Use::Own);
        self.replicas.loads.push(client);
        true
    }

    /// Answers the watched claims whose copy changed, whose home went down, or whose time
    /// is up (see `Watch`); drops those of a claimant that went down.
    pub(super) fn watch_copies(&mut self, now: u64) {
        if self.replicas.watching.is_empty() {
            return;
        }
        let watching = std::mem::take(&mut self.replicas.watching);
        for w in watching {
            if !self.cluster.peer_up(w.peer) {
                continue;
            }
            let copy = self.replicas.copies.get(&w.client);
            let same = copy.is_some_and(|c| c.stamp == w.copy);
            let home_down = copy.is_some_and(|c| {
                !self
                    .cluster
                    .peer_id_of(&c.home)
                    .is_some_and(|h| self.cluster.peer_up(h))
            });
            if same && home_down {
                if !self.claim_from_copy(w.peer, &w.client, w.stamp, false, now) {
                    self.cluster
                        .queue_claim_answer(w.peer, &w.client, w.stamp, &[], None, &[]);
                }
            } else if same && now < w.until {
                self.replicas.watching.push(w);
            } else if self.holds_disconnected(&w.client) {
                // Its home handed it here as it left the cluster (`cluster_leave`): this
                // node serves the claim the home can no longer serve.
                self.serve_claim(w.peer, &w.client, w.stamp, false, now);
            } else {
                // Handed over by its home (or gone, or no word from it): nothing here.
                self.cluster
                    .queue_claim_answer(w.peer, &w.client, w.stamp, &[], None, &[]);
            }
        }
    }

    /// Looks for copies whose home has been down for the takeover time and that this node
    /// is the first owner up to take over (at most once per down period of a peer).
    pub(super) fn replicas_tick(&mut self, now: u64) {
        self.note_acting(now);
        // Output held past owners out of reach goes once this side has acted long enough.
        self.release_gates();
        self.promote_listed(now);
        self.stream_copies();
        self.watch_copies(now);
        if !self.replicas.unconfirmed.is_empty() {
            let due: Vec<SessionId> = self
                .replicas
                .unconfirmed
                .iter()
                .filter(|(_, u)| now >= u.until && u.give_up_to.is_none())
                .map(|(&sid, _)| sid)
                .collect();
            for sid in due {
                self.confirm(sid, now);
            }
        }
        let after = self.cfg.cluster_takeover_ms;
        if after == 0 || self.replicas.map.is_none() || self.replicas.copies.is_empty() {
            return;
        }
        if now < self.out_of_touch_until {
            // Out of touch itself (paused, or its store failing and its data links closed
            // by it): its peers are not dead, and its copies may be stale; a version made
            // from one would outrank the live one and deliver again what its client had.
            return;
        }
        let dead = self.cluster.down_longer_than(after, now);
        if !dead.is_empty() && !self.acts_on_copies() {
            // Cut off, not the survivor: the homes may live on; or back from a split, with
            // copies that may be stale and links still coming back (`cluster_authority`).
            // Swept once this side acts.
            self.replicas.sweep_due = true;
            return;
        }
        let fresh = dead.iter().any(|p| !self.replicas.swept.contains(p));
        self.replicas.swept.retain(|p| dead.contains(p));
        if !fresh && !std::mem::take(&mut self.replicas.sweep_due) {
            return;
        }
        self.replicas.swept.extend(dead.iter().copied());
        let map = self.replicas.map.as_ref().expect("checked");
        let mut take = Vec::new();
        for (client, copy) in &self.replicas.copies {
            if self.replicas.wanted.contains_key(client) {
                continue;
            }
            let home = self.cluster.peer_id_of(&copy.home);
            // A home that left the cluster (no longer a peer) is dead too.
            if home.is_some_and(|h| !dead.contains(&h)) {
                continue;
            }
            let first = map
                .owners(client)
                .iter()
                .copied()
                .filter(|&p| Some(p) != home)
                .find(|&p| p == THIS_NODE || self.cluster.peer_up(p));
            if first == Some(THIS_NODE) {
                take.push(client.clone());
            }
        }
        for client in take {
            self.replicas.wanted.insert(client.clone(), Use::Takeover);
            self.replicas.loads.push(client);
        }
    }

    /// Peer `peer` (a home this node holds copies of) applied `mark`: kept in the store
    /// too, in the write of the copies its batch made (an owner that restarts still knows
    /// how far a home that died meanwhile got).
    pub(super) fn applied_received(&mut self, peer: PeerId, mark: Mark) {
        let home = self.cluster.peer_key(peer);
        if let Some(m) = self.restore_mark(home, mark) {
            if self.cfg.durable {
                let key = records::mark_key(home, m.node);
                let body = records::encode_mark(m.epoch, m.seq);
                let value = envelope::seal(&key, &body, self.cfg.compress_above);
                self.store_ops.push((key, Some(value)));
            }
        }
    }

    /// Takes `mark` of the home with key `home` (from a peer, or read back from the store):
    /// the mark as it stands now, if it changed.
    pub(super) fn restore_mark(&mut self, home: u64, mark: Mark) -> Option<Mark> {
        let marks = self.replicas.marks.entry(home).or_default();
        match marks.iter().position(|m| m.node == mark.node) {
            Some(i) if marks[i].epoch == mark.epoch && marks[i].seq >= mark.seq => None,
            Some(i) if marks[i].epoch == mark.epoch => {
                marks[i].seq = mark.seq;
                Some(marks[i])
            }
            Some(i) => {
                marks[i] = mark;
                Some(mark)
            }
            // One per node of the cluster at most.
            None if marks.len() < 1024 => {
                marks.push(mark);
                Some(mark)
            }
            None => None,
        }
    }

    /// The marks of the home of this node's copy of `client_id` (see `applied_received`).
    pub(super) fn copy_marks(&self, client_id: &str) -> Vec<Mark> {
        self.replicas
            .copies
            .get(client_id)
            .and_then(|c| {
                let key = super::cluster_retained::node_key(&c.home);
                self.replicas.marks.get(&key)
            })
            .cloned()
            .unwrap_or_default()
    }

    pub fn has_copy_loads(&self) -> bool {
        !self.replicas.loads.is_empty()
    }

    /// The store keys of each copy to read back (`copy_loaded` takes them).
    pub fn copy_loads(&mut self) -> Vec<(Arc<str>, Vec<Vec<u8>>)> {
        let loads = std::mem::take(&mut self.replicas.loads);
        loads
            .into_iter()
            .filter_map(|client| {
                let copy = self.replicas.copies.get(&client)?;
                let keys = copy
                    .keys
                    .iter()
                    .map(|k| records::copy_key(&client, k))
                    .collect();
                Some((client, keys))
            })
            .collect()
    }

    /// The records of `client_id`'s copy, read back (`None`: missing): a claim is answered
    /// with them, or the session is installed here (its home is dead). Returns problems.
    pub fn copy_loaded(
        &mut self,
        client_id: &str,
        recs: &[(&[u8], Option<&[u8]>)],
        now: u64,
    ) -> Vec<String> {
        self.last_now = now;
        let mut problems = Vec::new();
        let Some(want) = self.replicas.wanted.remove(client_id) else {
            return problems;
        };
        let at = self.replicas.copies.get(client_id).map_or(0, |c| c.at);
        let prefix = records::copy_key(client_id, b"").len();
        let mut inner: Vec<(Vec<u8>, Vec<u8>)> = Vec::with_capacity(recs.len());
        for &(key, value) in recs {
            let Some(value) = value else {
                problems.push(format!("a copy record of {client_id} is missing"));
                continue;
            };
            let own = key[prefix.min(key.len())..].to_vec();
            if let Err(e) = envelope::open(&own, value) {
                problems.push(format!("a copy record of {client_id} is damaged: {e}"));
                continue;
            }
            inner.push((own, value.to_vec()));
        }
        match want {
            Use::Claim { peer, stamp } => {
                self.replicas.stats.claims_served += 1;
                let marks = self.copy_marks(client_id);
                self.drop_copy(client_id);
                self.cluster
                    .queue_claim_answer(peer, client_id, stamp, &inner, Some(at), &marks);
                // Kept on disk in the same write that deletes the copy.
                self.cluster.seal_for(peer);
                self.store_outgoing(peer);
            }
            Use::Own => {
                self.replicas.stats.claims_served += 1;
                let pairs: Vec<(&[u8], &[u8])> =
                    inner.iter().map(|(k, v)| (&k[..], &v[..])).collect();
                let marks = self.copy_marks(client_id);
                self.own_copy_loaded(client_id, &pairs, at, &marks, now);
            }
            Use::Takeover => {
                if self.by_client.contains_key(client_id) {
                    return problems;
                }
                self.replicas.stats.takeovers += 1;
                let pairs: Vec<(&[u8], &[u8])> =
                    inner.iter().map(|(k, v)| (&k[..], &v[..])).collect();
                let marks = self.copy_marks(client_id);
                self.install_session(client_id, &pairs, &marks, now);
                self.event(
                    "session_taken_over",
                    Arc::from(client_id),
                    "its home node is down: installed from the copy here".into(),
                );
            }
        }
        problems
    }

    /// Session `sid` was just installed here from records another node made: it gets a new
    /// version, and the owners a full copy of it (any copy here goes).
    pub(super) fn installed(&mut self, sid: SessionId, now: u64) {
        let Some(client) = self.session(sid).map(|s| s.client_id.clone()) else {
            return;
        };
        self.drop_copy(&client);
        self.replicas.installed.remove(&client);
        // In the peers' batch order: what this node routes from now on reaches the session.
        self.cluster.queue_installed(&client);
        if self.cluster.epoch_of() == 0 {
            return;
        }
        let stamp = self.cluster.retained.next(self.wall(now));
        self.session_mut(sid).expect("checked").stamp = Some(stamp);
        self.copy_session(sid, None, now);
    }
}

/// Puts the items with an id of each publishing node (an id's upper half) in the order of
/// their ids, in the places that node's items hold; the other items stay where they are.
pub(super) fn in_origin_order<T>(items: &mut [T], id: impl Fn(&T) -> u128) {
    let mut places: HashMap<u64, Vec<usize>> = HashMap::new();
    for (i, item) in items.iter().enumerate() {
        let id = id(item);
        if id != 0 {
            places.entry((id >> 64) as u64).or_default().push(i);
        }
    }
    for at in places.values() {
        if at.windows(2).all(|w| id(&items[w[0]]) < id(&items[w[1]])) {
            continue;
        }
        let mut sorted = at.clone();
        sorted.sort_by_key(|&i| id(&items[i]));
        // Apply the permutation: position at[k] gets the item now at sorted[k].
        let mut moved: Vec<Option<usize>> = vec![None; items.len()];
        for (&to, &from) in at.iter().zip(&sorted) {
            moved[to] = Some(from);
        }
        let mut done = vec![false; items.len()];
        for &start in at {
            if done[start] {
                continue;
            }
            // Follow the cycle that starts at `start`.
            let mut i = start;
            while let Some(from) = moved[i].filter(|&f| f != start) {
                items.swap(i, from);
                done[i] = true;
                i = from;
            }
            done[i] = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::in_origin_order;

    fn id(origin: u64, n: u64) -> u128 {
        (u128::from(origin) << 64) | u128::from(n)
    }

    #[test]
    fn each_origins_items_go_in_id_order_in_the_places_they_hold() {
        let mut items = vec![
            id(1, 3),
            id(2, 9),
            0,
            id(1, 1),
            id(2, 7),
            id(1, 2),
            0,
            id(2, 8),
        ];
        in_origin_order(&mut items, |&i| i);
        assert_eq!(
            items,
            vec![
                id(1, 1),
                id(2, 7),
                0,
                id(1, 2),
                id(2, 8),
                id(1, 3),
                0,
                id(2, 9)
            ]
        );
    }

    #[test]
    fn any_permutation_of_one_origin_comes_out_sorted() {
        let orders: [&[u64]; 5] = [
            &[5, 1, 4, 2, 3],
            &[2, 3, 4, 5, 1],
            &[5, 4, 3, 2, 1],
            &[1],
            &[],
        ];
        for order in orders {
            let mut items: Vec<u128> = order.iter().map(|&n| id(3, n)).collect();
            in_origin_order(&mut items, |&i| i);
            let mut want: Vec<u128> = order.iter().map(|&n| id(3, n)).collect();
            want.sort();
            assert_eq!(items, want, "{order:?}");
        }
    }
}
