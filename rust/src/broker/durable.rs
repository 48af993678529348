//! Durable state: the records the engine writes for persistent sessions and retained
//! messages, and rebuilding the engine from them at start-up.
//!
//! The engine only produces operations (`take_store_ops`); the caller writes them to the store
//! as one batch *before* it drains the output they belong to, so no PUBACK, PUBREC or PUBLISH
//! reaches the network ahead of the state it acknowledges or depends on (a QoS 2 packet id
//! must be stored before its PUBLISH goes out, or a restart could deliver the message again
//! under a new id). If the write fails, `store_failed` disconnects the publishers whose
//! messages were in the batch, before their acknowledgements are sent.
//!
//! Stored: sessions with an expiry (subscriptions, will), their QoS 1/2 messages queued or in
//! flight, inbound QoS 2 packet ids awaiting PUBREL, and retained messages. QoS 0 messages
//! are not stored, nor is anything of a session that ends with its connection.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use bytes::Bytes;

use super::state::{AwaitingAck, Delivery, Inflight, Message, Session, SessionId, BROKER_ORIGIN};
use super::{ConnId, Engine};
use crate::cluster::batch::{Mark, Stamp};
use crate::codec::QoS;
use crate::store::envelope;
use crate::store::records::{self, Key, StoredMessage, StoredRetained, StoredSession};

/// One store operation: put `(key, Some(value))` or delete `(key, None)`.
pub type StoreOp = (Vec<u8>, Option<Vec<u8>>);

/// Records read back at start-up, collected until `finish_restore` (keys arrive sorted by
/// kind, and sessions sort after their messages).
#[derive(Default)]
pub(super) struct Restoring {
    sessions: HashMap<String, StoredSession>,
    messages: HashMap<String, BTreeMap<u64, StoredMessage>>,
    flights: HashMap<String, HashMap<u64, (u16, u8)>>,
    inbound: HashMap<String, Vec<u16>>,
    retained: Vec<(Bytes, StoredRetained)>,
}

/// What `finish_restore` rebuilt.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestoreSummary {
    pub sessions: usize,
    pub messages: usize,
    pub inflight: usize,
    pub retained: usize,
    /// Records of sessions that no longer exist (their deletion was torn off by a crash);
    /// deleted now.
    pub orphans: usize,
    /// Sessions that expired while the broker was down.
    pub expired_sessions: usize,
}

fn awaiting_code(a: AwaitingAck) -> u8 {
    match a {
        AwaitingAck::PubAck => 1,
        AwaitingAck::PubRec => 2,
        AwaitingAck::PubComp => 3,
    }
}

fn awaiting_of(code: u8) -> AwaitingAck {
    match code {
        1 => AwaitingAck::PubAck,
        2 => AwaitingAck::PubRec,
        _ => AwaitingAck::PubComp,
    }
}

impl Engine {
    /// Wall-clock ms at `now` (monotonic ms): stored times must survive a restart.
    pub(super) fn wall(&self, now: u64) -> u64 {
        (now as i64 + self.wall_offset).max(0) as u64
    }

    fn mono(&self, wall: u64, now: u64) -> u64 {
        // A time before this process started maps to 0, i.e. "long ago".
        let m = wall as i64 - self.wall_offset;
        if m < 0 {
            0
        } else {
            (m as u64).min(now.saturating_add(1 << 40))
        }
    }

    /// Tells the engine the wall-clock time that goes with `now`; call at start and now and
    /// then (the two clocks drift apart).
    pub fn set_wall_clock(&mut self, wall_ms: u64, now: u64) {
        self.wall_offset = wall_ms as i64 - now as i64;
    }

    /// Operations produced since the last call; the caller writes them as one batch before
    /// its next `drain`.
    pub fn take_store_ops(&mut self) -> Vec<StoreOp> {
        if self.cluster_store_due() {
            self.store_cluster_batches();
        }
        self.unconfirmed_publishers = std::mem::take(&mut self.batch_publishers);
        std::mem::take(&mut self.store_ops)
    }

    pub fn has_store_ops(&self) -> bool {
        !self.store_ops.is_empty() || self.cluster_store_due()
    }

