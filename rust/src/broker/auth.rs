//! Authentication decided by the caller: a CONNECT (and the AUTH packets of an MQTT 5
//! enhanced-authentication exchange, and re-authentication) becomes a request; the caller
//! answers with `auth_done` or `auth_continue`. Also the access log of connects and
//! disconnects, and permission changes.

use std::collections::VecDeque;
use std::sync::Arc;

use bytes::Bytes;

use super::acl::{self, Permissions};
use super::connect::PendingConnect;
use super::state::{ConnId, ConnState};
use super::Engine;
use crate::codec::{Auth, Packet, Properties, Protocol};

/// Authentication state of one connection.
#[derive(Debug, Default)]
pub struct AuthState {
    /// The checked CONNECT waiting for the decision; None once accepted.
    pub pending: Option<Box<PendingConnect>>,
    /// The enhanced-authentication method of the CONNECT, if any (AUTH must repeat it).
    pub method: Option<String>,
    /// A re-authentication (AUTH 0x19) is in progress.
    pub reauth: bool,
    /// During re-authentication: the broker sent AUTH 0x18 and waits for the client's.
    pub awaiting_client: bool,
}

/// A question for the caller: may this client connect (or go on)?
#[derive(Debug, Clone)]
pub struct AuthRequest {
    pub conn: ConnId,
    /// "connect", "auth" (the client's AUTH 0x18 answer) or "reauth" (AUTH 0x19).
    pub kind: &'static str,
    pub client_id: Arc<str>,
    pub username: Option<Arc<str>>,
    pub password: Option<Bytes>,
    pub protocol_level: u8,
    pub auth_method: Option<String>,
    pub auth_data: Option<Bytes>,
}

/// An access-log entry: (kind, conn, client id, username, protocol level, reason code, reason).
pub type AccessEvent = (
    &'static str,
    ConnId,
    Arc<str>,
    Option<Arc<str>>,
    u8,
    u8,
    String,
);

/// Access events kept for a caller that does not read them; the oldest go first.
const MAX_ACCESS_EVENTS: usize = 100_000;

/// How long a connection id whose authentication request is unanswered stays out of reuse
/// after the connection closed, so a late answer cannot apply to a new connection.
const QUARANTINE_MS: u64 = 60_000;

/// The 3.1.1 CONNACK return code's MQTT 5 counterpart for a refusal with `code`: 3.1.1 has
/// only "bad credentials" (4), "not authorized" (5), "bad protocol" (1), "bad client id" (2);
/// anything else reads as "server unavailable" (3). The encoder maps the result.
fn v311_refusal(code: u8) -> u8 {
    match code {
        0x84..=0x87 => code,
        _ => 0x89,
    }
}

impl Engine {
    pub fn has_auth_requests(&self) -> bool {
        !self.auth_requests.is_empty()
    }

    pub fn take_auth_requests(&mut self) -> Vec<AuthRequest> {
        std::mem::take(&mut self.auth_requests)
    }

    /// Queues a request about `id` (which must exist) for the caller.
    pub(super) fn request_auth(
        &mut self,
        id: ConnId,
        kind: &'static str,
        password: Option<Bytes>,
        method: Option<String>,
        data: Option<Bytes>,
    ) {
        let conn = self.conn_mut(id).expect("caller checked");
        conn.auth_outstanding = true;
        let request = AuthRequest {
            conn: id,
            kind,
            client_id: conn.client_id.clone(),
            username: conn.username.clone(),
            password,
            protocol_level: conn.protocol.level(),
            auth_method: method,
            auth_data: data,
        };
        self.auth_requests.push(request);
    }

    /// A connection id closed with a request outstanding is freed when the answer comes.
    /// Returns true if `id` was such an id (the answer is then ignored).
    fn answer_for_closed(&mut self, id: ConnId) -> bool {
        if self.conn(id).is_some() {
            return false;
        }
        if let Some(i) = self.quarantine.iter().position(|&(q, _)| q == id) {
            self.quarantine.swap_remove(i);
            self.free_conns.push(id);
        }
        true
    }

    /// Keeps `id` (just closed) out of reuse while its authentication request is unanswered.
    pub(super) fn quarantine_or_free(&mut self, id: ConnId, outstanding: bool, now: u64) {
        if outstanding {
            self.quarantine.push((id, now + QUARANTINE_MS));
        } else {
            self.free_conns.push(id);
        }
    }

