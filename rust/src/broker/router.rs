//! The publish path: an incoming PUBLISH is checked, matched against the subscription index,
//! and encoded straight onto each subscriber's output, or queued when it cannot go now.
//! Also the acknowledgement flows of QoS 1 and 2 in both directions.

use std::mem;
use std::sync::Arc;

use bytes::Bytes;

use super::acl;
use super::cluster::PeerId;
use super::cluster_replicas::Listing;
use super::state::{AwaitingAck, ConnState, Delivery, Inflight, Message, SessionId};
use super::{ConnId, Engine};
use crate::cluster::batch::Stamp;
use crate::codec::{self, Ack, Packet, Properties, Protocol, Publish, PublishOut, QoS};
use crate::topics::SubOpts;

/// The properties a message carries to its receivers, or None when there are none (the
/// common case, which then costs nothing per delivery). Takes a box to reuse it.
pub(super) fn forwarded_props(mut p: Box<Properties>) -> Option<Box<Properties>> {
    p.topic_alias = None;
    p.subscription_identifiers.clear();
    p.message_expiry_interval = None;
    if p.payload_format_indicator.is_none()
        && p.content_type.is_none()
        && p.response_topic.is_none()
        && p.correlation_data.is_none()
        && p.user_properties.is_empty()
    {
        None
    } else {
        Some(p)
    }
}

/// The subscription identifiers a delivery through one subscription carries.
pub(super) fn sub_ids_of(opts: &SubOpts) -> Vec<u32> {
    if opts.identifier != 0 {
        vec![opts.identifier]
    } else {
        Vec::new()
    }
}

/// Which of this node's subscriptions a message routed here is for.
#[derive(Clone, Copy)]
pub(super) enum Scope<'a> {
    /// Published on this node: every plain subscription, and the shared groups the cluster
    /// part does not give to another node.
    Origin,
    /// Forwarded by another node: the plain subscriptions if `plain`, and these shared
    /// groups (`$share/g/f`), one member each; a retained write's `stamp`.
    Forwarded {
        plain: bool,
        groups: &'a [&'a str],
        stamp: Option<Stamp>,
        /// The peer it came from, and the keys of the other nodes it went to plain.
        from: PeerId,
        also: &'a [u64],
        /// Client ids whose sessions on that peer took it (`WireMessage::taken`).
        taken: &'a [&'a str],
    },
}

/// Scratch space for one routing pass, kept between calls so routing does not allocate.
#[derive(Default)]
pub(super) struct RouteScratch {
    plain: Vec<(SessionId, SubOpts)>,
    targets: Vec<(SessionId, SubOpts, Vec<u32>)>,
}