    /// The last batch from `take_store_ops` could not be written: publishers whose QoS 1/2
    /// messages were in it are disconnected before their acknowledgements go out (MQTT 5:
    /// DISCONNECT 0x97 quota exceeded), so they resend later; nothing unstored is
    /// acknowledged. Their connection ids are returned.
    pub fn store_failed(&mut self, now: u64) -> Vec<ConnId> {
        if self.cluster.epoch_of() != 0 {
            // Its data links close (the data plane): out of touch until the store works
            // and the failure timeout passes after (`cluster_store_recovered`).
            self.out_of_touch_until = u64::MAX;
        }
        let conns = std::mem::take(&mut self.unconfirmed_publishers);
        for &id in &conns {
            if let Some(conn) = self.conn_mut(id) {
                conn.out.clear();
            }
            self.close(id, Some(0x97), "store write failed", true, now);
        }
        conns
    }

    pub(super) fn put(&mut self, key: Vec<u8>, body: &[u8]) {
        let value = envelope::seal(&key, body, self.cfg.compress_above);
        self.copy_op(&key, Some(&value));
        self.store_ops.push((key, Some(value)));
    }

    pub(super) fn delete(&mut self, key: Vec<u8>) {
        self.copy_op(&key, None);
        self.store_ops.push((key, None));
    }

    /// Whether `sid` outlives its connection and is kept on disk.
    pub(super) fn is_durable(&self, sid: SessionId) -> bool {
        self.cfg.durable && self.session(sid).is_some_and(|s| s.expiry > 0)
    }

    /// A QoS 1/2 publish from connection `id` is being handled: remember it if it produced
    /// store operations, so a failed write can take back its acknowledgement.
    pub(super) fn note_publisher(&mut self, id: ConnId, ops_before: usize) {
        // A message for a peer whose link is down is stored with the next write too.
        let stored = self.store_ops.len() > ops_before || self.cluster.to_down_peer();
        if stored && self.batch_publishers.last() != Some(&id) {
            self.batch_publishers.push(id);
        }
    }

    /// Writes the session record (or removes every record of a session that stopped being
    /// durable).
    pub(super) fn persist_session(&mut self, sid: SessionId, now: u64) {
        if !self.cfg.durable {
            return;
        }
        if !self.is_durable(sid) {
            self.unpersist_session(sid);
            return;
        }
        // Its version in a cluster first: the record and its copies carry it.
        self.stamp_session(sid, now);
        let record = self.session_record(sid, now);
        let session = self.session(sid).expect("durable session exists");
        let key = records::session_key(&session.client_id);
        // First write of a session that already holds messages (it became durable): store
        // them too, with their in-flight state.
        let pending: Vec<(Option<(u16, AwaitingAck)>, Delivery)> = if session.stored {
            Vec::new()
        } else {
            session
                .inflight
                .iter()
                .map(|f| (Some((f.pkid, f.state)), f.delivery.clone()))
                .chain(session.queue.iter().map(|d| (None, d.clone())))
                .filter(|(_, d)| d.qos != QoS::AtMostOnce)
                .collect()
        };
        self.put(key, &record.encode());
        self.session_mut(sid).expect("exists").stored = true;
        for (flight, mut d) in pending {
            self.store_delivery(sid, &mut d, now);
            if let Some((pkid, state)) = flight {
                self.store_flight(sid, d.seq, pkid, state);
            }
            self.set_seq(sid, &d);
        }
    }

    /// The session record of `sid` as the store keeps it.
    fn session_record(&self, sid: SessionId, now: u64) -> StoredSession {
        let wall_now = self.wall(now);
        let session = self.session(sid).expect("caller checked");
        let will = session
            .conn
            .and_then(|c| self.conn(c))
            .and_then(|c| c.will.as_deref().cloned());
        StoredSession {
            expiry: session.expiry,
            disconnected_at_wall: session
                .disconnected_at
                .filter(|_| session.conn.is_none())
                .map(|t| wall_now.saturating_sub(now.saturating_sub(t))),
            subs: session.subs.iter().map(|(f, o)| (f.clone(), *o)).collect(),
            will,
            will_at_wall: session
                .pending_will()
                .map(|(_, at)| wall_now + at.saturating_sub(now)),
            stamp: session.stamp,
        }
    }

    /// The record of a stored message as the store keeps it.
    pub(super) fn message_record(&self, d: &Delivery, now: u64) -> StoredMessage {
        let wall_now = self.wall(now);
        let m = &d.msg;
        StoredMessage {
            topic: m.topic.clone(),
            payload: m.payload.clone(),
            msg_qos: m.qos,
            qos: d.qos,
            msg_retain: m.retain,
            retain: d.retain,
            props: m.props.clone(),
            expires_at_wall: m.expires_at.map(|t| wall_now + t.saturating_sub(now)),
            sub_ids: d.sub_ids.clone(),
            id: m.id,
        }
    }

