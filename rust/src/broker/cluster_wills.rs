//! Wills of connections whose session ends with them (MQTT 3.1.1 clean session, MQTT 5
//! session expiry 0) outlive the node that holds the connection (issue 16).
//!
//! Persistent sessions are copied to the owners of their client id's partition, will and
//! all, and the owner that takes a dead home's session over publishes its will
//! (`cluster_replicas`). A session that ends with its connection is not copied (it has
//! nothing to resume), so its will, the "device offline" message most fleets rely on, died
//! with its node. Now such a connection's node sends its will to the other owners of the
//! partition (`WillCopy`, protocol 9, with the connection's version) and tells them when
//! the connection ends (`WillGone`: the will was published here, or discarded by a
//! DISCONNECT). Owners keep the copies (in memory, and in their store once a copy has
//! lived a second: record `w`), and the connection counts as ended when:
//! - the home has been down for the takeover time (as sessions are taken over);
//! - a claim for the client id arrives while the home is down (the client reconnected
//!   elsewhere before the takeover time): the will is published before the claim is
//!   answered, so it comes before anything the new connection publishes, as a takeover on
//!   one node; or
//! - the home restarted before the takeover time (a supervisor brings a killed node back in
//!   a second or two): its first reliable batch of a new incarnation shows that every
//!   connection of the old one died.
//!
//! Then one owner publishes the will, once (`will_duty`): the first owner besides the home,
//! in map order, that has not been out of reach for the takeover time, once it has the
//! routes of every other node in reach. Every owner picks the same one however its links
//! came up (after a power cut of the whole cluster they connect in any order); the others
//! drop their copies once it is up.
//!
//! When a link comes up, its node sends the owners the wills of its live connections
//! again (an owner that lost its disk has none). At a map change the home copies its wills to
//! the current owners, and owners drop the copies of partitions they lost. A new owner may
//! get the home's copy before the new map reaches it: it refuses it then, but keeps it a
//! while, and takes it in if its next map makes it an owner.
//!
//! A home that was only cut off or paused keeps its connections meanwhile: the owner that
//! published a will tells it so when their link comes up (`WillFired`), and the home closes
//! that connection (0x8E) without publishing the will again; the client reconnects as it
//! would after a takeover. (What an owner has yet to tell such a home is in its store too,
//! record `p`, so an owner restarted meanwhile still tells it.) A connection of such a home
//! that ends while it is out of touch with a node (a link down and that node not gone for
//! the takeover time, or a second after the home was frozen: its clients' sockets close as
//! it resumes, before it sees its links were closed) keeps its will until the home is in
//! touch with every node again: another node may have published it meanwhile (an owner, or
//! the node a claim of the client came to), and says so first when the links come up
//! (`WillFired`, or a newer version of a persistent session that fences this one). Only
//! then does the home publish the wills it kept.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::cluster::PeerId;
use super::cluster_replicas::THIS_NODE;
use super::cluster_sessions::FOUND_DOWN_MS;
use super::state::{SessionId, BROKER_ORIGIN};
use super::{ConnId, Engine};
use crate::cluster::batch::Stamp;
use crate::codec::LastWill;
use crate::store::{envelope, records};

/// What an owner does with the will of an ended connection (`will_duty`).
enum Duty {
    Publish,
    /// Another owner publishes it.
    Drop,
    /// The owner that publishes it is out of reach, for less than the takeover time.
    Wait,
}

/// A will held here for a connection on another node.
struct HeldWill {
    /// The key of the node that holds the connection.
    home: u64,
    /// The home's incarnation that sent the copy (its batches' epoch).
    epoch: u64,
    stamp: Stamp,
    will: LastWill,
    /// The connection is known to have ended (its home restarted, or its client connected
    /// elsewhere while the home was down); whether that home may still think it holds it.
    ended: Option<bool>,
    /// A record of this client's copy is in the store (perhaps of an older version).
    stored: bool,
}

