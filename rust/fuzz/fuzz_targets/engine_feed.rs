//! Arbitrary byte streams into the broker engine itself, not just the codec: up to four
//! connections fed bytes in arbitrary pieces, with time passing, peer closes, slow
//! consumers, failed store writes, authentication answers, interception verdicts and
//! permission changes in between. The engine must never panic, and every byte it asks to
//! be written must be whole, well-formed MQTT packets.
//!
//! Input layout (so that a valid MQTT session stays a contiguous run of bytes the fuzzer
//! can mutate):
//!
//! - byte 0 picks the engine's limits, byte 1 its features (see `config`);
//! - then operations, each one byte `op` (connection `op & 3`, kind `op >> 6`, argument
//!   `(op >> 2) & 15`) and its operands:
//!   - kinds 0 and 1: feed the next `arg * 256 + next byte` bytes to the connection (held
//!     back while the engine holds the connection, as a caller that stopped reading would);
//!   - kind 2: the clock moves `(arg + 1) * next byte * 64` ms, then the engine's tick;
//!   - kind 3: what the caller does, by `arg` (see `caller`).
//!
//! After every operation the output is drained as a real caller would: store batches are
//! taken, connections the engine closes are reported closed and replaced, and held
//! connections it resumes get what was held back.

#![no_main]

use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use fastbroker_core::broker::{
    AuthRequest, Config, ConnId, Engine, Intercepted, Permissions, Verdict, FEED_HOLD,
};
use fastbroker_core::codec::{decode, Protocol, QoS};
use libfuzzer_sys::fuzz_target;

const CONNS: usize = 4;

/// Engine limits (`limits`) and features (`features`): small values and optional features
/// each half the time, so that short inputs reach every limit.
fn config(limits: u8, features: u8) -> Config {
    let mut cfg = Config::default();
    if limits & 1 != 0 {
        cfg.max_packet_size = 200;
    }
    cfg.durable = limits & 2 != 0;
    if limits & 4 != 0 {
        cfg.max_inflight = 2;
        cfg.receive_maximum = 2;
        cfg.max_queued_messages = 3;
        cfg.max_queued_bytes = 64;
    }
    if limits & 8 != 0 {
        cfg.topic_alias_maximum = 0;
        cfg.outgoing_topic_aliases = false;
    }
    if limits & 16 != 0 {
        cfg.maximum_qos = 1;
        cfg.retain_available = false;
    }
    if limits & 32 != 0 {
        cfg.max_keepalive = 10;
        cfg.max_session_expiry = 30;
        cfg.max_client_id_len = 8;
    }
    if limits & 64 != 0 {
        cfg.max_retained_messages = 2;
        cfg.max_retained_size = 8;
        cfg.denied_subscriptions = vec!["secret/#".to_string()];
    }
    cfg.connect_timeout_ms = 2_000;
    cfg.auth_required = features & 1 != 0;
    if features & 2 != 0 {
        cfg.intercept = true;
        cfg.max_intercepted = 2;
    }
    if features & 4 != 0 {
        cfg.max_publish_rate = 2;
    }
    if features & 8 != 0 {
        cfg.max_connections = 2;
    }
    if features & 16 != 0 {
        cfg.max_conn_buffer = 32;
    }
    cfg
}

/// Permissions of a restricted user: everything under `a/`, reading under `r/`.
fn restricted() -> Arc<Permissions> {
    let rules = vec![(1 | 2 | 4, "a/#".to_string()), (2 | 4, "r/#".to_string())];
    Arc::new(Permissions::new(rules).expect("valid rules"))
}

/// Whether `out` is a run of whole packets in one protocol version (the connection's; the
/// harness does not track which it negotiated).
fn well_formed(out: &[u8]) -> bool {
    [Protocol::V5, Protocol::V311].into_iter().any(|protocol| {
        let mut buf = BytesMut::from(out);
        loop {
            match decode(&mut buf, protocol, usize::MAX) {
                Ok(Some(_)) => {}
                Ok(None) => return buf.is_empty(),
                Err(_) => return false,
            }
        }
    })
}

struct Harness {
    engine: Engine,
    conns: [ConnId; CONNS],
    /// Bytes not fed to a held connection yet (`Some` while it is held).
    held_back: [Option<Vec<u8>>; CONNS],
    auth_requests: Vec<AuthRequest>,
    intercepted: Vec<Intercepted>,
    now: u64,
}

impl Harness {
    fn slot(&self, id: ConnId) -> Option<usize> {
        self.conns.iter().position(|&c| c == id)
    }

    fn feed(&mut self, slot: usize, data: &[u8]) {
        if let Some(back) = &mut self.held_back[slot] {
            back.extend_from_slice(data);
            return;
        }
        if self.engine.feed(self.conns[slot], data, self.now) & FEED_HOLD != 0 {
            self.held_back[slot] = Some(Vec::new());
        }
    }

    /// The peer of `slot` went away; a new connection takes its place.
    fn replace(&mut self, slot: usize) {
        self.conns[slot] = self.engine.open(self.now);
        self.held_back[slot] = None;
    }