    /// Every record of session `sid` as the store would hold them (sealed), for another
    /// node to restore: the session, its QoS 1/2 messages in order (`renumber`: numbered
    /// from 1, the keys of a node that installs them; else under their keys here, for a
    /// copy), their in-flight states, its inbound QoS 2 ids. Made by the same functions
    /// that write them to the store.
    pub(super) fn session_records(
        &self,
        sid: SessionId,
        renumber: bool,
        now: u64,
    ) -> Vec<(Vec<u8>, Vec<u8>)> {
        let Some(session) = self.session(sid) else {
            return Vec::new();
        };
        let seal = |key: Vec<u8>, body: &[u8]| {
            let value = envelope::seal(&key, body, self.cfg.compress_above);
            (key, value)
        };
        let id = &session.client_id;
        let mut out = vec![seal(
            records::session_key(id),
            &self.session_record(sid, now).encode(),
        )];
        let mut seq = 0;
        let mut number = |d: &Delivery| {
            seq += 1;
            if renumber {
                seq
            } else {
                d.seq
            }
        };
        for f in &session.inflight {
            let seq = number(&f.delivery);
            if seq == 0 {
                continue;
            }
            out.push(seal(
                records::message_key(id, seq),
                &self.message_record(&f.delivery, now).encode(),
            ));
            out.push(seal(
                records::flight_key(id, seq),
                &records::encode_flight(f.pkid, awaiting_code(f.state)),
            ));
        }
        for d in session.queue.iter().filter(|d| d.qos != QoS::AtMostOnce) {
            let seq = number(d);
            if seq == 0 {
                continue;
            }
            out.push(seal(
                records::message_key(id, seq),
                &self.message_record(d, now).encode(),
            ));
        }
        for &pkid in session.inbound_qos2.iter() {
            out.push(seal(records::inbound_key(id, pkid), &[]));
        }
        out
    }

    /// Copies a freshly assigned sequence number into the session's own copy of `d`.
    fn set_seq(&mut self, sid: SessionId, d: &Delivery) {
        let session = self.session_mut(sid).expect("exists");
        for f in session.inflight.iter_mut() {
            if Arc::ptr_eq(&f.delivery.msg, &d.msg) && f.delivery.seq == 0 {
                f.delivery.seq = d.seq;
                return;
            }
        }
        for q in session.queue.iter_mut() {
            if Arc::ptr_eq(&q.msg, &d.msg) && q.seq == 0 {
                q.seq = d.seq;
                return;
            }
        }
    }

    /// Deletes every record of `sid` (the session ends, or stops being durable).
    pub(super) fn unpersist_session(&mut self, sid: SessionId) {
        let Some(session) = self.session_mut(sid) else {
            return;
        };
        if !session.stored {
            return;
        }
        session.stored = false;
        let id = session.client_id.clone();
        let seqs: Vec<u64> = session
            .inflight
            .iter()
            .map(|f| f.delivery.seq)
            .chain(session.queue.iter().map(|d| d.seq))
            .filter(|&s| s != 0)
            .collect();
        let inbound: Vec<u16> = session.inbound_qos2.iter().copied().collect();
        for q in session.queue.iter_mut() {
            q.seq = 0;
        }
        for f in session.inflight.iter_mut() {
            f.delivery.seq = 0;
        }
        self.delete(records::session_key(&id));
        for seq in seqs {
            self.delete(records::message_key(&id, seq));
            self.delete(records::flight_key(&id, seq));
        }
        for pkid in inbound {
            self.delete(records::inbound_key(&id, pkid));
        }
    }

    /// Stores a QoS 1/2 delivery to a durable session, giving it its sequence number.
    pub(super) fn store_delivery(&mut self, sid: SessionId, d: &mut Delivery, now: u64) {
        if d.qos == QoS::AtMostOnce || d.seq != 0 || !self.is_durable(sid) {
            return;
        }
        let session = self.session_mut(sid).expect("durable session exists");
        if !session.stored {
            return;
        }
        session.next_seq += 1;
        d.seq = session.next_seq;
        let key = records::message_key(&session.client_id, d.seq);
        let record = self.message_record(d, now);
        self.put(key, &record.encode());
    }

