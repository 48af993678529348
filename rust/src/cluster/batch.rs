//! Data-plane batches between nodes: everything one node sends another in one loop iteration
//! (route rows, forwarded messages, acknowledgements), as one frame of kind [`DATA_FRAME`]
//! whose value is one byte string (so the link layer hands it over without looking inside).
//!
//! A batch body, little-endian (the store's record encoding, [`crate::store::wire`]):
//!
//! | field | type | meaning |
//! |---|---|---|
//! | version | u8 | [`BATCH_VERSION`] |
//! | flags | u8 | bit 0: the items are zstd-compressed (large batches, when the link is backed up) |
//! | epoch | u64 | the sender's incarnation (random per process start) |
//! | seq | u64 | reliable batch number from 1, or 0: not to be acknowledged (QoS 0 only) |
//! | ack_epoch, ack_seq | u64, u64 | the receiver's reliable batches taken so far |
//! | items | bytes | count u32, then each item: a tag u8 and its fields |
//!
//! Items: route rows are versioned per origin (every add or remove is one version more, a
//! snapshot replaces all rows of its sender), so a receiver notices a gap and asks for a
//! snapshot, and a late or replayed row never brings back a removed one. A message carries
//! its QoS as published, the retain flag, the time left before it expires (ms) and its MQTT 5
//! properties (the block as on the wire, empty when none). A retained message also carries
//! its [`Stamp`], by which every node keeps the same last write of a topic; one sent only to
//! be kept (plain off, no groups) is an entry of the sender's retained set, which it sends
//! whole when a link comes up and ends with [`Item::RetainedSent`].

use crate::store::wire::{BodyError, Reader, Writer};

use super::frame::{finish_frame, start_frame};
use super::wire::Writer as ValueWriter;

/// The frame kind of a data-plane batch (the link's own kinds are below 16, the control
/// plane's from 16 to 31).
pub const DATA_FRAME: u8 = 32;
pub const BATCH_VERSION: u8 = 1;
/// Items larger than this (uncompressed) are compressed.
pub const COMPRESS_ABOVE: usize = 16 * 1024;
/// A batch decompresses to at most this much: a peer cannot make us allocate more. Room for
/// one message of MQTT's largest packet (256 MiB) behind a batch closed at 1 MiB.
pub const MAX_BATCH: usize = 320 * 1024 * 1024;
/// Items in one batch at most (each is a few bytes at least; this bounds the count field).
const MAX_ITEMS: u32 = 16 * 1024 * 1024;

const FLAG_ZSTD: u8 = 1;

const ITEM_ROUTE_SNAPSHOT: u8 = 1;
const ITEM_ROUTE_ADD: u8 = 2;
const ITEM_ROUTE_REMOVE: u8 = 3;
const ITEM_RESYNC: u8 = 4;
const ITEM_MESSAGE: u8 = 5;
const ITEM_RETAINED_SENT: u8 = 6;
const ITEM_KICK: u8 = 7;
const ITEM_CLAIM: u8 = 8;
const ITEM_CLAIM_ANSWER: u8 = 9;
const ITEM_SESSION_MESSAGE: u8 = 10;
const ITEM_COPY: u8 = 11;
const ITEM_COPY_CHECK: u8 = 12;
const ITEM_FENCE: u8 = 13;
const ITEM_INSTALLED: u8 = 14;
const ITEM_SAFE: u8 = 15;
const ITEM_COPY_ANSWER: u8 = 16;
/// Protocol 7: a session taken over from a dead home asks for what was kept for it.
const ITEM_KEPT_ASK: u8 = 17;
const ITEM_KEPT_MESSAGE: u8 = 18;
const ITEM_APPLIED: u8 = 19;
/// A `CopyAnswer` with the home's `Applied` marks the copy holds (protocol 7).
const ITEM_COPY_ANSWER_MARKED: u8 = 20;
/// Protocol 8.
const ITEM_RELAY_END: u8 = 21;
const ITEM_KEPT_STATE: u8 = 22;
/// Protocol 9.
const ITEM_WILL_COPY: u8 = 23;
const ITEM_WILL_GONE: u8 = 24;
const ITEM_WILL_FIRED: u8 = 25;
/// Protocol 10.
const ITEM_HOMES: u8 = 26;
const ITEM_HOME: u8 = 27;
const ITEM_CLAIM_ROUTE: u8 = 28;
const ITEM_CLAIM_ROUTED: u8 = 29;
/// Protocol 12.
const ITEM_KEPT_END: u8 = 30;
/// Protocol 13.
const ITEM_TAKEN_IDS: u8 = 31;
/// Protocol 14.
const ITEM_RELEASED_MESSAGE: u8 = 32;
/// Protocol 15: a node key, then one of the three session message items above or a
/// `KeptEnd`.
const ITEM_HANDED_ON: u8 = 33;
/// Protocol 16.
const ITEM_TOOK_ROUTED: u8 = 34;
/// `Homes` flags.
const HOMES_FIRST: u8 = 1;
const HOMES_LAST: u8 = 2;
/// `KeptAsk` flags.
const ASK_AGAIN: u8 = 1;
const ASK_APPLIED: u8 = 2;

const CLAIM_DISCARD: u8 = 1;
/// `KeptAsk` subscription flags, beside the QoS in the low two bits.
const SUB_RAP: u8 = 0b100;
/// `Copy` flags: a value follows (a put, else a delete); the home's moment follows (6).
const COPY_PUT: u8 = 1;
const COPY_AT: u8 = 2;

const MSG_RETAIN: u8 = 0b100;
const MSG_NOT_PLAIN: u8 = 0b1000;
const MSG_STAMPED: u8 = 0b1_0000;
const MSG_ALSO: u8 = 0b10_0000;
/// Protocol 5: the message's cluster-wide id follows.
const MSG_ID: u8 = 0b100_0000;
/// Protocol 11: the client ids of the sender's sessions that took the message follow.
const MSG_TAKEN: u8 = 0b1000_0000;
/// Client ids a message lists as taken on its sender at most.
pub const TAKEN_MAX: usize = 64;

/// The version of a retained write: a hybrid logical clock (wall milliseconds << 16, plus
/// a counter) and the writing node's key, compared in that order. Every node applies a
/// retained write only if its stamp is above the topic's current one, so concurrent writes
/// end in the same value everywhere, whatever order they arrive in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Stamp {
    pub clock: u64,
    pub node: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    pub epoch: u64,
    pub seq: u64,
    pub ack_epoch: u64,
    pub ack_seq: u64,
}

/// A message as forwarded: what the receiving node needs to route it as if published there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WireMessage<'a> {
    pub topic: &'a [u8],
    pub payload: &'a [u8],
    pub qos: u8,
    pub retain: bool,
    /// Milliseconds left before the message expires (MQTT 5 message expiry), counted down
    /// on the sender at the moment it was batched.
    pub expires_in_ms: Option<u64>,
    /// MQTT 5 properties block to forward (as the codec encodes it), or empty.
    pub props: &'a [u8],
    /// For the receiver's plain subscriptions (false: only for `groups`).
    pub plain: bool,
    /// Shared subscriptions (`$share/g/f`) the receiver delivers it to, one member each:
    /// the sender picked the receiver's members for them, cluster-wide.
    pub groups: Vec<&'a str>,
    /// The retained write's version (retained messages only).
    pub stamp: Option<Stamp>,
    /// The keys of the other nodes this message went to for their plain subscriptions
    /// (empty when it went to one node only): a node relaying for a session that moved to
    /// one of them does not send it a second copy.
    pub also: Vec<u64>,
    /// The message's cluster-wide id (0: none; sent only to peers of protocol 5).
    pub id: u128,
    /// Client ids of persistent sessions on the sender that took the message (protocol
    /// 11; listed for a peer out of reach, at most `TAKEN_MAX`): a version of one of them on
    /// the receiver, made meanwhile, does not deliver it again (the sender's version hands
    /// over what its client did not get when the two merge).
    pub taken: Vec<&'a str>,
}

/// How far a home applied one node's batches: that node's key, incarnation, batch number.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Mark {
    pub node: u64,
    pub epoch: u64,
    pub seq: u64,
}

/// The messages one node published that came to another routed while a session lived
/// there (`Item::TookRouted`): the origin of their ids, and the range `(after, upto]` of
/// their sequence numbers (the low 64 bits of an id).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RoutedRange {
    pub origin: u64,
    pub after: u64,
    pub upto: u64,
}

