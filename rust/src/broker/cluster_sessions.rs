//! One session per client id across the cluster, and sessions that follow their client to
//! the node it reconnects to (docs/cluster-sessions.md).
//!
//! - **Claims.** A CONNECT accepted here for a client id is held (its connection is not
//!   read) while a `Claim`, stamped by the first owner of the client id's partition in
//!   reach, goes to the nodes that owner names and the partition's owners
//!   (`cluster_registry`; with no owner of protocol 10 in reach, stamped with this node's
//!   hybrid logical clock, to every reachable peer of protocol 3). A peer that holds the
//!   client closes its connection
//!   (DISCONNECT 0x8E, as a takeover on one node) and answers with the session's store
//!   records, or ends the session if the claim discards it (clean start, or this node holds
//!   one already); a peer without it answers with none. The CONNECT goes on once every peer
//!   asked has answered or gone down, or after `CLAIM_TIMEOUT_MS` (3 s; for a claim that
//!   resumes a session, a little past the failure timeout if longer: a stalled home is
//!   found down then, and answered for from its copy), with the session the answers
//!   brought (session present = 1).
//! - **Races.** The highest stamp wins. A node with its own claim out for the client answers
//!   an older claim at once with none, and serves a newer one only after its own completed
//!   (then as a takeover), so every node ends with the newest connect alive and no claim
//!   waits on one that waits on it. A session whose connection is gone goes to any claim:
//!   stamps order claims only through what their owners heard, and an owner new to the
//!   partition may stamp the client's next connect below the one before.
//! - **No loss in the hand-over.** The session's records leave the old home in a reliable
//!   batch kept in its store in the same write that deletes them, so a crash of either node
//!   at any point leaves them on one disk at least. An answer that finds no claim waiting
//!   (the claimant restarted, or gave up) is installed as a disconnected session.
//! - **The relay.** Route rows move with the session, and other nodes learn of it at
//!   different moments. The old home keeps the session's subscriptions and sends what
//!   still matches them to the new home (`SessionMessage`) until the new home says every
//!   peer acknowledged its rows for the session (`RelayEnd`, protocol 8; then `RELAY_MS`
//!   more, and `RELAY_MAX_MS` at most; the session remembers ids meanwhile; not while a
//!   peer is out of touch, nor before each peer that lagged at the hand-over sent its rows
//!   again, its late batches first: then `KeptEnd` tells the new home, which holds what such
//!   a peer sends it directly until then), except a message that
//!   the new home routed after it installed the session (its `Installed` marker comes first
//!   on the link), or one it sent there itself after the hand-over (same link). A message
//!   relayed to a node the session left again goes on along that node's relay.
//! - **Message ids** (protocol 5). Every message published in a cluster gets an id (origin
//!   node and incarnation, counter), forwarded, relayed and stored with it. For `RECENT_MS`
//!   (30 s) after a session is installed it remembers the ids that reach it, starting with those
//!   of its records, and takes each once: a message that reached the new home from a third
//!   node is relayed too (only the new home knows whether it had the session then), and a
//!   session that comes straight back gets what its old relay caught meanwhile once. A
//!   session that moves on within those 30 s takes the ids with it (`KeptState` with home
//!   0, after the claim answer): a relay's late message (an old home that was frozen, a
//!   relay chain) reaches it once, not again at the next node.
//!   Messages from peers of protocol 4 carry none: those the new home also got for its own
//!   subscriptions (a forwarded message lists the other nodes it went to) are not relayed.
//!
//! Copies of sessions on the partition's owners: `cluster_replicas`. Not yet (issue 16): a
//! node that cannot reach the new home for longer than `RELAY_MAX_MS` misses it with what
//! it publishes meanwhile.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::cluster::PeerId;
use super::cluster_kept::{
    HANDED_ON_PROTOCOL, KEPT_MAX, RELAY_CAUGHT_UP_PROTOCOL, TAKEN_IDS_PROTOCOL,
};
use super::cluster_replicas::THIS_NODE;
use super::connect::PendingConnect;
use super::router::Scope;
use super::state::{ConnState, Delivery, Message, SessionId};
use super::{ConnId, Engine};
use crate::cluster::batch::{Mark, SessionMessageKind, Stamp};
use crate::codec::QoS;

/// How long a claim waits at least for a peer whose link is up but that does not answer;
/// and at least until such a peer is found down (`claim_wait_ms`).
const CLAIM_TIMEOUT_MS: u64 = 3_000;
/// How long after the failure timeout a silent link is closed for sure (the link layer
/// looks every 50 ms), and an owner watching its home answers from its copy.
pub(super) const FOUND_DOWN_MS: u64 = 1_000;
/// How long the old home relays a moved session's messages to a node of protocol 7 or
/// less, and after the new home said every node has its rows (`RelayEnd`): far longer than
/// route rows, or messages sent before them, take over links that are up.
const RELAY_MS: u64 = 5_000;
/// How long it relays at most to a node of protocol 8 that does not say so: a node that
/// reaches the old home but not the new one sends there meanwhile.
const RELAY_MAX_MS: u64 = 300_000;

/// How long a session that moved here tells messages that reach it twice by their ids:
/// the relay's time, and room for a relayed batch sent again after its link dropped.
pub(super) const RECENT_MS: u64 = 30_000;
/// How long a claim waits for an owner to stamp it (a few round trips) before it asks the
/// next owner in reach: one that is up but silent would hold it until found down.
const ROUTE_MS: u64 = 1_000;

/// Ids a moved session remembers at most (past that, a repeat can get through).
const RECENT_MAX: usize = 1 << 16;

/// A message caught for a claimed session (`Claim::early`).
struct EarlyMessage {
    msg: Arc<Message>,
    qos: QoS,
    retain: bool,
    sub_ids: Vec<u32>,
    /// Routed here (not relayed): the peer it came from and the keys of the other nodes
    /// it went to (`cluster_relay_order`).
    routed: Option<(PeerId, Vec<u64>)>,
    /// Whom it came from, as `twin_took` is asked once the session is here (0: routed; a
    /// node's key: relayed, that node's hand-over), None: published here.
    from: Option<u64>,
}

/// A CONNECT of this node waiting for the answers to its claim.
struct Claim {
    conn: ConnId,
    stamp: Stamp,
    connect: PendingConnect,
    auth_method: Option<String>,
    auth_data: Option<Bytes>,
    /// Peers whose answer is still awaited (`THIS_NODE`: this node's own copy, read back).
    waiting: Vec<PeerId>,
    /// The claim ends the session (it wants none back).
    discard: bool,
    deadline: u64,
    /// Messages for the session on its way here that reached this node first (through an
    /// old relay of it, or relayed before it arrived): delivered to it once installed.
    early: Vec<EarlyMessage>,
    /// The owner asked to stamp the claim, and the request's number, until it answers
    /// (`stamp` is zero meanwhile: every peer's claim counts as newer and waits), or until
    /// `route_until`: then the next owner in reach is asked.
    route: Option<(PeerId, u64)>,
    route_until: u64,
    /// Owners that did not answer in time.
    silent: Vec<PeerId>,
    /// The most current answer read from a copy so far (its home's moment, who sent it,
    /// the records), installed when every answer is in: owners' copies can lag each other
    /// by what was acknowledged with fewer of them.
    best_copy: Option<CopyAnswer>,
    /// Nodes that may hold the session went out of reach lately and could not be asked
    /// (`may_hold_out_of_reach`), or went out of reach before answering: unless a session
    /// came, the CONNECT is refused.
    out_of_reach: bool,
    /// The nodes (keys) the claim's owner named as holding or claiming the session; None
    /// when it went to every node in reach (any may hold it).
    named: Option<Vec<u64>>,
}

/// A session that came here from a live home, which relays for it meanwhile.
struct RelayRelease {
    client_id: Arc<str>,
    home: PeerId,
    rows: u64,
    /// When that home's relay ends anyway (`RELAY_MAX_MS`).
    until: u64,
}

/// A relay of a session handed over from here (`Claims::relays`).
struct Relay {
    /// The session's new home.
    to: PeerId,
    /// When the relay ends, and the latest that may be pushed to (`claims_tick`).
    until: u64,
    cap: u64,
    /// The peers (keys) that lagged at the hand-over and have not sent their rows since:
    /// batches they sent here before they heard where the session went may still come.
    lagging: Vec<u64>,
}

