//! Keys and bodies of the stored records.
//!
//! Every key starts with its kind, then the client id (length-prefixed, so one client's keys
//! are one contiguous range that no other client id can fall into) or the topic: the unit a
//! cluster replicates. Numbers in keys are big-endian, so RocksDB's byte order is their order.
//!
//! | kind | key | value |
//! |---|---|---|
//! | `s` | client | session: expiry, subscriptions, will, disconnect time |
//! | `m` | client, seq u64 | a message for the session (queued or in flight) |
//! | `f` | client, seq u64 | in-flight state of message `seq`: packet id, ack awaited |
//! | `q` | client, packet id u16 | inbound QoS 2 packet id awaiting PUBREL |
//! | `r` | topic | retained message |
//! | `o` | peer node, start u64, epoch u64, seq u64 | a data batch for a peer node whose link is down, kept until it acknowledges it (the frame as sent) |
//! | `c` | client, then a key above of that client (`s`, `m`, `f`, `q`) | a copy of another node's session record, as sealed there (with its own key) |
//! | `c` | client, nothing after | the copy's home node and version (`CopyMeta`) |
//! | `a` | home node key u64, node key u64 | how far that home of copies held here applied that node's batches: its incarnation u64 and batch u64 (`Mark`) |
//! | `w` | client | the will of a connection on another node whose session ends with it: home key, incarnation, version, will (`WillCopyRecord`) |
//! | `p` | client | a will published here for a node out of reach, to tell it when its link is back: home key, version |
//! | `n` | peer node, filter | a route row of that peer (its sessions hold the filter), so that a restart routes by it before the peer's link is back (empty) |

use bytes::Bytes;

use super::wire::{BodyError, Reader, Writer};
use crate::cluster::batch::Stamp;
use crate::codec::{self, LastWill, Properties, QoS};
use crate::topics::SubOpts;

pub const SESSION: u8 = b's';
pub const MESSAGE: u8 = b'm';
pub const FLIGHT: u8 = b'f';
pub const INBOUND: u8 = b'q';
pub const RETAINED: u8 = b'r';
pub const OUTBOX: u8 = b'o';
pub const COPY: u8 = b'c';
pub const MARK: u8 = b'a';
pub const WILL_COPY: u8 = b'w';
pub const WILL_FIRED: u8 = b'p';
pub const ROUTE_ROW: u8 = b'n';

fn client_prefix(kind: u8, client_id: &str, extra: usize) -> Vec<u8> {
    let id = client_id.as_bytes();
    let mut k = Vec::with_capacity(3 + id.len() + extra);
    k.push(kind);
    // Client ids are MQTT strings: at most 65,535 bytes.
    k.extend_from_slice(&(id.len() as u16).to_be_bytes());
    k.extend_from_slice(id);
    k
}

pub fn session_key(client_id: &str) -> Vec<u8> {
    client_prefix(SESSION, client_id, 0)
}