/// A subscription of a session, as a `KeptAsk` carries it (plain filters only).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeptSub<'a> {
    pub filter: &'a str,
    pub qos: u8,
    pub retain_as_published: bool,
    pub identifier: u32,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item<'a> {
    /// All route rows of the sender, replacing what the receiver held, at `version`.
    RouteSnapshot {
        version: u64,
        filters: Vec<&'a str>,
    },
    RouteAdd {
        version: u64,
        filter: &'a str,
    },
    RouteRemove {
        version: u64,
        filter: &'a str,
    },
    /// The receiver of this asks the sender for a snapshot of its routes.
    Resync,
    Message(WireMessage<'a>),
    /// The sender's whole retained set was sent before this item (since its link came up).
    RetainedSent,
    /// An administrator kicked this client id: its connection and session end on every node
    /// (protocol 3 on; never sent to a peer that speaks 2).
    Kick {
        client_id: &'a str,
    },
    /// A message for session `client_id`, which moved from the sender to the receiver: the
    /// sender's subscriptions for it still matched (route rows take a moment to move).
    ///
    /// `kept` (protocol 7): the answer to a `KeptAsk`, a message the sender had kept for
    /// the session's dead home: the receiver remembers its id as long as that home may
    /// still come back and send it on.
    ///
    /// `released` (protocol 14): a QoS 2 message the sender's version of the session had
    /// sent PUBREL for (this packet id) when it gave way to the receiver's: the client may
    /// have delivered it already, so the receiver sends that PUBREL again, not the message,
    /// where the packet id is free in its version.
    SessionMessage {
        client_id: &'a str,
        qos: u8,
        retain: bool,
        sub_ids: Vec<u32>,
        message: WireMessage<'a>,
        kept: bool,
        released: Option<u16>,
        /// The node (key) the sender got it from for a session that had moved on from the
        /// sender (0: the sender's own): the receiver tells that node's hand-over of what
        /// its version of the session took from the same ids arriving by other paths.
        origin: u64,
    },
    /// The sender installed session `client_id` from a copy: its home (node key `home`) is
    /// down. The receiver sends it, as kept `SessionMessage`s, what it keeps for that home
    /// that matches `subs` (protocol 7). Sent after the sender's route rows for them, so
    /// what the receiver publishes later comes straight to the sender. `again`: asked when
    /// a link came back, after the session was installed; what the receiver also sent the
    /// sender for its own rows reached the session that way.
    ///
    /// `applied`: how far the home had applied the receiver's batches (its incarnation and
    /// batch number), as the copy the session was installed from knows it: batches written
    /// to the home's link past that are sent on too (without it, none written to the link).
    KeptAsk {
        client_id: &'a str,
        home: u64,
        again: bool,
        applied: Option<(u64, u64)>,
        subs: Vec<KeptSub<'a>>,
    },
    /// The sender's answer to the receiver's `KeptAsk` for `client_id` ends here: what the
    /// sender kept in memory went before this item (protocol 12). What comes after it from
    /// the sender is newer than all of that. Also sent after what a version of the session
    /// on the sender, found older, handed over to the receiver's (protocol 13).
    ///
    /// `origin` (protocol 15): passed on by a node the session had moved on from, which got
    /// it from the node with that key (0: the sender's own).
    KeptEnd {
        client_id: &'a str,
        origin: u64,
    },
    /// The version `stamp` of session `client_id` on the node with key `node` delivered the
    /// messages with `ids` (of what reached it since it moved there, and what was kept for
    /// its old home, `cluster_kept`), maybe while cut off from the receiver: the receiver's
    /// version of it does not take them from another path, and the older of the two gives
    /// way to the newer (protocol 13). Sent ahead of what waited for the receiver, and
    /// passed on along a relay of the session.
    TakenIds {
        client_id: &'a str,
        stamp: Stamp,
        node: u64,
        ids: Vec<u128>,
    },
    /// The sender (a session's home) has applied the reliable batches of the node with key
    /// `node` of its incarnation `epoch` up to `seq`, and the copies they made went before
    /// this item (protocol 7; sent to the owners it copied to).
    Applied(Mark),
    /// The sender has a CONNECT for `client_id`, stamped with its clock: the receiver closes
    /// its own connection of that client (DISCONNECT 0x8E) and hands the session over in a
    /// `ClaimAnswer`, or ends it (`discard`: a clean start, or the sender holds one already).
    /// Racing claims: the highest stamp wins (see broker::cluster_sessions).
    Claim {
        client_id: &'a str,
        stamp: Stamp,
        discard: bool,
    },
    /// The answer to the claim with `stamp`: the session's store records (key, sealed value)
    /// as the store holds them, or none. `copy_at` (protocol 6): read from a copy, which was
    /// current as of that moment of its home (`Copy::at`); the claimant takes the newest.
    ///
    /// `marks` (protocol 7, with `copy_at` only): the `Applied` marks of the session's home
    /// the copy's owner holds: how far the home had applied each node's batches.
    ClaimAnswer {
        client_id: &'a str,
        stamp: Stamp,
        records: Vec<(&'a [u8], &'a [u8])>,
        copy_at: Option<u64>,
        marks: Vec<Mark>,
    },
    /// One store operation on a session record of the sender (its home), for the receiver's
    /// copy (protocol 4): put `value` (sealed, as the sender stores it) under `key`, or
    /// delete it. `stamp` is the session's version; `map` the sender's partition map version;
    /// `at` (protocol 6, else 0) the home's clock when it made the operation: how current a
    /// copy is, compared between owners.
    Copy {
        map: u64,
        stamp: Stamp,
        key: &'a [u8],
        value: Option<&'a [u8]>,
        at: u64,
    },
    /// The sender holds session `client_id` at version `stamp` (sent when a link comes up):
    /// the receiver answers with a `Fence`.
    CopyCheck {
        client_id: &'a str,
        stamp: Stamp,
    },
    /// The newest version of session `client_id` the sender knows, and its home (`stamp`
    /// zero and `home` empty: none newer than asked). A receiver holding an older one gives
    /// it up, without a will, to `home` (which has the session).
    Fence {
        client_id: &'a str,
        stamp: Stamp,
        home: &'a str,
    },
    /// The sender installed session `client_id` (it moved there): what it routes after this
    /// item it delivers to the session itself, so a node relaying for the session does not
    /// send those back; what it routed before, it did not.
    Installed {
        client_id: &'a str,
    },
    /// Every node has the sender's route rows for session `client_id`, which moved to the
    /// sender from the receiver (protocol 8): the receiver's relay for it may end.
    RelayEnd {
        client_id: &'a str,
    },
    /// Sent after the `ClaimAnswer` that hands session `client_id` over, if the session was
    /// installed on the sender from a copy of a home that is still down or back only a
    /// moment ago (node key `home`; protocol 8): the marks of that copy and the ids of the
    /// messages other nodes kept for the home that reached the session. The receiver asks
    /// the nodes again (some may have been out of the sender's reach) and takes each of
    /// those ids once.
    KeptState {
        client_id: &'a str,
        home: u64,
        marks: Vec<Mark>,
        ids: Vec<u128>,
    },
    /// Sent after the `ClaimAnswer` that hands session `client_id` over (protocol 16): for
    /// each node (by the origin of its message ids), the range `(after, upto]` of its
    /// message sequence numbers that came to the sender routed while the session lived
    /// there. Those it routed to the sender too, the session took there (or they are in
    /// what the answer hands over): a copy sent straight to the receiver, before that node
    /// knew the session lives there, is not delivered again.
    TookRouted {
        client_id: &'a str,
        ranges: Vec<RoutedRange>,
    },
    /// Connection `client_id` on the sender, whose session ends with it, has this will
    /// (`records::encode_will`); `stamp`: the connection's version. Sent to the owners of
    /// the client id's partition (protocol 9), which publish it if the sender dies.
    WillCopy {
        client_id: &'a str,
        stamp: Stamp,
        will: &'a [u8],
    },
    /// The connection of `client_id` with version `stamp` ended on the sender (its will was
    /// published there or discarded): the receiver drops its copy (protocol 9).
    WillGone {
        client_id: &'a str,
        stamp: Stamp,
    },
    /// The sender, an owner of `client_id`'s partition, published the will of its
    /// connection with version `stamp` on the receiver while the receiver was out of its
    /// reach (protocol 9): the receiver closes that connection, without the will.
    WillFired {
        client_id: &'a str,
        stamp: Stamp,
    },
    /// The sender applied the receiver's reliable batches of its incarnation `epoch` up to
    /// `seq` and its copies of what they stored are acknowledged (the header's acknowledgement
    /// says applied only): the receiver's publishers may be acknowledged.
    Safe {
        epoch: u64,
        seq: u64,
    },
    /// The sender holds the sessions of `clients` (connected or not), of partitions the
    /// receiver owns in map `map` (protocol 10): a snapshot in parts; `first` replaces what
    /// the receiver knew of the sender, `last` ends it.
    Homes {
        map: u64,
        first: bool,
        last: bool,
        clients: Vec<&'a str>,
    },
    /// A session of `client_id` came to the sender (`here`) or left it (protocol 10; sent to
    /// the owners of its partition).
    Home {
        client_id: &'a str,
        here: bool,
    },
    /// The sender has a CONNECT for `client_id`: the receiver, the first owner of its
    /// partition the sender reaches, stamps the claim (after every claim it stamped before)
    /// and says which nodes may hold the client (protocol 10).
    ClaimRoute {
        client_id: &'a str,
        req: u64,
    },
    /// The answer to `ClaimRoute` number `req`: the claim's stamp and the nodes (keys) to
    /// claim from: where the client's session is, claims stamped before, and nodes whose
    /// sessions the sender does not all know.
    ClaimRouted {
        client_id: &'a str,
        req: u64,
        stamp: Stamp,
        ask: Vec<u64>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchError(pub String);

impl std::fmt::Display for BatchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<BodyError> for BatchError {
    fn from(e: BodyError) -> Self {
        BatchError(format!("malformed batch: {}", e.0))
    }
}

/// Items of one batch being written; `finish` makes the frame.
#[derive(Default)]
pub struct ItemWriter {
    w: Writer,
    count: u32,
}

impl ItemWriter {
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    pub fn len(&self) -> usize {
        self.w.buf.len()
    }

    pub fn route_snapshot<'f>(
        &mut self,
        version: u64,
        filters: impl ExactSizeIterator<Item = &'f str>,
    ) {
        self.w
            .u8(ITEM_ROUTE_SNAPSHOT)
            .u64(version)
            .u32(filters.len() as u32);
        for f in filters {
            self.w.bytes(f.as_bytes());
        }
        self.count += 1;
    }

    pub fn route_add(&mut self, version: u64, filter: &str) {
        self.route_row(ITEM_ROUTE_ADD, version, filter);
    }

    pub fn route_remove(&mut self, version: u64, filter: &str) {
        self.route_row(ITEM_ROUTE_REMOVE, version, filter);
    }

    fn route_row(&mut self, item: u8, version: u64, filter: &str) {
        self.w.u8(item).u64(version).bytes(filter.as_bytes());
        self.count += 1;
    }

    pub fn resync(&mut self) {
        self.w.u8(ITEM_RESYNC);
        self.count += 1;
    }

    pub fn retained_sent(&mut self) {
        self.w.u8(ITEM_RETAINED_SENT);
        self.count += 1;
    }

    pub fn kick(&mut self, client_id: &str) {
        self.w.u8(ITEM_KICK).bytes(client_id.as_bytes());
        self.count += 1;
    }

    pub fn claim(&mut self, client_id: &str, stamp: Stamp, discard: bool) {
        self.w
            .u8(ITEM_CLAIM)
            .bytes(client_id.as_bytes())
            .u64(stamp.clock)
            .u64(stamp.node)
            .u8(if discard { CLAIM_DISCARD } else { 0 });
        self.count += 1;
    }

    /// `marks` (with `copy_at` only; protocol 7): see `Item::ClaimAnswer`.
    pub fn claim_answer(
        &mut self,
        client_id: &str,
        stamp: Stamp,
        records: &[(Vec<u8>, Vec<u8>)],
        copy_at: Option<u64>,
        marks: Option<&[Mark]>,
    ) {
        let kind = match (copy_at, marks) {
            (Some(_), Some(_)) => ITEM_COPY_ANSWER_MARKED,
            (Some(_), None) => ITEM_COPY_ANSWER,
            (None, _) => ITEM_CLAIM_ANSWER,
        };
        self.w
            .u8(kind)
            .bytes(client_id.as_bytes())
            .u64(stamp.clock)
            .u64(stamp.node);
        if let Some(at) = copy_at {
            self.w.u64(at);
            if let Some(marks) = marks {
                self.w.u32(marks.len() as u32);
                for m in marks {
                    self.w.u64(m.node).u64(m.epoch).u64(m.seq);
                }
            }
        }
        self.w.u32(records.len() as u32);
        for (key, value) in records {
            self.w.bytes(key).bytes(value);
        }
        self.count += 1;
    }

    /// `at`: the home's moment (sent to peers of protocol 6 only).
    pub fn copy(
        &mut self,
        map: u64,
        stamp: Stamp,
        key: &[u8],
        value: Option<&[u8]>,
        at: Option<u64>,
    ) {
        self.w
            .u8(ITEM_COPY)
            .u64(map)
            .u64(stamp.clock)
            .u64(stamp.node)
            .bytes(key);
        let flags = u8::from(value.is_some()) * COPY_PUT + u8::from(at.is_some()) * COPY_AT;
        self.w.u8(flags);
        if let Some(at) = at {
            self.w.u64(at);
        }
        if let Some(v) = value {
            self.w.bytes(v);
        }
        self.count += 1;
    }

    pub fn copy_check(&mut self, client_id: &str, stamp: Stamp) {
        self.session_stamp(ITEM_COPY_CHECK, client_id, stamp);
    }

    pub fn fence(&mut self, client_id: &str, stamp: Stamp, home: &str) {
        self.session_stamp(ITEM_FENCE, client_id, stamp);
        self.w.bytes(home.as_bytes());
    }

    pub fn safe(&mut self, epoch: u64, seq: u64) {
        self.w.u8(ITEM_SAFE).u64(epoch).u64(seq);
        self.count += 1;
    }

    pub fn kept_ask(
        &mut self,
        client_id: &str,
        home: u64,
        again: bool,
        applied: Option<(u64, u64)>,
        subs: &[KeptSub<'_>],
    ) {
        let flags =
            if again { ASK_AGAIN } else { 0 } | if applied.is_some() { ASK_APPLIED } else { 0 };
        self.w
            .u8(ITEM_KEPT_ASK)
            .bytes(client_id.as_bytes())
            .u64(home)
            .u8(flags);
        if let Some((epoch, seq)) = applied {
            self.w.u64(epoch).u64(seq);
        }
        self.w.u32(subs.len() as u32);
        for s in subs {
            let flags = s.qos | if s.retain_as_published { SUB_RAP } else { 0 };
            self.w
                .bytes(s.filter.as_bytes())
                .u8(flags)
                .u32(s.identifier);
        }
        self.count += 1;
    }

    pub fn applied(&mut self, m: Mark) {
        self.w.u8(ITEM_APPLIED).u64(m.node).u64(m.epoch).u64(m.seq);
        self.count += 1;
    }

    pub fn installed(&mut self, client_id: &str) {
        self.w.u8(ITEM_INSTALLED).bytes(client_id.as_bytes());
        self.count += 1;
    }

    pub fn will_copy(&mut self, client_id: &str, stamp: Stamp, will: &[u8]) {
        self.session_stamp(ITEM_WILL_COPY, client_id, stamp);
        self.w.bytes(will);
    }

    pub fn will_gone(&mut self, client_id: &str, stamp: Stamp) {
        self.session_stamp(ITEM_WILL_GONE, client_id, stamp);
    }

    pub fn will_fired(&mut self, client_id: &str, stamp: Stamp) {
        self.session_stamp(ITEM_WILL_FIRED, client_id, stamp);
    }

    pub fn relay_end(&mut self, client_id: &str) {
        self.w.u8(ITEM_RELAY_END).bytes(client_id.as_bytes());
        self.count += 1;
    }

    /// `origin` as in [`Item::KeptEnd`] (not 0 only to a peer of protocol 15).
    pub fn kept_end(&mut self, client_id: &str, origin: u64) {
        if origin != 0 {
            self.w.u8(ITEM_HANDED_ON).u64(origin);
        }
        self.w.u8(ITEM_KEPT_END).bytes(client_id.as_bytes());
        self.count += 1;
    }

    pub fn took_routed(&mut self, client_id: &str, ranges: &[RoutedRange]) {
        self.w
            .u8(ITEM_TOOK_ROUTED)
            .bytes(client_id.as_bytes())
            .u32(ranges.len() as u32);
        for r in ranges {
            self.w.u64(r.origin).u64(r.after).u64(r.upto);
        }
        self.count += 1;
    }

    pub fn taken_ids(
        &mut self,
        client_id: &str,
        stamp: Stamp,
        node: u64,
        ids: impl ExactSizeIterator<Item = u128>,
    ) {
        self.session_stamp(ITEM_TAKEN_IDS, client_id, stamp);
        self.w.u64(node);
        self.ids(ids);
    }

    /// A count, then that many message ids (`read_ids`).
    fn ids(&mut self, ids: impl ExactSizeIterator<Item = u128>) {
        self.w.u32(ids.len() as u32);
        for id in ids {
            self.w.u64((id >> 64) as u64).u64(id as u64);
        }
    }

    pub fn kept_state(
        &mut self,
        client_id: &str,
        home: u64,
        marks: &[Mark],
        ids: impl ExactSizeIterator<Item = u128>,
    ) {
        self.w
            .u8(ITEM_KEPT_STATE)
            .bytes(client_id.as_bytes())
            .u64(home)
            .u32(marks.len() as u32);
        for m in marks {
            self.w.u64(m.node).u64(m.epoch).u64(m.seq);
        }
        self.ids(ids);
        self.count += 1;
    }

    pub fn homes<'c>(
        &mut self,
        map: u64,
        first: bool,
        last: bool,
        clients: impl ExactSizeIterator<Item = &'c str>,
    ) {
        let flags = if first { HOMES_FIRST } else { 0 } | if last { HOMES_LAST } else { 0 };
        self.w
            .u8(ITEM_HOMES)
            .u64(map)
            .u8(flags)
            .u32(clients.len() as u32);
        for c in clients {
            self.w.bytes(c.as_bytes());
        }
        self.count += 1;
    }

    pub fn home(&mut self, client_id: &str, here: bool) {
        self.w
            .u8(ITEM_HOME)
            .bytes(client_id.as_bytes())
            .u8(u8::from(here));
        self.count += 1;
    }

    pub fn claim_route(&mut self, client_id: &str, req: u64) {
        self.w
            .u8(ITEM_CLAIM_ROUTE)
            .bytes(client_id.as_bytes())
            .u64(req);
        self.count += 1;
    }

    pub fn claim_routed(&mut self, client_id: &str, req: u64, stamp: Stamp, ask: &[u64]) {
        self.w
            .u8(ITEM_CLAIM_ROUTED)
            .bytes(client_id.as_bytes())
            .u64(req)
            .u64(stamp.clock)
            .u64(stamp.node)
            .u32(ask.len() as u32);
        for &k in ask {
            self.w.u64(k);
        }
        self.count += 1;
    }

    fn session_stamp(&mut self, item: u8, client_id: &str, stamp: Stamp) {
        self.w
            .u8(item)
            .bytes(client_id.as_bytes())
            .u64(stamp.clock)
            .u64(stamp.node);
        self.count += 1;
    }

    /// An already encoded item (see [`encode_message`]), so a message sent to several
    /// peers is encoded once.
    pub fn raw_item(&mut self, item: &[u8]) {
        self.w.buf.extend_from_slice(item);
        self.count += 1;
    }

    /// The whole frame of a batch with these items, ready to write to the link (items
    /// compressed above [`COMPRESS_ABOVE`]); the writer is left empty.
    pub fn finish(&mut self, header: Header) -> Vec<u8> {
        self.finish_with(header, true)
    }

    /// `finish`, compressing only if `compress` (the sender knows whether the link's
    /// bandwidth or the CPU is what is short).
    pub fn finish_with(&mut self, header: Header, compress: bool) -> Vec<u8> {
        let items = std::mem::take(&mut self.w.buf);
        let count = std::mem::take(&mut self.count);
        let mut plain = Writer::default();
        plain.u32(count);
        plain.buf.extend_from_slice(&items);
        let (flags, body) = if compress && plain.buf.len() > COMPRESS_ABOVE {
            match zstd::bulk::compress(&plain.buf, 1) {
                Ok(c) if c.len() < plain.buf.len() => (FLAG_ZSTD, c),
                _ => (0, plain.buf),
            }
        } else {
            (0, plain.buf)
        };
        let mut batch = Writer::default();
        batch
            .u8(BATCH_VERSION)
            .u8(flags)
            .u64(header.epoch)
            .u64(header.seq)
            .u64(header.ack_epoch)
            .u64(header.ack_seq)
            .bytes(&body);
        let mut frame = ValueWriter::default();
        let start = start_frame(&mut frame, DATA_FRAME);
        frame.bytes(&batch.buf);
        finish_frame(&mut frame, start).expect("batches stay far below 4 GiB");
        frame.buf
    }
}

/// One message item, encoded once for every peer it goes to.
pub fn encode_message(m: &WireMessage<'_>, out: &mut Vec<u8>) {
    let mut w = Writer {
        buf: std::mem::take(out),
    };
    let mut flags = m.qos;
    if m.retain {
        flags |= MSG_RETAIN;
    }
    if !m.plain {
        flags |= MSG_NOT_PLAIN;
    }
    if m.stamp.is_some() {
        flags |= MSG_STAMPED;
    }
    if !m.also.is_empty() {
        flags |= MSG_ALSO;
    }
    if m.id != 0 {
        flags |= MSG_ID;
    }
    if !m.taken.is_empty() {
        flags |= MSG_TAKEN;
    }
    w.u8(ITEM_MESSAGE).u8(flags);
    if let Some(s) = m.stamp {
        w.u64(s.clock).u64(s.node);
    }
    w.opt_u64(m.expires_in_ms)
        .bytes(m.topic)
        .bytes(m.payload)
        .bytes(m.props)
        .u32(m.groups.len() as u32);
    for g in &m.groups {
        w.bytes(g.as_bytes());
    }
    if !m.also.is_empty() {
        w.u32(m.also.len() as u32);
        for &k in &m.also {
            w.u64(k);
        }
    }
    if m.id != 0 {
        w.u64((m.id >> 64) as u64).u64(m.id as u64);
    }
    if !m.taken.is_empty() {
        w.u32(m.taken.len() as u32);
        for c in &m.taken {
            w.bytes(c.as_bytes());
        }
    }
    *out = w.buf;
}

/// What a [`Item::SessionMessage`] is besides a message for the session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SessionMessageKind {
    Relayed,
    /// An answer to a `KeptAsk` (protocol 7).
    Kept,
    /// Released to the client under this packet id (protocol 14).
    Released(u16),
}