impl Engine {
    pub(super) fn handle_publish(&mut self, id: ConnId, mut p: Publish, now: u64) {
        let conn = self.conn_mut(id).expect("caller checked");
        let v5 = conn.protocol == Protocol::V5;
        let sid = conn.session.expect("active connection has a session");
        conn.published = true;
        if let Some(bucket) = conn.bucket.as_mut() {
            bucket.take();
        }
        let has_permissions = conn.permissions.is_some();
        if !p.props().subscription_identifiers.is_empty() {
            // MQTT-3.3.4-6: only the server puts subscription identifiers in a PUBLISH.
            return self.close(
                id,
                Some(0x82),
                "subscription identifier from client",
                true,
                now,
            );
        }
        // Topic alias (MQTT 5): set or look up, and never forward it.
        if let Some(alias) = p.properties.as_mut().and_then(|p| p.topic_alias.take()) {
            if alias == 0 || alias > self.cfg.topic_alias_maximum {
                return self.close(id, Some(0x94), "topic alias invalid", true, now);
            }
            let conn = self.conn_mut(id).expect("exists");
            if p.topic.is_empty() {
                match conn.aliases.as_ref().and_then(|a| a.incoming.get(&alias)) {
                    Some(topic) => p.topic = topic.clone(),
                    None => return self.close(id, Some(0x82), "unknown topic alias", true, now),
                }
            } else {
                let aliases = conn.aliases.get_or_insert_with(Default::default);
                aliases
                    .incoming
                    .insert(alias, Bytes::copy_from_slice(&p.topic));
            }
        } else if p.topic.is_empty() {
            return self.close(id, Some(0x82), "empty topic without alias", true, now);
        }
        if p.qos as u8 > self.cfg.maximum_qos {
            return self.close(id, Some(0x9B), "QoS not supported", true, now);
        }
        if p.retain && !self.cfg.retain_available {
            return self.close(id, Some(0x9A), "retain not supported", true, now);
        }
        self.stats.messages_received += 1;
        if p.topic.starts_with(b"$SYS") {
            // Only the broker writes $SYS: acknowledged (0x87 "not authorized" in MQTT 5) and
            // dropped, so a client cannot fake broker statistics.
            return self.ack_not_authorized(id, v5, &p);
        }
        if has_permissions
            && self
                .conn(id)
                .and_then(|c| c.permissions.as_deref())
                .is_some_and(|perm| !perm.allows(acl::PUBLISH, &p.topic))
        {
            return self.deny_publish(id, v5, &p);
        }
        if self.cfg.intercept {
            return self.intercept_publish(id, sid, p, now);
        }
        // The copies this publish makes (and only these) hold its acknowledgement.
        self.replicas.start();
        match p.qos {
            QoS::AtMostOnce => {
                self.route(Arc::new(message_of(p, sid, now)), now);
            }
            QoS::AtLeastOnce => {
                let pkid = p.pkid;
                let ops_before = self.store_ops.len();
                let drops_before = self.quota_drops;
                let delivered = self.route(Arc::new(message_of(p, sid, now)), now);
                self.note_publisher(id, ops_before);
                let code = self.publish_result(v5, delivered, drops_before);
                self.ack_publish(id, Packet::PubAck(Engine::ack(pkid, code)));
            }
            QoS::ExactlyOnce => {
                let pkid = p.pkid;
                let receive_maximum = usize::from(self.cfg.receive_maximum);
                let session = self.session_mut(sid).expect("exists");
                if session.inbound_qos2.contains(&pkid) {
                    // A resend before PUBREL: acknowledge again, never deliver twice.
                    self.send(id, &Packet::PubRec(Engine::ack(pkid, 0)));
                    return;
                }
                if session.inbound_qos2.count() >= receive_maximum {
                    return self.close(id, Some(0x93), "receive maximum exceeded", true, now);
                }
                session.inbound_qos2.insert(pkid);
                let ops_before = self.store_ops.len();
                let drops_before = self.quota_drops;
                self.store_inbound(sid, pkid, true);
                let delivered = self.route(Arc::new(message_of(p, sid, now)), now);
                self.note_publisher(id, ops_before);
                let code = self.publish_result(v5, delivered, drops_before);
                if code >= 0x80 {
                    // A failed PUBREC ends the exchange (MQTT 5 4.3.3): no PUBREL will come.
                    if let Some(s) = self.session_mut(sid) {
                        s.inbound_qos2.remove(&pkid);
                    }
                    self.store_inbound(sid, pkid, false);
                }
                self.ack_publish(id, Packet::PubRec(Engine::ack(pkid, code)));
            }
        }
    }

    /// A publish the connection's permissions do not allow: never routed, retained or
    /// stored. MQTT 5 acknowledges QoS 1/2 with 0x87; 3.1.1 acknowledges positively
    /// (MQTT-3.3.5-2 allows it) and the message is dropped.
    fn deny_publish(&mut self, id: ConnId, v5: bool, p: &Publish) {
        self.stats.publish_denied += 1;
        let client = self
            .conn(id)
            .map(|c| c.client_id.clone())
            .unwrap_or_default();
        let topic = String::from_utf8_lossy(&p.topic).into_owned();
        self.event("publish_denied", client, topic);
        self.ack_not_authorized(id, v5, p);
    }

