//! What the engine keeps per message, per network connection and per session.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use super::acl::Permissions;
use super::auth::AuthState;
use super::limits::TokenBucket;
use crate::cluster::batch::Stamp;
use crate::codec::{LastWill, Properties, Protocol, QoS};
use crate::topics::SubOpts;

pub type ConnId = u32;
pub type SessionId = u32;

/// Origin of a message published by the broker itself (`$SYS`), never a session id.
pub const BROKER_ORIGIN: SessionId = u32::MAX;

/// One application message as routed: shared by every queue and in-flight slot that holds it.
#[derive(Debug)]
pub struct Message {
    pub topic: Bytes,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    /// Properties forwarded unchanged (payload format, content type, response topic,
    /// correlation data, user properties); expiry, alias and subscription ids are per delivery.
    pub props: Option<Box<Properties>>,
    /// Monotonic ms after which the message is no longer delivered.
    pub expires_at: Option<u64>,
    /// Publishing session, for no-local.
    pub origin: SessionId,
    /// Its id in the cluster (origin node's key and incarnation, and a counter), 0 if none:
    /// a session that just moved tells by it a message that reached it twice.
    pub id: u128,
}

impl Message {
    pub fn expired(&self, now: u64) -> bool {
        self.expires_at.is_some_and(|t| now >= t)
    }
}

