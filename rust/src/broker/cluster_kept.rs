//! Messages kept for a dead home reach its sessions where they live now (issue 16).
//!
//! A node keeps what it routes to a peer whose link is down in that peer's queue (stored:
//! `cluster`), and acknowledges its publisher with that as one of the copies. If the peer
//! is dead and one of its sessions is installed on another node from a copy, those messages
//! would reach the session only once the dead home came back and sent them on (after newer
//! ones), or never. So the node that installs such a session asks every reachable node of
//! protocol 7 for what it keeps for the dead home that matches the session's
//! subscriptions (`KeptAsk`, queued after its route rows for them on the same links: what a
//! node publishes after answering comes straight to the new home), and looks through its
//! own queue for that home too. A batch written to the home's link before it died may have
//! been applied there: the home tells the owners it copies to how far it applied each
//! node's batches (`Applied`, after the copies they made), a claim answer read from a copy
//! carries those marks, and a written batch past its mark is handed on, one within it not,
//! and of one no mark covers only the QoS 1 deliveries (owners keep the marks in their store
//! too). A batch the home acknowledged stays here until it says the batch's copies are
//! acknowledged (`Safe`; `Peer::uncopied`): one it applied but could not copy (cut off from
//! the owner in a partial split) is handed on as well, not left to come with the home's
//! hand-over at the heal, behind newer messages. The answers are `SessionMessage`s
//! marked kept. The session takes each id once, and remembers the ids of everything that
//! reaches it (kept or straight: a publisher's node still sends to the dead home's queue
//! too, while its rows are there) until its old home has been back for
//! `RECENT_MS`: a home that comes back gets the same messages from its queues and sends
//! them on to the session (`give_up`). A session that moves on from here meanwhile takes
//! the kept ids, the home and the marks with it (`KeptState`, protocol 8), and the next node
//! asks every node again: some may have been out of this one's reach.
//!
//! Batches of a down peer past `cluster_outbox_memory` live only in the store: they are read
//! back and looked through after those in memory (`cluster_kept_store`).
//!
//! **A home still up for the node asked.** The two ends of a silence find it moments
//! apart: a node asked about a home it has not found down yet holds the ask until it has
//! (then answers: what it wrote to that home's link as the silence began is kept for it),
//! or until `KEPT_WAIT_MS` passed (then ends it with nothing: a home up gets its queue).
//!
//! **Order.** A node asked may have sent the new home newer messages for the session's
//! filters before it got the ask (the new home had a route for them already, for another
//! session): they would reach the client before the older kept ones. So an asked node of
//! protocol 12 ends its answer (`KeptEnd`, after the kept messages in memory), and until
//! every asked node's answer has ended (at most `KEPT_WAIT_MS`; a node whose link goes down
//! answers no more), the session sends nothing new to its client: what arrives is queued
//! (stored and copied as any queued message), and before sending, the queue's messages of
//! each publishing node are put back in that node's order (their ids), in the places they
//! hold.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::cluster::{message_from_wire, KeptBatch, PeerId};
use super::cluster_kept_store::{Asker, Search};
use super::cluster_sessions::RECENT_MS;
use super::state::{Delivery, Message, SessionId};
use super::Engine;
use crate::cluster::batch::{self, Batch, Item, KeptSub, Mark, Stamp, WireMessage};
use crate::codec::QoS;
use crate::store::records;
use crate::topics;

/// The first inter-node protocol that asks for and answers with kept messages.
const KEPT_PROTOCOL: u16 = 7;
/// The first that ends its answer (`KeptEnd`).
pub(super) const KEPT_END_PROTOCOL: u16 = 12;
/// How long a session waits at most for an asked node's answer to end: a node that stays
/// up but silent (overloaded) does not stall the session for longer.
pub(super) const KEPT_WAIT_MS: u64 = 2_000;
/// Kept ids a session remembers at most (16 bytes each).
pub(super) const KEPT_MAX: usize = 1 << 20;
/// The first that tells a peer what a session's version took (`TakenIds`).
pub(super) const TAKEN_IDS_PROTOCOL: u16 = 13;
/// The first whose relays tell the new home that what lagging peers sent them is in
/// (`KeptEnd`, broker::cluster_sessions).
pub(super) const RELAY_CAUGHT_UP_PROTOCOL: u16 = 13;
/// The first that tells, of a session message it passes on to where the session went next,
/// the node it came from (`SessionMessage::origin`): a version's hand-over passed on by a
/// node the newer version moved on from is told from what that version took.
pub(super) const HANDED_ON_PROTOCOL: u16 = 15;
/// Ids told (and remembered) per session at most.
pub(super) const TAKEN_IDS_MAX: usize = 1 << 16;

/// A message kept for a dead home, as the session asking gets it.
pub(super) type KeptDelivery = (Arc<Message>, QoS, bool, Vec<u32>);