#[derive(Default)]
pub(super) struct Wills {
    /// Connections here whose wills are copied to the owners, by session: their versions.
    out: HashMap<SessionId, Stamp>,
    /// Copies held for connections on other nodes, by client id.
    held: HashMap<Arc<str>, HeldWill>,
    /// Copies replaced by a newer connection's from another node before their own
    /// connection was known to end: its home may have died just then (its link not yet
    /// seen down), and then nobody else has its will. Kept, in memory, until that home says
    /// the connection ended (`WillGone`), or is found dead or restarted, as `held`.
    superseded: Vec<(Arc<str>, HeldWill)>,
    /// Copies refused because this node did not own their partition, for `REFUSED_KEEP_MS`
    /// (until when): the home may have sent them under a newer map than this node's. Taken
    /// in if the next map here makes this node an owner (the home sends nothing again).
    refused: Vec<(Arc<str>, HeldWill, u64)>,
    /// Wills this node published for connections on nodes out of its reach, to tell those
    /// nodes when their links come up (home key, client id, version; one per client id, in
    /// the store too).
    fired: Vec<(u64, Arc<str>, Stamp)>,
    /// Some copies wait for the owner that publishes them (`Duty::Wait`), or the map
    /// changed: `settle_wills` looks through them at the next tick.
    sweep: bool,
    /// Copies to write to the store once they have lived `STORE_AFTER_MS` (client id,
    /// version, when), oldest first.
    to_store: VecDeque<(Arc<str>, Stamp, u64)>,
    /// Wills of this node's connections (sessions of expiry 0) that ended while it was out
    /// of touch (client id, version, will): published once it is in touch again, unless
    /// an owner says it published them (`WillFired`).
    kept: Vec<(Arc<str>, Stamp, LastWill)>,
    /// When `wills_tick` last ran, to tell that this node was frozen (SIGSTOP, a stalled
    /// VM): no will of its own goes out until `thawed_until`.
    last_tick: u64,
    thawed_until: u64,
    pub(super) stats: WillStats,
}

/// How long a copy lives before it is written to the store: a connection that ends sooner
/// (a device that connects, publishes and goes) costs the owners no store write, and one
/// that lives on is written with the others of its tick. A power cut of the whole cluster
/// within that time of a connect loses that connection's will, as it would on one node.
const STORE_AFTER_MS: u64 = 1_000;

/// Published wills remembered at most until their nodes are back (a node gone for good is
/// never back: past this, the oldest are forgotten).
const FIRED_MAX: usize = 1 << 16;

/// Replaced copies kept at most (a flood of reconnects elsewhere while homes look up).
const SUPERSEDED_MAX: usize = 1 << 16;

/// How long a copy refused for a partition this node does not own is kept in case the
/// next map makes it an owner (maps reach the nodes within a heartbeat or two), and how
/// many at most.
const REFUSED_KEEP_MS: u64 = 10_000;
const REFUSED_MAX: usize = 1 << 12;

#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub struct WillStats {
    /// Wills of other nodes' connections held here.
    pub held: u64,
    /// Wills of other nodes' connections this node published (their node died).
    pub published: u64,
    /// Will copies refused: for a partition this node does not own, or unreadable.
    pub refused: u64,
}

impl Engine {
    /// Connection `conn` of session `sid` became live: if it has a will and the session
    /// ends with it, the other owners of its partition get a copy.
    pub(super) fn copy_will(&mut self, sid: SessionId, conn: ConnId, now: u64) {
        let Some(session) = self.session(sid) else {
            return;
        };
        if session.expiry != 0 || self.cluster.epoch_of() == 0 {
            return;
        }
        let client = session.client_id.clone();
        let will = self.conn(conn).and_then(|c| c.will.as_deref());
        let Some(body) = will.map(records::encode_will) else {
            return;
        };
        let stamp = self.cluster.retained.next(self.wall(now));
        self.wills.out.insert(sid, stamp);
        for peer in self.replicas.other_owners(&client) {
            self.cluster.queue_will_copy(peer, &client, stamp, &body);
        }
    }

