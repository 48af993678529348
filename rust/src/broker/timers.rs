//! Time: connect and keepalive timeouts, delayed wills, session expiry, expired retained
//! messages. Called by the caller's periodic tick, never per message.

use super::state::{ConnId, ConnState, SessionId};
use super::Engine;

/// How often expired retained messages are purged (they are skipped on delivery anyway).
const RETAINED_PURGE_MS: u64 = 10_000;

impl Engine {
    /// Drops expired messages from the queues of offline sessions (connected ones drop them
    /// as they are sent), so they leave memory and the store.
    fn purge_expired_queued(&mut self, now: u64) {
        let mut forgotten: Vec<(SessionId, u64)> = Vec::new();
        for (i, s) in self.sessions.iter_mut() {
            if s.conn.is_some() || !s.queue.iter().any(|d| d.msg.expired(now)) {
                continue;
            }
            let mut freed = 0;
            s.queue.retain(|d| {
                if d.msg.expired(now) {
                    freed += d.msg.payload.len();
                    forgotten.push((i as SessionId, d.seq));
                    false
                } else {
                    true
                }
            });
            s.queued_bytes -= freed;
        }
        for (sid, seq) in forgotten {
            self.forget_delivery(sid, seq);
        }
    }

    pub fn tick(&mut self, now: u64) {
        self.observe_time(now);
        self.claims_tick(now);
        self.registry_tick(now);
        self.replicas_tick(now);
        self.wills_tick(now);
        self.kept_holds_tick(now);
        self.kept_asks_tick(now);
        let connect_timeout = self.cfg.connect_timeout_ms;
        let mut to_close: Vec<(ConnId, bool)> = Vec::new();
        for (i, conn) in self.conns.iter() {
            match conn.state {
                // Pending authentication counts: until CONNACK, the connect timeout applies.
                ConnState::AwaitConnect
                | ConnState::AwaitAuth
                | ConnState::AuthContinue
                | ConnState::AwaitClaim
                    if now.saturating_sub(conn.opened_at) >= connect_timeout =>
                {
                    to_close.push((i as ConnId, false));
                }
                // MQTT-3.1.2-24: one and a half times the keepalive without a packet. A held
                // connection is silent because the broker stopped reading it.
                ConnState::Active
                    if conn.keep_alive_ms > 0
                        && !conn.held
                        && now.saturating_sub(conn.last_rx)
                            >= u64::from(conn.keep_alive_ms) * 3 / 2 =>
                {
                    to_close.push((i as ConnId, true));
                }
                _ => {}
            }
        }
        for (id, active) in to_close {
            if active {
                // 0x8D: keep alive timeout; the will is published (abnormal end).
                self.close(id, Some(0x8D), "keep alive timeout", true, now);
            } else {
                self.close(id, None, "connect timeout", false, now);
            }
        }
        self.retry_held(now);
        self.expire_quarantine(now);

        let mut wills = Vec::new();
        let mut expired: Vec<SessionId> = Vec::new();
        for (i, s) in self.sessions.iter() {
            let Some(since) = s.disconnected_at else {
                continue;
            };
            if s.conn.is_some() {
                continue;
            }
            if let Some((_, at)) = s.pending_will() {
                if now >= *at {
                    wills.push(i as SessionId);
                }
            }
            if s.expiry != u32::MAX && now >= since + 1000 * u64::from(s.expiry) {
                expired.push(i as SessionId);
            }
        }
        if !wills.is_empty() && self.wills_wait(now) {
            // Those of sessions copied to other nodes wait until this one is in touch with
            // them: the session may have moved on meanwhile (it is fenced, will and all).
            wills.retain(|&sid| self.session(sid).is_some_and(|s| s.stamp.is_none()));
        }
        for sid in wills {
            if let Some((will, _)) = self.session_mut(sid).and_then(|s| s.take_pending_will()) {
                self.publish_will(*will, sid, now);
                self.persist_session(sid, now);
            }
        }
        for sid in expired {
            self.end_session(sid, now);
        }

        if now >= self.last_purge + RETAINED_PURGE_MS {
            self.last_purge = now;
            let mut gone = Vec::new();
            self.retained.retain(|m| {
                let expired = m.expired(now);
                if expired {
                    gone.push(m.topic.clone());
                }
                !expired
            });
            for topic in gone {
                if !topic.starts_with(b"$SYS") {
                    // Expired on every node alike: no tombstone, and the stamp goes too.
                    self.cluster.retained.forget(&topic);
                    self.store_retained(&topic, None, None, now);
                }
            }
            self.purge_expired_queued(now);
        }
    }
}
