//! SUBSCRIBE and UNSUBSCRIBE: filter checks, the authorization hook, a reason code per
//! filter, and retained messages sent on subscribe.

use std::sync::Arc;

use super::acl;
use super::state::Message;
use super::{ConnId, Engine};
use crate::codec::{Packet, Protocol, QoS, SubAck, Subscribe, UnsubAck, Unsubscribe};
use crate::topics::{self, SubOpts};

impl Engine {
    pub(super) fn handle_subscribe(&mut self, id: ConnId, s: Subscribe, now: u64) {
        let conn = self.conn(id).expect("caller checked");
        let v5 = conn.protocol == Protocol::V5;
        let sid = conn.session.expect("active connection has a session");
        let permissions = conn.permissions.clone();
        let client = conn.client_id.clone();
        let mut needs_read_check = false;
        let identifier = s
            .props()
            .subscription_identifiers
            .first()
            .copied()
            .unwrap_or(0);
        let mut codes = Vec::with_capacity(s.filters.len());
        // Retained messages to send after the SUBACK: (filter, options).
        let mut retained_for = Vec::new();
        for f in &s.filters {
            if !topics::valid_filter(&f.filter) {
                codes.push(if v5 { 0x8F } else { 0x80 });
                continue;
            }
            let shared = topics::split_shared(&f.filter);
            if shared.is_some() && f.no_local {
                // MQTT-3.8.3-4: No Local on a shared subscription is a protocol error.
                return self.close(
                    id,
                    Some(0x82),
                    "no local on a shared subscription",
                    true,
                    now,
                );
            }
            if self.denied(&f.filter) {
                codes.push(if v5 { 0x87 } else { 0x80 });
                continue;
            }
            if let Some(perms) = &permissions {
                if !perms.covers(acl::SUBSCRIBE, &f.filter) {
                    self.stats.subscribe_denied += 1;
                    self.event("subscribe_denied", client.clone(), f.filter.clone());
                    codes.push(if v5 { 0x87 } else { 0x80 });
                    continue;
                }
                // Messages for a filter inside the READ rules need no check each.
                needs_read_check |= !perms.covers(acl::READ, &f.filter);
            }
            let granted = QoS::from_u8((f.qos as u8).min(self.cfg.maximum_qos)).expect("0..=2");
            let opts = SubOpts {
                qos: granted,
                no_local: f.no_local,
                retain_as_published: f.retain_as_published,
                retain_handling: f.retain_handling,
                identifier,
            };
            let is_new = self.index_subscribe(&f.filter, sid, opts);
            self.session_mut(sid)
                .expect("exists")
                .subs
                .insert(f.filter.clone(), opts);
            codes.push(granted as u8);
            // Retained messages are not sent for shared subscriptions (MQTT-3.8.4-4 note).
            let send_retained = shared.is_none()
                && match f.retain_handling {
                    0 => true,
                    1 => is_new,
                    _ => false,
                };
            if send_retained {
                retained_for.push((f.filter.clone(), opts));
            }
        }
        if needs_read_check {
            self.session_mut(sid)
                .expect("exists")
                .set_read_check(permissions);
        }
        self.persist_session(sid, now);
        self.send(
            id,
            &Packet::SubAck(SubAck {
                pkid: s.pkid,
                reason_codes: codes,
                properties: None,
            }),
        );
        for (filter, opts) in retained_for {
            let mut found: Vec<Arc<Message>> = Vec::new();
            self.retained
                .for_each_match(&filter, |m| found.push(m.clone()));
            for msg in found {
                if msg.expired(now) {
                    continue;
                }
                let qos = msg.qos.min(opts.qos);
                let sub_ids = super::router::sub_ids_of(&opts);
                // Retained messages sent on subscribe always carry the flag (MQTT-3.3.1-8).
                self.deliver(sid, &msg, qos, true, sub_ids, now);
            }
        }
    }

    pub(super) fn handle_unsubscribe(&mut self, id: ConnId, u: Unsubscribe) {
        let conn = self.conn(id).expect("caller checked");
        let v5 = conn.protocol == Protocol::V5;
        let sid = conn.session.expect("active connection has a session");
        let mut codes = Vec::with_capacity(u.filters.len());
        for filter in &u.filters {
            if !topics::valid_filter(filter) {
                codes.push(0x8F);
                continue;
            }
            let existed = self
                .session_mut(sid)
                .expect("exists")
                .subs
                .remove(filter)
                .is_some();
            self.index_unsubscribe(filter, sid);
            // 0x11: "no subscription existed".
            codes.push(if existed { 0x00 } else { 0x11 });
        }
        self.persist_session(sid, self.last_now);
        self.send(
            id,
            &Packet::UnsubAck(UnsubAck {
                pkid: u.pkid,
                reason_codes: if v5 { codes } else { Vec::new() },
                properties: None,
            }),
        );
    }

    /// The subscribe authorization hook: a filter is refused when a configured denied
    /// filter covers it (its levels read literally, so "secret/#" covers "secret/+/x").
    fn denied(&self, filter: &str) -> bool {
        let inner = topics::split_shared(filter).map_or(filter, |(_, f)| f);
        self.cfg
            .denied_subscriptions
            .iter()
            .any(|d| d == inner || topics::matches(d, inner.as_bytes()))
    }
}