    /// Whether a will of this node's connections must wait instead of going out now:
    /// another node may have published it while this one was out of touch (see the
    /// module's comment).
    pub(super) fn wills_wait(&mut self, now: u64) -> bool {
        let after = self.cfg.cluster_takeover_ms;
        if after == 0 || !self.replicas.has_map() {
            return false;
        }
        if now < self.out_of_touch_until {
            // Its store failing (and its data links closed by it), or just back from that
            // or a pause: an owner may publish the will meanwhile (the client gone
            // elsewhere), and tells it once their link is back.
            return true;
        }
        self.note_thaw(now);
        if now < self.wills.thawed_until {
            return true;
        }
        let gone = self.cluster.down_longer_than(after, now);
        !self.cluster.routes_known(&gone, None)
    }

    /// Ticks come every 100 ms: a gap far longer means the process was frozen, and the
    /// links' ends (their peers closed them meanwhile) may not have been seen yet.
    fn note_thaw(&mut self, now: u64) {
        let last = self.wills.last_tick;
        let gap = (self.cfg.cluster_takeover_ms / 2).max(FOUND_DOWN_MS);
        if last != 0 && now.saturating_sub(last) > gap {
            self.wills.thawed_until = self.wills.thawed_until.max(now + FOUND_DOWN_MS);
        }
    }

    /// Connection `sid`'s will is due while this node is out of touch: if the session ends
    /// with it and its will is copied to the owners, it is kept here (no `WillGone`: the
    /// owners keep their copies). True if kept.
    pub(super) fn keep_will(&mut self, sid: SessionId, will: &LastWill) -> bool {
        let Some(&stamp) = self.wills.out.get(&sid) else {
            return false;
        };
        let Some(client) = self.session(sid).map(|s| s.client_id.clone()) else {
            return false;
        };
        self.wills.out.remove(&sid);
        self.wills.kept.push((client, stamp, will.clone()));
        true
    }

    /// In touch again: the kept wills nobody else published go out, and the owners drop
    /// their copies.
    fn publish_kept_wills(&mut self, now: u64) {
        for (client, stamp, will) in std::mem::take(&mut self.wills.kept) {
            self.publish_will(will, BROKER_ORIGIN, now);
            self.tell_owners_gone(&client, stamp);
        }
    }

    /// The connection of session `sid` ended (its will published here or discarded).
    pub(super) fn will_ended(&mut self, sid: SessionId) {
        if self.wills.out.is_empty() {
            return;
        }
        let Some(stamp) = self.wills.out.remove(&sid) else {
            return;
        };
        let Some(client) = self.session(sid).map(|s| s.client_id.clone()) else {
            return;
        };
        self.tell_owners_gone(&client, stamp);
    }

    /// The other owners drop their copies of `client`'s connection of version `stamp`.
    fn tell_owners_gone(&mut self, client: &str, stamp: Stamp) {
        for peer in self.replicas.other_owners(client) {
            self.cluster.queue_will_gone(peer, client, stamp);
        }
    }

    /// The wills of this node's connections, to the owners of their partitions (at a map
    /// change), or to `peer` only (its link came up).
    pub(super) fn send_wills(&mut self, only: Option<PeerId>) {
        if self.wills.out.is_empty() {
            return;
        }
        let out: Vec<(SessionId, Stamp)> = self.wills.out.iter().map(|(&s, &t)| (s, t)).collect();
        for (sid, stamp) in out {
            let Some(conn) = self.session(sid).and_then(|s| s.conn) else {
                continue;
            };
            let Some(will) = self.conn(conn).and_then(|c| c.will.as_deref()) else {
                continue;
            };
            let body = records::encode_will(will);
            let client = self.session(sid).expect("checked").client_id.clone();
            for peer in self.replicas.other_owners(&client) {
                if only.is_none_or(|p| p == peer) {
                    self.cluster.queue_will_copy(peer, &client, stamp, &body);
                }
            }
        }
    }