/// A message waiting for, or in, delivery to one session: the message plus what this
/// subscriber's subscriptions made of it.
#[derive(Clone, Debug)]
pub struct Delivery {
    pub msg: Arc<Message>,
    pub qos: QoS,
    pub retain: bool,
    /// Subscription identifiers of every matching subscription (MQTT 5).
    pub sub_ids: Vec<u32>,
    /// Number of its stored record (durable sessions, QoS 1/2); 0 = not stored.
    pub seq: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
// Variants are named after the MQTT packets awaited.
#[allow(clippy::enum_variant_names)]
pub enum AwaitingAck {
    /// QoS 1 sent, waiting for PUBACK.
    PubAck,
    /// QoS 2 sent, waiting for PUBREC.
    PubRec,
    /// PUBREL sent, waiting for PUBCOMP.
    PubComp,
}

#[derive(Debug)]
pub struct Inflight {
    pub pkid: u16,
    pub state: AwaitingAck,
    pub delivery: Delivery,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnState {
    /// Waiting for CONNECT.
    AwaitConnect,
    /// A CONNECT (or the client's AUTH) awaits the caller's decision; input is buffered, not
    /// decoded.
    AwaitAuth,
    /// The broker sent AUTH 0x18 and waits for the client's AUTH (or DISCONNECT).
    AuthContinue,
    /// The CONNECT was accepted and waits for the other nodes' answers to its claim of the
    /// client id (broker::cluster_sessions); input is buffered, not decoded.
    AwaitClaim,
    Active,
    /// The engine asked the caller to close it; input is ignored.
    Closing,
}

pub struct Conn {
    pub state: ConnState,
    pub protocol: Protocol,
    /// Bytes read but not yet a whole packet.
    pub rx: BytesMut,
    /// Bytes to write, handed out by `drain`.
    pub out: Vec<u8>,
    pub close_after_write: bool,
    /// The client asked to close (DISCONNECT): the caller closes at once, no linger.
    pub client_closed: bool,
    /// Whether the connection is in the engine's dirty list.
    pub dirty: bool,
    /// False while the transport's write buffer is above its high-water mark.
    pub writable: bool,
    pub session: Option<SessionId>,
    pub opened_at: u64,
    pub last_rx: u64,
    /// Keepalive in ms (0 = none); the connection is closed after 1.5 times it.
    pub keep_alive_ms: u32,
    /// Boxed: most connections have no will, and an idle connection's size is the broker's
    /// memory per client.
    pub will: Option<Box<LastWill>>,
    /// Client's limits (MQTT 5 CONNECT properties).
    pub client_max_packet: u32,
    pub client_receive_max: u16,
    pub client_topic_alias_max: u16,
    /// Topic aliases (MQTT 5), boxed and made on first use: most clients use none, and two
    /// empty maps inline would cost every idle connection 96 bytes.
    pub aliases: Option<Box<TopicAliases>>,
    /// Whether the client wants reason strings and user properties on errors.
    pub problem_info: bool,
    pub client_id: Arc<str>,
    /// Unique over the engine's life (connection ids are reused): what a late answer about
    /// this connection is checked against.
    pub serial: u64,
    pub username: Option<Arc<str>>,
    /// What the connection may do; None = everything (no check at all).
    pub permissions: Option<Arc<Permissions>>,
    /// Publish-rate limit, when configured.
    pub bucket: Option<Box<TokenBucket>>,
    /// Authentication in progress, or the enhanced-authentication method kept for
    /// re-authentication.
    pub auth: Option<Box<AuthState>>,
    /// Publishes of this connection waiting in the interception queue.
    pub intercepted: u32,
    /// Whether packets are checked against limits before decoding (rate, interception).
    pub gated: bool,
    /// In the engine's held list: the caller stopped reading it.
    pub held: bool,
    /// A publish of it went to a peer node whose link is full: not read until that link
    /// drains (`cluster`).
    pub link_wait: bool,
    /// Sent at least one PUBLISH.
    pub published: bool,
    /// The caller holds an authentication request about it, not yet answered.
    pub auth_outstanding: bool,
    /// A CONNECT was decoded: `protocol` is the client's.
    pub connect_seen: bool,
}

#[derive(Default)]
pub struct TopicAliases {
    /// Aliases the broker assigned for topics it sends.
    pub outgoing: HashMap<Bytes, u16>,
    /// Aliases the client set for topics it publishes.
    pub incoming: HashMap<u16, Bytes>,
}

impl Conn {
    pub fn new(now: u64) -> Conn {
        Conn {
            state: ConnState::AwaitConnect,
            protocol: Protocol::V311,
            rx: BytesMut::new(),
            out: Vec::new(),
            close_after_write: false,
            client_closed: false,
            dirty: false,
            writable: true,
            session: None,
            opened_at: now,
            last_rx: now,
            keep_alive_ms: 0,
            will: None,
            client_max_packet: u32::MAX,
            client_receive_max: 65535,
            client_topic_alias_max: 0,
            aliases: None,
            problem_info: true,
            client_id: Arc::from(""),
            serial: 0,
            username: None,
            permissions: None,
            bucket: None,
            auth: None,
            intercepted: 0,
            gated: false,
            held: false,
            link_wait: false,
            published: false,
            auth_outstanding: false,
            connect_seen: false,
        }
    }
}

/// Packet ids of QoS 2 messages received, awaiting PUBREL. The set is made on first insert:
/// most sessions never receive QoS 2, and an empty set inline costs every session 48 bytes.
#[derive(Default)]
#[allow(clippy::box_collection)] // the Box is the point: 8 bytes inline instead of 48
pub struct InboundIds(Option<Box<HashSet<u16>>>);

impl InboundIds {
    pub fn contains(&self, pkid: &u16) -> bool {
        self.0.as_ref().is_some_and(|set| set.contains(pkid))
    }

    pub fn count(&self) -> usize {
        self.0.as_ref().map_or(0, |set| set.len())
    }

    /// Whether `pkid` was not in the set.
    pub fn insert(&mut self, pkid: u16) -> bool {
        self.0.get_or_insert_with(Default::default).insert(pkid)
    }

    /// Whether `pkid` was in the set.
    pub fn remove(&mut self, pkid: &u16) -> bool {
        self.0.as_mut().is_some_and(|set| set.remove(pkid))
    }