    /// Acknowledges a publish that is dropped: 0x87 in MQTT 5, success in 3.1.1 (which has
    /// no failure code); QoS 0 gets nothing.
    fn ack_not_authorized(&mut self, id: ConnId, v5: bool, p: &Publish) {
        let code = if v5 { 0x87 } else { 0 };
        match p.qos {
            QoS::AtMostOnce => {}
            QoS::AtLeastOnce => {
                self.send(id, &Packet::PubAck(Engine::ack(p.pkid, code)));
            }
            QoS::ExactlyOnce => {
                self.send(id, &Packet::PubRec(Engine::ack(p.pkid, code)));
            }
        }
    }

    /// Queues a checked client publish for the caller (config `intercept`). A QoS 2 resend
    /// of a packet id already queued is ignored: its PUBREC goes out on release.
    fn intercept_publish(&mut self, id: ConnId, sid: SessionId, p: Publish, now: u64) {
        if p.qos == QoS::ExactlyOnce {
            let receive_maximum = usize::from(self.cfg.receive_maximum);
            let session = self.session(sid).expect("exists");
            if session.inbound_qos2.contains(&p.pkid) {
                if !session
                    .rare()
                    .is_some_and(|r| r.intercepting.contains(&p.pkid))
                {
                    self.send(id, &Packet::PubRec(Engine::ack(p.pkid, 0)));
                }
                return;
            }
            if session.inbound_qos2.count() >= receive_maximum {
                return self.close(id, Some(0x93), "receive maximum exceeded", true, now);
            }
        }
        let pkid = p.pkid;
        self.intercept(id, sid, message_of(p, sid, now), pkid);
    }

    /// The reason code of a QoS 1/2 publish's PUBACK / PUBREC (MQTT 5; 3.1.1 has none):
    /// 0x10 no matching subscribers, 0x97 quota exceeded when every subscriber's queue was
    /// full and dropped it.
    pub(super) fn publish_result(&self, v5: bool, delivered: usize, drops_before: u64) -> u8 {
        if !v5 {
            0
        } else if delivered == 0 {
            0x10
        } else if self.quota_drops - drops_before >= delivered as u64 {
            0x97
        } else {
            0
        }
    }

    pub(super) fn handle_pubrel(&mut self, id: ConnId, ack: Ack) {
        let Some(sid) = self.conn(id).and_then(|c| c.session) else {
            return;
        };
        let known = self
            .session_mut(sid)
            .is_some_and(|s| s.inbound_qos2.remove(&ack.pkid));
        if known {
            self.store_inbound(sid, ack.pkid, false);
        }
        // 0x92: packet identifier not found (MQTT 5; 3.1.1 ignores the code).
        let code = if known { 0 } else { 0x92 };
        self.send(id, &Packet::PubComp(Engine::ack(ack.pkid, code)));
    }

    pub(super) fn handle_puback(&mut self, id: ConnId, ack: Ack, now: u64) {
        self.complete(id, ack.pkid, AwaitingAck::PubAck, now);
    }

    pub(super) fn handle_pubcomp(&mut self, id: ConnId, ack: Ack, now: u64) {
        self.complete(id, ack.pkid, AwaitingAck::PubComp, now);
    }

    pub(super) fn handle_pubrec(&mut self, id: ConnId, ack: Ack, now: u64) {
        let Some(sid) = self.conn(id).and_then(|c| c.session) else {
            return;
        };
        let session = self.session_mut(sid).expect("exists");
        let pos = session
            .inflight
            .iter()
            .position(|f| f.pkid == ack.pkid && f.state == AwaitingAck::PubRec);
        match pos {
            Some(i) if ack.reason_code >= 0x80 => {
                // The receiver refused it: the exchange ends here (MQTT 5 4.3.3).
                let done = session.remove_inflight(i).expect("index valid");
                self.forget_delivery(sid, done.delivery.seq);
                self.pump(sid, now);
            }
            Some(i) => {
                session.inflight[i].state = AwaitingAck::PubComp;
                let seq = session.inflight[i].delivery.seq;
                let mark = self.wait_mark();
                let from = self.conn(id).map_or(0, |c| c.out.len());
                self.store_flight(sid, seq, ack.pkid, AwaitingAck::PubComp);
                self.send(id, &Packet::PubRel(Engine::ack(ack.pkid, 0)));
                self.gate_output(id, from, mark);
            }
            None => {
                let code = if session
                    .inflight
                    .iter()
                    .any(|f| f.pkid == ack.pkid && f.state == AwaitingAck::PubComp)
                {
                    0
                } else {
                    0x92
                };
                self.send(id, &Packet::PubRel(Engine::ack(ack.pkid, code)));
            }
        }
    }