/// An answer to a claim read from an owner's copy.
struct CopyAnswer {
    /// The home's moment the copy was current as of.
    at: u64,
    from: PeerId,
    records: Vec<(Vec<u8>, Vec<u8>)>,
    /// How far the home had applied each node's batches, as that copy knows it.
    marks: Vec<Mark>,
}

#[derive(Default)]
pub(super) struct Claims {
    /// This node's claims in flight, by client id.
    pending: HashMap<Arc<str>, Claim>,
    /// Newer claims of peers for a client id this node claims too, served once ours is done.
    deferred: Vec<(PeerId, Arc<str>, Stamp, bool)>,
    /// Sessions handed over a moment ago, whose subscriptions here relay to their new home.
    relays: HashMap<SessionId, Relay>,
    /// Sessions a live home handed to this node: until every peer holds this node's route
    /// rows as of `rows`, that home relays for them (and they remember message ids).
    releases: Vec<RelayRelease>,
    /// The stamp of the claim each session here last won: an older claim that arrives late
    /// (sent again after a link came back) does not take it away.
    pub(super) won: HashMap<SessionId, Stamp>,
    /// Sessions that send nothing new to their clients until the nodes they asked for what
    /// was kept for their dead home have answered (`cluster_kept`).
    pub(super) kept_holds: Vec<SessionId>,
    /// Asks for what was kept for a home still up here (`cluster_kept`).
    pub(super) kept_asks: Vec<super::cluster_kept::HeldKeptAsk>,
    pub(super) stats: ClaimStats,
}

#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClaimStats {
    /// Claims made by this node.
    pub made: u64,
    /// Sessions this node received from another (by a claim, or an answer found later).
    pub sessions_in: u64,
    /// Sessions this node handed over to a claimant.
    pub sessions_out: u64,
    /// Claims that went on without every answer (a peer up but silent).
    pub timed_out: u64,
    /// Messages relayed to a session's new home.
    pub relayed: u64,
    /// Messages kept here for a dead home sent to where its sessions live now
    /// (`cluster_kept`).
    pub kept_handed: u64,
    /// Batches kept here for a dead home only in the store, read back to look through for
    /// its sessions (`cluster_kept_store`).
    pub kept_read_back: u64,
    /// Answers to this node's asks for kept messages that did not end in `KEPT_WAIT_MS`
    /// (the session went on without them: what they bring after may be out of order).
    pub kept_waits_timed_out: u64,
    /// Queued messages put back in their publishing node's order once those answers ended
    /// (or once an old home's relay caught up, `cluster_relay_order`).
    pub kept_reordered: u64,
    /// Messages that came straight to a session that moved here, held until the old home's
    /// relayed copy came (`cluster_relay_order`); and holds that ended without it.
    pub relay_waits: u64,
    pub relay_waits_timed_out: u64,
    /// Messages that came straight to a session that moved here which it had taken at its
    /// old home (`cluster_took_routed`): not delivered again.
    pub took_at_old_home: u64,
    /// Sessions that moved here whose old home's link went down while it could still relay
    /// for them: they asked for what the reachable nodes kept for it (`cluster_kept`).
    pub moved_home_lost: u64,
    /// Lists of what a session that came here (or whose client came back here) in the last
    /// `RECENT_MS` took, told to a peer whose link came up (`TakenIds`).
    pub taken_told: u64,
    /// CONNECTs refused because the nodes that may hold the client's session were out of
    /// reach (and no copy was here).
    pub refused_out_of_reach: u64,
}

impl Claims {
    /// Session `sid` is gone (its number may be given to another).
    pub(super) fn forget(&mut self, sid: SessionId) {
        if !self.won.is_empty() {
            self.won.remove(&sid);
        }
        if !self.relays.is_empty() {
            self.relays.remove(&sid);
        }
        self.kept_holds.retain(|&s| s != sid);
    }

    /// Whether session `sid` moved away a moment ago (its messages are relayed).
    pub(super) fn relaying(&self, sid: SessionId) -> bool {
        !self.relays.is_empty() && self.relays.contains_key(&sid)
    }
}

impl Engine {
    /// Whether the CONNECT must first claim its client id from the other nodes.
    fn claim_needed(&self, pending: &PendingConnect) -> bool {
        // An id the broker assigned is new everywhere. With no peer to ask, a copy here of
        // a dead home's session is still read back.
        pending.assigned.is_none()
            && (!self.cluster.claim_peers().is_empty()
                || (!pending.connect.clean_start && self.own_copy_usable(&pending.client_id, None)))
    }

    /// Goes on with a checked CONNECT: claims its client id from the other nodes first if
    /// there are any (`claim_answered` goes on), else at once.
    pub(super) fn accept_connect(
        &mut self,
        id: ConnId,
        pending: PendingConnect,
        auth_method: Option<String>,
        auth_data: Option<Bytes>,
        now: u64,
    ) {
        if self.cluster.require_map && !self.replicas.has_map() {
            self.refuse(id, 0x88, "this node has not joined its cluster yet");
            self.claims.stats.refused_out_of_reach += 1;
            return;
        }
        if now < self.out_of_touch_until {
            // Its peers took this node for dead while it was stopped (or its store failed):
            // a CONNECT read now (perhaps queued before, its client long gone) must not take
            // the client's session over from where it lives on.
            let why = "this node is catching up with the cluster after a pause or a full disk";
            self.refuse(id, 0x88, why);
            self.claims.stats.refused_out_of_reach += 1;
            return;
        }
        if !pending.connect.clean_start && self.aside(now) {
            let why = "this node stepped aside in a partial split: its peers serve this session";
            self.refuse(id, 0x88, why);
            self.claims.stats.refused_out_of_reach += 1;
            return;
        }
        let cut_off = self
            .by_client
            .get(&pending.client_id)
            .is_some_and(|&sid| self.cut_off_unconfirmed(sid));
        if cut_off && !pending.connect.clean_start {
            // Back in touch after a split: the other side may have made a newer version of
            // this session and delivered what this one still has queued. Its owners answer
            // within a round trip (`cut_off_sessions`); the client comes back then, here or
            // through the load balancer elsewhere.
            let why = "this node is catching up with the cluster after being cut off from it";
            self.refuse(id, 0x88, why);
            self.claims.stats.refused_out_of_reach += 1;
            return;
        }
        self.will_on_claim(&pending.client_id, now);
        if !self.claim_needed(&pending) {
            let resumes = !pending.connect.clean_start && pending.assigned.is_none();
            if resumes
                && !self.by_client.contains_key(&pending.client_id)
                && (self.may_hold_out_of_reach(None, now)
                    || self.copy_beyond_reach(&pending.client_id))
            {
                return self.refuse_out_of_reach(id);
            }
            return self.accept_connect_here(id, pending, auth_method, auth_data, now);
        }
        let client_id = pending.client_id.clone();
        if let Some(old) = self.claims.pending.remove(&client_id) {
            // The same client connected here again meanwhile: the newer CONNECT goes on.
            self.refuse(old.conn, 0x89, "a newer CONNECT of this client arrived");
        }
        // A session here discards the others, unless it is one restored at start-up that
        // another node may have taken over meanwhile: then the newest comes here.
        let here = self.by_client.get(&client_id).copied();
        let discard = pending.connect.clean_start || here.is_some_and(|sid| !self.unconfirmed(sid));
        self.claims.stats.made += 1;
        self.conn_mut(id).expect("caller checked").state = ConnState::AwaitClaim;
        self.claims.pending.insert(
            client_id.clone(),
            Claim {
                conn: id,
                stamp: Stamp::default(),
                connect: pending,
                auth_method,
                auth_data,
                waiting: Vec::new(),
                discard,
                deadline: now + self.claim_wait_ms(discard),
                early: Vec::new(),
                best_copy: None,
                route: None,
                route_until: 0,
                silent: Vec::new(),
                out_of_reach: false,
                named: None,
            },
        );
        if self.route_claim(&client_id, false, now) {
            // Nobody to ask (this node stamped it and holds all there is): the CONNECT goes
            // on now, and its connection's reading with it.
            self.finish_claim(&client_id, false, now);
        }
    }