    /// Peer `peer`'s link came up: it gets the wills of our connections it owns, and those
    /// this node published for it meanwhile. (What it held here stays: the connections
    /// that ended meanwhile say so in its reliable batches, sent again; if it restarted,
    /// its first batch of the new incarnation says that, `wills_home_restarted`.)
    pub(super) fn wills_link_up(&mut self, peer: PeerId) {
        let key = self.cluster.peer_key(peer);
        self.send_wills(Some(peer));
        // Wills of its connections known to have ended (a claim came while it was down)
        // that wait to go out here: it learns now that this node publishes them, before it
        // is in touch enough to publish them itself.
        let after = self.cfg.cluster_takeover_ms;
        let gone = self.cluster.down_longer_than(after, self.last_now);
        let ours: Vec<(Arc<str>, Stamp)> = self
            .wills
            .held
            .iter()
            .filter(|(c, w)| {
                w.home == key
                    && w.ended == Some(true)
                    && matches!(self.will_duty(c, Some(peer), &gone), Duty::Publish)
            })
            .map(|(c, w)| (c.clone(), w.stamp))
            .collect();
        for (client, stamp) in ours {
            if let Some(w) = self.wills.held.get_mut(&client) {
                w.ended = Some(false);
            }
            self.cluster.queue_will_fired(peer, &client, stamp);
        }
        if self.wills.fired.iter().any(|f| f.0 == key) {
            let fired = std::mem::take(&mut self.wills.fired);
            for (home, client, stamp) in fired {
                if home == key {
                    self.cluster.queue_will_fired(peer, &client, stamp);
                    self.unstore_fired(&client);
                } else {
                    self.wills.fired.push((home, client, stamp));
                }
            }
        }
    }

    /// An owner published the will of our connection `client_id` (version `stamp`) while
    /// this node was out of its reach: that connection ends here, without the will.
    pub(super) fn will_fired_received(&mut self, client_id: &str, stamp: Stamp, now: u64) {
        self.wills
            .kept
            .retain(|(client, s, _)| !(&**client == client_id && *s == stamp));
        let Some(&sid) = self.by_client.get(client_id) else {
            return;
        };
        if self.wills.out.get(&sid) != Some(&stamp) {
            // That connection ended meanwhile (its will went with it, or was discarded).
            return;
        }
        // Closed below, it tells the owners it ended (`WillGone`), as any end does.
        let Some(conn) = self.session(sid).and_then(|s| s.conn) else {
            return;
        };
        self.close_for_another_node(
            conn,
            "its will was published by another node while this one was out of reach",
            now,
        );
    }

    /// After a map change: copies of partitions this node no longer owns go, those it
    /// refused lately and owns now come in, and the owners get the wills of this node's
    /// connections.
    pub(super) fn wills_map_changed(&mut self, now: u64) {
        let lost: Vec<Arc<str>> = self
            .wills
            .held
            .keys()
            .filter(|client| !self.replicas.is_owner(client))
            .cloned()
            .collect();
        for client in lost {
            self.take_held(&client);
        }
        let mut superseded = std::mem::take(&mut self.wills.superseded);
        superseded.retain(|(client, _)| self.replicas.is_owner(client));
        self.wills.superseded = superseded;
        // Copies the home sent under this map before it reached this node.
        for (client, w, until) in std::mem::take(&mut self.wills.refused) {
            if until <= now || !self.replicas.is_owner(&client) {
                continue;
            }
            if self
                .wills
                .held
                .get(&client)
                .is_some_and(|h| h.stamp >= w.stamp)
            {
                continue;
            }
            self.hold_copy(client, w, now);
        }
        // Homes no longer in the map are dead, and who publishes may have changed.
        self.wills.sweep = true;
        self.send_wills(None);
    }