    /// Ends the in-flight exchange `pkid` awaiting `state`, then sends what was waiting.
    fn complete(&mut self, id: ConnId, pkid: u16, state: AwaitingAck, now: u64) {
        let Some(sid) = self.conn(id).and_then(|c| c.session) else {
            return;
        };
        let session = self.session_mut(sid).expect("exists");
        // Acks mostly come in order, so the match is usually at the front.
        if let Some(i) = session
            .inflight
            .iter()
            .position(|f| f.pkid == pkid && f.state == state)
        {
            let done = session.remove_inflight(i).expect("index valid");
            self.forget_delivery(sid, done.delivery.seq);
            self.pump(sid, now);
        }
    }

    /// Delivers `msg` to every matching subscription on this node and forwards it to every
    /// other node with one (`cluster`). Returns how many sessions and nodes it went to.
    pub(super) fn route(&mut self, mut msg: Arc<Message>, now: u64) -> usize {
        if msg.id == 0 {
            // Published here: its id in the cluster (the Arc is new, not shared yet).
            if let Some(m) = Arc::get_mut(&mut msg) {
                m.id = self.cluster.next_message_id();
            }
        }
        let remote = self.plan_forward(&msg);
        let local = self.route_local(msg.clone(), now, Scope::Origin);
        let nodes = if remote { self.forward(&msg, now) } else { 0 };
        local + nodes
    }