    /// Sends claim `client_id` of this node through the first owner of its partition in
    /// reach (`cluster_registry`), or to every node in reach if there is none (`broadcast`,
    /// or none in reach). True if no answer is to wait for.
    fn route_claim(&mut self, client_id: &Arc<str>, broadcast: bool, now: u64) -> bool {
        let silent = match self.claims.pending.get(client_id) {
            Some(c) => c.silent.clone(),
            None => return false,
        };
        let router = if broadcast {
            None
        } else {
            self.claim_router(client_id, &silent)
        };
        match router {
            Some(THIS_NODE) => {
                let stamp = self.cluster.retained.next(self.wall(now));
                let ask = self.claim_ask(client_id, THIS_NODE);
                self.claim_from(client_id, stamp, Some(&ask), now)
            }
            Some(owner) => {
                let req = self.registry.next_req();
                self.cluster.queue_claim_route(owner, client_id, req);
                let claim = self.claims.pending.get_mut(client_id).expect("checked");
                claim.route = Some((owner, req));
                claim.route_until = now + ROUTE_MS;
                claim.waiting = vec![owner];
                false
            }
            None => {
                let stamp = self.cluster.retained.next(self.wall(now));
                self.claim_from(client_id, stamp, None, now)
            }
        }
    }

    /// The owner of `client_id`'s partition a claim goes through: the first in map order
    /// that is this node or in reach (and not `silent`), if it speaks protocol 10.
    fn claim_router(&self, client_id: &str, silent: &[PeerId]) -> Option<PeerId> {
        for owner in self.replicas.owners_of(client_id) {
            if owner == THIS_NODE {
                return Some(THIS_NODE);
            }
            if self.cluster.peer_up(owner) && !silent.contains(&owner) {
                return (self.cluster.peer_protocol(owner) >= 10).then_some(owner);
            }
        }
        None
    }

    /// Claim `client_id` of this node, stamped `stamp`, goes to the nodes `ask` names (keys;
    /// all in reach if none) and the other owners of its partition, and this node's own
    /// copy is read back if it has one.
    /// True if no answer is to wait for.
    fn claim_from(
        &mut self,
        client_id: &Arc<str>,
        stamp: Stamp,
        ask: Option<&[u64]>,
        now: u64,
    ) -> bool {
        self.answer_older_deferred(client_id, stamp);
        let Some(discard) = self.claims.pending.get(client_id).map(|c| c.discard) else {
            return false;
        };
        let mut peers = self.cluster.claim_peers();
        if let Some(ask) = ask {
            // Nobody named: no node holds a session, a copy or a claim of the client (the
            // owner knows every node's), so there is nobody to ask, the other owners
            // included: they learn of the session when it is installed here (`Home`).
            let owners = self.replicas.other_owners(client_id);
            peers.retain(|&p| {
                !ask.is_empty() && (owners.contains(&p) || ask.contains(&self.cluster.peer_key(p)))
            });
            self.registry.stats.directed += 1;
        } else {
            self.registry.stats.broadcast += 1;
        }
        self.registry.stats.asked += peers.len() as u64;
        for &peer in &peers {
            self.cluster.queue_claim(peer, client_id, stamp, discard);
        }
        let out_of_reach =
            !discard && (self.may_hold_out_of_reach(ask, now) || self.copy_beyond_reach(client_id));
        if !discard && self.claim_own_copy(client_id, None) {
            peers.push(THIS_NODE);
        }
        let wait = self.claim_wait_ms(discard);
        let claim = self.claims.pending.get_mut(client_id).expect("checked");
        claim.stamp = stamp;
        claim.route = None;
        claim.out_of_reach = out_of_reach;
        claim.named = ask.map(<[u64]>::to_vec);
        claim.waiting = peers;
        claim.deadline = now + wait;
        claim.waiting.is_empty()
    }

    /// Whether a node that may hold a client's session (one `ask` names, or any peer if the
    /// claim asks every node in reach) is out of reach since less than a claim's wait for a
    /// silent home: cut off by a split, or stalled, it may come back with the session. A
    /// node down for longer is taken for dead (its sessions are served from their copies),
    /// so a last survivor goes on serving; unless the control plane hears it still
    /// (`cluster_peer_alive`).
    fn may_hold_out_of_reach(&mut self, ask: Option<&[u64]>, now: u64) -> bool {
        let wait = self.claim_wait_ms(false);
        let long_gone = self.cluster.dead_longer_than(wait, now);
        let named: Vec<PeerId> = match ask {
            Some(keys) => keys
                .iter()
                .filter_map(|&k| self.cluster.peer_by_key(k))
                .collect(),
            None => self
                .cluster
                .peer_keys()
                .into_iter()
                .map(|(p, _)| p)
                .collect(),
        };
        named
            .into_iter()
            .any(|p| !self.cluster.peer_up(p) && !long_gone.contains(&p))
    }

    /// The caller's time is `now`. No time passing here for the failure timeout means this
    /// process was stopped (SIGSTOP, a frozen VM, a long GC-like stall): its peers took it
    /// for dead meanwhile, took its sessions over and may have removed it from the cluster.
    /// Until the map changes (it is added again, or learns the cluster's current map) or
    /// the failure timeout passes again, it refuses CONNECTs.
    pub(super) fn observe_time(&mut self, now: u64) {
        let limit = self.cfg.cluster_takeover_ms;
        let gap = now.saturating_sub(self.last_now);
        if limit > 0 && self.last_now != 0 && gap >= limit && self.cluster.epoch_of() != 0 {
            let detail =
                format!("no time passed here for {gap} ms: CONNECTs refused until in touch");
            self.out_of_touch(now, "resumed_after_pause", detail);
        }
        self.last_now = now;
    }

    /// This node's store failed for a while (a full disk) and works again. Meanwhile its
    /// data links were closed, so its peers took it for dead, as after a pause: a CONNECT
    /// held unread while the store failed (its client perhaps gone through the load
    /// balancer to another node long since) must not take that client's session over from
    /// where it lives on now. CONNECTs are refused as after a pause (`observe_time`).
    pub fn cluster_store_recovered(&mut self, now: u64) {
        // Out of touch since the failure (`store_failed`); without takeovers, in touch now.
        self.out_of_touch_until = 0;
        if self.cfg.cluster_takeover_ms > 0 && self.cluster.epoch_of() != 0 {
            let detail = "its store failed for a while: CONNECTs refused until in touch";
            self.out_of_touch(now, "store_recovered", detail.to_string());
        }
    }

    fn out_of_touch(&mut self, now: u64, event: &'static str, detail: String) {
        self.out_of_touch_until = now + self.cfg.cluster_takeover_ms;
        self.out_of_touch_map = self.replicas.map_version();
        self.event(event, Arc::from(""), detail);
    }

    /// A fresh session here would lose the client's subscriptions and queue, which may live
    /// on a node out of reach: refused, the client reconnects (through a load balancer, to
    /// another node) and resumes there, or here once that node is back.
    fn refuse_out_of_reach(&mut self, conn: ConnId) {
        let why = "the nodes that may hold this client's session are out of reach";
        self.refuse(conn, 0x88, why);
        self.claims.stats.refused_out_of_reach += 1;
    }

    /// Owner `peer` stamped our claim `req` of `client_id` and named the nodes to ask.
    pub(super) fn claim_routed(
        &mut self,
        peer: PeerId,
        client_id: &str,
        req: u64,
        stamp: Stamp,
        ask: &[u64],
        now: u64,
    ) {
        let Some((id, _)) = self
            .claims
            .pending
            .get_key_value(client_id)
            .filter(|(_, c)| c.route == Some((peer, req)))
        else {
            return;
        };
        let id = id.clone();
        self.cluster.retained.observe(stamp);
        if self.claim_from(&id, stamp, Some(ask), now) {
            self.finish_claim(&id, true, now);
        }
    }

    /// The stamp of this node's claim of `client_id` waiting for answers.
    #[cfg(test)]
    pub(super) fn pending_claim_stamp(&self, client_id: &str) -> Option<Stamp> {
        self.claims.pending.get(client_id).map(|c| c.stamp)
    }