    pub fn iter(&self) -> impl Iterator<Item = &u16> {
        self.0.iter().flat_map(|set| set.iter())
    }
}

pub struct Session {
    pub client_id: Arc<str>,
    pub conn: Option<ConnId>,
    /// Filter (as subscribed, `$share/...` included) -> options.
    pub subs: HashMap<String, SubOpts, ProcessKeys>,
    /// Seconds the session outlives its connection; u32::MAX = forever.
    pub expiry: u32,
    pub disconnected_at: Option<u64>,
    /// Messages not yet sent (offline, window full, or transport not writable).
    pub queue: VecDeque<Delivery>,
    pub queued_bytes: usize,
    /// Sent, not yet acknowledged, in send order. Changed through `push_inflight` and
    /// `remove_inflight`, which keep `inflight_ids` in step.
    pub inflight: VecDeque<Inflight>,
    pub next_pkid: u16,
    /// In the engine's pending-pump list (queue sending stopped at its budget).
    pub pump_pending: bool,
    /// Whether the session has records in the store.
    pub stored: bool,
    /// Sequence number of the last stored message (keys of its records).
    pub next_seq: u64,
    /// QoS 2 packet ids received and passed on, awaiting PUBREL: a repeat is not delivered
    /// again.
    pub inbound_qos2: InboundIds,
    /// What few sessions use, made on first use (`rare_mut`).
    pub rare: Option<Box<SessionRare>>,
    /// In a cluster, the version of this session here (see broker::cluster_replicas): set
    /// when it becomes durable or is installed, stored with it, carried by its copies.
    pub stamp: Option<Stamp>,
    /// For a while after it moved here, the ids of the messages that reached it: the same
    /// message can come along several paths then (broker::cluster_sessions).
    pub recent: Option<Box<RecentIds>>,
}

/// The hasher of a session's subscription map: one random key for the whole process (as
/// resistant to chosen collisions as `RandomState`) and none in each map, so a session
/// without subscriptions costs 32 bytes for it, not 48.
#[derive(Clone, Copy, Default)]
pub struct ProcessKeys;

impl std::hash::BuildHasher for ProcessKeys {
    type Hasher = std::collections::hash_map::DefaultHasher;