    /// Hands the output to the "sockets", as the server's loop does after every read.
    fn drain(&mut self) {
        // Bounded: each drain may leave a budget-limited pump's output for the next one.
        for _ in 0..64 {
            if self.engine.has_store_ops() {
                // The caller writes store batches before draining acknowledgements.
                drop(self.engine.take_store_ops());
            }
            self.auth_requests.extend(self.engine.take_auth_requests());
            self.intercepted.extend(self.engine.take_intercepted());
            for id in self.engine.take_resumed() {
                if let Some(slot) = self.slot(id) {
                    if let Some(back) = self.held_back[slot].take() {
                        self.feed(slot, &back);
                    }
                }
            }
            if !self.engine.has_output() && !self.engine.has_resumed() {
                break;
            }
            let mut closing = Vec::new();
            self.engine.drain(|id, out, close| {
                assert!(well_formed(out), "engine wrote a broken packet: {out:02x?}");
                if close != 0 {
                    closing.push(id);
                }
            });
            for id in closing {
                self.engine.closed(id, self.now);
                if let Some(slot) = self.slot(id) {
                    self.replace(slot);
                }
            }
        }
        drop(self.engine.take_events());
        drop(self.engine.take_access_events());
    }

    /// Caller actions (kind 3), by `arg`.
    fn caller(&mut self, slot: usize, arg: u8) {
        let now = self.now;
        let conn = self.conns[slot];
        match arg {
            0 => {
                self.engine.closed(conn, now);
                self.replace(slot);
            }
            1 | 2 => self.engine.set_writable(conn, arg == 2, now),
            // The engine closes the publishers itself; the ids are for the caller's logs.
            3 => drop(self.engine.store_failed(now)),
            4..=7 => {
                for req in std::mem::take(&mut self.auth_requests) {
                    match arg {
                        4 => self
                            .engine
                            .auth_done(req.conn, 0, None, now, None, None, None),
                        5 => {
                            let perms = Some(restricted());
                            let data = Some(Bytes::from_static(b"server-final"));
                            let method = req.auth_method.clone();
                            self.engine
                                .auth_done(req.conn, 0, perms, now, method, data, None);
                        }
                        6 => {
                            let why = Some("bad password".to_string());
                            self.engine
                                .auth_done(req.conn, 0x86, None, now, None, None, why);
                        }
                        _ => {
                            let method = req.auth_method.clone().unwrap_or_default();
                            let data = Some(Bytes::from_static(b"challenge"));
                            self.engine.auth_continue(req.conn, method, data, now);
                        }
                    }
                }
            }
            8..=12 => {
                for msg in std::mem::take(&mut self.intercepted) {
                    let (verdict, topic) = match arg {
                        8 => (Verdict::Route, None),
                        9 => (Verdict::Drop, None),
                        10 => (Verdict::Deny, None),
                        11 => (Verdict::Route, Some("a/rewritten")),
                        _ => (Verdict::Route, Some("bad/#")),
                    };
                    let payload = topic.map(|_| Bytes::from_static(b"rewritten"));
                    self.engine
                        .release(msg.ticket, verdict, topic, payload, now);
                }
            }
            13 => self.engine.set_permissions(conn, Some(restricted())),
            14 => self.engine.set_permissions(conn, None),
            _ => self
                .engine
                .publish("a/sys", b"broker", QoS::AtLeastOnce, true, now),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let [limits, features, ref ops @ ..] = *data else {
        return;
    };
    let mut ops = ops;
    let mut engine = Engine::new(config(limits, features));
    let now = 1_000;
    let conns = [(); CONNS].map(|()| engine.open(now));
    let mut h = Harness {
        engine,
        conns,
        held_back: Default::default(),
        auth_requests: Vec::new(),
        intercepted: Vec::new(),
        now,
    };

    while let Some((&op, rest)) = ops.split_first() {
        ops = rest;
        let slot = usize::from(op & 3);
        let arg = (op >> 2) & 15;
        match op >> 6 {
            0 | 1 => {
                let Some((&low, rest)) = ops.split_first() else {
                    break;
                };
                let len = (usize::from(arg) << 8 | usize::from(low)).min(rest.len());
                let (piece, rest) = rest.split_at(len);
                ops = rest;
                h.now += 1;
                h.feed(slot, piece);
            }
            2 => {
                let Some((&step, rest)) = ops.split_first() else {
                    break;
                };
                ops = rest;
                h.now += (u64::from(arg) + 1) * u64::from(step) * 64;
                h.engine.tick(h.now);
            }
            _ => h.caller(slot, arg),
        }
        h.drain();
    }
    // Everyone leaves and every question is answered; the engine must end consistent.
    h.caller(0, 4);
    h.caller(0, 8);
    for id in h.conns {
        h.engine.closed(id, h.now);
    }
    h.now += 1_000_000;
    h.engine.tick(h.now);
    h.drain();
});
