//! Where each client id's session lives, known to the owners of its partition, so that a
//! CONNECT's claim goes through the partition's primary to the nodes that may hold the
//! client instead of to every node (issue 16; EMQX's `emqx_cm_registry`, partitioned).
//!
//! - **What the owners know.** A node tells the other owners of a client id's partition
//!   when a session of that id, or a copy of one, comes to it or leaves it (`Home`; a
//!   former owner's copy answers claims until the new owners have theirs), and sends each
//!   owner its
//!   whole list when their link comes up or the map changes (`Homes`, in parts; the last
//!   part names the map version the list is whole for). An owner knows a peer's sessions
//!   completely once that list, for the map it holds, came over the link that is up now.
//! - **Claims through the primary.** A CONNECT that claims its client id first asks the
//!   first owner of the partition it reaches (`ClaimRoute`: the primary while it is up, a
//!   follower after; this node itself if it is that owner). The owner stamps the claim with
//!   its clock, after every claim it stamped before, notes the claimant as where the client
//!   goes, and answers (`ClaimRouted`) with the nodes to claim from: those that hold the
//!   client's session or a copy, claimants it noted before, and every node whose sessions
//!   it does not all know (a link down, a list not complete yet, a peer older than protocol
//!   10). The claimant claims from those and from the partition's owners (their copies may
//!   differ), or from nobody if none is named (a client id nobody holds: the CONNECT goes
//!   on after one round trip, or at once on the owner itself), and
//!   races go as in `cluster_sessions`: a later claim reaches the earlier claimant, which
//!   hands over once its own claim is done. A node that holds nothing of the client is not
//!   asked, so a silent one does not delay the CONNECT.
//! - **Fallback.** With no owner of protocol 10 in reach (a split, a rolling upgrade) the
//!   claim goes to every node in reach with this node's stamp, as before. An owner notes the
//!   claimant of every claim it receives, so a follower that stamps claims once the primary
//!   is gone knows the claims that primary stamped.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::cluster::PeerId;
use super::cluster_replicas::THIS_NODE;
use super::Engine;
use crate::cluster::batch::Stamp;

/// Client ids per `Homes` part.
const HOMES_PART: usize = 4096;
/// How long an owner remembers a claimant whose session has not come there (its claim
/// waits at most the failure timeout and a little more).
const CLAIMANT_MS: u64 = 60_000;

#[derive(Default)]
pub(super) struct Registry {
    /// By peer: client ids of partitions this node owns whose sessions that peer holds.
    of_peer: HashMap<PeerId, PeerHomes>,
    /// Claimants noted for a client id (peer, until when), not confirmed by a `Home` yet.
    claimants: HashMap<Arc<str>, Vec<(PeerId, u64)>>,
    /// The newest claim stamp seen for a client id (stamped here or received as an owner),
    /// until when it is remembered.
    newest: HashMap<Arc<str>, (Stamp, u64)>,
    /// Numbers this node's `ClaimRoute`s.
    next_req: u64,
    pub(super) stats: RegistryStats,
}

#[derive(Default)]
struct PeerHomes {
    clients: HashSet<Arc<str>>,
    /// The map version the list is whole for (0: not whole).
    whole_for: u64,
}

#[derive(Default, Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegistryStats {
    /// Claims of other nodes this node stamped as their client id's owner.
    pub routed: u64,
    /// Claims of this node that went through an owner (to the nodes it named).
    pub directed: u64,
    /// Claims of this node that went to every node in reach (no owner in reach).
    pub broadcast: u64,
    /// Claim messages this node sent (per claim: the nodes asked).
    pub asked: u64,
}

impl Registry {
    pub(super) fn next_req(&mut self) -> u64 {
        self.next_req += 1;
        self.next_req
    }

    /// Client ids whose sessions this node knows another node holds.
    pub(super) fn known(&self) -> usize {
        self.of_peer.values().map(|h| h.clients.len()).sum()
    }
}