    pub(super) fn expire_quarantine(&mut self, now: u64) {
        if self.quarantine.is_empty() {
            return;
        }
        let mut i = 0;
        while i < self.quarantine.len() {
            if now >= self.quarantine[i].1 {
                let (id, _) = self.quarantine.swap_remove(i);
                self.free_conns.push(id);
            } else {
                i += 1;
            }
        }
    }

    /// The caller's decision about `id`'s pending request. `reason_code` 0 accepts (the
    /// CONNECT goes on: takeover, session, CONNACK carrying `method`/`data`; or a
    /// re-authentication succeeds with AUTH 0x00), any other code refuses (CONNACK with it,
    /// or DISCONNECT for a re-authentication). `permissions` replaces the connection's.
    #[allow(clippy::too_many_arguments)]
    pub fn auth_done(
        &mut self,
        id: ConnId,
        reason_code: u8,
        permissions: Option<Arc<Permissions>>,
        now: u64,
        method: Option<String>,
        data: Option<Bytes>,
        reason: Option<String>,
    ) {
        self.last_now = now;
        if self.answer_for_closed(id) {
            return;
        }
        let conn = self.conn_mut(id).expect("checked");
        conn.auth_outstanding = false;
        match conn.state {
            ConnState::AwaitAuth | ConnState::AuthContinue => {
                let Some(pending) = conn.auth.as_mut().and_then(|a| a.pending.take()) else {
                    return;
                };
                if reason_code != 0 {
                    let why = reason.as_deref().unwrap_or("not authorized");
                    return self.refuse_auth(id, reason_code, reason.as_deref(), why);
                }
                if let (Some(p), Some(will)) = (&permissions, &pending.connect.will) {
                    if !p.allows(acl::PUBLISH, will.topic.as_bytes()) {
                        return self.refuse(id, 0x87, "will topic not authorized");
                    }
                }
                if self.at_connection_limit(&pending.client_id) {
                    return self.refuse(id, 0x97, "max_connections reached");
                }
                let conn = self.conn_mut(id).expect("checked");
                conn.permissions = permissions;
                if conn.auth.as_ref().is_some_and(|a| a.method.is_none()) {
                    conn.auth = None;
                }
                self.accept_connect(id, *pending, method, data, now);
                // What the client sent while waiting is handled now.
                self.run(id, now);
            }
            ConnState::Active if conn.auth.as_ref().is_some_and(|a| a.reauth) => {
                let auth = conn.auth.as_mut().expect("checked");
                auth.reauth = false;
                auth.awaiting_client = false;
                let kept_method = auth.method.clone();
                if reason_code != 0 {
                    let why = reason.unwrap_or_else(|| "re-authentication failed".into());
                    return self.close(id, Some(reason_code), &why, true, now);
                }
                conn.permissions = permissions;
                self.refresh_read_check(id);
                self.send_auth(id, 0x00, method.or(kept_method), data, None);
            }
            _ => {}
        }
    }

    /// Asks the client of `id` for another step of enhanced authentication: AUTH 0x18 with
    /// `method` and `data`; its AUTH answer becomes an "auth" request.
    pub fn auth_continue(&mut self, id: ConnId, method: String, data: Option<Bytes>, now: u64) {
        self.last_now = now;
        if self.answer_for_closed(id) {
            return;
        }
        let conn = self.conn_mut(id).expect("checked");
        conn.auth_outstanding = false;
        let has_method = conn.auth.as_ref().is_some_and(|a| a.method.is_some());
        match conn.state {
            ConnState::AwaitAuth => {
                if conn.protocol != Protocol::V5 || !has_method {
                    // No AUTH packet exists for this client (MQTT 5 4.12: only after a
                    // CONNECT with an Authentication Method).
                    return self.refuse(id, 0x8C, "no enhanced authentication in this CONNECT");
                }
                conn.state = ConnState::AuthContinue;
                self.send_auth(id, 0x18, Some(method), data, None);
                // Its answer is decoded (it may already be buffered).
                self.run(id, now);
            }
            ConnState::Active
                if conn
                    .auth
                    .as_ref()
                    .is_some_and(|a| a.reauth && !a.awaiting_client) =>
            {
                conn.auth.as_mut().expect("checked").awaiting_client = true;
                self.send_auth(id, 0x18, Some(method), data, None);
            }
            _ => {}
        }
    }

    fn send_auth(
        &mut self,
        id: ConnId,
        reason_code: u8,
        method: Option<String>,
        data: Option<Bytes>,
        reason: Option<String>,
    ) {
        let properties = Properties {
            authentication_method: method,
            authentication_data: data,
            reason_string: reason,
            ..Properties::default()
        };
        self.send(
            id,
            &Packet::Auth(Auth {
                reason_code,
                properties: properties.into_boxed(),
            }),
        );
    }