/// A [`Item::SessionMessage`]: `message` is an item made by [`encode_message`]; `origin`
/// as there (not 0 only to a peer of protocol 15).
#[allow(clippy::too_many_arguments)]
pub fn encode_session_message(
    client_id: &str,
    qos: u8,
    retain: bool,
    sub_ids: &[u32],
    message: &[u8],
    kind: SessionMessageKind,
    origin: u64,
    out: &mut Vec<u8>,
) {
    let mut w = Writer {
        buf: std::mem::take(out),
    };
    if origin != 0 {
        w.u8(ITEM_HANDED_ON).u64(origin);
    }
    w.u8(match kind {
        SessionMessageKind::Relayed => ITEM_SESSION_MESSAGE,
        SessionMessageKind::Kept => ITEM_KEPT_MESSAGE,
        SessionMessageKind::Released(_) => ITEM_RELEASED_MESSAGE,
    })
    .bytes(client_id.as_bytes());
    if let SessionMessageKind::Released(pkid) = kind {
        w.u16(pkid);
    }
    w.u8(qos).u8(u8::from(retain)).u32(sub_ids.len() as u32);
    for &id in sub_ids {
        w.u32(id);
    }
    w.buf.extend_from_slice(message);
    *out = w.buf;
}

/// The value of a whole DATA frame as `ItemWriter::finish` made it (for reading this node's
/// own kept batches back), or None if it is not one.
pub fn frame_value(frame: &[u8]) -> Option<Vec<u8>> {
    let mut d = super::FrameDecoder::new(frame.len().max(1));
    d.extend(frame);
    match d.next_raw() {
        Ok(Some((DATA_FRAME, value))) => match super::Value::decode(value) {
            Ok(super::Value::Bytes(b)) => Some(b),
            _ => None,
        },
        _ => None,
    }
}

