//! Overload protection inside the engine: per-connection publish rate, the interception
//! backlog bound and the connection cap. A limited connection is not refused or dropped: the
//! engine stops decoding its buffered bytes and tells the caller to stop reading it (FEED_HOLD),
//! so the client's TCP window fills; `take_resumed` lists it once it may be read again.

use super::state::{ConnId, ConnState};
use super::Engine;

/// `feed` result bit: stop reading this connection until `take_resumed` lists it.
pub const FEED_HOLD: u8 = 1;
/// `feed` result bit: the connection has sent at least one PUBLISH.
pub const FEED_PUBLISHER: u8 = 2;

/// Cost of one PUBLISH in thousandths of a token: integer refill without drift.
const TOKEN: u64 = 1000;

/// A token bucket of `rate` publishes per second with a burst of `rate` (at least 1).
#[derive(Debug)]
pub struct TokenBucket {
    milli: u64,
    last: u64,
}

impl TokenBucket {
    pub fn full(rate: u32, now: u64) -> TokenBucket {
        TokenBucket {
            milli: Self::capacity(rate),
            last: now,
        }
    }

    fn capacity(rate: u32) -> u64 {
        u64::from(rate.max(1)) * TOKEN
    }

    /// Adds what `now - last` ms earned: `rate` thousandths of a token per ms.
    pub fn refill(&mut self, rate: u32, now: u64) {
        let elapsed = now.saturating_sub(self.last);
        if elapsed > 0 {
            self.milli = self
                .milli
                .saturating_add(elapsed.saturating_mul(u64::from(rate)))
                .min(Self::capacity(rate));
            self.last = now;
        }
    }

    pub fn has_token(&self) -> bool {
        self.milli >= TOKEN
    }

    pub fn take(&mut self) {
        self.milli = self.milli.saturating_sub(TOKEN);
    }
}

impl Engine {
    /// Decodes and handles `id`'s buffered packets until they run out or a limit says wait.
    /// Returns the FEED_* bits. A held connection that runs dry is listed as resumed.
    pub(super) fn run(&mut self, id: ConnId, now: u64) -> u8 {
        let max_packet_size = self.cfg.max_packet_size as usize;
        loop {
            let Some(conn) = self.conn_mut(id) else {
                return 0;
            };
            let level = match conn.state {
                ConnState::Active => {
                    if conn.gated && self.must_wait(id, now) {
                        return self.hold(id);
                    }
                    None
                }
                // Before CONNECT is decoded, note its level: a bad one is answered in that
                // version.
                ConnState::AwaitConnect => crate::codec::connect_level(&conn.rx),
                ConnState::AuthContinue => None,
                ConnState::AwaitAuth | ConnState::AwaitClaim => return self.auth_wait(id),
                ConnState::Closing => return 0,
            };
            let conn = self.conn_mut(id).expect("checked above");
            let protocol = conn.protocol;
            match crate::codec::decode(&mut conn.rx, protocol, max_packet_size) {
                Ok(Some(packet)) => {
                    // Keep alive counts whole control packets, not bytes: a packet trickled
                    // in a byte at a time (slowloris) must not keep a connection alive.
                    conn.last_rx = now;
                    self.cluster.full_links.clear();
                    self.handle(id, packet, now);
                    if !self.cluster.full_links.is_empty() {
                        self.wait_for_links(id);
                    }
                }
                Ok(None) => {
                    let published = conn.published;
                    if conn.held {
                        self.unhold(id, now);
                    }
                    return if published { FEED_PUBLISHER } else { 0 };
                }
                Err(err) => {
                    self.decode_failed(id, err, level, now);
                    return 0;
                }
            }
        }
    }

    /// Whether the next packet of an Active, gated connection must wait: its interception
    /// backlog is full, or it is a PUBLISH and the rate bucket is empty.
    fn must_wait(&mut self, id: ConnId, now: u64) -> bool {
        let intercept = self.cfg.intercept;
        let max_intercepted = self.cfg.max_intercepted;
        let rate = self.cfg.max_publish_rate;
        let conn = self.conn_mut(id).expect("caller checked");
        if conn.link_wait {
            return true;
        }
        if intercept && conn.intercepted as usize >= max_intercepted {
            return true;
        }
        if let Some(bucket) = conn.bucket.as_mut() {
            if conn.rx.first().is_some_and(|b| b >> 4 == 3) {
                bucket.refill(rate, now);
                return !bucket.has_token();
            }
        }
        false
    }

