//! The sans-I/O broker engine: every MQTT rule a broker follows, with no sockets and no clock
//! of its own. The caller reports connections, bytes and time; the engine answers with bytes
//! to write and connections to close (`drain`).
//!
//! One `feed` handles all packets in the bytes given; publishes are parsed, matched, and
//! encoded for every subscriber without returning to the caller, so the caller's cost is per
//! read, not per message.

pub mod acl;
mod auth;
mod cluster;
mod cluster_authority;
mod cluster_gates;
mod cluster_kept;
mod cluster_kept_store;
mod cluster_leave;
mod cluster_registry;
mod cluster_relay_order;
mod cluster_replicas;
mod cluster_retained;
mod cluster_sessions;
mod cluster_streams;
#[cfg(test)]
mod cluster_tests;
mod cluster_took_routed;
mod cluster_wills;
mod config;
mod connect;
mod durable;
#[cfg(test)]
mod durable_tests;
mod intercept;
mod kick;
mod limits;
mod router;
mod state;
mod subscribe;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod tests_auth;
mod timers;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::slots::Slots;

use bytes::BytesMut;

pub use acl::Permissions;
pub use auth::{AccessEvent, AuthRequest};
pub use cluster::{PeerId, PeerStats};
pub use cluster_replicas::{ReplicaStats, THIS_NODE};
pub use cluster_sessions::ClaimStats;
pub use cluster_wills::WillStats;
pub use config::{Config, Value};
pub use durable::{RestoreSummary, StoreOp};
pub use intercept::{Intercepted, Verdict};
pub use limits::{FEED_HOLD, FEED_PUBLISHER};
pub use state::{ConnId, SessionId};

use crate::codec::{self, Ack, Disconnect, Packet, Properties, Protocol};
use crate::topics::{RetainedTree, SubscriptionIndex};
use state::{Conn, ConnState, Message, Session};

/// `drain`'s close argument: keep the connection open.
pub const CLOSE_NO: u8 = 0;
/// Close once `data` is written: the client asked to (DISCONNECT).
pub const CLOSE_NOW: u8 = 1;
/// Close on the broker's initiative: write `data`, half-close and read until the client
/// closes (or a short linger passes), so the client reads why instead of a reset.
pub const CLOSE_LINGER: u8 = 2;

/// Reads up to this many bytes give their emptied read buffer back (see `feed`).
const RX_RELEASE_BELOW: usize = 4096;

/// Counters for `$SYS` and metrics.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub messages_received: u64,
    pub messages_sent: u64,
    pub bytes_received: u64,
    pub bytes_sent: u64,
    pub publish_dropped: u64,
    pub clients_connected: u64,
    /// Publishes refused by permissions or by an interceptor.
    pub publish_denied: u64,
    /// Subscriptions refused by permissions.
    pub subscribe_denied: u64,
    /// CONNECTs refused (CONNACK with an error code, or closed before CONNACK).
    pub connections_refused: u64,
    /// Access events dropped because the caller did not take them.
    pub access_events_dropped: u64,
}