/// A decoded batch: its header and the items' bytes (decompressed if need be), read with
/// [`Batch::items`].
pub struct Batch<'a> {
    pub header: Header,
    /// Borrowed from the frame's value, or decompressed.
    items: std::borrow::Cow<'a, [u8]>,
}

impl<'a> Batch<'a> {
    /// Decodes the value of a [`DATA_FRAME`]. Checks the header and decompresses; the items
    /// are checked as they are read.
    pub fn decode(data: &'a [u8]) -> Result<Batch<'a>, BatchError> {
        let mut r = Reader::new(data);
        let version = r.u8()?;
        if version != BATCH_VERSION {
            return Err(BatchError(format!("unknown batch version {version}")));
        }
        let flags = r.u8()?;
        if flags & !FLAG_ZSTD != 0 {
            return Err(BatchError(format!("unknown batch flags 0x{flags:02x}")));
        }
        let header = Header {
            epoch: r.u64()?,
            seq: r.u64()?,
            ack_epoch: r.u64()?,
            ack_seq: r.u64()?,
        };
        let body = r.bytes()?;
        r.finish()?;
        let items = if flags & FLAG_ZSTD != 0 {
            std::borrow::Cow::Owned(decompress(body, MAX_BATCH)?)
        } else {
            std::borrow::Cow::Borrowed(body)
        };
        Ok(Batch { header, items })
    }

    /// Every item, in order; the first malformed one ends the list with an error (the
    /// items before it are still returned, the caller decides).
    pub fn items(&self) -> Result<Vec<Item<'_>>, BatchError> {
        let mut r = Reader::new(&self.items);
        let count = r.u32()?;
        if count > MAX_ITEMS {
            return Err(BatchError(format!("{count} items in one batch")));
        }
        let mut items = Vec::with_capacity((count as usize).min(self.items.len()));
        for _ in 0..count {
            items.push(read_item(&mut r)?);
        }
        r.finish()?;
        Ok(items)
    }
}