    /// A refusal decided by the caller: its MQTT 5 code, the nearest 3.1.1 return code, a
    /// reason string only when given and wanted.
    fn refuse_auth(&mut self, id: ConnId, code: u8, reason_string: Option<&str>, why: &str) {
        let Some(conn) = self.conn(id) else { return };
        let wire_code = if conn.protocol == Protocol::V5 {
            code
        } else {
            v311_refusal(code)
        };
        self.refuse_with(id, wire_code, code, reason_string, why);
    }

    /// An AUTH packet from the client (MQTT 5).
    pub(super) fn handle_auth(&mut self, id: ConnId, a: Auth, now: u64) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        let method = a.props().authentication_method.clone();
        let data = a.props().authentication_data.clone();
        let state = conn.state;
        let Some(auth) = conn.auth.as_mut().filter(|a| a.method.is_some()) else {
            // No enhanced authentication was started by this client's CONNECT.
            return match state {
                ConnState::Active => self.close(id, Some(0x82), "unexpected AUTH", true, now),
                _ => self.refuse(id, 0x82, "unexpected AUTH"),
            };
        };
        let same_method = method.is_some() && method == auth.method;
        match (state, a.reason_code) {
            (ConnState::AuthContinue, 0x18) => {
                if !same_method {
                    return self.refuse(id, 0x8C, "authentication method changed");
                }
                conn.state = ConnState::AwaitAuth;
                self.request_auth(id, "auth", None, method, data);
            }
            (ConnState::AuthContinue, _) => {
                self.refuse(id, 0x82, "AUTH reason code not Continue authentication")
            }
            (ConnState::Active, 0x19) if !auth.reauth => {
                if !same_method {
                    return self.close(id, Some(0x8C), "authentication method changed", true, now);
                }
                auth.reauth = true;
                self.request_auth(id, "reauth", None, method, data);
            }
            (ConnState::Active, 0x18) if auth.reauth && auth.awaiting_client => {
                if !same_method {
                    return self.close(id, Some(0x8C), "authentication method changed", true, now);
                }
                auth.awaiting_client = false;
                self.request_auth(id, "auth", None, method, data);
            }
            _ => self.close(id, Some(0x82), "unexpected AUTH", true, now),
        }
    }

    /// Replaces what `id` may do from now on (new publishes and subscribes; deliveries are
    /// checked against the new READ rules).
    pub fn set_permissions(&mut self, id: ConnId, permissions: Option<Arc<Permissions>>) {
        let Some(conn) = self.conn_mut(id) else {
            return;
        };
        conn.permissions = permissions;
        self.refresh_read_check(id);
    }

    /// Recomputes whether the session of `id` needs a READ check per delivered message: some
    /// subscription reaches outside the connection's READ rules.
    pub(super) fn refresh_read_check(&mut self, id: ConnId) {
        let Some(conn) = self.conn(id) else { return };
        let Some(sid) = conn.session else { return };
        let perms = conn.permissions.clone();
        let Some(session) = self.session_mut(sid) else {
            return;
        };
        let perms = perms.filter(|p| {
            session
                .subs
                .keys()
                .any(|filter| !p.covers(acl::READ, filter))
        });
        session.set_read_check(perms);
    }

    // ---- access log ----

    /// Records an access event about `id` (which must still exist).
    pub(super) fn access(&mut self, kind: &'static str, id: ConnId, code: u8, reason: &str) {
        let Some(conn) = self.conn(id) else { return };
        // A connection that never sent a CONNECT has no protocol level yet.
        let level = if conn.connect_seen {
            conn.protocol.level()
        } else {
            0
        };
        let event = (
            kind,
            id,
            conn.client_id.clone(),
            conn.username.clone(),
            level,
            code,
            reason.to_string(),
        );
        self.push_access(event);
    }

    pub(super) fn push_access(&mut self, event: AccessEvent) {
        if self.access_events.len() >= MAX_ACCESS_EVENTS {
            self.access_events.pop_front();
            self.stats.access_events_dropped += 1;
        }
        self.access_events.push_back(event);
    }

    pub fn has_access_events(&self) -> bool {
        !self.access_events.is_empty()
    }

    pub fn take_access_events(&mut self) -> VecDeque<AccessEvent> {
        std::mem::take(&mut self.access_events)
    }
}
