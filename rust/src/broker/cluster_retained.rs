//! The retained set across nodes: every node holds all of it, and every node ends with the
//! same value for a topic whatever order writes reach it in.
//!
//! - **Stamps.** A retained write published here is stamped with a hybrid logical clock
//!   (wall ms << 16 plus a counter, never below a stamp seen from a peer) and this node's
//!   key; a forwarded write carries its stamp. A write is applied only if its stamp is
//!   above the topic's current one, so concurrent writes on different nodes converge to the
//!   one with the highest stamp, and a node's own later write always wins over what it has
//!   seen (read-your-writes for a publisher that moves between nodes).
//! - **Tombstones.** A deletion (empty retained payload) keeps its stamp for
//!   `TOMBSTONE_MS`, so an older write that arrives late (a resend after a reconnect, a
//!   peer's retained set) cannot bring the topic back. Tombstones are stored like retained
//!   messages, so they survive a restart.
//! - **The set on link up.** When a link comes up, each side sends the other its whole
//!   retained set (messages and tombstones, stamped, for keeping only) and then
//!   `RetainedSent`; a node that joins or comes back is ready once every reachable member
//!   has sent it (`PeerStats::retained_synced`).

use std::collections::{HashMap, VecDeque};

use bytes::Bytes;

use super::cluster::{encode_routed, PeerId};
use super::Engine;
use crate::cluster::batch::{self, Stamp, WireMessage};
use crate::codec;
use crate::store::records;

/// How long a deletion's stamp is kept (ms): longer than a link stays down with its
/// batches kept for it, and than a node is away before it is removed from the map.
const TOMBSTONE_MS: u64 = 3_600_000;
/// Deletions remembered at most; the oldest are forgotten first.
const MAX_TOMBSTONES: usize = 1_000_000;

#[derive(Default)]
pub(super) struct RetainedStamps {
    /// This node's key in stamps (0: not in a cluster, writes are not stamped).
    pub(super) node: u64,
    clock: u64,
    /// The stamp of each topic's last applied write (set or deleted).
    stamps: HashMap<Bytes, Stamp>,
    /// Deletions in the order made (monotonic ms, topic, stamp), for forgetting them.
    tombstones: VecDeque<(u64, Bytes, Stamp)>,
    /// The stamp given to the retained message being routed, for `forward`.
    pub(super) routing: Option<Stamp>,
}

impl RetainedStamps {
    /// A stamp from a peer: later stamps of this node are above it.
    pub(super) fn observe(&mut self, stamp: Stamp) {
        self.clock = self.clock.max(stamp.clock);
    }

    /// A new stamp above every stamp seen.
    pub(super) fn next(&mut self, wall: u64) -> Stamp {
        self.clock = (self.clock + 1).max(wall << 16);
        Stamp {
            clock: self.clock,
            node: self.node,
        }
    }

    pub(super) fn stamp_of(&self, topic: &[u8]) -> Stamp {
        self.stamps.get(topic).copied().unwrap_or_default()
    }

    pub(super) fn tombstones(&self) -> impl Iterator<Item = (&Bytes, Stamp)> {
        self.tombstones
            .iter()
            .filter(|(_, t, s)| self.stamps.get(t) == Some(s))
            .map(|(_, t, s)| (t, *s))
    }

    pub(super) fn forget(&mut self, topic: &[u8]) {
        self.stamps.remove(topic);
    }

    /// Notes a stamp restored from the store (`deleted`: a tombstone).
    pub(super) fn restored(&mut self, topic: Bytes, stamp: Stamp, deleted: bool, now: u64) {
        self.clock = self.clock.max(stamp.clock);
        if deleted {
            self.tombstones.push_back((now, topic.clone(), stamp));
        }
        self.stamps.insert(topic, stamp);
    }
}

impl Engine {
    /// Starts stamping retained writes with this node's key (a hash of its name, the same on
    /// every start).
    pub(super) fn retained_stamping(&mut self, node_name: &str) {
        self.cluster.retained.node = node_key(node_name);
    }

    /// Whether a retained write of `topic` is applied here, and with which stamp: a write
    /// published here (`forwarded` None) gets a new one; a forwarded one only if its stamp
    /// is above the topic's. Outside a cluster, and for `$SYS`, every write applies
    /// unstamped.
    pub(super) fn retained_write(
        &mut self,
        topic: &Bytes,
        forwarded: Option<Stamp>,
        deleting: bool,
        now: u64,
    ) -> Option<Option<Stamp>> {
        let wall = self.wall(now);
        let r = &mut self.cluster.retained;
        r.routing = None;
        if r.node == 0 || topic.starts_with(b"$SYS") {
            return Some(None);
        }
        let stamp = match forwarded {
            Some(s) => {
                r.clock = r.clock.max(s.clock);
                if s <= r.stamp_of(topic) {
                    return None;
                }
                s
            }
            None => r.next(wall),
        };
        r.stamps.insert(topic.clone(), stamp);
        if deleting {
            r.tombstones.push_back((now, topic.clone(), stamp));
        }
        r.routing = Some(stamp);
        self.forget_tombstones(now);
        Some(Some(stamp))
    }

    /// Forgets deletions older than `TOMBSTONE_MS` or past `MAX_TOMBSTONES` (and their
    /// records), unless the topic was written again since.
    fn forget_tombstones(&mut self, now: u64) {
        loop {
            let r = &mut self.cluster.retained;
            let old = match r.tombstones.front() {
                Some((at, _, _)) => {
                    now.saturating_sub(*at) > TOMBSTONE_MS || r.tombstones.len() > MAX_TOMBSTONES
                }
                None => false,
            };
            if !old {
                return;
            }
            let (_, topic, stamp) = r.tombstones.pop_front().expect("checked");
            if r.stamps.get(&topic) == Some(&stamp) {
                r.stamps.remove(&topic);
                if self.cfg.durable {
                    self.delete(records::retained_key(&topic));
                }
            }
        }
    }

    /// Queues this node's whole retained set for peer `id` (just connected), for keeping
    /// only, then `RetainedSent`.
    pub(super) fn queue_retained_set(&mut self, id: PeerId, now: u64) {
        let mut item = Vec::new();
        let mut props = Vec::new();
        let mut items: Vec<Vec<u8>> = Vec::new();
        let r = &self.cluster.retained;
        for msg in self.retained.values() {
            if msg.expired(now) || msg.topic.starts_with(b"$SYS") {
                continue;
            }
            props.clear();
            if let Some(p) = msg.props.as_deref() {
                codec::encode_properties(p, &mut props).expect("retained properties encode");
            }
            item.clear();
            // Kept only: plain off, no groups.
            let stamp = Some(r.stamp_of(&msg.topic));
            encode_routed(
                msg,
                &props,
                now,
                false,
                Vec::new(),
                stamp,
                &mut Vec::new(),
                0,
                Vec::new(),
                &mut item,
            );
            items.push(item.clone());
        }
        for (topic, stamp) in r.tombstones() {
            item.clear();
            batch::encode_message(
                &WireMessage {
                    topic,
                    payload: b"",
                    qos: 0,
                    retain: true,
                    expires_in_ms: None,
                    props: b"",
                    plain: false,
                    groups: Vec::new(),
                    stamp: Some(stamp),
                    also: Vec::new(),
                    id: 0,
                    taken: Vec::new(),
                },
                &mut item,
            );
            items.push(item.clone());
        }
        self.cluster.queue_items(id, &items, true);
    }
}

/// A node's key in stamps: FNV-1a of its name (stable across starts and releases), never 0.
pub(super) fn node_key(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}