    fn build_hasher(&self) -> Self::Hasher {
        static KEYS: std::sync::OnceLock<std::collections::hash_map::RandomState> =
            std::sync::OnceLock::new();
        KEYS.get_or_init(Default::default).build_hasher()
    }
}

/// The parts of a session that most sessions never use, boxed apart: an idle session's size
/// is most of the broker's memory per client (80 bytes less each).
#[derive(Default)]
pub struct SessionRare {
    /// The packet ids in `inflight` as a bitset, built once the window is large (below that
    /// a scan is cheaper and costs no memory); dropped when the window empties.
    pub inflight_ids: Option<Box<PkidSet>>,
    /// A will waiting for its delay (or the session end) after an abnormal disconnect.
    pub pending_will: Option<(Box<LastWill>, u64)>,
    /// Set when some subscription is not wholly inside the permissions' READ rules: each
    /// message delivered is then checked against them.
    pub read_check: Option<Arc<Permissions>>,
    /// QoS 2 packet ids received and waiting in the interception queue: a resend is ignored
    /// (the PUBREC goes out on release).
    pub intercepting: Vec<u16>,
    /// The store number from which on messages here were listed as taken to a lagging peer
    /// (0: none): those only this version has, handed over whatever its age if a newer
    /// version made meanwhile elsewhere wins (broker::cluster_replicas::give_up).
    pub taken_from_seq: u64,
    /// In a cluster, how far each peer's routed messages had come here (origin, sequence)
    /// when the session began to live here: what came after, until it moves on, it took
    /// here (broker::cluster_took_routed). None: not known (restored at start-up).
    pub routed_since: Option<Box<[(u64, u64)]>>,
}

/// Message ids a session got since it moved, until `until` (monotonic ms).
#[derive(Debug, Default)]
pub struct RecentIds {
    pub until: u64,
    pub ids: HashSet<u128>,
    /// The key of the dead home it was taken over from (0: none), whose kept messages it
    /// got (`kept`, broker::cluster_kept): remembered while that node is down and for
    /// `until`'s span once it is back (`kept_until`, 0 until then).
    pub kept_from: u64,
    pub kept_until: u64,
    pub kept: HashSet<u128>,
    /// How far that home had applied each node's batches, as the copy it was installed
    /// from knew it (asked again with them when a link comes up).
    pub kept_marks: Vec<crate::cluster::batch::Mark>,
    /// The nodes (keys) whose answers to this session's ask for kept messages have not
    /// ended yet, and until when it waits for each: meanwhile nothing new is sent to the
    /// client, so that the older messages they bring go first (`cluster_kept`).
    pub kept_waits: Vec<(u64, u64)>,
    /// Messages another version of the session took while its node was cut off from this
    /// one (`TakenIds`, broker::cluster_kept), until `twin_until`; the key of that node.
    pub twin: HashSet<u128>,
    pub twin_node: u64,
    pub twin_until: u64,
    /// That version's stamp, and whether its hand-over ended here (`KeptEnd`): passed on
    /// with `twin` if this version moves on.
    pub twin_stamp: crate::cluster::batch::Stamp,
    pub twin_handed: bool,
    /// The nodes (keys) out of reach when the client came back here: each may hold
    /// another version of the session, and says what it took first thing once its link is
    /// up. Until it has, what other nodes send once theirs are up waits (at most
    /// `KEPT_WAIT_MS`, broker::cluster_kept).
    pub untold: Vec<u64>,
    /// The live home it came from (its key), which relays for it, until that home says it
    /// took in what the peers that lagged at the hand-over had sent it (`KeptEnd`; 0 then,
    /// or none): a batch on its way there as a split began reaches it only once the split
    /// heals, and is relayed here then (broker::cluster_sessions).
    pub relay_home: u64,
    /// The live home it came from (its key, 0: none) and until when (monotonic ms) its
    /// relay may bring older messages of a publishing node than that node sends here
    /// straight (broker::cluster_relay_order).
    pub relayed_by: u64,
    pub relayed_until: u64,
    /// Per publishing node, the first id that came here straight and went to that home
    /// too, whose relayed copy has not come yet, and until when it is waited for:
    /// meanwhile nothing new is sent to the client.
    pub relay_waits: Vec<(u128, u64)>,
    /// The publishing nodes (their keys) whose first such message's relayed copy came:
    /// everything they sent the old home alone came before it.
    pub relay_caught_up: Vec<u64>,
    /// The other way round: per publishing node, the first id the old home relayed here
    /// before it came straight (it was sent here too), and until when it is waited for;
    /// and the publishing nodes whose first such message came straight since.
    pub direct_waits: Vec<(u128, u64)>,
    pub direct_caught_up: Vec<u64>,
    /// The live home it came from (its key, 0: none), and per publishing node the range of
    /// its routed messages that came there while the session lived there: taken there
    /// (broker::cluster_took_routed).
    pub took_from: u64,
    pub took_ranges: Vec<crate::cluster::batch::RoutedRange>,
}

impl RecentIds {
    /// Whether the session sends nothing new to its client: it waits for older messages
    /// (broker::cluster_kept, broker::cluster_relay_order).
    pub fn holds(&self) -> bool {
        !self.kept_waits.is_empty() || !self.relay_waits.is_empty() || !self.direct_waits.is_empty()
    }
}

impl Session {
    pub fn new(client_id: Arc<str>) -> Session {
        Session {
            client_id,
            conn: None,
            subs: HashMap::default(),
            expiry: 0,
            disconnected_at: None,
            queue: VecDeque::new(),
            queued_bytes: 0,
            pump_pending: false,
            stored: false,
            next_seq: 0,
            inflight: VecDeque::new(),
            next_pkid: 1,
            inbound_qos2: InboundIds::default(),
            rare: None,
            stamp: None,
            recent: None,
        }
    }

    pub fn rare(&self) -> Option<&SessionRare> {
        self.rare.as_deref()
    }

    pub fn rare_mut(&mut self) -> &mut SessionRare {
        self.rare.get_or_insert_with(Default::default)
    }

    pub fn pending_will(&self) -> Option<&(Box<LastWill>, u64)> {
        self.rare()?.pending_will.as_ref()
    }

    pub fn take_pending_will(&mut self) -> Option<(Box<LastWill>, u64)> {
        self.rare.as_mut()?.pending_will.take()
    }