pub fn message_key(client_id: &str, seq: u64) -> Vec<u8> {
    let mut k = client_prefix(MESSAGE, client_id, 8);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

pub fn flight_key(client_id: &str, seq: u64) -> Vec<u8> {
    let mut k = client_prefix(FLIGHT, client_id, 8);
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

pub fn inbound_key(client_id: &str, pkid: u16) -> Vec<u8> {
    let mut k = client_prefix(INBOUND, client_id, 2);
    k.extend_from_slice(&pkid.to_be_bytes());
    k
}

pub fn retained_key(topic: &[u8]) -> Vec<u8> {
    let mut k = Vec::with_capacity(1 + topic.len());
    k.push(RETAINED);
    k.extend_from_slice(topic);
    k
}

/// A batch for peer node `peer` made by the incarnation `epoch` of this node, which
/// started at wall time `start` (so the batches of several runs sort in the order made).
pub fn outbox_key(peer: &str, start: u64, epoch: u64, seq: u64) -> Vec<u8> {
    let mut k = client_prefix(OUTBOX, peer, 24);
    k.extend_from_slice(&start.to_be_bytes());
    k.extend_from_slice(&epoch.to_be_bytes());
    k.extend_from_slice(&seq.to_be_bytes());
    k
}

/// A copy of record `inner` (a session-kind key of `client_id`) held for another node; with
/// `inner` empty, the copy's meta record.
pub fn copy_key(client_id: &str, inner: &[u8]) -> Vec<u8> {
    let mut k = client_prefix(COPY, client_id, inner.len());
    k.extend_from_slice(inner);
    k
}

/// The will of a connection on another node whose session ends with it, held by an owner
/// of its partition (`cluster_wills`).
pub fn will_copy_key(client_id: &str) -> Vec<u8> {
    client_prefix(WILL_COPY, client_id, 0)
}

/// A will this node published for a connection on a node out of its reach, which that node
/// is to be told of when their link comes up (`cluster_wills`).
pub fn will_fired_key(client_id: &str) -> Vec<u8> {
    client_prefix(WILL_FIRED, client_id, 0)
}

/// A route row of peer node `peer`: its sessions hold `filter`.
pub fn route_row_key(peer: &str, filter: &str) -> Vec<u8> {
    let mut k = client_prefix(ROUTE_ROW, peer, filter.len());
    k.extend_from_slice(filter.as_bytes());
    k
}

/// A published will to tell its home of: that node's key and the connection's version.
pub fn encode_will_fired(home: u64, stamp: Stamp) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(home).u64(stamp.clock).u64(stamp.node);
    w.buf
}

pub fn decode_will_fired(body: &[u8]) -> Result<(u64, Stamp), BodyError> {
    let mut r = Reader::new(body);
    let home = r.u64()?;
    let stamp = Stamp {
        clock: r.u64()?,
        node: r.u64()?,
    };
    r.finish()?;
    Ok((home, stamp))
}

/// A held will copy: the key of the node holding the connection, that node's incarnation,
/// the connection's version, and the will as `encode_will` wrote it.
pub struct WillCopyRecord {
    pub home: u64,
    pub epoch: u64,
    pub stamp: Stamp,
    pub will: LastWill,
}

pub fn encode_will_copy(home: u64, epoch: u64, stamp: Stamp, will: &[u8]) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(home)
        .u64(epoch)
        .u64(stamp.clock)
        .u64(stamp.node)
        .bytes(will);
    w.buf
}

pub fn decode_will_copy(body: &[u8]) -> Result<WillCopyRecord, BodyError> {
    let mut r = Reader::new(body);
    let home = r.u64()?;
    let epoch = r.u64()?;
    let stamp = Stamp {
        clock: r.u64()?,
        node: r.u64()?,
    };
    let will = decode_will(r.bytes()?)?;
    r.finish()?;
    Ok(WillCopyRecord {
        home,
        epoch,
        stamp,
        will,
    })
}

/// How far the home with node key `home` applied the batches of the node with key `node`
/// (an `Applied` mark kept by an owner of copies of that home's sessions).
pub fn mark_key(home: u64, node: u64) -> Vec<u8> {
    let mut k = Vec::with_capacity(17);
    k.push(MARK);
    k.extend_from_slice(&home.to_be_bytes());
    k.extend_from_slice(&node.to_be_bytes());
    k
}

pub fn encode_mark(epoch: u64, seq: u64) -> Vec<u8> {
    let mut w = Writer::default();
    w.u64(epoch).u64(seq);
    w.buf
}

pub fn decode_mark(body: &[u8]) -> Result<(u64, u64), BodyError> {
    let mut r = Reader::new(body);
    let epoch = r.u64()?;
    let seq = r.u64()?;
    r.finish()?;
    Ok((epoch, seq))
}

/// The client id of a session-kind key (`s`, `m`, `f`, `q`), without allocating: the unit
/// that is copied to replicas.
pub fn session_client(key: &[u8]) -> Option<&str> {
    let (&kind, rest) = key.split_first()?;
    if !matches!(kind, SESSION | MESSAGE | FLIGHT | INBOUND) || rest.len() < 2 {
        return None;
    }
    let n = u16::from_be_bytes([rest[0], rest[1]]) as usize;
    std::str::from_utf8(rest.get(2..2 + n)?).ok()
}

