//! Message interception (config `intercept`): client publishes that passed every check wait
//! in a queue for the caller (a plugin), who routes, rewrites, drops or denies each one with
//! `release`. The QoS 1 PUBACK / QoS 2 PUBREC goes out on release, so an acknowledgement
//! still means the message was handled.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;

use super::state::{ConnId, Message, SessionId, BROKER_ORIGIN};
use super::Engine;
use crate::codec::{Packet, Protocol, QoS};

/// A publish waiting for the caller's decision.
pub(super) struct Pending {
    conn: ConnId,
    /// The connection's serial: the id may be reused once it closes.
    serial: u64,
    sid: SessionId,
    client_id: Arc<str>,
    username: Option<Arc<str>>,
    pkid: u16,
    v5: bool,
    msg: Message,
}

/// An intercepted publish as the caller sees it.
pub struct Intercepted {
    pub ticket: u64,
    pub conn: ConnId,
    pub client_id: Arc<str>,
    pub username: Option<Arc<str>>,
    pub topic: Bytes,
    pub payload: Bytes,
    pub qos: u8,
    pub retain: bool,
}

/// What the caller decided about an intercepted publish.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Route it (possibly rewritten).
    Route,
    /// Drop it; the publisher is told it succeeded.
    Drop,
    /// Refuse it: MQTT 5 acknowledgements carry 0x87, 3.1.1 ones are positive.
    Deny,
}

#[derive(Default)]
pub(super) struct InterceptQueue {
    next_ticket: u64,
    pending: HashMap<u64, Pending>,
    /// Tickets not yet taken by the caller, in arrival order.
    new: Vec<u64>,
}

impl InterceptQueue {
    pub(super) fn len(&self) -> usize {
        self.pending.len()
    }
}

impl Engine {
    /// Queues a client publish (checks passed) instead of routing it. For QoS 2 the packet
    /// id is held by the session at once, so a resend is recognised.
    pub(super) fn intercept(&mut self, id: ConnId, sid: SessionId, msg: Message, pkid: u16) {
        let conn = self.conn_mut(id).expect("caller checked");
        conn.intercepted += 1;
        let pending = Pending {
            conn: id,
            serial: conn.serial,
            sid,
            client_id: conn.client_id.clone(),
            username: conn.username.clone(),
            pkid,
            v5: conn.protocol == Protocol::V5,
            msg,
        };
        if pending.msg.qos == QoS::ExactlyOnce {
            let session = self.session_mut(sid).expect("exists");
            session.inbound_qos2.insert(pkid);
            session.rare_mut().intercepting.push(pkid);
        }
        let q = &mut self.intercepted;
        q.next_ticket += 1;
        let ticket = q.next_ticket;
        q.pending.insert(ticket, pending);
        q.new.push(ticket);
    }

    pub fn has_intercepted(&self) -> bool {
        !self.intercepted.new.is_empty()
    }

    /// Publishes intercepted since the last call, in arrival order.
    pub fn take_intercepted(&mut self) -> Vec<Intercepted> {
        let tickets = std::mem::take(&mut self.intercepted.new);
        let pending = &self.intercepted.pending;
        tickets
            .into_iter()
            .filter_map(|ticket| {
                let p = pending.get(&ticket)?;
                Some(Intercepted {
                    ticket,
                    conn: p.conn,
                    client_id: p.client_id.clone(),
                    username: p.username.clone(),
                    topic: p.msg.topic.clone(),
                    payload: p.msg.payload.clone(),
                    qos: p.msg.qos as u8,
                    retain: p.msg.retain,
                })
            })
            .collect()
    }

