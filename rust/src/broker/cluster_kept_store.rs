//! What a node keeps for a dead home that lives only in the store (issue 16).
//!
//! A down peer's queue past `cluster_outbox_memory` keeps its oldest batches in memory and
//! the newer ones only in the store. A session of that peer installed from a copy, here or
//! on a node that asks (`KeptAsk`), gets what the batches in memory hold at once
//! (`cluster_kept`), and what those in the store hold once they are read back: without
//! this, those messages (acknowledged to their publishers with the kept batch as one copy)
//! would be lost if the home never came back.
//!
//! - **One read serves every search.** A dead home's sessions are taken over together, so
//!   their searches come at about the same time: the searches of one peer's queue share a
//!   pass through its stored batches, read back about `LOAD_BUDGET` bytes at a time through
//!   `cluster_loads`, as a queue is read back for a peer whose link is up. A search that
//!   comes once a pass has begun to read waits for the next one. Nothing read stays in
//!   memory.
//! - **In queue order.** The batches before the first that lives only in the store are
//!   looked through at once; from that one on, chunk by chunk, with the batches among them
//!   still in memory taken from there (the newest are spilled first, so later batches can
//!   stay in memory after older ones went). Messages published since the session was
//!   installed come to it directly and may be ahead of those read back.
//! - **Ends** when the peer's link comes up (the peer sends on what reaches it), when the
//!   peer is gone, or for one search when its session left this node or the asking peer's
//!   link is down (that node asks again when the link is back).

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::cluster::{KeptBatch, PeerId, LOAD_BUDGET};
use super::cluster_kept::{handed_on, kept_in_frame, kept_subs, KeptDelivery, OwnedSub};
use super::Engine;
use crate::store::envelope;

/// Who gets what a search finds.
pub(super) enum Asker {
    /// A session here, installed from a copy of the dead node with this key.
    Here(u64),
    /// A session installed on this peer.
    Peer(PeerId),
}

/// A session looking for what a dead peer's stored batches hold for it.
pub(super) struct Search {
    asker: Asker,
    client_id: Arc<str>,
    subs: Vec<OwnedSub>,
    /// Messages that also went to the node with this key are not its.
    skip: Option<u64>,
    /// How far the dead node applied this node's batches (see `cluster_kept`).
    applied: Option<(u64, u64)>,
}

impl Search {
    pub(super) fn new(
        asker: Asker,
        client_id: Arc<str>,
        subs: Vec<OwnedSub>,
        skip: Option<u64>,
        applied: Option<(u64, u64)>,
    ) -> Search {
        Search {
            asker,
            client_id,
            subs,
            skip,
            applied,
        }
    }
}

/// The searches through one dead peer's stored batches.
#[derive(Default)]
struct Scan {
    /// Searches the pass under way serves, and the batches it has yet to read.
    searches: Vec<Search>,
    batches: VecDeque<KeptBatch>,
    /// Batches of the chunk being read back (some may be in memory).
    reading: Vec<KeptBatch>,
    /// Searches that came during the pass: the next one serves them.
    waiting: Vec<Search>,
    /// Batches read and messages found in the pass under way.
    read: u64,
    found: u64,
}

#[derive(Default)]
pub(super) struct KeptScans {
    scans: HashMap<PeerId, Scan>,
}

impl KeptScans {
    pub(super) fn due(&self) -> bool {
        self.scans
            .values()
            .any(|s| s.reading.is_empty() && !s.batches.is_empty())
    }
}

impl Engine {
    /// `search` looks through `spilled`, peer `dead`'s kept batches from the first that
    /// lives only in the store on (or those of the pass it joins or waits for).
    pub(super) fn search_store(&mut self, dead: PeerId, search: Search, spilled: Vec<KeptBatch>) {
        let scan = self.kept_scans.scans.entry(dead).or_default();
        if scan.searches.is_empty() {
            scan.batches = spilled.into();
            scan.searches.push(search);
        } else if scan.read == 0 && scan.reading.is_empty() {
            // Nothing read yet: it joins the pass.
            scan.searches.push(search);
        } else {
            scan.waiting.push(search);
        }
    }

    /// Adds to `loads` the records the searches read next (about `LOAD_BUDGET` bytes of
    /// batches per peer, in queue order); `cluster_loaded` takes them.
    pub(super) fn kept_loads(&mut self, loads: &mut Vec<(PeerId, Vec<Vec<u8>>)>) {
        let cluster = &self.cluster;
        self.kept_scans
            .scans
            .retain(|&peer, _| cluster.peer_name(peer).is_some() && !cluster.peer_up(peer));
        let due: Vec<PeerId> = self.kept_scans.scans.keys().copied().collect();
        for peer in due {
            while let Some(scan) = self.kept_scans.scans.get_mut(&peer) {
                if !scan.reading.is_empty() {
                    break;
                }
                let mut bytes = 0;
                while bytes < LOAD_BUDGET {
                    let Some(b) = scan.batches.pop_front() else {
                        break;
                    };
                    bytes += b.len;
                    scan.reading.push(b);
                }
                if scan.reading.is_empty() {
                    break;
                }
                let in_memory = self.cluster.kept_in_memory(peer, &scan.reading);
                let keys: Vec<Vec<u8>> = scan
                    .reading
                    .iter()
                    .zip(in_memory)
                    .filter(|(_, frame)| frame.is_none())
                    .filter_map(|(b, _)| b.key.clone())
                    .collect();
                if !keys.is_empty() {
                    loads.push((peer, keys));
                    break;
                }
                // All of them in memory: looked through now.
                self.kept_loaded(peer, &[]);
            }
        }
    }