/// A parsed key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Key {
    Session(String),
    Message(String, u64),
    Flight(String, u64),
    Inbound(String, u16),
    Retained(Bytes),
    Outbox {
        peer: String,
        start: u64,
        epoch: u64,
        seq: u64,
    },
    /// A copy of `inner` (a session record of `client`) or, with `inner` empty, its meta.
    Copy(String, Vec<u8>),
    /// An `Applied` mark of the home with key `home` for the node with key `node`.
    Mark {
        home: u64,
        node: u64,
    },
    /// A will copy held for a connection of `client` on another node.
    WillCopy(String),
    /// A will published here for a connection of `client` on a node out of reach.
    WillFired(String),
    /// A route row of a peer node.
    RouteRow {
        peer: String,
        filter: String,
    },
}

pub fn parse_key(key: &[u8]) -> Option<Key> {
    let (&kind, rest) = key.split_first()?;
    if kind == RETAINED {
        return Some(Key::Retained(Bytes::copy_from_slice(rest)));
    }
    if kind == MARK {
        return (rest.len() == 16).then(|| Key::Mark {
            home: u64::from_be_bytes(rest[..8].try_into().expect("16 bytes")),
            node: u64::from_be_bytes(rest[8..].try_into().expect("16 bytes")),
        });
    }
    if rest.len() < 2 {
        return None;
    }
    let n = u16::from_be_bytes([rest[0], rest[1]]) as usize;
    let id = std::str::from_utf8(rest.get(2..2 + n)?).ok()?.to_owned();
    let tail = &rest[2 + n..];
    match (kind, tail.len()) {
        (SESSION, 0) => Some(Key::Session(id)),
        (WILL_COPY, 0) => Some(Key::WillCopy(id)),
        (WILL_FIRED, 0) => Some(Key::WillFired(id)),
        (MESSAGE, 8) => Some(Key::Message(id, u64::from_be_bytes(tail.try_into().ok()?))),
        (FLIGHT, 8) => Some(Key::Flight(id, u64::from_be_bytes(tail.try_into().ok()?))),
        (INBOUND, 2) => Some(Key::Inbound(id, u16::from_be_bytes([tail[0], tail[1]]))),
        (COPY, _) => {
            if !tail.is_empty() && session_client(tail) != Some(id.as_str()) {
                return None;
            }
            Some(Key::Copy(id, tail.to_vec()))
        }
        (ROUTE_ROW, 1..) => Some(Key::RouteRow {
            peer: id,
            filter: std::str::from_utf8(tail).ok()?.to_owned(),
        }),
        (OUTBOX, 24) => Some(Key::Outbox {
            peer: id,
            start: u64::from_be_bytes(tail[..8].try_into().ok()?),
            epoch: u64::from_be_bytes(tail[8..16].try_into().ok()?),
            seq: u64::from_be_bytes(tail[16..].try_into().ok()?),
        }),
        _ => None,
    }
}

fn qos(v: u8) -> Result<QoS, BodyError> {
    QoS::from_u8(v).ok_or(BodyError("bad QoS"))
}

fn write_props(w: &mut Writer, p: Option<&Properties>) {
    let mut block = Vec::new();
    if let Some(p) = p {
        // Properties that decoded from the wire encode again.
        codec::encode_properties(p, &mut block).expect("decoded properties re-encode");
    }
    w.bytes(&block);
}

fn read_props(r: &mut Reader<'_>, will: bool) -> Result<Option<Box<Properties>>, BodyError> {
    let block = r.bytes()?;
    if block.is_empty() {
        return Ok(None);
    }
    let p = codec::decode_properties(block, will).map_err(|_| BodyError("bad properties"))?;
    Ok(p.into_boxed())
}

/// A message stored for one session: the message as routed plus what this session's
/// subscriptions made of it. Times are wall-clock ms (monotonic time does not survive a
/// restart).
#[derive(Debug, Clone, PartialEq)]
pub struct StoredMessage {
    pub topic: Bytes,
    pub payload: Bytes,
    /// QoS of the message as published, and of this delivery.
    pub msg_qos: QoS,
    pub qos: QoS,
    /// Retain flag as published, and as delivered.
    pub msg_retain: bool,
    pub retain: bool,
    pub props: Option<Box<Properties>>,
    pub expires_at_wall: Option<u64>,
    pub sub_ids: Vec<u32>,
    /// The message's id in a cluster (0: none), appended (absent in older records).
    pub id: u128,
}