fn decompress(body: &[u8], max: usize) -> Result<Vec<u8>, BatchError> {
    let size = zstd::bulk::Decompressor::upper_bound(body)
        .ok_or_else(|| BatchError("compressed batch without its size".into()))?;
    if size > max {
        return Err(BatchError(format!(
            "batch of {size} bytes decompressed is over {max}"
        )));
    }
    zstd::bulk::decompress(body, size).map_err(|e| BatchError(format!("bad compressed batch: {e}")))
}

fn utf8(b: &[u8]) -> Result<&str, BatchError> {
    std::str::from_utf8(b).map_err(|_| BatchError("route filter is not UTF-8".into()))
}

/// A client id as MQTT allows it: UTF-8 of at most 65535 bytes.
fn client_id(b: &[u8]) -> Result<&str, BatchError> {
    if b.len() > usize::from(u16::MAX) {
        return Err(BatchError("client id longer than 65535 bytes".into()));
    }
    std::str::from_utf8(b).map_err(|_| BatchError("client id is not UTF-8".into()))
}

fn read_item<'a>(r: &mut Reader<'a>) -> Result<Item<'a>, BatchError> {
    let kind = r.u8()?;
    Ok(match kind {
        ITEM_ROUTE_SNAPSHOT => {
            let version = r.u64()?;
            let n = r.u32()?;
            let mut filters = Vec::new();
            for _ in 0..n {
                filters.push(utf8(r.bytes()?)?);
            }
            Item::RouteSnapshot { version, filters }
        }
        ITEM_ROUTE_ADD => Item::RouteAdd {
            version: r.u64()?,
            filter: utf8(r.bytes()?)?,
        },
        ITEM_ROUTE_REMOVE => Item::RouteRemove {
            version: r.u64()?,
            filter: utf8(r.bytes()?)?,
        },
        ITEM_RESYNC => Item::Resync,
        ITEM_RETAINED_SENT => Item::RetainedSent,
        ITEM_KICK => Item::Kick {
            client_id: client_id(r.bytes()?)?,
        },
        ITEM_CLAIM => {
            let client_id = client_id(r.bytes()?)?;
            let stamp = Stamp {
                clock: r.u64()?,
                node: r.u64()?,
            };
            let flags = r.u8()?;
            if flags & !CLAIM_DISCARD != 0 {
                return Err(BatchError(format!("bad claim flags 0x{flags:02x}")));
            }
            Item::Claim {
                client_id,
                stamp,
                discard: flags & CLAIM_DISCARD != 0,
            }
        }
        ITEM_CLAIM_ANSWER | ITEM_COPY_ANSWER | ITEM_COPY_ANSWER_MARKED => {
            let client_id = client_id(r.bytes()?)?;
            let stamp = Stamp {
                clock: r.u64()?,
                node: r.u64()?,
            };
            let copy_at = if kind == ITEM_CLAIM_ANSWER {
                None
            } else {
                Some(r.u64()?)
            };
            let mut marks = Vec::new();
            if kind == ITEM_COPY_ANSWER_MARKED {
                let n = r.u32()?;
                for _ in 0..n {
                    marks.push(read_mark(r)?);
                }
            }
            let n = r.u32()?;
            let mut records = Vec::new();
            for _ in 0..n {
                records.push((r.bytes()?, r.bytes()?));
            }
            Item::ClaimAnswer {
                client_id,
                stamp,
                records,
                copy_at,
                marks,
            }
        }
        ITEM_MESSAGE => Item::Message(read_message(r)?),
        ITEM_COPY => {
            let map = r.u64()?;
            let stamp = read_stamp(r)?;
            let key = r.bytes()?;
            let flags = r.u8()?;
            if flags & !(COPY_PUT | COPY_AT) != 0 {
                return Err(BatchError("bad copy flag".into()));
            }
            let at = if flags & COPY_AT != 0 { r.u64()? } else { 0 };
            let value = if flags & COPY_PUT != 0 {
                Some(r.bytes()?)
            } else {
                None
            };
            Item::Copy {
                map,
                stamp,
                key,
                value,
                at,
            }
        }
        ITEM_COPY_CHECK => Item::CopyCheck {
            client_id: client_id(r.bytes()?)?,
            stamp: read_stamp(r)?,
        },
        ITEM_SAFE => Item::Safe {
            epoch: r.u64()?,
            seq: r.u64()?,
        },
        ITEM_INSTALLED => Item::Installed {
            client_id: client_id(r.bytes()?)?,
        },
        ITEM_RELAY_END => Item::RelayEnd {
            client_id: client_id(r.bytes()?)?,
        },
        ITEM_KEPT_END => Item::KeptEnd {
            client_id: client_id(r.bytes()?)?,
            origin: 0,
        },
        ITEM_WILL_COPY => Item::WillCopy {
            client_id: client_id(r.bytes()?)?,
            stamp: read_stamp(r)?,
            will: r.bytes()?,
        },
        ITEM_WILL_GONE => Item::WillGone {
            client_id: client_id(r.bytes()?)?,
            stamp: read_stamp(r)?,
        },
        ITEM_WILL_FIRED => Item::WillFired {
            client_id: client_id(r.bytes()?)?,
            stamp: read_stamp(r)?,
        },
        ITEM_HOMES => {
            let map = r.u64()?;
            let flags = r.u8()?;
            if flags & !(HOMES_FIRST | HOMES_LAST) != 0 {
                return Err(BatchError("bad homes flags".into()));
            }
            let n = r.u32()?;
            let mut clients = Vec::new();
            for _ in 0..n {
                clients.push(client_id(r.bytes()?)?);
            }
            Item::Homes {
                map,
                first: flags & HOMES_FIRST != 0,
                last: flags & HOMES_LAST != 0,
                clients,
            }
        }
        ITEM_HOME => {
            let client_id = client_id(r.bytes()?)?;
            let here = match r.u8()? {
                0 => false,
                1 => true,
                _ => return Err(BatchError("bad home flag".into())),
            };
            Item::Home { client_id, here }
        }
        ITEM_CLAIM_ROUTE => Item::ClaimRoute {
            client_id: client_id(r.bytes()?)?,
            req: r.u64()?,
        },
        ITEM_CLAIM_ROUTED => {
            let client_id = client_id(r.bytes()?)?;
            let req = r.u64()?;
            let stamp = read_stamp(r)?;
            let n = r.u32()?;
            let mut ask = Vec::new();
            for _ in 0..n {
                ask.push(r.u64()?);
            }
            Item::ClaimRouted {
                client_id,
                req,
                stamp,
                ask,
            }
        }
        ITEM_TOOK_ROUTED => {
            let client_id = client_id(r.bytes()?)?;
            let n = r.u32()?;
            let mut ranges = Vec::new();
            for _ in 0..n {
                let range = RoutedRange {
                    origin: r.u64()?,
                    after: r.u64()?,
                    upto: r.u64()?,
                };
                if range.after >= range.upto {
                    return Err(BatchError("empty routed range".into()));
                }
                ranges.push(range);
            }
            Item::TookRouted { client_id, ranges }
        }
        ITEM_TAKEN_IDS => {
            let client_id = client_id(r.bytes()?)?;
            let stamp = read_stamp(r)?;
            let node = r.u64()?;
            let ids = read_ids(r)?;
            Item::TakenIds {
                client_id,
                stamp,
                node,
                ids,
            }
        }
        ITEM_KEPT_STATE => {
            let client_id = client_id(r.bytes()?)?;
            let home = r.u64()?;
            let n = r.u32()?;
            let mut marks = Vec::new();
            for _ in 0..n {
                marks.push(read_mark(r)?);
            }
            let ids = read_ids(r)?;
            Item::KeptState {
                client_id,
                home,
                marks,
                ids,
            }
        }
        ITEM_FENCE => Item::Fence {
            client_id: client_id(r.bytes()?)?,
            stamp: read_stamp(r)?,
            home: utf8(r.bytes()?)?,
        },
        ITEM_KEPT_ASK => {
            let client_id = client_id(r.bytes()?)?;
            let home = r.u64()?;
            let ask = r.u8()?;
            if ask & !(ASK_AGAIN | ASK_APPLIED) != 0 {
                return Err(BatchError("bad kept ask flags".into()));
            }
            let applied = if ask & ASK_APPLIED != 0 {
                Some((r.u64()?, r.u64()?))
            } else {
                None
            };
            let n = r.u32()?;
            let mut subs = Vec::new();
            for _ in 0..n {
                let filter = utf8(r.bytes()?)?;
                let flags = r.u8()?;
                if flags & !(SUB_RAP | 3) != 0 || flags & 3 == 3 {
                    return Err(BatchError("bad subscription flags".into()));
                }
                subs.push(KeptSub {
                    filter,
                    qos: flags & 3,
                    retain_as_published: flags & SUB_RAP != 0,
                    identifier: r.u32()?,
                });
            }
            Item::KeptAsk {
                client_id,
                home,
                again: ask & ASK_AGAIN != 0,
                applied,
                subs,
            }
        }
        ITEM_APPLIED => Item::Applied(read_mark(r)?),
        ITEM_HANDED_ON => {
            let origin = r.u64()?;
            let kind = r.u8()?;
            let known = [
                ITEM_SESSION_MESSAGE,
                ITEM_KEPT_MESSAGE,
                ITEM_RELEASED_MESSAGE,
                ITEM_KEPT_END,
            ];
            if origin == 0 || !known.contains(&kind) {
                return Err(BatchError("bad handed-on item".into()));
            }
            if kind == ITEM_KEPT_END {
                Item::KeptEnd {
                    client_id: client_id(r.bytes()?)?,
                    origin,
                }
            } else {
                read_session_message(r, kind, origin)?
            }
        }
        ITEM_SESSION_MESSAGE | ITEM_KEPT_MESSAGE | ITEM_RELEASED_MESSAGE => {
            read_session_message(r, kind, 0)?
        }
        tag => return Err(BatchError(format!("unknown batch item 0x{tag:02x}"))),
    })
}