    /// A connection waiting for an authentication decision buffers what it sends; past
    /// `max_conn_buffer` the caller is asked to stop reading it.
    fn auth_wait(&mut self, id: ConnId) -> u8 {
        let max = self.cfg.max_conn_buffer;
        let conn = self.conn(id).expect("caller checked");
        if conn.rx.len() > max || conn.held {
            self.hold(id)
        } else {
            0
        }
    }

    fn hold(&mut self, id: ConnId) -> u8 {
        let conn = self.conn_mut(id).expect("caller checked");
        let published = conn.published;
        if !conn.held {
            conn.held = true;
            self.held.push(id);
        }
        FEED_HOLD | if published { FEED_PUBLISHER } else { 0 }
    }

    fn unhold(&mut self, id: ConnId, now: u64) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        conn.held = false;
        // Silence while held was the broker's doing, not the client's.
        conn.last_rx = now;
        self.held.retain(|&h| h != id);
        self.resumed.push(id);
    }

    /// Forgets that `id` is held (it is closing): it is not listed as resumed.
    pub(super) fn drop_hold(&mut self, id: ConnId) {
        if let Some(conn) = self.conn_mut(id) {
            if conn.held {
                conn.held = false;
                self.held.retain(|&h| h != id);
            }
        }
    }

    /// Tries the held connections again (tokens come back with time).
    pub(super) fn retry_held(&mut self, now: u64) {
        if self.held.is_empty() {
            return;
        }
        for id in self.held.clone() {
            if self
                .conn(id)
                .is_some_and(|c| c.state == ConnState::Active && c.held)
            {
                self.run(id, now);
            }
        }
    }

    /// Held connections that may be read again, since the last call.
    pub fn take_resumed(&mut self) -> Vec<ConnId> {
        std::mem::take(&mut self.resumed)
    }

    pub fn has_resumed(&self) -> bool {
        !self.resumed.is_empty()
    }

    /// Whether a CONNECT for `client_id` finds the broker full: `max_connections` Active
    /// connections, not counting a takeover of this client's own connection.
    pub(super) fn at_connection_limit(&self, client_id: &str) -> bool {
        let max = self.cfg.max_connections;
        if max == 0 || self.active_conns < max {
            return false;
        }
        let takeover = self
            .by_client
            .get(client_id)
            .and_then(|&sid| self.session(sid))
            .is_some_and(|s| s.conn.is_some());
        !takeover
    }

    /// Whether `id` is checked before each packet: rate limit, interception, a full link.
    pub(super) fn regate(&mut self, id: ConnId) {
        let intercept = self.cfg.intercept;
        if let Some(conn) = self.conn_mut(id) {
            conn.gated = conn.bucket.is_some() || intercept || conn.link_wait;
        }
    }

    /// Per-connection limits an accepted connection starts with.
    pub(super) fn arm_limits(&mut self, id: ConnId, now: u64) {
        let rate = self.cfg.max_publish_rate;
        let intercept = self.cfg.intercept;
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        if rate > 0 {
            conn.bucket = Some(Box::new(TokenBucket::full(rate, now)));
        }
        conn.gated = rate > 0 || intercept;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_bursts_then_refills_at_the_rate() {
        let mut b = TokenBucket::full(10, 0);
        for _ in 0..10 {
            assert!(b.has_token());
            b.take();
        }
        assert!(!b.has_token());
        b.refill(10, 99);
        assert!(!b.has_token(), "0.99 of a token after 99 ms at 10/s");
        b.refill(10, 100);
        assert!(b.has_token());
        b.take();
        assert!(!b.has_token());
        // A long pause earns no more than the burst.
        b.refill(10, 1_000_000);
        for _ in 0..10 {
            assert!(b.has_token());
            b.take();
        }
        assert!(!b.has_token());
    }

    #[test]
    fn bucket_rate_below_one_burst_still_allows_one() {
        // Rate 1/s: burst 1, then one more a second later.
        let mut b = TokenBucket::full(1, 0);
        assert!(b.has_token());
        b.take();
        b.refill(1, 999);
        assert!(!b.has_token());
        b.refill(1, 1000);
        assert!(b.has_token());
        // Time going backwards (caller's clock) earns nothing and does not panic.
        b.take();
        b.refill(1, 10);
        assert!(!b.has_token());
        b.refill(u32::MAX, u64::MAX);
        assert!(b.has_token());
    }
}