    pub(super) fn store_flight(&mut self, sid: SessionId, seq: u64, pkid: u16, a: AwaitingAck) {
        if seq == 0 {
            return;
        }
        let Some(session) = self.session(sid) else {
            return;
        };
        let key = records::flight_key(&session.client_id, seq);
        self.put(key, &records::encode_flight(pkid, awaiting_code(a)));
    }

    /// A stored delivery is done with (acknowledged, expired, refused, dropped).
    pub(super) fn forget_delivery(&mut self, sid: SessionId, seq: u64) {
        if seq == 0 {
            return;
        }
        let Some(session) = self.session(sid) else {
            return;
        };
        let id = session.client_id.clone();
        self.delete(records::message_key(&id, seq));
        self.delete(records::flight_key(&id, seq));
    }

    /// An inbound QoS 2 packet id of a durable session was added (`present`) or released.
    pub(super) fn store_inbound(&mut self, sid: SessionId, pkid: u16, present: bool) {
        if !self.is_durable(sid) || !self.session(sid).is_some_and(|s| s.stored) {
            return;
        }
        let key = records::inbound_key(&self.session(sid).expect("exists").client_id, pkid);
        if present {
            self.put(key, &[]);
        } else {
            self.delete(key);
        }
    }

    /// The retained message of `topic` was set (`Some`) or cleared. A stamped deletion (in a
    /// cluster) is stored as a tombstone: an empty payload with the stamp.
    pub(super) fn store_retained(
        &mut self,
        topic: &[u8],
        msg: Option<&Message>,
        stamp: Option<Stamp>,
        now: u64,
    ) {
        if !self.cfg.durable {
            return;
        }
        let key = records::retained_key(topic);
        let record = match msg {
            Some(m) => {
                let wall_now = self.wall(now);
                StoredRetained {
                    payload: m.payload.clone(),
                    qos: m.qos,
                    props: m.props.clone(),
                    expires_at_wall: m.expires_at.map(|t| wall_now + t.saturating_sub(now)),
                    stamp,
                }
            }
            None if stamp.is_some() => StoredRetained {
                payload: Bytes::new(),
                qos: QoS::AtMostOnce,
                props: None,
                expires_at_wall: None,
                stamp,
            },
            None => return self.delete(key),
        };
        self.put(key, &record.encode());
    }

    /// Takes stored records (in key order, in as many calls as convenient) before any
    /// connection is opened. A record that fails its checksum or does not decode is skipped
    /// and returned with the reason: it is reported, never delivered.
    pub fn restore(&mut self, recs: &[(&[u8], &[u8])]) -> Vec<(Vec<u8>, String)> {
        let mut bad = Vec::new();
        for &(key, value) in recs {
            if let Err(why) = self.restore_one(key, value) {
                bad.push((key.to_vec(), why));
            }
        }
        bad
    }

    fn restore_one(&mut self, key: &[u8], value: &[u8]) -> Result<(), String> {
        let parsed = records::parse_key(key).ok_or("unknown key")?;
        if let Key::Copy(client, inner) = parsed {
            // A copied record is sealed with its own key, and only read back when used.
            let body = if inner.is_empty() {
                envelope::open(key, value).map_err(|e| e.to_string())?
            } else {
                Default::default()
            };
            return self.restore_copy(client, inner, &body);
        }
        let body = envelope::open(key, value).map_err(|e| e.to_string())?;
        if let Key::Outbox {
            peer, epoch, seq, ..
        } = parsed
        {
            if seq == 0 || body.is_empty() {
                return Err("outbox record without a batch".into());
            }
            self.restore_outgoing(&peer, epoch, seq, key.to_vec(), body.to_vec());
            return Ok(());
        }
        if let Key::WillCopy(client) = parsed {
            return self.restore_will_copy(client, &body);
        }
        if let Key::WillFired(client) = parsed {
            return self.restore_will_fired(client, &body);
        }
        if let Key::RouteRow { peer, filter } = parsed {
            if !body.is_empty() {
                return Err("route row with a body".into());
            }
            return self.restore_route_row(&peer, &filter);
        }
        if let Key::Mark { home, node } = parsed {
            let (epoch, seq) = records::decode_mark(&body).map_err(|e| e.to_string())?;
            self.restore_mark(home, Mark { node, epoch, seq });
            return Ok(());
        }
        let r = self.restoring.get_or_insert_with(Box::default);
        match parsed {
            Key::Outbox { .. }
            | Key::Copy(..)
            | Key::Mark { .. }
            | Key::WillCopy(_)
            | Key::WillFired(_)
            | Key::RouteRow { .. } => {
                unreachable!("handled above")
            }
            Key::Session(id) => {
                let s = StoredSession::decode(&body).map_err(|e| e.to_string())?;
                r.sessions.insert(id, s);
            }
            Key::Message(id, seq) => {
                let m = StoredMessage::decode(&body).map_err(|e| e.to_string())?;
                r.messages.entry(id).or_default().insert(seq, m);
            }
            Key::Flight(id, seq) => {
                let f = records::decode_flight(&body).map_err(|e| e.to_string())?;
                r.flights.entry(id).or_default().insert(seq, f);
            }
            Key::Inbound(id, pkid) => {
                if !body.is_empty() {
                    return Err("inbound record with a body".into());
                }
                r.inbound.entry(id).or_default().push(pkid);
            }
            Key::Retained(topic) => {
                let m = StoredRetained::decode(&body).map_err(|e| e.to_string())?;
                r.retained.push((topic, m));
            }
        }
        Ok(())
    }