/// A session message item of type `kind` (its tag read), handed on from `origin`.
fn read_session_message<'a>(
    r: &mut Reader<'a>,
    kind: u8,
    origin: u64,
) -> Result<Item<'a>, BatchError> {
    let client_id = client_id(r.bytes()?)?;
    let released = if kind == ITEM_RELEASED_MESSAGE {
        Some(r.u16()?).filter(|&p| p != 0)
    } else {
        None
    };
    if kind == ITEM_RELEASED_MESSAGE && released.is_none() {
        return Err(BatchError("released message with packet id 0".into()));
    }
    let qos = r.u8()?;
    let retain = r.u8()?;
    if qos > 2 || retain > 1 {
        return Err(BatchError("bad session message flags".into()));
    }
    let n = r.u32()?;
    let mut sub_ids = Vec::new();
    for _ in 0..n {
        sub_ids.push(r.u32()?);
    }
    // Not read_item: a session message cannot nest another (no recursion).
    if r.u8()? != ITEM_MESSAGE {
        return Err(BatchError("session message without a message".into()));
    }
    let message = read_message(r)?;
    Ok(Item::SessionMessage {
        client_id,
        qos,
        retain: retain == 1,
        sub_ids,
        message,
        kept: kind == ITEM_KEPT_MESSAGE,
        released,
        origin,
    })
}

/// A count, then that many message ids.
fn read_ids(r: &mut Reader<'_>) -> Result<Vec<u128>, BatchError> {
    let n = r.u32()?;
    let mut ids = Vec::new();
    for _ in 0..n {
        let high = r.u64()?;
        ids.push(u128::from(high) << 64 | u128::from(r.u64()?));
    }
    Ok(ids)
}

fn read_mark(r: &mut Reader<'_>) -> Result<Mark, BatchError> {
    Ok(Mark {
        node: r.u64()?,
        epoch: r.u64()?,
        seq: r.u64()?,
    })
}

fn read_stamp(r: &mut Reader<'_>) -> Result<Stamp, BatchError> {
    Ok(Stamp {
        clock: r.u64()?,
        node: r.u64()?,
    })
}