    /// Takes the will held for `client_id` out (and out of the store).
    fn take_held(&mut self, client_id: &str) -> Option<HeldWill> {
        let w = self.wills.held.remove(client_id)?;
        if w.stored {
            self.store_ops
                .push((records::will_copy_key(client_id), None));
        }
        Some(w)
    }

    /// Writes the copies that have lived `STORE_AFTER_MS` to the store.
    fn store_due_wills(&mut self, now: u64) {
        while let Some((_, _, due)) = self.wills.to_store.front() {
            if *due > now {
                return;
            }
            let (client, stamp, _) = self.wills.to_store.pop_front().expect("checked");
            if let Some(w) = self.wills.held.get_mut(&client) {
                if w.stamp == stamp && !w.stored {
                    w.stored = true;
                    let (home, epoch) = (w.home, w.epoch);
                    let body = records::encode_will(&w.will);
                    self.store_will_copy(&client, home, epoch, stamp, &body);
                }
            }
        }
    }

    fn store_will_copy(
        &mut self,
        client_id: &str,
        home: u64,
        epoch: u64,
        stamp: Stamp,
        will: &[u8],
    ) {
        let key = records::will_copy_key(client_id);
        let record = records::encode_will_copy(home, epoch, stamp, will);
        let value = envelope::seal(&key, &record, self.cfg.compress_above);
        self.store_ops.push((key, Some(value)));
    }

    fn unstore_fired(&mut self, client_id: &str) {
        if self.cfg.durable {
            self.store_ops
                .push((records::will_fired_key(client_id), None));
        }
    }

    /// A will this node published for a node out of its reach, read back at start-up: that
    /// node is told when their link comes up.
    pub(super) fn restore_will_fired(&mut self, client: String, body: &[u8]) -> Result<(), String> {
        let (home, stamp) = records::decode_will_fired(body).map_err(|e| e.to_string())?;
        self.wills.fired.push((home, Arc::from(client), stamp));
        Ok(())
    }

    /// A will copy read back from the store at start-up.
    pub(super) fn restore_will_copy(&mut self, client: String, body: &[u8]) -> Result<(), String> {
        let r = records::decode_will_copy(body).map_err(|e| e.to_string())?;
        self.wills.held.insert(
            Arc::from(client),
            HeldWill {
                home: r.home,
                epoch: r.epoch,
                stamp: r.stamp,
                will: r.will,
                ended: None,
                stored: true,
            },
        );
        Ok(())
    }

    /// Peer `peer` holds connection `client_id` (version `stamp`) with this will.
    /// (`epoch`: the incarnation of the peer whose batch brought it.)
    pub(super) fn will_copy_received(
        &mut self,
        peer: PeerId,
        epoch: u64,
        client_id: &str,
        stamp: Stamp,
        body: &[u8],
        now: u64,
    ) {
        let owner = self.replicas.is_owner(client_id);
        let will = match records::decode_will(body) {
            Ok(will) => will,
            Err(e) => {
                self.wills.stats.refused += 1;
                self.event(
                    "will_copy_refused",
                    Arc::from(client_id),
                    format!("unreadable will: {}", e.0),
                );
                return;
            }
        };
        let home = self.cluster.peer_key(peer);
        if !owner {
            self.wills.stats.refused += 1;
            self.event(
                "will_copy_refused",
                Arc::from(client_id),
                "a will copy for a partition this node does not own".into(),
            );
            let refused = &mut self.wills.refused;
            refused.retain(|(c, w, until)| {
                *until > now && !(&**c == client_id && w.home == home && w.stamp <= stamp)
            });
            if refused.len() < REFUSED_MAX {
                let w = HeldWill {
                    home,
                    epoch,
                    stamp,
                    will,
                    ended: None,
                    stored: false,
                };
                refused.push((Arc::from(client_id), w, now + REFUSED_KEEP_MS));
            }
            return;
        }
        match self.wills.held.get(client_id) {
            Some(w) if w.stamp > stamp => return,
            // The connection it was for ended, and its will waits to go: it goes (or is
            // left to the owner that publishes it) before the new connection's replaces it.
            Some(w) if w.ended.is_some() => self.settle_wills(Some(client_id), true, now),
            _ => {}
        }
        let w = HeldWill {
            home,
            epoch,
            stamp,
            will,
            ended: None,
            stored: false,
        };
        self.hold_copy(Arc::from(client_id), w, now);
    }

