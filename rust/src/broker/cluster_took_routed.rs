//! What a session took at its old home is not delivered again at the new one when a copy
//! of it comes straight, late (issue 17).
//!
//! A publishing node sends a message to every node with a matching route row: the session's
//! home, and other nodes for their own sessions or relays. A copy to another node can wait
//! in a silent link (a split) and reach it only at the heal, after the session moved there
//! meanwhile: it matches the session there too, though the session took the message at its
//! old home long before. The fault suite found this in a partial split (QoS 2 delivered
//! twice: the copy had gone to the session's new home as an old relay of another session).
//!
//! So a home that hands a session over tells the new home, per publishing node, the range
//! of that node's message sequence numbers that came to it routed while the session lived
//! there (`TookRouted`, after the hand-over). A publishing node sends in order and numbers
//! its messages in the order it routes them, so each of those that it sent to the old home
//! (its `also` names the old home) came there while the session lived there: the session
//! took it there, or it is in the queue the hand-over carries (an unconfirmed session is
//! confirmed first, so nothing it held stays behind). A copy of such a message that comes
//! straight to the new home is not delivered again, for `RECENT_MS` after the move.

use super::cluster::PeerId;
use super::state::SessionId;
use super::Engine;
use crate::cluster::batch::RoutedRange;

/// The first protocol whose nodes send and take `TookRouted`.
pub(super) const TOOK_ROUTED_PROTOCOL: u16 = 16;

/// At most this many ranges are taken from a peer (one per publishing node).
const RANGES_MAX: usize = 1024;

impl Engine {
    /// Session `sid` begins to live here: what its peers' routed messages came here after
    /// this, it takes here.
    pub(super) fn note_arrival(&mut self, sid: SessionId) {
        if self.cluster.epoch_of() == 0 {
            return;
        }
        let marks = self.cluster.routed_marks();
        if let Some(s) = self.session_mut(sid) {
            s.rare_mut().routed_since = Some(marks.into_boxed_slice());
        }
    }

    /// The ranges of its peers' routed messages that came here while session `sid` lived
    /// here: none if that is not known (restored at start-up), or if it waits for its
    /// owners' word (it is confirmed first; what it held might stay behind).
    pub(super) fn took_routed(&self, sid: SessionId) -> Vec<RoutedRange> {
        let Some(since) = self
            .session(sid)
            .and_then(|s| s.rare()?.routed_since.as_deref())
        else {
            return Vec::new();
        };
        if self.unconfirmed(sid) {
            return Vec::new();
        }
        self.cluster
            .routed_marks()
            .into_iter()
            .filter_map(|(origin, upto)| {
                let after = since
                    .iter()
                    .find(|&&(o, _)| o == origin)
                    .map_or(0, |&(_, s)| s);
                (upto > after).then_some(RoutedRange {
                    origin,
                    after,
                    upto,
                })
            })
            .collect()
    }

    /// Peer `peer`, which handed session `client_id` over, says what its peers' routed
    /// messages came there while the session lived there.
    pub(super) fn took_routed_received(
        &mut self,
        peer: PeerId,
        client_id: &str,
        ranges: &[RoutedRange],
    ) {
        if !self.came_from(peer, client_id) {
            self.event(
                "took_routed_refused",
                client_id.into(),
                "routed ranges for a session the peer did not hand over".into(),
            );
            return;
        }
        let from = self.cluster.peer_key(peer);
        let Some(&sid) = self.by_client.get(client_id) else {
            return;
        };
        if let Some(recent) = self.session_mut(sid).and_then(|s| s.recent.as_mut()) {
            recent.took_from = from;
            recent.took_ranges = ranges.iter().take(RANGES_MAX).copied().collect();
        }
    }

    /// Whether message `id`, come straight from `from` and sent to the nodes with keys
    /// `also` too, is one session `sid` took at the home it came from.
    pub(super) fn took_at_old_home(
        &self,
        sid: SessionId,
        id: u128,
        from: PeerId,
        also: &[u64],
        now: u64,
    ) -> bool {
        let Some(recent) = self.session(sid).and_then(|s| s.recent.as_ref()) else {
            return false;
        };
        if id == 0 || recent.took_from == 0 || now >= recent.until {
            return false;
        }
        let origin = (id >> 64) as u64;
        let seq = id as u64;
        also.contains(&recent.took_from)
            && self.cluster.routed_origin(from) == origin
            && recent
                .took_ranges
                .iter()
                .any(|r| r.origin == origin && r.after < seq && seq <= r.upto)
    }
}
