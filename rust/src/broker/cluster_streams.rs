//! Copies streamed to a partition's new owners after a map change (issue 16), paced so that
//! rebalancing never starves client traffic, with the former owners' copies kept until the
//! new owners hold theirs.
//!
//! - **Queued, then paced.** At a map change each stored session homed here whose partition
//!   gained owners is queued with the owners it gained and those it left (`Stream`). Each
//!   tick sends whole sessions to the owners gained (`copy_session`: the records the store
//!   holds, as one batch's items), while each one's link has less than `STREAM_QUEUED_MAX`
//!   bytes unacknowledged and until `STREAM_TICK_BYTES` went out in the tick: the pace is
//!   the new owners' acknowledgements, below the level at which publishers are held
//!   (`HOLD_ABOVE`), and nothing is dropped by the links' bounds.
//! - **No window without a copy.** Until a new owner has been sent its full copy, the
//!   session's store operations go to the former owners instead (they hold a current copy
//!   and count for `ack_replicas`); from its full copy on, the new owner gets them. Once
//!   every new owner has acknowledged (and copied) the batch its copy ended in, each former
//!   owner is told to drop its copy: a deletion of the session record, which ends a copy on
//!   any node. A home that dies before then leaves a full copy on a former owner, which
//!   answers claims as an owner would.
//! - **Asked for.** An owner with no copy of a session it is told about when its link comes
//!   up (`CopyCheck`: it restarted with an empty disk, or its home restarted before streaming
//!   to it) says so in its answer (protocol 6), and is streamed a copy the same way.
//!
//! A former owner keeps, at a map change, the copies whose home speaks protocol 6 (the home
//! releases them); those of older homes go at once, as before.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::cluster::PeerId;
use super::Engine;
use crate::store::records;

/// Unacknowledged bytes on a new owner's link past which no more sessions are streamed to it
/// this tick: half of `HOLD_ABOVE`, so client publishes to that peer are never held for it.
const STREAM_QUEUED_MAX: usize = 8 << 20;
/// Bytes of session records streamed per tick (ticks are 100 ms apart), at least one session.
const STREAM_TICK_BYTES: usize = 4 << 20;
/// Queued sessions looked at per tick at most (a backlog waiting for a full or down owner
/// costs the tick no more than this).
const STREAM_TICK_SESSIONS: usize = 4096;

/// A session of this node whose copies move between owners.
#[derive(Default)]
struct Stream {
    /// Owners gained that have not been sent the session in full yet.
    to: Vec<PeerId>,
    /// Owners it was sent to, with the batch that carried the end of it.
    sent: Vec<(PeerId, u64)>,
    /// Former owners that hold a copy until every new owner has its own.
    keep: Vec<PeerId>,
    /// In `Streams::order` (some of `to` waits to be sent).
    queued: bool,
}

#[derive(Default)]
pub(super) struct Streams {
    pending: HashMap<Arc<str>, Stream>,
    /// Sessions with owners to send to, oldest first.
    order: VecDeque<Arc<str>>,
    /// Sessions sent to every new owner, waiting for their acknowledgements.
    awaiting: Vec<Arc<str>>,
    /// Sessions sent in full to a new owner, since start.
    pub(super) streamed: u64,
}

impl Streams {
    pub(super) fn backlog(&self) -> u64 {
        self.pending.len() as u64
    }

    /// Where the store operations of `client`'s session go: the owners `targets` (this node
    /// left out), less those still waiting for the full copy, plus the former owners that
    /// keep theirs meanwhile.
    pub(super) fn adjust_targets(&self, client: &str, targets: &mut Vec<PeerId>) {
        if self.pending.is_empty() {
            return;
        }
        if let Some(s) = self.pending.get(client) {
            targets.retain(|p| !s.to.contains(p));
            for &p in &s.keep {
                if !targets.contains(&p) {
                    targets.push(p);
                }
            }
        }
    }

    /// Whether former owner `peer` keeps its copy of `client`'s session for now.
    pub(super) fn keeps(&self, client: &str, peer: PeerId) -> bool {
        self.pending
            .get(client)
            .is_some_and(|s| s.keep.contains(&peer))
    }

    /// `client`'s session is to be sent in full to `gained`, and the copies of `left` kept
    /// until they have it. `owners`: the partition's owners now (this node left out).
    pub(super) fn add(
        &mut self,
        client: &Arc<str>,
        gained: &[PeerId],
        left: &[PeerId],
        owners: &[PeerId],
    ) {
        if gained.is_empty() && left.is_empty() && !self.pending.contains_key(client) {
            return;
        }
        let s = self.pending.entry(client.clone()).or_default();
        for &p in gained {
            s.sent.retain(|&(q, _)| q != p);
            if !s.to.contains(&p) {
                s.to.push(p);
            }
        }
        for &p in left {
            if !s.keep.contains(&p) {
                s.keep.push(p);
            }
        }
        // A later map may have moved the partition again.
        s.to.retain(|p| owners.contains(p));
        s.sent.retain(|(p, _)| owners.contains(p));
        s.keep.retain(|p| !owners.contains(p));
        if s.to.is_empty() && s.sent.is_empty() && s.keep.is_empty() {
            self.pending.remove(client);
            return;
        }
        if !s.to.is_empty() && !s.queued {
            s.queued = true;
            self.order.push_back(client.clone());
        } else if s.to.is_empty() && !self.awaiting.contains(client) {
            self.awaiting.push(client.clone());
        }
    }
}

