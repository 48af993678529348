//! One session per client id across the cluster, and sessions that follow their client to
//! the node it reconnects to (docs/cluster-sessions.md).
//!
//! - **Claims.** A CONNECT accepted here for a client id is held (its connection is not
//!   read) while a `Claim`, stamped with this node's hybrid logical clock, goes to every
//!   reachable peer of protocol 3. A peer that holds the client closes its connection
//!   (DISCONNECT 0x8E, as a takeover on one node) and answers with the session's store
//!   records, or ends the session if the claim discards it (clean start, or this node holds
//!   one already); a peer without it answers with none. The CONNECT goes on once every peer
//!   asked has answered or gone down, or after `CLAIM_TIMEOUT_MS`, with the session the
//!   answers brought (session present = 1).
//! - **Races.** The highest stamp wins. A node with its own claim out for the client answers
//!   an older claim at once with none, and serves a newer one only after its own completed
//!   (then as a takeover), so every node ends with the newest connect alive and no claim
//!   waits on one that waits on it.
//! - **No loss in the hand-over.** The session's records leave the old home in a reliable
//!   batch kept in its store in the same write that deletes them, so a crash of either node
//!   at any point leaves them on one disk at least. An answer that finds no claim waiting
//!   (the claimant restarted, or gave up) is installed as a disconnected session.
//!
//! Not yet (issue 16): claims go to every reachable node, not through the partition's
//! primary; a message published on a third node while the route rows move (one link round
//! trip) can miss the moving session; copies on replicas.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::cluster::PeerId;
use super::connect::PendingConnect;
use super::state::{ConnState, SessionId};
use super::{ConnId, Engine};
use crate::cluster::batch::Stamp;

/// How long a claim waits for a peer whose link is up but that does not answer.
const CLAIM_TIMEOUT_MS: u64 = 3_000;

/// A CONNECT of this node waiting for the answers to its claim.
struct Claim {
    conn: ConnId,
    stamp: Stamp,
    connect: PendingConnect,
    auth_method: Option<String>,
    auth_data: Option<Bytes>,
    /// Peers whose answer is still awaited.
    waiting: Vec<PeerId>,
    deadline: u64,
}

#[derive(Default)]
pub(super) struct Claims {
    /// This node's claims in flight, by client id.
    pending: HashMap<Arc<str>, Claim>,
    /// Newer claims of peers for a client id this node claims too, served once ours is done.
    deferred: Vec<(PeerId, Arc<str>, Stamp, bool)>,
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
}