    pub fn read_check(&self) -> Option<&Arc<Permissions>> {
        self.rare()?.read_check.as_ref()
    }

    pub fn set_read_check(&mut self, perms: Option<Arc<Permissions>>) {
        if perms.is_some() || self.rare.is_some() {
            self.rare_mut().read_check = perms;
        }
    }

    pub fn taken_from_seq(&self) -> u64 {
        self.rare().map_or(0, |r| r.taken_from_seq)
    }

    /// Next packet id not in flight (1..=65535). The caller checked the window has room.
    pub fn alloc_pkid(&mut self) -> u16 {
        loop {
            let id = self.next_pkid;
            self.next_pkid = if id == u16::MAX { 1 } else { id + 1 };
            let in_use = if self.inflight.len() < SCAN_BELOW {
                self.inflight.iter().any(|f| f.pkid == id)
            } else {
                let inflight = &self.inflight;
                self.rare
                    .get_or_insert_with(Default::default)
                    .inflight_ids
                    .get_or_insert_with(|| {
                        let mut set = Box::new(PkidSet([0; 1024]));
                        for f in inflight {
                            set.insert(f.pkid);
                        }
                        set
                    })
                    .contains(id)
            };
            if !in_use {
                return id;
            }
        }
    }

    pub fn push_inflight(&mut self, f: Inflight) {
        if let Some(set) = self.rare.as_mut().and_then(|r| r.inflight_ids.as_mut()) {
            set.insert(f.pkid);
        }
        self.inflight.push_back(f);
    }

    pub fn remove_inflight(&mut self, i: usize) -> Option<Inflight> {
        let f = self.inflight.remove(i)?;
        if let Some(rare) = self.rare.as_mut() {
            if self.inflight.is_empty() {
                rare.inflight_ids = None;
            } else if let Some(set) = &mut rare.inflight_ids {
                set.remove(f.pkid);
            }
        }
        Some(f)
    }
}

/// Windows smaller than this find a free packet id by scanning.
const SCAN_BELOW: usize = 64;

/// One bit per packet id.
pub struct PkidSet([u64; 1024]);

impl PkidSet {
    fn insert(&mut self, id: u16) {
        self.0[usize::from(id >> 6)] |= 1 << (id & 63);
    }

    fn remove(&mut self, id: u16) {
        self.0[usize::from(id >> 6)] &= !(1 << (id & 63));
    }

    fn contains(&self, id: u16) -> bool {
        self.0[usize::from(id >> 6)] & (1 << (id & 63)) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inflight(pkid: u16, msg: &Arc<Message>) -> Inflight {
        Inflight {
            pkid,
            state: AwaitingAck::PubAck,
            delivery: Delivery {
                msg: msg.clone(),
                qos: QoS::AtLeastOnce,
                retain: false,
                sub_ids: Vec::new(),
                seq: 0,
            },
        }
    }

    #[test]
    fn packet_ids_stay_unique_across_wraps_and_holes_in_a_full_window() {
        let msg = Arc::new(Message {
            topic: Bytes::from_static(b"t"),
            payload: Bytes::new(),
            qos: QoS::AtLeastOnce,
            retain: false,
            props: None,
            expires_at: None,
            origin: 0,
            id: 0,
        });
        let mut s = Session::new(Arc::from("c"));
        let mut live = std::collections::HashSet::new();
        // Fill almost the whole id space, acknowledge every third, refill, three times over.
        for round in 0..3 {
            while s.inflight.len() < 65_000 {
                let id = s.alloc_pkid();
                assert!(id != 0 && live.insert(id), "round {round}: id {id} reused");
                s.push_inflight(inflight(id, &msg));
            }
            let mut i = 0;
            while i < s.inflight.len() {
                let f = s.remove_inflight(i).unwrap();
                live.remove(&f.pkid);
                i += 2;
            }
        }
        while let Some(f) = s.remove_inflight(0) {
            live.remove(&f.pkid);
        }
        assert!(s.rare().is_none_or(|r| r.inflight_ids.is_none()) && live.is_empty());
    }
}