    /// Whether this node has a claim of `client_id` in flight.
    pub(super) fn claims_pending(&self, client_id: &str) -> bool {
        self.claims.pending.contains_key(client_id)
    }

    /// How long a claim waits for silent peers: a stalled home (SIGSTOP, a frozen VM) is
    /// found down only at the failure timeout, and then the owners answer from its copy;
    /// giving up before would start a fresh session without what was acknowledged for it.
    /// A claim that discards the session wants nothing back: it goes on after 3 s (the
    /// silent node ends its connection when it reads the claim, queued to it).
    fn claim_wait_ms(&self, discard: bool) -> u64 {
        if discard {
            return CLAIM_TIMEOUT_MS;
        }
        CLAIM_TIMEOUT_MS.max(self.cfg.cluster_takeover_ms + 2 * FOUND_DOWN_MS)
    }

    /// This node claims `client_id` anew with `stamp` (the client connected here again
    /// before the claim before was done): peers' claims deferred until that one was done
    /// are now older than ours and get their answer at once, as in `claim_received`, or
    /// they and ours would each wait for the other until the timeout.
    fn answer_older_deferred(&mut self, client_id: &str, stamp: Stamp) {
        if self.claims.deferred.is_empty() {
            return;
        }
        let deferred = std::mem::take(&mut self.claims.deferred);
        for (peer, id, theirs, discard) in deferred {
            if &*id == client_id && theirs < stamp {
                self.cluster
                    .queue_claim_answer(peer, client_id, theirs, &[], None, &[]);
            } else {
                self.claims.deferred.push((peer, id, theirs, discard));
            }
        }
    }

    /// A peer claims `client_id`.
    pub(super) fn claim_received(
        &mut self,
        peer: PeerId,
        client_id: &str,
        stamp: Stamp,
        discard: bool,
        now: u64,
    ) {
        self.cluster.retained.observe(stamp);
        self.will_on_claim(client_id, now);
        self.note_claimant(client_id, peer, stamp, now);
        if let Some(ours) = self.claims.pending.get(client_id) {
            if ours.stamp > stamp {
                // Ours is newer: theirs finds nothing here, and ours takes over from it.
                self.cluster
                    .queue_claim_answer(peer, client_id, stamp, &[], None, &[]);
            } else {
                // One per peer and client id (its newest): a peer cannot grow the list.
                self.claims
                    .deferred
                    .retain(|d| !(d.0 == peer && &*d.1 == client_id));
                self.claims
                    .deferred
                    .push((peer, Arc::from(client_id), stamp, discard));
            }
            return;
        }
        self.serve_claim(peer, client_id, stamp, discard, now);
    }

    /// Closes our connection of `client_id` and hands its session to `peer` (or ends it).
    pub(super) fn serve_claim(
        &mut self,
        peer: PeerId,
        client_id: &str,
        stamp: Stamp,
        discard: bool,
        now: u64,
    ) {
        let sid = self.by_client.get(client_id).copied();
        if sid.is_none() && self.claim_from_copy(peer, client_id, stamp, discard, now) {
            // Its home is down: answered from the copy here once read back.
            return;
        }
        // Made by a newer claim than this one, or, made by none, installed here after it
        // (taken over from a copy): a claim held up in a link's queue by a split arrives
        // after that. (One made by a claim is stamped anew once installed: that stamp is
        // after the claims racing with the one that made it.)
        let newer = sid
            .and_then(|sid| match self.claims.won.get(&sid) {
                Some(&won) => Some(won),
                None => self.session(sid).and_then(|s| s.stamp),
            })
            .is_some_and(|v| v > stamp);
        let live = sid.is_some_and(|sid| self.session(sid).is_some_and(|s| s.conn.is_some()));
        if newer && (live || discard) {
            // Newer, and its connection lives, or the claimant would end it (the claimant's
            // version gives way to it instead, told of it by the checks that follow a link
            // back: `copy_check_received`): it stays. (One whose client left goes to a claim
            // that takes it over, the client's latest connection: a claim's stamp is ordered
            // after another node's claim only through what its owner heard, and an owner new
            // to the partition may not have heard of it.)
            self.cluster
                .queue_claim_answer(peer, client_id, stamp, &[], None, &[]);
            return;
        }
        if let Some(sid) = sid {
            if let Some(conn) = self.session(sid).and_then(|s| s.conn) {
                // As a takeover on one node: the will goes as for an abnormal end.
                self.close(
                    conn,
                    Some(0x8E),
                    "session taken over by another node",
                    true,
                    now,
                );
            }
            // A session of expiry 0 ended with its connection.
            if self.session(sid).is_some() {
                // What waited for its confirmation goes with it (or ends with it).
                self.confirm(sid, now);
                if discard {
                    self.end_session(sid, now);
                } else {
                    self.send_session(sid, peer, client_id, stamp, now);
                    return;
                }
            }
        }
        self.cluster
            .queue_claim_answer(peer, client_id, stamp, &[], None, &[]);
    }

    /// Hands session `sid` of `client_id` over to `peer` in an answer to its claim stamped
    /// `stamp` (or in one no claim waits for: `cluster_leave`), and relays for it.
    pub(super) fn send_session(
        &mut self,
        sid: SessionId,
        peer: PeerId,
        client_id: &str,
        stamp: Stamp,
        now: u64,
    ) {
        let records = self.session_records(sid, true, now);
        let twin_on = self.cluster.peer_protocol(peer) >= HANDED_ON_PROTOCOL;
        let kept = self.moving_ids(sid, !twin_on, now);
        let twin = self
            .session(sid)
            .and_then(|s| s.recent.as_ref())
            .filter(|r| twin_on && now < r.twin_until && !r.twin.is_empty())
            .map(|r| {
                let ids: Vec<u128> = r.twin.iter().copied().collect();
                (r.twin_stamp, r.twin_node, ids, r.twin_handed)
            });
        let took = self.took_routed(sid);
        self.hand_over(sid, peer, true, now);
        self.claims.stats.sessions_out += 1;
        self.cluster
            .queue_claim_answer(peer, client_id, stamp, &records, None, &[]);
        if !took.is_empty() {
            self.cluster.queue_took_routed(peer, client_id, &took);
        }
        let relay = self.claims.relays.get(&sid);
        if relay.is_some_and(|r| r.lagging.is_empty())
            && self.cluster.peer_protocol(peer) >= RELAY_CAUGHT_UP_PROTOCOL
        {
            // No peer lagged: nothing it sent here late is to be waited for there.
            self.cluster.queue_kept_end(peer, client_id);
        }
        if let Some((home, marks, ids)) = kept {
            self.cluster
                .queue_kept_state(peer, client_id, home, &marks, ids.into_iter());
        }
        if let Some((stamp, node, ids, handed)) = twin {
            // What another version took while cut off, as that version's node said it: the
            // session skips those there too, but for that node's own hand-over of them
            // (passed on from here, `SessionMessage::origin`), and waits for that to end
            // unless it did here.
            self.cluster
                .queue_taken_ids(peer, client_id, stamp, node, &ids);
            if handed {
                self.cluster.queue_kept_end_from(peer, client_id, node);
            }
        }
        if !records.is_empty() {
            // Kept on disk in the same write that deletes the session's own records: it is
            // on one disk or the other whatever crashes.
            self.cluster.seal_for(peer);
            self.store_outgoing(peer);
        }
    }

    /// What a session handed over takes with it besides its records (`KeptState`): the
    /// ids of what reached it while its old home is dead (`cluster_kept`), or home 0 and
    /// those of what reached it since it moved here (`RECENT_MS`). A message sent to this
    /// node before the hand-over (through an old relay of it, or by a node that had not
    /// yet our rows) is then relayed on and delivered once.
    ///
    /// With `twin`, for a peer that does not tell a hand-over passed on from here (before
    /// protocol 15), those another version took too: the peer never delivers them then.
    fn moving_ids(
        &self,
        sid: SessionId,
        twin: bool,
        now: u64,
    ) -> Option<(u64, Vec<Mark>, Vec<u128>)> {
        let recent = self.session(sid)?.recent.as_ref()?;
        let fresh = now < recent.until;
        let mut kept = self.kept_state(sid, now).unwrap_or_default();
        if fresh {
            kept.2.extend(recent.ids.iter().copied());
        }
        if twin && now < recent.twin_until {
            // What another version took while cut off: still waiting in queues for here.
            kept.2.extend(recent.twin.iter().copied());
        }
        (kept.0 != 0 || !kept.2.is_empty()).then_some(kept)
    }