    /// The QoS 1/2 messages among a session's records (as `session_records` makes them) that
    /// its client may not have yet, in order: those queued and in flight, QoS 2 ones past
    /// PUBREC included (a client that delivers on PUBREL, as paho and libmosquitto do, would
    /// never get the PUBREL of the version they were in). Records that do not open are
    /// skipped.
    pub(super) fn undelivered_in_records(
        &self,
        recs: &[(&[u8], &[u8])],
        now: u64,
    ) -> Vec<Delivery> {
        let mut messages = BTreeMap::new();
        for &(key, value) in recs {
            let Ok(body) = envelope::open(key, value) else {
                continue;
            };
            if let Some(Key::Message(_, seq)) = records::parse_key(key) {
                if let Ok(m) = StoredMessage::decode(&body) {
                    messages.insert(seq, m);
                }
            }
        }
        messages
            .into_values()
            .map(|m| self.stored_delivery(m, 0, now))
            .collect()
    }

    /// A stored message record as a delivery numbered `seq`.
    fn stored_delivery(&self, m: StoredMessage, seq: u64, now: u64) -> Delivery {
        let msg = Message {
            topic: m.topic,
            payload: m.payload,
            qos: m.msg_qos,
            retain: m.msg_retain,
            props: m.props,
            expires_at: m.expires_at_wall.map(|w| self.mono(w, now)),
            origin: BROKER_ORIGIN,
            id: m.id,
        };
        Delivery {
            msg: Arc::new(msg),
            qos: m.qos,
            retain: m.retain,
            sub_ids: m.sub_ids,
            seq,
        }
    }