    /// Delivers `msg` to the matching subscriptions on this node that `scope` gives it and
    /// keeps it if retained. Returns how many sessions it was delivered or queued to.
    pub(super) fn route_local(&mut self, msg: Arc<Message>, now: u64, scope: Scope<'_>) -> usize {
        if msg.retain {
            self.keep_retained(&msg, scope, now);
        }
        let mut scratch = mem::take(&mut self.scratch);
        scratch.plain.clear();
        scratch.targets.clear();
        let mut shared = Vec::new();
        self.subs
            .lookup(&msg.topic, &mut scratch.plain, &mut shared);
        // Shared groups: one member each, round robin, preferring connected members.
        let mut picked: Vec<(SessionId, SubOpts)> = Vec::with_capacity(shared.len());
        for group in &shared {
            // Each message goes to one member cluster-wide: this node's, or another's.
            let here = match scope {
                Scope::Origin => !self.cluster.give_group_away(group.key),
                Scope::Forwarded { groups, .. } => groups.contains(&group.key),
            };
            if !here {
                continue;
            }
            let n = group.members.len() as u32;
            let start = group.cursor.get();
            let mut choice = None;
            for k in 0..n {
                let (sid, opts) = group.members[((start + k) % n) as usize];
                let online = self.session(sid).is_some_and(|s| s.conn.is_some());
                if online || choice.is_none() {
                    choice = Some(((start + k) % n, sid, opts));
                    if online {
                        break;
                    }
                }
            }
            if let Some((idx, sid, opts)) = choice {
                group.cursor.set(idx + 1);
                picked.push((sid, opts));
            }
        }
        drop(shared);
        if let Scope::Origin = scope {
            self.cluster.assign_remote_groups();
        }
        if let Scope::Forwarded { plain: false, .. } = scope {
            // Sent here for shared groups only: the plain subscribers are not this batch's.
            scratch.plain.clear();
        }

        // Overlapping subscriptions of one session: one copy, highest QoS, every identifier.
        scratch.plain.sort_unstable_by_key(|(sid, _)| *sid);
        for &(sid, opts) in &scratch.plain {
            if opts.no_local && sid == msg.origin {
                continue;
            }
            match scratch.targets.last_mut() {
                Some((last, merged, ids)) if *last == sid => {
                    merged.qos = merged.qos.max(opts.qos);
                    merged.retain_as_published |= opts.retain_as_published;
                    if opts.identifier != 0 {
                        ids.push(opts.identifier);
                    }
                }
                _ => {
                    scratch.targets.push((sid, opts, sub_ids_of(&opts)));
                }
            }
        }
        let plain_targets = scratch.targets.len();
        for (sid, opts) in picked {
            scratch.targets.push((sid, opts, sub_ids_of(&opts)));
        }
        let mut count = 0;
        let taken = match scope {
            Scope::Forwarded { taken, .. } => taken,
            Scope::Origin => &[],
        };
        let origin = matches!(scope, Scope::Origin);
        let list_lagging = origin && self.cluster.lagging_plan();
        let list_qos2 = origin && self.cluster.listable_plan();
        for (i, (sid, opts, ids)) in scratch.targets.drain(..).enumerate() {
            let qos = msg.qos.min(opts.qos);
            let retain = msg.retain && opts.retain_as_published;
            let listing = if list_lagging && qos != QoS::AtMostOnce {
                Listing::Lagging
            } else if list_qos2 && qos == QoS::ExactlyOnce {
                Listing::Qos2
            } else {
                Listing::No
            };
            if (listing != Listing::No || !taken.is_empty())
                && self.taken_elsewhere(sid, taken, listing, now)
            {
                if let Scope::Forwarded { from, .. } = scope {
                    let key = self.cluster.peer_key(from);
                    self.wait_for_twin(sid, key, now);
                }
                continue;
            }
            if !origin && self.twin_took(sid, msg.id, 0, now) {
                continue;
            }
            if self.claims.relaying(sid) {
                // A session that moved to another node a moment ago (cluster_sessions).
                if self.relay(sid, &msg, qos, retain, ids, i < plain_targets, scope, now) {
                    count += 1;
                }
                continue;
            }
            if let Scope::Forwarded { from, also, .. } = scope {
                if i < plain_targets && self.took_at_old_home(sid, msg.id, from, also, now) {
                    // It reached the session where it lived before (cluster_took_routed).
                    self.claims.stats.took_at_old_home += 1;
                    count += 1;
                    continue;
                }
            }
            if self.unconfirmed(sid) {
                // Restored, and maybe taken over elsewhere meanwhile (cluster_replicas).
                self.hold_for_confirm(sid, &msg, qos, retain, ids, i < plain_targets, scope);
                count += 1;
                continue;
            }
            if let Scope::Forwarded { from, also, .. } = scope {
                if i < plain_targets {
                    self.direct_copy_came(sid, msg.id, now);
                    self.wait_for_relay(sid, msg.id, from, also, now);
                }
            }
            if self.deliver(sid, &msg, qos, retain, ids, now) {
                count += 1;
            }
        }
        self.scratch = scratch;
        count
    }

    /// Sets or clears `msg`'s topic in the retained set, if its stamp says so in a cluster
    /// (`cluster_retained`), and stores the change.
    fn keep_retained(&mut self, msg: &Arc<Message>, scope: Scope<'_>, now: u64) {
        let forwarded = match scope {
            Scope::Origin => None,
            Scope::Forwarded { stamp, .. } => Some(stamp.unwrap_or_default()),
        };
        let deleting = msg.payload.is_empty();
        let Some(stamp) = self.retained_write(&msg.topic, forwarded, deleting, now) else {
            return;
        };
        // $SYS topics are the broker's own, republished after a restart.
        let stored = !msg.topic.starts_with(b"$SYS");
        if deleting {
            // In a cluster the deletion is stored too (a tombstone), existing here or not.
            if (self.retained.remove(&msg.topic).is_some() || stamp.is_some()) && stored {
                self.store_retained(&msg.topic.clone(), None, stamp, now);
            }
        } else if self.retain_allowed(msg) {
            self.retained.insert(&msg.topic, msg.clone());
            if stored {
                self.store_retained(&msg.topic.clone(), Some(&**msg), stamp, now);
            }
        }
    }