    /// A peer answered the claim with `stamp` (records: the session, if it held one;
    /// `copy`: read from its copy, current as of that moment of the session's home, with
    /// the home's `Applied` marks the copy holds).
    pub(super) fn claim_answered(
        &mut self,
        peer: PeerId,
        client_id: &str,
        stamp: Stamp,
        records: &[(&[u8], &[u8])],
        copy: Option<(u64, &[Mark])>,
        now: u64,
    ) {
        let marks = copy.map_or(&[][..], |c| c.1);
        if !records.is_empty() {
            let ours = self.claims.pending.get_mut(client_id);
            match ours {
                Some(claim) if claim.stamp == stamp && copy.is_some() => {
                    // Kept until every answer is in: another owner's copy may be more
                    // current (it acknowledged what this one had not got yet).
                    let at = copy.expect("checked").0;
                    if claim.best_copy.as_ref().is_none_or(|b| b.at < at) {
                        let owned = records.iter().map(|(k, v)| (k.to_vec(), v.to_vec()));
                        claim.best_copy = Some(CopyAnswer {
                            at,
                            from: peer,
                            records: owned.collect(),
                            marks: marks.to_vec(),
                        });
                    }
                }
                Some(claim) if claim.stamp == stamp => {
                    self.install_claimed(peer, client_id, records, &[], now);
                }
                _ if !self.by_client.contains_key(client_id) => {
                    // No claim waits (this node restarted, or gave up): kept, disconnected.
                    self.install_session(client_id, records, marks, now);
                }
                _ => {
                    // A session of this client is here already (a newer connect, made while
                    // the node handing this one over was out of reach): what that one held
                    // for the client goes to this one, unless it reached it another way.
                    let merged = self.merge_handed_over(client_id, records, now);
                    // Its messages are in the queue now: they go in their order.
                    self.kept_end_received((peer, 0), client_id, now);
                    self.event(
                        "claim_merged",
                        Arc::from(client_id),
                        format!(
                            "a session handed over arrived after a newer one: \
                             {merged} of its messages passed to it (once each)"
                        ),
                    );
                }
            }
        }
        if !records.is_empty()
            && copy.is_none()
            && peer != THIS_NODE
            && self.cluster.peer_protocol(peer) >= 8
        {
            // Its live home handed it over and relays for it until every node has our rows
            // for it (installed above).
            self.claims.releases.retain(|r| &*r.client_id != client_id);
            let home = self.cluster.peer_key(peer);
            let session = self.by_client.get(client_id).copied();
            if let Some(s) = session.and_then(|sid| self.session_mut(sid)) {
                let recent = s.recent.get_or_insert_with(Default::default);
                recent.relay_home = home;
                recent.relayed_by = home;
                // The old home's relay ends at the latest this long after it handed over.
                recent.relayed_until = now + RELAY_MAX_MS - RELAY_MS / 2;
            }
            self.claims.releases.push(RelayRelease {
                client_id: Arc::from(client_id),
                home: peer,
                rows: self.cluster.rows_now(),
                until: now + RELAY_MAX_MS,
            });
        }
        let done = match self.claims.pending.get_mut(client_id) {
            Some(claim) if claim.stamp == stamp => {
                claim.waiting.retain(|&p| p != peer);
                claim.waiting.is_empty()
            }
            _ => false,
        };
        if done {
            self.finish_claim(client_id, true, now);
        }
    }

    /// Delivers to the session of `client_id` here what an older version of it (`records`,
    /// handed over late) held for its client, unless it has it queued or in flight, or it
    /// reached it since it was installed (`deliver`: for `RECENT_MS`). Returns how many
    /// were passed to `deliver`.
    fn merge_handed_over(
        &mut self,
        client_id: &str,
        records: &[(&[u8], &[u8])],
        now: u64,
    ) -> usize {
        let Some(&sid) = self.by_client.get(client_id) else {
            return 0;
        };
        let mut merged = 0;
        for d in self.undelivered_in_records(records, now) {
            let known = self.session(sid).is_some_and(|s| {
                let ids = s.inflight.iter().map(|f| f.delivery.msg.id);
                ids.chain(s.queue.iter().map(|q| q.msg.id))
                    .any(|id| id != 0 && id == d.msg.id)
            });
            // Without an id a QoS 2 message could reach the client twice: left out.
            if known || (d.msg.id == 0 && d.qos == QoS::ExactlyOnce) {
                continue;
            }
            // `deliver` skips what reached the session since it was installed.
            let Delivery {
                msg,
                qos,
                retain,
                sub_ids,
                ..
            } = d;
            if self.deliver(sid, &msg, qos, retain, sub_ids, now) {
                merged += 1;
            }
        }
        merged
    }

    /// The session a claim of this node brought, from `peer` (an older version restored
    /// here gives way, with what waited for it); the CONNECT finds it when every answer is
    /// in.
    fn install_claimed(
        &mut self,
        peer: PeerId,
        client_id: &str,
        records: &[(&[u8], &[u8])],
        marks: &[Mark],
        now: u64,
    ) {
        let held = self.replace_unconfirmed(client_id, peer, now);
        if !self.by_client.contains_key(client_id) {
            self.install_session(client_id, records, marks, now);
        } else {
            // Another answer to this claim brought a version already (after a split, each
            // side may have held one): what this one held for the client is kept too.
            let merged = self.merge_handed_over(client_id, records, now);
            self.event(
                "claim_merged",
                Arc::from(client_id),
                format!(
                    "a second version of the session answered the claim: {merged} of its \
                     messages passed on (once each)"
                ),
            );
        }
        if let Some(&sid) = self.by_client.get(client_id) {
            self.deliver_held(sid, held, now);
        }
    }

    /// This node's copy of `client_id` (current as of `at`), read back for its own claim:
    /// taken as an answer.
    pub(super) fn own_copy_loaded(
        &mut self,
        client_id: &str,
        records: &[(&[u8], &[u8])],
        at: u64,
        marks: &[Mark],
        now: u64,
    ) {
        match self.claims.pending.get(client_id) {
            Some(claim) => {
                let stamp = claim.stamp;
                self.claim_answered(THIS_NODE, client_id, stamp, records, Some((at, marks)), now);
            }
            // The claim went on without it (its timeout): a session made meanwhile stays.
            None if self.by_client.contains_key(client_id) => {}
            None => self.install_session(client_id, records, marks, now),
        }
    }

    /// Installs a session from its store records (as another node holds them) and keeps
    /// them in this node's store. `marks`: read from a copy, how far its home had applied
    /// each node's batches (`cluster_kept`).
    pub(super) fn install_session(
        &mut self,
        client_id: &str,
        records: &[(&[u8], &[u8])],
        marks: &[Mark],
        now: u64,
    ) {
        let bad = self.restore(records);
        if self.cfg.durable {
            // Before what finish_restore writes (it may delete some of them again).
            for (key, value) in records {
                if !bad.iter().any(|(k, _)| k == key) {
                    self.store_ops.push((key.to_vec(), Some(value.to_vec())));
                }
            }
        }
        for (key, why) in bad {
            self.event(
                "claim_bad_record",
                Arc::from(client_id),
                format!("{}: {why}", String::from_utf8_lossy(&key)),
            );
        }
        let summary = self.finish_restore(now);
        self.claims.stats.sessions_in += summary.sessions as u64;
        if let Some(&sid) = self.by_client.get(client_id) {
            // The node that made the version brought (its home then).
            let home = self
                .session(sid)
                .and_then(|s| s.stamp)
                .map_or(0, |s| s.node);
            // A new version here, copied to the owners.
            self.installed(sid, now);
            self.start_recent(sid, now);
            self.note_arrival(sid);
            self.ask_kept(sid, home, marks, now);
        }
        if !self.cfg.durable {
            // finish_restore marks what it restores as stored; here nothing is.
            if let Some(&sid) = self.by_client.get(client_id) {
                if let Some(session) = self.session_mut(sid) {
                    session.stored = false;
                }
            }
        }
    }