impl Engine {
    /// A session of `client` or a copy of one came here or left: the other owners of its
    /// partition that are up are told whether this node holds either now (one whose link
    /// is down gets the whole list when it is up).
    pub(super) fn registry_note(&mut self, client: &str) {
        if self.cluster.epoch_of() == 0 || !self.replicas.has_map() {
            return;
        }
        let here = self.by_client.contains_key(client) || self.holds_copy(client);
        for peer in self.replicas.other_owners(client) {
            if self.cluster.peer_up(peer) {
                self.cluster.queue_home(peer, client, here);
            }
        }
    }

    /// This node's sessions, each to the owners of its partition: to `only` (its link came
    /// up), or to every peer up (the map changed).
    fn send_homes(&mut self, only: Option<PeerId>) {
        let map = self.replicas.map_version();
        if self.cluster.epoch_of() == 0 || map == 0 {
            return;
        }
        let peers = match only {
            Some(p) => vec![p],
            None => self.cluster.up_peers_from(10),
        };
        let mut lists: HashMap<PeerId, Vec<Arc<str>>> = peers
            .into_iter()
            .filter(|&p| self.cluster.peer_up(p) && self.cluster.peer_protocol(p) >= 10)
            .map(|p| (p, Vec::new()))
            .collect();
        if lists.is_empty() {
            return;
        }
        // A copy answers claims too (a former owner's, until the new owners have theirs).
        let copies = self
            .copied_clients()
            .filter(|c| !self.by_client.contains_key(&***c));
        for client in self.by_client.keys().chain(copies) {
            for owner in self.replicas.owners_of(client) {
                if let Some(list) = lists.get_mut(&owner) {
                    list.push(client.clone());
                }
            }
        }
        for (peer, list) in lists {
            // An empty list still goes: its one part says the list is whole.
            let mut parts: Vec<&[Arc<str>]> = list.chunks(HOMES_PART).collect();
            if parts.is_empty() {
                parts.push(&[]);
            }
            let last = parts.len() - 1;
            for (i, part) in parts.into_iter().enumerate() {
                let clients = part.iter().map(|c| &**c);
                self.cluster
                    .queue_homes(peer, map, i == 0, i == last, clients);
            }
        }
    }

    /// Peer `peer`'s list of sessions (a part of it).
    pub(super) fn homes_received(
        &mut self,
        peer: PeerId,
        map: u64,
        first: bool,
        last: bool,
        clients: &[&str],
    ) {
        let homes = self.registry.of_peer.entry(peer).or_default();
        if first {
            homes.clients.clear();
            homes.whole_for = 0;
        }
        homes.clients.extend(clients.iter().map(|&c| Arc::from(c)));
        if last {
            homes.whole_for = map;
        }
    }

    /// A session of `client` came to peer `peer` (`here`) or left it.
    pub(super) fn home_received(&mut self, peer: PeerId, client: &str, here: bool) {
        let homes = self.registry.of_peer.entry(peer).or_default();
        if here {
            homes.clients.insert(Arc::from(client));
            if let Some(c) = self.registry.claimants.get_mut(client) {
                c.retain(|&(p, _)| p != peer);
                if c.is_empty() {
                    self.registry.claimants.remove(client);
                }
            }
        } else {
            homes.clients.remove(client);
        }
    }

    /// Peer `peer`'s link came up or went down: what this node knows of its sessions is not
    /// whole until its list comes again; up, it gets this node's.
    pub(super) fn registry_link(&mut self, peer: PeerId, up: bool) {
        if let Some(homes) = self.registry.of_peer.get_mut(&peer) {
            homes.whole_for = 0;
        }
        if up {
            self.send_homes(Some(peer));
        }
    }

    /// Peer `peer` left the cluster.
    pub(super) fn registry_peer_removed(&mut self, peer: PeerId) {
        self.registry.of_peer.remove(&peer);
        for c in self.registry.claimants.values_mut() {
            c.retain(|&(p, _)| p != peer);
        }
        self.registry.claimants.retain(|_, c| !c.is_empty());
    }

    /// The map changed: what this node no longer owns goes, and the owners get this node's
    /// lists for the new map.
    pub(super) fn registry_map_changed(&mut self) {
        let replicas = &self.replicas;
        for homes in self.registry.of_peer.values_mut() {
            homes.clients.retain(|c| replicas.is_owner(c));
        }
        self.registry.claimants.retain(|c, _| replicas.is_owner(c));
        self.registry.newest.retain(|c, _| replicas.is_owner(c));
        self.send_homes(None);
    }