impl StoredMessage {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(&self.topic)
            .bytes(&self.payload)
            .u8(self.msg_qos as u8)
            .u8(self.qos as u8)
            .u8(u8::from(self.msg_retain) | (u8::from(self.retain) << 1))
            .opt_u64(self.expires_at_wall);
        write_props(&mut w, self.props.as_deref());
        w.u32(self.sub_ids.len() as u32);
        for &id in &self.sub_ids {
            w.u32(id);
        }
        if self.id != 0 {
            w.u64((self.id >> 64) as u64).u64(self.id as u64);
        }
        w.buf
    }

    pub fn decode(body: &[u8]) -> Result<StoredMessage, BodyError> {
        let mut r = Reader::new(body);
        let topic = Bytes::copy_from_slice(r.bytes()?);
        let payload = Bytes::copy_from_slice(r.bytes()?);
        let msg_qos = qos(r.u8()?)?;
        let qos = qos(r.u8()?)?;
        let flags = r.u8()?;
        if flags > 3 {
            return Err(BodyError("bad flags"));
        }
        let expires_at_wall = r.opt_u64()?;
        let props = read_props(&mut r, false)?;
        let n = r.u32()? as usize;
        if n > 1 << 16 {
            return Err(BodyError("too many subscription identifiers"));
        }
        let mut sub_ids = Vec::with_capacity(n);
        for _ in 0..n {
            sub_ids.push(r.u32()?);
        }
        let id = if r.is_empty() {
            0
        } else {
            (u128::from(r.u64()?) << 64) | u128::from(r.u64()?)
        };
        r.finish()?;
        Ok(StoredMessage {
            topic,
            payload,
            msg_qos,
            qos,
            msg_retain: flags & 1 != 0,
            retain: flags & 2 != 0,
            props,
            expires_at_wall,
            sub_ids,
            id,
        })
    }
}

/// In-flight state of a stored message: its packet id and the acknowledgement awaited
/// (1 PUBACK, 2 PUBREC, 3 PUBCOMP).
pub fn encode_flight(pkid: u16, awaiting: u8) -> Vec<u8> {
    let mut w = Writer::default();
    w.u16(pkid).u8(awaiting);
    w.buf
}

pub fn decode_flight(body: &[u8]) -> Result<(u16, u8), BodyError> {
    let mut r = Reader::new(body);
    let pkid = r.u16()?;
    let awaiting = r.u8()?;
    r.finish()?;
    if pkid == 0 || !(1..=3).contains(&awaiting) {
        return Err(BodyError("bad in-flight state"));
    }
    Ok((pkid, awaiting))
}

/// A session as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredSession {
    pub expiry: u32,
    /// Wall-clock ms of the disconnect; None while connected (after a crash: the connection
    /// died with the broker, at some time after the last write).
    pub disconnected_at_wall: Option<u64>,
    pub subs: Vec<(String, SubOpts)>,
    /// The will of the live connection, published if the broker dies under it.
    pub will: Option<LastWill>,
    /// A will waiting for its delay after an abnormal disconnect: fires at this wall time.
    pub will_at_wall: Option<u64>,
    /// In a cluster, the session's version: the stamp of the claim that made it live here
    /// (appended; absent on a single node and in earlier records). A copy or an owner with
    /// an older one gives way to it.
    pub stamp: Option<Stamp>,
}

/// A cluster version appended to a record (absent in older records and on a single node).
fn write_stamp(w: &mut Writer, stamp: Option<Stamp>) {
    if let Some(s) = stamp {
        w.u64(s.clock).u64(s.node);
    }
}

fn read_stamp(r: &mut Reader<'_>) -> Result<Option<Stamp>, BodyError> {
    if r.is_empty() {
        return Ok(None);
    }
    Ok(Some(Stamp {
        clock: r.u64()?,
        node: r.u64()?,
    }))
}