    /// Holds copy `w` of `client`'s will. A record of an older version is replaced at
    /// once; a new copy is written once it has lived a while. A copy from another home it
    /// replaces is kept as superseded.
    fn hold_copy(&mut self, client: Arc<str>, mut w: HeldWill, now: u64) {
        w.stored = self.wills.held.get(&client).is_some_and(|h| h.stored);
        if w.stored {
            let body = records::encode_will(&w.will);
            self.store_will_copy(&client, w.home, w.epoch, w.stamp, &body);
        } else if self.cfg.durable {
            let due = now + STORE_AFTER_MS;
            self.wills
                .to_store
                .push_back((client.clone(), w.stamp, due));
        }
        let home = w.home;
        let old = self.wills.held.insert(client.clone(), w);
        // (From the same home, its end was said first: `WillGone` comes before the copy.)
        if let Some(old) = old.filter(|o| o.home != home && o.ended.is_none()) {
            if self.wills.superseded.len() < SUPERSEDED_MAX {
                self.wills.superseded.push((client, old));
            }
        }
    }

    /// The connection of `client_id` with version `stamp` ended on peer `peer`.
    pub(super) fn will_gone_received(&mut self, peer: PeerId, client_id: &str, stamp: Stamp) {
        let home = self.cluster.peer_key(peer);
        if self
            .wills
            .held
            .get(client_id)
            .is_some_and(|w| w.home == home && w.stamp <= stamp)
        {
            self.take_held(client_id);
        }
        self.wills
            .superseded
            .retain(|(c, w)| !(&**c == client_id && w.home == home && w.stamp <= stamp));
        self.wills
            .refused
            .retain(|(c, w, _)| !(&**c == client_id && w.home == home && w.stamp <= stamp));
    }

    /// A claim for `client_id` (a peer's, or this node's own): if the connection whose will
    /// is held here is on a node that is down, its will is published now by the owner whose
    /// duty it is (`will_duty`), and the copies go.
    pub(super) fn will_on_claim(&mut self, client_id: &str, now: u64) {
        if self.wills.held.is_empty() {
            return;
        }
        let Some(w) = self.wills.held.get_mut(client_id) else {
            return;
        };
        let home = self.cluster.peer_by_key(w.home);
        if home.is_some_and(|h| self.cluster.peer_up(h)) {
            // The home serves the claim: it ends the connection and says so.
            return;
        }
        // The home may only be cut off: it learns of it when its link comes up.
        w.ended = Some(true);
        self.settle_wills(Some(client_id), false, now);
    }

    /// Peer `peer`'s reliable batches now come from incarnation `epoch`: it restarted, and
    /// the connections of the one before died with it. Their wills are published now (by
    /// the owner whose duty it is), as after the takeover time. Reliable batches of one link
    /// come in incarnation order (a restarted node's kept batches are acknowledged before
    /// its new ones go), so a copy from an older incarnation does not arrive after this.
    pub(super) fn wills_home_restarted(&mut self, peer: PeerId, epoch: u64, now: u64) {
        if self.wills.held.is_empty() {
            return;
        }
        let key = self.cluster.peer_key(peer);
        let mut any = false;
        let superseded = self.wills.superseded.iter_mut().map(|(_, w)| w);
        for w in self.wills.held.values_mut().chain(superseded) {
            if w.home == key && w.epoch != epoch {
                // Its new incarnation does not have that connection: nothing to tell it.
                w.ended = Some(false);
                any = true;
            }
        }
        if any {
            self.wills.sweep = true;
            self.settle_wills(None, false, now);
        }
    }