    /// A claim of `client` by `peer` stamped `stamp` came here (to be stamped, or the claim
    /// itself), an owner: the next claim of that client is sent there too.
    pub(super) fn note_claimant(&mut self, client: &str, peer: PeerId, stamp: Stamp, now: u64) {
        if peer == THIS_NODE || !self.replicas.is_owner(client) {
            return;
        }
        let client: Arc<str> = Arc::from(client);
        let newest = self.registry.newest.entry(client.clone()).or_default();
        if stamp > newest.0 {
            *newest = (stamp, now + CLAIMANT_MS);
        }
        let c = self.registry.claimants.entry(client).or_default();
        c.retain(|&(p, _)| p != peer);
        c.push((peer, now + CLAIMANT_MS));
    }

    /// Whether a claim of `client` newer than `stamp` came here: its claimant takes the
    /// session over from the claimant of `stamp` (every claim stamped after another is sent
    /// to it), so this one needs nothing from this node's copy.
    pub(super) fn newer_claim_seen(&self, client: &str, stamp: Stamp) -> bool {
        self.registry
            .newest
            .get(client)
            .is_some_and(|&(newest, _)| newest > stamp)
    }

    /// The nodes (keys) a claim of `client` by `claimant` must ask: see the module comment.
    /// Every node but the claimant if this node does not own the client's partition.
    pub(super) fn claim_ask(&self, client: &str, claimant: PeerId) -> Vec<u64> {
        let map = self.replicas.map_version();
        let owner = map != 0 && self.replicas.is_owner(client);
        let mut ask = Vec::new();
        if claimant != THIS_NODE
            && (self.by_client.contains_key(client)
                || self.claims_pending(client)
                || self.holds_copy(client))
        {
            ask.push(self.cluster.retained.node);
        }
        let claimants = self.registry.claimants.get(client);
        // The home of a copy held here holds the session, whatever its list says (a list
        // can lag a session that came to it as a split healed).
        let copy_home = self.copy_home(client);
        for (peer, key) in self.cluster.peer_keys() {
            if peer == claimant {
                continue;
            }
            let homes = self.registry.of_peer.get(&peer);
            let whole = owner && homes.is_some_and(|h| h.whole_for == map);
            let holds = homes.is_some_and(|h| h.clients.contains(client));
            let claims = claimants.is_some_and(|c| c.iter().any(|&(p, _)| p == peer));
            if !whole || holds || claims || copy_home == Some(peer) {
                ask.push(key);
            }
        }
        ask
    }

    /// Peer `peer` asks this node, an owner of `client`'s partition, to stamp its claim.
    pub(super) fn claim_route_received(&mut self, peer: PeerId, client: &str, req: u64, now: u64) {
        let stamp = self.cluster.retained.next(self.wall(now));
        let ask = self.claim_ask(client, peer);
        self.note_claimant(client, peer, stamp, now);
        self.registry.stats.routed += 1;
        self.cluster
            .queue_claim_routed(peer, client, req, stamp, &ask);
    }

    /// Claimants and claims noted long ago go.
    pub(super) fn registry_tick(&mut self, now: u64) {
        if !self.registry.newest.is_empty() {
            self.registry
                .newest
                .retain(|_, &mut (_, until)| now < until);
        }
        if self.registry.claimants.is_empty() {
            return;
        }
        for c in self.registry.claimants.values_mut() {
            c.retain(|&(_, until)| now < until);
        }
        self.registry.claimants.retain(|_, c| !c.is_empty());
    }

    /// Forgets that `peer` holds `client` (tests: a list that lags).
    #[cfg(test)]
    pub(super) fn registry_forget(&mut self, peer: PeerId, client: &str) {
        if let Some(h) = self.registry.of_peer.get_mut(&peer) {
            h.clients.remove(client);
        }
    }

    pub fn registry_stats(&self) -> (RegistryStats, usize) {
        (self.registry.stats, self.registry.known())
    }
}