    /// Whether `msg` may be kept as a retained message under the configured limits (a
    /// replacement of an existing topic always may, unless too large). Refusals are logged;
    /// the message is still delivered.
    fn retain_allowed(&mut self, msg: &Message) -> bool {
        let max_size = self.cfg.max_retained_size;
        let max_count = self.cfg.max_retained_messages;
        let why = if max_size > 0 && msg.payload.len() > max_size {
            "payload above max_retained_size"
        } else if max_count > 0
            && self.retained.len() >= max_count
            && self.retained.get(&msg.topic).is_none()
        {
            "max_retained_messages reached"
        } else {
            return true;
        };
        let topic = String::from_utf8_lossy(&msg.topic).into_owned();
        self.event("retained_refused", Arc::from(""), format!("{topic}: {why}"));
        false
    }

    /// Sends `msg` to session `sid` now if it can go, else queues it (bounded). A QoS 0
    /// message that goes now is encoded straight from the shared message. Returns false
    /// when the session may not read the topic (or is gone).
    pub(super) fn deliver(
        &mut self,
        sid: SessionId,
        msg: &Arc<Message>,
        qos: QoS,
        retain: bool,
        sub_ids: Vec<u32>,
        now: u64,
    ) -> bool {
        if msg.id != 0 && self.seen_since_move(sid, msg.id, now) {
            // It reached the session along another path already.
            return true;
        }
        let window = self.window(sid);
        let Some(session) = self.session(sid) else {
            return false;
        };
        if let Some(perms) = session.read_check() {
            if !perms.allows(acl::READ, &msg.topic) {
                return false;
            }
        }
        let conn = session.conn;
        let can_send = match (conn, window) {
            (Some(_), Some(free)) => {
                session.queue.is_empty() && (qos == QoS::AtMostOnce || free > 0)
            }
            _ => false,
        };
        if can_send && qos == QoS::AtMostOnce {
            let cid = conn.expect("checked");
            if !msg.expired(now)
                && !self.send_publish(cid, msg, qos, retain, &sub_ids, 0, false, now)
            {
                self.stats.publish_dropped += 1;
            }
            return true;
        }
        if conn.is_none() && qos == QoS::AtMostOnce {
            // Offline sessions keep QoS 1/2 only (MQTT 3.1.1 4.4, like Mosquitto's default).
            return true;
        }
        let d = Delivery {
            msg: msg.clone(),
            qos,
            retain,
            sub_ids,
            seq: 0,
        };
        if can_send {
            self.transmit(sid, conn.expect("checked"), d, now);
        } else {
            self.enqueue(sid, d);
        }
        true
    }

    /// Free in-flight slots when `sid`'s connection may be written to now, else None.
    fn window(&self, sid: SessionId) -> Option<usize> {
        let session = self.session(sid)?;
        if session.recent.as_ref().is_some_and(|r| r.holds()) {
            // Waiting for older messages kept for its dead home (`cluster_kept`), or relayed
            // by the live home it came from (`cluster_relay_order`).
            return None;
        }
        if self.unconfirmed(sid) {
            // Waiting for its owners' word after a split or a restart: what their side kept
            // for it (held meanwhile) goes to the client first, in publishing order, with
            // its queue (`confirm`).
            return None;
        }
        let conn = self.conn(session.conn?)?;
        if !conn.writable || conn.state != ConnState::Active {
            return None;
        }
        let cap = usize::from(conn.client_receive_max.min(self.cfg.max_inflight));
        Some(cap.saturating_sub(session.inflight.len()))
    }