    /// Rebuilds sessions, queues, in-flight windows and retained messages from what `restore`
    /// took. Sessions come back disconnected; one whose connection died with the broker has
    /// its will published (after its delay), as for any abnormal disconnect.
    pub fn finish_restore(&mut self, now: u64) -> RestoreSummary {
        let mut summary = RestoreSummary::default();
        let Some(r) = self.restoring.take() else {
            return summary;
        };
        let Restoring {
            sessions,
            mut messages,
            mut flights,
            mut inbound,
            retained,
        } = *r;
        let wall_now = self.wall(now);
        for (topic, m) in retained {
            if let Some(stamp) = m.stamp {
                let deleted = m.payload.is_empty();
                self.cluster
                    .retained
                    .restored(topic.clone(), stamp, deleted, now);
                if deleted {
                    continue;
                }
            }
            let expires_at = m.expires_at_wall.map(|w| self.mono(w, now));
            if expires_at.is_some_and(|t| now >= t) {
                self.delete(records::retained_key(&topic));
                continue;
            }
            let msg = Message {
                topic: topic.clone(),
                payload: m.payload,
                qos: m.qos,
                retain: true,
                props: m.props,
                expires_at,
                origin: BROKER_ORIGIN,
                id: 0,
            };
            self.retained.insert(&topic, Arc::new(msg));
            summary.retained += 1;
        }
        let mut wills = Vec::new();
        for (id, s) in sessions {
            let client_id: Arc<str> = Arc::from(id.as_str());
            // Down time counts towards expiry; a crash under a live connection counts from
            // now (the time of death is unknown, and the client may still reconnect).
            let since_wall = s.disconnected_at_wall.unwrap_or(wall_now);
            let elapsed = wall_now.saturating_sub(since_wall);
            if s.expiry != u32::MAX && elapsed >= 1000 * u64::from(s.expiry) {
                summary.expired_sessions += 1;
                // Its messages go with the orphans below.
                self.delete(records::session_key(&id));
                continue;
            }
            let mut session = Session::new(client_id.clone());
            if let Some(stamp) = s.stamp {
                self.cluster.retained.observe(stamp);
            }
            session.stamp = s.stamp;
            session.expiry = s.expiry;
            session.disconnected_at = Some(now.saturating_sub(elapsed));
            session.stored = true;
            for (filter, opts) in &s.subs {
                session.subs.insert(filter.clone(), *opts);
            }
            let msgs = messages.remove(&id).unwrap_or_default();
            let mut flight = flights.remove(&id).unwrap_or_default();
            let mut inflight = VecDeque::new();
            let mut queue = VecDeque::new();
            for (seq, m) in msgs {
                session.next_seq = session.next_seq.max(seq);
                let d = self.stored_delivery(m, seq, now);
                match flight.remove(&seq) {
                    Some((pkid, code)) => {
                        session.next_pkid = session.next_pkid.max(pkid);
                        inflight.push_back(Inflight {
                            pkid,
                            state: awaiting_of(code),
                            delivery: d,
                        });
                    }
                    None => {
                        session.queued_bytes += d.msg.payload.len();
                        queue.push_back(d);
                    }
                }
            }
            // In-flight states whose message is gone: the ack completed but the deletes of
            // the pair were split by a crash. Cannot happen with atomic batches; dropped.
            for seq in flight.keys() {
                self.delete(records::flight_key(&id, *seq));
                summary.orphans += 1;
            }
            summary.messages += queue.len();
            summary.inflight += inflight.len();
            session.queue = queue;
            session.inflight = inflight;
            for pkid in inbound.remove(&id).unwrap_or_default() {
                session.inbound_qos2.insert(pkid);
            }
            let will_at = s
                .will_at_wall
                .map(|w| self.mono(w, now).max(now))
                .or_else(|| {
                    // Connected when the broker died: an abnormal disconnect now.
                    s.will.as_ref().map(|w| {
                        now + 1000
                            * u64::from(w.properties.will_delay_interval.unwrap_or(0).min(s.expiry))
                    })
                });
            let will = s.will.map(Box::new);
            let versioned = session.stamp.is_some();
            let sid = self.insert_session(client_id, session);
            if versioned && self.cluster.epoch_of() == 0 && self.cfg.cluster_takeover_ms > 0 {
                // Another node may have taken it over while this one was down.
                self.restored_unconfirmed(sid, now);
            }
            for (filter, opts) in &s.subs {
                self.index_subscribe(filter, sid, *opts);
            }
            if let (Some(will), Some(at)) = (will, will_at) {
                wills.push((sid, will, at));
            }
            summary.sessions += 1;
        }
        // Messages, in-flight states and packet ids of sessions that are gone.
        for (id, msgs) in messages {
            for seq in msgs.keys() {
                self.delete(records::message_key(&id, *seq));
                summary.orphans += 1;
            }
        }
        for (id, f) in flights {
            for seq in f.keys() {
                self.delete(records::flight_key(&id, *seq));
                summary.orphans += 1;
            }
        }
        for (id, pkids) in inbound {
            for pkid in pkids {
                self.delete(records::inbound_key(&id, pkid));
                summary.orphans += 1;
            }
        }
        // At start-up in a cluster, a will of a connection that died with this node waits for
        // the takeover time: meanwhile the copies' owners tell this node if another took the
        // session over and published it (then the session here is dropped, will and all).
        let defer = if self.cluster.epoch_of() == 0 {
            self.cfg.cluster_takeover_ms
        } else {
            0
        };
        for (sid, will, at) in wills {
            let at = if defer > 0 { at.max(now + defer) } else { at };
            if at <= now {
                self.publish_will(*will, sid, now);
            } else {
                self.session_mut(sid)
                    .expect("restored")
                    .rare_mut()
                    .pending_will = Some((will, at));
            }
            self.persist_session(sid, now);
        }
        summary
    }
}
