//! A node that leaves the cluster (`cluster leave`) hands its sessions on before it goes.
//!
//! Its peers route to it as to any member until it stops: a session it still holds gets
//! its messages (the other nodes forgetting its routes as it asked to leave lost what was
//! published for its sessions until they resumed elsewhere: found by the fault suite's long
//! schedule). Once removed from the map and with its connections closed (their clients
//! claim their sessions from it on other nodes, as at a planned stop), it hands every
//! session it still holds to the first owner of the session's partition that is up, in a
//! claim answer no claim waits for: the owner installs it disconnected, and this node
//! relays what peers still send it until the owner says every node has its rows, as after
//! a claim. Then it holds no session and no route row, and its peers keep nothing for it
//! after it is gone. A client that comes back elsewhere as its session is on its way to
//! the owner finds this node without it; the owner, which watched its copy for that claim
//! (the home being up), serves the claim from the session once it arrives. A session it
//! cannot hand on that way (no owner of protocol 8 up, or a will whose delay runs) stays,
//! and is taken over from its copy once this node is found down, as a dead home's.

use std::sync::Arc;

use super::cluster::PeerId;
use super::cluster_replicas::THIS_NODE;
use super::state::SessionId;
use super::Engine;
use crate::cluster::batch::Stamp;

/// The first protocol whose nodes say when every node has their rows (`RelayEnd`): the
/// relay of a session handed to an older one would end after `RELAY_MS` whatever lags.
const LEAVE_PROTOCOL: u16 = 8;

impl Engine {
    /// This node left the cluster and its connections are closed: every session it holds
    /// goes to the first owner of its partition that is up (see above). Returns how many.
    pub fn cluster_hand_over_all(&mut self, now: u64) -> usize {
        let sessions: Vec<(Arc<str>, SessionId)> = self
            .by_client
            .iter()
            .map(|(c, &sid)| (c.clone(), sid))
            .collect();
        let mut handed = 0;
        for (client, sid) in sessions {
            // A connection still open (closing), a claim of this node waiting for it, or a
            // will waiting for its delay: taken over from the copy instead (which publishes
            // the will).
            let will = self
                .session(sid)
                .is_some_and(|s| s.pending_will().is_some());
            if will || !self.holds_disconnected(&client) {
                continue;
            }
            let Some(to) = self.leave_target(&client) else {
                continue;
            };
            self.confirm(sid, now);
            if self.session(sid).is_none() {
                continue;
            }
            self.send_session(sid, to, &client, Stamp::default(), now);
            handed += 1;
        }
        if handed > 0 {
            self.event(
                "sessions_handed_on",
                Arc::from(""),
                format!("{handed} sessions handed to their owners: this node left the cluster"),
            );
        }
        handed
    }

    /// Whether a session of `client` lives here without a connection, and no claim of
    /// this node waits for it.
    pub(super) fn holds_disconnected(&self, client: &str) -> bool {
        let sid = self.by_client.get(client).copied();
        sid.and_then(|sid| self.session(sid))
            .is_some_and(|s| s.conn.is_none())
            && !self.claims_pending(client)
    }

    /// Where a leaving node hands `client`: the first owner of its partition that is up
    /// and speaks `LEAVE_PROTOCOL`.
    fn leave_target(&self, client: &str) -> Option<PeerId> {
        self.replicas.owners_of(client).into_iter().find(|&p| {
            p != THIS_NODE
                && self.cluster.peer_up(p)
                && self.cluster.peer_protocol(p) >= LEAVE_PROTOCOL
        })
    }
}