    /// The caller's decision on `ticket`; `topic` / `payload` replace the message's when
    /// given (an invalid topic denies it). Unknown tickets are ignored. A message whose
    /// publisher has gone is still routed (at least once).
    pub fn release(
        &mut self,
        ticket: u64,
        verdict: Verdict,
        topic: Option<&str>,
        payload: Option<Bytes>,
        now: u64,
    ) {
        self.last_now = now;
        let Some(mut p) = self.intercepted.pending.remove(&ticket) else {
            return;
        };
        self.intercepted.new.retain(|&t| t != ticket);
        let mut verdict = verdict;
        if let Some(topic) = topic {
            if crate::topics::valid_topic_name(topic.as_bytes()) {
                p.msg.topic = Bytes::copy_from_slice(topic.as_bytes());
            } else {
                verdict = Verdict::Deny;
            }
        }
        if let Some(payload) = payload {
            p.msg.payload = payload;
        }
        // Where the acknowledgement goes: the publishing connection if it is still there;
        // for QoS 2, else the session's new connection (the client resent the packet id
        // there and waits for PUBREC).
        let live = self
            .conn(p.conn)
            .is_some_and(|c| c.serial == p.serial && c.session == Some(p.sid));
        if live {
            let conn = self.conn_mut(p.conn).expect("checked");
            conn.intercepted -= 1;
        }
        let session_same = self
            .session(p.sid)
            .is_some_and(|s| Arc::ptr_eq(&s.client_id, &p.client_id));
        let qos = p.msg.qos;
        if session_same && qos == QoS::ExactlyOnce {
            let s = self.session_mut(p.sid).expect("checked");
            if let Some(rare) = s.rare.as_mut() {
                if let Some(i) = rare.intercepting.iter().position(|&k| k == p.pkid) {
                    rare.intercepting.swap_remove(i);
                }
            }
        }
        let ack_to = if live {
            Some(p.conn)
        } else if session_same && qos == QoS::ExactlyOnce {
            self.session(p.sid).and_then(|s| s.conn)
        } else {
            None
        };
        let v5 = ack_to
            .and_then(|c| self.conn(c))
            .map_or(p.v5, |c| c.protocol == Protocol::V5);
        let routed = matches!(verdict, Verdict::Route);
        self.replicas.start();
        let code = match verdict {
            Verdict::Route => {
                if !session_same {
                    p.msg.origin = BROKER_ORIGIN;
                }
                let ops_before = self.store_ops.len();
                let drops_before = self.quota_drops;
                if qos == QoS::ExactlyOnce && session_same {
                    self.store_inbound(p.sid, p.pkid, true);
                }
                let delivered = self.route(Arc::new(p.msg), now);
                if let Some(c) = ack_to {
                    self.note_publisher(c, ops_before);
                }
                self.publish_result(v5, delivered, drops_before)
            }
            Verdict::Drop => 0,
            Verdict::Deny => {
                self.stats.publish_denied += 1;
                if v5 {
                    0x87
                } else {
                    0
                }
            }
        };
        if qos == QoS::ExactlyOnce && code >= 0x80 && session_same {
            // A failed PUBREC ends the exchange (MQTT 5 4.3.3): no PUBREL will come.
            if let Some(s) = self.session_mut(p.sid) {
                s.inbound_qos2.remove(&p.pkid);
            }
            self.store_inbound(p.sid, p.pkid, false);
        }
        if let Some(c) = ack_to {
            let packet = match qos {
                QoS::AtMostOnce => None,
                QoS::AtLeastOnce => Some(Packet::PubAck(Engine::ack(p.pkid, code))),
                QoS::ExactlyOnce => Some(Packet::PubRec(Engine::ack(p.pkid, code))),
            };
            match (packet, routed) {
                // Held, like any routed publish, until the other nodes have it.
                (Some(packet), true) => self.ack_publish(c, packet),
                (Some(packet), false) => {
                    self.send(c, &packet);
                }
                (None, _) => {}
            }
        }
        if live {
            let max = self.cfg.max_intercepted;
            if self
                .conn(p.conn)
                .is_some_and(|c| c.held && (c.intercepted as usize) < max)
            {
                self.run(p.conn, now);
            }
        }
    }
}