    fn enqueue(&mut self, sid: SessionId, mut d: Delivery) {
        let max_msgs = self.cfg.max_queued_messages;
        let max_bytes = self.cfg.max_queued_bytes;
        let mut dropped = 0;
        let session = self.session_mut(sid).expect("caller checked");
        let size = d.msg.payload.len();
        let full = |s: &super::state::Session| {
            s.queue.len() >= max_msgs || (max_bytes > 0 && s.queued_bytes + size > max_bytes)
        };
        if full(session) && d.qos != QoS::AtMostOnce {
            // Make room by dropping queued QoS 0 first.
            while full(session) {
                let Some(i) = session.queue.iter().position(|q| q.qos == QoS::AtMostOnce) else {
                    break;
                };
                let old = session.queue.remove(i).expect("index valid");
                session.queued_bytes -= old.msg.payload.len();
                dropped += 1;
            }
        }
        if full(session) {
            dropped += 1;
            if d.qos != QoS::AtMostOnce {
                self.quota_drops += 1;
            }
        } else {
            self.store_delivery(sid, &mut d, self.last_now);
            let session = self.session_mut(sid).expect("caller checked");
            session.queued_bytes += size;
            session.queue.push_back(d);
        }
        self.stats.publish_dropped += dropped;
    }

    /// Sends queued messages while the window and the transport allow, up to PUMP_BUDGET
    /// bytes of output; `drain` continues a pump that stopped at the budget.
    pub(super) fn pump(&mut self, sid: SessionId, now: u64) {
        loop {
            let Some(free) = self.window(sid) else { return };
            let session = self.session_mut(sid).expect("window checked");
            if session.queue.is_empty() {
                return;
            }
            let cid = session.conn.expect("window checked");
            if self.conn(cid).is_some_and(|c| c.out.len() >= PUMP_BUDGET) {
                // A long queue (a resumed slow subscriber) is sent over several loop
                // iterations, so other clients' reads and writes go on in between.
                let session = self.session_mut(sid).expect("window checked");
                if !session.pump_pending {
                    session.pump_pending = true;
                    self.pending_pump.push(sid);
                }
                return;
            }
            let session = self.session_mut(sid).expect("window checked");
            let Some(front) = session.queue.front() else {
                return;
            };
            if front.qos != QoS::AtMostOnce && free == 0 {
                return;
            }
            let d = session.queue.pop_front().expect("front exists");
            session.queued_bytes -= d.msg.payload.len();
            if d.msg.expired(now) {
                self.forget_delivery(sid, d.seq);
                continue;
            }
            self.transmit(sid, cid, d, now);
        }
    }

    /// Puts `d` on the wire for connection `cid` of session `sid`, in flight if QoS > 0.
    fn transmit(&mut self, sid: SessionId, cid: ConnId, mut d: Delivery, now: u64) {
        if d.msg.expired(now) {
            self.forget_delivery(sid, d.seq);
            return;
        }
        // Stored (with its packet id, below) before the PUBLISH can reach the network.
        let mark = self.wait_mark();
        let from = self.conn(cid).map_or(0, |c| c.out.len());
        self.store_delivery(sid, &mut d, now);
        let pkid = if d.qos == QoS::AtMostOnce {
            0
        } else {
            self.session_mut(sid).expect("exists").alloc_pkid()
        };
        if !self.send_publish(cid, &d.msg, d.qos, d.retain, &d.sub_ids, pkid, false, now) {
            // Too large for this client: dropped as if delivered (MQTT-3.1.2-25).
            self.stats.publish_dropped += 1;
            self.forget_delivery(sid, d.seq);
            return;
        }
        if d.qos != QoS::AtMostOnce {
            let state = if d.qos == QoS::AtLeastOnce {
                AwaitingAck::PubAck
            } else {
                AwaitingAck::PubRec
            };
            self.store_flight(sid, d.seq, pkid, state);
            if d.qos == QoS::ExactlyOnce {
                self.gate_output(cid, from, mark);
            }
            self.session_mut(sid)
                .expect("exists")
                .push_inflight(Inflight {
                    pkid,
                    state,
                    delivery: d,
                });
        }
    }