impl Engine {
    /// Session `sid` was just installed here from records its home (node key `home`) made:
    /// if that node is down, what this node and the reachable ones keep for it and the
    /// session's subscriptions match comes to the session.
    pub(super) fn ask_kept(&mut self, sid: SessionId, home: u64, marks: &[Mark], now: u64) {
        let Some(dead) = self.cluster.peer_by_key(home) else {
            return;
        };
        if self.cluster.peer_up(dead) {
            // A live hand-over: the home relays what reaches it.
            return;
        }
        let Some((client, owned)) = self.plain_subs(sid) else {
            return;
        };
        let subs = kept_subs(&owned);
        if let Some(s) = self.session_mut(sid) {
            // What its records hold, the dead home (back) would send on too.
            let held = s.inflight.iter().map(|f| f.delivery.msg.id);
            let held: Vec<u128> = held.chain(s.queue.iter().map(|d| d.msg.id)).collect();
            let recent = s.recent.get_or_insert_with(Default::default);
            recent.kept_from = home;
            recent.kept_until = 0;
            recent.kept_marks = marks.to_vec();
            let room = KEPT_MAX.saturating_sub(recent.kept.len());
            recent
                .kept
                .extend(held.into_iter().filter(|&id| id != 0).take(room));
        }
        let mut waits = Vec::new();
        for peer in self.cluster.up_peers_from(KEPT_PROTOCOL) {
            let applied = applied_for(marks, self.cluster.peer_key(peer));
            self.cluster
                .queue_kept_ask(peer, &client, home, false, applied, &subs);
            if self.cluster.peer_protocol(peer) >= KEPT_END_PROTOCOL {
                waits.push(self.cluster.peer_key(peer));
            }
        }
        self.wait_for_kept(sid, &waits, now);
        let own = super::cluster_retained::node_key(&self.cluster.name);
        let applied = applied_for(marks, own);
        let (kept, spilled) = self.kept_matching(dead, &client, &subs, None, applied, now);
        self.deliver_kept(sid, kept, now);
        if !spilled.is_empty() {
            let search = Search::new(Asker::Here(home), client, owned, None, applied);
            self.search_store(dead, search, spilled);
        }
    }

    /// Peer `peer`'s link went down: the sessions that moved here from it while it was up,
    /// and for which it may still relay, ask for what the reachable nodes (and this one)
    /// keep for it, as a session installed from its copy does. In a partial split (the old
    /// home cut off from a publishing node that still reaches this one, until one of the
    /// two steps aside) that node wrote the session's older messages to the old home's
    /// silent link and sends the newer ones here: without the ask they would come only
    /// once the cut heals, through the old home, after the newer (docs/chaos.md). No
    /// applied marks: of what was written to the old home's link only QoS 1 is handed on
    /// (it may have been applied there and sent on already).
    pub(super) fn ask_kept_for_relaying_home(&mut self, peer: PeerId, now: u64) {
        let key = self.cluster.peer_key(peer);
        let moved: Vec<SessionId> = self
            .by_client
            .values()
            .copied()
            .filter(|&sid| {
                self.session(sid)
                    .and_then(|s| s.recent.as_ref())
                    .is_some_and(|r| {
                        r.relayed_by == key && now < r.relayed_until && r.kept_from == 0
                    })
            })
            .collect();
        for sid in moved {
            self.claims.stats.moved_home_lost += 1;
            self.ask_kept(sid, key, &[], now);
        }
    }

    /// Messages kept for a dead home, to its session `sid` here: each id once.
    pub(super) fn deliver_kept(&mut self, sid: SessionId, kept: Vec<KeptDelivery>, now: u64) {
        for (msg, qos, retain, sub_ids) in kept {
            let id = msg.id;
            self.deliver(sid, &msg, qos, retain, sub_ids, now);
            self.note_kept(sid, id);
        }
    }

    /// Peer `peer`'s link came up: the sessions here whose dead home is still down ask it
    /// (it may have kept messages for that home while it could not reach this node). What
    /// they got already they take only once.
    pub(super) fn ask_kept_on_link_up(&mut self, peer: PeerId, now: u64) {
        if self.cluster.peer_protocol(peer) < KEPT_PROTOCOL {
            return;
        }
        let mut asks = Vec::new();
        let key = self.cluster.peer_key(peer);
        for &sid in self.by_client.values() {
            let (home, applied) = self
                .session(sid)
                .and_then(|s| s.recent.as_ref())
                .map_or((0, None), |r| {
                    (r.kept_from, applied_for(&r.kept_marks, key))
                });
            let down = self
                .cluster
                .peer_by_key(home)
                .is_some_and(|h| h != peer && !self.cluster.peer_up(h));
            if home != 0 && down {
                asks.push((sid, home, applied));
            }
        }
        let ends = self.cluster.peer_protocol(peer) >= KEPT_END_PROTOCOL;
        for (sid, home, applied) in asks {
            if let Some((client, owned)) = self.plain_subs(sid) {
                let subs = kept_subs(&owned);
                self.cluster
                    .queue_kept_ask(peer, &client, home, true, applied, &subs);
                if ends {
                    self.wait_for_kept(sid, &[key], now);
                }
            }
        }
    }