    /// Publishes the wills held for connections on nodes down for the takeover time, or
    /// known to have ended, whose publication is this node's duty; drops those another
    /// owner publishes.
    pub(super) fn wills_tick(&mut self, now: u64) {
        self.note_thaw(now);
        self.wills.last_tick = now;
        if !self.wills.to_store.is_empty() {
            self.store_due_wills(now);
        }
        if !self.wills.kept.is_empty() && !self.wills_wait(now) {
            self.publish_kept_wills(now);
        }
        let after = self.cfg.cluster_takeover_ms;
        // Copies read back at start-up wait for the map: until then no node is a peer.
        if after == 0 || !self.replicas.has_map() {
            return;
        }
        if !self.wills.held.is_empty() {
            self.settle_wills(None, false, now);
        }
        if !self.wills.superseded.is_empty() {
            self.settle_superseded(now);
        }
    }

    /// `settle_wills` for the superseded copies: those whose home is dead (or restarted)
    /// are published here or dropped, as the duty says.
    fn settle_superseded(&mut self, now: u64) {
        let after = self.cfg.cluster_takeover_ms;
        let gone = self.cluster.down_longer_than(after, now);
        // A home the control plane still hears serves its connections on.
        let dead_homes = self.cluster.dead_longer_than(after, now);
        let mut keep = Vec::new();
        for (client, w) in std::mem::take(&mut self.wills.superseded) {
            let home = self.cluster.peer_by_key(w.home);
            let dead = w.ended.is_some() || home.is_none_or(|h| dead_homes.contains(&h));
            let duty = match self.will_duty(&client, home, &gone) {
                _ if !dead => Duty::Wait,
                Duty::Publish if !self.may_publish_held(&gone, home, now) => Duty::Wait,
                duty => duty,
            };
            match duty {
                Duty::Publish => self.publish_held_will(&client, w, true, now),
                Duty::Drop => {}
                Duty::Wait => keep.push((client, w)),
            }
        }
        self.wills.superseded = keep;
    }

    /// Whether this node, whose duty a held will is, may publish it now: once it has the
    /// routes of every node in reach (one that just started would miss the subscribers of
    /// nodes whose links still connect), has installed the dead homes' sessions it takes
    /// over (whose subscriptions may match), and is in touch itself (its peers only look
    /// dead to a node whose store fails or that was paused: the duty may be theirs), and
    /// has not stepped aside in a partial split (its peers are alive, and so are their
    /// connections: `cluster_step_aside`).
    fn may_publish_held(&self, gone: &[PeerId], home: Option<PeerId>, now: u64) -> bool {
        !self.taking_over()
            && now >= self.out_of_touch_until
            && !self.aside(now)
            && self.cluster.routes_known(gone, home)
    }