/// A will alone, as the session record holds it: what a connection's node copies to the
/// owners of its client id's partition (broker::cluster_wills).
pub fn encode_will(will: &LastWill) -> Vec<u8> {
    let mut w = Writer::default();
    write_will(&mut w, will);
    w.buf
}

pub fn decode_will(body: &[u8]) -> Result<LastWill, BodyError> {
    let mut r = Reader::new(body);
    let will = read_will(&mut r)?;
    r.finish()?;
    Ok(will)
}

fn write_will(w: &mut Writer, will: &LastWill) {
    w.bytes(will.topic.as_bytes())
        .bytes(&will.payload)
        .u8(will.qos as u8)
        .u8(u8::from(will.retain));
    write_props(w, Some(&will.properties));
}

fn read_will(r: &mut Reader<'_>) -> Result<LastWill, BodyError> {
    let topic = r.string()?;
    let payload = Bytes::copy_from_slice(r.bytes()?);
    let qos = qos(r.u8()?)?;
    let retain = match r.u8()? {
        0 => false,
        1 => true,
        _ => return Err(BodyError("bad retain flag")),
    };
    let properties = read_props(r, true)?.map(|b| *b).unwrap_or_default();
    Ok(LastWill {
        topic,
        payload,
        qos,
        retain,
        properties,
    })
}

impl StoredSession {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.u32(self.expiry).opt_u64(self.disconnected_at_wall);
        w.u32(self.subs.len() as u32);
        for (filter, o) in &self.subs {
            w.bytes(filter.as_bytes())
                .u8(o.qos as u8)
                .u8(u8::from(o.no_local) | (u8::from(o.retain_as_published) << 1))
                .u8(o.retain_handling)
                .u32(o.identifier);
        }
        match &self.will {
            Some(will) => {
                w.u8(1);
                write_will(&mut w, will);
            }
            None => {
                w.u8(0);
            }
        }
        w.opt_u64(self.will_at_wall);
        write_stamp(&mut w, self.stamp);
        w.buf
    }

    pub fn decode(body: &[u8]) -> Result<StoredSession, BodyError> {
        let mut r = Reader::new(body);
        let expiry = r.u32()?;
        let disconnected_at_wall = r.opt_u64()?;
        let n = r.u32()? as usize;
        let mut subs = Vec::with_capacity(n.min(4096));
        for _ in 0..n {
            let filter = r.string()?;
            let qos = qos(r.u8()?)?;
            let flags = r.u8()?;
            let retain_handling = r.u8()?;
            let identifier = r.u32()?;
            if flags > 3 || retain_handling > 2 {
                return Err(BodyError("bad subscription options"));
            }
            subs.push((
                filter,
                SubOpts {
                    qos,
                    no_local: flags & 1 != 0,
                    retain_as_published: flags & 2 != 0,
                    retain_handling,
                    identifier,
                },
            ));
        }
        let will = match r.u8()? {
            0 => None,
            1 => Some(read_will(&mut r)?),
            _ => return Err(BodyError("bad will tag")),
        };
        let will_at_wall = r.opt_u64()?;
        let stamp = read_stamp(&mut r)?;
        r.finish()?;
        Ok(StoredSession {
            expiry,
            disconnected_at_wall,
            subs,
            will,
            will_at_wall,
            stamp,
        })
    }
}

/// A retained message as stored.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredRetained {
    pub payload: Bytes,
    pub qos: QoS,
    pub props: Option<Box<Properties>>,
    pub expires_at_wall: Option<u64>,
    /// The write's version in a cluster (appended; absent in records of a single node or
    /// of earlier releases). With an empty payload the record is a deletion's tombstone.
    pub stamp: Option<Stamp>,
}