impl Engine {
    /// Whether the CONNECT must first claim its client id from the other nodes.
    fn claim_needed(&self, pending: &PendingConnect) -> bool {
        // An id the broker assigned is new everywhere.
        pending.assigned.is_none() && !self.cluster.claim_peers().is_empty()
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
        if !self.claim_needed(&pending) {
            return self.accept_connect_here(id, pending, auth_method, auth_data, now);
        }
        let client_id = pending.client_id.clone();
        if let Some(old) = self.claims.pending.remove(&client_id) {
            // The same client connected here again meanwhile: the newer CONNECT goes on.
            self.refuse(old.conn, 0x89, "a newer CONNECT of this client arrived");
        }
        let wall = self.wall(now);
        let stamp = self.cluster.retained.next(wall);
        let discard = pending.connect.clean_start || self.by_client.contains_key(&client_id);
        let peers = self.cluster.claim_peers();
        for &peer in &peers {
            self.cluster.queue_claim(peer, &client_id, stamp, discard);
        }
        self.claims.stats.made += 1;
        self.conn_mut(id).expect("caller checked").state = ConnState::AwaitClaim;
        self.claims.pending.insert(
            client_id,
            Claim {
                conn: id,
                stamp,
                connect: pending,
                auth_method,
                auth_data,
                waiting: peers,
                deadline: now + CLAIM_TIMEOUT_MS,
            },
        );
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
        if let Some(ours) = self.claims.pending.get(client_id) {
            if ours.stamp > stamp {
                // Ours is newer: theirs finds nothing here, and ours takes over from it.
                self.cluster.queue_claim_answer(peer, client_id, stamp, &[]);
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
    fn serve_claim(
        &mut self,
        peer: PeerId,
        client_id: &str,
        stamp: Stamp,
        discard: bool,
        now: u64,
    ) {
        let mut records = Vec::new();
        if let Some(&sid) = self.by_client.get(client_id) {
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
                if discard {
                    self.end_session(sid, now);
                } else {
                    records = self.session_records(sid, now);
                    self.take_session(sid);
                    self.claims.stats.sessions_out += 1;
                }
            }
        }
        self.cluster
            .queue_claim_answer(peer, client_id, stamp, &records);
        if !records.is_empty() {
            // Kept on disk in the same write that deletes the session's own records: it is
            // on one disk or the other whatever crashes.
            self.cluster.seal_for(peer);
            self.store_outgoing(peer);
        }
    }

    /// A peer answered the claim with `stamp` (records: the session, if it held one).
    pub(super) fn claim_answered(
        &mut self,
        peer: PeerId,
        client_id: &str,
        stamp: Stamp,
        records: &[(&[u8], &[u8])],
        now: u64,
    ) {
        if !records.is_empty() {
            let ours = self.claims.pending.get(client_id);
            match ours {
                Some(claim) if claim.stamp == stamp => {
                    // Installed now: the CONNECT finds it when every answer is in.
                    if !self.by_client.contains_key(client_id) {
                        self.install_session(client_id, records, now);
                    }
                }
                _ if !self.by_client.contains_key(client_id) => {
                    // No claim waits (this node restarted, or gave up): kept, disconnected.
                    self.install_session(client_id, records, now);
                }
                _ => {
                    // A session of this client is here already (a newer connect): the
                    // handed-over one is dropped.
                    self.event(
                        "claim_dropped",
                        Arc::from(client_id),
                        "a session handed over arrived after a newer one".into(),
                    );
                }
            }
        }
        let done = match self.claims.pending.get_mut(client_id) {
            Some(claim) if claim.stamp == stamp => {
                claim.waiting.retain(|&p| p != peer);
                claim.waiting.is_empty()
            }
            _ => false,
        };
        if done {
            self.finish_claim(client_id, now);
        }
    }

    /// Installs a session from its store records (as another node holds them) and keeps
    /// them in this node's store.
    fn install_session(&mut self, client_id: &str, records: &[(&[u8], &[u8])], now: u64) {
        if self.cfg.durable {
            for (key, value) in records {
                self.store_ops.push((key.to_vec(), Some(value.to_vec())));
            }
        }
        let bad = self.restore(records);
        for (key, why) in bad {
            self.event(
                "claim_bad_record",
                Arc::from(""),
                format!("{}: {why}", String::from_utf8_lossy(&key)),
            );
        }
        let summary = self.finish_restore(now);
        self.claims.stats.sessions_in += summary.sessions as u64;
        if !self.cfg.durable {
            // finish_restore marks what it restores as stored; here nothing is.
            if let Some(&sid) = self.by_client.get(client_id) {
                if let Some(session) = self.session_mut(sid) {
                    session.stored = false;
                }
            }
        }
    }

    /// Every answer is in (or no more can come): the CONNECT goes on, and the newer claims
    /// of peers that waited for it are served.
    fn finish_claim(&mut self, client_id: &str, now: u64) {
        let Some(claim) = self.claims.pending.remove(client_id) else {
            return;
        };
        // The connection may have closed meanwhile (its slot even reused).
        let live = self.conn(claim.conn).is_some_and(|c| {
            c.state == ConnState::AwaitClaim && c.client_id == claim.connect.client_id
        });
        if live {
            self.accept_connect_here(
                claim.conn,
                claim.connect,
                claim.auth_method,
                claim.auth_data,
                now,
            );
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

    /// Peer `peer`'s link went down: claims stop waiting for it.
    pub(super) fn claims_peer_down(&mut self, peer: PeerId, now: u64) {
        let done: Vec<Arc<str>> = self
            .claims
            .pending
            .iter_mut()
            .filter_map(|(id, claim)| {
                claim.waiting.retain(|&p| p != peer);
                claim.waiting.is_empty().then(|| id.clone())
            })
            .collect();
        self.claims.deferred.retain(|d| d.0 != peer);
        for id in done {
            self.finish_claim(&id, now);
        }
    }

    /// Claims past their deadline go on without the missing answers.
    pub(super) fn claims_tick(&mut self, now: u64) {
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
            self.finish_claim(&id, now);
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

    pub fn claim_stats(&self) -> ClaimStats {
        self.claims.stats
    }

    /// Removes session `sid` with all its records, without publishing its will: it lives on
    /// elsewhere.
    fn take_session(&mut self, sid: SessionId) {
        self.unpersist_session(sid);
        if let Some(session) = self.remove_session(sid) {
            drop(session);
        }
    }
}