/// The fields of a message item, its tag read.
fn read_message<'a>(r: &mut Reader<'a>) -> Result<WireMessage<'a>, BatchError> {
    let flags = r.u8()?;
    let stamped = flags & MSG_STAMPED != 0;
    if flags & 0b11 == 3 || stamped != (flags & MSG_RETAIN != 0) {
        return Err(BatchError(format!("bad message flags 0x{flags:02x}")));
    }
    let stamp = if stamped {
        Some(Stamp {
            clock: r.u64()?,
            node: r.u64()?,
        })
    } else {
        None
    };
    let expires_in_ms = r.opt_u64()?;
    let topic = r.bytes()?;
    let payload = r.bytes()?;
    let props = r.bytes()?;
    let n = r.u32()?;
    let mut groups = Vec::new();
    for _ in 0..n {
        groups.push(utf8(r.bytes()?)?);
    }
    let mut also = Vec::new();
    if flags & MSG_ALSO != 0 {
        let n = r.u32()?;
        for _ in 0..n {
            also.push(r.u64()?);
        }
    }
    let id = if flags & MSG_ID != 0 {
        let id = (u128::from(r.u64()?) << 64) | u128::from(r.u64()?);
        if id == 0 {
            return Err(BatchError("message id 0".into()));
        }
        id
    } else {
        0
    };
    let mut taken = Vec::new();
    if flags & MSG_TAKEN != 0 {
        let n = r.u32()? as usize;
        if n == 0 || n > TAKEN_MAX {
            return Err(BatchError(format!("{n} client ids taken")));
        }
        for _ in 0..n {
            taken.push(client_id(r.bytes()?)?);
        }
    }
    Ok(WireMessage {
        qos: flags & 0b11,
        retain: flags & MSG_RETAIN != 0,
        plain: flags & MSG_NOT_PLAIN == 0,
        stamp,
        expires_in_ms,
        topic,
        payload,
        props,
        groups,
        also,
        id,
        taken,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::FrameDecoder;
    use crate::cluster::Value;
    use proptest::prelude::*;

    fn body_of(frame: &[u8]) -> Vec<u8> {
        let mut d = FrameDecoder::new(usize::MAX >> 1);
        d.extend(frame);
        let (kind, value) = d.next_raw().unwrap().unwrap();
        assert_eq!(kind, DATA_FRAME);
        match Value::decode(value).unwrap() {
            Value::Bytes(b) => b,
            other => panic!("not bytes: {other:?}"),
        }
    }

    fn message(topic: &'static [u8], payload: &'static [u8]) -> WireMessage<'static> {
        WireMessage {
            topic,
            payload,
            qos: 1,
            retain: true,
            expires_in_ms: Some(1500),
            props: b"\x03\x00\x01x",
            plain: false,
            groups: vec!["$share/g/a/#", "$share/h/b"],
            stamp: Some(Stamp {
                clock: 9 << 16,
                node: 3,
            }),
            also: vec![11, 12],
            id: (3u128 << 64) | 77,
            taken: vec!["dev", "lamp"],
        }
    }

    #[test]
    fn round_trip_of_every_item() {
        let mut w = ItemWriter::default();
        w.route_snapshot(7, ["a/#", "b/+/c"].into_iter());
        w.route_add(8, "x");
        w.route_remove(9, "a/#");
        w.resync();
        let mut m = Vec::new();
        encode_message(&message(b"t/1", b"hello"), &mut m);
        w.raw_item(&m);
        w.retained_sent();
        w.kick("dev-1");
        let stamp = Stamp { clock: 5, node: 6 };
        w.claim("dev-2", stamp, true);
        w.claim_answer(
            "dev-2",
            stamp,
            &[(b"k".to_vec(), b"v".to_vec())],
            None,
            None,
        );
        w.claim_answer(
            "dev-2",
            stamp,
            &[(b"k".to_vec(), b"v".to_vec())],
            Some(12),
            None,
        );
        let mark = Mark {
            node: 4,
            epoch: 5,
            seq: 6,
        };
        w.claim_answer("dev-2", stamp, &[], Some(13), Some(&[mark, mark]));
        w.applied(mark);
        w.copy(3, stamp, b"k", Some(b"v"), None);
        w.copy(3, stamp, b"k", None, None);
        w.copy(3, stamp, b"k", Some(b"v"), Some(77));
        w.copy(3, stamp, b"k", None, Some(78));
        w.copy_check("dev-3", stamp);
        w.fence("dev-3", stamp, "n2");
        w.installed("dev-4");
        w.relay_end("dev-4");
        w.kept_end("dev-5", 0);
        w.kept_end("dev-6", 77);
        w.will_copy("dev-6", stamp, b"will");
        w.will_gone("dev-6", stamp);
        w.will_fired("dev-6", stamp);
        w.homes(4, true, false, ["dev-7", "dev-8"].into_iter());
        w.homes(4, false, true, [].into_iter());
        w.home("dev-7", true);
        w.home("dev-8", false);
        w.claim_route("dev-9", 17);
        w.claim_routed("dev-9", 17, stamp, &[5, 6]);
        w.kept_state("dev-4", 99, &[mark], [7u128 << 64 | 3, 1].into_iter());
        w.taken_ids("dev-4", stamp, 98, [9u128 << 64 | 4].into_iter());
        let range = RoutedRange {
            origin: 9,
            after: 3,
            upto: 40,
        };
        w.took_routed("dev-4", &[range]);
        w.safe(8, 9);
        let subs = [
            KeptSub {
                filter: "cmd/#",
                qos: 2,
                retain_as_published: true,
                identifier: 7,
            },
            KeptSub {
                filter: "a/+",
                qos: 0,
                retain_as_published: false,
                identifier: 0,
            },
        ];
        w.kept_ask("dev-5", 99, true, None, &subs);
        w.kept_ask("dev-5", 99, false, Some((7, 8)), &subs);
        let kinds = [
            SessionMessageKind::Relayed,
            SessionMessageKind::Kept,
            SessionMessageKind::Released(513),
        ];
        for (kind, origin) in kinds.iter().map(|&k| (k, 0)).chain([(kinds[2], 77)]) {
            let mut item = Vec::new();
            encode_session_message("dev-5", 1, true, &[3, 4], &m, kind, origin, &mut item);
            w.raw_item(&item);
        }
        let header = Header {
            epoch: 1,
            seq: 2,
            ack_epoch: 3,
            ack_seq: 4,
        };
        let frame = w.finish(header);
        let body = body_of(&frame);
        assert_eq!(frame_value(&frame), Some(body.clone()));
        assert_eq!(frame_value(&frame[..frame.len() - 1]), None);
        let batch = Batch::decode(&body).unwrap();
        assert_eq!(batch.header, header);
        assert_eq!(
            batch.items().unwrap(),
            vec![
                Item::RouteSnapshot {
                    version: 7,
                    filters: vec!["a/#", "b/+/c"]
                },
                Item::RouteAdd {
                    version: 8,
                    filter: "x"
                },
                Item::RouteRemove {
                    version: 9,
                    filter: "a/#"
                },
                Item::Resync,
                Item::Message(message(b"t/1", b"hello")),
                Item::RetainedSent,
                Item::Kick { client_id: "dev-1" },
                Item::Claim {
                    client_id: "dev-2",
                    stamp,
                    discard: true
                },
                Item::ClaimAnswer {
                    client_id: "dev-2",
                    stamp,
                    records: vec![(&b"k"[..], &b"v"[..])],
                    copy_at: None,
                    marks: vec![]
                },
                Item::ClaimAnswer {
                    client_id: "dev-2",
                    stamp,
                    records: vec![(&b"k"[..], &b"v"[..])],
                    copy_at: Some(12),
                    marks: vec![]
                },
                Item::ClaimAnswer {
                    client_id: "dev-2",
                    stamp,
                    records: vec![],
                    copy_at: Some(13),
                    marks: vec![mark, mark]
                },
                Item::Applied(mark),
                Item::Copy {
                    map: 3,
                    stamp,
                    key: b"k",
                    value: Some(b"v"),
                    at: 0
                },
                Item::Copy {
                    map: 3,
                    stamp,
                    key: b"k",
                    value: None,
                    at: 0
                },
                Item::Copy {
                    map: 3,
                    stamp,
                    key: b"k",
                    value: Some(b"v"),
                    at: 77
                },
                Item::Copy {
                    map: 3,
                    stamp,
                    key: b"k",
                    value: None,
                    at: 78
                },
                Item::CopyCheck {
                    client_id: "dev-3",
                    stamp
                },
                Item::Fence {
                    client_id: "dev-3",
                    stamp,
                    home: "n2"
                },
                Item::Installed { client_id: "dev-4" },
                Item::RelayEnd { client_id: "dev-4" },
                Item::KeptEnd {
                    client_id: "dev-5",
                    origin: 0
                },
                Item::KeptEnd {
                    client_id: "dev-6",
                    origin: 77
                },
                Item::WillCopy {
                    client_id: "dev-6",
                    stamp,
                    will: b"will"
                },
                Item::WillGone {
                    client_id: "dev-6",
                    stamp
                },
                Item::WillFired {
                    client_id: "dev-6",
                    stamp
                },
                Item::Homes {
                    map: 4,
                    first: true,
                    last: false,
                    clients: vec!["dev-7", "dev-8"]
                },
                Item::Homes {
                    map: 4,
                    first: false,
                    last: true,
                    clients: vec![]
                },
                Item::Home {
                    client_id: "dev-7",
                    here: true
                },
                Item::Home {
                    client_id: "dev-8",
                    here: false
                },
                Item::ClaimRoute {
                    client_id: "dev-9",
                    req: 17
                },
                Item::ClaimRouted {
                    client_id: "dev-9",
                    req: 17,
                    stamp,
                    ask: vec![5, 6]
                },
                Item::KeptState {
                    client_id: "dev-4",
                    home: 99,
                    marks: vec![mark],
                    ids: vec![7u128 << 64 | 3, 1]
                },
                Item::TakenIds {
                    client_id: "dev-4",
                    stamp,
                    node: 98,
                    ids: vec![9u128 << 64 | 4]
                },
                Item::TookRouted {
                    client_id: "dev-4",
                    ranges: vec![range]
                },
                Item::Safe { epoch: 8, seq: 9 },
                Item::KeptAsk {
                    client_id: "dev-5",
                    home: 99,
                    again: true,
                    applied: None,
                    subs: subs.to_vec()
                },
                Item::KeptAsk {
                    client_id: "dev-5",
                    home: 99,
                    again: false,
                    applied: Some((7, 8)),
                    subs: subs.to_vec()
                },
            ]
            .into_iter()
            .chain(
                [
                    (false, None, 0),
                    (true, None, 0),
                    (false, Some(513), 0),
                    (false, Some(513), 77)
                ]
                .map(|(kept, released, origin)| Item::SessionMessage {
                    client_id: "dev-5",
                    qos: 1,
                    retain: true,
                    sub_ids: vec![3, 4],
                    message: message(b"t/1", b"hello"),
                    kept,
                    released,
                    origin,
                })
            )
            .collect::<Vec<_>>()
        );
        assert!(w.is_empty());
    }

    #[test]
    fn large_batches_are_compressed() {
        let mut w = ItemWriter::default();
        let mut m = Vec::new();
        for _ in 0..1000 {
            m.clear();
            encode_message(&message(b"sensors/1/temperature", &[b'7'; 100]), &mut m);
            w.raw_item(&m);
        }
        let plain = w.len();
        let frame = w.finish(Header::default());
        assert!(frame.len() < plain / 4, "{} of {plain}", frame.len());
        let body = body_of(&frame);
        let batch = Batch::decode(&body).unwrap();
        assert_eq!(batch.items().unwrap().len(), 1000);
        // Unless the sender says the link keeps up.
        for _ in 0..1000 {
            w.raw_item(&m);
        }
        let frame = w.finish_with(Header::default(), false);
        assert!(frame.len() > plain, "{} of {plain}", frame.len());
        let body = body_of(&frame);
        assert_eq!(Batch::decode(&body).unwrap().items().unwrap().len(), 1000);
    }

    #[test]
    fn a_decompression_bomb_is_refused() {
        let c = zstd::bulk::compress(&[0u8; 4096], 1).unwrap();
        let e = decompress(&c, 1024).err().unwrap();
        assert!(e.0.contains("over"), "{e}");
        assert_eq!(decompress(&c, 4096).unwrap(), vec![0u8; 4096]);
        // Without a size in the frame header.
        assert!(decompress(b"\x28\xb5\x2f\xfd\x00\x00", 1024).is_err());
    }

    /// A batch with a zero header, these flags and these item bytes, made by hand.
    fn raw_batch(flags: u8, items: &[u8]) -> Writer {
        let mut w = Writer::default();
        w.u8(BATCH_VERSION)
            .u8(flags)
            .u64(0)
            .u64(0)
            .u64(0)
            .u64(0)
            .bytes(items);
        w
    }

    #[test]
    fn bad_headers_and_items_are_errors() {
        assert!(Batch::decode(b"").is_err());
        assert!(Batch::decode(&[9]).is_err());
        let w = raw_batch(0x80, b"");
        assert!(Batch::decode(&w.buf).is_err());
        // A message with QoS 3.
        let mut items = Writer::default();
        items
            .u32(1)
            .u8(ITEM_MESSAGE)
            .u8(3)
            .u8(0)
            .bytes(b"t")
            .bytes(b"")
            .bytes(b"")
            .u32(0);
        let w = raw_batch(0, &items.buf);
        assert!(Batch::decode(&w.buf).unwrap().items().is_err());
        // A retained message without its stamp.
        let mut items = Writer::default();
        items
            .u32(1)
            .u8(ITEM_MESSAGE)
            .u8(MSG_RETAIN)
            .u8(0)
            .bytes(b"t")
            .bytes(b"")
            .bytes(b"")
            .u32(0);
        let w = raw_batch(0, &items.buf);
        assert!(Batch::decode(&w.buf).unwrap().items().is_err());
        // A kept ask with a subscription of QoS 3, and one with unknown flags.
        for (again, flags) in [(0u8, 3u8), (4, 1), (0, 0x81)] {
            let mut items = Writer::default();
            items
                .u32(1)
                .u8(ITEM_KEPT_ASK)
                .bytes(b"c")
                .u64(1)
                .u8(again)
                .u32(1)
                .bytes(b"a/#")
                .u8(flags)
                .u32(0);
            let w = raw_batch(0, &items.buf);
            assert!(Batch::decode(&w.buf).unwrap().items().is_err());
        }
        // A count larger than the items present.
        let mut items = Writer::default();
        items.u32(1_000_000);
        let w = raw_batch(0, &items.buf);
        assert!(Batch::decode(&w.buf).unwrap().items().is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            if let Ok(batch) = Batch::decode(&data) {
                let _ = batch.items();
            }
        }

        #[test]
        fn messages_round_trip(
            topic in proptest::collection::vec(any::<u8>(), 0..64),
            payload in proptest::collection::vec(any::<u8>(), 0..4096),
            qos in 0u8..3,
            retain: bool,
            expiry in proptest::option::of(any::<u64>()),
            seq: u64,
            plain: bool,
            shared: bool,
            clock: u64,
        ) {
            let m = WireMessage {
                topic: &topic,
                payload: &payload,
                qos,
                retain,
                expires_in_ms: expiry,
                props: b"",
                plain,
                groups: if shared { vec!["$share/g/#"] } else { vec![] },
                stamp: retain.then_some(Stamp { clock, node: 7 }),
                also: if shared { vec![] } else { vec![clock, 3] },
                id: if plain { u128::from(seq) << 64 | u128::from(clock) | 1 } else { 0 },
                taken: if shared { vec!["dev", "ü"] } else { vec![] },
            };
            let mut item = Vec::new();
            encode_message(&m, &mut item);
            let mut w = ItemWriter::default();
            w.raw_item(&item);
            let header = Header { epoch: 5, seq, ack_epoch: 0, ack_seq: 0 };
            let body = body_of(&w.finish(header));
        let batch = Batch::decode(&body).unwrap();
            prop_assert_eq!(batch.header, header);
            prop_assert_eq!(batch.items().unwrap(), vec![Item::Message(m)]);
        }

        #[test]
        fn session_messages_round_trip(
            client in "[a-z0-9/ü-]{0,24}",
            qos in 0u8..3,
            retain: bool,
            sub_ids in proptest::collection::vec(any::<u32>(), 0..4),
            kind in 0u8..3,
            pkid in 1u16..,
            origin in proptest::option::of(1u64..),
        ) {
            let kind = match kind {
                0 => SessionMessageKind::Relayed,
                1 => SessionMessageKind::Kept,
                _ => SessionMessageKind::Released(pkid),
            };
            let m = message(b"t/1", b"hello");
            let origin = origin.unwrap_or(0);
            let body = session_message_body(&client, qos, retain, &sub_ids, &m, kind, origin);
            let batch = Batch::decode(&body).unwrap();
            let released = match kind {
                SessionMessageKind::Released(p) => Some(p),
                _ => None,
            };
            prop_assert_eq!(batch.items().unwrap(), vec![Item::SessionMessage {
                client_id: &client,
                qos,
                retain,
                sub_ids: sub_ids.clone(),
                message: m,
                kept: kind == SessionMessageKind::Kept,
                released,
                origin,
            }]);
        }
    }

    /// The body of a batch holding one `SessionMessage` of `m`.
    fn session_message_body(
        client: &str,
        qos: u8,
        retain: bool,
        sub_ids: &[u32],
        m: &WireMessage<'_>,
        kind: SessionMessageKind,
        origin: u64,
    ) -> Vec<u8> {
        let mut encoded = Vec::new();
        encode_message(m, &mut encoded);
        let mut item = Vec::new();
        encode_session_message(
            client, qos, retain, sub_ids, &encoded, kind, origin, &mut item,
        );
        item_body(&item)
    }

    /// The body of a batch holding the one item `item`.
    fn item_body(item: &[u8]) -> Vec<u8> {
        let mut w = ItemWriter::default();
        w.raw_item(item);
        let header = Header {
            epoch: 5,
            seq: 1,
            ack_epoch: 0,
            ack_seq: 0,
        };
        body_of(&w.finish(header))
    }

    #[test]
    fn took_routed_ranges_that_are_empty_are_refused() {
        for (after, upto, ok) in [(3, 4, true), (4, 4, false), (5, 4, false)] {
            let mut w = ItemWriter::default();
            let range = RoutedRange {
                origin: 1,
                after,
                upto,
            };
            w.took_routed("dev", &[range]);
            let body = body_of(&w.finish(Header::default()));
            let batch = Batch::decode(&body).unwrap();
            assert_eq!(batch.items().is_ok(), ok, "({after}, {upto}]");
        }
    }

    #[test]
    fn a_released_message_under_packet_id_0_is_refused() {
        let m = message(b"t/1", b"x");
        let body =
            session_message_body("dev", 2, false, &[], &m, SessionMessageKind::Released(0), 0);
        assert!(Batch::decode(&body).unwrap().items().is_err());
    }

    #[test]
    fn a_handed_on_message_from_node_0_or_around_another_item_is_refused() {
        let mut encoded = Vec::new();
        encode_message(&message(b"t/1", b"x"), &mut encoded);
        for (origin, inner) in [(0u64, ITEM_SESSION_MESSAGE), (5, ITEM_MESSAGE)] {
            let mut item = vec![ITEM_HANDED_ON];
            item.extend_from_slice(&origin.to_le_bytes());
            if inner == ITEM_MESSAGE {
                item.extend_from_slice(&encoded);
            } else {
                let kind = SessionMessageKind::Relayed;
                encode_session_message("dev", 1, false, &[], &encoded, kind, 0, &mut item);
            }
            let body = item_body(&item);
            assert!(Batch::decode(&body).unwrap().items().is_err(), "{origin}");
        }
    }
}