    /// Session `sid` sends nothing new to its client until the nodes with `keys`, asked for
    /// what they kept for its dead home (or holding another version of it), have answered
    /// (or `KEPT_WAIT_MS` passed).
    fn wait_for_kept(&mut self, sid: SessionId, keys: &[u64], now: u64) {
        if keys.is_empty() {
            return;
        }
        let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) else {
            return;
        };
        for &key in keys {
            recent.kept_waits.retain(|&(k, _)| k != key);
            recent.kept_waits.push((key, now + KEPT_WAIT_MS));
        }
        if !self.claims.kept_holds.contains(&sid) {
            self.claims.kept_holds.push(sid);
        }
    }

    /// Peer `peer`'s answer to the ask for what it kept for `client_id`'s dead home ended
    /// (or what a version there that gave way handed over), or the node with key `origin`'s,
    /// passed on by `peer`, which the session left.
    pub(super) fn kept_end_received(
        &mut self,
        (peer, origin): (PeerId, u64),
        client_id: &str,
        now: u64,
    ) {
        let key = if origin != 0 {
            origin
        } else {
            self.cluster.peer_key(peer)
        };
        let Some(&sid) = self.by_client.get(client_id) else {
            if let Some(to) = self.relay_of(client_id).filter(|&to| to != peer) {
                // The session moved on from here: its wait for that node goes with it (a
                // hand-over it sent here was passed on ahead of this).
                self.cluster.queue_kept_end_from(to, client_id, key);
            }
            return;
        };
        let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) else {
            return;
        };
        if recent.relay_home == key {
            recent.relay_home = 0;
        }
        if recent.twin_node == key {
            recent.twin_handed = true;
        }
        let before = recent.kept_waits.len();
        recent.kept_waits.retain(|&(k, _)| k != key);
        if before > 0 && recent.kept_waits.is_empty() {
            self.send_after_kept(sid, now);
        }
    }

    /// Sessions whose asked nodes went down or did not answer in time send on.
    pub(super) fn kept_holds_tick(&mut self, now: u64) {
        if self.claims.kept_holds.is_empty() {
            return;
        }
        let mut done = Vec::new();
        for sid in self.claims.kept_holds.clone() {
            let c = &self.cluster;
            let Some(recent) = self
                .sessions
                .get_mut(sid as usize)
                .and_then(|s| s.recent.as_mut())
            else {
                done.push((sid, false));
                continue;
            };
            let had = recent.holds();
            let mut timed_out = 0;
            let untold = &recent.untold;
            recent.kept_waits.retain(|&(key, until)| {
                // A node yet to say what it took is waited for while its link is down too.
                let waited =
                    untold.contains(&key) || c.peer_by_key(key).is_some_and(|p| c.peer_up(p));
                timed_out += u64::from(waited && now >= until);
                waited && now < until
            });
            self.claims.stats.kept_waits_timed_out += timed_out;
            // A relayed copy (`cluster_relay_order`) comes only while the old home is up.
            let home_up = c
                .peer_by_key(recent.relayed_by)
                .is_some_and(|p| c.peer_up(p));
            let mut timed_out = 0;
            recent.relay_waits.retain(|&(_, until)| {
                timed_out += u64::from(home_up && now >= until);
                home_up && now < until
            });
            self.claims.stats.relay_waits_timed_out += timed_out;
            if timed_out > 0 {
                // A home that did not relay in time (stalled, or its relay ended) holds this
                // session up no more.
                recent.relayed_by = 0;
            }
            let before = recent.direct_waits.len();
            recent.direct_waits.retain(|&(w, until)| {
                let done = now >= until;
                if done {
                    // Not held for that publishing node again.
                    recent.direct_caught_up.push((w >> 64) as u64);
                }
                !done
            });
            self.claims.stats.relay_waits_timed_out += (before - recent.direct_waits.len()) as u64;
            if !recent.holds() {
                done.push((sid, had));
            }
        }
        for (sid, had) in done {
            self.claims.kept_holds.retain(|&s| s != sid);
            if had {
                self.send_after_kept(sid, now);
            }
        }
    }

    /// Session `sid` waits for no answer any more: its queue's messages of each publishing
    /// node go back in that node's order (in the places they hold, the stored ones among
    /// the stored), then what can be sent goes.
    pub(super) fn send_after_kept(&mut self, sid: SessionId, now: u64) {
        let recent = self.session(sid).and_then(|s| s.recent.as_ref());
        if recent.is_some_and(|r| !r.relay_waits.is_empty() || !r.direct_waits.is_empty()) {
            // Still held for an old home's relay (`cluster_relay_order`): sent after that.
            return;
        }
        self.claims.kept_holds.retain(|&s| s != sid);
        self.queue_in_origin_order(sid, now);
        self.pump(sid, now);
    }

    /// Puts the messages of each publishing node in session `sid`'s queue back in that
    /// node's order (their ids), in the places they hold (the stored ones among the
    /// stored, whose records follow): what came along different paths may have arrived
    /// out of it.
    pub(super) fn queue_in_origin_order(&mut self, sid: SessionId, now: u64) {
        let Some(session) = self.session_mut(sid) else {
            return;
        };
        let mut places: HashMap<(u64, bool), Vec<usize>> = HashMap::new();
        for (i, d) in session.queue.iter().enumerate() {
            if d.msg.id != 0 {
                let origin = (d.msg.id >> 64) as u64;
                places.entry((origin, d.seq != 0)).or_default().push(i);
            }
        }
        let mut moved = Vec::new();
        for at in places.values() {
            let queue = &mut session.queue;
            if at
                .windows(2)
                .all(|w| queue[w[0]].msg.id < queue[w[1]].msg.id)
            {
                continue;
            }
            let mut ds: Vec<Delivery> = at.iter().map(|&i| queue[i].clone()).collect();
            ds.sort_by_key(|d| d.msg.id);
            for (&i, mut d) in at.iter().zip(ds) {
                if d.msg.id != queue[i].msg.id {
                    d.seq = queue[i].seq;
                    queue[i] = d;
                    moved.push(i);
                }
            }
        }
        if !moved.is_empty() {
            let client = session.client_id.clone();
            self.claims.stats.kept_reordered += moved.len() as u64;
            for i in moved {
                let session = self.session(sid).expect("exists");
                let d = &session.queue[i];
                if d.seq != 0 {
                    let record = self.message_record(d, now).encode();
                    self.put(records::message_key(&client, d.seq), &record);
                }
            }
        }
    }

    /// Session `sid`'s client id and plain subscriptions (filter, QoS, retain as
    /// published, identifier), if it has any.
    fn plain_subs(&self, sid: SessionId) -> Option<(Arc<str>, Vec<OwnedSub>)> {
        let session = self.session(sid)?;
        let owned: Vec<OwnedSub> = session
            .subs
            .iter()
            .filter(|(f, _)| topics::split_shared(f).is_none())
            .map(|(f, o)| (f.clone(), o.qos as u8, o.retain_as_published, o.identifier))
            .collect();
        (!owned.is_empty()).then(|| (session.client_id.clone(), owned))
    }

    /// Peer `peer` installed `client_id` from a copy of the dead node with key `home`: what
    /// is kept here for that node and matches `subs` goes to it.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kept_asked(
        &mut self,
        peer: PeerId,
        client_id: &str,
        home: u64,
        again: bool,
        applied: Option<(u64, u64)>,
        subs: &[KeptSub<'_>],
        now: u64,
    ) {
        let dead = self.cluster.peer_by_key(home).filter(|&d| d != peer);
        match dead {
            Some(dead) if !self.cluster.peer_up(dead) => {
                self.answer_kept(peer, dead, client_id, again, applied, subs, now);
            }
            Some(dead) if self.claims.kept_asks.len() < KEPT_ASKS_MAX => {
                // Down for the asker, still up here: the two ends of a silence find it
                // moments apart, and what this node wrote to that home's link as the
                // silence began is kept for it once it is down here too. (A home that is
                // up gets its queue: it sends on what reaches it.)
                let asks = &mut self.claims.kept_asks;
                asks.retain(|a| !(a.peer == peer && *a.client == *client_id));
                asks.push(HeldKeptAsk {
                    peer,
                    client: Arc::from(client_id),
                    home: dead,
                    again,
                    applied,
                    subs: owned_subs(subs),
                    until: now + KEPT_WAIT_MS,
                });
                return;
            }
            _ => {}
        }
        self.cluster.queue_kept_end(peer, client_id);
    }

    /// Peer `id`'s link went down: the asks held for it as a home still up here are
    /// answered, and those it made go.
    pub(super) fn kept_asks_peer_down(&mut self, id: PeerId, now: u64) {
        if self.claims.kept_asks.is_empty() {
            return;
        }
        let (due, rest): (Vec<HeldKeptAsk>, Vec<HeldKeptAsk>) =
            std::mem::take(&mut self.claims.kept_asks)
                .into_iter()
                .filter(|a| a.peer != id)
                .partition(|a| a.home == id);
        self.claims.kept_asks = rest;
        for a in due {
            let subs = kept_subs(&a.subs);
            self.answer_kept(a.peer, id, &a.client, a.again, a.applied, &subs, now);
            self.cluster.queue_kept_end(a.peer, &a.client);
        }
    }

    /// Asks held for a home that stayed up here past `KEPT_WAIT_MS` end with nothing.
    pub(super) fn kept_asks_tick(&mut self, now: u64) {
        if self.claims.kept_asks.is_empty() {
            return;
        }
        let (due, rest): (Vec<HeldKeptAsk>, Vec<HeldKeptAsk>) =
            std::mem::take(&mut self.claims.kept_asks)
                .into_iter()
                .partition(|a| now >= a.until);
        self.claims.kept_asks = rest;
        for a in due {
            self.cluster.queue_kept_end(a.peer, &a.client);
        }
    }

    /// What `kept_asked` sends: what is kept for `dead` and matches `subs`.
    #[allow(clippy::too_many_arguments)]
    fn answer_kept(
        &mut self,
        peer: PeerId,
        dead: PeerId,
        client_id: &str,
        again: bool,
        applied: Option<(u64, u64)>,
        subs: &[KeptSub<'_>],
        now: u64,
    ) {
        let skip = again.then(|| self.cluster.peer_key(peer));
        let (kept, spilled) = self.kept_matching(dead, client_id, subs, skip, applied, now);
        self.hand_kept(peer, client_id, kept, now);
        if !spilled.is_empty() {
            let owned = owned_subs(subs);
            let search = Search::new(
                Asker::Peer(peer),
                Arc::from(client_id),
                owned,
                skip,
                applied,
            );
            self.search_store(dead, search, spilled);
        }
    }

    /// Messages kept for a dead home, to peer `peer` for session `client_id` there.
    pub(super) fn hand_kept(
        &mut self,
        peer: PeerId,
        client_id: &str,
        kept: Vec<KeptDelivery>,
        now: u64,
    ) {
        self.claims.stats.kept_handed += kept.len() as u64;
        for (msg, qos, retain, sub_ids) in kept {
            self.cluster.queue_session_message(
                peer,
                client_id,
                &msg,
                qos,
                retain,
                &sub_ids,
                batch::SessionMessageKind::Kept,
                &[],
                0,
                now,
            );
        }
    }

    /// What session `sid` got that other nodes kept for its dead home (that home's key,
    /// the marks of the copy it was installed from, the ids), while it still matters: sent
    /// on with the session when it moves (`KeptState`).
    pub(super) fn kept_state(
        &self,
        sid: SessionId,
        now: u64,
    ) -> Option<(u64, Vec<Mark>, Vec<u128>)> {
        let r = self.session(sid)?.recent.as_ref()?;
        let over = r.kept_until != 0 && now >= r.kept_until;
        (r.kept_from != 0 && !over).then(|| {
            let ids = r.kept.iter().copied().collect();
            (r.kept_from, r.kept_marks.clone(), ids)
        })
    }

    /// Session `client_id` came here from `peer`, which had installed it from a copy of
    /// the dead node with key `home`, and got `ids` of what nodes kept for that home: it
    /// takes those once, and asks every node again (some may have been out of `peer`'s
    /// reach). Only right after `peer` handed the session here.
    pub(super) fn kept_state_received(
        &mut self,
        peer: PeerId,
        client_id: &str,
        home: u64,
        marks: &[Mark],
        ids: &[u128],
        now: u64,
    ) {
        if !self.came_from(peer, client_id) {
            self.event(
                "kept_state_refused",
                Arc::from(client_id),
                "kept state for a session the peer did not hand over".into(),
            );
            return;
        }
        let Some(&sid) = self.by_client.get(client_id) else {
            return;
        };
        if home == 0 {
            // No dead home: what reached the session where it was, taken once here.
            self.note_recent(sid, ids);
            return;
        }
        if let Some(s) = self.session_mut(sid) {
            let recent = s.recent.get_or_insert_with(Default::default);
            recent.kept_from = home;
            recent.kept_until = 0;
            recent.kept_marks = marks.to_vec();
            let room = KEPT_MAX.saturating_sub(recent.kept.len());
            recent
                .kept
                .extend(ids.iter().copied().filter(|&id| id != 0).take(room));
        }
        self.ask_kept(sid, home, marks, now);
    }

    /// Peer `peer`'s link came up: ahead of what waited for it, it learns what the sessions
    /// that came here, or whose client came back here, in the last `RECENT_MS` took: the
    /// ids of what reached them since, and of what was kept for their dead home
    /// (`TakenIds`). A version of such a session the peer made meanwhile (the two were cut
    /// off, and the client went there too) must not take those again, from the queues that
    /// waited for it here or elsewhere; what the version here did not deliver reaches that
    /// one when the two merge.
    pub(super) fn send_taken_ids(&mut self, peer: PeerId, now: u64) {
        if self.cluster.peer_protocol(peer) < TAKEN_IDS_PROTOCOL {
            return;
        }
        let taken: Vec<(Arc<str>, Stamp, Vec<u128>)> = self
            .by_client
            .iter()
            .filter(|(_, &sid)| self.moved_lately(sid, now))
            .filter_map(|(client, &sid)| {
                let stamp = self.version_of(sid)?;
                let mut ids: Vec<u128> = self.told_taken(sid, now).into_iter().collect();
                ids.truncate(TAKEN_IDS_MAX);
                Some((client.clone(), stamp, ids))
            })
            .collect();
        if taken.is_empty() {
            return;
        }
        self.claims.stats.taken_told += taken.len() as u64;
        let own = super::cluster_retained::node_key(&self.cluster.name);
        self.cluster.queue_first(peer, TAKEN_IDS_PROTOCOL, |items| {
            for (client, stamp, ids) in &taken {
                items.taken_ids(client, *stamp, own, ids.iter().copied());
            }
        });
    }

    /// Whether session `sid` came here (or its client came back) in the last `RECENT_MS`,
    /// or got what was kept for its dead home: a peer whose link comes up learns that this
    /// version exists, with what it took (none, perhaps).
    pub(super) fn moved_lately(&self, sid: SessionId, now: u64) -> bool {
        let Some(recent) = self.session(sid).and_then(|s| s.recent.as_ref()) else {
            return false;
        };
        now < recent.until || self.kept_state(sid, now).is_some()
    }

    /// What session `sid` tells a peer whose link comes up that it took (`send_taken_ids`):
    /// the ids of what reached it in the `RECENT_MS` since it came here (or its client came
    /// back), and of what was kept for its dead home, that went to its client. Not those
    /// still queued: the peer's version may hold them queued too, and would drop them
    /// (`unqueue_twin_took`) as this one would drop what it lists.
    pub(super) fn told_taken(&self, sid: SessionId, now: u64) -> HashSet<u128> {
        let Some(session) = self.session(sid) else {
            return HashSet::new();
        };
        let Some(recent) = session.recent.as_ref() else {
            return HashSet::new();
        };
        let mut ids = HashSet::new();
        if let Some((_, _, kept)) = self.kept_state(sid, now) {
            ids.extend(kept);
        }
        if now < recent.until {
            ids.extend(recent.ids.iter().copied());
        }
        for d in &session.queue {
            ids.remove(&d.msg.id);
        }
        ids
    }

    /// Peer `peer` says the version `stamp` of `client_id` on the node with key `node`
    /// delivered the messages `ids`: the session here does not take them from another path
    /// for a while; one that moved on from here passes that on along its relay.
    pub(super) fn taken_ids_received(
        &mut self,
        peer: PeerId,
        client_id: &str,
        stamp: Stamp,
        node: u64,
        ids: &[u128],
        now: u64,
    ) {
        let from_node = self.cluster.peer_key(peer) == node;
        if let Some(&sid) = self.by_client.get(client_id) {
            let Some(s) = self.session_mut(sid) else {
                return;
            };
            let recent = s.recent.get_or_insert_with(Default::default);
            if recent.twin_node != node || recent.twin_stamp != stamp || from_node {
                // Its hand-over (if that version gives way) is yet to come.
                recent.twin_handed = false;
            }
            recent.twin_node = node;
            recent.twin_stamp = stamp;
            recent.twin_until = now + RECENT_MS;
            let room = TAKEN_IDS_MAX.saturating_sub(recent.twin.len());
            let ids = ids.iter().copied().filter(|&id| id != 0);
            recent.twin.extend(ids.take(room));
            if from_node {
                // Straight from that version's node, ahead of anything it sends: what waits
                // here with those ids came by other paths (queues of other nodes, whose
                // links came up first).
                self.unqueue_twin_took(sid, now);
                let untold = self.session(sid).and_then(|s| s.recent.as_ref());
                if untold.is_some_and(|r| r.untold.contains(&node)) {
                    // This version was made while that node was out of reach: what that
                    // one holds (older, if it gives way) goes to the client first.
                    self.wait_for_twin(sid, node, now);
                }
                self.settle_twins(sid, peer, stamp, now);
            }
        } else if let Some(to) = self.relay_of(client_id).filter(|&to| to != peer) {
            self.cluster
                .queue_taken_ids(to, client_id, stamp, node, ids);
        }
    }

    /// Session `sid` here and version `stamp` of it on peer `peer` were made while the two
    /// nodes were out of touch: the older gives way to the newer (as a copy check would
    /// decide, but whichever nodes own the partition: after a split that removed one side
    /// from the map, neither node may be an owner of the other's).
    fn settle_twins(&mut self, sid: SessionId, peer: PeerId, stamp: Stamp, now: u64) {
        let Some(ours) = self.version_of(sid) else {
            return;
        };
        if ours < stamp {
            self.give_up(sid, peer, stamp, now);
        } else if ours > stamp {
            let Some(client) = self.session(sid).map(|s| s.client_id.clone()) else {
                return;
            };
            let me = self.cluster.name.clone();
            self.cluster.queue_fence(peer, &client, ours, &me);
        }
    }

    /// Whether message `id`, reaching session `sid` from the node with key `from` (0:
    /// routed to it), was taken by another version of it (`TakenIds`): only a hand-over
    /// from that version's node brings it.
    pub(super) fn twin_took(&mut self, sid: SessionId, id: u128, from: u64, now: u64) -> bool {
        let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) else {
            return false;
        };
        if recent.twin.is_empty() || id == 0 || from == recent.twin_node {
            return false;
        }
        if now >= recent.twin_until {
            recent.twin = Default::default();
            return false;
        }
        let took = recent.twin.contains(&id);
        if took {
            let node = recent.twin_node;
            self.replicas.stats.taken_elsewhere += 1;
            self.wait_for_twin(sid, node, now);
        }
        took
    }

    /// Session `sid` skipped a message that its version on the node with key `node` took
    /// while the two were cut off: that version hands over what it did not deliver soon
    /// (ending with `KeptEnd`), and newer messages the node sends meanwhile must not go to
    /// the client before those. So the session sends nothing new until then, as while it
    /// waits for kept messages (at most `KEPT_WAIT_MS` after the last such skip).
    pub(super) fn wait_for_twin(&mut self, sid: SessionId, node: u64, now: u64) {
        let speaks = self
            .cluster
            .peer_by_key(node)
            .is_some_and(|p| self.cluster.peer_protocol(p) >= TAKEN_IDS_PROTOCOL);
        let recent = self.session(sid).and_then(|s| s.recent.as_ref());
        if recent.is_some_and(|r| r.twin_node == node && r.twin_handed) {
            // That hand-over ended already (here, or where the session came from).
            return;
        }
        if speaks {
            self.wait_for_kept(sid, &[node], now);
        }
    }

    /// Drops from session `sid`'s queue what its other version took (`RecentIds::twin`):
    /// that version delivered those, or hands them over with what it held.
    fn unqueue_twin_took(&mut self, sid: SessionId, now: u64) {
        let Some(s) = self.session_mut(sid) else {
            return;
        };
        let Some(recent) = s.recent.as_ref() else {
            return;
        };
        if recent.twin.is_empty() || !s.queue.iter().any(|d| recent.twin.contains(&d.msg.id)) {
            return;
        }
        let node = recent.twin_node;
        let mut freed = 0;
        let mut dropped = Vec::new();
        s.queue.retain(|d| {
            if recent.twin.contains(&d.msg.id) {
                freed += d.msg.payload.len();
                dropped.push((d.msg.id, d.seq));
                false
            } else {
                true
            }
        });
        s.queued_bytes -= freed;
        if let Some(recent) = s.recent.as_mut() {
            // Not seen here after all: the other version's hand-over brings them.
            for (id, _) in &dropped {
                recent.ids.remove(id);
                recent.kept.remove(id);
            }
        }
        self.replicas.stats.taken_elsewhere += dropped.len() as u64;
        for (_, seq) in dropped {
            self.forget_delivery(sid, seq);
        }
        self.wait_for_twin(sid, node, now);
    }

    /// Peer `peer`'s link came up: the sessions whose client came back here while it and
    /// other nodes were out of reach, and whose other nodes have yet to say what versions of
    /// them took (`RecentIds::untold`), send nothing new until those have (at most
    /// `KEPT_WAIT_MS`): `peer`'s queues for this node hold messages that such a version may
    /// have taken, and its own node says so only once its link is up too.
    pub(super) fn wait_for_untold(&mut self, peer: PeerId, now: u64) {
        let key = self.cluster.peer_key(peer);
        let mut waits = Vec::new();
        for &sid in self.by_client.values() {
            let Some(recent) = self.session(sid).and_then(|s| s.recent.as_ref()) else {
                continue;
            };
            if !recent.untold.contains(&key) {
                continue;
            }
            let mut others: Vec<u64> = recent
                .untold
                .iter()
                .copied()
                .filter(|&k| k != key && !self.cluster.heard_or_gone(k))
                .collect();
            // What `peer` sent the live home this session came from before it learned where
            // the session went reaches that home now, and is relayed here: first.
            let home = recent.relay_home;
            let says = self
                .cluster
                .peer_by_key(home)
                .is_some_and(|p| self.cluster.peer_protocol(p) >= RELAY_CAUGHT_UP_PROTOCOL);
            if home != 0 && home != key && says {
                others.push(home);
            }
            if !others.is_empty() {
                waits.push((sid, others));
            }
        }
        for (sid, others) in waits {
            self.wait_for_kept(sid, &others, now);
        }
    }

    /// The node with key `key` said what its versions of sessions took (its first batch
    /// since its link came up): the sessions here that waited for that send on.
    pub(super) fn told_by(&mut self, key: u64, now: u64) {
        let mut done = Vec::new();
        let sids: Vec<SessionId> = self.by_client.values().copied().collect();
        for sid in sids {
            let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) else {
                continue;
            };
            if !recent.untold.contains(&key) {
                continue;
            }
            recent.untold.retain(|&k| k != key);
            if recent.twin_node == key && now < recent.twin_until {
                // It holds another version: the wait goes on until that hands over.
                continue;
            }
            let before = recent.kept_waits.len();
            recent.kept_waits.retain(|&(k, _)| k != key);
            if before > 0 && recent.kept_waits.is_empty() {
                done.push(sid);
            }
        }
        for sid in done {
            self.send_after_kept(sid, now);
        }
    }

    /// Session `sid` got kept message `id`: another copy of it (from its old home, back) is
    /// not delivered again.
    pub(super) fn note_kept(&mut self, sid: SessionId, id: u128) {
        if id == 0 {
            return;
        }
        if let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) {
            if recent.kept_from != 0 && recent.kept.len() < KEPT_MAX {
                recent.kept.insert(id);
            }
        }
    }

    /// The messages in the queue kept for peer `dead` (in memory) that session `client_id`
    /// gets with subscriptions `subs`, oldest first; not those that also went to the node
    /// with key `skip` for its own rows. A batch written to the dead node's link before it
    /// went down it may have applied (`handed_on`): one past `applied` (its incarnation and
    /// number, as the session's copy knows how far the home applied ours) goes, one within
    /// it does not (the copy holds what the home applied and the client was told of), and
    /// of one it does not cover (no mark: the home went silent before it told) only the
    /// QoS 1 deliveries go: a second one is allowed, a QoS 2 message delivered twice is not,
    /// and one that only the home's version brings after the heal comes after newer ones.
    /// Also returns the batches after those that live only in the store
    /// (`cluster_kept_store` reads them back).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn kept_matching(
        &mut self,
        dead: PeerId,
        client_id: &str,
        subs: &[KeptSub<'_>],
        skip: Option<u64>,
        applied: Option<(u64, u64)>,
        now: u64,
    ) -> (Vec<KeptDelivery>, Vec<KeptBatch>) {
        let mut out = Vec::new();
        let (mut unreadable, mut sent) = (0, 0);
        let for_key = self.cluster.peer_key(dead);
        let spilled = self
            .cluster
            .each_kept_frame(dead, |epoch, seq, written, frame| {
                let Some(most) = handed_on(epoch, seq, written, applied) else {
                    sent += 1;
                    return;
                };
                let kept = (client_id, subs, skip, for_key);
                if !kept_in_frame(frame, kept, most, now, &mut out) {
                    unreadable += 1;
                }
            });
        // Items queued for it were closed into a batch: kept in the store like the others.
        self.store_outgoing(dead);
        if sent + unreadable > 0 {
            self.kept_not_searched(dead, client_id, sent, unreadable);
        }
        (out, spilled)
    }

    /// Logs the batches kept for `dead` that a search for `client_id` passed over.
    pub(super) fn kept_not_searched(
        &mut self,
        dead: PeerId,
        client_id: &str,
        sent: usize,
        unreadable: usize,
    ) {
        let name = self
            .cluster
            .peer_name(dead)
            .unwrap_or_else(|| Arc::from("?"));
        self.event(
            "kept_not_searched",
            Arc::from(client_id),
            format!(
                "batches kept for {name} not looked through: {sent} it had applied (the \
                 copy's mark), {unreadable} unreadable"
            ),
        );
    }
}