    /// Records read back for the searches through peer `peer`'s kept batches (`None`:
    /// missing), or `None` if no search asked for them. Returns problems.
    pub(super) fn kept_loaded(
        &mut self,
        peer: PeerId,
        records: &[(&[u8], Option<&[u8]>)],
    ) -> Option<Vec<String>> {
        let now = self.last_now;
        let scan = self.kept_scans.scans.get_mut(&peer)?;
        if scan.reading.is_empty() || self.cluster.peer_up(peer) {
            return None;
        }
        let reading = std::mem::take(&mut scan.reading);
        let in_memory = self.cluster.kept_in_memory(peer, &reading);
        let stored = |(b, frame): (&KeptBatch, &Option<&[u8]>)| frame.is_none() && b.key.is_some();
        if records.is_empty() && reading.iter().zip(&in_memory).any(stored) {
            // The store failed: asked for again by a later flush.
            for b in reading.into_iter().rev() {
                scan.batches.push_front(b);
            }
            return Some(Vec::new());
        }
        let searches = std::mem::take(&mut scan.searches);
        let for_key = self.cluster.peer_key(peer);
        let mut found: Vec<Vec<KeptDelivery>> = searches.iter().map(|_| Vec::new()).collect();
        let (mut problems, mut sent, mut unreadable) = (Vec::new(), 0, 0);
        let name = self
            .cluster
            .peer_name(peer)
            .unwrap_or_else(|| Arc::from("?"));
        // Records come back in the order asked for: one forward scan matches them.
        let mut at = 0;
        for (b, memory) in reading.iter().zip(&in_memory) {
            let frame = match (memory, &b.key) {
                (Some(frame), _) => Cow::Borrowed(*frame),
                (None, Some(key)) => {
                    let Some(i) = (at..records.len()).find(|&i| records[i].0 == key) else {
                        continue;
                    };
                    at = i + 1;
                    match records[i].1.map(|v| envelope::open(key, v)) {
                        Some(Ok(frame)) => frame,
                        Some(Err(e)) => {
                            problems.push(format!("a stored batch for {name} is damaged: {e}"));
                            continue;
                        }
                        None => {
                            problems.push(format!("a stored batch for {name} is missing"));
                            continue;
                        }
                    }
                }
                // Neither in memory nor stored: gone from the queue.
                (None, None) => continue,
            };
            for (search, out) in searches.iter().zip(found.iter_mut()) {
                let Some(most) = handed_on(b.epoch, b.seq, b.sent, search.applied) else {
                    sent += 1;
                    continue;
                };
                let subs = kept_subs(&search.subs);
                let kept = (&*search.client_id, &subs[..], search.skip, for_key);
                if !kept_in_frame(&frame, kept, most, now, out) {
                    unreadable += 1;
                }
            }
        }
        let count: usize = found.iter().map(Vec::len).sum();
        self.claims.stats.kept_read_back += reading.len() as u64;
        for (search, kept) in searches.iter().zip(found) {
            self.hand_found(search, kept, now);
        }
        if sent + unreadable > 0 {
            let client = searches.first().map_or("?", |s| &*s.client_id).to_owned();
            self.kept_not_searched(peer, &client, sent, unreadable);
        }
        let scan = self.kept_scans.scans.get_mut(&peer)?;
        scan.read += reading.len() as u64;
        scan.found += count as u64;
        if !scan.batches.is_empty() {
            scan.searches = searches;
            return Some(problems);
        }
        // The pass is over: the searches that came meanwhile start the next.
        let (read, found) = (
            std::mem::take(&mut scan.read),
            std::mem::take(&mut scan.found),
        );
        let waiting = std::mem::take(&mut scan.waiting);
        self.event(
            "kept_read_back",
            Arc::from(""),
            format!(
                "{read} batches kept for {name} looked through (from the first only in the \
                 store) for {} sessions taken over from it: {found} messages for them",
                searches.len()
            ),
        );
        let batches = if waiting.is_empty() {
            Vec::new()
        } else {
            self.cluster.batches_from_store(peer)
        };
        if batches.is_empty() {
            self.kept_scans.scans.remove(&peer);
        } else {
            let scan = self.kept_scans.scans.get_mut(&peer)?;
            scan.searches = waiting;
            scan.batches = batches.into();
        }
        Some(problems)
    }

    /// What a search found, to its session here or to the peer that asked.
    fn hand_found(&mut self, search: &Search, kept: Vec<KeptDelivery>, now: u64) {
        if kept.is_empty() {
            return;
        }
        match search.asker {
            Asker::Here(home) => {
                let sid = self.by_client.get(&search.client_id).copied();
                let still = sid
                    .and_then(|sid| self.session(sid)?.recent.as_ref())
                    .is_some_and(|r| r.kept_from == home);
                if let (Some(sid), true) = (sid, still) {
                    self.deliver_kept(sid, kept, now);
                }
            }
            Asker::Peer(p) => {
                if self.cluster.peer_up(p) {
                    self.hand_kept(p, &search.client_id, kept, now);
                }
            }
        }
    }
}