    /// Acts on the held wills whose connections ended (`only`: that client's alone): each
    /// is published here, dropped, or kept a while longer (`will_duty`).
    /// (`replaced`: `only`'s copy is about to be replaced by a newer connection's: acted on
    /// at once.)
    fn settle_wills(&mut self, only: Option<&str>, replaced: bool, now: u64) {
        let after = self.cfg.cluster_takeover_ms;
        let gone = self.cluster.down_longer_than(after, now);
        if only.is_none() && gone.is_empty() && !self.wills.sweep {
            return;
        }
        // A home the control plane still hears serves its connections on.
        let dead = self.cluster.dead_longer_than(after, now);
        let gone_keys: Vec<u64> = dead.iter().map(|&p| self.cluster.peer_key(p)).collect();
        // (client id, whether its home may still hold the connection) of each ended one.
        let ended = |(c, w): (&Arc<str>, &HeldWill)| {
            // A home that left the cluster (no longer a peer) is dead too.
            let dead = gone_keys.contains(&w.home) || self.cluster.peer_by_key(w.home).is_none();
            match w.ended {
                Some(tell) => Some((c.clone(), tell)),
                None if dead => Some((c.clone(), true)),
                None => None,
            }
        };
        let due: Vec<(Arc<str>, bool)> = match only {
            Some(client) => self
                .wills
                .held
                .get_key_value(client)
                .and_then(ended)
                .into_iter()
                .collect(),
            None => self.wills.held.iter().filter_map(ended).collect(),
        };
        let mut waiting = false;
        for (client, tell_home) in due {
            let home = self.wills.held[&client].home;
            let home = self.cluster.peer_by_key(home);
            let duty = match self.will_duty(&client, home, &gone) {
                // Unless the copy is about to be replaced.
                Duty::Publish if !replaced && !self.may_publish_held(&gone, home, now) => {
                    Duty::Wait
                }
                // That owner holds a copy of its own.
                Duty::Wait if replaced => Duty::Drop,
                duty => duty,
            };
            match duty {
                Duty::Publish => {
                    let w = self.take_held(&client).expect("listed");
                    self.publish_held_will(&client, w, tell_home, now);
                }
                Duty::Drop => {
                    self.take_held(&client);
                }
                Duty::Wait => waiting = true,
            }
        }
        if only.is_none() {
            self.wills.sweep = waiting;
        } else {
            self.wills.sweep |= waiting;
        }
    }

    /// Who publishes the will of `client_id`'s ended connection on `home`: the first owner
    /// of its partition besides `home`, in map order, that has not been out of reach for
    /// the takeover time (`gone`). Every owner picks the same one however its links came up
    /// (a restarted cluster's links connect in any order); it holds a copy of its own.
    fn will_duty(&self, client_id: &str, home: Option<PeerId>, gone: &[PeerId]) -> Duty {
        let first = self
            .replicas
            .owners_of(client_id)
            .into_iter()
            .filter(|&p| Some(p) != home)
            .find(|&p| p == THIS_NODE || !gone.contains(&p));
        match first {
            Some(THIS_NODE) => Duty::Publish,
            // Out of reach for less than the takeover time: it may be connecting still.
            Some(p) if !self.cluster.peer_up(p) => Duty::Wait,
            _ => Duty::Drop,
        }
    }

    /// Publishes will `w` of a connection on another node (`tell_home`: that node may still
    /// hold the connection, and learns of it when its link comes up).
    fn publish_held_will(&mut self, client_id: &str, w: HeldWill, tell_home: bool, now: u64) {
        self.wills.stats.published += 1;
        let client: Arc<str> = Arc::from(client_id);
        self.event(
            "will_published_for_dead_node",
            client.clone(),
            format!(
                "the will of a connection on a dead node, on {}",
                w.will.topic
            ),
        );
        let home_up = self
            .cluster
            .peer_by_key(w.home)
            .filter(|&p| self.cluster.peer_up(p));
        if let (true, Some(home)) = (tell_home, home_up) {
            // Its link is up again already: told now, not at the next link-up.
            self.cluster.queue_will_fired(home, &client, w.stamp);
        } else if tell_home {
            // One per client id (its newest), as its store record.
            self.wills.fired.retain(|f| f.1 != client);
            if self.wills.fired.len() >= FIRED_MAX {
                let oldest = self.wills.fired.remove(0);
                self.unstore_fired(&oldest.1);
            }
            if self.cfg.durable {
                // On disk: an owner restarted before the home is back still tells it.
                let key = records::will_fired_key(client_id);
                let record = records::encode_will_fired(w.home, w.stamp);
                let value = envelope::seal(&key, &record, self.cfg.compress_above);
                self.store_ops.push((key, Some(value)));
            }
            self.wills.fired.push((w.home, client, w.stamp));
        }
        self.publish_will(w.will, BROKER_ORIGIN, now);
    }

    pub fn will_stats(&self) -> WillStats {
        WillStats {
            held: (self.wills.held.len() + self.wills.superseded.len()) as u64,
            ..self.wills.stats
        }
    }
}