/// Which deliveries of a batch kept for a dead node (its incarnation and number, and
/// whether it was written to the node's link) are handed on, given how far the node
/// applied ours: all (`ExactlyOnce` and below), QoS 1 only (`AtLeastOnce`: a written one
/// the mark does not cover), or none (the mark covers it).
pub(super) fn handed_on(
    epoch: u64,
    seq: u64,
    written: bool,
    applied: Option<(u64, u64)>,
) -> Option<QoS> {
    match applied {
        _ if !written => Some(QoS::ExactlyOnce),
        Some((e, s)) if seq != 0 && epoch == e => (seq > s).then_some(QoS::ExactlyOnce),
        _ => Some(QoS::AtLeastOnce),
    }
}

/// Adds to `out` the messages of batch `frame`, kept for the node with key `for_key`, that
/// session `client_id` with `subs` gets (not those that also went to the node with key
/// `skip`; with `most` below QoS 2, only the QoS 1 deliveries). False if it cannot be read.
pub(super) fn kept_in_frame(
    frame: &[u8],
    (client_id, subs, skip, for_key): (&str, &[KeptSub<'_>], Option<u64>, u64),
    most: QoS,
    now: u64,
    out: &mut Vec<KeptDelivery>,
) -> bool {
    let value = batch::frame_value(frame);
    let decoded = value.as_deref().map(Batch::decode);
    let Some(Ok(b)) = decoded else {
        return false;
    };
    let Ok(items) = b.items() else {
        return false;
    };
    for item in items {
        let (m, qos, retain, sub_ids) = match item {
            Item::Message(m) if m.plain && !skip.is_some_and(|k| m.also.contains(&k)) => {
                match delivery_for(&m, subs) {
                    Some((qos, retain, ids)) => (m, qos, retain, ids),
                    None => continue,
                }
            }
            Item::Message(_) => continue,
            // A relayed copy of a message its publishing node sent that node straight too:
            // that node's own word (its copy's mark, and what it kept) covers it. The fault
            // suite found it handed again after the node had delivered it (partial splits).
            Item::SessionMessage {
                message,
                kept: false,
                released: None,
                ..
            } if message.also.contains(&for_key) => continue,
            Item::SessionMessage {
                client_id: c,
                qos,
                retain,
                sub_ids,
                message,
                ..
            } if c == client_id => match QoS::from_u8(qos) {
                Some(qos) => (message, qos, retain, sub_ids),
                None => continue,
            },
            _ => continue,
        };
        if most != QoS::ExactlyOnce && qos != QoS::AtLeastOnce {
            continue;
        }
        if let Ok(msg) = message_from_wire(&m, now) {
            out.push((Arc::new(msg), qos, retain, sub_ids));
        }
    }
    true
}

pub(super) type OwnedSub = (String, u8, bool, u32);

fn owned_subs(subs: &[KeptSub<'_>]) -> Vec<OwnedSub> {
    subs.iter()
        .map(|s| {
            (
                s.filter.to_string(),
                s.qos,
                s.retain_as_published,
                s.identifier,
            )
        })
        .collect()
}

/// An ask for what this node kept for a home it still sees up (`kept_asked`).
pub(super) struct HeldKeptAsk {
    peer: PeerId,
    client: Arc<str>,
    home: PeerId,
    again: bool,
    applied: Option<(u64, u64)>,
    subs: Vec<OwnedSub>,
    until: u64,
}

/// Asks held at most (past that, answered at once as before: nothing).
const KEPT_ASKS_MAX: usize = 4096;

pub(super) fn kept_subs(owned: &[OwnedSub]) -> Vec<KeptSub<'_>> {
    owned
        .iter()
        .map(|(filter, qos, rap, identifier)| KeptSub {
            filter,
            qos: *qos,
            retain_as_published: *rap,
            identifier: *identifier,
        })
        .collect()
}

/// How a session with plain subscriptions `subs` gets `m`, if any match: one copy, the
/// highest QoS granted, every identifier (as `route_local` merges overlapping ones).
fn delivery_for(m: &WireMessage<'_>, subs: &[KeptSub<'_>]) -> Option<(QoS, bool, Vec<u32>)> {
    let mut granted: Option<u8> = None;
    let mut rap = false;
    let mut ids = Vec::new();
    for s in subs.iter().filter(|s| topics::matches(s.filter, m.topic)) {
        granted = Some(granted.map_or(s.qos, |g| g.max(s.qos)));
        rap |= s.retain_as_published;
        if s.identifier != 0 {
            ids.push(s.identifier);
        }
    }
    let qos = QoS::from_u8(m.qos.min(granted?))?;
    Some((qos, m.retain && rap, ids))
}

/// Node `node`'s incarnation and batch number in `marks`.
fn applied_for(marks: &[Mark], node: u64) -> Option<(u64, u64)> {
    marks
        .iter()
        .find(|m| m.node == node)
        .map(|m| (m.epoch, m.seq))
}