impl Engine {
    /// Sends the queued sessions to their new owners, as far as the pace allows, and tells
    /// the former owners of those every new owner has acknowledged to drop their copies.
    pub(super) fn stream_copies(&mut self) {
        if self.replicas.streams.pending.is_empty() {
            return;
        }
        let now = self.last_now;
        let mut budget = STREAM_TICK_BYTES;
        let mut skipped = Vec::new();
        let mut looked = 0;
        while budget > 0 && looked < STREAM_TICK_SESSIONS {
            looked += 1;
            let Some(client) = self.replicas.streams.order.pop_front() else {
                break;
            };
            let Some(stream) = self.replicas.streams.pending.get_mut(&client) else {
                continue;
            };
            if stream.to.is_empty() {
                // A later map took its new owners away again: only releases are left.
                stream.queued = false;
                self.replicas.streams.awaiting.push(client);
                continue;
            }
            let Some(stream) = self.replicas.streams.pending.get(&client) else {
                continue;
            };
            let sid = self.by_client.get(&client).copied();
            let session = sid.and_then(|sid| self.session(sid));
            if session.is_none_or(|s| !s.stored || s.stamp.is_none()) {
                // Moved away or ended here: its owners (and the former ones) were told.
                self.replicas.streams.pending.remove(&client);
                continue;
            }
            let ready: Vec<PeerId> = stream
                .to
                .iter()
                .copied()
                .filter(|&p| self.cluster.stream_room(p, STREAM_QUEUED_MAX))
                .collect();
            if ready.is_empty() {
                skipped.push(client);
                continue;
            }
            let sid = sid.expect("checked");
            let (bytes, ends) = self.copy_session(sid, Some(&ready), now);
            budget = budget.saturating_sub(bytes.max(1));
            self.replicas.streams.streamed += ready.len() as u64;
            let s = self
                .replicas
                .streams
                .pending
                .get_mut(&client)
                .expect("checked");
            s.to.retain(|p| !ready.contains(p));
            s.sent.extend(ends);
            if s.to.is_empty() {
                s.queued = false;
                self.replicas.streams.awaiting.push(client);
            } else {
                skipped.push(client);
            }
        }
        // Those whose new owners were full or down go round again, after the others (one
        // waiting for a down owner holds up none for an owner that is up).
        self.replicas.streams.order.extend(skipped);
        self.release_former_owners();
    }

    /// Owner `peer` has no copy of `client_id`'s session here: it is streamed one.
    pub(super) fn stream_to_owner(&mut self, peer: PeerId, client_id: &str) {
        let Some(session) = self
            .by_client
            .get(client_id)
            .and_then(|&sid| self.session(sid))
        else {
            return;
        };
        if !session.stored || session.stamp.is_none() {
            return;
        }
        let client = session.client_id.clone();
        let owners = self.replicas.other_owners(client_id);
        if owners.contains(&peer) {
            self.replicas.streams.add(&client, &[peer], &[], &owners);
        }
    }

    /// Former owners of sessions whose new owners all acknowledged their copies drop theirs.
    fn release_former_owners(&mut self) {
        if self.replicas.streams.awaiting.is_empty() {
            return;
        }
        let awaiting = std::mem::take(&mut self.replicas.streams.awaiting);
        for client in awaiting {
            let Some(s) = self.replicas.streams.pending.get(&client) else {
                continue;
            };
            if s.queued {
                // Gained another owner meanwhile: back in `order`.
                continue;
            }
            if !s
                .sent
                .iter()
                .all(|&(p, seq)| self.cluster.copied_through(p, seq))
            {
                self.replicas.streams.awaiting.push(client);
                continue;
            }
            let s = self
                .replicas
                .streams
                .pending
                .remove(&client)
                .expect("checked");
            for p in s.keep {
                self.release_copy(p, &client);
            }
        }
    }

    /// Tells former owner `peer` to drop its copy of `client_id`'s session (here): the
    /// deletion of the session record.
    pub(super) fn release_copy(&mut self, peer: PeerId, client_id: &str) {
        let stamp = self
            .by_client
            .get(client_id)
            .and_then(|&sid| self.session(sid))
            .and_then(|s| s.stamp);
        let Some(stamp) = stamp else { return };
        let version = self.replicas.map_version();
        let key = records::session_key(client_id);
        let at = self.cluster.retained.next(self.wall(self.last_now)).clock;
        if self
            .cluster
            .queue_copy(peer, version, stamp, &key, None, at)
            .is_some()
        {
            self.replicas.stats.ops_out += 1;
        }
    }
}