impl StoredRetained {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::default();
        w.bytes(&self.payload)
            .u8(self.qos as u8)
            .opt_u64(self.expires_at_wall);
        write_props(&mut w, self.props.as_deref());
        write_stamp(&mut w, self.stamp);
        w.buf
    }

    pub fn decode(body: &[u8]) -> Result<StoredRetained, BodyError> {
        let mut r = Reader::new(body);
        let payload = Bytes::copy_from_slice(r.bytes()?);
        let qos = qos(r.u8()?)?;
        let expires_at_wall = r.opt_u64()?;
        let props = read_props(&mut r, false)?;
        let stamp = read_stamp(&mut r)?;
        r.finish()?;
        Ok(StoredRetained {
            payload,
            qos,
            props,
            expires_at_wall,
            stamp,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_parse_back_and_keep_one_client_contiguous() {
        for id in ["", "a", "client/with/slashes", "ü"] {
            assert_eq!(parse_key(&session_key(id)), Some(Key::Session(id.into())));
            assert_eq!(
                parse_key(&message_key(id, 7)),
                Some(Key::Message(id.into(), 7))
            );
            assert_eq!(
                parse_key(&outbox_key(id, 1, 2, 3)),
                Some(Key::Outbox {
                    peer: id.into(),
                    start: 1,
                    epoch: 2,
                    seq: 3
                })
            );
            assert_eq!(
                parse_key(&flight_key(id, u64::MAX)),
                Some(Key::Flight(id.into(), u64::MAX))
            );
            assert_eq!(
                parse_key(&inbound_key(id, 9)),
                Some(Key::Inbound(id.into(), 9))
            );
            let inner = message_key(id, 7);
            assert_eq!(session_client(&inner), Some(id));
            assert_eq!(
                parse_key(&copy_key(id, &inner)),
                Some(Key::Copy(id.into(), inner))
            );
            assert_eq!(
                parse_key(&copy_key(id, b"")),
                Some(Key::Copy(id.into(), vec![]))
            );
            // A copy holds only records of its own client.
            assert_eq!(parse_key(&copy_key(id, &session_key("other"))), None);
        }
        assert_eq!(session_client(&retained_key(b"a")), None);
        assert_eq!(
            parse_key(&retained_key(b"a/b")),
            Some(Key::Retained(Bytes::from_static(b"a/b")))
        );
        // "a" and "ab": every key of "a" sorts before every key of "ab" and no prefix of one
        // client's range is another's.
        assert!(message_key("a", u64::MAX) < message_key("ab", 0));
        assert!(message_key("a", 1) < message_key("a", 256));
        assert_eq!(
            parse_key(&mark_key(3, u64::MAX)),
            Some(Key::Mark {
                home: 3,
                node: u64::MAX
            })
        );
        assert_eq!(parse_key(&mark_key(3, 4)[..16]), None);
        assert_eq!(
            parse_key(&will_copy_key("dev")),
            Some(Key::WillCopy("dev".into()))
        );
        assert_eq!(parse_key(b"w\x00\x03devx"), None);
        assert_eq!(
            parse_key(&will_fired_key("dev")),
            Some(Key::WillFired("dev".into()))
        );
        assert_eq!(
            parse_key(&route_row_key("node1", "a/+/#")),
            Some(Key::RouteRow {
                peer: "node1".into(),
                filter: "a/+/#".into()
            })
        );
        // A row names a filter; a filter is never empty.
        assert_eq!(parse_key(&route_row_key("node1", "")), None);
        assert!(route_row_key("n", "z") < route_row_key("na", "a"));
        assert_eq!(parse_key(b""), None);
        assert_eq!(parse_key(b"m\x00\x05ab"), None);
        assert_eq!(parse_key(b"x\x00\x00"), None);
    }

    #[test]
    fn bodies_round_trip_and_reject_truncation() {
        let props = Properties {
            content_type: Some("text/plain".into()),
            user_properties: vec![("k".into(), "v".into())],
            ..Properties::default()
        };
        let m = StoredMessage {
            topic: Bytes::from_static(b"t/1"),
            payload: Bytes::from_static(b"hello"),
            msg_qos: QoS::ExactlyOnce,
            qos: QoS::AtLeastOnce,
            msg_retain: true,
            retain: false,
            props: props.clone().into_boxed(),
            expires_at_wall: Some(123),
            sub_ids: vec![1, 268_435_455],
            id: 0,
        };
        let body = m.encode();
        assert_eq!(StoredMessage::decode(&body).unwrap(), m);
        for len in 0..body.len() {
            assert!(StoredMessage::decode(&body[..len]).is_err());
        }
        // A cluster message id is appended; a record cut inside it is refused.
        let with_id = StoredMessage {
            id: (7u128 << 64) | 9,
            ..m.clone()
        };
        let long = with_id.encode();
        assert_eq!(long.len(), body.len() + 16);
        assert_eq!(StoredMessage::decode(&long).unwrap(), with_id);
        for len in body.len() + 1..long.len() {
            assert!(StoredMessage::decode(&long[..len]).is_err());
        }
        let s = StoredSession {
            expiry: 3600,
            disconnected_at_wall: Some(99),
            subs: vec![(
                "a/+".into(),
                SubOpts {
                    qos: QoS::ExactlyOnce,
                    no_local: true,
                    retain_as_published: false,
                    retain_handling: 2,
                    identifier: 42,
                },
            )],
            will: Some(LastWill {
                topic: "w".into(),
                payload: Bytes::from_static(b"bye"),
                qos: QoS::AtLeastOnce,
                retain: true,
                properties: Properties {
                    will_delay_interval: Some(5),
                    ..Properties::default()
                },
            }),
            will_at_wall: Some(1000),
            stamp: None,
        };
        let body = s.encode();
        assert_eq!(StoredSession::decode(&body).unwrap(), s);
        for len in 0..body.len() {
            assert!(StoredSession::decode(&body[..len]).is_err());
        }
        // A cluster's session carries its version; a record without one still reads.
        let stamped = StoredSession {
            stamp: Some(Stamp { clock: 7, node: 8 }),
            ..s
        };
        let body = stamped.encode();
        assert_eq!(StoredSession::decode(&body).unwrap(), stamped);
        assert!(StoredSession::decode(&body[..body.len() - 1]).is_err());
        let r = StoredRetained {
            payload: Bytes::from_static(b"on"),
            qos: QoS::AtMostOnce,
            props: None,
            expires_at_wall: None,
            stamp: None,
        };
        assert_eq!(StoredRetained::decode(&r.encode()).unwrap(), r);
        let stamped = StoredRetained {
            stamp: Some(Stamp {
                clock: 1 << 20,
                node: 9,
            }),
            ..r
        };
        let body = stamped.encode();
        assert_eq!(StoredRetained::decode(&body).unwrap(), stamped);
        for len in body.len() - 16 + 1..body.len() {
            assert!(StoredRetained::decode(&body[..len]).is_err());
        }
        assert_eq!(decode_flight(&encode_flight(5, 3)), Ok((5, 3)));
        assert!(decode_flight(&encode_flight(0, 1)).is_err());
        let mark = encode_mark(7, u64::MAX);
        assert_eq!(decode_mark(&mark), Ok((7, u64::MAX)));
        for len in 0..mark.len() {
            assert!(decode_mark(&mark[..len]).is_err());
        }
        assert!(decode_mark(&[mark.clone(), vec![0]].concat()).is_err());
        let will = LastWill {
            topic: "wills/dev".into(),
            payload: Bytes::from_static(b"offline"),
            qos: QoS::AtLeastOnce,
            retain: true,
            properties: Default::default(),
        };
        let stamp = Stamp {
            clock: 11,
            node: 12,
        };
        let fired = encode_will_fired(3, stamp);
        assert_eq!(decode_will_fired(&fired), Ok((3, stamp)));
        for len in 0..fired.len() {
            assert!(decode_will_fired(&fired[..len]).is_err());
        }
        assert!(decode_will_fired(&[fired, vec![0]].concat()).is_err());
        let body = encode_will_copy(3, 4, stamp, &encode_will(&will));
        let held = decode_will_copy(&body).unwrap();
        assert_eq!((held.home, held.epoch, held.stamp), (3, 4, stamp));
        assert_eq!(held.will, will);
        for len in 0..body.len() {
            assert!(decode_will_copy(&body[..len]).is_err());
        }
        assert!(decode_will_copy(&[body, vec![0]].concat()).is_err());
    }
}
