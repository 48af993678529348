//! Which side of a split may act on what both sides hold (docs/cluster-sessions.md,
//! "Splits: one side acts on what both hold").
//!
//! A home and the owners of its session's copies can end on two sides of a split. Until the
//! split, a QoS 2 PUBLISH or PUBREL leaves the home only once the owners hold its flight
//! record (`cluster_gates`), so a copy says all the client may have had. Once the owners are
//! out of reach, a home that went on sending would make the copies stale, and a client that
//! then crossed the split would get from a version made of one what it had already had: the
//! fault suite's QoS 2 duplicates of messages in doubt as a split began. Neither side can
//! tell a dead peer from a cut-off one, so one side acts and the other waits: the side that
//! reaches more than half of the map's members (or exactly half, with the member whose name
//! sorts first). There, a home sends past owners out of reach and copies are served (the
//! behaviour a killed node meets: nothing changes while a majority stands). Elsewhere a
//! home holds such output until the owners are back or the map drops them, and a copy is
//! neither resumed (the CONNECT is refused, 0x88), nor answered for, nor taken over. A last
//! survivor of a lost majority acts again once `fastbroker cluster recover` has made it the
//! only member.

use std::collections::BTreeSet;

use super::cluster::PeerId;
use super::cluster_replicas::THIS_NODE;
use super::Engine;

impl Engine {
    /// Whether this node is on the side of the cluster that acts on what a split may leave
    /// on both sides (see above), counting the peers whose links are up. True without a
    /// cluster or before the first map. (Sessions are served from copies, or taken over,
    /// only past the failure timeout, when the links of a split are all found down.)
    pub(super) fn authoritative(&self) -> bool {
        self.side_acts(false)
    }

    /// As `authoritative`, counting only the peers that acknowledged a batch sent when a
    /// link last went down: a split is found one link at a time, and a home that took the
    /// first peer found down for the only one cut off would send what the copies lack.
    pub(super) fn authoritative_in_reach(&self) -> bool {
        self.side_acts(true)
    }

    /// Whether copies may be served or taken over: this side acts, and has without a
    /// break for the takeover time if it did not once. A node back from a split gets its
    /// links back one at a time: with the first it may count a majority while the homes
    /// it was cut off from are still down here and its copies of their sessions stale
    /// (what changed meanwhile comes with their links), and could take such sessions over
    /// (a fault run lost a client's subscriptions that way, it seems).
    pub(super) fn acts_on_copies(&self) -> bool {
        if !self.authoritative() {
            return false;
        }
        !self.replicas.acting_lost
            && self.last_now >= self.replicas.acting_since + self.cfg.cluster_takeover_ms
    }

    /// Whether QoS 2 output may pass owners out of reach: this side acts (counting the
    /// peers in reach), and has for the takeover time if it did not once. A home back
    /// from a split gets its links back one at a time, and the owner still out of reach
    /// may have made a newer version of a session meanwhile: its client, resuming here,
    /// got again what it had completed there (the long schedule, seed 41).
    pub(super) fn gates_pass_down_owners(&self) -> bool {
        self.authoritative_in_reach() && self.acts_on_copies()
    }

    /// Whether this node holds a copy of `client_id`'s session whose home is out of reach,
    /// and no session of it, and may not act on the copy: the session lives on beyond a
    /// split (or beyond a lost majority, until `cluster recover`). A CONNECT resuming it is
    /// refused (0x88), not given a fresh session that would leave the copy's messages
    /// behind: through a load balancer the client lands on the side that acts.
    pub(super) fn copy_beyond_reach(&self, client_id: &str) -> bool {
        !self.by_client.contains_key(client_id)
            && self.copy_home_down(client_id)
            && !self.acts_on_copies()
    }

    /// Each tick: whether this side acts, and since when (see `acts_on_copies`).
    pub(super) fn note_acting(&mut self, now: u64) {
        if self.cfg.cluster_minority_acts {
            return;
        }
        if !self.authoritative() {
            self.replicas.acting_lost = true;
        } else if self.replicas.acting_lost {
            self.replicas.acting_lost = false;
            self.replicas.acting_since = now;
        }
    }

    fn side_acts(&self, proven: bool) -> bool {
        if self.cluster.epoch_of() == 0 || self.cfg.cluster_minority_acts {
            return true;
        }
        let members: BTreeSet<PeerId> = match self.replicas.members() {
            Some(told) => told.iter().copied().collect(),
            // Not told (the engine's own tests): the map's owners and every peer known.
            None => {
                let mut all = self.replicas.map_owners();
                all.extend(self.cluster.peer_keys().into_iter().map(|(p, _)| p));
                all.insert(THIS_NODE);
                all
            }
        };
        if members.is_empty() {
            return true;
        }
        let reachable = |p: PeerId| {
            p == THIS_NODE
                || if proven {
                    self.cluster.peer_in_reach(p)
                } else {
                    self.cluster.peer_up(p)
                }
        };
        let up = members.iter().filter(|&&p| reachable(p)).count();
        if 2 * up != members.len() {
            return 2 * up > members.len();
        }
        // Exactly half: the side with the member whose name sorts first.
        let name = |p: PeerId| {
            if p == THIS_NODE {
                Some(self.cluster.name.clone())
            } else {
                self.cluster.peer_name(p)
            }
        };
        members
            .iter()
            .filter_map(|&p| name(p).map(|n| (n, p)))
            .min()
            .is_some_and(|(_, p)| reachable(p))
    }
}