    /// Session `sid` was just installed here from another node's records (or its client
    /// came back while a peer lags): for `RECENT_MS` it remembers the ids of what reaches
    /// it, starting with those of its records, and which lagging peers have yet to say what
    /// another version of it took (`RecentIds::untold`).
    pub(super) fn start_recent(&mut self, sid: SessionId, now: u64) {
        let lagging = self.cluster.lagging_keys(TAKEN_IDS_PROTOCOL, now);
        let Some(session) = self.session_mut(sid) else {
            return;
        };
        let mut recent = session.recent.take().unwrap_or_default();
        recent.until = now + RECENT_MS;
        let ids = session.inflight.iter().map(|f| f.delivery.msg.id);
        let ids = ids.chain(session.queue.iter().map(|d| d.msg.id));
        recent.ids.extend(ids.filter(|&id| id != 0));
        for key in lagging {
            if !recent.untold.contains(&key) {
                recent.untold.push(key);
            }
        }
        session.recent = Some(recent);
    }

    /// Ids of what reached session `sid` on the node it came from: taken once here too.
    pub(super) fn note_recent(&mut self, sid: SessionId, ids: &[u128]) {
        let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) else {
            return;
        };
        let room = RECENT_MAX.saturating_sub(recent.ids.len());
        let ids = ids.iter().copied().filter(|&id| id != 0);
        recent.ids.extend(ids.take(room));
    }

    /// Whether message `id` reached session `sid` since it moved here (it is remembered if
    /// not).
    pub(super) fn seen_since_move(&mut self, sid: SessionId, id: u128, now: u64) -> bool {
        let kept_from = self
            .session(sid)
            .and_then(|s| s.recent.as_ref())
            .map_or(0, |r| r.kept_from);
        // A home that is back (or gone from the cluster) sends on what it held soon.
        let home_back = kept_from != 0
            && self
                .cluster
                .peer_by_key(kept_from)
                .is_none_or(|p| self.cluster.peer_up(p));
        let Some(session) = self.session_mut(sid) else {
            return false;
        };
        let Some(recent) = session.recent.as_mut() else {
            return false;
        };
        if recent.kept_from != 0 {
            if home_back && recent.kept_until == 0 {
                recent.kept_until = now + RECENT_MS;
            }
            if recent.kept_until != 0 && now >= recent.kept_until {
                recent.kept_from = 0;
                recent.kept = Default::default();
            } else if !recent.kept.insert(id) {
                return true;
            } else if recent.kept.len() > KEPT_MAX {
                // Bounded: past this a repeat can get through.
                recent.kept.remove(&id);
            }
        }
        if now >= recent.until {
            if recent.kept_from == 0
                && recent.kept_waits.is_empty()
                && recent.relay_waits.is_empty()
                && recent.direct_waits.is_empty()
                && recent.twin.is_empty()
                && recent.untold.is_empty()
            {
                session.recent = None;
            } else if !recent.ids.is_empty() {
                recent.ids = Default::default();
            }
            return false;
        }
        if recent.ids.len() >= RECENT_MAX {
            return recent.ids.contains(&id);
        }
        !recent.ids.insert(id)
    }

    /// Every answer is in (or no more can come): the CONNECT goes on, and the newer claims
    /// of peers that waited for it are served.
    /// `run`: what the client sent while it waited is handled now (not when the CONNECT is
    /// being handled: its reading goes on).
    fn finish_claim(&mut self, client_id: &str, run: bool, now: u64) {
        let Some(mut claim) = self.claims.pending.remove(client_id) else {
            return;
        };
        if let Some(best) = claim.best_copy.take() {
            // The most current copy, unless the live home answered (its session is here),
            // or it is this node's own and this side no longer acts on copies: a split is
            // found one link at a time, and a copy read back when the home's link went
            // down, the others still up, would be resumed here once the last one closed
            // (`cluster_authority`). It stays here as a copy. (A peer that answered from
            // its copy dropped it: that one is installed, not lost.)
            if best.from == THIS_NODE && !self.acts_on_copies() {
                claim.out_of_reach = true;
            } else if !self.by_client.contains_key(client_id) {
                let pairs: Vec<(&[u8], &[u8])> =
                    best.records.iter().map(|(k, v)| (&k[..], &v[..])).collect();
                self.install_claimed(best.from, client_id, &pairs, &best.marks, now);
            }
        }
        // The connection may have closed meanwhile (its slot even reused).
        let mut live = self.conn(claim.conn).is_some_and(|c| {
            c.state == ConnState::AwaitClaim && c.client_id == claim.connect.client_id
        });
        let id = claim.connect.client_id.clone();
        if live && claim.out_of_reach && !self.by_client.contains_key(&id) {
            self.refuse_out_of_reach(claim.conn);
            live = false;
        }
        let clean = claim.connect.connect.clean_start;
        if live {
            self.accept_connect_here(
                claim.conn,
                claim.connect,
                claim.auth_method,
                claim.auth_data,
                now,
            );
            if let Some(&sid) = self.by_client.get(&id) {
                self.claims.won.insert(sid, claim.stamp);
            }
        }
        match self.by_client.get(&id).copied() {
            // After what the session brought (a clean start wanted none of it).
            Some(sid) if !clean => {
                for e in claim.early {
                    if e.from
                        .is_some_and(|k| self.twin_took(sid, e.msg.id, k, now))
                    {
                        continue;
                    }
                    if let Some((from, also)) = &e.routed {
                        // It may have overtaken older ones the session's old home relays.
                        self.wait_for_relay(sid, e.msg.id, *from, also, now);
                    }
                    self.deliver(sid, &e.msg, e.qos, e.retain, e.sub_ids, now);
                }
            }
            Some(_) => {}
            // Refused: the session stays where it is, and so goes what was caught for it.
            None => self.pass_on_early(&id, claim.early, now),
        }
        if live && run {
            // What the client sent while it waited is handled now.
            self.run(claim.conn, now);
        }
        let deferred: Vec<_> = {
            let (mine, rest) = std::mem::take(&mut self.claims.deferred)
                .into_iter()
                .partition(|(_, id, _, _)| &**id == client_id);
            self.claims.deferred = rest;
            mine
        };
        for (peer, id, stamp, discard) in deferred {
            self.serve_claim(peer, &id, stamp, discard, now);
        }
    }

    /// Messages a refused claim caught for its session (`Claim::early`) go on to where the
    /// session is, if this node relays for it; otherwise nothing here knows where it went.
    fn pass_on_early(&mut self, client_id: &str, early: Vec<EarlyMessage>, now: u64) {
        if early.is_empty() {
            return;
        }
        let Some(peer) = self.relay_of(client_id) else {
            self.event(
                "relay_dropped",
                Arc::from(client_id),
                format!("{} messages caught for a refused claim", early.len()),
            );
            return;
        };
        for e in early {
            let kind = (SessionMessageKind::Relayed, e.from.unwrap_or(0));
            let also = e.routed.as_ref().map_or(&[][..], |r| &r.1[..]);
            self.relay_to(
                peer, client_id, &e.msg, e.qos, e.retain, &e.sub_ids, kind, also, now,
            );
        }
    }

    /// Sends a message of session `client_id` on to `peer`, where the session went (`also`:
    /// the other nodes its publishing node sent it to), as `kind`, handed on from the node
    /// with key `origin` (0: from here).
    #[allow(clippy::too_many_arguments)]
    fn relay_to(
        &mut self,
        peer: PeerId,
        client_id: &str,
        msg: &Arc<Message>,
        qos: QoS,
        retain: bool,
        sub_ids: &[u32],
        (kind, origin): (SessionMessageKind, u64),
        also: &[u64],
        now: u64,
    ) {
        self.claims.stats.relayed += 1;
        self.cluster.queue_session_message(
            peer, client_id, msg, qos, retain, sub_ids, kind, also, origin, now,
        );
        if qos != QoS::AtMostOnce {
            // Kept on disk with the write that acknowledges it to its sender.
            self.cluster.seal_for(peer);
            self.store_outgoing(peer);
        }
    }

    /// Peer `peer`'s link went down: claims stop waiting for it.
    pub(super) fn claims_peer_down(&mut self, peer: PeerId, now: u64) {
        // Claims that owner was to stamp go through the next one in reach.
        let unrouted: Vec<Arc<str>> = self
            .claims
            .pending
            .iter()
            .filter(|(_, c)| c.route.is_some_and(|r| r.0 == peer))
            .map(|(id, _)| id.clone())
            .collect();
        for id in unrouted {
            if self.route_claim(&id, false, now) {
                self.finish_claim(&id, true, now);
            }
        }
        // A claim for a client of that peer whose copy is here reads it back.
        let own: Vec<Arc<str>> = self
            .claims
            .pending
            .iter()
            .filter(|(_, c)| !c.discard && !c.waiting.contains(&THIS_NODE))
            .map(|(id, _)| id.clone())
            .collect();
        for id in own {
            if self.claim_own_copy(&id, Some(peer)) {
                if let Some(claim) = self.claims.pending.get_mut(&id) {
                    claim.waiting.push(THIS_NODE);
                }
            }
        }
        let key = self.cluster.peer_key(peer);
        let done: Vec<Arc<str>> = self
            .claims
            .pending
            .iter_mut()
            .filter_map(|(id, claim)| {
                let before = claim.waiting.len();
                claim.waiting.retain(|&p| p != peer);
                // Gone without answering, it may hold the session (cut off by a split, its
                // link found down only now): no fresh session here, unless a copy answers.
                let may_hold = claim.named.as_ref().is_none_or(|n| n.contains(&key));
                if claim.waiting.len() < before && may_hold && !claim.discard {
                    claim.out_of_reach = true;
                }
                claim.waiting.is_empty().then(|| id.clone())
            })
            .collect();
        self.claims.deferred.retain(|d| d.0 != peer);
        for id in done {
            self.finish_claim(&id, true, now);
        }
        // Claims waiting on this node's copies: a home that went down is answered for.
        self.watch_copies(now);
    }

    /// Claims past their deadline go on without the missing answers; relays past theirs end.
    pub(super) fn claims_tick(&mut self, now: u64) {
        if !self.claims.releases.is_empty() {
            self.release_relays(now);
        }
        if !self.claims.relays.is_empty() {
            // A peer out of reach, or not yet heard from since its link came back, may hold
            // batches sent here before it learned where the sessions went (a split that
            // began as it published): its link sends them again when it comes back, and
            // they must still find the relay. So relays end `RELAY_MS` after every peer is
            // in touch again (`RELAY_MAX_MS` after the hand-over at most).
            if !self.cluster.all_in_touch(now) {
                for relay in self.claims.relays.values_mut() {
                    relay.until = relay.until.max(now + RELAY_MS).min(relay.cap);
                }
            }
            let done: Vec<SessionId> = self
                .claims
                .relays
                .iter()
                .filter(|(_, r)| now >= r.until && (r.lagging.is_empty() || now >= r.cap))
                .map(|(&sid, _)| sid)
                .collect();
            for sid in done {
                self.end_relay(sid);
            }
        }
        if self.claims.pending.is_empty() {
            return;
        }
        let late: Vec<Arc<str>> = self
            .claims
            .pending
            .iter()
            .filter(|(_, c)| now >= c.deadline)
            .map(|(id, _)| id.clone())
            .collect();
        for id in late {
            self.claims.stats.timed_out += 1;
            if self
                .claims
                .pending
                .get(&id)
                .is_some_and(|c| c.route.is_some())
            {
                // No owner stamped it in time: it goes to every node in reach, so that a
                // connection of the client elsewhere still ends when its node reads it.
                self.route_claim(&id, true, now);
            }
            if let Some(claim) = self.claims.pending.get_mut(&id) {
                // A peer that did not answer may hold the session (a stalled home, or one
                // cut off by a split whose link is not found down yet).
                let unanswered = claim.waiting.iter().any(|&p| p != THIS_NODE);
                claim.out_of_reach |= unanswered && !claim.discard;
            }
            self.finish_claim(&id, true, now);
        }
        // An owner up but silent (stalled) does not stamp a claim: the next one does.
        let unrouted: Vec<Arc<str>> = self
            .claims
            .pending
            .iter()
            .filter(|(_, c)| c.route.is_some() && now >= c.route_until)
            .map(|(id, _)| id.clone())
            .collect();
        for id in unrouted {
            let claim = self.claims.pending.get_mut(&id).expect("listed");
            let (owner, _) = claim.route.take().expect("listed");
            claim.silent.push(owner);
            if self.route_claim(&id, false, now) {
                self.finish_claim(&id, true, now);
            }
        }
    }

    /// The connection of a claim closed before the answers came: the answers are still
    /// taken (a session they bring is kept, disconnected).
    pub(super) fn claim_conn_closed(&mut self, id: ConnId) {
        for claim in self.claims.pending.values_mut() {
            if claim.conn == id {
                claim.conn = ConnId::MAX;
            }
        }
    }

    /// Whether a session of `client_id` relays here.
    pub(super) fn relays_client(&self, client_id: &str) -> bool {
        self.claims.relays.keys().any(|&sid| {
            self.session(sid)
                .is_some_and(|s| &*s.client_id == client_id)
        })
    }

    pub fn claim_stats(&self) -> ClaimStats {
        self.claims.stats
    }

    /// Sessions this node still relays for (handed over, their new homes not yet known to
    /// every node for long enough): a leaving node waits for them to end.
    pub fn cluster_relays(&self) -> usize {
        self.claims.relays.len()
    }

    /// Where this node relays `client_id`'s messages to, if anywhere.
    pub(super) fn relay_of(&self, client_id: &str) -> Option<PeerId> {
        self.claims.relays.iter().find_map(|(&sid, r)| {
            self.session(sid)
                .is_some_and(|s| &*s.client_id == client_id)
                .then_some(r.to)
        })
    }

    /// Session `sid` went to `peer` (its records in the batch being written): its records
    /// here go, its state is empty, its client id is free here, and its subscriptions relay
    /// to `peer`: for `RELAY_MS`, or (`long`: `peer` claimed it, and speaks protocol 8)
    /// until `peer` says every node has its rows. No will: it lives on there.
    pub(super) fn hand_over(&mut self, sid: SessionId, peer: PeerId, long: bool, now: u64) {
        // One relay per client id: the newest (an older one points back along its moves).
        let client = self.session(sid).map(|s| s.client_id.clone());
        if let Some(client) = client {
            let old: Vec<SessionId> = self
                .claims
                .relays
                .keys()
                .copied()
                .filter(|&o| o != sid && self.session(o).is_some_and(|s| s.client_id == client))
                .collect();
            for o in old {
                self.end_relay(o);
            }
        }
        self.unpersist_session(sid);
        let session = self.session_mut(sid).expect("caller checked");
        session.queue.clear();
        session.queued_bytes = 0;
        session.inflight.clear();
        if let Some(rare) = session.rare.as_mut() {
            rare.inflight_ids = None;
        }
        session.inbound_qos2 = Default::default();
        session.take_pending_will();
        if let Some(recent) = session.recent.as_mut() {
            recent.relay_waits.clear();
            recent.direct_waits.clear();
        }
        let id = session.client_id.clone();
        if self.by_client.get(&id) == Some(&sid) {
            self.by_client.remove(&id);
            self.registry_note(&id);
        }
        // A claimant of protocol 8 says when every node has its rows (`RelayEnd`).
        let relay = if long && self.cluster.peer_protocol(peer) >= 8 {
            RELAY_MAX_MS
        } else {
            RELAY_MS
        };
        // Peers that lag may have sent this session's messages here before they learn
        // where it went: the new home holds what they send it directly until this node
        // says it took theirs in (`relay_caught_up`), so that they go to the client first.
        let to = self.cluster.peer_key(peer);
        let lagging: Vec<u64> = self
            .cluster
            .lagging_keys(0, now)
            .into_iter()
            .filter(|&k| k != to)
            .collect();
        self.claims.relays.insert(
            sid,
            Relay {
                to: peer,
                until: now + relay,
                cap: now + RELAY_MAX_MS,
                lagging,
            },
        );
    }

    /// Whether session `client_id` came here from `peer` (handed over by it while it lived
    /// there, and that peer still relays for it).
    pub(super) fn came_from(&self, peer: PeerId, client_id: &str) -> bool {
        let releases = &self.claims.releases;
        releases
            .iter()
            .any(|r| r.home == peer && &*r.client_id == client_id)
    }

    /// Peer `peer`, which session `client_id` moved to from here, says every node has its
    /// rows for it: the relay ends after what was sent before them had time to arrive.
    pub(super) fn relay_end_received(&mut self, peer: PeerId, client_id: &str, now: u64) {
        let end = now + RELAY_MS;
        let Some(sid) = self.claims.relays.iter().find_map(|(&sid, r)| {
            (r.to == peer
                && self
                    .session(sid)
                    .is_some_and(|s| &*s.client_id == client_id))
            .then_some(sid)
        }) else {
            return;
        };
        if let Some(relay) = self.claims.relays.get_mut(&sid) {
            relay.until = relay.until.min(end);
        }
    }

    /// Peer `peer` sent its rows (after what its link held for this node): the relays that
    /// waited for it have relayed all it sent here before it learned where their sessions
    /// went, and the last of them to wait tells its new home so (`KeptEnd`).
    pub(super) fn relay_caught_up(&mut self, peer: PeerId) {
        if self.claims.relays.is_empty() {
            return;
        }
        let key = self.cluster.peer_key(peer);
        let mut done = Vec::new();
        for (&sid, r) in self.claims.relays.iter_mut() {
            let before = r.lagging.len();
            r.lagging.retain(|&k| k != key);
            if before > 0 && r.lagging.is_empty() {
                done.push((sid, r.to));
            }
        }
        for (sid, to) in done {
            let Some(client) = self.session(sid).map(|s| s.client_id.clone()) else {
                continue;
            };
            if self.cluster.peer_protocol(to) >= RELAY_CAUGHT_UP_PROTOCOL {
                self.cluster.queue_kept_end(to, &client);
            }
        }
    }

    /// New homes of sessions that came from a live home tell it once every peer holds
    /// their rows; until then the sessions remember the ids of what reaches them (the old
    /// home relays what also came here).
    fn release_relays(&mut self, now: u64) {
        let held = self.cluster.rows_held_by_all();
        let releases = std::mem::take(&mut self.claims.releases);
        for r in releases {
            if r.rows <= held {
                self.cluster.queue_relay_end(r.home, &r.client_id);
                // It relays for `RELAY_MS` more once it hears this.
                self.relay_order_ends(&r.client_id, now + RELAY_MS / 2);
                continue;
            }
            if now >= r.until {
                continue;
            }
            if let Some(&sid) = self.by_client.get(&r.client_id) {
                if let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) {
                    recent.until = recent.until.max(now + RECENT_MS);
                }
            }
            self.claims.releases.push(r);
        }
    }

    /// The relay of `sid` ends: its subscriptions go (and with them this node's route rows,
    /// if no other session here holds their filters).
    fn end_relay(&mut self, sid: SessionId) {
        if self.claims.relays.contains_key(&sid) {
            if let Some(client) = self.session(sid).map(|s| s.client_id.clone()) {
                self.replicas.forget_installed(&client);
            }
            self.remove_session(sid);
        }
    }

    /// `msg` matched a subscription of `sid`, which moved to another node: sent on there,
    /// unless it came from that node or that node got it for its own plain subscriptions
    /// (`plain`: the match was a plain subscription, not a shared group's pick). True if it
    /// went on.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn relay(
        &mut self,
        sid: SessionId,
        msg: &Arc<Message>,
        qos: QoS,
        retain: bool,
        sub_ids: Vec<u32>,
        plain: bool,
        scope: Scope<'_>,
        now: u64,
    ) -> bool {
        let Some(peer) = self.claims.relays.get(&sid).map(|r| r.to) else {
            return false;
        };
        let Some(session) = self.session(sid) else {
            return false;
        };
        let client_id = session.client_id.clone();
        if self.by_client.contains_key(&client_id) {
            // The client is back here: the relay is over.
            self.end_relay(sid);
            return false;
        }
        if let Some(claim) = self.claims.pending.get_mut(&client_id) {
            // The client is coming back here: the session follows, and so does this. (The
            // node it moved to may have it too: its id tells once the session is here.)
            let routed = match scope {
                Scope::Forwarded { from, also, .. } if plain => Some((from, also.to_vec())),
                _ => None,
            };
            let from = match scope {
                Scope::Origin => None,
                _ => Some(0),
            };
            claim.early.push(EarlyMessage {
                msg: msg.clone(),
                qos,
                retain,
                sub_ids,
                routed,
                from,
            });
            return true;
        }
        let skip = match scope {
            Scope::Forwarded { from, also, .. } => {
                // What the new home routed before it had the session goes to it (the same
                // link's order tells). Whether it routed a message that reached it from a
                // third node before or after it had the session, only it knows: such a
                // message goes too, and its id tells the session a second copy. One
                // without an id (from a peer of protocol 4), or for a new home whose link
                // is down (it could arrive after the session forgot the ids), is skipped.
                let guess = msg.id == 0 || !self.cluster.peer_up(peer);
                (from == peer && self.routes_itself(peer, &client_id))
                    || (plain && guess && also.contains(&self.cluster.peer_key(peer)))
            }
            // Sent there after the session on the same link: it routes it itself.
            Scope::Origin => plain && self.cluster.plans_plain(peer),
        };
        if skip {
            return false;
        }
        let kind = (SessionMessageKind::Relayed, 0);
        let also = match scope {
            Scope::Forwarded { also, .. } if plain => also,
            _ => &[],
        };
        self.relay_to(
            peer, &client_id, msg, qos, retain, &sub_ids, kind, also, now,
        );
        true
    }

    /// A message relayed to session `client_id`, which moved here (`Kept`: one another node
    /// kept for its dead home, see `cluster_kept`; `Released`: one another version of the
    /// session had sent PUBREL for as it gave way, `cluster_replicas::take_released`), by
    /// peer `from.0`, which got it from the node with key `from.1` (0: its own).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn relayed(
        &mut self,
        (from, origin): (PeerId, u64),
        client_id: &str,
        msg: Arc<Message>,
        qos: u8,
        retain: bool,
        sub_ids: Vec<u32>,
        kind: SessionMessageKind,
        also: &[u64],
        now: u64,
    ) {
        let qos = match qos {
            2 => QoS::ExactlyOnce,
            1 => QoS::AtLeastOnce,
            _ => QoS::AtMostOnce,
        };
        let key = self.cluster.peer_key(from);
        let origin = if origin != 0 { origin } else { key };
        let Some(&sid) = self.by_client.get(client_id) else {
            if let Some(claim) = self.claims.pending.get_mut(client_id) {
                claim.early.push(EarlyMessage {
                    msg,
                    qos,
                    retain,
                    sub_ids,
                    routed: None,
                    from: Some(origin),
                });
                return;
            }
            if let Some(peer) = self.relay_of(client_id) {
                // The session moved on from here meanwhile: so does this (relays point to
                // where the session went next, so the chain ends where it is), saying where
                // it came from (a hand-over of another version is told by its node).
                let how = (kind, origin);
                self.replicas.stats.handed_on += 1;
                self.relay_to(peer, client_id, &msg, qos, retain, &sub_ids, how, also, now);
                return;
            }
            self.event(
                "relay_dropped",
                Arc::from(client_id),
                "no session for a relayed message".into(),
            );
            return;
        };
        let id = msg.id;
        if self.twin_took(sid, id, origin, now) {
            return;
        }
        if self.put_off_after_released(sid, &msg, qos, retain, &sub_ids, kind) {
            return;
        }
        if let (SessionMessageKind::Released(pkid), QoS::ExactlyOnce) = (kind, qos) {
            self.take_released(sid, &msg, retain, &sub_ids, pkid, now);
            return;
        }
        if kind == SessionMessageKind::Relayed {
            self.wait_for_direct(sid, id, also, now);
        }
        self.deliver(sid, &msg, qos, retain, sub_ids, now);
        if kind == SessionMessageKind::Kept {
            self.note_kept(sid, id);
        }
        if kind == SessionMessageKind::Relayed {
            self.relayed_copy_came(sid, id, key, now);
        }
    }
}