/// A log event for the caller: (kind, client id, detail).
pub type Event = (&'static str, Arc<str>, String);

pub struct Engine {
    cfg: Config,
    conns: Slots<Conn>,
    free_conns: Vec<ConnId>,
    sessions: Slots<Session>,
    free_sessions: Vec<SessionId>,
    by_client: HashMap<Arc<str>, SessionId>,
    subs: SubscriptionIndex<SessionId>,
    retained: RetainedTree<Arc<Message>>,
    /// Connections with output or a close request since the last `drain`.
    dirty: Vec<ConnId>,
    /// Where `close_all` sends MQTT 5 clients (DISCONNECT 0x9C), if anywhere.
    server_reference: Option<String>,
    /// Sessions whose queue pump stopped at PUMP_BUDGET and goes on after the next drain.
    pending_pump: Vec<SessionId>,
    /// The latest time the caller gave; drain has no clock of its own.
    last_now: u64,
    /// After a pause of this process (`observe_time`), and from a store failure until a
    /// while after it works again (`store_failed`, `cluster_store_recovered`; `u64::MAX`
    /// meanwhile), CONNECTs are refused and no session is taken over from a copy until
    /// then, or until the map changes from `out_of_touch_map`.
    out_of_touch_until: u64,
    out_of_touch_map: u64,
    events: Vec<Event>,
    stats: Stats,
    assigned_ids: u64,
    last_purge: u64,
    scratch: router::RouteScratch,
    /// Store operations not yet taken by the caller (`take_store_ops`).
    store_ops: Vec<durable::StoreOp>,
    /// Connections whose QoS 1/2 publishes produced operations since the last take, and
    /// those of the batch last taken (disconnected if its write fails).
    batch_publishers: Vec<ConnId>,
    unconfirmed_publishers: Vec<ConnId>,
    /// Wall-clock ms minus monotonic ms.
    wall_offset: i64,
    /// QoS 1/2 deliveries dropped because a session's queue was full (for 0x97).
    quota_drops: u64,
    /// Records being read back at start-up.
    restoring: Option<Box<durable::Restoring>>,
    /// Connections ever opened: the next connection's serial.
    serials: u64,
    /// Connections in state Active.
    active_conns: usize,
    /// Connections the caller was told to stop reading (FEED_HOLD).
    held: Vec<ConnId>,
    /// Held connections that may be read again, not yet taken.
    resumed: Vec<ConnId>,
    auth_requests: Vec<auth::AuthRequest>,
    /// Closed connection ids kept from reuse until their authentication answer (or a
    /// deadline, ms).
    quarantine: Vec<(ConnId, u64)>,
    access_events: VecDeque<auth::AccessEvent>,
    intercepted: intercept::InterceptQueue,
    cluster: cluster::Cluster,
    claims: cluster_sessions::Claims,
    registry: cluster_registry::Registry,
    replicas: cluster_replicas::Replicas,
    wills: cluster_wills::Wills,
    kept_scans: cluster_kept_store::KeptScans,
    gates: cluster_gates::Gates,
}

impl Engine {
    pub fn new(cfg: Config) -> Engine {
        Engine {
            cfg,
            conns: Slots::new(),
            free_conns: Vec::new(),
            sessions: Slots::new(),
            free_sessions: Vec::new(),
            by_client: HashMap::new(),
            subs: SubscriptionIndex::new(),
            retained: RetainedTree::new(),
            dirty: Vec::new(),
            server_reference: None,
            pending_pump: Vec::new(),
            last_now: 0,
            out_of_touch_until: 0,
            out_of_touch_map: 0,
            events: Vec::new(),
            stats: Stats::default(),
            assigned_ids: 0,
            last_purge: 0,
            scratch: router::RouteScratch::default(),
            store_ops: Vec::new(),
            batch_publishers: Vec::new(),
            unconfirmed_publishers: Vec::new(),
            wall_offset: 0,
            restoring: None,
            quota_drops: 0,
            serials: 0,
            active_conns: 0,
            held: Vec::new(),
            resumed: Vec::new(),
            auth_requests: Vec::new(),
            quarantine: Vec::new(),
            access_events: VecDeque::new(),
            intercepted: intercept::InterceptQueue::default(),
            cluster: cluster::Cluster::default(),
            claims: cluster_sessions::Claims::default(),
            registry: cluster_registry::Registry::default(),
            replicas: cluster_replicas::Replicas::default(),
            wills: cluster_wills::Wills::default(),
            kept_scans: cluster_kept_store::KeptScans::default(),
            gates: cluster_gates::Gates::default(),
        }
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    /// A new network connection.
    pub fn open(&mut self, now: u64) -> ConnId {
        self.observe_time(now);
        let mut conn = Conn::new(now);
        self.serials += 1;
        conn.serial = self.serials;
        match self.free_conns.pop() {
            Some(id) => {
                self.conns.set(id as usize, conn);
                id
            }
            None => self.conns.push(conn) as ConnId,
        }
    }

    /// Bytes read from `id`: decodes and handles every whole packet in them, unless a limit
    /// makes the connection wait. Returns FEED_HOLD (stop reading `id` until `take_resumed`
    /// lists it) and FEED_PUBLISHER (it has sent a PUBLISH) bits.
    pub fn feed(&mut self, id: ConnId, data: &[u8], now: u64) -> u8 {
        self.observe_time(now);
        let Some(conn) = self.conn_mut(id) else {
            return 0;
        };
        if conn.state == ConnState::Closing {
            return 0;
        }
        conn.rx.extend_from_slice(data);
        self.stats.bytes_received += data.len() as u64;
        let flags = self.run(id, now);
        if data.len() <= RX_RELEASE_BELOW {
            if let Some(conn) = self.conn_mut(id) {
                if conn.rx.is_empty() {
                    // The buffer would stay allocated (with its shared header) for as long as
                    // the client idles. Busy readers with big reads keep theirs for reuse.
                    conn.rx = BytesMut::new();
                }
            }
        }
        flags
    }

    /// The connection is gone: closed by the peer, or by the caller after `drain` asked. An
    /// end the engine did not ask for is logged as "connection lost".
    pub fn closed(&mut self, id: ConnId, now: u64) {
        self.closed_because(id, now, None)
    }

    /// `closed`, with the access log's reason for the end.
    pub fn closed_because(&mut self, id: ConnId, now: u64, why: Option<&str>) {
        self.last_now = now;
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        let why = why.unwrap_or("connection lost");
        match conn.state {
            ConnState::Closing => {}
            ConnState::Active => {
                self.access("disconnect", id, 0, why);
                self.active_conns -= 1;
                // Not a close the engine asked for: an abnormal disconnect (will is published).
                self.disconnect_session(id, true, now);
            }
            ConnState::AwaitAuth | ConnState::AuthContinue => {
                self.stats.connections_refused += 1;
                self.access("refused", id, 0, why);
            }
            ConnState::AwaitConnect => {}
            ConnState::AwaitClaim => self.claim_conn_closed(id),
        }
        self.drop_hold(id);
        let outstanding = self.conn(id).is_some_and(|c| c.auth_outstanding);
        // Keep the slot out of `dirty` handling: drain skips empty slots.
        self.conns.take(id as usize);
        self.quarantine_or_free(id, outstanding, now);
    }

    /// The broker is stopping: every connection is closed, MQTT 5 clients first getting
    /// DISCONNECT 0x8B. Wills are published, as for any end the client did not ask for.
    pub fn close_all(&mut self, detail: &str, server_reference: Option<&str>, now: u64) {
        self.last_now = now;
        self.server_reference = server_reference.map(str::to_owned);
        // 0x9C "use another server" where there is one to name, else "server shutting down".
        let code = if server_reference.is_some() {
            0x9C
        } else {
            0x8B
        };
        for id in 0..self.conns.len() as ConnId {
            match self.conn(id).map(|c| c.state) {
                Some(ConnState::Active) => self.close(id, Some(code), detail, true, now),
                Some(ConnState::Closing) | None => {}
                Some(_) => self.stop_reading_and_close(id),
            }
        }
    }

    /// The transport's write buffer went above (false) or back below (true) its high mark.
    pub fn set_writable(&mut self, id: ConnId, writable: bool, now: u64) {
        self.last_now = now;
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        conn.writable = writable;
        if writable {
            if let Some(sid) = conn.session {
                self.pump(sid, now);
            }
        }
    }

    /// A message from the broker itself (e.g. `$SYS`).
    pub fn publish(
        &mut self,
        topic: &str,
        payload: &[u8],
        qos: codec::QoS,
        retain: bool,
        now: u64,
    ) {
        let msg = Message {
            topic: bytes::Bytes::copy_from_slice(topic.as_bytes()),
            payload: bytes::Bytes::copy_from_slice(payload),
            qos,
            retain,
            props: None,
            expires_at: None,
            origin: state::BROKER_ORIGIN,
            id: 0,
        };
        self.route(Arc::new(msg), now);
    }

    /// Output for connections (`drain`) or for other nodes (`drain_cluster`).
    pub fn has_output(&self) -> bool {
        !self.dirty.is_empty() || self.has_cluster_output()
    }

    /// Calls `f(conn, bytes, close)` for every connection with output or a close request;
    /// `close` is CLOSE_NO, CLOSE_NOW (the client asked) or CLOSE_LINGER (the broker ends it).
    pub fn drain(&mut self, mut f: impl FnMut(ConnId, &[u8], u8)) {
        let dirty = std::mem::take(&mut self.dirty);
        for &id in &dirty {
            if let Some(conn) = self.conns.get_mut(id as usize) {
                conn.dirty = false;
                let close = match (conn.close_after_write, conn.client_closed) {
                    (false, _) => CLOSE_NO,
                    (true, true) => CLOSE_NOW,
                    (true, false) => CLOSE_LINGER,
                };
                if let Some(open) = self.gates.open_len(id, conn.serial) {
                    if close == CLOSE_NO {
                        // Held output stays until its copies are acknowledged (cluster_gates).
                        if open > 0 {
                            self.stats.bytes_sent += open as u64;
                            f(id, &conn.out[..open], close);
                            conn.out.drain(..open);
                            self.gates.written(id, open);
                        }
                        continue;
                    }
                    // Closing: what was held is not sent (the session resumes from its state).
                    conn.out.truncate(open);
                    self.gates.drop_conn(id);
                }
                self.stats.bytes_sent += conn.out.len() as u64;
                f(id, &conn.out, close);
                conn.out.clear();
                // A large burst should not pin its peak buffer for the connection's lifetime.
                if conn.out.capacity() > 1 << 20 {
                    conn.out.shrink_to(64 * 1024);
                }
            }
        }
        let mut dirty = dirty;
        dirty.clear();
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
        // Pumps that stopped at their budget go on now; their output is for the next drain
        // (`has_output` tells the caller there is one).
        let pending = std::mem::take(&mut self.pending_pump);
        for sid in pending {
            if let Some(session) = self.session_mut(sid) {
                session.pump_pending = false;
                self.pump(sid, self.last_now);
            }
        }
    }

    pub fn take_events(&mut self) -> Vec<Event> {
        std::mem::take(&mut self.events)
    }

    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.clients_connected = self.sessions.values().filter(|s| s.conn.is_some()).count() as u64;
        s
    }

    pub fn session_count(&self) -> usize {
        self.by_client.len()
    }

    pub fn subscription_count(&self) -> usize {
        self.subs.len()
    }

    pub fn retained_count(&self) -> usize {
        self.retained.len()
    }

    pub fn inflight_count(&self) -> usize {
        self.sessions.values().map(|s| s.inflight.len()).sum()
    }

    pub fn queued_count(&self) -> usize {
        self.sessions.values().map(|s| s.queue.len()).sum()
    }

    /// Payload bytes queued across sessions (a scan, like `queued_count`).
    pub fn queued_bytes(&self) -> usize {
        self.sessions.values().map(|s| s.queued_bytes).sum()
    }

    /// Connections the caller was told to stop reading, not yet resumed.
    pub fn held_count(&self) -> usize {
        self.held.len()
    }

    /// Intercepted publishes waiting for `release`.
    pub fn intercepted_count(&self) -> usize {
        self.intercepted.len()
    }

    /// Connections whose authentication is not yet decided (re-authentications included).
    pub fn auth_pending_count(&self) -> usize {
        self.conns
            .values()
            .filter(|c| {
                matches!(c.state, ConnState::AwaitAuth | ConnState::AuthContinue)
                    || c.auth.as_ref().is_some_and(|a| a.reauth)
            })
            .count()
    }

    // ---- internals shared by the handler files ----

    fn conn_mut(&mut self, id: ConnId) -> Option<&mut Conn> {
        self.conns.get_mut(id as usize)
    }

    fn conn(&self, id: ConnId) -> Option<&Conn> {
        self.conns.get(id as usize)
    }

    fn session_mut(&mut self, sid: SessionId) -> Option<&mut Session> {
        self.sessions.get_mut(sid as usize)
    }

    fn session(&self, sid: SessionId) -> Option<&Session> {
        self.sessions.get(sid as usize)
    }

    fn mark_dirty(&mut self, id: ConnId) {
        if let Some(conn) = self.conns.get_mut(id as usize) {
            if !conn.dirty {
                conn.dirty = true;
                self.dirty.push(id);
            }
        }
    }

    /// Encodes `packet` onto `id`'s output. Returns false (and writes nothing) when the
    /// packet is larger than the client's Maximum Packet Size.
    fn send(&mut self, id: ConnId, packet: &Packet) -> bool {
        let Some(conn) = self.conns.get_mut(id as usize) else {
            return false;
        };
        let start = conn.out.len();
        if codec::encode(packet, conn.protocol, &mut conn.out).is_err()
            || conn.out.len() - start > conn.client_max_packet as usize
        {
            conn.out.truncate(start);
            return false;
        }
        self.mark_dirty(id);
        true
    }

    fn event(&mut self, kind: &'static str, client: Arc<str>, detail: String) {
        // Bounded so a caller that never reads events cannot grow memory without end.
        if self.events.len() < 10_000 {
            self.events.push((kind, client, detail));
        }
    }

    /// Closes `id` on the broker's initiative: MQTT 5 clients first get DISCONNECT with
    /// `reason` (if any). `abnormal` decides whether the will is published.
    fn close(&mut self, id: ConnId, reason: Option<u8>, detail: &str, abnormal: bool, now: u64) {
        self.close_logged(id, reason, reason.unwrap_or(0), detail, abnormal, now);
    }

    /// Closes `id` with 0x8E and without its will: what it stood for lives on, or was
    /// published, on another node (the cluster's parts).
    fn close_for_another_node(&mut self, id: ConnId, detail: &str, now: u64) {
        if let Some(c) = self.conn_mut(id) {
            c.will = None;
        }
        self.close(id, Some(0x8E), detail, false, now);
    }

    /// `close`, with the reason code the access log records (a client's DISCONNECT code).
    fn close_logged(
        &mut self,
        id: ConnId,
        reason: Option<u8>,
        access_code: u8,
        detail: &str,
        abnormal: bool,
        now: u64,
    ) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        let state = conn.state;
        if state == ConnState::Closing {
            return;
        }
        let was_active = state == ConnState::Active;
        if was_active {
            self.access("disconnect", id, access_code, detail);
        } else {
            self.stats.connections_refused += 1;
            self.access("refused", id, access_code, detail);
        }
        let conn = self.conn_mut(id).expect("checked");
        let protocol = conn.protocol;
        let client = conn.client_id.clone();
        if let (Some(code), Protocol::V5, true) = (reason, protocol, was_active) {
            let mut properties = Properties::default();
            if conn.problem_info && !detail.is_empty() {
                properties.reason_string = Some(detail.to_string());
            }
            if code == 0x9C {
                properties
                    .server_reference
                    .clone_from(&self.server_reference);
            }
            self.send(
                id,
                &Packet::Disconnect(Disconnect {
                    reason_code: code,
                    properties: properties.into_boxed(),
                }),
            );
        }
        if was_active {
            self.disconnect_session(id, abnormal, now);
        }
        if !detail.is_empty() {
            self.event("disconnect", client, detail.to_string());
        }
        self.stop_reading_and_close(id);
    }

    /// Ignores further input from `id` and asks the caller to close it once its output is
    /// written.
    fn stop_reading_and_close(&mut self, id: ConnId) {
        let Some(conn) = self.conns.get_mut(id as usize) else {
            return;
        };
        if conn.state == ConnState::Active {
            self.active_conns -= 1;
        }
        conn.state = ConnState::Closing;
        conn.close_after_write = true;
        conn.rx.clear();
        self.drop_hold(id);
        self.mark_dirty(id);
    }

    /// The decoder found a broken stream: MQTT 5 gets the reason code, then the close.
    fn decode_failed(&mut self, id: ConnId, err: codec::DecodeError, level: Option<u8>, now: u64) {
        let Some(conn) = self.conn(id) else { return };
        if conn.state == ConnState::AwaitConnect {
            self.connect_decode_failed(id, err, level);
            return;
        }
        let detail = format!("{err:?}");
        self.event("protocol_error", conn.client_id.clone(), detail.clone());
        self.close(id, Some(err.reason_code()), &detail, true, now);
    }

    /// Detaches the session from connection `id`. An abnormal end publishes the will (now, or
    /// after its delay); a session with expiry 0 ends here.
    fn disconnect_session(&mut self, id: ConnId, abnormal: bool, now: u64) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        let will = conn.will.take();
        let Some(sid) = conn.session.take() else {
            return;
        };
        let Some(session) = self.session_mut(sid) else {
            return;
        };
        if session.conn != Some(id) {
            return;
        }
        session.conn = None;
        session.disconnected_at = Some(now);
        let expiry = session.expiry;
        let copied = session.stamp.is_some();
        // Out of touch with another node, which may have published it meanwhile (in a
        // cluster): kept until in touch (a persistent session's as a will due now).
        let wait = abnormal && will.is_some() && self.wills_wait(now);
        let kept = wait && expiry == 0 && will.as_deref().is_some_and(|w| self.keep_will(sid, w));
        let will = if kept { None } else { will };
        self.will_ended(sid);
        if let (true, Some(will)) = (abnormal, will) {
            let delay = will.properties.will_delay_interval.unwrap_or(0);
            if expiry == 0 || (delay == 0 && !(wait && copied)) {
                self.publish_will(*will, sid, now);
            } else {
                let at = now + 1000 * u64::from(delay.min(expiry));
                self.session_mut(sid)
                    .expect("exists")
                    .rare_mut()
                    .pending_will = Some((will, at));
            }
        }
        if expiry == 0 {
            self.end_session(sid, now);
        } else {
            self.persist_session(sid, now);
        }
    }

    fn publish_will(&mut self, will: codec::LastWill, origin: SessionId, now: u64) {
        let mut props = will.properties;
        props.will_delay_interval = None;
        let expires_at = props
            .message_expiry_interval
            .map(|s| now + 1000 * u64::from(s));
        let msg = Message {
            topic: bytes::Bytes::from(will.topic.into_bytes()),
            payload: will.payload,
            qos: will.qos,
            retain: will.retain,
            props: router::forwarded_props(Box::new(props)),
            expires_at,
            origin,
            id: 0,
        };
        self.route(Arc::new(msg), now);
    }

    /// Removes a session and all its subscriptions; a pending will goes out first.
    fn end_session(&mut self, sid: SessionId, now: u64) {
        self.unpersist_session(sid);
        let Some(session) = self.remove_session(sid) else {
            return;
        };
        if let Some((will, _)) = session.rare.and_then(|r| r.pending_will) {
            self.publish_will(*will, state::BROKER_ORIGIN, now);
        }
    }

    /// Takes session `sid` out of the engine with its subscriptions (not its records).
    fn remove_session(&mut self, sid: SessionId) -> Option<Session> {
        self.will_ended(sid);
        let session = self.sessions.take(sid as usize)?;
        for filter in session.subs.keys() {
            self.index_unsubscribe(filter, sid);
        }
        self.claims.forget(sid);
        self.replicas.forget(sid);
        // A session handed to another node no longer owns its id here.
        if self.by_client.get(&session.client_id) == Some(&sid) {
            self.by_client.remove(&session.client_id);
            self.registry_note(&session.client_id);
        }
        self.free_sessions.push(sid);
        Some(session)
    }

    fn handle(&mut self, id: ConnId, packet: Packet, now: u64) {
        let state = self.conn(id).map(|c| c.state);
        match state {
            Some(ConnState::AwaitConnect) => {
                match packet {
                    Packet::Connect(connect) => self.handle_connect(id, connect, now),
                    // Anything before CONNECT: close without a word (MQTT-3.1.0-1).
                    _ => self.close(id, None, "packet before CONNECT", false, now),
                }
                return;
            }
            Some(ConnState::AuthContinue) => {
                // Only AUTH or DISCONNECT may come during the exchange (MQTT 5 4.12).
                match packet {
                    Packet::Auth(a) => self.handle_auth(id, a, now),
                    Packet::Disconnect(_) => {
                        self.close(id, None, "disconnected during authentication", false, now)
                    }
                    _ => self.refuse(id, 0x82, "packet other than AUTH during authentication"),
                }
                return;
            }
            _ => {}
        }
        match packet {
            Packet::Publish(publish) => self.handle_publish(id, publish, now),
            Packet::PubAck(ack) => self.handle_puback(id, ack, now),
            Packet::PubRec(ack) => self.handle_pubrec(id, ack, now),
            Packet::PubRel(ack) => self.handle_pubrel(id, ack),
            Packet::PubComp(ack) => self.handle_pubcomp(id, ack, now),
            Packet::Subscribe(sub) => self.handle_subscribe(id, sub, now),
            Packet::Unsubscribe(unsub) => self.handle_unsubscribe(id, unsub),
            Packet::PingReq => {
                self.send(id, &Packet::PingResp);
            }
            Packet::Disconnect(d) => self.handle_disconnect(id, d, now),
            Packet::Connect(_) => {
                self.close(id, Some(0x82), "second CONNECT", true, now);
            }
            Packet::Auth(a) => self.handle_auth(id, a, now),
            Packet::ConnAck(_) | Packet::SubAck(_) | Packet::UnsubAck(_) | Packet::PingResp => {
                self.close(id, Some(0x82), "server-only packet from client", true, now);
            }
        }
    }

    fn handle_disconnect(&mut self, id: ConnId, d: Disconnect, now: u64) {
        let Some(conn) = self.conn(id) else { return };
        if let (Some(sid), Some(new_expiry)) = (conn.session, d.props().session_expiry_interval) {
            let max = self.cfg.max_session_expiry;
            if let Some(session) = self.session_mut(sid) {
                if session.expiry == 0 && new_expiry != 0 {
                    // MQTT-3.14.2-2: cannot turn a non-persistent session persistent here.
                    self.close(
                        id,
                        Some(0x82),
                        "session expiry set on DISCONNECT",
                        true,
                        now,
                    );
                    return;
                }
                session.expiry = new_expiry.min(max);
            }
        }
        // 0x04 = "disconnect with will message".
        let with_will = d.reason_code == 0x04;
        let detail = format!("client DISCONNECT 0x{:02x}", d.reason_code);
        self.close_logged(id, None, d.reason_code, &detail, with_will, now);
        if let Some(conn) = self.conn_mut(id) {
            conn.client_closed = true;
        }
    }

    /// PUBACK/PUBREC/PUBREL/PUBCOMP encoding helper.
    fn ack(pkid: u16, reason_code: u8) -> Ack {
        Ack {
            pkid,
            reason_code,
            properties: None,
        }
    }
}
