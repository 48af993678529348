//! A session that moved here from a live home gets a publishing node's messages in that
//! node's order, though they come along two paths (issue 17).
//!
//! Until a publishing node has this node's route rows for the session, it sends the
//! session's messages to the old home, which relays them here (`cluster_sessions`); once it
//! has them, it sends here straight, and to the old home as well while that home's rows
//! are there too (the message's `also` names it), which relays them once more (the session
//! takes each id once). The first message that comes straight can overtake the last ones
//! on the slower way through the old home. So the first message of a publishing node that
//! comes here straight and went to the old home too is held (queued, nothing new sent to
//! the client) until the old home's relayed copy of it comes: the old home relays in the
//! order it got them, so everything the publishing node sent it alone came before. Then the
//! queue's messages of each publishing node go back in that node's order
//! (`queue_in_origin_order`) and are sent, and that node's messages are held no more (the
//! later ones come straight in its order). A hold ends without its copy when the old
//! home's link goes down, or after `KEPT_WAIT_MS` (a stalled old home, or one whose relay
//! ended meanwhile: then none begins any more), and none begins once the old home may have
//! ended its relay (`RecentIds::relayed_until`).
//!
//! **The other way round.** A publishing node whose link to this node comes back later
//! than its link to the old home (after a split) sends the old home a new message that the
//! old home relays here before the older ones the publishing node kept for this node
//! arrive straight. A relayed message names the nodes its publishing node sent it to
//! (`also`, carried in the relayed item): if this node is one and the message has not come
//! straight yet, the session is held until it does (the publishing node's link sends in
//! order, so what it kept for this node comes first), then the queue goes in each
//! publishing node's order. Once per publishing node, at most `KEPT_WAIT_MS` (a publishing
//! node out of reach: it is not waited for again).

use super::cluster::PeerId;
use super::cluster_kept::KEPT_WAIT_MS;
use super::state::SessionId;
use super::Engine;

impl Engine {
    /// Message `id` came straight from `from` to session `sid` (plain subscription), and
    /// went to the nodes with keys `also` too: if the old home it moved from is one, and it
    /// is the first such of its publishing node, the session waits for its relayed copy.
    pub(super) fn wait_for_relay(
        &mut self,
        sid: SessionId,
        id: u128,
        from: PeerId,
        also: &[u64],
        now: u64,
    ) {
        if id == 0 || also.is_empty() {
            return;
        }
        let Some(recent) = self.session(sid).and_then(|s| s.recent.as_ref()) else {
            return;
        };
        let home = recent.relayed_by;
        let origin = (id >> 64) as u64;
        if home == 0
            || now >= recent.relayed_until
            || recent.relay_caught_up.contains(&origin)
            || recent
                .relay_waits
                .iter()
                .any(|&(w, _)| (w >> 64) as u64 == origin)
        {
            return;
        }
        let c = &self.cluster;
        if c.peer_key(from) == home
            || !also.contains(&home)
            || !c.peer_by_key(home).is_some_and(|p| c.peer_up(p))
        {
            return;
        }
        let recent = self
            .session_mut(sid)
            .and_then(|s| s.recent.as_mut())
            .expect("checked");
        if recent.ids.contains(&id) {
            // Its relayed copy came first: so did everything before it.
            recent.relay_caught_up.push(origin);
            return;
        }
        recent.relay_waits.push((id, now + KEPT_WAIT_MS));
        self.claims.stats.relay_waits += 1;
        if !self.claims.kept_holds.contains(&sid) {
            self.claims.kept_holds.push(sid);
        }
    }

    /// The old home's relayed copy of message `id` came to session `sid` (from the node
    /// with key `from`): the wait for it ends, and its publishing node is waited for no
    /// more.
    pub(super) fn relayed_copy_came(&mut self, sid: SessionId, id: u128, from: u64, now: u64) {
        let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) else {
            return;
        };
        if id == 0 || recent.relayed_by != from || recent.relay_waits.is_empty() {
            return;
        }
        if end_wait(&mut recent.relay_waits, &mut recent.relay_caught_up, id) && !recent.holds() {
            self.send_after_kept(sid, now);
        }
    }

    /// The old home relayed message `id` to session `sid`, and its publishing node sent it
    /// to the nodes with keys `also`: if this node is one and the message has not come
    /// straight yet (the first such of its publishing node), the session waits for it.
    pub(super) fn wait_for_direct(&mut self, sid: SessionId, id: u128, also: &[u64], now: u64) {
        if id == 0 || also.is_empty() {
            return;
        }
        let own = super::cluster_retained::node_key(&self.cluster.name);
        if !also.contains(&own) {
            return;
        }
        let routed = self.cluster.routed_here(id);
        let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) else {
            return;
        };
        let origin = (id >> 64) as u64;
        if recent.direct_caught_up.contains(&origin)
            || recent
                .direct_waits
                .iter()
                .any(|&(w, _)| (w >> 64) as u64 == origin)
        {
            return;
        }
        match routed {
            // Unknown origin (its node restarted since, say): not waited for.
            None => return,
            Some(true) => {
                // It came straight first: so did everything sent here before it.
                recent.direct_caught_up.push(origin);
                return;
            }
            Some(false) => {}
        }
        recent.direct_waits.push((id, now + KEPT_WAIT_MS));
        self.claims.stats.relay_waits += 1;
        if !self.claims.kept_holds.contains(&sid) {
            self.claims.kept_holds.push(sid);
        }
    }

    /// Message `id` came straight to session `sid`: a wait for it (or for an older one of
    /// its publishing node) ends.
    pub(super) fn direct_copy_came(&mut self, sid: SessionId, id: u128, now: u64) {
        let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) else {
            return;
        };
        if id == 0 || recent.direct_waits.is_empty() {
            return;
        }
        if end_wait(&mut recent.direct_waits, &mut recent.direct_caught_up, id) && !recent.holds() {
            self.send_after_kept(sid, now);
        }
    }

    /// Peer `peer`'s link went down: what it publishes from now on is kept for this node
    /// until the link is back, so a message of it that an old home relays here after that
    /// is waited for again (`wait_for_direct`), however caught up the session was with it
    /// before. (Found by the fault suite: at the heal of a second partial split, a relayed
    /// message went to the client ahead of what was kept for this node.)
    pub(super) fn direct_caught_up_no_more(&mut self, peer: PeerId) {
        let origin = self.cluster.routed_origin(peer);
        if origin == 0 {
            return;
        }
        for s in self.sessions.values_mut() {
            if let Some(recent) = s.recent.as_mut() {
                recent.direct_caught_up.retain(|&o| o != origin);
            }
        }
    }

    /// The old home of session `client_id` may end its relay from `at` on: from then, what
    /// comes straight is not held for it.
    pub(super) fn relay_order_ends(&mut self, client_id: &str, at: u64) {
        let Some(&sid) = self.by_client.get(client_id) else {
            return;
        };
        if let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) {
            recent.relayed_until = recent.relayed_until.min(at);
        }
    }
}

/// Ends the wait in `waits` for the publishing node of message `id` if it waited for `id`
/// or an older one: true if it did (that node is then caught up).
fn end_wait(waits: &mut Vec<(u128, u64)>, caught_up: &mut Vec<u64>, id: u128) -> bool {
    let origin = (id >> 64) as u64;
    let before = waits.len();
    waits.retain(|&(w, _)| (w >> 64) as u64 != origin || w > id);
    if waits.len() == before {
        return false;
    }
    caught_up.push(origin);
    true
}