    /// Encodes one PUBLISH of `msg` onto `cid`'s output, with this connection's topic alias
    /// and the remaining expiry. Returns false if it exceeds the client's maximum size.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn send_publish(
        &mut self,
        cid: ConnId,
        msg: &Message,
        qos: QoS,
        retain: bool,
        sub_ids: &[u32],
        pkid: u16,
        dup: bool,
        now: u64,
    ) -> bool {
        let alias_enabled = self.cfg.outgoing_topic_aliases;
        let Some(conn) = self.conns.get_mut(cid as usize) else {
            return false;
        };
        let v5 = conn.protocol == Protocol::V5;
        let mut topic: &[u8] = &msg.topic;
        let mut alias = None;
        let mut new_alias = false;
        if v5 && alias_enabled && conn.client_topic_alias_max > 0 {
            let max = conn.client_topic_alias_max;
            let outgoing = &mut conn.aliases.get_or_insert_with(Default::default).outgoing;
            match outgoing.get(&msg.topic) {
                Some(&a) => {
                    alias = Some(a);
                    topic = b"";
                }
                None => {
                    let next = outgoing.len() as u16 + 1;
                    if next <= max {
                        outgoing.insert(msg.topic.clone(), next);
                        alias = Some(next);
                        new_alias = true;
                    }
                }
            }
        }
        let packet = PublishOut {
            dup,
            qos,
            retain,
            topic,
            pkid,
            properties: msg.props.as_deref(),
            // Remaining whole seconds, rounded up so a live message never says 0.
            message_expiry: msg
                .expires_at
                .map(|at| at.saturating_sub(now).div_ceil(1000) as u32),
            topic_alias: alias,
            subscription_ids: sub_ids,
            payload: &msg.payload,
        };
        let start = conn.out.len();
        let fits = codec::encode_publish(&packet, conn.protocol, &mut conn.out).is_ok()
            && conn.out.len() - start <= conn.client_max_packet as usize;
        if !fits {
            conn.out.truncate(start);
            if new_alias {
                // An alias assigned for a message that was not sent must not be assumed known.
                if let Some(aliases) = conn.aliases.as_mut() {
                    aliases.outgoing.remove(&msg.topic);
                }
            }
            return false;
        }
        self.stats.messages_sent += 1;
        self.mark_dirty(cid);
        true
    }
}

fn message_of(p: Publish, origin: SessionId, now: u64) -> Message {
    let expires_at = p
        .props()
        .message_expiry_interval
        .map(|s| now + 1000 * u64::from(s));
    let (topic, payload) = compact(&p.topic, p.payload);
    Message {
        topic,
        payload,
        qos: p.qos,
        retain: p.retain,
        props: p.properties.and_then(forwarded_props),
        expires_at,
        origin,
        id: 0,
    }
}

/// Output a pump may add to one connection between two drains.
pub(super) const PUMP_BUDGET: usize = 512 * 1024;

/// Below this size a payload is copied out of the read buffer it was parsed from.
const COPY_PAYLOAD_BELOW: usize = 64 * 1024;

/// Topic and payload in one allocation of their own: a message that is queued or retained
/// must not pin the whole read buffer its bytes were sliced from. Large payloads fill most
/// of their buffer anyway, so they stay where they are.
fn compact(topic: &Bytes, payload: Bytes) -> (Bytes, Bytes) {
    if payload.len() >= COPY_PAYLOAD_BELOW {
        return (Bytes::copy_from_slice(topic), payload);
    }
    let mut buf = bytes::BytesMut::with_capacity(topic.len() + payload.len());
    buf.extend_from_slice(topic);
    buf.extend_from_slice(&payload);
    let buf = buf.freeze();
    (buf.slice(..topic.len()), buf.slice(topic.len()..))
}
